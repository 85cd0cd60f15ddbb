"""What each CPU fast-path change is worth: decode-step time with all of them, and with each one turned off.

    python bench/ablate_decode.py --batch 1 8 --dtype float32 bfloat16 --threads 2

On the benchmark checkpoint, ``batch`` sequences are prefilled (``--prompt-len`` tokens) and kept
decoding; in each of ``--rounds`` rounds every variant runs ``--steps`` decode steps in turn (interleaved, so a
change in the machine's load hits all variants alike), and the median step time per variant is reported with
its ratio to "all on". Variants switch one change off at run time:

- ``no oneDNN packing``: every GEMM through ``F.linear`` (MKL), as before the fast path;
- ``no decode plan``: the per-layer ``mla_decode`` + ``store_latent`` instead of one plan per step;
- ``no q_a/kv_a stacking``: two input-projection GEMMs per layer instead of one;
- ``no host expert grouping``: a decode step's experts grouped by the sort path of prefill.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from peer_checkpoint import build_checkpoint
from profile_decode import start_decoding

from mla_runtime import LLM
from mla_runtime.layers import moe as moe_module
from mla_runtime.layers.cpu_gemm import PackedWeight
from mla_runtime.layers.mla import MLAttention
from mla_runtime.models import deepseek as deepseek_module

OUT = Path(__file__).resolve().parent / "out" / "peer_ckpt"
PACKED_ATTRS = ("packed", "gate_up_packed", "down_packed", "lm_head_packed", "qkv_a")


@contextmanager
def no_packing(model):
    saved = [(m, a, getattr(m, a)) for m in model.modules() for a in PACKED_ATTRS if hasattr(m, a)]
    for m, a, v in saved:
        setattr(m, a, [] if isinstance(v, list) else None)
    try:
        yield
    finally:
        for m, a, v in saved:
            setattr(m, a, v)


@contextmanager
def no_plan(model):
    original = deepseek_module.plan_decode
    deepseek_module.plan_decode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        deepseek_module.plan_decode = original


@contextmanager
def no_stacking(model):
    attns = [m for m in model.modules() if isinstance(m, MLAttention) and m.qkv_a is not None]
    saved = [(a, a.qkv_a) for a in attns]
    for a in attns:
        a.qkv_a = None
        a.q_a_proj.packed = PackedWeight.make(a.q_a_proj.weight, model.plan)
        a.kv_a_proj_with_mqa.packed = PackedWeight.make(a.kv_a_proj_with_mqa.weight, model.plan)
    try:
        yield
    finally:
        for a, qkv in saved:
            a.qkv_a = qkv
            a.q_a_proj.packed = a.kv_a_proj_with_mqa.packed = None


@contextmanager
def no_host_grouping(model):
    original = moe_module.HOST_GROUPING_MAX_PAIRS
    moe_module.HOST_GROUPING_MAX_PAIRS = 0
    try:
        yield
    finally:
        moe_module.HOST_GROUPING_MAX_PAIRS = original


@contextmanager
def all_on(model):
    yield


VARIANTS: dict[str, Callable] = {
    "all on": all_on, "no oneDNN packing": no_packing, "no decode plan": no_plan,
    "no q_a/kv_a stacking": no_stacking, "no host expert grouping": no_host_grouping,
}


def run(dtype: str, batch: int, args) -> None:
    llm = LLM(str(OUT), dtype=dtype, max_model_len=args.prompt_len + 64 + args.rounds * args.steps * len(VARIANTS),
              kv_cache_memory="1GiB", max_num_seqs=batch, num_threads=args.threads)
    total_steps = args.rounds * args.steps * len(VARIANTS)
    start_decoding(llm, batch, args.prompt_len, total_steps // 3 + 8, warmup=4)
    engine, model = llm.engine, llm.engine.worker.model
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, variant in VARIANTS.items():
            with variant(model):
                engine.step()  # one untimed step after switching
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                times[name].append((time.perf_counter() - t0) / args.steps)
    base = statistics.median(times["all on"])
    print(f"\n## {dtype}, batch {batch}, {torch.get_num_threads()} threads: median of {args.rounds} rounds × "
          f"{args.steps} steps, context {args.prompt_len}+")
    print("| variant | ms/step | tok/s | vs all on |")
    print("|---|---:|---:|---:|")
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"| {name} | {ms * 1e3:.2f} | {batch / ms:.1f} | {ms / base:.2f}× |")
    llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    build_checkpoint(OUT)
    for dtype in args.dtype:
        for batch in args.batch:
            run(dtype, batch, args)


if __name__ == "__main__":
    main()
