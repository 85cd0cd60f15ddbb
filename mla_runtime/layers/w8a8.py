"""W8A8 int8 (``quantization="w8a8"``): int8 weights with one float32 scale per output channel, and the input rows
of every product rounded to int8 per row (per token) when it runs: the scheme of W8A8 int8 checkpoints
(compressed-tensors ``int-quantized`` with dynamic per-token int8 activations; SGLang's ``w8a8_int8``), which load
as stored. From a float checkpoint, the weights are quantised per channel at load (``quantize``)::

    s_n = absmax(W[n, :]) / 127 (float32)        q[n, k] = round(W[n, k] / s_n) ∈ [-127, 127]

A product (``mla_kernels.w8a8_format``) rounds each input row to int8 with one scale (``amax / 127``, to nearest even),
sums the int8 × int8 products exactly in int32 and scales the sums, ``float32(sum) * sx * s``: on a CPU the compiled
kernel (``csrc/gemm_w8a8.c``; AVX2 ``vpmaddwd`` on values sign-extended to int16; AVX-512 VNNI ``vpdpwssd`` so for a
lone row, ``vpdpbusd`` on the rows offset to unsigned bytes for several) where it builds and its check passes
(``KernelPlan.w8a8_failure``), elsewhere ``torch._int_mm``: the same integers and the same two multiplications, so
the same bits on every path, and a row's result does not depend on the rows beside it. A matrix stored as a
checkpoint's int8 tensor on a CPU is a view of the mapped file, as ``int8``'s are. The weight reads one byte per
value plus four bytes per row.

Under tensor parallelism a row-parallel matrix (``o_proj``, ``down_proj``: each rank holds a slice of ``K`` and sees
its slice of every input row) rounds its slice with the whole row's amax, the ranks' maximum (``share_row_amax``: one
all-reduce of a value per row), so that every rank's integers are the ones one rank computes, and the ranks' scaled
partial sums add up to one rank's product up to the float32 additions of the reduction, as every sharded product does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch

from mla_kernels import cpu_kernels
from mla_kernels.w8a8_format import W8A8_QMAX, row_amax, w8a8_product
from mla_runtime.kernel_plan import KernelPlan
from mla_runtime.layers.qweight import PackedWeight, QuantizedWeight, default_plan, stack_rows
from mla_runtime.parallel import ParallelContext


def quantize_w8a8(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (``q [N, K]`` int8, ``scales [N]`` float32): symmetric, per output channel (a zero row
    gets the scale 1); ``absmax [N]``: the rows' largest magnitudes given (a tensor-parallel rank's columns of a
    row-parallel matrix take the whole rows', so that its integers are one rank's), at least this part's."""
    w = weight.detach().float()
    absmax = torch.linalg.vector_norm(w, float("inf"), dim=1) if absmax is None else absmax.float()
    scales = torch.where(absmax > 0, absmax / W8A8_QMAX, torch.ones_like(absmax))
    q = torch.div(w, scales.unsqueeze(1)).round_().clamp_(-W8A8_QMAX, W8A8_QMAX).to(torch.int8)
    return q, scales


class W8A8Weight(QuantizedWeight):
    """A W8A8 int8 ``[N, K]`` matrix (module docstring): what ``cpu_gemm.linear`` runs in place of the float weight."""

    rounds_to_int8 = True  # every path rounds each row to int8

    # shared_amax: for a row-parallel shard, the ranks' maximum of a [rows] vector (``share_row_amax``); None: the rows'
    # own amax
    __slots__ = ("qweight", "scales", "kernel", "shared_amax")
    scheme = "w8a8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        """``qweight [N, K]`` int8 and ``scales [N]`` (any float dtype, held in float32), standing for a weight of
        ``dtype``."""
        if (qweight.dtype != torch.int8 or qweight.dim() != 2 or not scales.dtype.is_floating_point
                or scales.shape != (qweight.shape[0],)):
            raise ValueError(f"W8A8Weight: an int8 matrix [N, K] and float scales [N], got {qweight.dtype} "
                             f"{tuple(qweight.shape)} and {scales.dtype} {tuple(scales.shape)}")
        self._release_float(qweight.shape, dtype, qweight.device)
        self.qweight, self.scales = qweight, scales.float().contiguous()
        self.shared_amax: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.bind(default_plan(qweight.device))

    def bind(self, plan: KernelPlan) -> W8A8Weight:
        super().bind(plan)
        self.kernel = self.on_cpu and plan.w8a8_failure is None  # else torch's int8 products
        return self

    @classmethod
    def quantize(cls, weight: torch.Tensor, absmax: torch.Tensor | None = None) -> W8A8Weight:
        return cls(*quantize_w8a8(weight, absmax), weight.dtype)

    @classmethod
    def cat(cls, parts: Sequence[QuantizedWeight]) -> W8A8Weight:
        w8 = [cast(W8A8Weight, p) for p in parts]
        if not w8 or any(not isinstance(p, W8A8Weight) or p.shape[1] != w8[0].shape[1] for p in w8):
            raise ValueError("W8A8Weight.cat: W8A8 matrices of one K")
        return cls(stack_rows([p.qweight for p in w8]), torch.cat([p.scales for p in w8]), w8[0].plain.dtype)

    def select_rows(self, index: torch.Tensor) -> W8A8Weight:
        index = index.to(self.qweight.device)
        return W8A8Weight(self.qweight[index].contiguous(), self.scales[index], self.plain.dtype)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    @classmethod
    def stored_bytes(cls, rows: int, k: int, block: tuple[int, int] | None = None) -> int:
        """A byte a value and a float32 scale a row."""
        return rows * k + 4 * rows

    def row_operand(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The matrix as the compiled layer and MLP kernels read it (``cpu_tables.Operand``: the row scales shaped
        ``[N, 1]``, which marks W8A8's rounding of the rows), where its kernel runs and each row is rounded with its
        own amax (not a row-parallel shard's shared one); else None (product by product)."""
        own = self.kernel and self.shared_amax is None and self.qweight.is_contiguous()
        return (self.qweight, self.scales.view(-1, 1)) if own else None

    def _dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:
        return self.qweight[r0:r1].float() * self.scales[r0:r1].unsqueeze(1)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix this one stands for."""
        return self._dequantize_rows(0, self.qweight.shape[0])

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K]`` (any float dtype) -> ``x · Wᵀ (+ bias)`` in ``x``'s dtype, rows rounded to int8 per row."""
        n, k = self.qweight.shape
        wide_bias = None if bias is None else bias.float()
        rows = x.reshape(-1, k)
        amax = None if self.shared_amax is None else self.shared_amax(row_amax(rows))
        if self.kernel and x.numel():
            return cpu_kernels.w8a8_linear(x, self.qweight, self.scales, bias=wide_bias, row_amax=amax).to(x.dtype)
        y = w8a8_product(rows, self.qweight, self.scales, amax)
        if wide_bias is not None:
            y = y + wide_bias
        return y.to(x.dtype).reshape(*x.shape[:-1], n)


def share_row_amax(weight: PackedWeight | None, par: ParallelContext) -> None:
    """Make a row-parallel shard's W8A8 products (``weight``, this rank's columns of the matrix) round their input rows
    with the whole row's amax: the ranks' maximum of their slices' (module docstring). Other formats: nothing."""
    if isinstance(weight, W8A8Weight):
        weight.shared_amax = par.all_reduce_max if par.enabled else None
