"""Matrices kept in the ggml block types a GGUF file stores them in (``GgufWeight``), and Q4_0 moved into the int4
format (``int4_from_q4_0``).

A ggml type cuts each row of ``K`` values into blocks of ``block`` values stored in ``type_size`` bytes
(``gguf.GGML_QUANT_SIZES``): Q8_0 32 values in 34 bytes (a float16 scale, 32 int8), Q4_0 32 in 18, the K-quants 256
values in super-blocks with their own scales (Q2_K 84 bytes ... Q6_K 210). A ``GgufWeight`` holds a matrix's rows as
those bytes, ``[rows, K / block * type_size]`` uint8 per part, and a matrix stacked from tensors of different types
(``gate_proj`` Q4_K beside ``up_proj`` Q6_K) keeps one part per type: the type is data, not a class.

Products widen the weight to float32 a block of output rows at a time (``QuantizedWeight.widened_product``: about
``WIDEN_CHUNK_ELEMENTS`` values, never the whole matrix) and multiply in float32. Q8_0 and the float types are
widened by torch on the weight's device; the other types by the ``gguf`` package's dequantisers (numpy, on the CPU).

Q4_0 is the runtime's int4 number format exactly (``layers.int4``: groups of 32 along ``K``, one float16 scale,
``q[j] + 8`` in the low nibble of byte ``j`` and ``q[j + 16] + 8`` in its high nibble), so a Q4_0 matrix becomes an
``Int4Weight`` by moving bytes: each block's two scale bytes go to the scales, its 16 nibble bytes to the packed
matrix, nothing dequantised, and its products take the int4 kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from mla_runtime.layers.int4 import Int4Weight
from mla_runtime.layers.qweight import QuantizedWeight, default_plan

FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def block_shape(type_name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a ggml type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return cast(tuple[int, int], GGML_QUANT_SIZES[GGMLQuantizationType[type_name]])


def row_bytes(type_name: str, k: int) -> int:
    """The bytes one row of ``k`` values takes in ``type_name``."""
    block, size = block_shape(type_name)
    if k % block:
        raise ValueError(f"{type_name}: a row of {k} values is not a whole number of its {block}-value blocks")
    return k // block * size


def dequantize_rows(type_name: str, data: torch.Tensor, k: int) -> torch.Tensor:
    """Float32 ``[rows, k]`` of rows stored as ``type_name`` (``data``: uint8 ``[rows, row_bytes]``), on ``data``'s
    device: torch for the float types and Q8_0, the ``gguf`` package's dequantiser for the others."""
    rows = data.shape[0]
    if type_name in FLOAT_DTYPES:
        return data.contiguous().view(FLOAT_DTYPES[type_name]).float().reshape(rows, k)
    if type_name == "Q8_0":
        blocks = data.reshape(rows, k // 32, 34)
        scale = blocks[..., :2].contiguous().view(torch.float16).float()
        return (blocks[..., 2:].contiguous().view(torch.int8).float() * scale).reshape(rows, k)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(data.cpu().numpy(), GGMLQuantizationType[type_name])
    return torch.from_numpy(values.reshape(rows, k)).to(data.device)


class GgufWeight(QuantizedWeight):
    """A ``[N, K]`` matrix in ggml block types (module docstring): ``parts`` is a list of (type name, uint8
    ``[rows, row_bytes]``), stacked in row order."""

    __slots__ = ("parts", "k")
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
        self.bind(default_plan(device))

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
            type_name, data = self.parts[i]
            picked.append((type_name, data[row - starts[i]: row - starts[i] + 1]))
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

    def row_operand(self) -> None:
        return None  # the compiled layer and MLP kernels read float32, int8 or int4 matrices

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

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K]`` (any float dtype) -> ``x · Wᵀ (+ bias)`` in ``x``'s dtype, the weight widened a block of
        rows at a time."""
        return self.widened_product(x, bias)


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
