"""CPU matrix products through oneDNN, with weights pre-packed once at load time.

``F.linear`` on a CPU tensor calls MKL's sgemm for float32. On AMD processors MKL does not take its
AVX-512 paths, and for the small ``M`` of decoding (1–32 rows) it runs far below the memory bandwidth
(measured on a 2-core EPYC, ``[8, 1024] × [1024, 32000]`` fp32: MKL 27 ms, oneDNN 9.4 ms; bf16
``[1, 1024] × [1024, 32000]``: 6.7 ms plain, 3.4 ms pre-packed). oneDNN picks its kernels by the
instruction set alone, and a weight reordered once into its blocked layout (``_reorder_linear_weight``)
is streamed without a per-call reorder.

``PackedWeight`` keeps both layouts of one ``[N, K]`` weight: the plain tensor (what the rest of the
code reads, unchanged) and the blocked copy (the price is one extra copy of the linear weights in RAM).
``linear`` picks per call: a float32 matrix-vector product (one row) runs oneDNN on the plain weight — the
blocked layout made for a batch streams a weight that is not in cache 1.15–1.4× slower at one row (7 MoE
layers' experts: 6.3 vs 7.3 ms; the lm_head: 6.4 vs 9.3 ms) — and everything else uses the blocked one
(bf16 at one row: 3.9 vs 6.4 ms; float32 at 2–3 rows: up to 6× faster than the plain weight). Results
equal ``F.linear`` to float rounding (the same products, another summation order). Anything oneDNN
cannot take — another device or dtype, an empty input — goes to ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 16  # oneDNN chooses the blocked layout for about this many rows
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedWeight:
    """One ``[N, K]`` weight in its plain and its oneDNN-blocked layout (see the module docstring)."""

    __slots__ = ("plain", "blocked", "plain_gemv")

    def __init__(self, weight: torch.Tensor) -> None:
        self.plain = weight.detach()
        self.blocked = torch.ops.mkldnn._reorder_linear_weight(self.plain.contiguous(), PACK_BATCH_HINT)
        self.plain_gemv = weight.dtype == torch.float32  # one row: oneDNN on the plain weight

    @staticmethod
    def make(weight: torch.Tensor) -> PackedWeight | None:
        """A packed weight, or None where oneDNN does not apply (then callers use ``F.linear``)."""
        if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES or weight.dim() != 2 \
                or not onednn_available():
            return None
        return PackedWeight(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN when ``packed`` (made from ``weight``) is given."""
    if packed is None or x.dtype != weight.dtype or x.numel() == 0:
        return F.linear(x, weight, bias)
    w = packed.plain if packed.plain_gemv and x.numel() == x.shape[-1] else packed.blocked
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [None], "")
