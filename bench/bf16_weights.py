"""Decode speed of a model's weight formats side by side: bfloat16 weights in a float32 model against the formats a
bfloat16 checkpoint can otherwise run in, in interleaved rounds on one machine.

    python bench/bf16_weights.py --batch 1 8 --threads 2 --rounds 3

Formats (the benchmark checkpoint of ``peer_checkpoint.py``): ``bf16 model`` (``dtype="bfloat16"``: oneDNN's bfloat16
products where the CPU has them, else float32 copies), ``f32 model`` (``dtype="float32"``: the weights widened to four
bytes, the compiled decode path), ``f32 + bf16 weights`` (``quantization="bf16"``: the compiled decode path reading two
bytes a weight) and ``f32 + int8 weights`` for reference. Each cell is the median decode tok/s over the rounds (one
engine per format, built once; a round times ``--steps`` decode steps of every format in turn).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from overhead_floor import OUT
from peer_checkpoint import build_checkpoint, make_prompts

from mla_runtime import LLM, SamplingParams

FORMATS = {"bf16 model": dict(dtype="bfloat16"), "f32 model": dict(dtype="float32"),
           "f32 + bf16 weights": dict(dtype="float32", quantization="bf16"),
           "f32 + int8 weights": dict(dtype="float32", quantization="int8")}


def start(path: str, batch: int, prompt_len: int, budget: int, **kw: object) -> LLM:
    llm = LLM(path, max_model_len=prompt_len + budget + 64, max_num_seqs=batch, kv_cache_memory="1GiB", **kw)
    params = SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size
    for i, p in enumerate(make_prompts(batch, prompt_len, vocab, seed=0)):
        llm.engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    for _ in range(4):  # the prefill and warm-up decodes
        llm.engine.step()
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(build_checkpoint(OUT / "peer_ckpt"))
    print(f"decode tok/s, median of {args.rounds} interleaved rounds × {args.steps} steps, {args.threads} threads")
    print("| batch | " + " | ".join(FORMATS) + " |")
    print("|---:|" + "---:|" * len(FORMATS))
    for batch in args.batch:
        budget = (args.rounds + 1) * args.steps + 8
        engines = {name: start(path, batch, args.prompt_len, budget, **kw) for name, kw in FORMATS.items()}
        speeds: dict[str, list[float]] = {name: [] for name in FORMATS}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                t = time.perf_counter()
                for _ in range(args.steps):
                    llm.engine.step()
                speeds[name].append(batch * args.steps / (time.perf_counter() - t))
        for llm in engines.values():
            llm.shutdown()
        print(f"| {batch} | " + " | ".join(f"{statistics.median(v):.1f}" for v in speeds.values()) + " |")


if __name__ == "__main__":
    main()
