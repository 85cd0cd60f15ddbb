"""One GGUF file's header read straight from its bytes: the metadata (``GgufHeader.values``) and each tensor's
name, ggml type, shape and bytes (a view of the file's copy-on-write map). Nothing here reads a weight.

The layout (GGUF versions 2 and 3, little-endian): the magic ``GGUF``, a uint32 version, uint64 counts of tensors and
of metadata pairs; each pair a string key, a uint32 value type and the value (strings are a uint64 length and UTF-8
bytes; an array is an element type, a uint64 count and the elements); each tensor a string name, a uint32 rank, that
many uint64 dimensions (innermost first), a uint32 ggml type and a uint64 offset into the data, which starts at the
first multiple of ``general.alignment`` (default 32) after the header.

The ``gguf`` package's reader builds a numpy view for every part of every field, which for a DeepSeek vocabulary
(about 100,000 token strings and as many merges) takes seconds; this reads an array of numbers with one
``np.frombuffer`` and a string array with one pass over the header's bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF's value types: the scalar ones by number, as numpy dtypes; 8 is a string, 9 an array
SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
           7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


class GgufFormatError(ValueError):
    """A file that is not a GGUF file this reader understands."""


@dataclass(frozen=True)
class HeaderTensor:
    """A tensor of the file: its ggml type number, its dimensions innermost first (GGUF's order), its bytes."""

    name: str
    type_id: int
    dims: tuple[int, ...]
    data: np.ndarray  # uint8, a view of the file's map


class _Cursor:
    """Reads the header's fields in order from the file's bytes."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        if self.at + n > len(self.buf):
            raise GgufFormatError(f"a string of {n} bytes runs past the end of the file")
        text = bytes(self.buf[self.at: self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            return self.array()
        if kind not in SCALARS:
            raise GgufFormatError(f"unknown metadata value type {kind}")
        dtype = np.dtype(SCALARS[kind]).newbyteorder("<")
        value = np.frombuffer(self.buf, dtype, 1, self.at)[0]
        self.at += dtype.itemsize
        return value.item()

    def array(self) -> list[Any]:
        kind, n = self.scalar("I"), self.scalar("Q")
        if kind == STRING:
            return [self.string() for _ in range(n)]
        if kind == ARRAY:
            return [self.array() for _ in range(n)]
        if kind not in SCALARS:
            raise GgufFormatError(f"unknown array element type {kind}")
        dtype = np.dtype(SCALARS[kind]).newbyteorder("<")
        if self.at + n * dtype.itemsize > len(self.buf):
            raise GgufFormatError(f"an array of {n} values runs past the end of the file")
        values = np.frombuffer(self.buf, dtype, n, self.at)
        self.at += n * dtype.itemsize
        return values.tolist()


class GgufHeader:
    """The metadata and tensors of one GGUF file (module docstring), its bytes mapped copy-on-write."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.map = np.memmap(path, dtype=np.uint8, mode="c")
        cursor = _Cursor(memoryview(self.map.data))
        try:
            self._read(cursor)
        except struct.error as e:
            raise GgufFormatError(f"the header ends early ({e})") from e

    def _read(self, cursor: _Cursor) -> None:
        if bytes(cursor.buf[:4]) != MAGIC:
            raise GgufFormatError("it does not start with the bytes 'GGUF'")
        cursor.at = 4
        version = cursor.scalar("I")
        if version & 0xFFFF == 0:
            raise GgufFormatError("its byte order is not this machine's (a big-endian GGUF); convert it")
        if version not in (2, 3):
            raise GgufFormatError(f"GGUF version {version} (versions 2 and 3 are read)")
        n_tensors, n_values = cursor.scalar("Q"), cursor.scalar("Q")
        self.values: dict[str, Any] = {}
        for _ in range(n_values):
            key = cursor.string()
            self.values[key] = cursor.value(cursor.scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name, rank = cursor.string(), cursor.scalar("I")
            dims = tuple(cursor.scalar("Q") for _ in range(rank))
            infos.append((name, dims, cursor.scalar("I"), cursor.scalar("Q")))
        align = int(self.values.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cursor.at // align) * align
        self.tensors = [HeaderTensor(name, kind, dims, self._bytes(name, kind, dims, start + offset))
                        for name, dims, kind, offset in infos]

    def _bytes(self, name: str, kind: int, dims: tuple[int, ...], at: int) -> np.ndarray:
        """The tensor's bytes in the map (an unknown type: none; the caller refuses it by name)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            return self.map[at:at]
        values = int(np.prod(dims, dtype=np.int64)) if dims else 1
        n = values // block * size
        if at + n > self.map.shape[0]:
            raise GgufFormatError(f"tensor {name}'s {n} bytes at {at} run past the end of the file")
        return self.map[at: at + n]


def type_name(type_id: int) -> str:
    """The ggml type's name (``Q4_K``), or ``type <n>`` for a number the ``gguf`` package does not know."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"
