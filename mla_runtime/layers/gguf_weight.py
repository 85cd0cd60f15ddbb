"""Matrices kept in the ggml block types a GGUF file stores them in (``GgufWeight``), and Q4_0 moved into the int4
format (``int4_from_q4_0``).

A ggml type cuts each row of ``K`` values into blocks of ``block`` values stored in ``type_size`` bytes
(``gguf.GGML_QUANT_SIZES``): Q8_0 32 values in 34 bytes (a float16 scale, 32 int8), Q4_0 32 in 18, the K-quants 256
values in super-blocks with their own scales (Q2_K 84 bytes ... Q6_K 210). A ``GgufWeight`` holds a matrix's rows as
those bytes, ``[rows, K / block * type_size]`` uint8 per part, and a matrix stacked from tensors of different types
(``gate_proj`` Q4_K beside ``up_proj`` Q6_K) keeps one part per type: the type is data, not a class.

On a CPU whose compiled kernels passed their check (``KernelPlan.ggml_failure``), a part in a type they read
(``KERNEL_TYPES``: Q8_0, Q4_1, Q5_0, Q5_1, Q2_K to Q6_K) multiplies straight from its stored blocks
(``mla_kernels.cpu_kernels.ggml_linear``: the rows rounded to int8 per group of 32, each block's integer dot products
scaled in float32; a row's result the same bits whatever rows share the product). Other parts, and every part off a
CPU or under ``cpu_gemm=plain``, widen the weight to float32 a block of output rows at a time
(``QuantizedWeight.widened_product``: about ``WIDEN_CHUNK_ELEMENTS`` values, never the whole matrix) and multiply in
float32: Q8_0, Q4_K and Q6_K (a Q4_K_M or Q5_K_M file's most common types) widened by torch on the weight's device,
the others by the ``gguf`` package's dequantisers (numpy) through the CPU.

Q4_0 is the runtime's int4 number format exactly (``layers.int4``: groups of 32 along ``K``, one float16 scale,
``q[j] + 8`` in the low nibble of byte ``j`` and ``q[j + 16] + 8`` in its high nibble), so a Q4_0 matrix becomes an
``Int4Weight`` by moving bytes: each block's two scale bytes go to the scales, its 16 nibble bytes to the packed
matrix, nothing dequantised, and its products take the int4 kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F

from mla_kernels import cpu_kernels
from mla_kernels.cpu_check import GGML_TYPES
from mla_runtime.gguf_meta import R8_BYTES, RUN, RUN_BLOCKS, RUN_SUPERS, repacks
from mla_runtime.kernel_plan import KernelPlan
from mla_runtime.layers.int4 import Int4Weight
from mla_runtime.layers.qweight import WIDEN_CHUNK_ELEMENTS, QuantizedWeight, default_plan

FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
Q4_K_R8 = "Q4_K_R8"  # Q4_K rows repacked for the kernels (``GgufWeight.repack``), eight rows interleaved
KERNEL_TYPES = frozenset(GGML_TYPES) | {Q4_K_R8}  # the types the compiled CPU kernels multiply as stored
GGML_MAX_PARTS = 8  # the parts a matrix may have in the compiled layer and MLP kernels' tables (csrc/mla_cpu.h)


def block_shape(type_name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a ggml type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if type_name == Q4_K_R8:
        return 256, R8_BYTES
    return cast(tuple[int, int], GGML_QUANT_SIZES[GGMLQuantizationType[type_name]])


def type_number(type_name: str) -> int:
    """The number the compiled kernels know a type by: ggml's, or ``cpu_kernels.Q4_K_R8``."""
    from gguf import GGMLQuantizationType

    return cpu_kernels.Q4_K_R8 if type_name == Q4_K_R8 else int(GGMLQuantizationType[type_name])


def q4_k_from_r8(data: torch.Tensor) -> torch.Tensor:
    """The Q4_K rows (uint8 ``[N, K / 256 · 144]``) of Q4_K_R8 rows (``[N, K / 256 · 148]``,
    ``cpu_kernels.ggml_repack``): the exact bytes they were repacked from. An eight-row super-block holds four nibble
    vectors per group of 32 values (byte ``4 i + j`` of vector ``q``: row ``i``'s value ``4 q + j`` low,
    ``16 + 4 q + j`` high), the rows' scales (byte ``8 g + i``), minimums (byte ``16 p + 2 i + e``: group
    ``2 p + e``), ``d`` and ``dmin``."""
    n, nb = data.shape[0], data.shape[1] // R8_BYTES
    sb = data.reshape(n // 8, nb, 8 * R8_BYTES)
    nib = sb[..., :1024].reshape(n // 8, nb, 8, 4, 8, 4)  # [G, b, group, q, row, j]
    u = torch.stack([nib & 15, nib >> 4], dim=3)  # [G, b, group, half, q, row, j]: value 16 half + 4 q + j
    u = u.permute(0, 5, 1, 2, 3, 4, 6).reshape(n, nb, 4, 2, 32)  # [row, b, c, h, v]: group 2 c + h
    qs = u[..., 0, :] | (u[..., 1, :] << 4)  # [row, b, c, 32]: nibble h of byte 32 c + v
    sc = sb[..., 1024:1088].reshape(n // 8, nb, 8, 8).permute(0, 3, 1, 2).reshape(n, nb, 8)
    mn = sb[..., 1088:1152].reshape(n // 8, nb, 4, 8, 2).permute(0, 3, 1, 2, 4).reshape(n, nb, 8)
    packed = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], dim=-1)
    halves = sb[..., 1152:1184].reshape(n // 8, nb, 2, 8, 2).permute(0, 3, 1, 2, 4).reshape(n, nb, 4)
    return torch.cat([halves, packed, qs.reshape(n, nb, 128)], dim=-1).reshape(n, nb * 144)


def stored_rows(type_name: str, data: torch.Tensor, index: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Rows ``index`` of a part (its type and bytes) as the file stores them: Q4_K_R8's rows from their groups of
    eight turned back into Q4_K."""
    if type_name != Q4_K_R8:
        return type_name, data[index]
    groups = torch.unique(index // 8)
    wide = q4_k_from_r8(data.reshape(data.shape[0] // 8, -1)[groups].reshape(-1, data.shape[1]))
    at = torch.searchsorted(groups, index // 8) * 8 + index % 8
    return "Q4_K", wide[at]


def row_bytes(type_name: str, k: int) -> int:
    """The bytes one row of ``k`` values takes in ``type_name``."""
    block, size = block_shape(type_name)
    if k % block:
        raise ValueError(f"{type_name}: a row of {k} values is not a whole number of its {block}-value blocks")
    return k // block * size


def _half(b: torch.Tensor) -> torch.Tensor:
    """Float32 of float16 values stored as byte pairs (``b [..., 2]``)."""
    return b.contiguous().view(torch.float16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks ``[..., 34]``: a float16 scale, 32 int8 values."""
    return blocks[..., 2:].contiguous().view(torch.int8).float() * _half(blocks[..., :2])


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit sub-block scales and mins from their 12 bytes (``[..., 12]``): ``j < 4`` the low 6
    bits of bytes ``j`` and ``4 + j``; ``j >= 4`` byte ``8 + j - 4``'s low (scale) and high (min) nibble, over the
    top 2 bits of bytes ``j - 4`` and ``j``."""
    d, m, both = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([d & 63, (both & 15) | ((d >> 6) << 4)], dim=-1)
    mins = torch.cat([m & 63, (both >> 4) | ((m >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K super-blocks ``[n, 144]``: float16 ``d`` and ``dmin``, 12 bytes of scales and mins, 128 bytes of nibbles
    (value ``f``: nibble ``(f % 64) // 32`` of byte ``32 (f // 64) + f % 32``); ``d sc q - dmin m``."""
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=2).reshape(n, 8, 32).float()
    return (_half(blocks[:, 0:2]) * sc)[..., None] * q - (_half(blocks[:, 2:4]) * mn)[..., None]


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks ``[n, 210]``: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, a float16
    ``d``; ``d scale[f // 16] (q - 32)`` (the layout of ``tests/gguf_files.quantize_q6_k``)."""
    n = blocks.shape[0]
    ql, qh = blocks[:, :128].reshape(n, 2, 1, 64), blocks[:, 128:192].reshape(n, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=2).reshape(n, 2, 128)
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(n, 2, 128)
    q = (low | (high << 4)).reshape(n, 16, 16).float() - 32
    scale = blocks[:, 192:208].contiguous().view(torch.int8).float() * _half(blocks[:, 208:210])
    return scale[..., None] * q


TORCH_BLOCKS = {"Q8_0": (34, _q8_0), "Q4_K": (144, _q4_k), "Q6_K": (210, _q6_k)}  # bytes a block, its dequantiser


def run_scales(type_name: str, data: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each run of ``RUN`` values' scale ``A`` and offset ``B`` (float32 ``[rows, k / RUN]``) of rows stored as
    ``type_name`` (uint8 ``[rows, row_bytes]``): each value is ``A q + B`` for a small integer ``q`` (Q8_0, Q4_0,
    Q5_0: ``d``, 0; Q4_1, Q5_1: ``d``, ``m``; Q4_K, Q5_K: ``d sc``, ``-dmin m``). None for the other types (16-value
    sub-blocks, floats)."""
    rows = data.shape[0]
    if type_name in RUN_BLOCKS:
        blocks = data.reshape(rows, k // RUN, block_shape(type_name)[1])
        a = _half(blocks[..., 0:2]).reshape(rows, k // RUN)
        b = _half(blocks[..., 2:4]).reshape(rows, k // RUN) if type_name in ("Q4_1", "Q5_1") else torch.zeros_like(a)
        return a, b
    if type_name in RUN_SUPERS:
        blocks = data.reshape(rows * (k // 256), block_shape(type_name)[1])
        sc, mn = _k_scales(blocks[:, 4:16])
        a, b = _half(blocks[:, 0:2]) * sc, -(_half(blocks[:, 2:4]) * mn)
        return a.reshape(rows, k // RUN), b.reshape(rows, k // RUN)
    return None


def dequantize_rows(type_name: str, data: torch.Tensor, k: int) -> torch.Tensor:
    """Float32 ``[rows, k]`` of rows stored as ``type_name`` (``data``: uint8 ``[rows, row_bytes]``), on ``data``'s
    device: Q8_0, Q4_K and Q6_K by torch (the same values as the ``gguf`` package's dequantisers, as the tests check,
    in a fraction of numpy's time on these byte operations), the others by the package, through the CPU."""
    rows = data.shape[0]
    if type_name == Q4_K_R8:
        return dequantize_rows("Q4_K", q4_k_from_r8(data), k)
    if type_name in FLOAT_DTYPES:
        return data.contiguous().view(FLOAT_DTYPES[type_name]).float().reshape(rows, k)
    if type_name in TORCH_BLOCKS:
        size, widen = TORCH_BLOCKS[type_name]
        return widen(data.reshape(-1, size)).reshape(rows, k)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(data.cpu().numpy(), GGMLQuantizationType[type_name])
    return torch.from_numpy(values.reshape(rows, k)).to(data.device)


class GgufWeight(QuantizedWeight):
    """A ``[N, K]`` matrix in ggml block types (module docstring): ``parts`` is a list of (type name, uint8
    ``[rows, row_bytes]``), stacked in row order."""

    __slots__ = ("parts", "k", "kernel", "operand")
    scheme = "gguf"

    def __init__(self, parts: Sequence[tuple[str, torch.Tensor]], k: int, dtype: torch.dtype) -> None:
        if not parts:
            raise ValueError("GgufWeight: no parts")
        for type_name, data in parts:
            want = row_bytes(type_name, k)
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != want:
                raise ValueError(f"GgufWeight: {type_name} rows of {k} values take uint8 [rows, {want}], got "
                                 f"{data.dtype} {tuple(data.shape)}")
        device = parts[0][1].device
        self._release_float((sum(d.shape[0] for _, d in parts), k), dtype, device)
        self.parts, self.k = [(t, d) for t, d in parts], k
        self.operand: torch.Tensor | None = None  # row_operand's parts table, made at its first call
        self.bind(default_plan(device))

    @property
    def rounds_to_int8(self) -> bool:  # type: ignore[override]
        return bool(self.kernel)  # the kernels round the rows to int8 (ggml's Q8_0 / Q8_K); the fallback widens

    def bind(self, plan: KernelPlan) -> GgufWeight:
        super().bind(plan)
        self.kernel = self.on_cpu and plan.ggml_failure is None  # else every part widened per product
        return self

    @property
    def types(self) -> list[str]:
        """The ggml type of each part."""
        return [t for t, _ in self.parts]

    @classmethod
    def cat(cls, parts: Sequence[QuantizedWeight]) -> GgufWeight:
        ggml = [cast(GgufWeight, p) for p in parts]
        if not ggml or any(not isinstance(p, GgufWeight) or p.k != ggml[0].k for p in ggml):
            raise ValueError("GgufWeight.cat: GGUF matrices of one K")
        return cls([part for p in ggml for part in p.parts], ggml[0].k, ggml[0].plain.dtype)

    def select_rows(self, index: torch.Tensor) -> GgufWeight:
        """The matrix of the output rows ``index``, each row's bytes as stored."""
        starts, first = [], 0
        for _, data in self.parts:
            starts.append(first)
            first += data.shape[0]
        picked: list[tuple[str, torch.Tensor]] = []
        for row in index.tolist():
            i = max(j for j, s in enumerate(starts) if s <= row)
            picked.append(stored_rows(*self.parts[i], torch.tensor([row - starts[i]])))
        merged: list[tuple[str, torch.Tensor]] = []
        for type_name, data in picked:  # runs of one type become one part
            if merged and merged[-1][0] == type_name:
                merged[-1] = (type_name, torch.cat([merged[-1][1], data]))
            else:
                merged.append((type_name, data.clone()))
        return GgufWeight(merged, self.k, self.plain.dtype)

    @property
    def nbytes(self) -> int:
        return sum(d.numel() for _, d in self.parts)

    @staticmethod
    def bytes_of(type_name: str, rows: int, k: int) -> int:
        """The bytes a ``[rows, k]`` matrix takes in ``type_name``."""
        return rows * row_bytes(type_name, k)

    def row_operand(self) -> torch.Tensor | None:
        """The matrix as the compiled layer and MLP kernels read it (``cpu_tables.Operand``: the parts table of
        ``cpu_kernels.ggml_parts``, made once and kept beside the parts it points into), where every part is in a type
        they read; else None (the matrix runs product by product)."""
        if not self.kernel or len(self.parts) > GGML_MAX_PARTS or any(t not in KERNEL_TYPES for t in self.types):
            return None
        first = 0
        for type_name, data in self.parts:  # a repacked part starts on a group of eight rows
            if type_name == Q4_K_R8 and first % 8:
                return None
            first += data.shape[0]
        if self.operand is None:
            self.operand = cpu_kernels.ggml_parts([d for _, d in self.parts], [type_number(t) for t in self.types],
                                                  self.k)
        return self.operand

    def repack(self) -> bool:
        """Where the compiled kernels read this matrix, each Q4_K part of whole groups of eight rows becomes Q4_K_R8
        (``cpu_kernels.ggml_repack``: the same values, read as one stream at every count of input rows, with the
        stored rows' bits, about twice as fast in cache): True if a part did, and the matrix no longer holds its
        stored bytes. A matrix the kernels do not read keeps its parts."""
        if not self.kernel or not any(repacks(t, d.shape[0]) for t, d in self.parts):
            return False
        self.parts = [(Q4_K_R8, cpu_kernels.ggml_repack(d, self.k)) if repacks(t, d.shape[0]) else (t, d)
                      for t, d in self.parts]
        self.operand = None
        return True

    def _dequantize_rows(self, r0: int, r1: int) -> torch.Tensor:
        out, first = [], 0
        for type_name, data in self.parts:
            a, b = max(r0, first), min(r1, first + data.shape[0])
            if a < b:
                out.append(dequantize_rows(type_name, data[a - first: b - first], self.k))
            first += data.shape[0]
        return out[0] if len(out) == 1 else torch.cat(out)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix this one stands for."""
        return self._dequantize_rows(0, self.shape[0])

    def gather_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Float32 rows ``index`` of the matrix: each part's rows picked from its bytes, then widened together."""
        out = torch.empty(index.numel(), self.k, dtype=torch.float32, device=index.device)
        first = 0
        for type_name, data in self.parts:
            mine = ((index >= first) & (index < first + data.shape[0])).nonzero().flatten()
            if mine.numel():
                out[mine] = dequantize_rows(*stored_rows(type_name, data, index[mine] - first), self.k)
            first += data.shape[0]
        return out

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K]`` (any float dtype) -> ``x · Wᵀ (+ bias)`` in ``x``'s dtype: each part of a type the compiled
        kernels read from its blocks, the others widened a block of rows at a time (module docstring)."""
        if not self.kernel or not x.numel() or not any(t in KERNEL_TYPES for t in self.types):
            return self.widened_product(x, bias)
        rows = x.reshape(-1, self.k)
        outputs, first = [], 0
        for type_name, data in self.parts:
            if type_name in KERNEL_TYPES:
                outputs.append(cpu_kernels.ggml_linear(rows, data, type_number(type_name)))
            else:
                outputs.append(self._part_widened(rows, first, first + data.shape[0]))
            first += data.shape[0]
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.shape[0])

    def _part_widened(self, rows: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        """Float32 ``rows · W[r0:r1]ᵀ``, the weight rows widened ``WIDEN_CHUNK_ELEMENTS`` at a time."""
        step = max(1, WIDEN_CHUNK_ELEMENTS // max(self.k, 1))
        x = rows.float()
        return torch.cat([F.linear(x, self._dequantize_rows(a, min(r1, a + step))) for a in range(r0, r1, step)],
                         dim=-1)


def int4_from_q4_0(data: torch.Tensor, k: int, dtype: torch.dtype) -> Int4Weight:
    """The ``Int4Weight`` of Q4_0 rows (``data``: uint8 ``[N, K / 32 * 18]``, each block a float16 scale and 16 nibble
    bytes) for a weight of ``dtype``: the bytes moved, nothing dequantised (module docstring)."""
    n = data.shape[0]
    if data.dtype != torch.uint8 or data.shape[1] != row_bytes("Q4_0", k):
        raise ValueError(f"int4_from_q4_0: Q4_0 rows of {k} values take uint8 [N, {row_bytes('Q4_0', k)}], got "
                         f"{data.dtype} {tuple(data.shape)}")
    blocks = data.reshape(n, k // 32, 18)
    scales = blocks[..., :2].contiguous().view(torch.float16).reshape(n, k // 32)
    return Int4Weight(blocks[..., 2:].reshape(n, k // 2), scales, k, dtype)
