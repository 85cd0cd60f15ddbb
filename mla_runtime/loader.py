"""Load a Hugging Face MLA checkpoint (``config.json`` + safetensors), or a GGUF file, into ``DeepseekForCausalLM``.

- Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) checkpoints.
- Streamed: tensors are read one at a time into their final form (cast, quantised, sliced for this rank), so peak
  RAM stays near the model's own size; matrices that run as stored (pre-quantised int8, FP8 blocks) are views of
  the mapped file on a CPU (``_Reader.stored``).
- One name table (``checkpoint_layout``) maps every checkpoint tensor to a parameter slot; per-expert
  tensors are stacked, ``gate_proj``/``up_proj`` are fused. The family's adapter (``families.Family.rename``) first
  gives each stored tensor its name in that table, or drops it (a vision tower's tensors: ``renamed_files``).
- DeepSeek-V3 FP8 block-quantised weights (``*.weight`` in float8_e4m3fn with ``*.weight_scale_inv``,
  one fp32 scale per 128×128 block) are dequantised on load.
- DeepSeek-V3's multi-token-prediction layers (``model.layers.{num_hidden_layers + j}.*``: ``enorm``, ``hnorm``,
  ``eh_proj``, a decoder block, ``shared_head.norm``) load into ``model.mtp[j]`` when ``num_mtp_layers`` asks
  for them (sharded like any layer, FP8 blocks dequantised), and are skipped otherwise. Their copies of the
  embedding and head (``embed_tokens``, ``shared_head.head``) are skipped: the main model's are used, as
  DeepSeek-V3 shares them.
- LongCat-Flash's layers hold two attention blocks, two dense MLPs (``self_attn.{b}``, ``mlps.{b}``) and a MoE whose
  zero experts have no weights (gate/up tensors stored for them are skipped); its MLA scales are folded into
  ``q_a_layernorm`` and ``kv_a_layernorm`` once loaded (``_fold_lora_scales``).
- Mistral Large 4 is stored in Mistral's own names (``layers.{i}.attention.wq``, ``lerope.alpha``, ...), which its
  adapter renames; its per-head query scalings (``softmax_scaling``) load each rank's heads, its indexer's and its
  LeRoPE ``alpha`` whole.
- A.X-K2's fused query and gate projection is stored as ``q_b_proj`` and loads into ``q_gate_proj`` (each rank its
  heads' rows); its gated norms' gates (``W_down``, ``W_up``) load into ``gate_down``/``gate_up``.
- A GGUF model (llama.cpp's format: ``gguf_meta.gguf_files``) is read through ``gguf_reader.GgufTensors`` under the
  same names: its float tensors as any checkpoint's, the products it stores quantised kept in its block types
  (``STORED_GGUF``; ``STORED_Q4_0``: moved into the int4 format), the unsupported types refused before any weight is
  read.
- Every missing, unexpected or mis-shaped tensor is reported by name in one ``CheckpointError``.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import mmap
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn

from mla_runtime import attention
from mla_runtime.compressed import CT_INT4, is_stored_compressed, read_stored, stored_names, stored_shape
from mla_runtime.config import ModelConfig
from mla_runtime.dtypes import resolve_model_dtype
from mla_runtime.errors import InvalidParam
from mla_runtime.families import FAMILIES
from mla_runtime.gguf_meta import gguf_files, open_gguf
from mla_runtime.gguf_reader import STORED_GGUF, STORED_Q4_0, GgufTensors
from mla_runtime.kernel_plan import OFF_CPU, kernel_plan, resolve_cpu_format
from mla_runtime.layers.factor_runs import FactorRuns
from mla_runtime.layers.fp8 import Fp8Weight
from mla_runtime.layers.quantization import (
    WEIGHT_FORMATS,
    QuantizedMatrices,
    check_quantization,
    install_quantized,
    quantized_parameter_names,
)
from mla_runtime.layers.qweight import QuantizedWeight
from mla_runtime.layers.rotary import RotaryEmbedding
from mla_runtime.layers.w8a8 import W8A8Weight
from mla_runtime.models.deepseek import DeepseekForCausalLM
from mla_runtime.models.hybrid import causal_lm
from mla_runtime.parallel import SINGLE_RANK, ParallelContext
from mla_runtime.resolved_config import ResolvedConfig
from mla_runtime.stored_int4 import shard_problem

logger = logging.getLogger("mla_runtime")
STORED_FP8 = "stored fp8"  # a product matrix kept in the FP8 blocks the checkpoint stores

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")
# a ModelOpt export's activation and KV cache scales: the products take unquantised rows, the cache is the runtime's
MODELOPT_UNUSED = (".input_scale", ".k_scale", ".v_scale")
_FUSED_EXPERTS_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj$")
_POST_MLP_NORM_RE = re.compile(r"^model\.layers\.(\d+)\.post_mlp_layernorm\.weight$")
_EXPERT_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: lists every offending tensor."""


@dataclass(frozen=True)
class Slot:
    """Where a checkpoint tensor goes: a parameter, an index into it (``()`` = the whole tensor) and,
    under tensor parallelism, the part of the checkpoint tensor this rank takes:
    ``shard = (dim, start, stop, full)`` with ``full`` the tensor's whole size along ``dim``."""

    param: str
    index: tuple[int | slice, ...] = ()
    shard: tuple[int, int, int, int] | None = None


class _Layout:
    """Builds the name table of one rank (``checkpoint_layout``), one part of the model at a time."""

    def __init__(self, cfg: ModelConfig, par: ParallelContext) -> None:
        self.cfg, self.par, self.n = cfg, par, par.world_size
        self.table: dict[str, Slot | None] = {}

    def part(self, dim: int, full: int) -> tuple[int, int, int, int] | None:
        """This rank's equal share of ``full`` along ``dim`` (None on one rank)."""
        if self.n == 1:
            return None
        size = full // self.n
        return dim, self.par.rank * size, (self.par.rank + 1) * size, full

    def whole(self, name: str) -> None:
        self.table[name] = Slot(name)

    def embeddings(self) -> None:
        v0, v1, _ = self.par.vocab_split(self.cfg.vocab_size)
        vocab = (slice(0, v1 - v0),) if self.n > 1 else ()
        vocab_shard = (0, v0, v1, self.cfg.vocab_size) if self.n > 1 else None
        self.table["model.embed_tokens.weight"] = Slot("model.embed_tokens.weight", vocab, vocab_shard)
        self.whole("model.norm.weight")
        if self.cfg.rope.learned_frequency_scale:  # Mistral Large 4's LeRoPE: replicated
            self.whole("model.rotary_emb.alpha")
        if not self.cfg.tie_word_embeddings:
            self.table["lm_head.weight"] = Slot("lm_head", vocab, vocab_shard)

    def attention(self, p: str) -> None:
        cfg, h = self.cfg, self.cfg.num_attention_heads
        layer = int(p.rsplit(".", 1)[1])
        shards = {"q_proj": self.part(0, h * cfg.qk_head_dim), "q_b_proj": self.part(0, h * cfg.qk_head_dim),
                  "kv_b_proj": self.part(0, h * (cfg.layer_nope_dim(layer) + cfg.v_head_dim)),  # NoPE: d_n + d_r
                  "o_proj": self.part(1, h * cfg.v_head_dim)}
        projections = (["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_b_proj"]) + \
            ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
        for name in projections:
            self.table[f"{p}.self_attn.{name}.weight"] = Slot(f"{p}.self_attn.{name}.weight", (), shards.get(name))
            if cfg.attention_bias and name in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"):
                self.whole(f"{p}.self_attn.{name}.bias")
        for name in ["kv_a_layernorm"] + ([] if cfg.q_lora_rank is None else ["q_a_layernorm"]):
            self.whole(f"{p}.self_attn.{name}.weight")
        if cfg.query_gate:  # A.X-K2: its q_b_proj is q_gate_proj, each head's query rows then its gate rows
            self.table[f"{p}.self_attn.q_b_proj.weight"] = Slot(
                f"{p}.self_attn.q_gate_proj.weight", (), self.part(0, h * (cfg.qk_head_dim + cfg.v_head_dim)))
        if cfg.attention_head_gate:  # Ling: one gate row per head, each rank its heads'
            self.table[f"{p}.self_attn.g_proj.weight"] = Slot(f"{p}.self_attn.g_proj.weight", (), self.part(0, h))
        if cfg.query_log_scaling:  # Mistral Large 4: per head, each rank its heads'
            for name in ("scale", "bias"):
                self.table[f"{p}.self_attn.softmax_scaling.{name}"] = Slot(f"{p}.self_attn.softmax_scaling.{name}",
                                                                           (), self.part(0, h))
        idx = cfg.indexer
        if idx is not None and not idx.is_shared(layer):  # replicated on every rank
            names = ["wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"]
            names += ["q_input_norm.weight", "q_input_norm.bias"] if idx.query_source == "hidden" else []
            names += ["softmax_scaling.scale", "softmax_scaling.bias"] if idx.query_log_scaling else []
            for name in names:
                self.whole(f"{p}.self_attn.indexer.{name}")

    def linear_attention(self, p: str) -> None:
        """A hybrid's linear-attention layer (``layers.kda``), replicated (hybrids run on one rank)."""
        lin = self.cfg.linear_attention
        assert lin is not None
        width = lin.num_heads * lin.head_dim
        gates = ["g_a_proj", "g_b_proj", "forget_gate.f_a_proj", "forget_gate.f_b_proj"] if lin.low_rank_gates \
            else ["g_proj", "forget_gate.f_proj"]
        names = ["q_proj", "k_proj", "v_proj", "b_proj", "o_proj", "o_norm", *gates]
        for name in names:
            self.whole(f"{p}.self_attn.{name}.weight")
        for name in ("dt_bias", "A_log"):
            self.whole(f"{p}.self_attn.forget_gate.{name}")
        for j, part in enumerate("qkv"):  # the queries', keys' and values' taps, stacked in that order
            self.table[f"{p}.self_attn.{part}_conv1d.weight"] = Slot(f"{p}.self_attn.conv1d.weight",
                                                                      (slice(j * width, (j + 1) * width),))

    def norm(self, prefix: str, gated: bool) -> None:
        """A decoder norm, replicated: an RMSNorm, or A.X-K2's gated one (``layers.norm.GatedRMSNorm``: its norm and
        the gate's ``W_down``/``W_up``)."""
        if not gated:
            self.whole(f"{prefix}.weight")
            return
        self.whole(f"{prefix}.norm.weight")
        self.table[f"{prefix}.W_down.weight"] = Slot(f"{prefix}.gate_down.weight")
        self.table[f"{prefix}.W_up.weight"] = Slot(f"{prefix}.gate_up.weight")

    def mlp(self, prefix: str, size: int) -> None:
        """A gated MLP: gate and up stacked into ``gate_up_proj``, the intermediate dimension sharded."""
        local, shard = size // self.n, self.part(0, size)
        kinds = ["weight"] + (["bias"] if self.cfg.mlp_bias else [])
        for kind in kinds:
            stacked = f"{prefix}.gate_up_{'proj' if kind == 'weight' else 'bias'}"
            self.table[f"{prefix}.gate_proj.{kind}"] = Slot(stacked, (slice(0, local),), shard)
            self.table[f"{prefix}.up_proj.{kind}"] = Slot(stacked, (slice(local, 2 * local),), shard)
        self.table[f"{prefix}.down_proj.weight"] = Slot(f"{prefix}.down_proj", (), self.part(1, size))
        if self.cfg.mlp_bias:
            self.table[f"{prefix}.down_proj.bias"] = Slot(f"{prefix}.down_bias")

    def moe(self, p: str, fused: bool) -> None:
        """Router, shared experts and this rank's whole routed experts (stacked ``[E, ...]``)."""
        moe = self.cfg.moe
        assert moe is not None
        size, experts = moe.moe_intermediate_size, f"{p}.mlp.experts"
        self.whole(f"{p}.mlp.gate.weight")
        if moe.topk_method == "noaux_tc" and moe.correction_bias != "none":
            self.whole(f"{p}.mlp.gate.e_score_correction_bias")
        if self.cfg.moe_output_norm:  # stored beside the layer's norms, a part of its MoE here
            self.table[f"{p}.post_mlp_layernorm.weight"] = Slot(f"{p}.mlp.post_mlp_layernorm.weight")
        if moe.n_shared_experts:
            self.mlp(f"{p}.mlp.shared_experts", size * moe.n_shared_experts)
        if fused:  # transformers' in-memory layout: [E, 2I, d] and [E, d, I]
            for name in ("gate_up_proj", "down_proj"):
                self.table[f"{experts}.{name}"] = Slot(f"{experts}.{name}", (), self.part(0, moe.n_routed_experts))
            if moe.zero_experts:  # LongCat: gate_up_proj has rows for the zero experts too, which are not read
                e0, e1 = self.par.split(moe.n_routed_experts)
                self.table[f"{experts}.gate_up_proj"] = Slot(f"{experts}.gate_up_proj", (),
                                                             (0, e0, e1, moe.router_experts))
            return
        e0, e1 = self.par.split(moe.n_routed_experts)
        for e in range(moe.n_routed_experts):
            names = [f"{experts}.{e}.{w}_proj.weight" for w in ("gate", "up", "down")]
            if not e0 <= e < e1:
                self.table.update(dict.fromkeys(names))  # another rank's expert
                continue
            self.table[names[0]] = Slot(f"{experts}.gate_up_proj", (e - e0, slice(0, size)))
            self.table[names[1]] = Slot(f"{experts}.gate_up_proj", (e - e0, slice(size, 2 * size)))
            self.table[names[2]] = Slot(f"{experts}.down_proj", (e - e0,))


def _decoder_layer(layout: _Layout, cfg: ModelConfig, i: int, fused_expert_layers: AbstractSet[int]) -> None:
    p = f"model.layers.{i}"
    if cfg.attention_blocks_per_layer > 1:
        _longcat_layer(layout, cfg, p, i in fused_expert_layers)
        return
    layout.norm(f"{p}.input_layernorm", cfg.gated_norm_rank > 0)
    layout.norm(f"{p}.post_attention_layernorm", cfg.gated_norm_rank > 0 and cfg.is_moe_layer(i))
    if cfg.is_linear_layer(i):
        layout.linear_attention(p)
    else:
        layout.attention(p)
    if cfg.is_moe_layer(i):
        layout.moe(p, i in fused_expert_layers)
    else:
        layout.mlp(f"{p}.mlp", cfg.intermediate_size)


def _longcat_layer(layout: _Layout, cfg: ModelConfig, p: str, fused: bool) -> None:
    """A LongCat layer (``models.deepseek.LongcatDecoderLayer``): per block ``b`` its norms
    (``input_layernorm.{b}``, ``post_attention_layernorm.{b}``), attention (``self_attn.{b}``) and dense MLP
    (``mlps.{b}``); then the layer's MoE."""
    for b in range(cfg.attention_blocks_per_layer):
        layout.whole(f"{p}.input_layernorm.{b}.weight")
        layout.whole(f"{p}.post_attention_layernorm.{b}.weight")
        block = _Layout(cfg, layout.par)
        block.attention(p)
        old, new = f"{p}.self_attn.", f"{p}.self_attn.{b}."
        for name, slot in block.table.items():
            assert slot is not None
            layout.table[name.replace(old, new, 1)] = Slot(slot.param.replace(old, new, 1), slot.index, slot.shard)
        layout.mlp(f"{p}.mlps.{b}", cfg.intermediate_size)
    layout.moe(p, fused)


def mtp_layer_names(cfg: ModelConfig, j: int) -> list[str]:
    """The parts of MTP layer ``j`` that only MTP layers have (checkpoint names)."""
    p = f"model.layers.{cfg.num_hidden_layers + j}"
    return [f"{p}.{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm")]


def checkpoint_layout(cfg: ModelConfig, par: ParallelContext = SINGLE_RANK,
                      fused_expert_layers: AbstractSet[int] = frozenset(),
                      num_mtp_layers: int = 0) -> dict[str, Slot | None]:
    """The name table: every tensor the checkpoint must hold → its parameter slot on this rank
    (None: the tensor belongs to another tensor-parallel rank). MTP layer ``j`` (checkpoint
    ``model.layers.{num_hidden_layers + j}``) goes to the parameters ``mtp.{j}``."""
    layout = _Layout(cfg, par)
    layout.embeddings()
    for i in range(cfg.num_hidden_layers):
        _decoder_layer(layout, cfg, i, fused_expert_layers)
    for j in range(num_mtp_layers):
        mtp = _Layout(cfg, par)
        _decoder_layer(mtp, cfg, cfg.num_hidden_layers + j, fused_expert_layers)
        for name in mtp_layer_names(cfg, j):
            mtp.whole(name)
        ckpt, own = f"model.layers.{cfg.num_hidden_layers + j}.", f"mtp.{j}."
        for name, slot in mtp.table.items():
            layout.table[name] = None if slot is None else Slot(own + slot.param[len(ckpt):], slot.index, slot.shard)
    return layout.table


def renamed_files(files: dict[str, Path], rename: Callable[[str], str | None]
                  ) -> tuple[dict[str, Path], dict[str, str]]:
    """The checkpoint's tensors under the model's names (``Family.rename``; a tensor it maps to None, such as a vision
    tower's, is left out), and the stored name of each renamed one."""
    named: dict[str, Path] = {}
    stored: dict[str, str] = {}
    for name, f in files.items():
        new = rename(name)
        if new is None:
            continue
        if new in named:
            raise CheckpointError(f"checkpoint tensors {stored.get(new, new)!r} and {name!r} both map to {new!r}")
        named[new] = f
        if new != name:
            stored[new] = name
    return named, stored


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name → file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files and no model.safetensors.index.json")
    names: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                names[name] = f
    return names


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight [out, in]`` (float8) times its per-block scale ``[ceil(out/b0), ceil(in/b1)]`` → fp32."""
    out_f, in_f = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:out_f].repeat_interleave(block[1], 1)[:, :in_f]
    return weight.float() * scale


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class _Reader:
    """Read one tensor (or one rank's rows of it) at a time from safetensors files, with ``pread`` into memory that
    becomes the tensor, so a load's resident memory is the tensors it holds, not the pages of the files it has read
    (a shard of a real checkpoint is a gigabyte or more). The one exception is ``stored``: a matrix the runtime runs
    exactly as the file stores it (pre-quantised int8, FP8 blocks) is served from a private mapping of the file, the
    way llama.cpp serves a GGUF: loading it costs no copy, its pages are the page cache's until written, and they can
    be dropped and read again under memory pressure. The format is an 8-byte header length, a JSON header of
    ``name -> {dtype, shape, data_offsets}``, then the data."""

    def __init__(self, files: dict[str, Path], device: torch.device | None = None,
                 file_names: Mapping[str, str] | None = None) -> None:
        self.files = files
        self.file_names = file_names or {}  # a renamed tensor's name in its file (``renamed_files``)
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}
        self._maps: dict[Path, torch.Tensor] = {}
        # ``stored`` maps where the tensors stay on the CPU and the file's (little-endian) bytes are the machine's
        self.maps = (device is None or device.type == "cpu") and sys.byteorder == "little"

    def _entry(self, name: str) -> tuple[Path, int, dict[str, Any]]:
        f = self.files[name]
        if f not in self._headers:
            with open(f, "rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                self._headers[f] = 8 + size, json.loads(handle.read(size))
        start, header = self._headers[f]
        return f, start, header[self.file_names.get(name, name)]

    def _read(self, f: Path, offset: int, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(cast(Any, buf.numpy()))
        with open(f, "rb", buffering=0) as handle:
            done = 0
            while done < nbytes:
                n = os.preadv(handle.fileno(), [view[done:]], offset + done)
                if n <= 0:
                    raise CheckpointError(f"{f}: file ends inside a tensor (truncated?)")
                done += n
        return buf

    def _span(self, name: str, rows: tuple[int, int] | None = None
              ) -> tuple[Path, int, int, torch.dtype, list[int]]:
        """Where tensor ``name`` lies (or its rows ``[a, b)``): its file, byte offset and byte count, dtype and
        shape."""
        f, start, entry = self._entry(name)
        dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], list(entry["shape"])
        first, last = entry["data_offsets"]
        if rows is None:
            return f, start + first, last - first, dtype, shape
        a, b = rows
        row = (last - first) // shape[0] if shape[0] else 0
        return f, start + first + a * row, (b - a) * row, dtype, [b - a, *shape[1:]]

    def get(self, name: str, shard: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """The tensor, or only this rank's part of it (a part of the rows is read alone; a part along another
        dimension is cut from the whole tensor)."""
        rows = (shard[1], shard[2]) if shard is not None and shard[0] == 0 else None
        f, offset, nbytes, dtype, shape = self._span(name, rows)
        tensor = self._read(f, offset, nbytes).view(dtype).reshape(shape)
        if shard is None or rows is not None:
            return tensor
        dim, a, b, _ = shard
        return tensor.narrow(dim, a, b - a).contiguous()

    def stored(self, name: str, shard: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """``get``, but where the tensor (or this rank's rows of it) is used as stored and loads to the CPU: a view of
        the mapped file (``torch.cat`` of views lying back to back in it is free: ``qweight.stack_rows``)."""
        if not self.maps or (shard is not None and shard[0] != 0):
            return self.get(name, shard)
        f, offset, nbytes, dtype, shape = self._span(name, None if shard is None else (shard[1], shard[2]))
        if nbytes == 0 or offset % dtype.itemsize:  # a view of another dtype must start on its alignment
            return self.get(name, shard)
        if f not in self._maps:
            with open(f, "rb") as handle:  # copy-on-write: nothing the runtime does can change the file
                self._maps[f] = torch.frombuffer(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY),
                                                 dtype=torch.uint8)
        return self._maps[f][offset: offset + nbytes].view(dtype).reshape(shape)

    def shape(self, name: str) -> list[int]:
        return list(self._entry(name)[2]["shape"])

    def dtype(self, name: str) -> str:
        return str(self._entry(name)[2]["dtype"])


def _release_free_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc: ``malloc_trim``). A load frees a float temporary
    for every tensor it quantises between the quantised tensors it keeps; without this, the holes stay resident."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None


def _mtp_or_ignored(name: str, cfg: ModelConfig) -> bool:
    if _IGNORED_RE.search(name):
        return True
    norm = _POST_MLP_NORM_RE.match(name) if cfg.moe_output_norm else None
    if norm is not None and not cfg.is_moe_layer(int(norm.group(1))):
        return True  # A.X-K1 stores the MoE output norm for its dense layers too, which do not use it
    zero = _EXPERT_RE.match(name) if cfg.moe is not None and cfg.moe.zero_experts else None
    if zero is not None and int(zero.group(1)) >= cast(Any, cfg.moe).n_routed_experts:
        return True  # LongCat's zero experts: transformers stores gate/up rows for them, which no token reads
    m = _LAYER_RE.match(name)
    return m is not None and int(m.group(1)) >= cfg.num_hidden_layers


def check_mtp_weights(cfg: ModelConfig, files: AbstractSet[str] | dict[str, Path], path: Path) -> None:
    """MTP drafting needs the checkpoint's MTP layer: a clear error naming ``speculative_method`` without it."""
    if cfg.num_nextn_predict_layers < 1 or not all(n in files for n in mtp_layer_names(cfg, 0)):
        raise InvalidParam("speculative_method", f"speculative_method 'mtp' needs a checkpoint with a "
                           f"multi-token-prediction layer (num_nextn_predict_layers >= 1 and the tensors "
                           f"model.layers.{cfg.num_hidden_layers}.eh_proj/enorm/hnorm/...); {path} has none: "
                           f"use speculative_method 'prompt_lookup'")


def _scale_shard(shard: tuple[int, int, int, int] | None, block: tuple[int, int]
                 ) -> tuple[int, int, int, int] | None:
    """The part of a ``weight_scale_inv`` that covers the part ``shard`` of its weight (block-aligned)."""
    if shard is None:
        return None
    dim, start, stop, full = shard
    b = block[dim]
    return dim, start // b, -(-stop // b), -(-full // b)


def _block_aligned(shard: tuple[int, int, int, int] | None, rows: int | None, block: tuple[int, int]) -> bool:
    """Whether an FP8 tensor's part ``shard`` (and, stacked with others, its ``rows``) starts and ends on block
    boundaries, so that it keeps its own block scales."""
    if rows is not None and rows % block[0]:
        return False
    if shard is None:
        return True
    dim, start, stop, full = shard
    return start % block[dim] == 0 and (stop % block[dim] == 0 or stop == full)


def _piece_position(param: torch.Tensor, index: tuple[int | slice, ...]) -> tuple[int | None, int]:
    """(expert, first row) of the part ``index`` of a product parameter (``[N, K]``, or ``[E, N, K]``: expert
    None when the part spans every expert)."""
    expert = index[0] if param.dim() == 3 and index else None
    rows = index[1:] if param.dim() == 3 else index
    first = rows[0].start if rows and isinstance(rows[0], slice) else 0
    return cast(int | None, expert), first or 0


TRIM_BYTES = 64 << 20  # the allocator hands its free pages back after about this many bytes of tensors converted
CHUNK_ELEMENTS = 8 << 20  # a tensor is converted in row blocks of about this many values (32 MB in float32)
CHUNK_ROW_MULTIPLE = 128  # ... of a multiple of this many rows


def _row_chunks(reader: _Reader | GgufTensors, name: str, shard: tuple[int, int, int, int] | None,
                scale_name: str | None, block: tuple[int, int] | None) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows) of this rank's part of a checkpoint tensor, in blocks of about ``CHUNK_ELEMENTS`` values,
    each read (and FP8 blocks dequantised) on its own: converting a large tensor (an embedding, a head) never holds
    more than one block of it in a wider dtype. Tensors of more than two dimensions come whole."""
    shape = reader.shape(name)
    if len(shape) != 2 or (shard is not None and shard[0] != 0):
        tensor = reader.get(name, shard) if scale_name is None else \
            _dequantized(cast(_Reader, reader), name, scale_name, block, shard)
        yield 0, tensor
        return
    start, stop = (0, shape[0]) if shard is None else shard[1:3]
    # whole blocks of rows: an FP8 source's scale rows, and the FP8 blocks a quantisation to fp8 makes (start is
    # block-aligned or 0)
    rows = CHUNK_ROW_MULTIPLE if block is None else block[0]
    step = max(rows, CHUNK_ELEMENTS // max(1, shape[1]) // rows * rows)
    for a in range(start, stop, step):
        b = min(stop, a + step)
        part = (0, a, b, shape[0])
        yield a - start, (reader.get(name, part) if scale_name is None
                          else _dequantized(cast(_Reader, reader), name, scale_name, block, part))


def _whole_rows_absmax(reader: _Reader | GgufTensors, name: str, scale_name: str | None,
                       block: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    """The largest magnitude of each whole row of a checkpoint matrix in ``dtype`` (the model's, which the matrix is
    converted to before it is quantised), float32 ``[N]``, read a block of rows at a time."""
    return torch.cat([torch.linalg.vector_norm(chunk.to(dtype).float(), float("inf"), dim=1)
                      for _, chunk in _row_chunks(reader, name, None, scale_name, block)])


class _WholeRowScales:
    """W8A8 for a tensor-parallel rank's columns of a row-parallel matrix: each row's scale from the whole row's
    largest magnitude (``absmax``), as one rank quantises it, so that the rank's integers are one rank's columns."""

    def __init__(self, absmax: torch.Tensor) -> None:
        self.absmax = absmax

    def quantize(self, chunk: torch.Tensor) -> W8A8Weight:
        return W8A8Weight.quantize(chunk, self.absmax.to(chunk.device))


def _dequantized(reader: _Reader, name: str, scale_name: str, block: tuple[int, int] | None,
                 shard: tuple[int, int, int, int] | None) -> torch.Tensor:
    """Float32 of (a part of) an FP8 block tensor: a part of the rows reads only those rows and their scales."""
    assert block is not None
    if shard is not None and shard[0] == 0 and shard[1] % block[0] == 0:
        _, a, b, full = shard
        scale = reader.get(scale_name, (0, a // block[0], -(-b // block[0]), -(-full // block[0])))
        return dequantize_fp8_block(reader.get(name, shard), scale, block)
    tensor = dequantize_fp8_block(reader.get(name), reader.get(scale_name), block)
    if shard is None:
        return tensor
    dim, a, b, _ = shard
    return tensor.narrow(dim, a, b - a).contiguous()


class _QuantizedMatrices:
    """The quantised parts of each product matrix as they stream in; a matrix (one per expert of a stack) is stacked
    from its row blocks once they are all there, so at most one matrix's parts wait at a time."""

    def __init__(self, shapes: dict[str, torch.Size]) -> None:
        self.shapes = shapes
        self.waiting: dict[tuple[str, int | None], list[tuple[int, QuantizedWeight]]] = {}
        self.done: dict[str, QuantizedMatrices] = {
            n: cast(QuantizedMatrices, [None] * s[0]) if len(s) == 3 else cast(QuantizedMatrices, None)
            for n, s in shapes.items()}

    def add(self, param: str, expert: int | None, first_row: int, piece: QuantizedWeight) -> None:
        parts = self.waiting.setdefault((param, expert), [])
        parts.append((first_row, piece))
        if sum(p.shape[0] for _, p in parts) < self.shapes[param][-2]:
            return
        del self.waiting[(param, expert)]
        parts.sort(key=lambda part: part[0])
        matrix = parts[0][1] if len(parts) == 1 else type(parts[0][1]).cat([p for _, p in parts])
        if expert is None:
            self.done[param] = matrix
        else:
            cast(list, self.done[param])[expert] = matrix

    def result(self) -> dict[str, QuantizedMatrices]:
        incomplete = [n for n, m in self.done.items() if m is None or (isinstance(m, list) and None in m)]
        if incomplete or self.waiting:
            raise CheckpointError(f"quantised weights left incomplete: {', '.join(incomplete[:5])}")
        return self.done


def _weight_kinds(cfg: ModelConfig, table: dict[str, Slot | None], params: Mapping[str, torch.Tensor],
                  quantization: str | None, scale_names: AbstractSet[str], product_names: list[str]
                  ) -> dict[str, str]:
    """What each product parameter becomes: ``STORED_FP8`` where the checkpoint stores it as FP8 blocks that this
    rank's part keeps whole (with ``quantization`` None or ``fp8``), else ``quantization``'s format; absent: the
    model dtype."""
    if cfg.fp8_block_size is None or quantization not in (None, "fp8"):
        return {} if quantization is None else dict.fromkeys(product_names, quantization)
    block = cfg.fp8_block_size
    fp8 = dict.fromkeys(product_names, True)
    for name, slot in table.items():
        if slot is None or slot.param not in fp8:
            continue
        stacked = slot.index and isinstance(slot.index[-1], slice)
        rows = params[slot.param][slot.index].shape[-2] if stacked else None
        fp8[slot.param] &= (name[: -len("weight")] + "weight_scale_inv" in scale_names
                            and _block_aligned(slot.shard, rows, block))
    kinds = {n: STORED_FP8 for n, keep in fp8.items() if keep}
    if len(kinds) < len(fp8):
        logger.info("FP8 weights: %d of %d product matrices are not whole FP8 blocks on this rank and load %s",
                    len(fp8) - len(kinds), len(fp8), "dequantised" if quantization is None else "re-blocked")
    if quantization is not None:
        kinds.update({n: quantization for n in fp8 if n not in kinds})
    return kinds


EMBEDDING = "model.embed_tokens.weight"


def _stored_embedding(model: DeepseekForCausalLM) -> list[str]:
    """The embedding, where a GGUF file's quantised table may stay as stored (``layers.embedding``): on one rank (a
    rank's vocabulary rows may be padded) and untied (a tied table is the lm_head's weight as well)."""
    return [] if model.par.enabled or model.lm_head is None else [EMBEDDING]


def _gguf_kinds(table: dict[str, Slot | None], reader: GgufTensors, product_names: list[str]) -> dict[str, str]:
    """The products a GGUF file stores quantised, kept as stored (``gguf_reader.GgufTensors.stored_kind``); the ones
    it stores in a float type load as any checkpoint's do."""
    sources: dict[str, list[str]] = {n: [] for n in product_names}
    for name, slot in table.items():
        if slot is not None and slot.param in sources and name in reader.files:
            sources[slot.param].append(name)
    kinds = {param: reader.stored_kind(names) for param, names in sources.items() if names}
    return {param: kind for param, kind in kinds.items() if kind is not None}


def load_weights(model: DeepseekForCausalLM, path: str | Path, quantization: str | None = None,
                 device: torch.device | None = None) -> None:
    """Fill ``model`` (this rank's shard of it, with its ``mtp`` layers) from the checkpoint at ``path``; raises
    ``CheckpointError`` listing every problem. ``device``: where parameters still on the meta device go (default:
    where the model's other tensors are).

    Tensor by tensor (large ones in blocks of rows), each read, converted to its final form and placed: parameters
    still on the meta device are allocated as they are first filled, and a product matrix whose final form is
    quantised (``quantization``, or FP8 blocks kept as stored) is never allocated in a float dtype: each checkpoint
    tensor is quantised on its own (every format's scales are per row or per group of a row, so this equals
    quantising the stacked matrix) and its row blocks stacked once complete."""
    path = Path(path)
    cfg = model.config
    if device is None:
        device = next((t.device for t in [*model.parameters(), *model.buffers()] if not t.is_meta),
                      torch.device("cpu"))
    reader = _open_reader(path, cfg, device)
    files = reader.files
    if len(model.mtp):
        check_mtp_weights(cfg, files, path)
    fused = {int(m.group(1)) for n in files if (m := _FUSED_EXPERTS_RE.match(n))}
    table = checkpoint_layout(cfg, model.par, fused, len(model.mtp))
    if cfg.moe is not None and cfg.moe.correction_bias == "optional":  # absent: the router's zeros stay
        table = {n: s for n, s in table.items() if n in files or not n.endswith(".e_score_correction_bias")}
    params = dict(model.named_parameters())
    stored = cfg.stored_quantization  # a pre-quantised checkpoint: its matrices load as stored
    if stored is not None:
        if quantization not in (None, stored):
            raise InvalidParam("quantization", f"{path} is stored quantised to {stored}; quantization={quantization!r} "
                               f"would quantise it again: load it as stored, or quantise the original checkpoint")
        quantization = stored
    layout = cfg.stored_layout
    compressed = {n for n in table if stored is not None and is_stored_compressed(n, files.keys(), stored, layout)}
    scale_names = {n for n in files if n.endswith(".weight_scale_inv")}
    _check_checkpoint(path, cfg, table, params, reader, compressed, scale_names)
    if stored == "int4":
        _check_int4_shards(path, cfg, table, compressed)
    products = quantized_parameter_names(model)
    if stored is not None:  # an lm_head the checkpoint left unquantised loads as stored (ModelConfig.stored_float_head)
        stored_params = {slot.param for n, slot in table.items() if slot is not None and n in compressed}
        # a ModelOpt export's unquantised modules (its exclude_modules) stay so: NVIDIA leaves them wide on purpose
        keeps_float = cfg.stored_exclude is not None
        products = [p for p in products if p in stored_params or (p != "lm_head" and not keeps_float)]
    kinds = _weight_kinds(cfg, table, params, quantization, scale_names, products)
    if isinstance(reader, GgufTensors):
        kinds.update(_gguf_kinds(table, reader, products + _stored_embedding(model)))
        for attn in model.attention_layers():  # kv_b_proj, widened from the file: one layout (Linear.one_layout)
            attn.kv_b_proj.one_layout = True
    _allocate_float_parameters(model, table, kinds, device)
    matrices = _QuantizedMatrices({n: params[n].shape for n in kinds})
    _fill(model, table, kinds, reader, matrices, _Sources(quantization, compressed, scale_names, device))
    _fold_lora_scales(model)
    install_quantized(model, matrices.result())
    _absorbed_scales(model, reader)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.materialize(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{path}: nothing loaded into {', '.join(left[:5])}")


def _absorbed_scales(model: DeepseekForCausalLM, reader: _Reader | GgufTensors) -> None:
    """Each attention layer's absorbed factors' run scales from a GGUF file that stores them in runs of 32
    (``GgufTensors.absorbed_scales``), for the compiled decode kernels' runs (``layers.factor_runs``)."""
    if not isinstance(reader, GgufTensors):
        return
    names = {id(m): n for n, m in model.named_modules()}
    for attn in model.attention_layers():
        name = f"{names[id(attn)]}.kv_b_proj.weight"
        scales = reader.absorbed_scales(name) if name in reader.sources else None
        attn.factor_runs = FactorRuns(scales) if scales is not None else None


def _open_reader(path: Path, cfg: ModelConfig, device: torch.device) -> _Reader | GgufTensors:
    """The checkpoint's tensors by name: a GGUF file through llama.cpp's names (its types checked before any weight is
    read), else the safetensors files, renamed by the model's family."""
    if gguf_files(path) is not None:
        return GgufTensors(open_gguf(path), device)
    family = FAMILIES.get(cfg.model_type)
    files, file_names = checkpoint_files(path), dict[str, str]()
    if family is not None:
        files, file_names = renamed_files(files, family.rename)
    return _Reader(files, device, file_names)


def _check_int4_shards(path: Path, cfg: ModelConfig, table: dict[str, Any], compressed: set[str]) -> None:
    """Before any weight is read: this rank's part of each stored int4 matrix is whole groups (and whole packed
    words), else a ``CheckpointError`` naming every matrix a ``tensor_parallel_size`` would split."""
    layout = cfg.stored_layout or CT_INT4
    problems = [p for n in sorted(compressed)
                if table[n] is not None and (p := shard_problem(n, layout, table[n].shard)) is not None]
    if problems:
        raise CheckpointError(f"{path}: tensor parallelism would split stored int4 groups:\n  " + "\n  ".join(problems))


def _check_checkpoint(path: Path, cfg: ModelConfig, table: dict[str, Any], params: dict[str, nn.Parameter],
                      reader: _Reader | GgufTensors, compressed: set[str], scale_names: set[str]) -> None:
    """Every problem of the checkpoint against the model's layout (``table``) in one ``CheckpointError``: tensors
    missing, unexpected or of another shape, FP8 scales without a block size."""
    stored, modelopt = cfg.stored_quantization, cfg.stored_exclude is not None
    files = reader.files
    companions = {c for n in compressed for c in stored_names(n, cast(str, stored), cfg.stored_layout, modelopt)}
    missing = sorted(n for n in table if n not in files and n not in compressed)
    unexpected = sorted(n for n in files if n not in table and n not in scale_names and n not in companions
                        and not _mtp_or_ignored(n, cfg) and not (modelopt and n.endswith(MODELOPT_UNUSED)))
    mismatched = []
    for name, slot in table.items():
        if (name not in files and name not in compressed) or slot is None:
            continue
        want = list(params[slot.param][slot.index].shape)
        if slot.shard is not None:
            want[slot.shard[0]] = slot.shard[3]
        if name in compressed:
            got = stored_shape(reader, name, cast(str, stored), cfg.stored_layout, modelopt)
        else:
            got = reader.shape(name)
        if got != want:
            mismatched.append(f"{name}: checkpoint {got}, config expects {want}")
    problems = ([f"missing: {n}" for n in missing] + [f"unexpected: {n}" for n in unexpected]
                + [f"shape mismatch: {m}" for m in mismatched])
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match its config ({len(problems)} problems):\n  "
                              + "\n  ".join(problems))
    if scale_names and cfg.fp8_block_size is None:
        raise CheckpointError(f"{min(scale_names)}: FP8 scales found but config.json has no "
                              f"quantization_config with weight_block_size")


def _allocate_float_parameters(model: DeepseekForCausalLM, table: dict[str, Any], kinds: dict[str, str],
                               device: torch.device) -> None:
    """The float parameters (those not quantised: ``kinds``), allocated now: one checkpoint tensor fills a whole one;
    others (stacked, or with vocabulary padding rows) start from zeros."""
    modules = dict(model.named_modules())
    whole = {slot.param for slot in table.values() if slot is not None and slot.index == ()}
    for name, param in dict(model.named_parameters()).items():
        if name not in kinds and param.is_meta:
            owner, _, attr = name.rpartition(".")
            alloc = torch.empty if name in whole else torch.zeros
            setattr(modules[owner] if owner else model, attr,
                    nn.Parameter(alloc(param.shape, dtype=param.dtype, device=device), requires_grad=False))


@dataclass(frozen=True)
class _Sources:
    """How the checkpoint's tensors become the model's: the products' format, the names stored compressed, the FP8
    scales, the device."""

    quantization: str | None
    compressed: set[str]
    scale_names: set[str]
    device: torch.device
    ggml_kernels: bool = False  # the model's plan reads ggml blocks in the compiled kernels (a GGUF's Q4_K repacked)


def _fill(model: DeepseekForCausalLM, table: dict[str, Any], kinds: dict[str, str], reader: _Reader | GgufTensors,
          matrices: _QuantizedMatrices, src: _Sources) -> None:
    """Read every tensor of ``table`` into its parameter (float ones in place; quantised ones into ``matrices``),
    handing freed pages back to the system every ``TRIM_BYTES`` converted."""
    from tqdm import tqdm

    src = replace(src, ggml_kernels=src.device.type == "cpu" and model.plan.ggml_failure is None)
    params = dict(model.named_parameters())
    # on a terminal only (disable=None), and on one rank only
    bar = tqdm(total=sum(slot is not None for slot in table.values()), desc="loading weights", unit="tensor",
               disable=None if model.par.rank == 0 else True, leave=False)
    converted = 0  # bytes converted since the allocator last handed free pages back
    for name, slot in table.items():
        if slot is None:
            continue
        bar.update(1)
        converted += _fill_one(model.config, name, slot, params[slot.param], kinds.get(slot.param), reader, matrices,
                               src)
        if converted > TRIM_BYTES:
            _release_free_memory()
            converted = 0
    bar.close()
    _release_free_memory()


def _fill_one(cfg: ModelConfig, name: str, slot: Any, param: nn.Parameter, kind: str | None,
              reader: _Reader | GgufTensors, matrices: _QuantizedMatrices, src: _Sources) -> int:
    """One checkpoint tensor into its parameter or its quantised matrices; the bytes it converted."""
    device, stored = src.device, cfg.stored_quantization
    scale_name = name[: -len("weight")] + "weight_scale_inv" if name.endswith(".weight") else None
    expert, first = _piece_position(param, slot.index)
    if name in src.compressed:
        for row, piece in read_stored(reader, name, cast(str, stored), slot.shard, param.dtype, device,
                                      cfg.stored_layout, cfg.stored_exclude is not None):
            if kind is None:  # stored quantised, kept in the model dtype (kv_b_proj): its dequantised values
                with torch.no_grad():
                    param[slot.index][row: row + piece.shape[0]].copy_(piece.dequantize())
            else:
                matrices.add(slot.param, expert, first + row, piece)
        return 0
    if kind in (STORED_GGUF, STORED_Q4_0):
        repack = src.ggml_kernels and name != EMBEDDING  # a stored embedding is looked up, never multiplied
        matrix = cast(GgufTensors, reader).matrix(name, slot.shard, param.dtype, device, kind, repack)
        matrices.add(slot.param, expert, first, matrix)
        return 0
    if kind == STORED_FP8:
        block = cast(tuple[int, int], cfg.fp8_block_size)
        weight = cast(_Reader, reader).stored(name, slot.shard).to(device)
        scale = reader.get(cast(str, scale_name), _scale_shard(slot.shard, block)).to(device)
        matrices.add(slot.param, expert, first, Fp8Weight(weight, scale.float(), block, param.dtype))
        return 0
    fmt: Any = None if src.quantization is None else WEIGHT_FORMATS[src.quantization]
    fp8_scale = scale_name if scale_name in src.scale_names else None
    if fmt is W8A8Weight and slot.shard is not None and slot.shard[0] == 1 and len(reader.shape(name)) == 2:
        # a row-parallel rank's columns
        fmt = _WholeRowScales(_whole_rows_absmax(reader, name, fp8_scale, cfg.fp8_block_size, param.dtype))
    converted = 0
    for row, chunk in _row_chunks(reader, name, slot.shard, fp8_scale, cfg.fp8_block_size):
        chunk = chunk.to(device=device, dtype=param.dtype)
        if kind is None:
            with torch.no_grad():
                target = param[slot.index]
                (target if target.dim() == 3 else target[row: row + chunk.shape[0]]).copy_(chunk)
        elif expert is None and param.dim() == 3:  # every expert at once (transformers' fused layout)
            for e, rows in enumerate(chunk):
                matrices.add(slot.param, e, first, cast(Any, fmt).quantize(rows))
        else:
            matrices.add(slot.param, expert, first + row, cast(Any, fmt).quantize(chunk))
        converted += chunk.numel() * chunk.element_size()
        del chunk
    return converted


def _fold_lora_scales(model: DeepseekForCausalLM) -> None:
    """LongCat's MLA scales (``ModelConfig.query_lora_scale``, ``latent_scale``) into the freshly loaded weights of
    ``q_a_layernorm`` (the queries are linear in it) and ``kv_a_layernorm`` (the cached latent is its output)."""
    cfg = model.config
    if cfg.query_lora_scale == 1.0 and cfg.latent_scale == 1.0:
        return
    with torch.no_grad():
        for attn in model.attention_layers():
            for norm, scale in ((attn.q_a_layernorm, cfg.query_lora_scale), (attn.kv_a_layernorm, cfg.latent_scale)):
                if scale != 1.0:
                    norm.weight.copy_((norm.weight.float() * scale).to(norm.weight.dtype))


def load_model(path: str | Path, dtype: str | torch.dtype = "auto", attention_path: str = "auto",
               backend: str | None = None, device: str | torch.device = "cpu",
               par: ParallelContext = SINGLE_RANK, num_mtp_layers: int = 0,
               quantization: str | None = None, cpu_gemm: str = "auto") -> DeepseekForCausalLM:
    """Build the model (this rank's shard, with ``num_mtp_layers`` MTP layers) from ``<path>/config.json`` and
    load its safetensors weights straight into their final form (``load_resolved``): the settings resolved here the
    way the engine's ``Worker`` resolves them (on a CPU the kernel plan of ``cpu_gemm``; ``dtype="auto"``: the
    checkpoint's, or on a CPU ``kernel_plan.resolve_cpu_format``; ``backend`` None: the device's attention backend)."""
    cfg = ModelConfig.from_pretrained(path)
    dev = torch.device(device)
    model_dtype, scheme = resolve_model_dtype(dtype, cfg), check_quantization(quantization)
    plan = kernel_plan(cpu_gemm) if dev.type == "cpu" else OFF_CPU
    if dev.type == "cpu":  # "auto" may keep a bfloat16 checkpoint's products bfloat16 in a float32 model
        model_dtype, chosen = resolve_cpu_format(dtype, model_dtype, scheme or cfg.stored_quantization, plan)
        scheme = scheme if chosen == (scheme or cfg.stored_quantization) else chosen
    rc = ResolvedConfig(cfg, model_dtype, dev, par, attention.resolve(backend, dev),
                        attention_path, num_mtp_layers, scheme, plan=plan)
    return load_resolved(path, rc)


def load_resolved(path: str | Path, rc: ResolvedConfig) -> DeepseekForCausalLM:
    """Build the model ``rc`` describes and load the weights at ``path`` into their final form: the model dtype, or
    the products quantised (``rc.quantization``: ``layers.quantization``; then ``finish_quantization`` must follow
    once the weights are final, after any latent-rank truncation) or, for an FP8 checkpoint without
    ``quantization``, kept in FP8 blocks."""
    if rc.num_mtp_layers > rc.model.num_nextn_predict_layers:
        check_mtp_weights(rc.model, {}, Path(path))
    with torch.device("meta"):  # parameters that take no memory: load_weights allocates each in its final form
        model = causal_lm(rc)
    load_weights(model, path, rc.quantization, rc.device)
    return model.eval().prepare_inference()
