"""The decode step's compiled CPU kernels, for x86-64 with AVX2 and FMA, built at run time:

- products of one row with a weight matrix (``gemv``: float32; ``gemv_int8``: int8 with a scale per row, the row
  rounded to int16) and of two to ``FEW_ROWS_MAX`` rows (``gemm_few``; ``gemm_few_int8``, rows rounded to int16);
- products of one to ``INT4_ROWS_MAX`` rows with a group-wise int4 weight (``gemm_int4``, ``csrc/gemv_int4.c``: ggml's
  Q4_0 numbers, half a byte per weight and a float16 scale per 32; rows rounded to int8 per group of 32, as Q8_0),
  in an AVX2 and an AVX-512 VNNI variant with the same bits (``int4_variants``), probed on its own
  (``int4_failure``);
- a layer's absorbed MLA decode attention in one call (``absorbed_decode``): absorption into the latent, attention
  over the paged latent cache, up-projection;
- a one-thread RMSNorm of a few rows (``rms_norm``);
- gated MLPs of one row (``GatedMLPTable``): a dense MLP, or a MoE layer's router, routing, routed and shared
  experts in one call (``GatedMLPTable.moe_row``);
- a whole decoder layer of one to ``FEW_ROWS_MAX`` rows in one call (``decoder_layer``, ``csrc/mla_layer_f32.c``):
  the kernels above in the order a decode step calls them, with the MLP of any of those row counts (a MoE layer's
  rows routed, then each chosen expert read once for the rows that chose it).

A decode step at batch 1 multiplies one row by every weight matrix, streaming each from memory once. oneDNN and MKL
reach the memory bandwidth only on large matrices: measured on a 2-core AMD EPYC (Zen 3, AVX2) with the weights out
of cache (``bench/bench_gemv.py``), oneDNN streams a ``[512, 256]`` weight at 4.2 GB/s, ``[1024, 512]`` at 7.6 and
``[4096, 1024]`` at 15.1 GB/s, where the machine streams 16–25 GB/s. ``csrc/gemv_f32.c`` does the product the
simple way: each thread reads its share of the weight rows front to back as two sequential streams, and the input
rows stay in L1. The step's small operations cost more in dispatch than in arithmetic there (``F.rms_norm`` of one
row: about 35 µs; a MoE router in torch ops: about 120 µs), which is why the norm, the attention and the MoE layer
are whole calls of their own, and then each decoder layer (bench/RESULTS.md has the measurements).

The kernels are C (``csrc/*.c``, their entry points declared in ``csrc/mla_cpu.h``) compiled as C++ into the
library of typed torch operators that ``mla_kernels.cpu_ops`` builds once per machine (``-O3 -mavx2 -mfma -fopenmp``;
code for wider instruction sets is compiled per function with target attributes and chosen at run time), on the
OpenMP runtime PyTorch ships, so the kernels' threads are PyTorch's pool. Each is called as
``torch.ops.mla_kernels.<name>`` with its buffers as tensors. ``failure()`` (once per process) checks the CPU
(x86-64 with avx2 and fma3), that the operators built, and each kernel against torch on small inputs.
Anything that fails makes them unavailable, with the reason, and callers keep their torch paths
(``mla_runtime.layers.cpu_gemm``). Results equal torch's to float rounding (another summation order), except the
int8 products' int16 rounding of their rows and the int4 products' int8 rounding.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from typing import Any

import torch

from . import cpu_ops


@functools.cache
def _load() -> tuple[Any, str | None]:
    """The kernels' operators (``torch.ops.mla_kernels``), or None and why they are unavailable."""
    if not cpu_ops.x86():
        return None, f"the kernels are written for x86-64 (this CPU: {platform.machine()})"
    why = cpu_ops.failure()
    if why is not None:
        return None, why
    return torch.ops.mla_kernels, None


@functools.cache
def failure() -> str | None:
    """None where the kernel is built, loaded and exact on this machine, else why not."""
    lib, why = _load()
    if lib is None:
        return why
    g = torch.Generator().manual_seed(0)
    for n, k in ((37, 77), (8, 64), (1, 3)):  # row and column tails included
        w = torch.randint(-2, 3, (n, k), generator=g).float()
        x = torch.randint(-2, 3, (1, k), generator=g).float()
        exact = x.double() @ w.double().T
        if not torch.equal(gemv(x, w).double(), exact):
            return "the one-row kernel's products differ from the exact result on this CPU"
        xs = torch.randint(-2, 3, (3, k), generator=g).float()
        if not torch.equal(gemm_few(xs, w).double(), xs.double() @ w.double().T):
            return "the few-row kernel's products differ from the exact result on this CPU"
        scale = torch.full((n,), 0.5)
        if not torch.equal(gemv_int8(x, w.to(torch.int8), scale).double(), exact * 0.5):
            return "the one-row int8 kernel's products differ from the exact result on this CPU"
        if not torch.equal(gemm_few_int8(xs, w.to(torch.int8), scale).double(), xs.double() @ w.double().T * 0.5):
            return "the few-row int8 kernel's products differ from the exact result on this CPU"
    xs = torch.randn(3, 40, generator=g)
    weight = torch.randn(40, generator=g)
    if not torch.allclose(rms_norm(xs, weight, 1e-6), torch.nn.functional.rms_norm(xs, (40,), weight, 1e-6),
                          rtol=1e-5, atol=1e-6):
        return "the RMSNorm kernel differs from torch's on this CPU"
    return _decode_failure(g)


def _decode_failure(g: torch.Generator) -> str | None:
    """The absorbed decode kernel against the same attention in torch (float64) on a small random layer."""
    rows, heads, d_n, d_r, d_c, d_v, blocks = 3, 5, 16, 8, 72, 24, 40
    q = torch.randn(rows, heads, d_n + d_r, generator=g)
    q_n, q_r = q.split([d_n, d_r], dim=-1)
    w_uk, w_uv_t = torch.randn(heads, d_n, d_c, generator=g), torch.randn(heads, d_c, d_v, generator=g)
    cache = torch.randn(blocks, d_c + d_r, generator=g)
    lens = torch.tensor([1, 7, 33])
    slots = torch.randperm(blocks, generator=g)[:33].repeat(rows, 1)
    for weights in ((w_uk, w_uv_t), (w_uk.bfloat16(), w_uv_t.bfloat16())):
        got = absorbed_decode(q_n, q_r, *weights, cache, slots, lens, 0.3)
        uk, uv_t = (w.double() for w in weights)
        for t in range(rows):
            keys = cache[slots[t, :lens[t]]].double()
            q_abs = torch.einsum("hn,hnc->hc", q_n[t].double(), uk)
            p = torch.softmax(0.3 * (torch.cat([q_abs, q_r[t].double()], -1) @ keys.T), dim=-1)
            want = torch.einsum("hc,hcv->hv", p @ keys[:, :d_c], uv_t)
            if not torch.allclose(got[t].double(), want, rtol=1e-4, atol=1e-4):
                return f"the absorbed decode kernel ({weights[0].dtype} weights) differs from torch's attention here"
    return None


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one float32 row ``x [..., K]`` (``x.numel() == K``) and a contiguous float32
    CPU ``weight [N, K]``; only where ``failure()`` is None."""
    lib, _ = _load()
    assert lib is not None, "gemv needs the kernel: check failure() first"
    n, k = weight.shape
    if x.numel() != k or x.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"gemv takes one float32 row of {k} values and a contiguous float32 weight, got x "
                         f"{tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}")
    row = x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.gemv_f32(weight, row, y, n, k, torch.get_num_threads())
    return y if bias is None else y.add_(bias)


FEW_ROWS_MAX = 8


def gemm_few(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2 to ``FEW_ROWS_MAX`` float32 rows ``x [..., K]`` and a contiguous float32 CPU
    ``weight [N, K]``: each weight row read once for all the input rows; only where ``failure()`` is None."""
    lib, _ = _load()
    assert lib is not None, "gemm_few needs the kernel: check failure() first"
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    if (x.shape[-1] != k or not 1 <= rows <= FEW_ROWS_MAX or x.dtype != torch.float32
            or weight.dtype != torch.float32 or not weight.is_contiguous()):
        raise ValueError(f"gemm_few takes 1 to {FEW_ROWS_MAX} float32 rows of {k} values and a contiguous float32 "
                         f"weight, got x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}")
    xs = x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.gemm_few_f32(weight, xs, y, rows, n, k, torch.get_num_threads())
    return y if bias is None else y.add_(bias)


def gemm_few_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` in float32 of 1 to ``FEW_ROWS_MAX`` rows ``x [..., K]`` (any float dtype, widened) and a contiguous
    bfloat16 CPU ``weight [N, K]`` read at two bytes per weight (widened exactly in the kernel); the float32 result
    ``[..., N]`` (``+ bias``). Only where ``bf16_failure()`` is None."""
    lib, _ = _load()
    assert lib is not None, "gemm_few_bf16 needs the kernel: check bf16_failure() first"
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    if (x.shape[-1] != k or not 1 <= rows <= FEW_ROWS_MAX or weight.dtype != torch.bfloat16
            or not weight.is_contiguous()):
        raise ValueError(f"gemm_few_bf16 takes 1 to {FEW_ROWS_MAX} rows of {k} values and a contiguous bfloat16 "
                         f"weight, got x {tuple(x.shape)} and weight {tuple(weight.shape)} {weight.dtype}")
    xs = x.to(torch.float32).contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    if rows == 1:  # each thread's rows as two sequential streams (as gemv)
        lib.gemv_bf16(weight, xs, y, n, k, torch.get_num_threads())
    else:
        lib.gemm_few_bf16(weight, xs, y, rows, n, k, torch.get_num_threads())
    return y if bias is None else y.add_(bias)


@functools.cache
def bf16_failure() -> str | None:
    """None where the bfloat16-weight kernel is built and exact on this machine, else why not: products of small
    integers (exact in float32) with row and column tails, against float64."""
    why = failure()
    if why is not None:
        return why
    g = torch.Generator().manual_seed(0)
    for n, k, rows in ((37, 77, 1), (8, 64, 5), (3, 5, 8)):
        w = torch.randint(-3, 4, (n, k), generator=g).to(torch.bfloat16)
        x = torch.randint(-3, 4, (rows, k), generator=g).float()
        if not torch.equal(gemm_few_bf16(x, w).double(), x.double() @ w.double().T):
            return "the bfloat16-weight kernel's products differ from the exact result on this CPU"
    return None


def gemv_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x · (qweight · scales[:, None])ᵀ`` in float32 for one row ``x [..., K]`` (any float dtype), a contiguous
    int8 ``qweight [N, K]`` and float32 ``scales [N]``, the row rounded to int16 with a power-of-two scale (its
    largest value to at most 16383); only where ``failure()`` is None."""
    lib, _ = _load()
    assert lib is not None, "gemv_int8 needs the kernel: check failure() first"
    n, k = qweight.shape
    if (x.numel() != k or qweight.dtype != torch.int8 or not qweight.is_contiguous()
            or scales.dtype != torch.float32 or scales.shape != (n,) or not scales.is_contiguous()):
        raise ValueError(f"gemv_int8 takes one row of {k} values, a contiguous int8 weight and {n} float32 scales, "
                         f"got x {tuple(x.shape)}, weight {qweight.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype}")
    row = x.to(torch.float32).contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.gemv_i8(qweight, scales, row, y, n, k, torch.get_num_threads())
    return y


INT8_ROWS_MAX = 64  # int8 products of up to this many rows take the kernel, eight rows at a time


def gemm_few_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x · (qweight · scales[:, None])ᵀ`` in float32 for 1 to ``INT8_ROWS_MAX`` rows ``x [..., K]`` (any float
    dtype), a contiguous int8 ``qweight [N, K]`` and float32 ``scales [N]``, each row rounded to int16 with a
    power-of-two scale; eight rows at a time, each row's result independent of the others. Only where ``failure()``
    is None."""
    lib, _ = _load()
    assert lib is not None, "gemm_few_int8 needs the kernel: check failure() first"
    n, k = qweight.shape
    rows = x.numel() // k if k else 0
    if (x.shape[-1] != k or not 1 <= rows <= INT8_ROWS_MAX or qweight.dtype != torch.int8
            or not qweight.is_contiguous() or scales.dtype != torch.float32 or scales.shape != (n,)
            or not scales.is_contiguous()):
        raise ValueError(f"gemm_few_int8 takes 1 to {INT8_ROWS_MAX} rows of {k} values, a contiguous int8 weight and "
                         f"{n} float32 scales, got x {tuple(x.shape)}, weight {qweight.dtype} and scales "
                         f"{tuple(scales.shape)} {scales.dtype}")
    xs = x.to(torch.float32).contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.gemm_few_i8(qweight, scales, xs, y, rows, n, k, torch.get_num_threads())
    return y


INT8_VARIANTS = ("avx2", "avx512_vnni")  # the few-row int8 product's variants (csrc/gemv_f32.c), slowest first


def int8_variants() -> tuple[str, ...]:
    """The few-row int8 product's variants this CPU executes; the fastest runs unless ``select_int8_variant`` says
    otherwise. They give identical results (the same integer sums)."""
    lib, _ = _load()
    if lib is None:
        return ()
    mask = int(lib.i8_variants())
    return tuple(name for i, name in enumerate(INT8_VARIANTS) if mask >> i & 1)


def select_int8_variant(variant: str | None) -> None:
    """Run the few-row int8 products with ``variant`` (one of ``int8_variants()``), or the fastest (None)."""
    lib, _ = _load()
    assert lib is not None, "select_int8_variant needs the kernel: check failure() first"
    if variant is not None and variant not in int8_variants():
        raise ValueError(f"this CPU runs the int8 variants {list(int8_variants())}, not {variant!r}")
    lib.i8_select(-1 if variant is None else INT8_VARIANTS.index(variant))


FP8_ROWS_MAX = 64  # block-FP8 products of up to this many rows take the kernel


@functools.cache
def fp8_failure() -> str | None:
    """None where the block-FP8 kernel (``csrc/gemv_fp8.c``) is built and exact on this machine, else why not (the
    other kernels do not depend on it). Checks the widening of every e4m3 byte, then products whose values are small
    integers and powers of two (exact in float32) with partial blocks, against float64."""
    why = failure()
    if why is not None:
        return why
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if caps.get("f16c") is False:
        return "the CPU lacks f16c"
    every = torch.zeros(512, 17, dtype=torch.uint8)
    every[:256, 5] = every[256:, 16] = torch.arange(256, dtype=torch.uint8)  # each byte, in a vector and in the tail
    weight = every.view(torch.float8_e4m3fn)
    want = weight[:, 5].float().add(weight[:, 16].float()) * 0.5
    for rows in (1, 5):  # straight from the bytes, and through a widened row
        x = torch.zeros(rows, 17)
        x[:, 5] = x[:, 16] = 1.0
        got = gemm_fp8(x, weight, torch.full((4, 2), 0.5), (128, 16))
        if not torch.equal(torch.isnan(got), torch.isnan(want).expand(rows, -1)) or not torch.equal(
                torch.nan_to_num(got), torch.nan_to_num(want).expand(rows, -1)):
            return "the FP8 kernel widens e4m3 bytes wrongly on this CPU"
    g = torch.Generator().manual_seed(0)
    for n, k, block, rows in ((37, 77, (16, 32), 1), (37, 77, (16, 32), 9), (8, 64, (128, 128), 3), (3, 5, (1, 2), 2)):
        weight = torch.randint(-2, 3, (n, k), generator=g).float().to(torch.float8_e4m3fn)
        shape = (-(-n // block[0]), -(-k // block[1]))
        scale = torch.tensor([0.25, 0.5, 2.0])[torch.randint(0, 3, shape, generator=g)]
        x = torch.randint(-2, 3, (rows, k), generator=g).float()
        wide = weight.double() * scale.double().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        if not torch.equal(gemm_fp8(x, weight, scale, block).double(), x.double() @ wide.T):
            return "the FP8 kernel's products differ from the exact result on this CPU"
    return None


def gemm_fp8(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x · Wᵀ`` in float32 for 1 to ``FP8_ROWS_MAX`` rows ``x [..., K]`` (any float dtype, computed in float32) and a
    block-FP8 weight: contiguous float8_e4m3fn ``weight [N, K]`` with contiguous float32 ``scale_inv [ceil(N / bn),
    ceil(K / bk)]`` (``W = weight * scale_inv`` of its ``block = (bn, bk)``), read at one byte per value. Each row's
    result is independent of the others. Only where ``fp8_failure()`` is None."""
    lib, _ = _load()
    assert lib is not None, "gemm_fp8 needs the kernel: check fp8_failure() first"
    n, k = weight.shape
    bn, bk = block
    rows = x.numel() // k if k else 0
    if (x.shape[-1] != k or not 1 <= rows <= FP8_ROWS_MAX or weight.dtype != torch.float8_e4m3fn
            or not weight.is_contiguous() or weight.device.type != "cpu" or bn < 1 or bk < 1
            or scale_inv.dtype != torch.float32 or scale_inv.shape != (-(-n // bn), -(-k // bk))
            or not scale_inv.is_contiguous()):
        raise ValueError(f"gemm_fp8 takes 1 to {FP8_ROWS_MAX} rows of {k} values, a contiguous float8_e4m3fn CPU "
                         f"weight and float32 block scales [ceil(N / bn), ceil(K / bk)], got x {tuple(x.shape)}, "
                         f"weight {weight.dtype} {tuple(weight.shape)}, scales {tuple(scale_inv.shape)} "
                         f"{scale_inv.dtype} and block {tuple(block)}")
    xs = x.to(torch.float32).contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.gemm_fp8(weight, scale_inv, bn, bk, xs, y, rows, n, k, torch.get_num_threads())
    return y


# a weight operand of the tables: float32 [N, K]; int8 [N, K] with float32 row scales [N]; or int4 nibbles
# [N, Kp / 2] (pack_int4) with float16 group scales [N, Kp / 32]
Operand = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

INT4_GROUP = 32  # int4 weights: one float16 scale per this many values along K (csrc/gemv_int4.c)
INT4_ROWS_MAX = 64  # int4 products of up to this many rows take the kernel, eight rows at a time


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Integer ``q [N, Kp]`` (values in [-8, 7], ``Kp`` a multiple of ``INT4_GROUP``) -> the packed nibbles
    ``[N, Kp / 2]`` uint8 the int4 kernel reads: in each group of 32 values, byte ``j`` holds ``q[j] + 8`` in its low
    nibble and ``q[j + 16] + 8`` in its high nibble (the order of ggml's Q4_0 blocks). Any device."""
    n, kp = q.shape
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(n, kp // INT4_GROUP, 2, INT4_GROUP // 2)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(n, kp // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``pack_int4``'s inverse: int8 ``[N, Kp]`` with values in [-8, 7]."""
    n, half = packed.shape
    b = packed.view(n, half // (INT4_GROUP // 2), 1, INT4_GROUP // 2)
    return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(n, 2 * half).to(torch.int8) - 8


INT4_VARIANTS = ("avx2", "avx512_vnni")  # the int4 kernel's variants (enum in csrc/gemv_int4.c), slowest first


@functools.cache
def int4_variants() -> tuple[str, ...]:
    """The int4 kernel's variants this CPU executes (``INT4_VARIANTS``; empty where the library does not build)."""
    lib, _ = _load()
    if lib is None:
        return ()
    mask = int(lib.i4_variants())
    return tuple(name for i, name in enumerate(INT4_VARIANTS) if mask >> i & 1)


def int4_from_stored(stored: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized int4 bytes (``[N, K / 2]`` uint8, ``K`` a multiple of 32: byte ``b`` of a
    row holds values ``2b`` and ``2b + 1``, low nibble first) -> ``pack_int4``'s order, one pass over the bytes. Only
    where ``failure()`` is None."""
    lib, _ = _load()
    assert lib is not None, "int4_from_stored needs the kernel library: check failure() first"
    if stored.dtype != torch.uint8 or stored.dim() != 2 or stored.shape[1] % (INT4_GROUP // 2) or stored.is_cuda:
        raise ValueError(f"int4_from_stored takes uint8 CPU bytes [N, K / 2] with K a multiple of {INT4_GROUP}, got "
                         f"{stored.dtype} {tuple(stored.shape)}")
    src = stored.contiguous()
    out = torch.empty_like(src)
    lib.i4_from_stored(src, out, src.numel() // (INT4_GROUP // 2), torch.get_num_threads())
    return out


@functools.cache
def int4_failure() -> str | None:
    """None where the int4 kernel (``csrc/gemv_int4.c``) is built and exact on this machine in every variant it
    executes, else why not. Checks the widening of every finite float16 scale, then products with row and group tails
    whose activations round to themselves (each group's largest magnitude 127: scale 1) and whose sums are exact in
    float32, against float64."""
    why = failure()
    if why is not None:
        return why
    if not int4_variants():
        return "the CPU lacks f16c"
    for variant in int4_variants():
        why = _int4_variant_failure(variant)
        if why is not None:
            return why
    return None


def _int4_variant_failure(variant: str) -> str | None:
    # every finite float16 bit pattern as a scale: row j of x picks group j of each weight row, times 127
    bits = torch.arange(1 << 16, dtype=torch.int32)
    finite = bits[(bits & 0x7C00) != 0x7C00].to(torch.int16).view(torch.float16)
    groups = 32
    n = finite.numel() // groups
    scales = finite[:n * groups].reshape(n, groups)
    q = torch.zeros(n, groups * INT4_GROUP, dtype=torch.int8)
    q[:, ::INT4_GROUP] = 1
    x = torch.zeros(groups, groups * INT4_GROUP)
    x[torch.arange(groups), torch.arange(groups) * INT4_GROUP] = 127.0
    if not torch.equal(gemm_int4(x, pack_int4(q), scales, variant), scales.float().T * 127):
        return f"the int4 kernel ({variant}) widens float16 scales wrongly on this CPU"
    g = torch.Generator().manual_seed(0)
    for n, k, rows in ((37, 64, 1), (37, 96, 3), (9, 40, 9), (70, 512, 13), (5, 32, 64), (6, 200, 5)):
        kp = -(-k // INT4_GROUP) * INT4_GROUP
        q = torch.randint(-8, 8, (n, kp), generator=g, dtype=torch.int8)
        q[:, k:] = 0
        x = torch.randint(-3, 4, (rows, k), generator=g).float()
        x[:, ::INT4_GROUP] = 127.0 * (torch.randint(0, 2, x[:, ::INT4_GROUP].shape, generator=g) * 2 - 1)
        one = torch.randint(-(1 << 15), 1 << 15, (n, 1), generator=g, dtype=torch.int32)  # one scale a row: any value
        one = torch.where((one & 0x7C00) == 0x7C00, one & ~0x4000, one).to(torch.int16).view(torch.float16)
        one = torch.where(one.float().abs() > 1e3, one / 256, one)  # sums of products stay exact in float32
        per_group = torch.tensor([0.25, 0.5, 1.0, 2.0])[torch.randint(0, 4, (n, kp // INT4_GROUP), generator=g)]
        for scales in (one.expand(n, kp // INT4_GROUP).contiguous(), per_group.half()):
            wide = (q.double().view(n, -1, INT4_GROUP) * scales.double().unsqueeze(2)).view(n, kp)[:, :k]
            if not torch.equal(gemm_int4(x, pack_int4(q), scales, variant).double(), x.double() @ wide.T):
                return f"the int4 kernel's ({variant}) products differ from the exact result on this CPU"
    return None


def quantize_q8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How the int4 kernel rounds its input rows (``csrc/gemv_int4.c``), in torch: ``x [..., K]`` float32 -> (``q
    [..., Kp]`` int8, zero past ``K``; ``scale [..., Kp / 32]`` float32), ``x ≈ q * scale`` per group of 32 with
    ``scale = amax / 127`` and ``q = round(x * (127 / amax))`` to nearest even (NaN scales where a group is not
    finite)."""
    k = x.shape[-1]
    kp = -(-k // INT4_GROUP) * INT4_GROUP
    v = torch.nn.functional.pad(x.float(), (0, kp - k)).unflatten(-1, (-1, INT4_GROUP))
    amax = v.abs().amax(-1, keepdim=True)
    finite = v.isfinite().all(-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    q = torch.where(finite & (amax > 0), torch.round(v * (127.0 / safe)).clamp(-127, 127), torch.zeros_like(v))
    scale = torch.where(finite, torch.where(amax > 0, amax / 127.0, torch.zeros_like(amax)),
                        torch.full_like(amax, float("nan")))
    return q.to(torch.int8).flatten(-2), scale.squeeze(-1)


def gemm_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, variant: str | None = None
              ) -> torch.Tensor:
    """``x · Wᵀ`` in float32 for 1 to ``INT4_ROWS_MAX`` rows ``x [..., K]`` (any float dtype) and a group-wise int4
    weight ``W [N, K]``: contiguous ``packed [N, Kp / 2]`` uint8 (``pack_int4``; ``Kp`` is ``K`` rounded up to a
    multiple of ``INT4_GROUP``, the padding zero) and contiguous float16 ``scales [N, Kp / 32]``, read at half a byte
    per weight. Each row is rounded to int8 with a scale per group of 32 (``quantize_q8_groups``: ggml's Q8_0
    activations), each group is an exact integer dot product, summed in float32 times the two groups' scales. A row's
    result does not depend on the other rows, nor on the variant (``int4_variants()``; default: the fastest).
    Only where ``int4_failure()`` is None."""
    lib, _ = _load()
    assert lib is not None, "gemm_int4 needs the kernel: check int4_failure() first"
    n, half = packed.shape
    k = x.shape[-1]
    kp = -(-k // INT4_GROUP) * INT4_GROUP
    rows = x.numel() // k if k else 0
    if (not 1 <= rows <= INT4_ROWS_MAX or 2 * half != kp or packed.dtype != torch.uint8 or not packed.is_contiguous()
            or packed.device.type != "cpu" or scales.dtype != torch.float16 or scales.shape != (n, kp // INT4_GROUP)
            or not scales.is_contiguous()):
        raise ValueError(f"gemm_int4 takes 1 to {INT4_ROWS_MAX} rows of K values, contiguous uint8 nibbles [N, Kp / 2] "
                         f"and float16 scales [N, Kp / {INT4_GROUP}] (Kp: K rounded up to a multiple of {INT4_GROUP}), "
                         f"got x {tuple(x.shape)}, packed {packed.dtype} {tuple(packed.shape)} and scales "
                         f"{scales.dtype} {tuple(scales.shape)}")
    variant = int4_variant() if variant is None else variant
    if variant not in int4_variants():
        raise ValueError(f"gemm_int4: this CPU runs the int4 variants {list(int4_variants())}, not {variant!r}")
    xs = x.to(torch.float32).contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.gemm_i4(packed, scales, xs, y, rows, n, k, torch.get_num_threads(), INT4_VARIANTS.index(variant))
    return y


def int4_variant() -> str:
    """The int4 variant products and tables take here: the fastest this CPU executes."""
    variants = int4_variants()
    if not variants:
        raise ValueError("no int4 kernel variant runs on this CPU: check int4_failure() first")
    return variants[-1]


def absorbed_decode(q_n: torch.Tensor, q_r: torch.Tensor, w_uk: torch.Tensor, w_uv_t: torch.Tensor,
                    cache: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """A layer's absorbed decode attention in one call (``csrc/mla_decode_f32.c``), float32 on the CPU:
    ``q_n [T, H, d_n]`` and rotated ``q_r [T, H, d_r]`` (any row and head strides), ``w_uk [H, d_n, d_c]``,
    ``w_uv_t [H, d_c, d_v]`` (float32, or both bfloat16: read at half the bytes), ``cache [S, d_c + d_r]`` (flat
    latent rows), ``slots [T, L]`` int64 (row t's keys: ``cache[slots[t, :lens[t]]]``) and ``lens [T]`` int64 (each
    >= 1, <= L) -> ``out [T, H, d_v]``. Only where ``failure()`` is None; the caller guarantees the slots are valid
    rows of ``cache``."""
    lib, _ = _load()
    assert lib is not None, "absorbed_decode needs the kernel: check failure() first"
    rows, heads, d_n = q_n.shape
    d_r, (d_c, d_v) = q_r.shape[2], w_uv_t.shape[1:]
    q_n, q_r = (q if q.stride(2) == 1 else q.contiguous() for q in (q_n, q_r))
    # (checked without widening the factors: a copy of both per call would cost more than the attention)
    if (any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (q_n, q_r, cache))
            or w_uk.dtype not in (torch.float32, torch.bfloat16) or w_uk.device.type != "cpu"
            or w_uv_t.dtype != w_uk.dtype or w_uv_t.device.type != "cpu"
            or q_r.shape[:2] != (rows, heads)
            or w_uk.shape != (heads, d_n, d_c) or not w_uk.is_contiguous() or not w_uv_t.is_contiguous()
            or cache.shape[1] != d_c + d_r or not cache.is_contiguous()
            or slots.dtype != torch.int64 or slots.shape[0] != rows or slots.stride(1) != 1
            or lens.dtype != torch.int64 or lens.shape != (rows,) or not lens.is_contiguous()):
        raise ValueError(f"absorbed_decode: q_n {tuple(q_n.shape)}, q_r {tuple(q_r.shape)}, w_uk {tuple(w_uk.shape)}, "
                         f"w_uv_t {tuple(w_uv_t.shape)}, cache {tuple(cache.shape)}, slots {tuple(slots.shape)} "
                         f"{slots.dtype} and lens {tuple(lens.shape)} {lens.dtype} do not fit one float32 layer")
    threads = max(torch.get_num_threads(), -(-heads // DECODE_MAX_GROUP))  # at most DECODE_MAX_GROUP heads a thread
    per_row = -(-heads // threads) * 2 * d_c  # scratch floats a row takes per thread (q~ and o_lat of its heads)
    step = max(1, DECODE_SCRATCH_BYTES // (4 * threads * per_row))  # rows per call: bounds the scratch
    out = torch.empty(rows, heads, d_v, dtype=torch.float32)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        stride = n * per_row + -(-heads // threads) * slots.shape[1]  # per thread: see the C source
        scratch = torch.empty(threads, stride, dtype=torch.float32)
        lib.absorbed_decode(q_n[r0:], q_n.stride(0), q_n.stride(1), q_r[r0:], q_r.stride(0), q_r.stride(1), w_uk,
                            w_uv_t, cache, slots[r0:], slots.stride(0), lens[r0:], scale, out[r0:], scratch, stride,
                            n, heads, d_n, d_r, d_c, d_v, threads)
    return out


def rope_store(latent: torch.Tensor, norm: torch.Tensor, eps: float, q: torch.Tensor, d_n: int, cos: torch.Tensor,
               sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, interleave: bool) -> None:
    """The latent side of a float32 decode step in one call, on one thread: for each row ``t`` of ``latent [T,
    d_c + d_r]`` (``[c ; k_r]`` from ``kv_a_proj_with_mqa``), ``cache[slots[t]] = [RMSNorm(c) * norm ; RoPE(k_r)]``,
    and the RoPE part of each head of ``q [T, H, d_n + d_r]`` rotated in place (de-interleaved, as
    ``mla_runtime.layers.rotary``). ``cos``/``sin [T, d_r / 2]`` (rows with a stride), ``cache [S, d_c + d_r]``,
    ``slots [T]`` int64 (all valid). Only where ``failure()`` is None."""
    lib, _ = _load()
    assert lib is not None, "rope_store needs the kernel: check failure() first"
    rows, width = latent.shape
    d_r = q.shape[2] - d_n
    d_c = width - d_r
    tensors = (latent, norm, q, cos, sin, cache)
    if (any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors) or latent.stride(1) != 1
            or q.shape[0] != rows or q.stride(2) != 1 or norm.shape != (d_c,) or not norm.is_contiguous()
            or cos.shape != (rows, d_r // 2) or sin.shape != cos.shape or cos.stride(1) != 1
            or sin.stride() != cos.stride() or cache.shape[1] != width or not cache.is_contiguous()
            or slots.dtype != torch.int64 or slots.shape != (rows,) or not slots.is_contiguous()):
        raise ValueError(f"rope_store: latent {tuple(latent.shape)}, q {tuple(q.shape)}, cos {tuple(cos.shape)}, cache "
                         f"{tuple(cache.shape)} and slots {tuple(slots.shape)} {slots.dtype} do not fit one float32 "
                         "decode step")
    lib.rope_store(latent, latent.stride(0), norm, eps, q, q.stride(0), q.stride(1), q.shape[1], d_n, cos, sin,
                   cos.stride(0), cache, slots, rows, d_c, d_r, int(interleave))


DECODE_MAX_GROUP = 256  # heads one thread of the decode kernel takes (MAX_GROUP in csrc/mla_decode_f32.c)
DECODE_SCRATCH_BYTES = 64 << 20  # the decode kernel's scratch per call; more rows are split over calls


NORM_MAX_ROWS = 64  # RMSNorm of up to this many rows takes the one-thread kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (K,), weight, eps)`` for float32 ``x [..., K]`` (rows with a stride, last dimension
    contiguous) and a contiguous float32 ``weight [K]``, on one thread; only where ``failure()`` is None."""
    lib, _ = _load()
    assert lib is not None, "rms_norm needs the kernel: check failure() first"
    k, shape = weight.shape[0], x.shape
    if x.dim() != 2:
        x = x.reshape(-1, k)
    if (x.shape[1] != k or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.stride(1) != 1
            or not weight.is_contiguous()):
        raise ValueError(f"rms_norm takes float32 rows of {k} values and a contiguous float32 weight, got x "
                         f"{tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}")
    y = torch.empty(x.shape, dtype=torch.float32)
    lib.rms_norm_f32(x, x.stride(0), weight, y, x.shape[0], k, eps)
    return y.view(shape)


ROUTE_SCORING = ("softmax", "sigmoid")
ROUTE_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
MOE_MAX_TOPK = 64  # as csrc/gemv_f32.c


def route_config(scoring: str, method: str, n_experts: int, n_group: int, topk_group: int, top_k: int,
                 norm_topk_prob: bool) -> torch.Tensor | None:
    """The routing settings ``GatedMLPTable.moe_row`` passes to the kernel, or None where it does not route them."""
    if (scoring not in ROUTE_SCORING or method not in ROUTE_METHODS or not 1 <= top_k <= min(n_experts, MOE_MAX_TOPK)
            or n_group < 1 or n_experts % n_group or not 1 <= topk_group <= n_group
            or (method == "noaux_tc" and n_group > 1 and n_experts // n_group < 2)):
        return None
    return torch.tensor([ROUTE_SCORING.index(scoring), ROUTE_METHODS.index(method), n_group, topk_group, top_k,
                         int(norm_topk_prob), n_experts, 0], dtype=torch.int64)


def operand_tensors(operand: Operand, shape: tuple[int, int], name: str, keep: list[object]
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight operand of a table as (weight, scales or None), checked against the ``[N, K]`` matrix it stands for: a
    contiguous float32 or bfloat16 tensor, an int8 ``(qweight, float32 row scales)`` pair or an int4 ``(packed uint8
    [N, Kp / 2], float16 scales [N, Kp / 32])`` pair (run by ``int4_variant()``). ``keep`` holds the tensors (the
    tables point into them)."""
    n, k = shape
    kp = -(-k // INT4_GROUP) * INT4_GROUP
    want: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    if isinstance(operand, tuple):
        weight, scales = operand
        if weight.dtype == torch.uint8:
            want = ((torch.uint8, (n, kp // 2)), (torch.float16, (n, kp // INT4_GROUP)))
        else:
            want = ((torch.int8, (n, k)), (torch.float32, (n,)))
    elif operand.dtype == torch.bfloat16:
        weight, scales, want = operand, None, ((torch.bfloat16, (n, k)),)
    else:
        weight, scales, want = operand, None, ((torch.float32, (n, k)),)
    for t, (dtype, dims) in zip((weight, scales), want):
        assert t is not None
        if t.dtype != dtype or tuple(t.shape) != dims or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name}: a weight [{n}, {k}] is a contiguous float32 or bfloat16 tensor, int8 with "
                             f"float32 row scales, or int4 nibbles with float16 group scales; got {t.dtype} "
                             f"{list(t.shape)} where {dtype} {list(dims)} was expected")
    if weight.dtype == torch.uint8 and int4_failure() is not None:
        raise ValueError(f"{name}: the int4 kernel does not run here: {int4_failure()}")
    keep += [weight, scales]
    return weight, scales


def _i4_variant() -> int:
    """The int4 variant the tables' int4 operands run (0 where none runs: the tables then hold no int4 operand)."""
    return INT4_VARIANTS.index(int4_variant()) if int4_failure() is None else 0


def operand_rows(operand: Operand) -> int:
    """The number of rows ``N`` of an operand's matrix."""
    return (operand[0] if isinstance(operand, tuple) else operand).shape[0]


class GatedMLPTable:
    """The weights of gated MLPs (a MoE layer's experts and shared experts, or one dense MLP) as the one-row kernel
    reads them: ``mlps`` lists each MLP's ``(gate_up [2I, d], down [d, I])`` operands (``operand_tensors``). Holds
    them alive while it exists."""

    def __init__(self, mlps: list[tuple[Operand, Operand]]) -> None:
        lib, why = _load()
        if lib is None:
            raise ValueError(f"GatedMLPTable needs the kernels: {why}")
        self.keep: list[object] = []
        self.hidden = operand_rows(mlps[0][1])
        parts: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        inters = []
        for gate_up, down in mlps:
            inter = operand_rows(gate_up) // 2
            if operand_rows(down) != self.hidden:
                raise ValueError(f"GatedMLPTable: a down projection of {operand_rows(down)} rows in MLPs of width "
                                 f"{self.hidden}")
            parts += [operand_tensors(gate_up, (2 * inter, self.hidden), "GatedMLPTable", self.keep),
                      operand_tensors(down, (self.hidden, inter), "GatedMLPTable", self.keep)]
            inters.append(inter)
        self.table = lib.mlp_table([w for w, _ in parts[0::2]], [s for _, s in parts[0::2]],
                                   [w for w, _ in parts[1::2]], [s for _, s in parts[1::2]], _i4_variant())
        self.max_inter = max(inters)

    def __call__(self, x: torch.Tensor, ids: list[int], weights: list[float]) -> torch.Tensor:
        """``sum_i weights[i] * mlp_{ids[i]}(x)`` for one float32 row ``x [..., d]``; where ``failure()`` is None."""
        lib, _ = _load()
        assert lib is not None, "GatedMLPTable needs the kernel: check failure() first"
        if (x.numel() != self.hidden or x.dtype != torch.float32 or not ids or len(ids) != len(weights)
                or not 0 <= min(ids) <= max(ids) < len(self.table)):
            raise ValueError(f"GatedMLPTable takes one float32 row of {self.hidden} values and one weight per MLP, "
                             f"got x {tuple(x.shape)} {x.dtype}, MLPs {ids} of {len(self.table)} and {len(weights)} "
                             "weights")
        row = x.contiguous()
        y = torch.empty(x.shape, dtype=torch.float32)
        scratch = torch.empty(3 * self.max_inter, dtype=torch.float32)
        lib.gated_mlps(row, y, self.hidden, self.table, list(ids), [float(w) for w in weights], scratch,
                       torch.get_num_threads())
        return y

    def moe_row(self, x: torch.Tensor, router: torch.Tensor, route: torch.Tensor, bias: torch.Tensor | None,
                scaling: float, first: int, count: int, shared: int) -> torch.Tensor:
        """A MoE layer for one float32 row ``x [..., d]`` in one call: router logits (``router [E, d]`` float32), the
        routing ``route`` (``route_config``; ``bias`` its noaux_tc correction), then the chosen experts this table
        holds (global ids ``first .. first + count - 1`` are its rows ``0 .. count - 1``) and the shared experts
        (row ``shared``, or -1), summed. Only where ``failure()`` is None."""
        lib, _ = _load()
        assert lib is not None, "moe_row needs the kernel: check failure() first"
        n_experts, n_group = int(route[6]), int(route[2])
        if (x.numel() != self.hidden or x.dtype != torch.float32 or router.shape != (n_experts, self.hidden)
                or router.dtype != torch.float32 or not router.is_contiguous() or not 0 <= count <= len(self.table)
                or not -1 <= shared < len(self.table) or (bias is not None and (bias.shape != (n_experts,)
                                                                                  or bias.dtype != torch.float32))):
            raise ValueError(f"moe_row takes one float32 row of {self.hidden} values and a float32 router "
                             f"[{n_experts}, {self.hidden}], got x {tuple(x.shape)} {x.dtype} and router "
                             f"{tuple(router.shape)} {router.dtype}")
        row = x.contiguous()
        y = torch.empty(x.shape, dtype=torch.float32)
        scratch = torch.empty(3 * self.max_inter + 5 * n_experts + n_group + MOE_MAX_TOPK + 1, dtype=torch.float32)
        lib.moe_row(row, y, self.hidden, router, route, bias, scaling, self.table, first, count, shared, scratch,
                    self.max_inter, torch.get_num_threads())
        return y



LAYER_DIMS = ("d", "q_lora", "heads", "d_n", "d_r", "d_c", "d_v")


@dataclass
class LayerWeights:
    """One decoder layer's weights for ``DecoderLayerTable`` (float32 unless said): ``norms`` the input,
    post-attention, ``q_a`` (None without ``q_lora``) and ``kv_a`` RMSNorm weights with ``eps`` theirs; ``qa`` the
    stacked ``[q_a ; kv_a]`` projection with ``q_lora``, else ``q_proj`` (and ``kva`` then ``kv_a``); ``qb`` ``q_b``
    with ``q_lora``; ``w_uk [H, d_n, d_c]``, ``w_uv_t [H, d_c, d_v]`` (float32, or both bfloat16); ``o`` ``o_proj``.
    ``mlp``: the MLP's
    ``GatedMLPTable`` (a dense MLP: its row 0) or None (the caller runs the MLP); a MoE layer adds ``moe``: its router
    weight ``[E, d]``, ``route_config``, correction bias (or None), scaling factor and the table's first expert id,
    expert count and shared row, as ``GatedMLPTable.moe_row`` takes them."""

    dims: dict[str, int]  # LAYER_DIMS
    norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]
    eps: tuple[float, float, float, float]
    scale: float
    interleave: bool
    qa: Operand
    kva: Operand | None
    qb: Operand | None
    w_uk: torch.Tensor
    w_uv_t: torch.Tensor
    o: Operand
    mlp: GatedMLPTable | None = None
    moe: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float, int, int, int] | None = None


class DecoderLayerTable:
    """A decoder layer's weights as ``decoder_layer`` reads them (``LayerWeights``), checked once here: the calls
    trust them. Holds the tensors alive."""

    def __init__(self, w: LayerWeights) -> None:
        lib, why = _load()
        if lib is None:
            raise ValueError(f"DecoderLayerTable needs the kernels: {why}")
        self.keep: list[object] = []
        d, q_lora, heads, d_n, d_r, d_c, d_v = (w.dims[k] for k in LAYER_DIMS)
        qk = d_n + d_r
        if (w.kva is None) != bool(q_lora) or (w.qb is None) != (not q_lora) or (w.norms[2] is None) != (not q_lora):
            raise ValueError("DecoderLayerTable: with q_lora the stacked q_a/kv_a, q_b and the q_a norm; without, "
                             "q_proj and kv_a")
        norms = [None if norm is None else self._tensor(name, norm, torch.float32, (width,)) for name, norm, width in
                 zip(("in_norm", "post_norm", "q_norm", "kv_norm"), w.norms, (d, d, q_lora, d_c))]
        q_out = q_lora + d_c + d_r if q_lora else heads * qk
        operands: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        for name, operand, shape in (("qa", w.qa, (q_out, d)), ("kva", w.kva, (d_c + d_r, d)),
                                     ("qb", w.qb, (heads * qk, q_lora)), ("o", w.o, (d, heads * d_v))):
            operands[name] = (None, None) if operand is None else operand_tensors(
                operand, shape, f"DecoderLayerTable: {name}", self.keep)
        w_dtype = torch.bfloat16 if w.w_uk.dtype == torch.bfloat16 else torch.float32
        w_uk = self._tensor("w_uk", w.w_uk, w_dtype, (heads, d_n, d_c))
        w_uv_t = self._tensor("w_uv_t", w.w_uv_t, w_dtype, (heads, d_c, d_v))
        mlp, scaling, max_inter, moe = self._mlp(w)
        router, route, bias, first, count, shared = moe
        floats = torch.tensor([*w.eps, w.scale, scaling], dtype=torch.float32)
        self.keep.append(floats)
        self.heads, self.hidden, self.d_c = heads, d, d_c
        self.runs_mlp = w.mlp is not None
        self.table = lib.layer_table(norms[0], norms[1], norms[2], norms[3], *operands["qa"], *operands["kva"],
                                     *operands["qb"], w_uk, w_uv_t, *operands["o"], mlp, max_inter, router, route,
                                     bias, first, count, shared, [w.dims[k] for k in LAYER_DIMS], w.interleave,
                                     floats, _i4_variant())

    def _mlp(self, w: LayerWeights) -> tuple[torch.Tensor | None, float, int, tuple[Any, ...]]:
        """(the MLP table or None, the routed scaling factor, the largest intermediate width, (router, route, bias,
        first, count, shared) of a MoE layer)."""
        mlp = w.mlp
        none = (None, None, None, 0, 0, -1)
        if mlp is None:
            return None, 0.0, 0, none
        if mlp.hidden != w.dims["d"]:
            raise ValueError(f"DecoderLayerTable: the MLP table's width {mlp.hidden} is not the layer's {w.dims['d']}")
        self.keep.append(mlp)
        if w.moe is None:
            return mlp.table, 0.0, mlp.max_inter, none
        router, route, bias, scaling, first, count, shared = w.moe
        n_experts = int(route[6])
        router = self._tensor("router", router, torch.float32, (n_experts, w.dims["d"]))
        route = self._tensor("route", route, torch.int64, (8,))
        if bias is not None:
            bias = self._tensor("route_bias", bias, torch.float32, (n_experts,))
        if not (0 <= count <= len(mlp.table) and -1 <= shared < len(mlp.table)):
            raise ValueError(f"DecoderLayerTable: experts {count} and shared row {shared} do not fit the MLP table")
        return mlp.table, scaling, mlp.max_inter, (router, route, bias, first, count, shared)

    def _tensor(self, name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"DecoderLayerTable: {name} must be a contiguous {dtype} CPU tensor {list(shape)}, got "
                             f"{t.dtype} {list(t.shape)}")
        self.keep.append(t)
        return t


class DecodeStep:
    """A decode step's rows as ``decoder_layer`` reads them: ``rows`` query rows (1 to ``FEW_ROWS_MAX``), RoPE tables
    ``cos``/``sin [T, d_r / 2]`` (rows with a stride), each row's cache slot ``slots [T]`` and its keys' slots
    ``keys [T, L]`` with their counts ``lens [T]`` (int64; ``DecodePlan``), for layers of ``heads`` heads and latent
    width ``d_c``; one scratch buffer serves every layer of the step."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                 lens: torch.Tensor, heads: int, d_c: int, table: DecoderLayerTable) -> None:
        rows = slots.shape[0]
        if (not 1 <= rows <= FEW_ROWS_MAX or cos.dtype != torch.float32 or cos.shape[0] != rows
                or cos.stride(1) != 1 or sin.shape != cos.shape or sin.stride() != cos.stride()
                or slots.dtype != torch.int64 or not slots.is_contiguous() or keys.dtype != torch.int64
                or keys.shape[0] != rows or keys.stride(1) != 1 or lens.dtype != torch.int64 or lens.shape != (rows,)
                or not lens.is_contiguous()):
            raise ValueError(f"DecodeStep: cos {tuple(cos.shape)}, slots {tuple(slots.shape)} {slots.dtype}, keys "
                             f"{tuple(keys.shape)} {keys.dtype} and lens {tuple(lens.shape)} {lens.dtype} do not fit "
                             f"1 to {FEW_ROWS_MAX} decode rows")
        self.keep = (cos, sin, slots, keys, lens)
        threads = torch.get_num_threads()
        decode_threads = max(threads, -(-heads // DECODE_MAX_GROUP))  # as absorbed_decode
        group = -(-heads // decode_threads)
        lib, _ = _load()
        assert lib is not None, "DecodeStep needs the kernels: check failure() first"
        self.rows, self.heads, self.d_c = rows, heads, d_c
        self.table = lib.step_table(cos, sin, slots, keys, lens, threads, decode_threads,
                                    rows * group * 2 * d_c + group * keys.shape[1])
        self.scratch = torch.empty(lib.decoder_layer_scratch(table.table, self.table), dtype=torch.float32)

    def fits(self, table: DecoderLayerTable) -> bool:
        """Whether this step serves ``table``'s layer (the same heads and latent width); the scratch grows to what the
        layer needs (a model's dense and MoE layers need different amounts)."""
        if table.heads != self.heads or table.d_c != self.d_c:
            return False
        lib, _ = _load()
        assert lib is not None
        need = lib.decoder_layer_scratch(table.table, self.table)
        if need > self.scratch.numel():
            self.scratch = torch.empty(need, dtype=torch.float32)
        return True


def decoder_layer(table: DecoderLayerTable, step: DecodeStep, x: torch.Tensor, cache: torch.Tensor
                  ) -> torch.Tensor | None:
    """One decoder layer over ``step``'s rows (``csrc/mla_layer_f32.c``): ``x [T, d]`` (contiguous float32) updated in
    place, the new latents written into ``cache`` (the layer's ``[S, d_c + d_r]`` float32 rows; the step's slots and
    keys are valid rows of it). Returns None when the layer's MLP ran too (the table has one), else ``RMSNorm(x)``
    (post-attention, a view of the step's scratch, valid until the next call) for the caller's MLP. Only where
    ``failure()`` is None."""
    lib, _ = _load()
    assert lib is not None, "decoder_layer needs the kernels: check failure() first"
    if (x.shape != (step.rows, table.hidden) or x.dtype != torch.float32 or not x.is_contiguous()
            or cache.dtype != torch.float32 or not cache.is_contiguous() or not step.fits(table)):
        raise ValueError(f"decoder_layer: x {tuple(x.shape)} {x.dtype} and cache {tuple(cache.shape)} {cache.dtype} do "
                         f"not fit a layer of width {table.hidden} over {step.rows} rows")
    if lib.decoder_layer(table.table, step.table, x, cache, step.scratch):
        return None
    return step.scratch[:x.numel()].view(x.shape)
