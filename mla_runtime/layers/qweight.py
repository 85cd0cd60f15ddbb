"""The common shape of a weight-only quantised matrix: what every stored format (int8, int4, FP8 blocks) offers.

A ``QuantizedWeight`` stands in for one float ``[N, K]`` weight of a product (``y = x · Wᵀ``). It is made either
from a float matrix (``quantize``: the runtime's own quantisation, done while a checkpoint streams in) or from the
tensors a checkpoint stores (each format's own constructor), and it is row-stackable (``cat``: products that read
the same input, such as ``q_a_proj`` and ``kv_a_proj_with_mqa``, run as one). Every format's scales are per output
row or per group of one row, so quantising row blocks one at a time and stacking them gives exactly what quantising
the stacked matrix gives.

The float parameter it replaces keeps its shape and dtype but no storage (``released``), so nothing may re-derive a
layout from it afterwards.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F

from mla_runtime.kernel_plan import OFF_CPU, KernelPlan, kernel_plan
from mla_runtime.layers.cpu_gemm import PackedWeight

WIDEN_CHUNK_ELEMENTS = 4 << 20  # a widened product converts about this many weights to float32 at a time


def released(weight: torch.Tensor) -> torch.Tensor:
    """A stand-in for a released weight: same shape, dtype and device, one element of storage."""
    return torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)


def released_like(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``released`` for a weight that was never allocated."""
    return torch.zeros((), dtype=dtype, device=device).expand(*shape)


def stack_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` of row blocks, except that blocks already lying back to back in one storage (the matrices of a
    checkpoint served from its mapped file, where ``gate_proj`` and ``up_proj`` are stored one after the other) are
    joined as a view of it, without a copy."""
    first = tensors[0]
    end = first.data_ptr()
    joined = first.device.type == "cpu"
    for t in tensors:
        joined = (joined and t.is_contiguous() and t.data_ptr() == end and t.shape[1:] == first.shape[1:]
                  and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())
        end += t.numel() * t.element_size()
    if len(tensors) == 1 or not joined:
        return torch.cat(list(tensors))
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def default_plan(device: torch.device | str) -> KernelPlan:
    """The plan a new matrix on ``device`` is bound to until a model binds its own: on a CPU ``cpu_gemm=auto``'s with
    one layout per weight, so that a matrix made while a checkpoint streams in allocates no second layout (oneDNN's
    blocked copy, AMX tiles) that the model's plan may leave out to fit; binding that plan adds them where it keeps
    them."""
    return _lean_auto() if torch.device(device).type == "cpu" else OFF_CPU


@functools.cache
def _lean_auto() -> KernelPlan:
    return kernel_plan().with_one_layout()


def _onednn_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows · weightᵀ`` for float32 CPU tensors through oneDNN, the weight in its plain layout."""
    return torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [None], "")


class QuantizedWeight(PackedWeight):
    """Base of the weight-only formats. ``plain`` is the released float weight (shape and dtype only: callers pass it
    as the "weight" argument of ``cpu_gemm.linear``, which hands the product to ``matmul``)."""

    # widened_onednn: widened_product's blocks run oneDNN's float32 product (where its probe passed on this CPU, at
    # load) rather than F.linear
    __slots__ = ("widened_onednn",)
    quantized = True
    scheme: ClassVar[str]  # the ``quantization`` value that makes this format ("int8", "int4", "fp8")

    def _release_float(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> None:
        """Set the fields every ``PackedWeight`` has: no float layout is kept."""
        self.plain = released_like(shape, dtype, device)
        self.blocked = self.wide = self.amx = self.operand = None
        self.rows = (0, 0, 0)
        self.upcast = self.plain_gemv = self.row_kernel = self.onednn = self.compiled = False
        self.aten_max_rows = self.bf16_rows = 0
        self.widened_onednn = self.paired = False

    def bind(self, plan: KernelPlan) -> QuantizedWeight:
        """Take ``plan``'s paths for this matrix: its format's compiled kernel where the plan runs it (subclasses),
        and oneDNN's float32 products for the blocks a widened product multiplies. A new matrix is bound to the
        default plan of its device (``default_plan``); a model binds its own plan's at ``prepare_inference``."""
        self.widened_onednn = self.on_cpu and plan.choice(torch.float32).path == "onednn"
        return self

    @property
    def on_cpu(self) -> bool:
        return self.plain.device.type == "cpu"

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> QuantizedWeight:
        """The format's own quantisation of a float ``[N, K]`` weight (the result runs in ``weight.dtype``)."""
        raise NotImplementedError(f"{cls.__name__} is not made from float weights")

    @classmethod
    def cat(cls, parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """The row-stacked matrix of ``parts`` (same format, same ``K``): exactly what quantising the stacked float
        matrix gives."""
        raise NotImplementedError

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The matrix of the output rows ``index`` (the MTP drafts' rows of a quantised lm_head)."""
        raise NotImplementedError

    @property
    def shape(self) -> torch.Size:
        return self.plain.shape

    @property
    def nbytes(self) -> int:
        """Resident bytes: the stored matrix and its scales."""
        raise NotImplementedError

    @classmethod
    def stored_bytes(cls, rows: int, k: int, block: tuple[int, int] | None = None) -> int:
        """The ``nbytes`` of a ``[rows, k]`` matrix in this format, its scales included and no second layout; ``block``:
        the FP8 blocks it keeps (default: the format's own)."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix this one stands for."""
        raise NotImplementedError

    def _dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Float32 rows ``[r0, r1)`` of the matrix."""
        raise NotImplementedError

    def gather_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Float32 ``[len(index), K]``: the rows ``index`` (int64, any order, repeats allowed) of the matrix, widened
        (an embedding kept as stored looks its tokens up this way): the matrix of those rows (``select_rows``),
        each distinct row once."""
        if not index.numel():
            return torch.empty(0, self.shape[1], device=index.device)
        unique, where = torch.unique(index, return_inverse=True)
        return self.select_rows(unique).dequantize()[where]

    def widened_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K] · Wᵀ (+ bias)`` in ``x``'s dtype by widening the weight to float32 a block of output rows at a
        time (about ``WIDEN_CHUNK_ELEMENTS`` values: bounded temporaries) and ``F.linear``, or on a CPU oneDNN's float32
        product of the block (``widened_onednn``: on an AMD EPYC capped at AVX2, 128 rows of ``[4096, 1024]`` 4.6 ms
        against MKL's 5.6): the path of any device, and of products too large for a format's few-row kernels."""
        n, k = self.shape
        rows = x.reshape(-1, k).float()
        step = max(1, WIDEN_CHUNK_ELEMENTS // max(k, 1))
        product = _onednn_product if self.widened_onednn else F.linear
        if n <= step:
            y = product(rows, self._dequantize_rows(0, n))
        else:
            y = torch.empty(rows.shape[0], n, dtype=torch.float32, device=x.device)
            for r0 in range(0, n, step):
                r1 = min(n, r0 + step)
                y[:, r0:r1] = product(rows, self._dequantize_rows(r0, r1))
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], n)
