"""Matrix-vector (1–8 row) products on the CPU: every candidate kernel alone, against the memory bandwidth.

    python bench/bench_gemv.py                              # 2 threads, rows 1 2 4 8, the benchmark model's shapes
    python bench/bench_gemv.py --rows 1 8 --shapes 32000x1024 --rounds 9

A decode step streams each weight once per step, so a kernel's speed on a weight that is *not* in cache is
what matters: every candidate runs over enough copies of the weight (``--cold-mib`` in all, at least one)
that each call reads its weight from memory. For each shape ``[N, K]`` (``N`` outputs, ``K`` inputs) and row
count it prints the median time per product over ``--rounds`` rounds — each round runs every candidate in
turn (interleaved, so machine load hits all alike) — the weight bytes read per second (weights, scales
included; the input and output are negligible) and that as a fraction of the machine's streaming bandwidth,
measured in the same run (``roofline.stream_bandwidth``: best ``torch.sum`` over 1 GiB, same threads; median
of a probe before and after).

Candidates (a candidate the CPU or torch build cannot run is listed as unsupported):

- ``fp32 F.linear`` — ATen (MKL sgemm/sgemv); ``fp32 onednn-plain`` / ``fp32 onednn-blocked`` — oneDNN's
  ``_linear_pointwise`` on the plain weight and on the layout ``_reorder_linear_weight`` makes; ``fp32 row-kernel``
  (one to eight rows) — ``mla_kernels.cpu_kernels.linear``, the compiled kernels;
  ``fp32 cpu_gemm`` — what ``mla_runtime.layers.cpu_gemm.linear`` picks for that weight;
- ``bf16 F.linear``, ``bf16 onednn-blocked``, ``bf16 cpu_gemm`` — the same in bfloat16; ``bf16 amx`` — the AMX
  tile products (``cpu_kernels.amx_linear``, CPUs with AMX-BF16 only); ``bf16 row-kernel`` (one to
  eight rows) — ``cpu_kernels.linear``: the weight read at two bytes, widened by a shift (AVX2, no
  AVX512-BF16 needed); ``bf16 upcast`` — the float32 copy a CPU without oneDNN's bfloat16 path computes with;
- ``int8 pack-mm fp32x`` / ``int8 pack-mm bf16x`` — ``torch.ops.aten._weight_int8pack_mm``: int8 weight,
  one scale per output channel, the input in float32 / bfloat16 (the weight-only int8 path); ``int8 row-kernel``
  (one to eight rows) — ``cpu_kernels.linear`` (the rows rounded to int16, integer multiply-adds);
- ``int4 pack-mm g32 fp32x`` / ``bf16x`` — ``torch.ops.aten._weight_int4pack_mm_for_cpu``: 4-bit weight,
  scale and zero per 32-element group;
- ``w8a8 avx2`` / ``avx512_vnni`` / ``amx`` (``--families w8a8``) — ``cpu_kernels.ops().w8a8_linear`` in each variant
  this CPU runs: the rows rounded to int8 per row, exact int32 sums (``amx``: AMX int8 tiles from 8 rows);
- ``torchao int8wo`` — ``torchao.quantization.Int8WeightOnlyConfig`` where torchao is importable (optional).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from roofline import stream_bandwidth

from mla_kernels import cpu_kernels
from mla_runtime.kernel_plan import GemmChoice, kernel_plan
from mla_runtime.kernel_plan import reorder as _reorder
from mla_runtime.layers.cpu_gemm import PackedWeight, linear

# the benchmark checkpoint's products: lm_head, dense gate_up, o_proj / expert gate_up, expert down
SHAPES = ("32000x1024", "4096x1024", "1024x1024", "1024x512")
Call = Callable[[], object]


def copies_for(nbytes: int, cold_mib: int) -> int:
    return max(1, -(-(cold_mib << 20) // nbytes))


def row_kernels(name: str, family: str, kind: str, run: Callable[[str], object],
                nbytes: int) -> dict[str, tuple[Call, int]]:
    """The compiled kernels' candidates: what ``linear`` picks ("auto") and each variant this CPU runs."""
    why = cpu_kernels.failure(kind)
    if why is not None:
        return {f"{name} row-kernel": (None, f"unsupported: {why}")}  # type: ignore[dict-item]
    return {f"{name} row-kernel {v}": (functools.partial(run, v), nbytes)
            for v in ("auto", *cpu_kernels.variants(family))}


def float_candidates(n: int, k: int, rows: int, dtype: torch.dtype, cold_mib: int) -> dict[str, tuple[Call, int]]:
    name = "fp32" if dtype == torch.float32 else "bf16"
    g = torch.Generator().manual_seed(0)
    nbytes = n * k * dtype.itemsize
    ws = [torch.randn(n, k, generator=g).to(dtype) for _ in range(copies_for(nbytes, cold_mib))]
    x = torch.randn(rows, k, generator=g).to(dtype)
    out: dict[str, tuple[Call, int]] = {f"{name} F.linear": (lambda: [F.linear(x, w) for w in ws], nbytes)}
    pw = torch.ops.mkldnn._linear_pointwise
    if dtype == torch.float32:
        out[f"{name} onednn-plain"] = (lambda: [pw(x, w, None, "none", [None], "") for w in ws], nbytes)
        if rows <= cpu_kernels.max_rows(torch.float32):
            out.update(row_kernels(name, "float", "core", lambda v: [cpu_kernels.linear(x, w, variant=v) for w in ws],
                                   nbytes))
    try:
        blocked = [_reorder(w) for w in ws]
        pw(x, blocked[0], None, "none", [None], "")
        out[f"{name} onednn-blocked"] = (lambda: [pw(x, b, None, "none", [None], "") for b in blocked], nbytes)
    except Exception as e:  # this CPU / build cannot pack the dtype
        out[f"{name} onednn-blocked"] = (None, f"unsupported: {str(e).splitlines()[0][:80]}")  # type: ignore[assignment]
    if dtype == torch.bfloat16:  # AMX tiles (the runtime takes them from 9 to kernel_plan.AMX_MAX_ROWS rows)
        why = cpu_kernels.failure("amx") or (None if n % 16 == 0 and k % 32 == 0 else "N % 16 or K % 32 is not 0")
        if why is None:
            tiled = [cpu_kernels.amx_pack(w) for w in ws]
            out[f"{name} amx"] = (lambda: [cpu_kernels.amx_linear(x, t) for t in tiled], nbytes)
        else:
            out[f"{name} amx"] = (None, f"unsupported: {why}")  # type: ignore[assignment]
    if dtype == torch.bfloat16 and rows <= cpu_kernels.max_rows(torch.float32):
        out.update(row_kernels(name, "float", "bf16",
                               lambda v: [cpu_kernels.linear(x, w, variant=v).to(dtype) for w in ws], nbytes))
        plan = kernel_plan()
        upcast = dataclasses.replace(plan, gemm=tuple(GemmChoice(c.dtype, "upcast", torch.float32, "bench")
                                                      if c.dtype == dtype else c for c in plan.gemm))
        wide = [PackedWeight(w, upcast) for w in ws]  # what a CPU without oneDNN's bf16 path runs: float32 copies
        out[f"{name} upcast"] = (lambda: [linear(x, w, None, p) for w, p in zip(ws, wide)], nbytes)
    packs = [PackedWeight.make(w, kernel_plan()) for w in ws]
    out[f"{name} cpu_gemm"] = (lambda: [linear(x, w, None, p) for w, p in zip(ws, packs)], nbytes)
    return out


def int8_candidates(n: int, k: int, rows: int, cold_mib: int) -> dict[str, tuple[Call, int]]:
    g = torch.Generator().manual_seed(0)
    nbytes = n * k + n * 4
    ws = [torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8) for _ in range(copies_for(nbytes, cold_mib))]
    scales = torch.rand(n, generator=g) / 127
    x = torch.randn(rows, k, generator=g)
    xb, sb = x.bfloat16(), scales.bfloat16()
    mm = torch.ops.aten._weight_int8pack_mm
    out = {"int8 pack-mm fp32x": (lambda: [mm(x, w, scales) for w in ws], nbytes),
           "int8 pack-mm bf16x": (lambda: [mm(xb, w, sb) for w in ws], n * k + n * 2)}
    if rows <= cpu_kernels.max_rows(torch.float32):
        out.update(row_kernels("int8", "int8", "core", lambda v: [cpu_kernels.linear(x, w, scales, variant=v)
                                                                  for w in ws], nbytes))
    return out


def w8a8_candidates(n: int, k: int, rows: int, cold_mib: int) -> dict[str, tuple[Call, int]]:
    """W8A8's operator in each variant this CPU runs (``amx``: its int8 tiles from 8 rows), weights streamed."""
    if cpu_kernels.failure("w8a8") is not None:
        return {"w8a8": (None, f"unsupported: {cpu_kernels.failure('w8a8')}")}  # type: ignore[dict-item]
    g = torch.Generator().manual_seed(0)
    nbytes = n * k + n * 4
    ws = [torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8) for _ in range(copies_for(nbytes, cold_mib))]
    scales = torch.rand(n, generator=g) / 127
    x = torch.randn(rows, k, generator=g)
    op = cpu_kernels.ops().w8a8_linear
    return {f"w8a8 {v}": (lambda v=v: [op(x, w, scales, v) for w in ws], nbytes) for v in cpu_kernels.variants("w8a8")}


def int4_candidates(n: int, k: int, rows: int, cold_mib: int, group: int = 32) -> dict[str, tuple[Call, int]]:
    g = torch.Generator().manual_seed(0)
    nbytes = n * k // 2 + (k // group) * n * 2 * 4
    count = copies_for(nbytes, cold_mib)
    conv = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    try:
        ws = [conv(torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32), 1) for _ in range(count)]
    except Exception as e:
        return {"int4 pack-mm g32": (None, f"unsupported: {str(e).splitlines()[0][:80]}")}  # type: ignore[dict-item]
    sz = torch.rand(k // group, n, 2, generator=g) / 8
    x = torch.randn(rows, k, generator=g)
    xb, szb = x.bfloat16(), sz.bfloat16()
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    out = {"int4 pack-mm g32 fp32x": (lambda: [mm(x, w, group, sz) for w in ws], nbytes),
           "int4 pack-mm g32 bf16x": (lambda: [mm(xb, w, group, szb) for w in ws], nbytes // 2 + n * k // 4)}
    if rows <= cpu_kernels.max_rows(torch.int8) and k % group == 0:  # the int4 format's own kernels
        from mla_runtime.layers.int4 import Int4Weight

        own = n * k // 2 + n * (k // group) * 2  # nibbles and float16 scales
        mats = [Int4Weight.quantize(torch.randn(n, k, generator=g)) for _ in range(copies_for(own, cold_mib))]
        out.update(row_kernels("int4", "int4", "int4", lambda v: [cpu_kernels.linear(x, m.packed, m.scales,
                                                                                     variant=v) for m in mats], own))
    return out


def torchao_candidates(n: int, k: int, rows: int, cold_mib: int) -> dict[str, tuple[Call, int]]:
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        return {"torchao int8wo": (None, "unsupported: torchao is not installed")}  # type: ignore[dict-item]
    nbytes = n * k + n * 4
    mods = []
    for _ in range(copies_for(nbytes, cold_mib)):
        m = torch.nn.Linear(k, n, bias=False)
        quantize_(m, Int8WeightOnlyConfig())
        mods.append(m)
    x = torch.randn(rows, k)
    return {"torchao int8wo": (lambda: [m(x) for m in mods], nbytes)}


def count_copies(fn: Call) -> int:
    return len(fn())  # type: ignore[arg-type]


def measure(cands: dict[str, tuple[Call, int]], rounds: int) -> dict[str, tuple[float, int] | str]:
    """Median seconds per product of each candidate (rounds interleaved), or why it did not run."""
    live = {name: c for name, c in cands.items() if c[0] is not None}
    copies = {name: count_copies(c[0]) for name, c in live.items()}  # also the warm-up
    times: dict[str, list[float]] = {name: [] for name in live}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, (fn, _) in live.items():
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) / copies[name])
    out: dict[str, tuple[float, int] | str] = {}
    for name, (fn, info) in cands.items():
        out[name] = (statistics.median(times[name]), info) if fn is not None else str(info)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="NxK: N outputs, K inputs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cold-mib", type=int, default=96, help="weight copies per candidate, beyond the LLC")
    ap.add_argument("--families", nargs="+", default=["fp32", "bf16", "int8", "int4", "torchao"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"# {cpu}, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{args.threads} threads, rounds {args.rounds} interleaved, {args.cold_mib} MiB of copies per candidate")
    bw_before = stream_bandwidth()
    rows_out = []
    for shape in args.shapes:
        n, k = map(int, shape.lower().split("x"))
        for rows in args.rows:
            cands: dict[str, tuple[Call, int]] = {}
            makers = {"fp32": functools.partial(float_candidates, dtype=torch.float32),
                      "bf16": functools.partial(float_candidates, dtype=torch.bfloat16),
                      "int8": int8_candidates, "int4": int4_candidates, "w8a8": w8a8_candidates,
                      "torchao": torchao_candidates}
            for fam in args.families:
                cands.update(makers[fam](n, k, rows, cold_mib=args.cold_mib))
            for name, res in measure(cands, args.rounds).items():
                rows_out.append((shape, rows, name, res))
            del cands
    bw = statistics.median([bw_before, stream_bandwidth()])
    print(f"# streaming bandwidth (torch.sum over 1 GiB, {args.threads} threads): {bw / 1e9:.1f} GB/s "
          f"(before {bw_before / 1e9:.1f})")
    print("| weight [N, K] | rows | kernel | µs | GB/s | of bandwidth |\n|---|---:|---|---:|---:|---:|")
    for shape, rows, name, res in rows_out:
        if isinstance(res, str):
            print(f"| {shape} | {rows} | {name} | {res} | | |")
            continue
        sec, nbytes = res
        print(f"| {shape} | {rows} | {name} | {sec * 1e6:.0f} | {nbytes / sec / 1e9:.1f} | {nbytes / sec / bw:.2f} |")


if __name__ == "__main__":
    main()
