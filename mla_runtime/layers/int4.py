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

Stored checkpoints (AWQ, GPTQ, compressed-tensors W4A16: ``stored_int4``) keep their own groups in the same
nibbles: a float16 scale per ``group`` of 32, 64 or 128 values and, where asymmetric, a byte zero point ``z`` per
group (0 to 16), ``W ≈ scale * (nibble - z)`` (the format above is ``z = 8``); act-order ones their inputs' order
(``orders``). Their products take the same kernel (``cpu_kernels.linear_int4``: each group of 64 or 128 spans 2 or 4
of the input rows' groups of 32; the zero's term is ``-z`` times the rounded inputs' integer sum, exact) or the same
widening; only Q4_0's form (``q4_0``) takes the fused one-row decode kernels.

W4A16 (``quantization="w4a16"``, ``W4A16Weight``): the asymmetric groups of 128 of AWQ's and llm-compressor's
``W4A16_ASYM`` checkpoints, made at load or by ``mla-runtime quantize`` (compressed-tensors' min/max rule: the group's
range widened to hold 0, ``s = (max - min) / 15`` in float32, at least ``2^-24``; ``zero = round(clamp(-8 - min / s,
-8, 7))``; ``s`` stored rounded to float16; ``q = clamp(round(x / fp16(s) + zero), -8, 7)``; ``W = fp16(s) * (q -
zero)``), held as the stored checkpoints' groups are (a nibble ``q + 8``, a zero point ``zero + 8``). A matrix whose
``K`` is not a multiple of 128 takes Q4_0's groups of 32, as a written checkpoint leaves it float for loading to.

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
from mla_runtime.config import W4A16_GROUP
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


GROUPS = (32, 64, 128)  # the group widths the int4 kernels take
# row segments of a matrix whose inputs are reordered (GPTQ's act-order, made contiguous at load): (end row, the input
# order of the rows up to it: column j of the stored rows multiplies x[..., order[j]]; None: the identity)
Orders = tuple[tuple[int, torch.Tensor | None], ...]


def _check_layout(n: int, k: int, packed: torch.Tensor, scales: torch.Tensor, group: int,
                  zeros: torch.Tensor | None) -> None:
    kp = padded(k)
    per = -(-kp // group)
    if group not in GROUPS or (group > GROUP and k % group):
        raise ValueError(f"Int4Weight: groups of {', '.join(map(str, GROUPS))} values (K a multiple of a group over "
                         f"{GROUP}), got group {group} for K {k}")
    if (packed.dtype != torch.uint8 or packed.shape != (n, kp // 2) or scales.dtype != torch.float16
            or scales.shape != (n, per) or k < 1):
        raise ValueError(f"Int4Weight: a [N, {k}] matrix takes uint8 nibbles [N, {kp // 2}] and float16 scales "
                         f"[N, {per}], got {packed.dtype} {tuple(packed.shape)} and {scales.dtype} "
                         f"{tuple(scales.shape)}")
    if zeros is not None and (zeros.dtype != torch.uint8 or zeros.shape != (n, per)):
        raise ValueError(f"Int4Weight: zero points are uint8 [N, {per}], got {zeros.dtype} {tuple(zeros.shape)}")


def _cat_orders(parts: Sequence[Int4Weight]) -> Orders | None:
    """The row segments of ``parts`` stacked; adjacent segments of one order joined."""
    if all(p.orders is None for p in parts):
        return None
    segments: list[tuple[int, torch.Tensor | None]] = []
    base = 0
    for p in parts:
        for end, order in p.orders or ((p.packed.shape[0], None),):
            last = segments[-1][1] if segments else False
            same = segments and (last is order or (isinstance(last, torch.Tensor) and order is not None
                                                   and torch.equal(last, order)))
            if same:
                segments[-1] = (base + end, segments[-1][1])
            else:
                segments.append((base + end, order))
        base += p.packed.shape[0]
    return tuple(segments)


class Int4Weight(QuantizedWeight):
    """A group-wise int4 ``[N, K]`` matrix (module docstring): what ``cpu_gemm.linear`` runs in place of the float
    weight."""

    __slots__ = ("packed", "scales", "k", "kernel", "group", "zeros", "orders", "table")
    scheme = "int4"

    @property
    def rounds_to_int8(self) -> bool:  # type: ignore[override]
        return bool(self.kernel)  # the kernels round the rows to int8 in groups of 32; the fallback widens

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, k: int, dtype: torch.dtype, *, group: int = GROUP,
                 zeros: torch.Tensor | None = None, orders: Orders | None = None) -> None:
        """``packed [N, Kp / 2]`` uint8 nibbles (``int4_format.pack_int4``) and ``scales [N, Kp / group]`` float16, for
        a weight ``[N, k]`` of ``dtype`` (``Kp``: ``k`` rounded up to a multiple of 32): ``W = scale * (q + 8 - zero)``
        per group of ``group`` values (32, 64 or 128; ``k`` a multiple of it where it is over 32), ``zeros
        [N, Kp / group]`` uint8 in [0, 16] for asymmetric groups (None: 8, symmetric). ``orders``: the inputs each
        block of rows reads in place of ``x`` (``Orders``; None: ``x`` as it is)."""
        n = packed.shape[0]
        _check_layout(n, k, packed, scales, group, zeros)
        if orders is not None and (orders[-1][0] != n or any(o is not None and o.shape != (k,) for _, o in orders)):
            raise ValueError(f"Int4Weight: input orders must cover the {n} rows with [{k}] indices each")
        self._release_float((n, k), dtype, packed.device)
        self.packed, self.scales, self.k = packed.contiguous(), scales.contiguous(), k
        self.group, self.orders = group, orders
        self.zeros = None if zeros is None else zeros.contiguous()
        self.table: torch.Tensor | None = None  # row_operand's int4 table of a grouped matrix, made at its first call
        self.bind(default_plan(packed.device))

    def bind(self, plan: KernelPlan) -> Int4Weight:
        super().bind(plan)
        self.kernel = self.on_cpu and plan.int4_failure is None  # else dequantised per product
        return self

    @property
    def q4_0(self) -> bool:
        """Whether the matrix is in ggml's Q4_0 form: symmetric groups of 32, inputs in their order."""
        return self.group == GROUP and self.zeros is None and self.orders is None

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
    def from_unsigned(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
                      dtype: torch.dtype, order: torch.Tensor | None = None) -> Int4Weight:
        """From a stored asymmetric (or wider-grouped) matrix: ``q [N, K]`` integers in [0, 15], ``scales
        [N, K / group]`` (rounded to float16; float16 and bfloat16 scales of float16's range exactly) and ``zeros``
        (integers in [0, 16] of the same shape; None: 8), ``W = scale * (q - zero)`` per group of ``group`` values
        along ``K``; ``order``: the inputs the columns multiply (``x[..., order]``; None: ``x``)."""
        n, k = q.shape
        if q.dtype.is_floating_point or q.dtype == torch.bool:
            raise ValueError(f"Int4Weight.from_unsigned: integer q [N, K], got {q.dtype}")
        for name, t, top in (("values", q, 15), ("zero points", zeros, 16)):
            if t is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) > top):
                raise ValueError(f"Int4Weight.from_unsigned: {name} must lie in [0, {top}], got [{int(t.min())}, "
                                 f"{int(t.max())}]")
        wide = F.pad(q.to(torch.int16) - 8, (0, padded(k) - k)).to(torch.int8)
        z = None if zeros is None else zeros.to(torch.uint8)
        orders = None if order is None else ((n, order.to(torch.int64).contiguous()),)
        return cls(pack_int4(wide), scales.to(torch.float16), k, dtype, group=group, zeros=z, orders=orders)

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
        return cls(nibbles_from_words(words, k), scales.to(torch.float16), k, dtype)

    def to_int(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(``q [N, K]`` int8 in [-8, 7], ``scales [N, ceil(K / 32)]`` float16): what ``from_int`` takes, for a matrix
        in Q4_0's form (``q4_0``)."""
        if not self.q4_0:
            raise ValueError(f"Int4Weight.to_int: symmetric groups of {GROUP} in input order only (this matrix has "
                             f"groups of {self.group}{', zero points' if self.zeros is not None else ''}"
                             f"{', reordered inputs' if self.orders is not None else ''})")
        return unpack_int4(self.packed)[:, :self.k].contiguous(), self.scales

    @classmethod
    def cat(cls, parts: Sequence[QuantizedWeight]) -> Int4Weight:
        int4 = [cast(Int4Weight, p) for p in parts]
        if not int4 or any(not isinstance(p, Int4Weight) or (p.k, p.group) != (int4[0].k, int4[0].group)
                           for p in int4):
            raise ValueError("Int4Weight.cat: int4 matrices of one K and one group width")
        zeros = None
        if any(p.zeros is not None for p in int4):  # a symmetric part's zero points are 8
            zeros = torch.cat([torch.full_like(p.scales, 8, dtype=torch.uint8) if p.zeros is None else p.zeros
                               for p in int4])
        return cls(torch.cat([p.packed for p in int4]), torch.cat([p.scales for p in int4]), int4[0].k,
                   int4[0].plain.dtype, group=int4[0].group, zeros=zeros, orders=_cat_orders(int4))

    def select_rows(self, index: torch.Tensor) -> Int4Weight:
        index = index.to(self.packed.device)
        if self.orders is not None and len(self.orders) > 1:
            raise ValueError("Int4Weight.select_rows: a matrix whose row blocks reorder their inputs differently")
        orders = None if self.orders is None else ((len(index), self.orders[0][1]),)
        return Int4Weight(self.packed[index], self.scales[index], self.k, self.plain.dtype, group=self.group,
                          zeros=None if self.zeros is None else self.zeros[index], orders=orders)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.zeros is None else self.zeros.numel()
        orders = {id(o): o for _, o in self.orders or () if o is not None}
        return (self.packed.numel() + self.scales.numel() * self.scales.element_size() + extra
                + sum(o.numel() * o.element_size() for o in orders.values()))

    @classmethod
    def stored_bytes(cls, rows: int, k: int, block: tuple[int, int] | None = None) -> int:
        """Half a byte a value and a float16 scale per ``GROUP`` values of a row, ``K`` padded to whole groups."""
        return layout_bytes(rows, k, GROUP, False)

    def row_operand(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The matrix as the compiled layer and MLP kernels read it (``cpu_tables.Operand``), where they run: a matrix
        in Q4_0's form (``q4_0``) as its nibbles and scales; one in other groups or with zero points (AWQ, GPTQ
        without act-order, W4A16) as its nibbles and the int4 table of its scales and zeros (``cpu_kernels.int4_table``:
        ``linear_int4``'s product, the same bits). One whose blocks of rows read their inputs reordered (GPTQ's
        act-order) runs product by product."""
        if not self.kernel or self.orders is not None:
            return None
        if self.q4_0:
            return self.packed, self.scales
        if self.table is None:
            self.table = cpu_kernels.int4_table(self.packed, self.scales, self.zeros, self.group, self.k)
        return self.packed, self.table

    def _dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:
        q = unpack_int4(self.packed[r0:r1]).float().view(r1 - r0, -1, self.group)
        scales = self.scales[r0:r1].float().unsqueeze(-1)
        if self.zeros is not None:  # the nibble is q + 8
            q = q + (8.0 - self.zeros[r0:r1].float().unsqueeze(-1))
        w = (q * scales).view(r1 - r0, -1)[:, :self.k]
        if self.orders is None:
            return w
        out = torch.empty_like(w)
        start = 0
        for end, order in self.orders:  # column j of a block's rows is input order[j]
            a, b = max(start, r0), min(end, r1)
            if a < b:
                if order is None:
                    out[a - r0:b - r0] = w[a - r0:b - r0]
                else:
                    out[a - r0:b - r0, order] = w[a - r0:b - r0]
            start = end
        return out

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix this one stands for (its columns in the inputs' order)."""
        return self._dequantize_rows(0, self.packed.shape[0]).contiguous()

    def _kernel_product(self, x: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        if self.group == GROUP and self.zeros is None:  # Q4_0's numbers (its rows' inputs possibly reordered)
            return cpu_kernels.linear(x, self.packed[r0:r1], self.scales[r0:r1])
        zeros = None if self.zeros is None else self.zeros[r0:r1]
        return cpu_kernels.linear_int4(x, self.packed[r0:r1], self.scales[r0:r1], zeros, self.group)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K]`` (any float dtype) -> ``x · Wᵀ (+ bias)`` in ``x``'s dtype."""
        if not (self.kernel and x.numel()):
            return self.widened_product(x, bias)
        # the kernel (module docstring), 64 rows a pass; a row block whose inputs are reordered reads them so
        n = self.packed.shape[0]
        if self.orders is None:
            y = self._kernel_product(x, 0, n)
        else:
            start, blocks = 0, []
            for end, order in self.orders:
                blocks.append(self._kernel_product(x if order is None else x.index_select(-1, order), start, end))
                start = end
            y = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-1)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


def quantize_w4a16(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (``K`` a multiple of 128) -> (``q [N, K]`` uint8 nibbles in [0, 15], ``scales [N, K / 128]``
    float16, ``zeros [N, K / 128]`` uint8 in [0, 15]) by the W4A16 rule (module docstring), a block of rows at a
    time: ``W = scale * (q - zero)``."""
    n, k = weight.shape
    if k % W4A16_GROUP:
        raise ValueError(f"quantize_w4a16: K must be a multiple of {W4A16_GROUP}, got {k}")
    q = torch.empty(n, k, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(n, k // W4A16_GROUP, dtype=torch.float16, device=weight.device)
    zeros = torch.empty(n, k // W4A16_GROUP, dtype=torch.uint8, device=weight.device)
    step = max(1, CHUNK_ELEMENTS // k)
    for r0 in range(0, n, step):
        w = weight[r0:r0 + step].detach().float().reshape(-1, k // W4A16_GROUP, W4A16_GROUP)
        lo, hi = w.amin(-1).clamp(max=0.0), w.amax(-1).clamp(min=0.0)
        s = ((hi - lo) / 15).clamp(2.0 ** -24, float(torch.finfo(torch.float16).max))
        zero = (-8 - lo / s).clamp(-8, 7).round()
        s16 = s.to(torch.float16)
        values = (w / s16.float().unsqueeze(-1) + zero.unsqueeze(-1)).round().clamp(-8, 7)
        q[r0:r0 + step] = (values + 8).to(torch.uint8).view(-1, k)
        scales[r0:r0 + step], zeros[r0:r0 + step] = s16, (zero + 8).to(torch.uint8)
    return q, scales, zeros


class W4A16Weight(Int4Weight):
    """An int4 matrix made by ``quantization="w4a16"``: asymmetric groups of 128 (module docstring); Q4_0's groups of
    32 where ``K`` is not a multiple of 128."""

    __slots__ = ()
    scheme = "w4a16"

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weight:
        if weight.shape[1] % W4A16_GROUP:
            return Int4Weight.quantize(weight)
        q, scales, zeros = quantize_w4a16(weight)
        return cls.from_unsigned(q, scales, zeros, W4A16_GROUP, weight.dtype)

    @classmethod
    def stored_bytes(cls, rows: int, k: int, block: tuple[int, int] | None = None) -> int:
        """Half a byte a value, a float16 scale and a byte zero point per 128 values of a row (Q4_0's bytes where
        ``K`` is not a multiple of 128)."""
        return layout_bytes(rows, k, W4A16_GROUP, True) if k % W4A16_GROUP == 0 else layout_bytes(rows, k, GROUP,
                                                                                                     False)


def nibbles_from_words(words: torch.Tensor, k: int) -> torch.Tensor:
    """compressed-tensors' pack-quantized words ``[N, k / 8]`` int32 (value ``i`` of a row at bits ``4i`` of its
    little-endian bytes; ``k`` a multiple of 32) -> this format's nibbles ``[N, k / 2]``, with byte operations."""
    n = words.shape[0]
    stored = words.contiguous().view(torch.uint8)
    if stored.device.type == "cpu" and cpu_kernels.failure() is None:
        packed = cpu_kernels.ops().int4_from_stored(stored)
    else:
        halves = stored.view(n, k // GROUP, 2, GROUP // 4)  # values 0..15, 16..31
        values = torch.stack((halves & 0x0F, halves >> 4), dim=-1).view(n, k // GROUP, 2, GROUP // 2)
        packed = values[:, :, 0] | (values[:, :, 1] << 4)
    return packed.reshape(n, k // 2)


def layout_bytes(rows: int, k: int, group: int, asymmetric: bool) -> int:
    """Bytes of a ``[rows, k]`` int4 matrix with a float16 scale (and, ``asymmetric``, a byte zero point) per
    ``group`` values of a row: half a byte a value, ``K`` padded to whole groups of 32."""
    kp = padded(k)
    per = -(-kp // group)
    return rows * kp // 2 + rows * per * (3 if asymmetric else 2)
