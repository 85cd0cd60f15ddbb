"""Block-FP8 weights (``quantization="fp8"``), kept as checkpoints of DeepSeek-V3/R1/V3.1/V3.2 and Kimi-K2 store them.

Each matrix ``W [N, K]`` is ``weight [N, K]`` float8_e4m3fn (one byte per value) and ``scale_inv [ceil(N / bn),
ceil(K / bk)]`` float32, one scale per ``bn × bk`` block (128 × 128 in those checkpoints)::

    W[n, k] = float(weight[n, k]) * scale_inv[n // bn, k // bk]

The runtime multiplies the stored bytes; nothing is re-quantised. On CUDA ``matmul`` runs the Triton block-FP8 GEMM
(``mla_kernels.fp8_gemm``: the activations quantised per token in groups of ``bk`` values to float8_e4m3fn, both
scales applied per K block, float32 accumulation). On a CPU every product runs the operator ``cpu_kernels.linear``
where its kernel builds and passes its probe (``cpu_gemm=auto``): up to ``cpu_kernels.max_rows`` rows the AVX2 kernel
``csrc/gemv_fp8.c`` (float32 activations, the weight read at one byte per value and widened in the kernel, the
dequantised values exactly ``float(weight) * scale``; each row's result does not depend on the rows beside it), more
rows oneDNN's float32 product of the weight widened a block of rows at a time, the choice made inside the operator. A
CPU without the kernel, or ``cpu_gemm=plain``: the matrix is dequantised to float32 (a bounded number of output rows
at a time) and multiplied with ``F.linear``; so is it on a GPU the Triton kernel does not run on (before sm_89, ROCm).

``quantize`` makes the format from a float matrix (128 × 128 blocks, scale = the block's largest magnitude / 448).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F

from mla_kernels import cpu_kernels
from mla_kernels.fp8_gemm import fp8_gemm, fp8_gemm_failure
from mla_runtime.kernel_plan import KernelPlan
from mla_runtime.layers.qweight import QuantizedWeight, default_plan, stack_rows

FP8_MAX = 448.0  # the largest float8_e4m3fn magnitude
DEFAULT_BLOCK = (128, 128)
TRITON_BLOCK_K = (16, 32, 64, 128, 256)  # block columns the Triton GEMM takes (one tl.dot step per block)


def _blocks(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-n // block[0]), -(-k // block[1])


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (float) -> (``float8_e4m3fn [N, K]``, ``scale_inv [ceil(N / bn), ceil(K / bk)]`` float32):
    each block divided by its largest magnitude / 448 (an all-zero block: scale 1) and rounded to nearest."""
    n, k = weight.shape
    bn, bk = block
    nb, kb = _blocks(n, k, block)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=weight.device)
    scales = torch.empty(nb, kb, dtype=torch.float32, device=weight.device)
    for i in range(nb):  # one row of blocks at a time: the float32 temporaries stay small
        rows = weight[i * bn:(i + 1) * bn].detach().float()
        padded = F.pad(rows, (0, kb * bk - k)).view(rows.shape[0], kb, bk)
        amax = padded.abs().amax(dim=(0, 2))
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        scales[i] = s
        wide = (padded / s[None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
        q[i * bn:(i + 1) * bn] = wide.view(rows.shape[0], kb * bk)[:, :k].to(torch.float8_e4m3fn)
    return q, scales


class Fp8Weight(QuantizedWeight):
    """A block-FP8 ``[N, K]`` matrix: what ``cpu_gemm.linear`` runs in place of the float weight."""

    __slots__ = ("weight", "scale_inv", "block", "kernel")
    scheme = "fp8"

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                 dtype: torch.dtype) -> None:
        """``weight [N, K]`` float8_e4m3fn and ``scale_inv [ceil(N / bn), ceil(K / bk)]`` (float32) for ``block =
        (bn, bk)``, standing for a weight of ``dtype``."""
        if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Fp8Weight: weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"Fp8Weight: block must be two positive sizes (rows, columns), got {block}")
        bn, bk = int(block[0]), int(block[1])
        want = _blocks(weight.shape[0], weight.shape[1], (bn, bk))
        if tuple(scale_inv.shape) != want or not scale_inv.is_floating_point():
            raise ValueError(f"Fp8Weight: a {tuple(weight.shape)} weight in {bn}x{bk} blocks takes float scales "
                             f"{list(want)}, got {scale_inv.dtype} {tuple(scale_inv.shape)}")
        if scale_inv.device != weight.device:
            raise ValueError(f"Fp8Weight: the scales are on {scale_inv.device}, the weight on {weight.device}")
        self._release_float(weight.shape, dtype, weight.device)
        self.weight = weight.contiguous()
        self.scale_inv = scale_inv.to(torch.float32).contiguous()
        self.block = (bn, bk)
        self.bind(default_plan(weight.device))

    def bind(self, plan: KernelPlan) -> Fp8Weight:
        super().bind(plan)
        # every product on a CPU: the operator where the plan runs its AVX2 kernel and oneDNN's float32 products
        self.kernel = self.on_cpu and plan.fp8_failure is None and plan.choice(torch.float32).path == "onednn"
        return self

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Fp8Weight:
        return cls(*quantize_fp8_block(weight, DEFAULT_BLOCK), DEFAULT_BLOCK, weight.dtype)

    @classmethod
    def cat(cls, parts: Sequence[QuantizedWeight]) -> Fp8Weight:
        """The row-stacked matrix: every part but the last must end on a block boundary (its rows a multiple of its
        block rows), so that each scale row still covers rows of one part, and all parts share the block and ``K``."""
        if not parts:
            raise ValueError("Fp8Weight.cat: no parts")
        fp8 = []
        for i, p in enumerate(parts):
            if not isinstance(p, Fp8Weight):
                raise ValueError(f"Fp8Weight.cat: part {i} is a {type(p).__name__}, not an Fp8Weight")
            fp8.append(p)
        first = fp8[0]
        for i, p in enumerate(fp8):
            if p.block != first.block or p.weight.shape[1] != first.weight.shape[1]:
                raise ValueError(f"Fp8Weight.cat: part {i} has blocks {p.block} and K = {p.weight.shape[1]}, part 0 "
                                 f"{first.block} and K = {first.weight.shape[1]}: stacked parts share both")
            if i < len(fp8) - 1 and p.weight.shape[0] % p.block[0]:
                raise ValueError(f"Fp8Weight.cat: part {i} has {p.weight.shape[0]} rows, not a multiple of its "
                                 f"{p.block[0]} block rows: its last scale row would also cover the next part's rows")
        return cls(stack_rows([p.weight for p in fp8]), torch.cat([p.scale_inv for p in fp8]), first.block,
                   first.plain.dtype)

    def select_rows(self, index: torch.Tensor) -> Fp8Weight:
        """The matrix of the output rows ``index``: each keeps its bytes and its blocks' scales (one scale row per
        output row: blocks of ``(1, bk)``)."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.weight.device)
        scales = self.scale_inv.index_select(0, torch.div(index, self.block[0], rounding_mode="floor"))
        return Fp8Weight(self.weight.index_select(0, index), scales, (1, self.block[1]), self.plain.dtype)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale_inv.numel() * self.scale_inv.element_size()

    @classmethod
    def stored_bytes(cls, rows: int, k: int, block: tuple[int, int] | None = None) -> int:
        """A byte a value and a float32 scale per block (``block``, default ``DEFAULT_BLOCK``)."""
        nb, kb = _blocks(rows, k, block or DEFAULT_BLOCK)
        return rows * k + 4 * nb * kb

    def row_operand(self) -> None:
        return None  # the one-row MLP and decoder-layer kernels read float32 or int8 matrices

    def _dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Float32 rows ``[r0, r1)`` of the matrix: ``float(weight) * scale`` of each value's block."""
        bn, bk = self.block
        k = self.weight.shape[1]
        w = self.weight[r0:r1].float()
        rows = torch.arange(r0, r1, device=w.device)
        scales = self.scale_inv.index_select(0, torch.div(rows, bn, rounding_mode="floor"))  # [r1 - r0, kb]
        full = k // bk
        if full:
            w[:, :full * bk].unflatten(1, (full, bk)).mul_(scales[:, :full, None])
        if full * bk < k:
            w[:, full * bk:].mul_(scales[:, full:])
        return w

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix the FP8 one stands for."""
        return self._dequantize_rows(0, self.weight.shape[0])

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K]`` (any float dtype) -> ``x · Wᵀ (+ bias)`` in ``x``'s dtype."""
        if self.weight.is_cuda and self.block[1] in TRITON_BLOCK_K and fp8_gemm_failure(self.weight.device) is None:
            return cast(torch.Tensor, fp8_gemm(x, self.weight, self.scale_inv, self.block, bias))
        if self.kernel and x.numel():  # the operator: the AVX2 kernel, or past 64 rows oneDNN on the widened weight
            bias = None if bias is None else bias.float()
            return cpu_kernels.linear(x, self.weight, self.scale_inv, block=self.block, bias=bias).to(x.dtype)
        return self.widened_product(x, bias)
