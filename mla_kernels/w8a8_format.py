"""W8A8 int8 products as the CPU kernel computes them (``csrc/gemm_w8a8.c``), in torch: int8 weights with one float32
scale per output row, and input rows rounded to int8 per row (per token) when the product runs, the dynamic
activation quantisation of W8A8 int8 checkpoints (compressed-tensors ``int-quantized`` with dynamic per-token int8
activations; SGLang's ``w8a8_int8``)::

    sx = amax(|x|) / 127      xq = round(x / sx), to nearest even      (a row of zeros: sx = 0, xq = 0)
    y = float32(xq · qᵀ) * sx * sw       (the integer sums exact in int32; the two multiplications in that order)

Both the kernel and ``w8a8_product`` compute exactly these values, so they agree bit for bit. Either takes the rows'
``amax`` from outside in place of their own: a tensor-parallel rank holding a slice of ``K`` rounds its slice with the
whole row's amax (the ranks' MAX), as one rank rounds the whole row."""

from __future__ import annotations

import torch

W8A8_QMAX = 127


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` float -> ``amax(|x|)`` of each row, float32 ``[M]``."""
    return x.float().abs().amax(dim=1)


def quantize_rows_int8(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` float -> (``xq [M, K]`` int8, ``sx [M]`` float32) by the rule above (``amax [M]``: the rows'
    amax given, at least their own)."""
    rows = x.float()
    sx = (row_amax(rows) if amax is None else amax.float()) / W8A8_QMAX
    scaled = torch.where(sx.unsqueeze(1) > 0, rows / sx.unsqueeze(1), torch.zeros((), dtype=torch.float32,
                                                                                   device=rows.device))
    return scaled.round_().to(torch.int8), sx


def int_products(xq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``xq [M, K] · qᵀ`` (int8 ``q [N, K]``) as exact int32 sums: ``torch._int_mm`` on a CPU (and on CUDA for the
    shapes its kernel takes: more than 16 rows, sizes multiples of 8), else products summed in float64 (exact: every
    partial sum is an integer below 2^53)."""
    m, k = xq.shape
    if xq.device.type == "cpu" or (xq.device.type == "cuda" and m > 16 and k % 8 == 0 and q.shape[0] % 8 == 0):
        return torch._int_mm(xq.contiguous(), q.t())
    return (xq.double() @ q.double().t()).to(torch.int32)


def w8a8_product(x: torch.Tensor, q: torch.Tensor, sw: torch.Tensor, amax: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """``x [M, K]`` (float) times the W8A8 weight ``q [N, K]`` int8 with float32 row scales ``sw [N]``: float32
    ``[M, N]``, the kernel's values (module docstring; ``amax [M]``: the rows' amax given)."""
    xq, sx = quantize_rows_int8(x, amax)
    return int_products(xq, q).float() * sx.unsqueeze(1) * sw.float().unsqueeze(0)
