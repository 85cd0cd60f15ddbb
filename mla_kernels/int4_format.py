"""The group-wise int4 format the CPU kernels read (``csrc/gemv_int4.c``): ggml's Q4_0 numbers, half a byte per
weight and a float16 scale per ``INT4_GROUP`` values along K, and how the kernel rounds its input rows (ggml's Q8_0
activations)."""

from __future__ import annotations

import torch

INT4_GROUP = 32  # int4 weights: one float16 scale per this many values along K


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


def quantize_q8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How the int4 kernel rounds its input rows, in torch: ``x [..., K]`` float32 -> (``q [..., Kp]`` int8, zero past
    ``K``; ``scale [..., Kp / 32]`` float32), ``x ≈ q * scale`` per group of 32 with ``scale = amax / 127`` and
    ``q = round(x * (127 / amax))`` to nearest even (NaN scales where a group is not finite)."""
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
