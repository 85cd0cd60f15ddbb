"""Weight-only half precision: the products' weights held at two bytes in a float32 model (``quantization="bf16"``
or ``"fp16"``).

A bfloat16 (float16) checkpoint loaded with ``dtype="float32"`` keeps float32 activations, norms and attention (and on
a CPU the compiled decode path, which computes in float32) while its products' weights stay bfloat16 (float16): half
the bytes a decode step streams, exactly the checkpoint's values. (A float32 checkpoint's weights are rounded.)

Products of up to ``cpu_kernels.max_rows`` rows on a CPU where the compiled kernels build (and ``cpu_gemm`` is
``auto``) run ``cpu_kernels.linear``, which widens each weight to float32 exactly (a shift for bfloat16, F16C's
conversion for float16; AVX2 alone) and computes in float32; the compiled layer and MLP kernels read the same matrix
(``row_operand``). Larger bfloat16 products (a prefill) run oneDNN's bfloat16 products on a blocked copy where the CPU
has them (``cpu_gemm``'s ``onednn`` path for bfloat16: the rows rounded to bfloat16, as a bfloat16 model's are; 1.5x
the float32 products' speed on an AMD EPYC with AVX512-BF16); otherwise, and for float16, the weight is widened to
float32 a block of rows at a time (``widened_product``), as every device does.

Where those many-row products round their rows to bfloat16 (``Bf16Weight.rounds_rows``), what sits between them
computes in bfloat16 too, as in a bfloat16 model, instead of widening each product's output to float32 and rounding
it again for the next: a gated MLP's activation and down product (``half_mlp``), and a prefill chunk's attention
(``attention.cpu.half_prefill``). Decode steps of a few rows, and the latent cache, stay float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from mla_kernels import cpu_kernels
from mla_runtime.kernel_plan import AMX_MAX_ROWS, KernelPlan
from mla_runtime.layers.cpu_gemm import PackedWeight, torch_product
from mla_runtime.layers.qweight import QuantizedWeight, default_plan, stack_rows


class Bf16Weight(QuantizedWeight):
    """A bfloat16 ``[N, K]`` matrix standing for a weight of another dtype (float32)."""

    __slots__ = ("weight", "kernel", "native")
    scheme = "bf16"
    half = torch.bfloat16

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        if weight.dtype != self.half:
            raise ValueError(f"{type(self).__name__}: a {self.half} matrix, got {weight.dtype}")
        self._release_float(weight.shape, dtype, weight.device)
        self.weight = weight
        self.bind(default_plan(weight.device))

    def bind(self, plan: KernelPlan) -> Bf16Weight:
        super().bind(plan)
        self.compiled = plan.ops_failure is None
        self.kernel = self.on_cpu and self.weight.is_contiguous() and plan.half_kernel(self.half)
        # many-row bfloat16 products: oneDNN's on their blocked layout where this CPU has them
        onednn = self.on_cpu and self.half == torch.bfloat16 and plan.choice(torch.bfloat16).path == "onednn"
        self.native = PackedWeight.make(self.weight, plan) if onednn else None
        native = self.native  # dense_linear's operand and row limits (PackedWeight)
        self.operand = None if native is None else native.blocked if native.blocked is not None else native.plain
        self.rows = (cpu_kernels.max_rows(self.half) if self.kernel else 0, 0,
                     AMX_MAX_ROWS if native is not None and native.amx is not None else 0)
        return self

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Bf16Weight:
        return cls(weight.detach().to(cls.half).contiguous(), weight.dtype)

    @classmethod
    def cat(cls, parts: Sequence[QuantizedWeight]) -> Bf16Weight:
        mats = [cast(Bf16Weight, p) for p in parts]
        return cls(stack_rows([m.weight for m in mats]), mats[0].plain.dtype)

    def select_rows(self, index: torch.Tensor) -> Bf16Weight:
        return type(self)(self.weight[index].contiguous(), self.plain.dtype)

    @property
    def nbytes(self) -> int:
        """The matrix, and its second layout where it keeps one: oneDNN's blocked copy, or AMX's tiles."""
        second = None if self.native is None else self.native.amx if self.native.amx is not None else \
            self.native.blocked
        return self.weight.numel() * 2 + (0 if second is None else second.nbytes)

    @classmethod
    def stored_bytes(cls, rows: int, k: int, block: tuple[int, int] | None = None) -> int:
        """Two bytes a value (a second layout, where ``native`` keeps one, adds as many)."""
        return rows * k * cls.half.itemsize

    def row_operand(self) -> torch.Tensor | None:
        return self.weight if self.kernel else None

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    def _dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:
        return self.weight[r0:r1].float()

    def rounds_rows(self, x: torch.Tensor) -> bool:
        """Whether the product with ``x [..., K]`` runs oneDNN's bfloat16 product, ``x``'s rows rounded to bfloat16
        (``matmul``): where the caller may as well compute in bfloat16 around it, as a bfloat16 model does."""
        few = self.kernel and x.numel() <= cpu_kernels.max_rows(self.half) * self.weight.shape[1]
        return self.native is not None and x.numel() > 0 and not few

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K]`` (any float dtype) -> ``x · Wᵀ (+ bias)`` in ``x``'s dtype: ``dense_linear`` where the
        operators load (the few-row kernel reading two bytes a weight, AMX tiles, then the bfloat16 products on
        ``native``'s layout or the weight widened a block at a time), else the torch fallback."""
        if self.compiled and self.on_cpu:
            native = self.native
            return cpu_kernels.dense_linear(x, self.weight, self.operand, None if native is None else native.amx, bias,
                                            self.rows, native is not None or self.widened_onednn)
        operand = self.operand
        if operand is not None:
            return torch_product(x, operand, bias, onednn=True)
        return self.widened_product(x, bias)


class F16Weight(Bf16Weight):
    """A float16 ``[N, K]`` matrix standing for a weight of another dtype (float32)."""

    __slots__ = ()
    scheme = "fp16"
    half = torch.float16


def half_mlp(gate_up: PackedWeight | None, x: torch.Tensor) -> bool:
    """Whether a float32 gated MLP whose fused gate and up weight is ``gate_up`` computes ``x``'s rows in bfloat16:
    where that product rounds them to bfloat16 anyway (``Bf16Weight.rounds_rows``: a prefill's rows, on a CPU with
    native bfloat16 products), the activation and the down product take its bfloat16 output as a bfloat16 model's do,
    instead of widening it to float32 and rounding it again."""
    return x.dtype == torch.float32 and isinstance(gate_up, Bf16Weight) and gate_up.rounds_rows(x)
