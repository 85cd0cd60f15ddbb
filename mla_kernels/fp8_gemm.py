"""Block-FP8 matrix products on CUDA (Triton), for weights stored as DeepSeek-V3-style checkpoints store them.

A weight ``W [N, K]`` is ``weight [N, K]`` float8_e4m3fn with ``scale_inv [ceil(N / bn), ceil(K / bk)]`` float32,
one scale per ``bn × bk`` block: ``W[n, k] = weight[n, k] * scale_inv[n // bn, k // bk]``. The product ``y = x · Wᵀ``
runs in two kernels:

1. ``act_quant_fp8``: each row of ``x`` is quantised in groups of ``bk`` values (the weight's K blocks), one float32
   scale per group::

       s[m, g] = max(amax_g |x[m, :]|, 1e-10) / 448        xq[m, k] = e4m3(x[m, k] / s[m, k // bk])

   rounded to nearest (ties to even) with the division correctly rounded, so that it equals the same computation in
   torch (``(x / s).to(torch.float8_e4m3fn)``) value for value.
2. the GEMM: a program computes a ``BLOCK_M × BLOCK_N`` tile of ``y`` walking K one block (``BLOCK_K = bk``) at a
   time; each block's fp8 × fp8 product (``tl.dot``, float32 result) is multiplied by both scales (the activation
   scale per row, the weight scale per column) and added into a float32 accumulator, so the tensor cores' own
   accumulation never spans more than one block. The result is written in ``x``'s dtype, after an optional bias.

Partial blocks in N and K are masked; ``bn`` may be anything (one scale row per output row included), ``bk`` a power
of two of at least 16 (a ``tl.dot`` dimension). ``fp8_grouped_gemm`` runs several experts' matrices (``[E, N, K]``
with ``[E, ...]`` scales) in one launch over tokens sorted by expert: a small table maps each program's row tile to
its expert (made on the device from the per-expert offsets, without a host synchronisation), and experts without
tokens get no programs.

Triton's float8_e4m3fn type needs NVIDIA sm_89+ (Ada, Hopper, Blackwell). Under ``TRITON_INTERPRET=1`` the kernels
run on CPU tensors (the tests).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import triton_interpreting

FP8_MAX = 448.0
ACT_SCALE_EPS = 1e-10  # a group whose largest magnitude is below this is scaled as if it were this (all-zero: 0s)
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_QUANT_ROWS = 16  # rows per program of the activation quantisation


@triton.jit
def _round_to_e4m3(v):
    """``v`` (float32, |v| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, still as float32: the
    conversion that follows is exact (the interpreter's own rounding conversion mishandles mantissa carries)."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000  # from 2^-6 up: keep 3 mantissa bits
    # below 2^-6 (the subnormals, spaced 2^-9): adding 1.5 * 2^14 rounds to that spacing
    a = tl.abs(v)
    subnormal = ((a + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
    return (tl.where(a < 0.015625, subnormal, normal) | sign).to(tl.float32, bitcast=True)  # -0 stays -0


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                      GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK_G)
    cols = g * GROUP + offs
    mask_m = rows < M
    mask = mask_m[:, None] & (cols[None, :] < K) & (offs[None, :] < GROUP)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10)  # ACT_SCALE_EPS
    s = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    v = tl.div_rn(x, s[:, None])
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    q = _round_to_e4m3(v).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows64 * stride_sm + g, s, mask=mask_m)


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr, tile_expert_ptr, tile_row_ptr, row_end_ptr,
                     M, N, K, stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm,
                     SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:  # this row tile's expert (-1: a spare program) and first row
        expert = tl.load(tile_expert_ptr + pid_m)
        if expert < 0:
            return
        row0 = tl.load(tile_row_ptr + pid_m)
        row_end = tl.load(row_end_ptr + expert)
        b_ptr += expert.to(tl.int64) * stride_be
        bs_ptr += expert.to(tl.int64) * stride_bse
    else:
        row0 = pid_m * BLOCK_M
        row_end = M
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = rows < row_end
    mask_n = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    a_ptrs = a_ptr + rows64[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + cols64[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: W read K-major
    as_ptrs = as_ptr + rows64 * stride_asm
    bs_ptrs = bs_ptr + (cols // SCALE_BN).to(tl.int64) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        part = tl.dot(a, b, out_dtype=tl.float32)  # one K block: the scales are applied before the next
        a_s = tl.load(as_ptrs + kb, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=mask_n, other=0.0)
        acc += part * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rows64[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_gemm_failure(device: torch.device | str) -> str | None:
    """None where the Triton kernels run on ``device``'s tensors, else why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return None if triton_interpreting() else ("the Triton FP8 kernels need CUDA tensors (or TRITON_INTERPRET=1 "
                                                   "set before triton is imported)")
    return _cuda_failure(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_failure(index: int) -> str | None:
    if torch.version.hip is not None:
        return "the Triton FP8 kernels are written for NVIDIA's float8_e4m3fn (sm_89+), not ROCm"
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 9):
        return f"Triton's float8_e4m3fn needs sm_89+ (Ada, Hopper, ...), this GPU is sm_{major}{minor}"
    return None


def _check_device(t: torch.Tensor, name: str) -> None:
    why = fp8_gemm_failure(t.device)
    if why is not None:
        raise ValueError(f"{name}: {why}")


def _check_block(block: tuple[int, int], name: str) -> tuple[int, int]:
    if len(block) != 2 or not all(isinstance(b, int) and b >= 1 for b in block):
        raise ValueError(f"{name}: block must be two positive ints (rows, columns), got {block!r}")
    bn, bk = block
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"{name}: the block's columns must be a power of two >= 16 (one K step of tl.dot), got {bk}")
    return bn, bk


def act_quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (float32/bfloat16/float16, last dimension contiguous) -> (``xq [M, K]`` float8_e4m3fn,
    ``s [M, ceil(K / group)]`` float32): each row quantised in groups of ``group`` values (module docstring)."""
    if x.dim() != 2 or x.dtype not in ACT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"act_quant_fp8: x must be a 2-D float32/bfloat16/float16 tensor with a contiguous last "
                         f"dimension, got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"act_quant_fp8: group must be a positive int, got {group!r}")
    _check_device(x, "act_quant_fp8")
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m and k:
        grid = (triton.cdiv(m, _QUANT_ROWS), groups)
        _act_quant_kernel[grid](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), GROUP=group,
                                BLOCK_G=triton.next_power_of_2(group), BLOCK_M=_QUANT_ROWS, num_warps=4)
    return q, s


def _tiles(m: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for ``m`` rows: the smallest row tile ``tl.dot`` takes that holds them (up to 64), and
    narrower column tiles for few rows (more programs for a memory-bound product)."""
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    return block_m, 64 if m <= 64 else 128


def _check_weight(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                  experts: bool, name: str) -> tuple[int, int]:
    dims = 3 if experts else 2
    shape = "[E, N, K]" if experts else "[N, K]"
    if weight.dim() != dims or weight.dtype != torch.float8_e4m3fn or weight.stride(-1) != 1:
        raise ValueError(f"{name}: weight must be a float8_e4m3fn {shape} tensor with a contiguous last dimension, "
                         f"got {weight.dtype} {tuple(weight.shape)} strides {weight.stride()}")
    bn, bk = _check_block(block, name)
    n, k = weight.shape[-2:]
    want = (*weight.shape[:-2], triton.cdiv(n, bn), triton.cdiv(k, bk))
    if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != want or scale_inv.stride(-1) != 1:
        raise ValueError(f"{name}: scale_inv must be float32 {list(want)} (a {tuple(weight.shape)} weight in {bn}x{bk} "
                         f"blocks) with a contiguous last dimension, got {scale_inv.dtype} {tuple(scale_inv.shape)}")
    if x.dtype not in ACT_DTYPES or x.shape[-1] != k:
        raise ValueError(f"{name}: x must be float32/bfloat16/float16 [..., {k}], got {x.dtype} {tuple(x.shape)}")
    if not (x.device == weight.device == scale_inv.device):
        raise ValueError(f"{name}: x, weight and scale_inv must be on one device, got {x.device}, {weight.device} and "
                         f"{scale_inv.device}")
    _check_device(x, name)
    return bn, bk


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] · Wᵀ (+ bias)`` in ``x``'s dtype for a block-FP8 weight (``weight [N, K]`` float8_e4m3fn,
    ``scale_inv [ceil(N / bn), ceil(K / bk)]`` float32, ``block = (bn, bk)``); ``x`` is quantised per token in groups
    of ``bk`` values (module docstring). ``bias``: ``[N]`` of any float dtype, added in float32."""
    bn, bk = _check_weight(x, weight, scale_inv, block, False, "fp8_gemm")
    n, k = weight.shape
    if bias is not None and (bias.shape != (n,) or not bias.is_floating_point() or bias.device != x.device):
        raise ValueError(f"fp8_gemm: bias must be a float [{n}] tensor on {x.device}, got {bias.dtype} "
                         f"{tuple(bias.shape)} on {bias.device}")
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    if k == 0:
        out.zero_()
        return (out if bias is None else out.add_(bias.to(out.dtype))).reshape(*x.shape[:-1], n)
    xq, xs = act_quant_fp8(rows if rows.stride(1) == 1 else rows.contiguous(), bk)
    block_m, block_n = _tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_gemm_kernel[grid](
        xq, xs, weight, scale_inv, out, bias if bias is not None else out, xs, xs, xs,
        m, n, k, xq.stride(0), xs.stride(0), 0, weight.stride(0), 0, scale_inv.stride(0), out.stride(0),
        SCALE_BN=bn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, GROUPED=False, HAS_BIAS=bias is not None,
        num_warps=4, num_stages=3,
    )
    return out.reshape(*x.shape[:-1], n)


def _tile_table(offsets: torch.Tensor, block_m: int, programs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of ``programs`` row-tile programs: its expert (-1: none, a spare program) and its first row, from the
    per-expert row offsets ``[E + 1]`` (device tensors throughout: no host synchronisation)."""
    n_experts = offsets.shape[0] - 1
    counts = (offsets[1:] - offsets[:-1]).clamp_(min=0)
    tiles = torch.div(counts + block_m - 1, block_m, rounding_mode="floor")
    ends = torch.cumsum(tiles, 0)  # programs [ends[e] - tiles[e], ends[e]) are expert e's
    pid = torch.arange(programs, device=offsets.device, dtype=ends.dtype)
    expert = torch.searchsorted(ends, pid, right=True)  # the first expert whose tiles end after pid
    valid = expert < n_experts
    e = expert.clamp(max=max(n_experts - 1, 0))
    row = offsets[:-1][e] + (pid - (ends[e] - tiles[e])) * block_m
    return (torch.where(valid, e, -1).to(torch.int32), torch.where(valid, row, 0).to(torch.int32))


def fp8_grouped_gemm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, offsets: torch.Tensor,
                     block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Several experts' products in one launch: ``x [T, K]`` holds the tokens sorted by expert, expert ``e``'s rows
    being ``offsets[e]:offsets[e + 1]`` (``offsets [E + 1]`` int32/int64 on x's device, non-decreasing, from 0 to at
    most ``T``; an expert with no rows does nothing); ``weight [E, N, K]`` float8_e4m3fn with ``scale_inv [E,
    ceil(N / bn), ceil(K / bk)]`` float32. Returns ``y [T, N]`` in ``x``'s dtype, row ``t`` = ``x[t] · W_eᵀ`` of its
    expert (rows outside every expert's range: 0). The offsets' values are not checked (that would synchronise with
    the device)."""
    bn, bk = _check_weight(x, weight, scale_inv, block, True, "fp8_grouped_gemm")
    n_experts, n, k = weight.shape
    if x.dim() != 2:
        raise ValueError(f"fp8_grouped_gemm: x must be [T, {k}], got {tuple(x.shape)}")
    if (offsets.dim() != 1 or offsets.shape[0] != n_experts + 1 or offsets.dtype not in (torch.int32, torch.int64)
            or offsets.device != x.device):
        raise ValueError(f"fp8_grouped_gemm: offsets must be an int32/int64 [{n_experts + 1}] tensor on {x.device} "
                         f"(expert e's rows: offsets[e]:offsets[e + 1]), got {offsets.dtype} {tuple(offsets.shape)} "
                         f"on {offsets.device}")
    t = x.shape[0]
    out = torch.zeros(t, n, dtype=x.dtype, device=x.device)  # rows of no expert stay 0
    if t == 0 or n == 0 or n_experts == 0 or k == 0:
        return out
    xq, xs = act_quant_fp8(x if x.stride(1) == 1 else x.contiguous(), bk)
    block_m, block_n = _tiles(max(1, t // n_experts))  # tiles sized for the tokens an expert has on average
    programs = min(t, triton.cdiv(t, block_m) + n_experts)  # at least one row per tile, at most one part tile each
    offs = offsets.to(torch.int64)
    tile_expert, tile_row = _tile_table(offs, block_m, programs)
    row_end = offs[1:].to(torch.int32)
    grid = (programs, triton.cdiv(n, block_n))
    _fp8_gemm_kernel[grid](
        xq, xs, weight, scale_inv, out, out, tile_expert, tile_row, row_end,
        t, n, k, xq.stride(0), xs.stride(0), weight.stride(0), weight.stride(1), scale_inv.stride(0),
        scale_inv.stride(1), out.stride(0),
        SCALE_BN=bn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, GROUPED=True, HAS_BIAS=False,
        num_warps=4, num_stages=3,
    )
    return out
