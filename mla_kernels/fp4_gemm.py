"""A Triton GEMM for FP4 E2M1 weights (``mla_kernels.fp4_format``: MXFP4 and NVFP4, as compressed-tensors stores
them) on CUDA: ``x [M, K] · Wᵀ`` with the weight dequantised inside the matmul, a ``BLOCK_K`` slice at a time (the
nibbles split, widened by arithmetic on their bits, times their group's scale: exactly ``fp4_format.dequantize_fp4``'s
values), float32 rows and float32 accumulation (``tl.dot`` in IEEE float32). The weight is read at half a byte a value
plus its stored scales. Tested on a CPU through Triton's interpreter (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import triton_interpreting
from .fp4_format import GROUPS

BLOCK_K = 64  # a whole number of groups of 16 and of 32


@triton.jit
def _e2m1(code):
    """Nibbles (int32) -> their E2M1 values (float32): 0, 0.5 ... 6 by the exponent and mantissa bits, signed."""
    mag = code & 7
    e = mag >> 1
    doubled = tl.where(mag < 2, mag, (2 + (mag & 1)) << tl.maximum(e - 1, 0))
    value = doubled.to(tl.float32) * 0.5
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _group_scale(s, glob, MX: tl.constexpr):
    """Stored scales (int32 of their bytes) -> float32: MX 2^(e - 127) from its bits (0: 2^-127; 255: NaN); NV the
    E4M3 byte widened from its bits, divided by the row's global scale."""
    if MX:
        bits = tl.where(s == 0, 0x00400000, s << 23)
        bits = tl.where(s == 255, 0x7FC00000, bits)
        return bits.to(tl.float32, bitcast=True)
    e = (s >> 3) & 15
    man = s & 7
    normal = ((s & 0x80) << 24) | ((e + 120) << 23) | (man << 20)
    sub = man.to(tl.float32) * (1.0 / 512.0)
    sub = tl.where((s & 0x80) != 0, -sub, sub)
    v = tl.where(e == 0, sub, normal.to(tl.float32, bitcast=True))
    v = tl.where((e == 15) & (man == 7), float("nan"), v)
    return v / glob[:, None]


@triton.jit
def _fp4_gemm_kernel(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                     GROUP: tl.constexpr, MX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    if MX:
        glob = tl.full((BLOCK_N,), 1.0, tl.float32)
    else:
        glob = tl.load(g_ptr + cols64, mask=mask_n, other=1.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :], mask=mask_m[:, None] & (ks < K)[None, :],
                    other=0.0)
        bytes_at = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_ptr + cols64[:, None] * stride_wn + bytes_at[None, :],
                         mask=mask_n[:, None] & (bytes_at < K // 2)[None, :], other=0).to(tl.int32)
        codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, BLOCK_K))  # value 2i, then 2i + 1
        groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        s = tl.load(s_ptr + cols64[:, None] * stride_sn + groups[None, :],
                    mask=mask_n[:, None] & (groups < K // GROUP)[None, :], other=0).to(tl.int32)
        scale = _group_scale(s, glob, MX)
        w = tl.reshape(tl.reshape(_e2m1(codes), (BLOCK_N, BLOCK_K // GROUP, GROUP)) * scale[:, :, None],
                       (BLOCK_N, BLOCK_K))
        w = tl.where((ks < K)[None, :], w, 0.0)
        acc += tl.dot(a, tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + rows64[:, None] * stride_ym + cols64[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


def fp4_gemm_failure(device: torch.device | str) -> str | None:
    """None where the kernel runs on ``device``'s tensors, else why not."""
    if torch.device(device).type == "cuda" or triton_interpreting():
        return None
    return "the Triton FP4 kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is imported)"


def fp4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scales: torch.Tensor | None,
             variant: str) -> torch.Tensor:
    """``x [..., K] · Wᵀ`` in float32 for an FP4 weight (``packed [N, K / 2]`` uint8; ``variant`` "mxfp4" with uint8
    scales ``[N, K / 32]``, or "nvfp4" with float8_e4m3fn scales ``[N, K / 16]`` and float32 ``global_scales [N]``)."""
    group = GROUPS[variant]
    n, k = packed.shape[0], 2 * packed.shape[1]
    why = fp4_gemm_failure(x.device)
    if why is not None or x.shape[-1] != k or k % group or scales.shape != (n, k // group):
        raise ValueError(f"fp4_gemm: {why or f'x [..., {k}] and scales [{n}, {k // group}] expected, got x '}"
                         f"{'' if why else f'{tuple(x.shape)} and scales {tuple(scales.shape)}'}")
    rows = x.reshape(-1, k).float().contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m and n:
        stored = scales.contiguous().view(torch.uint8)
        glob = global_scales.float().contiguous() if global_scales is not None else out
        block_m = 16 if m <= 16 else 64
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
        _fp4_gemm_kernel[grid](rows, packed.contiguous(), stored, glob, out, m, n, k, rows.stride(0), k // 2,
                               stored.stride(0), out.stride(0), GROUP=group, MX=variant == "mxfp4", BLOCK_M=block_m,
                               BLOCK_N=64, BLOCK_K=BLOCK_K, num_warps=4)
    return out.reshape(*x.shape[:-1], n)
