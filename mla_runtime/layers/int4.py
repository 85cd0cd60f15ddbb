"""Weight-only int4 quantisation (``quantization="int4"``): ggml's Q4_0 number format, done at load.

Each matrix ``W [N, K]`` is cut into groups of 32 values along ``K``; each group gets one float16 scale and 32
signed 4-bit values, by exactly the rule of ggml's ``quantize_row_q4_0_ref`` (so the weights equal those of a Q4_0
GGUF made from the same float32 matrix)::

    m = the group's value of largest magnitude, with its sign (the first such value; +0.0 for a zero group)
    d = m / -8                        (float32; stored rounded to float16, to nearest even)
    q = min(15, trunc(fl(fl(x * fl(1 / d)) + 8.5))) - 8   ∈ [-8, 7]   (float32 operations, each rounded; 0 if d = 0)
    W ≈ q * fp16(d)

(``m`` itself maps to ``q = -8``, so every group uses the full range ``[-8, 7]``. ``q`` is computed with the float32
``d`` but multiplies its float16 rounding, as in Q4_0. A Q4_0 build that fuses ``x * (1 / d) + 8.5`` into one
FMA can differ by one step where that sum lies within float32 rounding of an integer: ggml's reference is plain
C compiled without FMA on x86.) ``K`` need not be a multiple of 32: the last group is padded with zeros, in the
storage too.

Storage: ``packed [N, Kp / 2]`` uint8 (``Kp``: ``K`` rounded up to a multiple of 32), in each group's 16 bytes
byte ``j`` holding ``q[j] + 8`` in its low nibble and ``q[j + 16] + 8`` in its high one (Q4_0's block order), and
``scales [N, Kp / 32]`` float16: 0.5625 bytes per weight (18 bytes per 32 values, as Q4_0).

Products: on the CPU, every product (decoding, a speculative verification, a batch, a prefill; 64 rows a pass) runs
the compiled kernel of ``mla_kernels.cpu_kernels`` (``linear``, ``csrc/gemv_int4.c``; AVX2, or AVX-512
VNNI where the CPU has it, with the same bits) where it builds and its check passes (``KernelPlan.int4_failure``): it
reads half a byte per weight, once for all the rows, rounds each input row to int8 with a scale per group of 32 as
ggml's Q8_0 does (``int4_format.quantize_q8_groups``), and sums each group's exact integer dot product in float32
with the two scales: the arithmetic of llama.cpp's Q4_0 × Q8_0 products. A row's result does not depend on the rows
beside it, whatever the batch: a prefill's products take this kernel too, 0.4–0.5x the time of widening the
weight to float32 and multiplying (``[4096, 1024]``, 128 rows: 5.5 against 23 ms; 512 rows: 20 against 40 ms; 2
threads, AVX-512 EPYC), where oneDNN's bfloat16 products of a dequantised copy, 1.1x faster on a 128-token prefill,
would round the rows to bfloat16 and make a prompt's answer depend on what shares its step. The compiled
decode step reads the same matrices (``row_operand``). Everywhere else (other devices, ``cpu_gemm=plain``) the
matrix is dequantised to float32, a block of output rows at a time, and multiplied with ``F.linear`` in float32
(float32 activations).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F

from mla_kernels import cpu_kernels
from mla_kernels.int4_format import INT4_GROUP, pack_int4, unpack_int4
from mla_runtime.kernel_plan import KernelPlan
from mla_runtime.layers.qweight import QuantizedWeight, default_plan

GROUP = INT4_GROUP  # values per float16 scale along K
QMIN, QMAX = -8, 7
CHUNK_ELEMENTS = 1 << 22  # quantisation works on blocks of rows of about this many values


def padded(k: int) -> int:
    """``K`` rounded up to a whole number of groups."""
    return -(-k // GROUP) * GROUP


def quantize_q4_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (``q [N, Kp]`` int8 in [-8, 7], zero past ``K``; ``scales [N, Kp / 32]`` float16) by Q4_0's
    rule (module docstring), on ``weight``'s device, a block of rows at a time."""
    n, k = weight.shape
    kp = padded(k)
    q = torch.empty(n, kp, dtype=torch.int8, device=weight.device)
    scales = torch.empty(n, kp // GROUP, dtype=torch.float16, device=weight.device)
    step = max(1, CHUNK_ELEMENTS // kp)
    for r0 in range(0, n, step):
        w = weight[r0:r0 + step].detach().float()
        if kp != k:
            w = F.pad(w, (0, kp - k))
        blocks = w.reshape(w.shape[0], -1, GROUP)
        mag = blocks.abs()
        amax = mag.amax(dim=-1, keepdim=True)
        first = (mag == amax).to(torch.uint8).argmax(dim=-1, keepdim=True)  # the first value of largest magnitude
        m = torch.where(amax > 0, blocks.gather(-1, first), torch.zeros_like(amax))  # +0.0 for a zero group
        d = m / -8
        inv = torch.where(d != 0, torch.ones_like(d) / d, torch.zeros_like(d))  # 1 / d: a division, rounded once
        scaled = blocks * inv  # rounded to float32, then the sum below rounded again, as in the reference
        v = (scaled + 8.5).nan_to_num_(0.0).trunc_().clamp_(0, 15)
        q[r0:r0 + step] = (v.to(torch.int8) - 8).reshape(w.shape[0], kp)
        scales[r0:r0 + step] = d.squeeze(-1).half()
    return q, scales


class Int4Weight(QuantizedWeight):
    """A group-wise int4 ``[N, K]`` matrix (module docstring): what ``cpu_gemm.linear`` runs in place of the float
    weight."""

    __slots__ = ("packed", "scales", "k", "kernel")
    scheme = "int4"

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, k: int, dtype: torch.dtype) -> None:
        """``packed [N, Kp / 2]`` uint8 nibbles (``int4_format.pack_int4``) and ``scales [N, Kp / 32]`` float16, for a
        weight ``[N, k]`` of ``dtype`` (``Kp``: ``k`` rounded up to a multiple of 32)."""
        n = packed.shape[0]
        kp = padded(k)
        if (packed.dtype != torch.uint8 or packed.shape != (n, kp // 2) or scales.dtype != torch.float16
                or scales.shape != (n, kp // GROUP) or k < 1):
            raise ValueError(f"Int4Weight: a [N, {k}] matrix takes uint8 nibbles [N, {kp // 2}] and float16 scales "
                             f"[N, {kp // GROUP}], got {packed.dtype} {tuple(packed.shape)} and {scales.dtype} "
                             f"{tuple(scales.shape)}")
        self._release_float((n, k), dtype, packed.device)
        self.packed, self.scales, self.k = packed.contiguous(), scales.contiguous(), k
        self.bind(default_plan(packed.device))

    def bind(self, plan: KernelPlan) -> Int4Weight:
        super().bind(plan)
        self.kernel = self.on_cpu and plan.int4_failure is None  # else dequantised per product
        return self

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weight:
        q, scales = quantize_q4_0(weight)
        return cls(pack_int4(q), scales, weight.shape[1], weight.dtype)

    @classmethod
    def from_int(cls, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
        """From stored integers: ``q [N, K]`` (an integer dtype, values in [-8, 7]) and ``scales [N, ceil(K / 32)]``
        (float16; another float dtype is rounded to float16), for a weight of ``dtype``."""
        n, k = q.shape
        kp = padded(k)
        if q.dtype.is_floating_point or q.dtype == torch.bool or scales.shape != (n, kp // GROUP):
            raise ValueError(f"Int4Weight.from_int: integer q [N, K] and scales [N, ceil(K / {GROUP})], got q "
                             f"{q.dtype} {tuple(q.shape)} and scales {tuple(scales.shape)}")
        if q.numel() and (int(q.min()) < QMIN or int(q.max()) > QMAX):
            raise ValueError(f"Int4Weight.from_int: values must lie in [{QMIN}, {QMAX}], got [{int(q.min())}, "
                             f"{int(q.max())}]")
        wide = F.pad(q.to(torch.int8), (0, kp - k))
        return cls(pack_int4(wide), scales.to(torch.float16), k, dtype)

    @classmethod
    def from_words(cls, words: torch.Tensor, scales: torch.Tensor, k: int, dtype: torch.dtype) -> Int4Weight:
        """From compressed-tensors' pack-quantized storage of a ``[N, k]`` matrix whose ``k`` is a multiple of 32:
        ``words [N, k / 8]`` int32 holding value ``i`` of a row at bits ``4i`` of the row's little-endian bytes,
        offset by 8, and ``scales [N, k / 32]``. The nibbles are moved into this format's order with byte
        operations (no widening to one value a byte), which is what makes loading such a checkpoint cost little more
        than reading it."""
        n = words.shape[0]
        if k % GROUP or words.dtype != torch.int32 or words.shape != (n, k // 8) or scales.shape != (n, k // GROUP):
            raise ValueError(f"Int4Weight.from_words: int32 words [N, {k // 8}] and scales [N, {k // GROUP}] of a "
                             f"matrix whose K ({k}) is a multiple of {GROUP}, got {words.dtype} "
                             f"{tuple(words.shape)} and {tuple(scales.shape)}")
        stored = words.contiguous().view(torch.uint8)
        if stored.device.type == "cpu" and cpu_kernels.failure() is None:
            packed = cpu_kernels.ops().int4_from_stored(stored)
        else:
            halves = stored.view(n, k // GROUP, 2, GROUP // 4)  # values 0..15, 16..31
            values = torch.stack((halves & 0x0F, halves >> 4), dim=-1).view(n, k // GROUP, 2, GROUP // 2)
            packed = values[:, :, 0] | (values[:, :, 1] << 4)
        return cls(packed.reshape(n, k // 2), scales.to(torch.float16), k, dtype)

    def to_int(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(``q [N, K]`` int8 in [-8, 7], ``scales [N, ceil(K / 32)]`` float16): what ``from_int`` takes."""
        return unpack_int4(self.packed)[:, :self.k].contiguous(), self.scales

    @classmethod
    def cat(cls, parts: Sequence[QuantizedWeight]) -> Int4Weight:
        int4 = [cast(Int4Weight, p) for p in parts]
        if not int4 or any(not isinstance(p, Int4Weight) or p.k != int4[0].k for p in int4):
            raise ValueError("Int4Weight.cat: int4 matrices of one K")
        return cls(torch.cat([p.packed for p in int4]), torch.cat([p.scales for p in int4]), int4[0].k,
                   int4[0].plain.dtype)

    def select_rows(self, index: torch.Tensor) -> Int4Weight:
        index = index.to(self.packed.device)
        return Int4Weight(self.packed[index], self.scales[index], self.k, self.plain.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() * self.scales.element_size()

    @classmethod
    def stored_bytes(cls, rows: int, k: int, block: tuple[int, int] | None = None) -> int:
        """Half a byte a value and a float16 scale per ``GROUP`` values of a row, ``K`` padded to whole groups."""
        kp = padded(k)
        return rows * kp // 2 + 2 * rows * (kp // GROUP)

    def row_operand(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The matrix as the compiled layer and MLP kernels read it (``cpu_tables.Operand``), where they run."""
        return (self.packed, self.scales) if self.kernel else None

    def _dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:
        q = unpack_int4(self.packed[r0:r1]).float().view(r1 - r0, -1, GROUP)
        return (q * self.scales[r0:r1].float().unsqueeze(-1)).view(r1 - r0, -1)[:, :self.k]

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix this one stands for."""
        return self._dequantize_rows(0, self.packed.shape[0]).contiguous()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K]`` (any float dtype) -> ``x · Wᵀ (+ bias)`` in ``x``'s dtype."""
        if self.kernel and x.numel():  # the kernel (module docstring), 64 rows a pass
            bias = None if bias is None else bias.float()
            return cpu_kernels.linear(x, self.packed, self.scales, bias=bias).to(x.dtype)
        return self.widened_product(x, bias)
