"""The fixed cost of a decode step: the benchmark model against its structural twin with tiny widths.

    python bench/overhead_floor.py --batch 1 8 --dtype float32 bfloat16 --threads 2

The twin has the benchmark checkpoint's structure — 8 layers, 16 heads, 4 routed experts top-2 + 1 shared,
the first layer dense — but hidden 64, latent 32 + 16, heads 16 + 16 wide, experts 32 wide and a vocabulary
of 1,000, so its arithmetic and weight traffic are negligible and its decode step is the floor that the
same sequence of operator calls costs: Python, torch's dispatcher, oneDNN's per-call set-up, OpenMP fork/join.
The difference to the real model's step is what the arithmetic and the memory traffic cost.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from peer_checkpoint import CONFIG, build_checkpoint, make_prompts

from mla_runtime import LLM, SamplingParams

OUT = Path(__file__).resolve().parent / "out"
TWIN = dict(CONFIG, vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)


def decode_step_ms(path: Path, dtype: str, batch: int, prompt_len: int, steps: int, rounds: int) -> float:
    llm = LLM(str(path), dtype=dtype, max_model_len=prompt_len + (rounds + 1) * steps + 64, max_num_seqs=batch,
              kv_cache_memory="512MiB")
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=(rounds + 1) * steps + 32, temperature=0, ignore_eos=True)
    for i, p in enumerate(make_prompts(batch, prompt_len, vocab, seed=0)):
        engine.add_request(f"floor-{i}", {"prompt_token_ids": p}, params)
    for _ in range(steps):  # prefill, then warm-up decode steps
        engine.step()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        best = min(best, (time.perf_counter() - t0) / steps)
    llm.shutdown()
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    real = build_checkpoint(OUT / "peer_ckpt")
    twin = build_checkpoint(OUT / "peer_twin", config=TWIN)
    print(f"decode step, best of {args.rounds} × {args.steps} steps, {torch.get_num_threads()} threads, "
          f"context {args.prompt_len}+")
    print("| dtype | batch | benchmark model ms | tiny twin ms (fixed cost) | fixed share |")
    print("|---|---:|---:|---:|---:|")
    for dtype in args.dtype:
        for batch in args.batch:
            full = decode_step_ms(real, dtype, batch, args.prompt_len, args.steps, args.rounds)
            floor = decode_step_ms(twin, dtype, batch, args.prompt_len, args.steps, args.rounds)
            print(f"| {dtype} | {batch} | {full:.2f} | {floor:.2f} | {floor / full * 100:.0f}% |")


if __name__ == "__main__":
    main()
