"""Load a Hugging Face MLA checkpoint (``config.json`` + safetensors) into ``DeepseekForCausalLM``.

- Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) checkpoints.
- Streamed: tensors are read one at a time from memory-mapped files straight into the model's
  pre-allocated parameters, so peak RAM stays near the model's own size.
- One name table (``checkpoint_layout``) maps every checkpoint tensor to a parameter slot; per-expert
  tensors are stacked, ``gate_proj``/``up_proj`` are fused.
- DeepSeek-V3 FP8 block-quantised weights (``*.weight`` in float8_e4m3fn with ``*.weight_scale_inv``,
  one fp32 scale per 128×128 block) are dequantised on load.
- DeepSeek-V3's multi-token-prediction layers (``model.layers.{num_hidden_layers + j}.*``: ``enorm``, ``hnorm``,
  ``eh_proj``, a decoder block, ``shared_head.norm``) load into ``model.mtp[j]`` when ``num_mtp_layers`` asks
  for them (sharded like any layer, FP8 blocks dequantised), and are skipped otherwise. Their copies of the
  embedding and head (``embed_tokens``, ``shared_head.head``) are skipped: the main model's are used, as
  DeepSeek-V3 shares them.
- Every missing, unexpected or mis-shaped tensor is reported by name in one ``CheckpointError``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from mla_runtime.config import ModelConfig
from mla_runtime.errors import InvalidParam
from mla_runtime.models.deepseek import DeepseekForCausalLM
from mla_runtime.parallel import SINGLE_RANK, ParallelContext
from mla_runtime.plan import resolve_model_dtype

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")
_FUSED_EXPERTS_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj$")


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
        if not self.cfg.tie_word_embeddings:
            self.table["lm_head.weight"] = Slot("lm_head", vocab, vocab_shard)

    def attention(self, p: str) -> None:
        cfg, h = self.cfg, self.cfg.num_attention_heads
        shards = {"q_proj": self.part(0, h * cfg.qk_head_dim), "q_b_proj": self.part(0, h * cfg.qk_head_dim),
                  "kv_b_proj": self.part(0, h * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
                  "o_proj": self.part(1, h * cfg.v_head_dim)}
        projections = (["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_b_proj"]) + \
            ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
        for name in projections:
            self.table[f"{p}.self_attn.{name}.weight"] = Slot(f"{p}.self_attn.{name}.weight", (), shards.get(name))
            if cfg.attention_bias and name in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"):
                self.whole(f"{p}.self_attn.{name}.bias")
        for name in ["kv_a_layernorm"] + ([] if cfg.q_lora_rank is None else ["q_a_layernorm"]):
            self.whole(f"{p}.self_attn.{name}.weight")

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
        if moe.topk_method == "noaux_tc":
            self.whole(f"{p}.mlp.gate.e_score_correction_bias")
        if moe.n_shared_experts:
            self.mlp(f"{p}.mlp.shared_experts", size * moe.n_shared_experts)
        if fused:  # transformers' in-memory layout: [E, 2I, d] and [E, d, I]
            for name in ("gate_up_proj", "down_proj"):
                self.table[f"{experts}.{name}"] = Slot(f"{experts}.{name}", (), self.part(0, moe.n_routed_experts))
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
    layout.whole(f"{p}.input_layernorm.weight")
    layout.whole(f"{p}.post_attention_layernorm.weight")
    layout.attention(p)
    if cfg.is_moe_layer(i):
        layout.moe(p, i in fused_expert_layers)
    else:
        layout.mlp(f"{p}.mlp", cfg.intermediate_size)


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


class _Reader:
    """Open safetensors files lazily (memory-mapped) and hand out one tensor at a time."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self._handles: dict[Path, object] = {}

    def _handle(self, name: str):
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f]

    def get(self, name: str, shard: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """The tensor, or only this rank's part of it (read without materialising the rest)."""
        if shard is None:
            return self._handle(name).get_tensor(name)
        dim, start, stop, _ = shard
        index = (slice(None),) * dim + (slice(start, stop),)
        return self._handle(name).get_slice(name)[index]

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())


def _mtp_or_ignored(name: str, cfg: ModelConfig) -> bool:
    if _IGNORED_RE.search(name):
        return True
    m = _LAYER_RE.match(name)
    return m is not None and int(m.group(1)) >= cfg.num_hidden_layers


def check_mtp_weights(cfg: ModelConfig, files: AbstractSet[str] | dict[str, Path], path: Path) -> None:
    """MTP drafting needs the checkpoint's MTP layer: a clear error naming ``speculative_method`` without it."""
    if cfg.num_nextn_predict_layers < 1 or not all(n in files for n in mtp_layer_names(cfg, 0)):
        raise InvalidParam("speculative_method", f"speculative_method 'mtp' needs a checkpoint with a "
                           f"multi-token-prediction layer (num_nextn_predict_layers >= 1 and the tensors "
                           f"model.layers.{cfg.num_hidden_layers}.eh_proj/enorm/hnorm/...); {path} has none: "
                           f"use speculative_method 'prompt_lookup'")


def load_weights(model: DeepseekForCausalLM, path: str | Path) -> None:
    """Fill ``model`` (this rank's shard of it, with its ``mtp`` layers) from the checkpoint at ``path``; raises
    ``CheckpointError`` listing every problem."""
    path = Path(path)
    cfg = model.config
    files = checkpoint_files(path)
    if len(model.mtp):
        check_mtp_weights(cfg, files, path)
    fused = {int(m.group(1)) for n in files if (m := _FUSED_EXPERTS_RE.match(n))}
    table = checkpoint_layout(cfg, model.par, fused, len(model.mtp))
    params = dict(model.named_parameters())
    reader = _Reader(files)

    scale_names = {n for n in files if n.endswith(".weight_scale_inv")}
    missing = sorted(n for n in table if n not in files)
    unexpected = sorted(n for n in files if n not in table and n not in scale_names and not _mtp_or_ignored(n, cfg))
    mismatched = []
    for name, slot in table.items():
        if name not in files or slot is None:
            continue
        want = list(params[slot.param][slot.index].shape)
        if slot.shard is not None:
            want[slot.shard[0]] = slot.shard[3]
        got = reader.shape(name)
        if got != want:
            mismatched.append(f"{name}: checkpoint {got}, config expects {want}")
    problems = ([f"missing: {n}" for n in missing] + [f"unexpected: {n}" for n in unexpected]
                + [f"shape mismatch: {m}" for m in mismatched])
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match its config ({len(problems)} problems):\n  "
                              + "\n  ".join(problems))

    from tqdm import tqdm

    # on a terminal only (disable=None), and on one rank only
    bar = tqdm(total=sum(slot is not None for slot in table.values()), desc="loading weights", unit="tensor",
               disable=None if model.par.rank == 0 else True, leave=False)
    for name, slot in table.items():
        if slot is None:
            continue
        bar.update(1)
        target = params[slot.param][slot.index]
        scale_name = name[: -len("weight")] + "weight_scale_inv" if name.endswith(".weight") else None
        if scale_name in scale_names:
            if cfg.fp8_block_size is None:
                raise CheckpointError(f"{scale_name}: FP8 scales found but config.json has no "
                                      f"quantization_config with weight_block_size")
            tensor = dequantize_fp8_block(reader.get(name), reader.get(scale_name), cfg.fp8_block_size)
            if slot.shard is not None:
                dim, start, stop, _ = slot.shard
                tensor = tensor.narrow(dim, start, stop - start)
        else:
            tensor = reader.get(name, slot.shard)
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        del tensor
    bar.close()


def load_model(path: str | Path, dtype: str | torch.dtype = "auto", attention_path: str = "auto",
               backend: str | None = None, device: str | torch.device = "cpu",
               par: ParallelContext = SINGLE_RANK, num_mtp_layers: int = 0) -> DeepseekForCausalLM:
    """Build the model (this rank's shard, with ``num_mtp_layers`` MTP layers) from ``<path>/config.json`` and
    load its safetensors weights."""
    cfg = ModelConfig.from_pretrained(path)
    if num_mtp_layers > cfg.num_nextn_predict_layers:
        check_mtp_weights(cfg, {}, Path(path))
    torch_dtype = resolve_model_dtype(dtype, cfg, device)
    with torch.device(device):
        model = DeepseekForCausalLM(cfg, torch_dtype, attention_path, backend, par, num_mtp_layers)
    load_weights(model, path)
    return model.eval().prepare_inference()
