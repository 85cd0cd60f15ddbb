"""Several experts' float matrix products in one launch (Triton), with no host synchronisation.

``grouped_gemm(x, weight, offsets)``: ``x [T, K]`` holds tokens sorted by expert, expert ``e``'s rows being
``offsets[e]:offsets[e + 1]``; ``weight [E, N, K]`` (float32 / bfloat16 / float16, the experts stacked as a MoE layer
keeps them). Row ``t`` of the result is ``x[t] · W_eᵀ`` of its expert, accumulated in float32 and written in ``x``'s
dtype (float32 weights multiply in full float32, not tf32). Each program computes a ``BLOCK_M × BLOCK_N`` tile of one
expert's rows; which expert and which first row is read from a small table made on the device from the offsets
(``fp8_gemm._tile_table``), so the launch does not depend on how many tokens each expert got: a MoE layer's decode
step can run inside a captured CUDA graph. The block-FP8
experts of an FP8 checkpoint take ``fp8_gemm.fp8_grouped_gemm`` instead, the same scheme with block scales.

Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import triton_interpreting
from .fp8_gemm import _tile_table, _tiles

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_K = 32


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, tile_expert_ptr, tile_row_ptr, row_end_ptr, N, K,
                         stride_am, stride_be, stride_bn, stride_cm,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert < 0:  # a spare program
        return
    row0 = tl.load(tile_row_ptr + pid_m)
    row_end = tl.load(row_end_ptr + expert)
    b_ptr += expert.to(tl.int64) * stride_be
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = rows < row_end
    mask_n = cols < N
    rows64 = rows.to(tl.int64)
    a_ptrs = a_ptr + rows64[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + cols.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: W read K-major
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:  # the CPU interpreter (numpy) got half-precision dots wrong here: widened to float32 (exact)
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a.to(b.dtype), b, out_dtype=tl.float32, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + rows64[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x [T, K]`` sorted by expert (expert ``e``'s rows ``offsets[e]:offsets[e + 1]``; ``offsets [E + 1]`` int32 or
    int64 on x's device, non-decreasing from 0 to at most ``T``), ``weight [E, N, K]`` float -> ``y [T, N]`` in x's
    dtype (rows of no expert: 0). The offsets' values are not checked: that would read them back from the device."""
    if weight.dim() != 3 or weight.dtype not in FLOAT_DTYPES or weight.stride(-1) != 1:
        raise ValueError(f"grouped_gemm: weight must be a float [E, N, K] tensor with a contiguous last dimension, got "
                         f"{weight.dtype} {tuple(weight.shape)} strides {weight.stride()}")
    n_experts, n, k = weight.shape
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.shape[1] != k or x.device != weight.device:
        raise ValueError(f"grouped_gemm: x must be a float [T, {k}] tensor on {weight.device}, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if (offsets.dim() != 1 or offsets.shape[0] != n_experts + 1 or offsets.dtype not in (torch.int32, torch.int64)
            or offsets.device != x.device):
        raise ValueError(f"grouped_gemm: offsets must be an int32/int64 [{n_experts + 1}] tensor on {x.device}, got "
                         f"{offsets.dtype} {tuple(offsets.shape)} on {offsets.device}")
    t = x.shape[0]
    out = torch.zeros(t, n, dtype=x.dtype, device=x.device)
    if t == 0 or n == 0 or n_experts == 0 or k == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    block_m, block_n = _tiles(max(1, t // n_experts))  # row tiles sized for the tokens an expert has on average
    programs = min(t, triton.cdiv(t, block_m) + n_experts)  # at least one row per tile, at most one part tile each
    offs = offsets.to(torch.int64)
    tile_expert, tile_row = _tile_table(offs, block_m, programs)
    grid = (programs, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](x, weight, out, tile_expert, tile_row, offs[1:].to(torch.int32), n, k,
                               x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
                               DOT_PRECISION="ieee",  # fp32 weights multiply in fp32, not tf32
                               UPCAST=triton_interpreting() and weight.dtype != torch.float32,
                               num_warps=4, num_stages=3)
    return out
