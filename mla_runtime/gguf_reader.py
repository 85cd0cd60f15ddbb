"""A GGUF model's tensors under the Hugging Face names the loader reads (``gguf_meta.hf_names``), through the same
calls as the safetensors reader (``files``, ``shape``, ``get``), plus the product matrices as stored (``matrix``).

Every tensor is a view of the file's copy-on-write map (``gguf_file``'s ``np.memmap``): ``get`` widens only
the rows it is asked for (a block of rows, or this rank's rows), and ``matrix`` keeps the stored bytes of this rank's
part of a matrix, an expert of a stacked tensor being its run of rows. Q4_0 matrices become ``Int4Weight``\\ s
(``layers.gguf_weight.int4_from_q4_0``), other types ``GgufWeight``\\ s.

Bytes that are copied out of the map (a Q4_0 matrix moved into the int4 format, a tensor widened to float) are then
released from the process (``release_pages``): their pages would otherwise stay resident beside the copy, and a
q4_0 file would take twice its size. A released page is read from the file again if it is touched.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import sys
from pathlib import Path

import numpy as np
import torch

from mla_runtime.gguf_meta import FLOAT_TYPES, GgufModel, Source, check_types, hf_names
from mla_runtime.layers.gguf_weight import (
    RUN,
    GgufWeight,
    block_shape,
    dequantize_rows,
    int4_from_q4_0,
    row_bytes,
    run_scales,
)
from mla_runtime.layers.qweight import QuantizedWeight

logger = logging.getLogger("mla_runtime")
STORED_GGUF = "stored gguf"  # a product matrix kept in the ggml types the file stores it in
STORED_Q4_0 = "stored q4_0"  # ... all of it Q4_0: moved into the int4 format


@functools.cache
def _madvise() -> object | None:
    """libc's ``madvise`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise


def release_pages(view: torch.Tensor) -> None:
    """Let the kernel drop the pages of the map under ``view`` (a view of the file's private, never written map) from
    this process: ``MADV_DONTNEED``, after their bytes were copied out. Elsewhere than on Linux, nothing."""
    advise = _madvise()
    if advise is None or view.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = view.data_ptr() // page * page
    end = view.data_ptr() + _span_bytes(view)
    advise(start, end - start, mmap.MADV_DONTNEED)  # type: ignore[operator]


def _span_bytes(view: torch.Tensor) -> int:
    """The bytes from a view's first element to the end of its last."""
    return (sum((n - 1) * st for n, st in zip(view.shape, view.stride())) + 1) * view.element_size()


RunScales = tuple[torch.Tensor, torch.Tensor]  # a factor's runs' scales and offsets


class GgufTensors:
    """The tensors of one GGUF model by Hugging Face name; unsupported types are refused when it is made."""

    def __init__(self, model: GgufModel, device: torch.device | None = None) -> None:
        self.model = model
        self.sources = hf_names(model)
        check_types(model, self.sources)
        first = model.files[0]
        self.files: dict[str, Path] = dict.fromkeys(self.sources, first)
        self.device = device

    # -- the stored bytes -------------------------------------------------------------------------------------
    def _rows(self, tensor: str, expert: int | None, rows: tuple[int, int] | None) -> torch.Tensor:
        """The stored bytes of ``tensor`` (of one ``expert``'s slice) as uint8 ``[rows, row_bytes]``, or only rows
        ``[a, b)`` of it: a view of the map."""
        t = self.model.tensors[tensor]
        k = t.shape[-1]
        n = math.prod(t.shape[:-1]) if len(t.shape) > 1 else 1
        data = torch.from_numpy(np.asarray(t.data).reshape(n, row_bytes(t.type_name, k)))
        per = n if expert is None else math.prod(t.shape[1:-1]) if len(t.shape) > 2 else 1
        start = 0 if expert is None else expert * per
        a, b = (0, per) if rows is None else rows
        return data[start + a: start + b]

    def _shape(self, source: Source) -> list[int]:
        tensors = [self.model.tensors[n] for n in source.tensors]
        if len(tensors) == 2:  # attn_k_b [H, d_c, d_n] and attn_v_b [H, d_v, d_c] -> kv_b_proj [H (d_n + d_v), d_c]
            k_b, v_b = tensors
            heads, rank, nope = k_b.shape
            return [heads * (nope + v_b.shape[1]), rank]
        shape = list(tensors[0].shape)
        return shape[1:] if source.expert is not None else shape

    def shape(self, name: str) -> list[int]:
        return self._shape(self.sources[name])

    def types(self, name: str) -> set[str]:
        """The ggml types the tensor ``name`` is stored in."""
        return {self.model.tensors[n].type_name for n in self.sources[name].tensors}

    # -- float tensors ---------------------------------------------------------------------------------------------
    def get(self, name: str, shard: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """The tensor widened to float32 (a float one in its own dtype), or only this rank's part of it: a part of the
        rows widens only those rows."""
        source = self.sources[name]
        shape = self._shape(source)
        if len(source.tensors) == 2:
            whole = self._kv_b(source)
        else:
            tensor = source.tensors[0]
            type_name = self.model.tensors[tensor].type_name
            rows = (shard[1], shard[2]) if shard is not None and shard[0] == 0 and len(shape) == 2 else None
            data = self._rows(tensor, source.expert, rows)
            if type_name in FLOAT_TYPES:  # a view of the map
                values = data.contiguous().view(_FLOAT[type_name])
            else:
                values = dequantize_rows(type_name, data, shape[-1])
                release_pages(data)
            if rows is not None:
                return values.reshape(rows[1] - rows[0], *shape[1:])
            whole = values.reshape(shape)
        if shard is None:
            return whole
        dim, a, b, _ = shard
        return whole.narrow(dim, a, b - a).contiguous()

    def _kv_b(self, source: Source) -> torch.Tensor:
        """``kv_b_proj`` rebuilt from llama.cpp's split: each head's ``W_UK`` (stored transposed) over its ``W_UV``."""
        k_name, v_name = source.tensors
        heads, rank, nope = self.model.tensors[k_name].shape
        v_dim = self.model.tensors[v_name].shape[1]
        k_b = dequantize_rows(self.model.tensors[k_name].type_name, self._rows(k_name, None, None), nope)
        v_b = dequantize_rows(self.model.tensors[v_name].type_name, self._rows(v_name, None, None), rank)
        w_uk = k_b.reshape(heads, rank, nope).transpose(1, 2)
        return torch.cat([w_uk, v_b.reshape(heads, v_dim, rank)], dim=1).reshape(heads * (nope + v_dim), rank)

    def absorbed_scales(self, name: str) -> tuple[RunScales, RunScales] | None:
        """The run scales and offsets (``gguf_weight.run_scales``) of ``kv_b_proj`` ``name``'s absorbed factors, laid
        out as ``W_UK [H, d_n, d_c]`` and ``W_UV^T [H, d_c, d_v]`` take them (``[H, d_n / 32, d_c]``, ``[H, d_c / 32,
        d_v]``): where the file splits it into ``attn_k_b`` and ``attn_v_b``, whose blocks run along ``d_n`` and
        ``d_c``, in types with 32-value runs; else None."""
        source = self.sources[name]
        if len(source.tensors) != 2:  # a joined attn_kv_b's blocks run along d_c in both factors
            return None
        k_name, v_name = source.tensors
        heads, rank, nope = self.model.tensors[k_name].shape
        v_dim = self.model.tensors[v_name].shape[1]
        uk = run_scales(self.model.tensors[k_name].type_name, self._rows(k_name, None, None), nope)
        uv = run_scales(self.model.tensors[v_name].type_name, self._rows(v_name, None, None), rank)
        if uk is None or uv is None:
            return None
        def laid(t: torch.Tensor, rows: int, runs: int) -> torch.Tensor:  # [H rows, runs] -> [H, runs, rows]
            return t.reshape(heads, rows, runs).transpose(1, 2).contiguous()

        return ((laid(uk[0], rank, nope // RUN), laid(uk[1], rank, nope // RUN)),
                (laid(uv[0], v_dim, rank // RUN), laid(uv[1], v_dim, rank // RUN)))

    # -- matrices as stored ------------------------------------------------------------------------------------
    def stored_kind(self, names: list[str]) -> str | None:
        """How a product parameter filled by the tensors ``names`` loads: ``STORED_Q4_0`` where all are Q4_0,
        ``STORED_GGUF`` where any is quantised, None (the model's float format) where all are float."""
        types = set().union(*(self.types(n) for n in names))
        if types <= set(FLOAT_TYPES):
            return None
        return STORED_Q4_0 if types == {"Q4_0"} else STORED_GGUF

    def matrix(self, name: str, shard: tuple[int, int, int, int] | None, dtype: torch.dtype,
               device: torch.device, kind: str, repack: bool = False) -> QuantizedWeight:
        """This rank's part of the matrix ``name`` as stored (``kind``: ``STORED_Q4_0`` or ``STORED_GGUF``), for a
        weight of ``dtype``: its rows, or its columns where they start and end on the type's blocks (else those
        columns widened to float32, the one case a product does not keep the file's bytes). ``repack``: the model's
        plan runs the compiled ggml kernels, which read Q4_K faster repacked (``GgufWeight.repack``)."""
        source = self.sources[name]
        if len(source.tensors) != 1:
            raise ValueError(f"{name}: rebuilt from {', '.join(source.tensors)}, it loads widened (get), not as stored")
        tensor = source.tensors[0]
        type_name = self.model.tensors[tensor].type_name
        n, k = self._shape(source)
        rows = (shard[1], shard[2]) if shard is not None and shard[0] == 0 else None
        data = self._rows(tensor, source.expert, rows)
        if shard is not None and shard[0] == 1:
            block, size = block_shape(type_name)
            a, b = shard[1], shard[2]
            if a % block or b % block:  # this rank's columns cut the blocks: they load widened, in float32
                logger.info("%s: this rank's columns [%d, %d) cut %s's blocks of %d: widened to float32", tensor, a,
                            b, type_name, block)
                wide = dequantize_rows(type_name, data, k)[:, a:b].contiguous()
                release_pages(data)
                return GgufWeight([("F32", wide.view(torch.uint8).to(device))], b - a, dtype)
            data, k = data[:, a // block * size: b // block * size], b - a
        if kind == STORED_Q4_0:
            int4 = int4_from_q4_0(data.to(device).contiguous(), k, dtype)
            release_pages(data)
            return int4
        weight = GgufWeight([(type_name, data.to(device))], k, dtype)
        if repack and weight.repack():  # the map's pages under the stored rows are let go
            release_pages(data)
        return weight


_FLOAT = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
