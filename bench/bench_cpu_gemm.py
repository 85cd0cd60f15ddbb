"""Decode speed on the probed CPU GEMM path (``cpu_gemm=auto``) next to the forced fallbacks (``plain``).

    python bench/bench_cpu_gemm.py --batch 1 8 --dtype float32 bfloat16 --steps 24 --threads 2

Loads the benchmark checkpoint (``bench/peer_checkpoint.py``, built on first use) once per (dtype, mode),
prefills ``batch`` prompts of ``--prompt-len`` tokens in both engines, runs a few warm-up decode steps,
then times ``--steps`` decode steps per engine in alternating rounds (so a shared machine's load falls on
both) and prints the median step time and tokens/s, with the path each row actually ran
(``KernelPlan.info``: on a CPU whose fast path fails its probe, ``auto`` is itself a fallback).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from peer_checkpoint import build_checkpoint, make_prompts

from mla_runtime import LLM, SamplingParams
from mla_runtime.options import CPU_GEMM_MODES as GEMM_MODES

OUT = Path(__file__).resolve().parent / "out" / "peer_ckpt"
WARMUP = 4
ROUNDS = 4  # alternating rounds per engine; each times steps // ROUNDS decode steps


def start_decoding(llm: LLM, batch: int, prompt_len: int, steps: int) -> None:
    """Prefill ``batch`` prompts, then decode ``WARMUP`` steps; requests end right after the timed steps."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + WARMUP + 2, temperature=0, ignore_eos=True)
    for i, p in enumerate(make_prompts(batch, prompt_len, engine.model_config.vocab_size, seed=0)):
        engine.add_request(f"gemm-{batch}-{i}", {"prompt_token_ids": p}, params)
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(WARMUP):
        engine.step()


def race(llms: dict[str, LLM], batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    """Median decode-step seconds per mode, the modes' steps timed in alternating rounds."""
    for llm in llms.values():
        start_decoding(llm, batch, prompt_len, steps)
    times: dict[str, list[float]] = {mode: [] for mode in llms}
    for _ in range(ROUNDS):
        for mode, llm in llms.items():
            for _ in range(steps // ROUNDS):
                t0 = time.perf_counter()
                llm.engine.step()
                times[mode].append(time.perf_counter() - t0)
    for llm in llms.values():  # finish the requests: the next batch starts from an empty engine
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    return {mode: statistics.median(t) for mode, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    build_checkpoint(OUT)
    caps = torch.cpu.get_capabilities()
    isa = [k for k in ("avx2", "avx512_f", "avx512_bf16", "amx_bf16", "neon", "bf16", "sve") if caps.get(k)]
    print(f"cpu: {caps.get('cpu_name', '?')} ({caps.get('architecture')}; {', '.join(isa)}), "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| dtype | cpu_gemm | path ran (compute dtype) | batch | decode step ms | tok/s | vs auto |")
    print("|---|---|---|---:|---:|---:|---:|")
    notes = {}
    for dtype in args.dtype:
        llms, info = {}, {}
        for mode in GEMM_MODES:
            llms[mode] = LLM(str(OUT), dtype=dtype, max_model_len=args.prompt_len + args.steps + 64,
                             kv_cache_memory="256MiB", max_num_seqs=max(args.batch), cpu_gemm=mode)
            info[mode] = llms[mode].engine.worker.gemm_info
        for batch in args.batch:
            step = race(llms, batch, args.prompt_len, args.steps)
            for mode in GEMM_MODES:
                i = info[mode]
                print(f"| {dtype} | {mode} | {i['path']} ({i['compute_dtype']}) | {batch} | {step[mode] * 1e3:.2f} "
                      f"| {batch / step[mode]:.1f} | {step['auto'] / step[mode]:.2f}× |")
        notes.update({f"{dtype}/{mode}": info[mode]["reason"] for mode in GEMM_MODES})
        for llm in llms.values():
            llm.shutdown()
    for key, reason in notes.items():
        print(f"- {key}: {reason}")


if __name__ == "__main__":
    main()
