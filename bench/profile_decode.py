"""Where a decode step's time goes: an exclusive-time breakdown of ``LLMEngine.step`` by category.

    python bench/profile_decode.py --batch 1 8 --dtype float32 bfloat16 --steps 32

Loads the benchmark checkpoint (``bench/peer_checkpoint.py``, built on first use), prefills
``batch`` prompts of ``--prompt-len`` tokens, runs a few warm-up decode steps, then times ``--steps``
decode steps twice:

1. **by category** — the step's functions are wrapped with timers that keep a stack, so each category
   gets its *exclusive* wall time and the categories add up to the step: ``dense matmuls`` (linear
   layers, dense MLP and shared experts, lm_head), ``MoE routed`` (router + routed experts),
   ``attention`` (RoPE, latent-cache write, absorption, the decode kernel, o_proj), ``norms``,
   ``sampling``, ``batch metadata`` (building the ``ForwardBatch``), ``engine/scheduler`` (the rest of
   the step: scheduling, output bookkeeping) and ``model glue`` (embedding, residuals);
2. **Python overhead** — under ``torch.profiler``, the wall time not covered by any top-level aten op
   (interpreter, module dispatch, argument checks) as a share of the step.

The timers cost a few microseconds per wrapped call; the totals of pass 1 are therefore a little above
the plain step time, which is printed alongside (pass 0, no instrumentation).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from peer_checkpoint import build_checkpoint, make_prompts

from mla_runtime import LLM, SamplingParams

OUT = Path(__file__).resolve().parent / "out" / "peer_ckpt"

# (module, attribute path, category): every function whose exclusive time is charged to the category.
TARGETS: list[tuple[str, str, str]] = [
    ("mla_runtime.engine.llm_engine", "LLMEngine.step", "engine/scheduler"),
    ("mla_runtime.engine.model_runner", "ModelRunner.prepare", "batch metadata"),
    ("mla_runtime.engine.model_runner", "ModelRunner.run", "engine/scheduler"),
    ("mla_runtime.engine.sampler", "sample", "sampling"),
    ("mla_runtime.models.deepseek", "DeepseekForCausalLM.forward", "model glue"),
    ("mla_runtime.models.deepseek", "DeepseekForCausalLM.compute_logits", "dense matmuls"),
    ("mla_runtime.models.deepseek", "DecoderLayer.forward", "model glue"),
    ("mla_runtime.layers.mla", "MLAttention.forward", "attention"),
    ("mla_runtime.layers.linear", "Linear.forward", "dense matmuls"),
    ("mla_runtime.layers.mlp", "GatedMLP.forward", "dense matmuls"),
    ("mla_runtime.layers.moe", "MoE.forward", "MoE routed"),
    ("mla_runtime.layers.moe", "Router.forward", "MoE routed"),
    ("mla_runtime.layers.moe", "Experts.forward", "MoE routed"),
    ("mla_runtime.layers.norm", "RMSNorm.forward", "norms"),
]


class CategoryTimer:
    def __init__(self) -> None:
        self.exclusive: dict[str, float] = defaultdict(float)
        self.stack: list[list[float]] = []  # [start, time spent in children]
        self.enabled = False

    def wrap(self, fn: Callable, category: str) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            frame = [time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                elapsed = time.perf_counter() - frame[0]
                self.exclusive[category] += elapsed - frame[1]
                if self.stack:
                    self.stack[-1][1] += elapsed

        return timed

    def install(self) -> None:
        for module_name, path, category in TARGETS:
            owner = importlib.import_module(module_name)
            *parents, attr = path.split(".")
            for p in parents:
                owner = getattr(owner, p, None)
            if owner is not None and hasattr(owner, attr):
                setattr(owner, attr, self.wrap(getattr(owner, attr), category))


def start_decoding(llm: LLM, batch: int, prompt_len: int, steps: int, warmup: int) -> None:
    engine = llm.engine
    params = SamplingParams(max_tokens=steps * 3 + warmup + 8, temperature=0, ignore_eos=True)
    for i, p in enumerate(make_prompts(batch, prompt_len, engine.model_config.vocab_size, seed=0)):
        engine.add_request(f"prof-{i}", {"prompt_token_ids": p}, params)
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(warmup):
        engine.step()


def run(dtype: str, batch: int, steps: int, prompt_len: int, timer: CategoryTimer, threads: int | None,
        quantization: str | None = None, kv_cache_dtype: str = "auto") -> None:
    if threads:
        torch.set_num_threads(threads)
    llm = LLM(str(OUT), dtype=dtype, max_model_len=prompt_len + steps * 3 + 64, kv_cache_memory="512MiB",
              max_num_seqs=batch, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    start_decoding(llm, batch, prompt_len, steps, warmup=8)
    engine = llm.engine

    t0 = time.perf_counter()  # pass 0: plain
    for _ in range(steps):
        engine.step()
    plain = (time.perf_counter() - t0) / steps

    timer.exclusive.clear()  # pass 1: categories
    timer.enabled = True
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    timed = (time.perf_counter() - t0) / steps
    timer.enabled = False
    cats = dict(timer.exclusive)

    # the compiled kernels are torch operators: the profiler counts each (mla_kernels::<name>) as a top-level op
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:  # pass 2: Python share
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled = time.perf_counter() - t0
    top_level_ops = sum(e.cpu_time_total for e in prof.events() if e.cpu_parent is None) / 1e6
    python_share = max(0.0, 1 - top_level_ops / profiled)

    label = dtype if quantization is None else f"{dtype}, {quantization} weights"
    label += "" if kv_cache_dtype == "auto" else f", {kv_cache_dtype} latent cache"
    print(f"\n## {label}, batch {batch}: decode step {plain * 1e3:.2f} ms plain "
          f"({batch / plain:.1f} tok/s), {timed * 1e3:.2f} ms with timers; context {prompt_len}+")
    print(f"Python/dispatch overhead (wall not inside any aten op or compiled kernel, torch.profiler): "
          f"{python_share * 100:.0f}%")
    print("| category | ms/step | share |")
    print("|---|---:|---:|")
    total = sum(cats.values())
    for cat, secs in sorted(cats.items(), key=lambda kv: -kv[1]):
        print(f"| {cat} | {secs / steps * 1e3:.2f} | {secs / total * 100:.0f}% |")
    ops = prof.key_averages()
    print("top aten ops (self CPU ms/step):",
          ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3 / steps:.2f}"
                    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:8]))
    llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--quantization", default=None, choices=["int8", "int4", "bf16", "fp16"],
                    help="weight-only quantisation")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], help="latent-cache element types, each run")
    args = ap.parse_args()
    build_checkpoint(OUT)
    timer = CategoryTimer()
    timer.install()
    for dtype in args.dtype:
        for batch in args.batch:
            for cache in args.kv_cache_dtype:
                run(dtype, batch, args.steps, args.prompt_len, timer, args.threads, args.quantization, cache)


if __name__ == "__main__":
    main()
