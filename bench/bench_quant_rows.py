"""Quantised products of many rows (a prefill chunk's, a large batch's) on the CPU: each compiled variant alone.

    python bench/bench_quant_rows.py                                  # 2 threads, 16 64 128 rows, the model's shapes
    python bench/bench_quant_rows.py --rows 64 --shapes 4096x1024 --formats int8
    python bench/bench_quant_rows.py --rows 16 48 128 --shapes 2816x2048 2048x1408 --formats int8 w8a8

A prefill's products multiply many input rows into each weight row while it is in cache, so these are timed with the
weight hot (the same matrix every call), unlike ``bench_gemv.py``'s decode products, which stream it from memory. For
each format, shape ``[N, K]`` (``N`` outputs, ``K`` inputs) and row count it prints the best of ``--repeats`` calls
of every variant of ``cpu_kernels.linear`` (W8A8: of its operator, which rounds the rows to int8 per row inside the
call) this CPU runs (``avx2``, ``avx512_vnni``; W8A8 also ``amx``, its int8 tiles), in milliseconds and in
multiply-adds a second, beside oneDNN's float32 product of the dequantised weight in its blocked layout (what a
float32 model of the same shape computes). Set ``MLA_CPU_ISA=avx2`` to see what an AVX2 CPU runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from mla_kernels import cpu_kernels, cpu_ops
from mla_runtime.kernel_plan import kernel_plan, onednn_linear, reorder
from mla_runtime.layers.int4 import Int4Weight
from mla_runtime.layers.quantization import Int8Weight
from mla_runtime.layers.qweight import QuantizedWeight
from mla_runtime.layers.w8a8 import W8A8Weight

# the benchmark model's products (bench/peer_checkpoint.py): q_b, the stacked q_a / kv_a, o_proj, an expert's
# gate_up and down, the dense MLP's, and the lm_head
SHAPES = ("2048x384", "960x1024", "1024x1024", "1024x512", "4096x1024", "1024x2048", "32000x1024")


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def candidates(fmt: str, weight: QuantizedWeight, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    out: dict[str, Callable[[], object]]
    if isinstance(weight, W8A8Weight):  # its rows rounded to int8 per row inside the call
        out = {f"{fmt} {v}": (lambda v=v: cpu_kernels.ops().w8a8_linear(x, weight.qweight, weight.scales, v))
               for v in cpu_kernels.variants("w8a8")}
    else:
        operand = (weight.qweight, weight.row_scales) if isinstance(weight, Int8Weight) else \
            (weight.packed, weight.scales)
        out = {f"{fmt} {v}": (lambda v=v: cpu_kernels.linear(x, *operand, variant=v))
               for v in cpu_kernels.variants(fmt)}
    if kernel_plan().choice(torch.float32).path == "onednn":
        blocked = reorder(weight.dequantize())
        out["float32 oneDNN"] = lambda: onednn_linear(x, blocked)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="NxK: N outputs, K inputs")
    ap.add_argument("--formats", nargs="+", default=["int8", "int4"], choices=["int8", "int4", "w8a8"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_kernels.failure() is not None:
        raise SystemExit(f"the compiled kernels do not run here: {cpu_kernels.failure()}")
    print(f"{args.threads} threads; {cpu_ops.summary()}; best of {args.repeats} calls, the weight hot\n")
    print("| format, path | shape | rows | ms | G multiply-adds/s |\n|---|---|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for fmt in args.formats:
        kind = {"int8": Int8Weight, "int4": Int4Weight, "w8a8": W8A8Weight}[fmt]
        for shape in args.shapes:
            n, k = (int(v) for v in shape.split("x"))
            weight = kind.quantize(torch.randn(n, k, generator=g) / k ** 0.5)
            for rows in args.rows:
                x = torch.randn(rows, k, generator=g)
                for name, fn in candidates(fmt, weight, x).items():
                    ms = best_ms(fn, args.repeats)
                    print(f"| {name} | [{n}, {k}] | {rows} | {ms:.3f} | {n * k * rows / ms / 1e6:.0f} |")


if __name__ == "__main__":
    main()
