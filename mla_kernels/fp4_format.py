"""The 4-bit float weight formats the CPU kernel reads (``csrc/gemm_fp4.c``), as compressed-tensors stores them:

- values: FP4 E2M1 (a sign, two exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives),
  two a byte, value ``2i`` of a row in the low nibble of byte ``i`` and value ``2i + 1`` in its high nibble; a nibble
  is ``sign << 3 | magnitude index``;
- ``mxfp4`` (the OCP MX format): one UE8M0 scale per ``MX_GROUP`` values of a row, a biased power of two
  ``2^(e - 127)`` stored as uint8 (255: NaN);
- ``nvfp4``: one FP8 E4M3 scale per ``NV_GROUP`` values of a row and one float32 global scale per tensor; a value is
  ``e2m1 * (float32(scale) / global)`` (compressed-tensors' ``weight_global_scale`` divides). The runtime holds the
  global scale once per row (a stack of matrices keeps each one's).

``group_scales`` turns stored scales into the float32 scale of each group exactly as the kernel does, and
``dequantize_fp4`` gives the float32 weights: ``fl(e2m1 * group scale)``."""

from __future__ import annotations

import torch

MX_GROUP = 32
NV_GROUP = 16
GROUPS = {"mxfp4": MX_GROUP, "nvfp4": NV_GROUP}
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 values of the nibbles, float32, indexed by the nibble."""
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``packed [N, K / 2]`` uint8 -> the nibbles ``[N, K]`` uint8, in value order."""
    n, half = packed.shape
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(n, 2 * half)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``unpack_nibbles``' inverse: nibbles ``[N, K]`` (``K`` even) -> ``[N, K / 2]`` uint8."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // 2, 2)
    return c[..., 0] | (c[..., 1] << 4)


def mx_scales(exponents: torch.Tensor) -> torch.Tensor:
    """UE8M0 exponents (uint8) -> float32 ``2^(e - 127)``, built from the bits (exact; 255: NaN)."""
    e = exponents.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)  # 2^-127 is subnormal
    return torch.where(e == 255, torch.full_like(e, 0x7FC00000), bits).view(torch.float32)


def group_scales(variant: str, scales: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """The float32 scale of each group ``[N, K / group]``: ``mxfp4``: the exponents' powers of two; ``nvfp4``: the E4M3
    scales widened and divided by the row's global scale (``[N]``), one float32 division."""
    if variant == "mxfp4":
        return mx_scales(scales)
    assert global_scale is not None
    return scales.float() / global_scale.float().unsqueeze(1)


def dequantize_fp4(variant: str, packed: torch.Tensor, scales: torch.Tensor,
                   global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 matrix ``[N, K]`` of stored FP4 weights."""
    group = GROUPS[variant]
    n = packed.shape[0]
    values = e2m1_table(packed.device)[unpack_nibbles(packed).long()].view(n, -1, group)
    return (values * group_scales(variant, scales, global_scale).unsqueeze(-1)).view(n, -1)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """The nibble of the E2M1 value nearest each float32 ``x`` (ties to the even mantissa; beyond 6: 6)."""
    mag = x.abs()
    # the midpoints between neighbours; at a tie the even code (0, 1.0, 2.0, 4.0) wins: >= / > alternate
    idx = torch.signbit(x).to(torch.uint8) << 3
    for bound, inclusive in ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                             (5.0, False)):
        idx += mag >= bound if inclusive else mag > bound
    return idx
