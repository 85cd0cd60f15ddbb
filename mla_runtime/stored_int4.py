"""4-bit checkpoints as their quantisers store them, loaded into ``Int4Weight`` without re-quantising.

Each layout keeps a matrix ``W [N, K]`` as unsigned 4-bit values ``q`` (``0..15``), a scale per group of ``g``
values along ``K`` (32, 64 or 128) and, where asymmetric, a zero point per group: ``W = scale * (q - zero)``.
Their tensors, after ``<base>.`` (the name of the module, ``<base>.weight`` its float weight):

- compressed-tensors ``pack-quantized`` (llm-compressor's W4A16): ``weight_packed`` int32 ``[N, K / 8]``, value ``i``
  of a row at bits ``4i`` of its words (the library's signed values offset by 8: the nibble is ``q``);
  ``weight_scale [N, K / g]``; ``weight_shape`` ``[N, K]``; asymmetric: ``weight_zero_point`` int32
  ``[ceil(N / 8), K / g]``, packed the same way along ``N`` (8 rows a word, offset by 8); with its act-order
  ``group`` option, ``weight_g_idx [K]``.
- AWQ (``quant_method: awq``, GEMM layout): ``qweight`` int32 ``[K, N / 8]``, the 8 values of a word the output
  columns ``AWQ_ORDER`` of its 8 at bits 0, 4, ... 28; ``qzeros`` int32 ``[K / g, N / 8]`` the same way;
  ``scales [K / g, N]`` float16.
- GPTQ (``quant_method: gptq``): ``qweight`` int32 ``[K / 8, N]``, inputs ``8i .. 8i + 7`` in word ``i`` at bits
  ``4j``; ``qzeros`` int32 ``[G, N / 8]``, 8 output columns a word; ``scales [G, N]``; ``g_idx [K]``, the group of
  each input. In GPTQ's original format (``checkpoint_format: gptq``) a stored zero is one less than the zero it
  means (``Int4Layout.zero_offset``; a stored 15 means 16, which ``Int4Weight`` takes); ``gptq_v2`` stores it as is.

A ``g_idx`` that is not ``k // g`` (GPTQ's ``desc_act``, compressed-tensors' act-order ``group``) groups inputs that
lie apart: the loader sorts the columns by group once (a stable sort, so every group is ``g`` contiguous columns) and
the matrix keeps that order of its inputs (``Int4Weight.orders``), which its products apply to ``x`` (exact: the
same products, summed in the kernel's order). Scales are held in float16 (the kernels' scale type: float16 and
bfloat16 scales within float16's range exactly).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch

from mla_kernels.int4_format import unpack_int4
from mla_runtime.config import Int4Layout
from mla_runtime.layers.int4 import Int4Weight, nibbles_from_words

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
AWQ_COLUMNS = tuple(AWQ_ORDER.index(c) for c in range(8))  # column c of a word: its nibble AWQ_COLUMNS[c]
STORED_CHUNK_ROWS = 4096  # a stored matrix is converted this many output rows at a time
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def int4_names(base: str, layout: Int4Layout) -> tuple[str, list[str]]:
    """(the tensor whose presence marks ``<base>.weight`` as stored quantised, every tensor it may be stored as)."""
    if layout.method == "compressed-tensors":
        names = ["weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"]
        return base + "weight_packed", [base + n for n in names]
    names = ["qweight", "qzeros", "scales"] + (["g_idx"] if layout.method == "gptq" else [])
    return base + "qweight", [base + n for n in names]


def int4_shape(reader: Any, base: str, layout: Int4Layout) -> list[int]:
    """``[N, K]`` of the matrix ``<base>.weight`` as stored."""
    if layout.method == "compressed-tensors":
        return [int(v) for v in reader.get(base + "weight_shape").tolist()]
    rows, cols = reader.shape(base + "qweight")
    return [cols * 8, rows] if layout.method == "awq" else [cols, rows * 8]


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 words ``[..., W]`` -> their nibbles ``[..., W * 8]`` uint8, nibble ``j`` of a word (bits ``4j``) at
    ``8w + j``."""
    return ((words.unsqueeze(-1) >> SHIFTS.to(words.device)) & 0xF).to(torch.uint8).flatten(-2)


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ's words ``[R, N / 8]`` -> values ``[R, N]`` in column order."""
    nib = unpack_words(words).view(words.shape[0], -1, 8)
    return nib[:, :, list(AWQ_COLUMNS)].reshape(words.shape[0], -1)


def _trivial(g_idx: torch.Tensor, group: int) -> bool:
    return bool(torch.equal(g_idx.long(), torch.arange(g_idx.numel(), device=g_idx.device) // group))


def input_order(g_idx: torch.Tensor | None, group: int, where: str) -> torch.Tensor | None:
    """The order that makes a ``g_idx``'s groups contiguous (None where they already are): each group must hold
    ``group`` inputs."""
    if g_idx is None or _trivial(g_idx, group):
        return None
    g = g_idx.long()
    counts = torch.bincount(g, minlength=g.numel() // group)
    if g.numel() % group or counts.numel() != g.numel() // group or bool((counts != group).any()):
        raise ValueError(f"{where}: its groups do not each hold {group} inputs, so they cannot be made contiguous")
    return torch.sort(g, stable=True).indices


class _Source:
    """One stored matrix: its values, scales and zeros by blocks of output rows, in ``[rows, ...]`` orientation."""

    def __init__(self, reader: Any, base: str, layout: Int4Layout, n: int, k: int) -> None:
        self.reader, self.base, self.layout, self.n, self.k = reader, base, layout, n, k
        names = reader.files
        self.zeros_all: torch.Tensor | None = None
        self.g_idx = None
        method = layout.method
        if method == "compressed-tensors":
            if base + "weight_zero_point" in names:
                self.zeros_all = unpack_words(reader.get(base + "weight_zero_point").T.contiguous())[:, :n].T
            if base + "weight_g_idx" in names:
                self.g_idx = reader.get(base + "weight_g_idx")
        elif method == "gptq":
            self.g_idx = reader.get(base + "g_idx")
        if not layout.symmetric and self.zeros_all is None and method == "compressed-tensors":
            raise ValueError(f"{base}weight_zero_point: missing from an asymmetric checkpoint")
        self.whole: dict[str, torch.Tensor] = {}  # AWQ's and GPTQ's tensors, read once (their outputs are columns)

    def _columns(self, name: str, a: int, b: int) -> torch.Tensor:
        """Columns ``[a, b)`` of the stored ``<base>.name``, the tensor read once for all the blocks."""
        if name not in self.whole:
            self.whole[name] = self.reader.get(self.base + name)
        return self.whole[name][:, a:b]

    def block(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Output rows ``[a, b)``: (nibbles ``[b - a, K / 2]`` in ``Int4Weight``'s order, or values ``[b - a, K]``
        uint8; scales ``[b - a, K / g]``; zeros ``[b - a, K / g]`` uint8 or None)."""
        r, base, layout = self.reader, self.base, self.layout
        if layout.method == "compressed-tensors":
            words = r.get(base + "weight_packed", (0, a, b, self.n))
            scales = r.get(base + "weight_scale", (0, a, b, self.n))
            zeros = None if self.zeros_all is None else self.zeros_all[a:b].contiguous()
            if self.k % 32 == 0 and sys.byteorder == "little":
                return nibbles_from_words(words, self.k), scales, zeros
            return unpack_words(words)[:, :self.k], scales, zeros
        scales = self._columns("scales", a, b).T.contiguous()
        if layout.method == "awq":
            q = _awq_columns(self._columns("qweight", a // 8, b // 8).contiguous()).T
            zeros = _awq_columns(self._columns("qzeros", a // 8, b // 8).contiguous()).T
            return q.contiguous(), scales, zeros.contiguous()
        q = unpack_words(self._columns("qweight", a, b).T.contiguous())[:, :self.k]
        zeros = unpack_words(self._columns("qzeros", a // 8, b // 8).contiguous()).T
        return q.contiguous(), scales, zeros + layout.zero_offset


def shard_problem(name: str, layout: Int4Layout, shard: tuple[int, int, int, int] | None) -> str | None:
    """Why a rank cannot take ``shard`` (``(dim, start, end, size)`` of the ``[N, K]`` matrix ``name``) of a matrix
    stored in ``layout``, or None: a column slice must be whole groups, a row slice of AWQ's and GPTQ's whole words of
    8 output columns."""
    if shard is None:
        return None
    dim, a, b, size = shard
    if dim == 1 and (a % layout.group or (b % layout.group and b != size)):
        return (f"{name}: this rank's columns [{a}, {b}) of {size} split groups of {layout.group}: choose a "
                f"tensor_parallel_size that divides the inputs into whole groups")
    if dim == 0 and layout.method != "compressed-tensors" and (a % 8 or (b % 8 and b != size)):
        return (f"{name}: this rank's rows [{a}, {b}) of {size} split the 8 output columns of a packed word: choose "
                f"a tensor_parallel_size that divides the outputs into whole words")
    return None


def _check_shard(base: str, layout: Int4Layout, n: int, k: int, rows: tuple[int, int], cols: tuple[int, int],
                 order: torch.Tensor | None) -> None:
    if layout.method != "compressed-tensors" and n % 8:
        raise ValueError(f"{base}qweight: {n} outputs are not whole words of 8")
    for shard in ((0, *rows, n), (1, *cols, k)):
        problem = shard_problem(base + "weight", layout, shard)
        if problem is not None:
            raise ValueError(problem)
    if cols != (0, k) and order is not None:
        raise ValueError(f"{base}weight: its inputs are reordered (act-order g_idx), so a rank cannot take a column "
                         f"slice of it: load it with tensor_parallel_size=1")


def read_int4(reader: Any, name: str, layout: Int4Layout, shard: tuple[int, int, int, int] | None,
              dtype: torch.dtype, device: torch.device) -> Iterator[tuple[int, Int4Weight]]:
    """(first row, rows) of the matrix ``<base>.weight`` as stored in ``layout`` (this rank's part of it: ``shard`` on
    the rows, or on the columns at group boundaries), in blocks of ``STORED_CHUNK_ROWS`` rows."""
    base = name[: -len("weight")]
    n, k = int4_shape(reader, base, layout)
    g = layout.group
    if k % g and g > 32:  # (groups of 32 may end in a partial one, as Int4Weight pads it)
        raise ValueError(f"{base}weight: its {k} inputs are not whole groups of {g}")
    src = _Source(reader, base, layout, n, k)
    order = input_order(src.g_idx, g, f"{base}g_idx")
    rows = (0, n) if shard is None or shard[0] != 0 else (shard[1], shard[2])
    cols = (0, k) if shard is None or shard[0] == 0 else (shard[1], shard[2])
    _check_shard(base, layout, n, k, rows, cols, order)
    step = STORED_CHUNK_ROWS
    for a in range(rows[0], rows[1], step):
        b = min(rows[1], a + step)
        values, scales, zeros = src.block(a, b)
        if zeros is not None and bool((zeros == 8).all()):  # symmetric: the kernels' own form
            zeros = None
        if values.shape[1] * 2 == k and order is None:  # Int4Weight's nibbles already (compressed-tensors)
            lo, hi = cols[0] // 2, cols[1] // 2
            s = scales[:, cols[0] // g: cols[1] // g].to(device, torch.float16)
            z = None if zeros is None else zeros[:, cols[0] // g: cols[1] // g].to(device, torch.uint8)
            yield a - rows[0], Int4Weight(values[:, lo:hi].to(device).contiguous(), s.contiguous(),
                                          cols[1] - cols[0], dtype, group=g, zeros=z)
            continue
        if values.shape[1] * 2 == k:
            values = (unpack_int4(values).to(torch.int16) + 8).to(torch.uint8)
        if order is not None:
            values = values[:, order]
        values = values[:, cols[0]:cols[1]]
        z = None if zeros is None else zeros[:, cols[0] // g: -(-cols[1] // g)]
        yield a - rows[0], Int4Weight.from_unsigned(values.to(device), scales[:, cols[0] // g: -(-cols[1] // g)]
                                                    .to(device), None if z is None else z.to(device), g, dtype,
                                                    None if order is None else order.to(device))

