"""End-to-end decode on a CUDA GPU: a DeepSeek-V2-Lite-shaped model with random weights, at batch 1 and 32.

The checkpoint is written with random weights by ``mla_runtime.random_checkpoint`` (nothing is downloaded), with
``--layers`` of V2-Lite's 27 decoder layers (all of them by default) so that the whole check fits its time budget.
Decode tok/s is timed after a warm-up, and the weight bytes one decode step streams (every non-expert weight, plus
the routed experts the batch touches, at most all of them) are set against a device-to-device copy bandwidth
measured in the same run.

Each batch is timed twice, by one engine after the other: eagerly (``enforce_eager``) and with the decode steps under
CUDA graphs (``engine/cuda_graphs.py``); the graph engine's captured batch sizes (and why any was not captured) are
printed, and the two engines' greedy tokens for a few prompts are compared. ``--dense`` makes every layer a dense MLP
(no routed experts), so that the graphs are captured even where the experts' host-side grouping keeps a MoE step
eager.

    python bench/gpu_e2e.py --layers 27 --batch 1 32 --out /tmp/v2lite
    python bench/gpu_e2e.py --layers 8 --dense --batch 1 32 --out /tmp/v2lite_dense
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.config import PRESET_DIR, ModelConfig
from mla_runtime.plan import parameter_breakdown
from mla_runtime.random_checkpoint import write_random_checkpoint


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy GB/s (a copy reads and writes: 2 × size / time), best of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def streamed_bytes(cfg: ModelConfig, batch: int) -> int:
    """Weight bytes (bf16) one decode step of ``batch`` rows reads: every weight but the embedding (a gathered row
    each) and the routed experts, plus the experts the rows choose (top-k each, at most all of them)."""
    parts = parameter_breakdown(cfg)
    moe, d = cfg.moe, cfg.hidden_size
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    routed = 0 if moe is None else moe_layers * moe.n_routed_experts * 3 * d * moe.moe_intermediate_size
    share = 1.0 if moe is None else min(1.0, batch * moe.num_experts_per_tok / moe.n_routed_experts)
    return int(2 * (sum(parts.values()) - parts["embedding"] - routed + routed * share))


def decode_tok_s(llm: LLM, batch: int, prompt_len: int, steps: int) -> float:
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        ids = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"d{i}", {"prompt_token_ids": ids}, params)
    for _ in range(8):  # prefill and warm-up decodes
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    while engine.has_unfinished_requests():
        engine.step()
    return batch * steps / seconds


def greedy_tokens(llm: LLM, prompts: int = 4, tokens: int = 32) -> list[list[int]]:
    """Greedy tokens of a few random prompts (the same in every call)."""
    gen = torch.Generator().manual_seed(1)
    vocab = llm.engine.model_config.vocab_size
    batch = [{"prompt_token_ids": torch.randint(0, vocab, (64 + 16 * i,), generator=gen).tolist()}
             for i in range(prompts)]
    outs = llm.generate(batch, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def graphs_summary(llm: LLM) -> str:
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return "CUDA graphs: none (off)"
    failed = "; ".join(f"{size}: {why}" for size, why in sorted(graphs.failures.items()))
    return (f"CUDA graphs: captured batch sizes {sorted(graphs.replays) or 'none'}"
            + (f"; eager sizes: {failed}" if failed else "") + f"; replays by size {dict(sorted(graphs.runs.items()))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default="/tmp/mla_gpu_v2lite")
    ap.add_argument("--dense", action="store_true", help="dense MLPs on every layer (no routed experts)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_e2e: no CUDA GPU visible")
    raw = json.loads((PRESET_DIR / "deepseek-v2-lite.json").read_text()) | {"num_hidden_layers": args.layers}
    if args.dense:
        raw["first_k_dense_replace"] = args.layers
    out = Path(args.out)
    if not (out / "config.json").is_file():
        t = time.perf_counter()
        write_random_checkpoint(raw, out)
        print(f"random checkpoint: {args.layers} layers written in {time.perf_counter() - t:.0f} s")
    cfg = ModelConfig.from_dict(raw)
    bw = copy_bandwidth()
    rows: list[str] = []
    greedy: dict[str, list[list[int]]] = {}
    for mode in ("eager", "graphs"):  # one engine after the other: each sizes its cache to the free memory
        t = time.perf_counter()
        llm = LLM(str(out), dtype="bfloat16", max_model_len=args.prompt_len + args.steps + 64,
                  max_num_seqs=max(args.batch), enforce_eager=mode == "eager")
        print(f"{mode}: engine ready in {time.perf_counter() - t:.0f} s")
        greedy[mode] = greedy_tokens(llm)
        for batch in args.batch:
            tok_s = decode_tok_s(llm, batch, args.prompt_len, args.steps)
            step_bytes = streamed_bytes(cfg, batch)
            frac = step_bytes * tok_s / batch / 1e9 / bw
            rows.append(f"| {batch} | {mode} | {tok_s:.1f} | {step_bytes / 2**30:.2f} GiB | {frac:.2f} |")
        if mode == "graphs":
            print(graphs_summary(llm))
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(greedy["eager"], greedy["graphs"]))
    print(f"greedy tokens, graphs against eager: {same} of {len(greedy['eager'])} prompts equal")
    print(f"| batch | steps | decode tok/s | weights streamed per step | fraction of copy bandwidth ({bw:.0f} GB/s) |")
    print("|---:|---|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
