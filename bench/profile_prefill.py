"""Where a prefill step's time goes: ``batch`` prompts of ``--prompt-len`` tokens prefilled in one step.

    python bench/profile_prefill.py --batch 8 --dtype float32 bfloat16 --threads 2

Loads the benchmark checkpoint, prefills the prompts (prefix caching off, one warm-up round), and
prints the step's wall time (the fastest of ``--repeats``), the same exclusive-time categories as
``profile_decode.py`` and the top aten ops under ``torch.profiler``.
"""

from __future__ import annotations

import argparse
import time

import torch
from peer_checkpoint import build_checkpoint, make_prompts
from profile_decode import OUT, CategoryTimer

from mla_runtime import LLM, SamplingParams


def prefill_once(llm: LLM, batch: int, prompt_len: int, tag: str) -> tuple[float, int]:
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for i, p in enumerate(make_prompts(batch, prompt_len, engine.model_config.vocab_size, seed=1)):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    t0, steps = time.perf_counter(), 0
    while engine.scheduler.has_work():
        engine.step()
        steps += 1
    return time.perf_counter() - t0, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[8])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quantization", default=None, choices=["int8", "int4", "bf16", "fp16"],
                    help="weight-only quantisation")
    ap.add_argument("--repeats", type=int, default=1, help="timed prefills (untraced); the fastest is reported")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    build_checkpoint(OUT)
    timer = CategoryTimer()
    timer.install()
    for dtype in args.dtype:
        for batch in args.batch:
            llm = LLM(str(OUT), dtype=dtype, max_model_len=args.prompt_len + 64, kv_cache_memory="512MiB",
                      max_num_seqs=max(batch, 1), enable_prefix_caching=False,
                      quantization=args.quantization)
            prefill_once(llm, batch, args.prompt_len, "warm")
            secs, steps = min(prefill_once(llm, batch, args.prompt_len, f"plain{r}") for r in range(args.repeats))
            timer.exclusive.clear()
            timer.enabled = True
            prefill_once(llm, batch, args.prompt_len, "timed")
            timer.enabled = False
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                prefill_once(llm, batch, args.prompt_len, "prof")
            tokens = batch * args.prompt_len
            label = dtype if args.quantization is None else f"{dtype}, {args.quantization} weights"
            print(f"\n## {label}, {batch} × {args.prompt_len} tokens: {secs * 1e3:.0f} ms in {steps} step(s), "
                  f"{tokens / secs:.0f} tok/s")
            print("| category | ms |\n|---|---:|")
            for cat, s in sorted(timer.exclusive.items(), key=lambda kv: -kv[1]):
                print(f"| {cat} | {s * 1e3:.0f} |")
            print("top aten ops (self CPU ms):", ", ".join(
                f"{e.key} {e.self_cpu_time_total / 1e3:.0f}"
                for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]))
            llm.shutdown()


if __name__ == "__main__":
    main()
