"""4-bit float weights (FP4 E2M1; ``mla_kernels.fp4_format``): ``mxfp4`` (a power-of-two UE8M0 scale per 32 values of
a row: the OCP MX format of DeepSeek-V4's and Kimi K3's routed experts) and ``nvfp4`` (an FP8 E4M3 scale per 16
values and a float32 global scale per tensor), loaded as compressed-tensors stores them (``mxfp4-pack-quantized``,
``nvfp4-pack-quantized``) and kept so: half a byte a value plus the stored scales (and, for NVFP4, the global scale
held once per row, so that matrices of different global scales stack).

A product on a CPU runs the compiled kernel (``csrc/gemm_fp4.c``: the nibbles widened by a 16-entry table held in a
register, times their group's scale, then float32 multiply-adds with the float32 rows; AVX2 or AVX-512, any number of
rows, 64 a pass) where it builds and its check passes (``KernelPlan.fp4_failure``); on CUDA the Triton GEMM of
``mla_kernels.fp4_gemm``, which dequantises inside the matmul; elsewhere (``cpu_gemm=plain``, other devices) the weight
widened to float32 a block of rows at a time and ``F.linear``. Every path multiplies the same float32 weights
(``fp4_format.dequantize_fp4``: ``e2m1 × group scale``, rounded once), so they agree to float32 summation order, and a
row's result does not depend on the rows beside it.

``quantize`` makes the format from float weights (the matrices a checkpoint leaves unquantised, a tied lm_head's
copy): MXFP4 by the OCP MX rule (the group's shared exponent ``floor(log2(amax)) - 2``, each value rounded to the
nearest E2M1 value, ties to even, beyond 6 to 6); NVFP4 with the global scale ``448 × 6 / amax`` of each row (so that
row blocks quantise as the stacked matrix does; ``quantize_tensor``: one for the matrix, as a checkpoint stores it)
and group scales ``amax / 6 × global`` rounded to E4M3. A ``K`` that is not a whole number of groups is padded with
zeros to one (stored checkpoints' never are); the products pad their rows to match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, cast

import torch

from mla_kernels import cpu_kernels
from mla_kernels.fp4_format import GROUPS, dequantize_fp4, group_scales, pack_nibbles, round_to_e2m1
from mla_runtime.kernel_plan import KernelPlan
from mla_runtime.layers.qweight import QuantizedWeight, default_plan, stack_rows

E4M3_MAX, E2M1_MAX = 448.0, 6.0
CHUNK_ELEMENTS = 1 << 22  # quantisation works on blocks of rows of about this many values (bounded temporaries)


def _by_row_blocks(weight: torch.Tensor, quantize: Callable[[torch.Tensor], Fp4Weight]) -> Fp4Weight:
    """``quantize`` (row-local) applied to blocks of rows of ``weight``, stacked."""
    step = max(1, CHUNK_ELEMENTS // max(1, weight.shape[-1]))
    if weight.dim() != 2 or weight.shape[0] <= step:
        return quantize(weight)
    parts = [quantize(weight[r0:r0 + step]) for r0 in range(0, weight.shape[0], step)]
    return type(parts[0]).cat(parts)


class Fp4Weight(QuantizedWeight):
    """An FP4 ``[N, K]`` matrix (module docstring); ``Mxfp4Weight`` and ``Nvfp4Weight`` are its two variants."""

    __slots__ = ("packed", "scales", "global_scales", "k", "kernel", "operand")
    variant: ClassVar[str]
    scale_dtype: ClassVar[torch.dtype]

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, global_scales: torch.Tensor | None,
                 dtype: torch.dtype, k: int | None = None) -> None:
        """``packed [N, Kp / 2]`` uint8 nibbles, ``scales [N, Kp / group]`` as stored (MXFP4 uint8 exponents, NVFP4
        float8_e4m3fn) and, for NVFP4, float32 ``global_scales [N]``; for a weight ``[N, k]`` of ``dtype`` (``k``,
        default ``Kp``: ``Kp`` is ``k`` rounded up to whole groups, the values past ``k`` zero)."""
        group = GROUPS[self.variant]
        n, kp = packed.shape[0], 2 * packed.shape[1] if packed.dim() == 2 else 0
        k = kp if k is None else k
        nv = self.variant == "nvfp4"
        if (packed.dtype != torch.uint8 or packed.dim() != 2 or kp == 0 or kp % group or not kp - group < k <= kp
                or scales.dtype != self.scale_dtype or scales.shape != (n, kp // group)
                or (global_scales is None) == nv or (nv and cast(torch.Tensor, global_scales).shape != (n,))):
            raise ValueError(
                f"{type(self).__name__}: uint8 nibbles [N, Kp / 2] ({k} values a row, Kp a multiple of {group}), "
                f"{self.scale_dtype} scales [N, Kp / {group}]{' and float32 global scales [N]' if nv else ''}; got "
                f"{packed.dtype} "
                f"{tuple(packed.shape)}, {scales.dtype} {tuple(scales.shape)} and "
                f"{None if global_scales is None else tuple(global_scales.shape)}")
        self._release_float((n, k), dtype, packed.device)
        self.packed, self.scales, self.k = packed, scales.contiguous(), k
        self.global_scales = None if global_scales is None else global_scales.float().contiguous()
        self.operand: torch.Tensor | None = None  # row_operand's FP4 table, made at its first call
        self.bind(default_plan(packed.device))

    def bind(self, plan: KernelPlan) -> Fp4Weight:
        super().bind(plan)
        self.kernel = self.on_cpu and plan.fp4_failure is None  # else widened a block of rows at a time
        return self

    @classmethod
    def cat(cls, parts: Sequence[QuantizedWeight]) -> Fp4Weight:
        fp4 = [cast(Fp4Weight, p) for p in parts]
        if not fp4 or any(type(p) is not cls or p.shape[1] != fp4[0].shape[1] for p in fp4):
            raise ValueError(f"{cls.__name__}.cat: {cls.variant} matrices of one K")
        glob = None if fp4[0].global_scales is None else torch.cat([cast(torch.Tensor, p.global_scales) for p in fp4])
        return cls(stack_rows([p.packed for p in fp4]), torch.cat([p.scales for p in fp4]), glob, fp4[0].plain.dtype,
                   fp4[0].k)

    def select_rows(self, index: torch.Tensor) -> Fp4Weight:
        index = index.to(self.packed.device)
        glob = None if self.global_scales is None else self.global_scales[index]
        return type(self)(self.packed[index].contiguous(), self.scales[index], glob, self.plain.dtype, self.k)

    @property
    def nbytes(self) -> int:
        glob = 0 if self.global_scales is None else 4 * self.global_scales.numel()
        return self.packed.numel() + self.scales.numel() + glob

    @classmethod
    def stored_bytes(cls, rows: int, k: int, block: tuple[int, int] | None = None) -> int:
        """Half a byte a value, a byte a group's scale (``K`` padded to whole groups), and for NVFP4 a float32 global
        scale a row."""
        groups = -(-k // GROUPS[cls.variant])
        return rows * groups * GROUPS[cls.variant] // 2 + rows * groups + (4 * rows if cls.variant == "nvfp4" else 0)

    def row_operand(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The matrix as the compiled layer and MLP kernels read it (``cpu_tables.Operand``: the nibbles and their FP4
        table, ``cpu_kernels.fp4_table``, made once and kept beside the scales it points into), where its kernel runs
        and ``K`` is whole groups; else None (the matrix runs product by product)."""
        if not self.kernel or 2 * self.packed.shape[1] != self.k or not self.packed.is_contiguous():
            return None
        if self.operand is None:
            self.operand = cpu_kernels.fp4_table(self.packed, self.scales, self.global_scales)
        return self.packed, self.operand

    def _dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:
        glob = None if self.global_scales is None else self.global_scales[r0:r1]
        return dequantize_fp4(self.variant, self.packed[r0:r1], self.scales[r0:r1], glob)[:, :self.k]

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix this one stands for."""
        return self._dequantize_rows(0, self.packed.shape[0])

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K]`` (any float dtype) -> ``x · Wᵀ (+ bias)`` in ``x``'s dtype."""
        if self.kernel and x.numel():
            wide_bias = None if bias is None else bias.float()
            return cpu_kernels.fp4_linear(x, self.packed, self.scales, self.global_scales,
                                          bias=wide_bias).to(x.dtype)
        if self.packed.is_cuda:
            from mla_kernels.fp4_gemm import fp4_gemm  # imports Triton: only where a CUDA product runs

            kp = 2 * self.packed.shape[1]
            wide = x if kp == self.k else torch.nn.functional.pad(x, (0, kp - self.k))
            y = fp4_gemm(wide, self.packed, self.scales, self.global_scales, self.variant)
            return (y if bias is None else y + bias.float()).to(x.dtype)
        return self.widened_product(x, bias)


def _groups(name: str, weight: torch.Tensor, group: int) -> torch.Tensor:
    """``weight [N, K]`` in float32 as ``[N, Kp / group, group]``, padded with zeros to whole groups."""
    w = weight.detach().float()
    if w.dim() != 2 or w.shape[1] < 1:
        raise ValueError(f"{name}: a matrix [N, K] expected, got {tuple(w.shape)}")
    pad = -w.shape[1] % group
    return (torch.nn.functional.pad(w, (0, pad)) if pad else w).reshape(w.shape[0], -1, group)


class Mxfp4Weight(Fp4Weight):
    """MXFP4: E2M1 values with a UE8M0 (power-of-two) scale per 32 values of a row."""

    __slots__ = ()
    scheme = variant = "mxfp4"
    scale_dtype = torch.uint8

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Mxfp4Weight:
        return cast(Mxfp4Weight, _by_row_blocks(weight, cls._quantize))

    @classmethod
    def _quantize(cls, weight: torch.Tensor) -> Mxfp4Weight:
        groups = _groups("mxfp4", weight, GROUPS["mxfp4"])
        amax = groups.abs().amax(-1)
        _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): floor(log2(amax)) = exp - 1
        shared = torch.where(amax > 0, exp - 1 - 2, torch.zeros_like(exp)).clamp(-127, 127)
        exponents = (shared + 127).to(torch.uint8)
        codes = round_to_e2m1(groups / group_scales("mxfp4", exponents, None).unsqueeze(-1))
        return cls(pack_nibbles(codes.reshape(weight.shape[0], -1)), exponents, None, weight.dtype, weight.shape[1])


class Nvfp4Weight(Fp4Weight):
    """NVFP4: E2M1 values with an FP8 E4M3 scale per 16 values of a row and a float32 global scale."""

    __slots__ = ()
    scheme = variant = "nvfp4"
    scale_dtype = torch.float8_e4m3fn

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Nvfp4Weight:
        """Each row with its own global scale, ``448 × 6 / amax`` of the row: quantising row blocks one at a time and
        stacking them gives what quantising the stacked matrix gives."""
        return cast(Nvfp4Weight, _by_row_blocks(weight, cls._quantize))

    @classmethod
    def _quantize(cls, weight: torch.Tensor) -> Nvfp4Weight:
        groups = _groups("nvfp4", weight, GROUPS["nvfp4"])
        amax = groups.abs().amax(dim=(1, 2))
        return cls._with_global(weight, groups, torch.where(amax > 0, E4M3_MAX * E2M1_MAX / amax, 1.0))

    @classmethod
    def quantize_tensor(cls, weight: torch.Tensor) -> Nvfp4Weight:
        """One global scale for the whole matrix (``448 × 6 / amax``), as a compressed-tensors checkpoint stores it."""
        groups = _groups("nvfp4", weight, GROUPS["nvfp4"])
        amax = groups.abs().amax()
        glob = E4M3_MAX * E2M1_MAX / amax if amax > 0 else torch.ones((), device=amax.device)
        return cls._with_global(weight, groups, glob.float().expand(weight.shape[0]))

    @classmethod
    def _with_global(cls, weight: torch.Tensor, groups: torch.Tensor, glob: torch.Tensor) -> Nvfp4Weight:
        """``groups [N, Kp / 16, 16]`` of ``weight`` quantised under the rows' global scales ``glob [N]``: the group
        scales ``amax / 6 × global`` rounded to E4M3, each value to the nearest E2M1 step of its group."""
        glob = glob.float().contiguous()
        scales = (groups.abs().amax(-1) / E2M1_MAX * glob[:, None]).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        step = group_scales("nvfp4", scales, glob).unsqueeze(-1)
        codes = round_to_e2m1(torch.where(step > 0, groups / step, torch.zeros((), device=step.device)))
        return cls(pack_nibbles(codes.reshape(weight.shape[0], -1)), scales, glob, weight.dtype, weight.shape[1])
