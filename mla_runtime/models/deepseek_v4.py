"""DeepSeek-V4 (``deepseek_v4``) in torch: one sequence at a time, over a per-sequence state.

V4 is not DeepSeek-V2/V3's MLA. Per layer and token it keeps one ``D``-wide latent (``head_dim``: its last ``d_r``
dims rotated) that is both the key and the value of a single KV head; the attention output's rotated dims are
rotated back by the query's position, then projected by a grouped low-rank output (``o_groups`` groups to
``o_lora_rank`` each, then ``o_b_proj``). Each head has an attention sink (one more logit in its softmax, whose
value is dropped). Three layer kinds (``layer_types``):

- ``sliding_attention``: the raw latents of the last ``sliding_window`` positions (the query's own included);
- ``heavily_compressed_attention`` (HCA): the window, plus one compressed entry per ``rate`` tokens (a softmax-gated
  sum of the window of ``rate`` latents, normalised and rotated at the window's first position), all attended;
- ``compressed_sparse_attention`` (CSA): the window, plus compressed entries every ``rate`` tokens over overlapping
  windows of ``2 rate`` (the previous window's first half-width series beside this window's second), of which a
  lightning indexer (its own, narrower compressor and ``index_n_heads`` query heads) keeps the ``index_topk`` best
  per query.

An entry is visible to the query at position ``p`` once its window is complete (entry ``i`` when ``i < (p + 1) //
rate``). The residual is ``hc_mult`` streams (manifold-constrained hyper-connections): before the attention and
before the MoE a learned, Sinkhorn-normalised mix collapses them into the block's input and spreads its output back.
Every layer's MLP is a MoE with one shared expert, SwiGLU clamped at ``swiglu_limit``; the first layers route by a
fixed token-to-experts table (``hash_moe``), the others by ``sqrtsoftplus`` (or sigmoid) scores with a correction
bias. The checkpoint's MTP layers are not read.

``V4SequenceState`` is what one sequence keeps between its steps: per layer the last ``sliding_window - 1`` raw
latents and, per compressor (the attention's and the indexer's), the tokens of the window not yet complete, the
previous window's overlapping half (CSA) and every compressed entry so far. A step may hold any number of the
sequence's tokens (a prompt, a chunk of one, a decode): the result does not depend on how the tokens are split.
An engine step (``ForwardBatch`` with each sequence's state slot) runs through ``forward_batch`` over a
``V4StateCache`` (one state per slot; prefix caching's snapshots beside them, copies of a state at a block boundary:
``V4SequenceState.copy``). Parameter names are transformers' in-memory ones; ``load_deepseek_v4`` reads the released
layout (which transformers saves) and those names, and the released FP8 / MXFP4 checkpoints, whose matrices stay as
stored (``v4_stored``: ``StoredLinear`` layers, ``PackedExperts.keep_stored``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mla_kernels import topk_lowest_first
from mla_runtime.config import RopeConfig
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.layers.hyper import (
    ClampedMLP,
    HyperConnection,
    HyperHead,
    PackedExperts,
    StoredLinear,
    frozen_linear,
    rms,
)
from mla_runtime.layers.rotary import rope_inv_freq
from mla_runtime.models.deepseek import VocabEmbedding
from mla_runtime.models.own_checkpoint import read_checkpoint
from mla_runtime.models.v4_shards import check_v4_parallel, expert_on_rank, shard_stored, shard_tensor
from mla_runtime.models.v4_stored import install_stored, split_stored, stored_matrix, v4_quantization
from mla_runtime.parallel import SINGLE_RANK, ParallelContext

LAYER_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_RATE_KINDS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
SCORING = ("sqrtsoftplus", "sigmoid")


@dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int]
    main_rope: RopeConfig
    compress_rope: RopeConfig
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    max_position_embeddings: int = 1048576

    @staticmethod
    def from_raw(raw: dict[str, Any]) -> V4Config:
        """A V4 ``config.json`` (transformers' names; the original ``compress_ratios``, ``num_hash_layers`` and
        ``qk_rope_head_dim`` too), checked: what the runtime does not implement is refused by name."""
        g = _with_v4_defaults(raw)
        n = int(g["num_hidden_layers"])
        kinds = _layer_kinds(g, n)
        rates = {**{"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                 **(g.get("compress_rates") or {})}
        mlp = g.get("mlp_layer_types") or (["hash_moe"] * min(n, int(g.get("num_hash_layers", 3)))
                                           + ["moe"] * max(0, n - int(g.get("num_hash_layers", 3))))
        head_dim = int(g["head_dim"])
        rope_dim = (int(g["qk_rope_head_dim"]) if g.get("qk_rope_head_dim") is not None
                    else int(head_dim * float(g.get("partial_rotary_factor") or 64 / 512)))
        _check(g, n, kinds, list(mlp), head_dim, rope_dim)
        small = [f"{k} {g[k]}" for k in ("sliding_window", "index_topk", "hc_mult", "hc_sinkhorn_iters")
                 if int(g[k]) < 1] + [f"compress_rates[{k!r}] {rates[k]}" for k in set(kinds) if k in rates
                                      and int(rates[k]) < 1]
        if small:
            raise ValueError("deepseek_v4: must be at least 1: " + ", ".join(small))
        main, compress = _ropes(g)
        return V4Config(
            vocab_size=int(g["vocab_size"]), hidden_size=int(g["hidden_size"]), num_hidden_layers=n,
            num_attention_heads=int(g["num_attention_heads"]), head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=int(g["q_lora_rank"]), o_groups=int(g["o_groups"]), o_lora_rank=int(g["o_lora_rank"]),
            sliding_window=int(g["sliding_window"]), layer_types=tuple(kinds),
            compress_rates={k: int(v) for k, v in rates.items()}, main_rope=main, compress_rope=compress,
            index_n_heads=int(g["index_n_heads"]), index_head_dim=int(g["index_head_dim"]),
            index_topk=int(g["index_topk"]), hc_mult=int(g["hc_mult"]), hc_sinkhorn_iters=int(g["hc_sinkhorn_iters"]),
            hc_eps=float(g["hc_eps"]), mlp_layer_types=tuple(mlp), n_routed_experts=int(g["n_routed_experts"]),
            num_experts_per_tok=int(g["num_experts_per_tok"]), moe_intermediate_size=int(g["moe_intermediate_size"]),
            scoring_func=str(g["scoring_func"]), routed_scaling_factor=float(g["routed_scaling_factor"]),
            swiglu_limit=float(g["swiglu_limit"]), rms_norm_eps=float(g["rms_norm_eps"]),
            tie_word_embeddings=bool(g["tie_word_embeddings"]), eos_token_id=g.get("eos_token_id"),
            bos_token_id=g.get("bos_token_id"), max_position_embeddings=int(g["max_position_embeddings"]))


def _with_v4_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers' ``DeepseekV4Config`` defaults for what ``raw`` leaves out."""
    defaults = dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
                    num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024,
                    num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1, scoring_func="sqrtsoftplus",
                    routed_scaling_factor=1.5, rope_theta=10000.0, compress_rope_theta=160000.0, hc_mult=4,
                    hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8,
                    o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False,
                    max_position_embeddings=1048576)
    out = {**defaults, **{k: v for k, v in raw.items() if v is not None}}
    for key in ("compress_rate_csa", "compress_rate_hca"):
        if raw.get(key) is not None:
            kind = "compressed_sparse_attention" if key.endswith("csa") else "heavily_compressed_attention"
            out["compress_rates"] = {**(out.get("compress_rates") or {}), kind: int(raw[key])}
    return out


def _layer_kinds(g: dict[str, Any], n: int) -> list[str]:
    if g.get("layer_types") is not None:
        return [str(k) for k in g["layer_types"]][:n]
    if g.get("compress_ratios") is not None:
        unknown = sorted({int(r) for r in g["compress_ratios"]} - set(_RATE_KINDS))
        if unknown:
            raise ValueError(f"deepseek_v4: compress_ratios {unknown} are not supported (use 0, 4 or 128)")
        return [_RATE_KINDS[int(r)] for r in g["compress_ratios"]][:n]
    rest = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    return (["heavily_compressed_attention"] * min(n, 2) + rest)[:n]


def _check(g: dict[str, Any], n: int, kinds: list[str], mlp: list[str], head_dim: int, rope_dim: int) -> None:
    problems = []
    if len(kinds) != n or len(mlp) != n:
        problems.append(f"layer_types/mlp_layer_types list {len(kinds)}/{len(mlp)} layers, the model has {n}")
    if set(kinds) - set(LAYER_KINDS):
        problems.append(f"layer_types {sorted(set(kinds) - set(LAYER_KINDS))} (use one of {list(LAYER_KINDS)})")
    if set(mlp) - {"hash_moe", "moe"}:
        problems.append(f"mlp_layer_types {sorted(set(mlp) - {'hash_moe', 'moe'})} (use 'hash_moe' or 'moe')")
    if int(g["num_key_value_heads"]) != 1:
        problems.append(f"num_key_value_heads {g['num_key_value_heads']} (V4 attends one shared K=V head)")
    if int(g["n_shared_experts"]) != 1:
        problems.append(f"n_shared_experts {g['n_shared_experts']} (one shared expert)")
    if g["scoring_func"] not in SCORING:
        problems.append(f"scoring_func {g['scoring_func']!r} (use one of {list(SCORING)})")
    if g["hidden_act"] != "silu":
        problems.append(f"hidden_act {g['hidden_act']!r} (silu)")
    if g["attention_bias"] or g["mlp_bias"]:
        problems.append("attention_bias/mlp_bias (V4's projections have no bias)")
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        problems.append(f"rotary dims {rope_dim} of head_dim {head_dim}")
    heads, groups = int(g["num_attention_heads"]), int(g["o_groups"])
    if heads % groups:
        problems.append(f"o_groups {groups} does not divide num_attention_heads {heads}")
    if problems:
        raise ValueError("deepseek_v4: not supported: " + "; ".join(problems))


def _ropes(g: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """The sliding layers' RoPE (``rope_theta``, plain) and the compressed layers' (``compress_rope_theta``, plain or
    YaRN; V4 does not scale cos/sin by YaRN's attention factor unless the config sets one)."""
    rp = g.get("rope_parameters") or g.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main_p, comp_p = rp["main"], rp["compress"]
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        main_p = {"rope_type": "default", "rope_theta": g["rope_theta"]}
        comp_p = {"rope_type": "default", **flat, "rope_theta": g["compress_rope_theta"]}
    return _rope(main_p, "main"), _rope(comp_p, "compress")


def _rope(p: dict[str, Any], label: str) -> RopeConfig:
    kind = p.get("rope_type", p.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=float(p["rope_theta"]), interleave=True)
    if kind != "yarn":
        raise ValueError(f"deepseek_v4: rope_type {kind!r} of the {label} rotary is not supported (default or yarn)")
    return RopeConfig(theta=float(p["rope_theta"]), kind="yarn", factor=float(p["factor"]),
                      original_max_position_embeddings=int(p["original_max_position_embeddings"]),
                      beta_fast=float(p.get("beta_fast") or 32.0), beta_slow=float(p.get("beta_slow") or 1.0),
                      attention_factor=float(p.get("attention_factor") or 1.0), truncate=bool(p.get("truncate", True)))


# -- small pieces ------------------------------------------------------------------------------------------------------
class Norm(nn.Module):
    """RMS norm with a weight, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


class Rotary:
    """Interleaved RoPE of the trailing ``dim`` channels (pairs ``(x0, x1), (x2, x3)...``); cos and sin are rounded
    to the model's dtype (as the reference's tables are), the rotation computed in float32."""

    def __init__(self, rope: RopeConfig, dim: int, dtype: torch.dtype) -> None:
        self.inv_freq, self.dtype = rope_inv_freq(rope, dim), dtype
        self.scale = rope.attention_factor if rope.kind == "yarn" and rope.attention_factor is not None else 1.0

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos, sin = freqs.cos() * self.scale, freqs.sin() * self.scale
        return cos.to(self.dtype).float(), sin.to(self.dtype).float()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, ..., D]`` with its last ``2 cos.shape[-1]`` channels rotated by ``cos/sin [T, d/2]``."""
        d = 2 * cos.shape[-1]
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        c, s = cos.view(shape), sin.view(shape)
        pairs = x[..., -d:].float().unflatten(-1, (-1, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2).to(x.dtype)
        return torch.cat([x[..., :-d], rotated], dim=-1)




def _param(*shape: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


# -- per-sequence state ------------------------------------------------------------------------------------------------
@dataclass
class CompressorState:
    """A compressor's part of a sequence: the incomplete window's projections, the previous window's overlapping
    half (CSA), and every entry so far ``[n, width]``."""

    buffer_kv: torch.Tensor | None = None
    buffer_gate: torch.Tensor | None = None
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return 0 if self.entries is None else int(self.entries.shape[0])

    def copy(self) -> CompressorState:
        """A copy later steps of either leave alone: the partial window and the overlapping half cloned (they may be
        views of a whole step's projections), the entries shared (a step appends by building a new tensor)."""
        def clone(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.clone()

        return CompressorState(clone(self.buffer_kv), clone(self.buffer_gate), clone(self.overlap_kv),
                               clone(self.overlap_gate), self.entries)


@dataclass
class LayerState:
    window: torch.Tensor | None = None  # the last ``sliding_window - 1`` latents [n, D]
    compressor: CompressorState = field(default_factory=CompressorState)
    indexer: CompressorState = field(default_factory=CompressorState)


@dataclass
class V4SequenceState:
    """Everything one sequence keeps between steps (see the module's docstring)."""

    layers: list[LayerState]
    length: int = 0  # tokens computed so far

    @staticmethod
    def empty(cfg: V4Config) -> V4SequenceState:
        return V4SequenceState([LayerState() for _ in range(cfg.num_hidden_layers)])

    def copy(self) -> V4SequenceState:
        """The state as it is now, which later steps of either leave alone (a state snapshot, a prefix hit's slot):
        every window and partial window cloned, every compressed entry and indexer key shared (never written into)."""
        return V4SequenceState([LayerState(None if ly.window is None else ly.window.clone(), ly.compressor.copy(),
                                           ly.indexer.copy()) for ly in self.layers], self.length)

    def nbytes(self) -> int:
        tensors: list[torch.Tensor | None] = []
        for layer in self.layers:
            tensors.append(layer.window)
            for c in (layer.compressor, layer.indexer):
                tensors += [c.buffer_kv, c.buffer_gate, c.overlap_kv, c.overlap_gate, c.entries]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


COMPRESSOR_FIELDS = ("buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate", "entries")


def state_tensors(st: V4SequenceState) -> dict[str, torch.Tensor]:
    """``st``'s tensors by name (``<layer>.window``, ``<layer>.<compressor|indexer>.<field>``; those not there yet
    left out), as they are (for a snapshot tier to keep: ``state_from_tensors`` turns them back)."""
    out: dict[str, torch.Tensor] = {}
    for i, ly in enumerate(st.layers):
        if ly.window is not None:
            out[f"{i}.window"] = ly.window
        for part, c in (("compressor", ly.compressor), ("indexer", ly.indexer)):
            for name in COMPRESSOR_FIELDS:
                t = getattr(c, name)
                if t is not None:
                    out[f"{i}.{part}.{name}"] = t
    return out


def state_from_tensors(cfg: V4Config, tensors: Mapping[str, torch.Tensor], tokens: int, dtype: torch.dtype,
                       device: torch.device | str) -> V4SequenceState:
    """The state ``state_tensors`` took after ``tokens`` tokens, on ``device``; ValueError unless it is one this
    model keeps: every name known, every tensor 2-D and of the model's dtype (overlapping gates: float32), a window
    of ``head_dim`` channels, and the bytes those of a state that long (``state_bytes``)."""
    st = V4SequenceState.empty(cfg)
    st.length = tokens
    for name, t in tensors.items():
        parts = name.split(".")
        if not parts[0].isdigit() or int(parts[0]) >= len(st.layers) or t.dim() != 2:
            raise ValueError(f"{name}: no such state tensor of this model, or not 2-D")
        ly = st.layers[int(parts[0])]
        want = torch.float32 if name.endswith("overlap_gate") else dtype  # its slot bias added in float32
        if t.dtype != want:
            raise ValueError(f"{name}: {t.dtype}, expected {want}")
        t = t.to(device)
        if parts[1:] == ["window"] and t.shape[1] == cfg.head_dim:
            ly.window = t
        elif len(parts) == 3 and parts[1] in ("compressor", "indexer") and parts[2] in COMPRESSOR_FIELDS:
            setattr(ly.compressor if parts[1] == "compressor" else ly.indexer, parts[2], t)
        else:
            raise ValueError(f"{name}: no such state tensor of this model (shape {tuple(t.shape)})")
    if not 0 < tokens <= cfg.max_position_embeddings or st.nbytes() != state_bytes(cfg, tokens, dtype.itemsize):
        raise ValueError(f"{st.nbytes():,} B for {tokens} tokens; this model keeps "
                         f"{state_bytes(cfg, max(tokens, 0), dtype.itemsize):,} B")
    return st


# -- compressors and the indexer ---------------------------------------------------------------------------------------
class Compressor(nn.Module):
    """Folds every ``rate`` tokens into one ``dim``-wide entry: ``norm(sum_j softmax_j(gate_j + bias_j) kv_j)``,
    rotated at the window's first position. ``overlap`` (CSA): the projections are ``2 dim`` wide, the first half
    pooled into the next window's entry beside the second half of this one's (windows of ``2 rate``, stride
    ``rate``). The gates' softmax runs in float32 (the slot bias is float32), the pooled sum in the model's dtype."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, rope: RopeConfig, rope_dim: int,
                 eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = frozen_linear(width, hidden, dtype)
        self.gate_proj = frozen_linear(width, hidden, dtype)
        self.position_bias = _param(rate, width)
        self.kv_norm = Norm(dim, eps)
        self.rotary = Rotary(rope, rope_dim, dtype)

    def update(self, x: torch.Tensor, st: CompressorState) -> torch.Tensor:
        """Take the step's tokens ``x [T, hidden]``; every entry of the sequence so far ``[n, dim]``."""
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        if st.buffer_kv is not None and st.buffer_gate is not None:
            kv, gate = torch.cat([st.buffer_kv, kv]), torch.cat([st.buffer_gate, gate])
        usable = kv.shape[0] // self.rate * self.rate
        st.buffer_kv, st.buffer_gate = kv[usable:], gate[usable:]
        if usable:
            new = self._pool(kv[:usable], gate[:usable], st)
            st.entries = new if st.entries is None else torch.cat([st.entries, new])
        return st.entries if st.entries is not None else kv.new_zeros(0, self.dim)

    def _pool(self, kv: torch.Tensor, gate: torch.Tensor, st: CompressorState) -> torch.Tensor:
        n, r, d = kv.shape[0] // self.rate, self.rate, self.dim
        first = st.count * r
        ckv, cg = kv.view(n, r, -1), gate.view(n, r, -1) + self.position_bias
        if self.overlap:
            wkv, wg = ckv.new_zeros(n, 2 * r, d), cg.new_full((n, 2 * r, d), float("-inf"))
            wkv[:, r:], wg[:, r:] = ckv[..., d:], cg[..., d:]
            wkv[1:, :r], wg[1:, :r] = ckv[:-1, :, :d], cg[:-1, :, :d]
            if st.overlap_kv is not None and st.overlap_gate is not None:
                wkv[0, :r], wg[0, :r] = st.overlap_kv, st.overlap_gate
            st.overlap_kv, st.overlap_gate = ckv[-1, :, :d].clone(), cg[-1, :, :d].clone()
            ckv, cg = wkv, wg
        pooled = self.kv_norm((ckv * cg.softmax(dim=1).to(ckv.dtype)).sum(dim=1))
        cos, sin = self.rotary.cos_sin(first + r * torch.arange(n, device=kv.device))
        return Rotary.apply(pooled, cos, sin)


class Scorer(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weights_proj = frozen_linear(heads, hidden, dtype)


class Indexer(Compressor):
    """CSA's lightning indexer: its own compressor (``index_head_dim`` wide, overlapping windows like the
    attention's) and ``index_n_heads`` query heads from the query's low-rank residual; score
    ``sum_h w_h relu(q_h . k) / sqrt(c)``, the ``index_topk`` best visible entries per query."""

    def __init__(self, cfg: V4Config, dtype: torch.dtype) -> None:
        rate = cfg.compress_rates["compressed_sparse_attention"]
        super().__init__(cfg.hidden_size, cfg.index_head_dim, rate, True, cfg.compress_rope, cfg.rope_dim,
                         cfg.rms_norm_eps, dtype)
        self.heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = frozen_linear(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, dtype)
        self.scorer = Scorer(cfg.hidden_size, cfg.index_n_heads, dtype)

    def select(self, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor, st: CompressorState
               ) -> torch.Tensor:
        """The entries each query attends ``[T, n]`` (bool)."""
        keys = self.update(x, st)
        n = keys.shape[0]
        if not n:
            return torch.zeros(x.shape[0], 0, dtype=torch.bool, device=x.device)
        q = self.q_b_proj(q_res).view(x.shape[0], self.heads, self.dim)
        q = Rotary.apply(q, *self.rotary.cos_sin(positions))
        scores = F.relu(torch.einsum("thc,nc->thn", q.float(), keys.float())) * self.dim ** -0.5
        weights = self.scorer.weights_proj(x).float() * self.heads ** -0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)
        visible = (positions + 1) // self.rate
        future = torch.arange(n, device=x.device)[None, :] >= visible[:, None]
        # equal scores (relu makes every key no head scores positively worth exactly 0): lowest position first
        top = topk_lowest_first(scores.masked_fill(future, float("-inf")), min(self.topk, n))
        top = torch.where(top < visible[:, None], top, torch.full_like(top, n))
        chosen = torch.zeros(x.shape[0], n + 1, dtype=torch.bool, device=x.device)
        return chosen.scatter_(1, top, True)[:, :n]


class CSACompressor(Compressor):
    def __init__(self, cfg: V4Config, dtype: torch.dtype) -> None:
        super().__init__(cfg.hidden_size, cfg.head_dim, cfg.compress_rates["compressed_sparse_attention"], True,
                         cfg.compress_rope, cfg.rope_dim, cfg.rms_norm_eps, dtype)
        self.indexer = Indexer(cfg, dtype)


# -- attention ---------------------------------------------------------------------------------------------------------
class V4Attention(nn.Module):
    """V4's attention; under tensor parallelism (``par``) this rank's heads, their sinks and the output groups they
    feed (``v4_shards``), the shared KV head, compressors and indexer whole, the output summed over the ranks."""

    def __init__(self, cfg: V4Config, layer: int, dtype: torch.dtype, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        n, d, eps = par.world_size, cfg.head_dim, cfg.rms_norm_eps
        h, groups, self.par = cfg.num_attention_heads // n, cfg.o_groups // n, par
        self.kind, self.heads, self.dim, self.eps = cfg.layer_types[layer], h, d, eps
        self.window, self.groups = cfg.sliding_window, groups
        self.q_a_proj = frozen_linear(cfg.q_lora_rank, cfg.hidden_size, dtype)
        self.q_a_norm = Norm(cfg.q_lora_rank, eps)
        self.q_b_proj = frozen_linear(h * d, cfg.q_lora_rank, dtype)
        self.kv_proj = frozen_linear(d, cfg.hidden_size, dtype)
        self.kv_norm = Norm(d, eps)
        self.o_a_proj = frozen_linear(groups * cfg.o_lora_rank, h * d // groups, dtype)
        self.o_b_proj = frozen_linear(cfg.hidden_size, groups * cfg.o_lora_rank, dtype)
        self.sinks = _param(h)
        self.rate = cfg.compress_rates.get(self.kind, 0)
        self.compressor: Compressor | None = None
        if self.kind == "compressed_sparse_attention":
            self.compressor = CSACompressor(cfg, dtype)
        elif self.kind == "heavily_compressed_attention":
            self.compressor = Compressor(cfg.hidden_size, d, self.rate, False, cfg.compress_rope, cfg.rope_dim, eps,
                                         dtype)
        self.rotary = Rotary(cfg.main_rope if self.compressor is None else cfg.compress_rope, cfg.rope_dim, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, st: LayerState) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = self.rotary.cos_sin(positions)
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = Rotary.apply(rms(self.q_b_proj(q_res).view(t, self.heads, self.dim), self.eps), cos, sin)
        latent = Rotary.apply(self.kv_norm(self.kv_proj(x)), cos, sin)
        keys, visible = self._window_keys(latent, positions, st)
        if self.compressor is not None:
            entries = self.compressor.update(x, st.compressor)
            seen = torch.arange(entries.shape[0], device=x.device)[None, :] < ((positions + 1) // self.rate)[:, None]
            if isinstance(self.compressor, CSACompressor):
                seen &= self.compressor.indexer.select(x, q_res, positions, st.indexer)
            keys, visible = torch.cat([keys, entries.to(keys.dtype)]), torch.cat([visible, seen], dim=1)
        out = self._attend(q, keys, visible)
        out = Rotary.apply(out, cos, -sin)  # the values' rotation, taken back at the query's position
        grouped = out.reshape(t, self.groups, -1)
        if isinstance(self.o_a_proj, StoredLinear):  # as the checkpoint stores it: each group's block of rows
            return self.par.all_reduce(self.o_b_proj(self.o_a_proj.grouped(grouped)))
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])
        return self.par.all_reduce(self.o_b_proj(torch.einsum("tgi,goi->tgo", grouped, w).flatten(1)))

    def _window_keys(self, latent: torch.Tensor, positions: torch.Tensor, st: LayerState
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw latents a step sees (the kept window, then the step's) and which each query attends ``[T, K]``;
        keeps the last ``sliding_window - 1`` for the next step."""
        keys = latent if st.window is None else torch.cat([st.window, latent])
        first = int(positions[0]) - (keys.shape[0] - latent.shape[0])
        key_pos = first + torch.arange(keys.shape[0], device=latent.device)
        st.window = keys[max(keys.shape[0] - (self.window - 1), 0):].clone()
        rel = positions[:, None] - key_pos[None, :]
        return keys, (rel >= 0) & (rel < self.window)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Softmax attention of ``q [T, H, D]`` over ``keys [K, D]`` (also the values) with each head's sink."""
        logits = torch.einsum("thd,kd->thk", q, keys) * self.dim ** -0.5
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        sinks = self.sinks.view(1, -1, 1).expand(q.shape[0], -1, 1)  # float32: the softmax runs in float32
        both = torch.cat([logits.float(), sinks], dim=-1)
        probs = (both - both.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
        return torch.einsum("thk,kd->thd", probs.to(keys.dtype), keys)


# -- MoE ---------------------------------------------------------------------------------------------------------------
class Router(nn.Module):
    """Scores ``score_fn(x W)``; the experts by a fixed token table (``hash``) or by the top scores plus the
    correction bias; the chosen scores normalised to sum 1, times ``routed_scaling_factor``."""

    def __init__(self, cfg: V4Config, hashed: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.hashed, self.k = hashed, cfg.num_experts_per_tok
        self.scoring, self.scale = cfg.scoring_func, cfg.routed_scaling_factor
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype)
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        scores = F.softplus(logits).sqrt() if self.scoring == "sqrtsoftplus" else torch.sigmoid(logits)
        if self.hashed:
            experts = cast(torch.Tensor, self.tid2eid)[input_ids].long()
        else:
            bias = cast(torch.Tensor, self.e_score_correction_bias)
            experts = torch.topk(scores + bias, self.k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        return experts, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale


class V4MoE(nn.Module):
    """The router (whole on every rank), the routed experts (this rank's, whole) and the shared expert (its slice of
    the intermediate size), summed over the ranks."""

    def __init__(self, cfg: V4Config, layer: int, dtype: torch.dtype, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        n, self.par = par.world_size, par
        self.gate = Router(cfg, cfg.mlp_layer_types[layer] == "hash_moe", dtype)
        self.experts = PackedExperts(cfg.n_routed_experts // n, cfg.hidden_size, cfg.moe_intermediate_size,
                                     cfg.swiglu_limit, dtype, first=par.split(cfg.n_routed_experts)[0])
        self.shared_experts = ClampedMLP(cfg.hidden_size, cfg.moe_intermediate_size // n, cfg.swiglu_limit, dtype)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        experts, weights = self.gate(x, input_ids)
        return self.par.all_reduce(self.experts(x, weights, experts) + self.shared_experts(x))


# -- the model ---------------------------------------------------------------------------------------------------------
class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: V4Config, layer: int, dtype: torch.dtype, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        n, d, eps = cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = V4Attention(cfg, layer, dtype, par)
        self.mlp = V4MoE(cfg, layer, dtype, par)
        self.input_layernorm, self.post_attention_layernorm = Norm(d, eps), Norm(d, eps)
        self.attn_hc = HyperConnection(n, d, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.ffn_hc = HyperConnection(n, d, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, st: LayerState
                ) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = HyperConnection.merge(streams, self.self_attn(self.input_layernorm(x), positions, st), post, comb)
        post, comb, x = self.ffn_hc(streams)
        return HyperConnection.merge(streams, self.mlp(self.post_attention_layernorm(x), input_ids), post, comb)


class V4Model(nn.Module):
    def __init__(self, cfg: V4Config, dtype: torch.dtype, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, par)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, i, dtype, par) for i in range(cfg.num_hidden_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)


class V4StateCache:
    """The states of the running sequences, one per slot of the engine's state slots (``cache.state_cache.
    StateSlots`` hands the ids out; the scheduler gives a slot back on finish, abort and preemption). A sequence's
    first step (no cached tokens) starts its slot afresh, whatever the slot held. Prefix caching keeps
    ``num_snapshots`` more: a sequence's state at a block boundary (``V4SequenceState.copy``), written during the step
    that computes the boundary's token (``ForwardBatch.state_snapshots``), copied into the slot of a sequence that
    hits the prefix (``restore``) and dropped when the scheduler frees it (``drop``)."""

    def __init__(self, cfg: V4Config, num_slots: int, num_snapshots: int = 0) -> None:
        if num_slots < 1 or num_snapshots < 0:
            raise ValueError(f"num_slots must be >= 1 and num_snapshots >= 0, got {num_slots}, {num_snapshots}")
        self.cfg = cfg
        self.slots: list[V4SequenceState | None] = [None] * num_slots
        self.snapshots: list[V4SequenceState | None] = [None] * num_snapshots

    def state(self, slot: int, context_len: int) -> V4SequenceState:
        """Slot ``slot``'s state for a step that continues after ``context_len`` tokens."""
        if not 0 <= slot < len(self.slots):
            raise ValueError(f"state slot {slot} is out of range (0..{len(self.slots) - 1})")
        if context_len == 0:
            self.slots[slot] = V4SequenceState.empty(self.cfg)
        st = self.slots[slot]
        if st is None or st.length != context_len:
            raise RuntimeError(f"state slot {slot} holds {0 if st is None else st.length} tokens; the step continues "
                               f"after {context_len}")
        return st

    def release(self, slot: int) -> None:
        """Drop slot ``slot``'s state (its sequence finished, was aborted or preempted)."""
        self.slots[slot] = None

    def run_batch(self, batch: ForwardBatch, hidden: Callable[[torch.Tensor, V4SequenceState], torch.Tensor]
                  ) -> torch.Tensor:
        """Hidden states ``[T, d]`` of an engine step: ``hidden(ids, state)`` over each sequence's slot, its snapshots
        (``batch.state_snapshots``: after its first ``n`` new tokens, into snapshot ``s``) taken on the way."""
        if batch.state_slots is None:
            raise ValueError("a deepseek_v4 step needs each sequence's state slot (ForwardBatch.state_slots)")
        starts, outs = batch.query_start_loc.tolist(), []
        for b, (q, ctx, slot) in enumerate(zip(batch.query_lens, batch.context_lens_list, batch.state_slots)):
            st, done = self.state(slot, ctx), 0
            for n, s in sorted((n, s) for sb, n, s in batch.state_snapshots if sb == b):
                if n > done:
                    outs.append(hidden(batch.input_ids[starts[b] + done:starts[b] + n], st))
                    done = n
                self.snapshots[s] = st.copy()
            if done < q:
                outs.append(hidden(batch.input_ids[starts[b] + done:starts[b] + q], st))
        return torch.cat(outs)

    def restore(self, snapshot: int, slot: int) -> None:
        """Slot ``slot`` resumes from snapshot ``snapshot`` (a prefix hit): a copy of its state."""
        st = self.snapshots[snapshot]
        if st is None:
            raise RuntimeError(f"state snapshot {snapshot} was never taken")
        self.slots[slot] = st.copy()

    def drop(self, snapshot: int) -> None:
        """Drop snapshot ``snapshot``'s state (the scheduler freed it)."""
        self.snapshots[snapshot] = None

    def nbytes(self) -> int:
        return sum(st.nbytes() for st in self.slots if st is not None)

    def snapshot_nbytes(self) -> int:
        """Bytes the snapshots hold, each counted whole (its entries may share tensors with a slot or another)."""
        return sum(st.nbytes() for st in self.snapshots if st is not None)


class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 over per-sequence states: ``forward(input_ids, state)`` computes a step of one sequence. Under
    tensor parallelism (``par``) each rank holds its shard (``v4_shards``) and runs every step with the others."""

    def __init__(self, cfg: V4Config, dtype: torch.dtype = torch.float32, par: ParallelContext = SINGLE_RANK
                 ) -> None:
        super().__init__()
        check_v4_parallel(cfg, par.world_size)
        self.config, self.dtype, self.par = cfg, dtype, par
        self.model = V4Model(cfg, dtype, par)
        rows = par.vocab_split(cfg.vocab_size)[2]
        self.lm_head: nn.Module | None = (None if cfg.tie_word_embeddings
                                          else frozen_linear(rows, cfg.hidden_size, dtype))

    def new_state(self) -> V4SequenceState:
        return V4SequenceState.empty(self.config)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, state: V4SequenceState) -> torch.Tensor:
        """Hidden states ``[T, d]`` after the final norm for the sequence's next ``T`` tokens ``input_ids [T]``;
        ``state`` (the sequence's, from ``new_state``) advances by them."""
        if input_ids.dim() != 1 or not input_ids.numel():
            raise ValueError(f"input_ids must be one sequence's next tokens [T], T >= 1; got {tuple(input_ids.shape)}")
        positions = state.length + torch.arange(input_ids.shape[0], device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer, st in zip(self.model.layers, state.layers):
            streams = layer(streams, input_ids, positions, st)
        state.length += int(input_ids.shape[0])
        return self.model.norm(self.model.hc_head(streams))

    def forward_batch(self, batch: ForwardBatch, states: V4StateCache) -> torch.Tensor:
        """Hidden states ``[T, d]`` of an engine step (``ForwardBatch``: any mix of prompts, chunks and decodes,
        each sequence with its state slot; the step's state snapshots), each sequence over its own slot's state."""
        return states.run_batch(batch, self)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[R, V]`` (under tensor parallelism every rank's vocabulary rows, gathered on every rank)."""
        if self.lm_head is not None:  # a linear layer, or the checkpoint's quantised head (``StoredLinear``)
            logits = self.lm_head(hidden).float()
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()
        if not self.par.enabled:
            return logits
        return self.par.all_gather(logits, dim=-1)[:, :self.config.vocab_size]

    def step(self, batch: list[tuple[torch.Tensor, V4SequenceState]]) -> list[torch.Tensor]:
        """One step of several sequences (any mix of prompts, chunks and decodes): each sequence's last logits
        ``[V]``, each computed over its own state only."""
        return [self.compute_logits(self(ids, st)[-1:])[0] for ids, st in batch]

    def generate_greedy(self, prompt: list[int], max_tokens: int, chunk: int | None = None) -> list[int]:
        """Greedy tokens after ``prompt`` (computed in chunks of ``chunk`` tokens if given)."""
        if not prompt or max_tokens < 1:
            raise ValueError("generate_greedy needs a non-empty prompt and max_tokens >= 1")
        state, step = self.new_state(), chunk or len(prompt)
        ids = torch.tensor(prompt, dtype=torch.long)
        for start in range(0, len(prompt), step):
            hidden = self(ids[start:start + step], state)
        out = [int(self.compute_logits(hidden[-1:]).argmax(-1))]
        while len(out) < max_tokens:
            out.append(int(self.compute_logits(self(torch.tensor(out[-1:]), state)).argmax(-1)))
        return out


# the released checkpoints' names (transformers saves them too) -> the model's, within a layer
_LAYER_NAMES = (("attn_norm.", "input_layernorm."), ("ffn_norm.", "post_attention_layernorm."),
                ("hc_attn_", "attn_hc."), ("hc_ffn_", "ffn_hc."), ("attn.", "self_attn."), ("ffn.", "mlp."))
_ATTN_NAMES = {"attn_sink": "sinks", "wq_a.weight": "q_a_proj.weight", "q_norm.weight": "q_a_norm.weight",
               "wq_b.weight": "q_b_proj.weight", "wkv.weight": "kv_proj.weight", "norm.weight": "kv_norm.weight",
               "wo_a.weight": "o_a_proj.weight", "wo_b.weight": "o_b_proj.weight"}
_COMPRESSOR_NAMES = {"wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight", "ape": "position_bias",
                     "norm.weight": "kv_norm.weight"}
_MLP_NAMES = {"gate.bias": "gate.e_score_correction_bias",
              "shared_experts.w1.weight": "shared_experts.gate_proj.weight",
              "shared_experts.w2.weight": "shared_experts.down_proj.weight",
              "shared_experts.w3.weight": "shared_experts.up_proj.weight"}
_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "embed_tokens.weight": "model.embed_tokens.weight",
              "head.weight": "lm_head.weight", "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
              "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}


def _attn_name(rest: str) -> str:
    if rest.startswith("compressor."):
        tail = rest[len("compressor."):]
        return "compressor." + _COMPRESSOR_NAMES.get(tail, tail)
    if rest.startswith("indexer.compressor."):  # the indexer's compressor: the indexer itself here
        tail = rest[len("indexer.compressor."):]
        return "compressor.indexer." + _COMPRESSOR_NAMES.get(tail, tail)
    if rest.startswith("indexer."):
        tail = {"wq_b.weight": "q_b_proj.weight", "weights_proj.weight": "scorer.weights_proj.weight"}.get(
            rest[len("indexer."):], rest[len("indexer."):])
        return "compressor.indexer." + tail
    return _ATTN_NAMES.get(rest, rest)


def stored_name(name: str) -> str | None:
    """A checkpoint tensor's name (the released layout, with or without transformers' ``model.`` prefix, or
    transformers' own names) -> the model's; None for what is not read (the MTP layers). A routed expert's
    ``experts.{e}.w1/w2/w3`` keeps its expert index: ``load_deepseek_v4`` stacks them."""
    if name.startswith(("mtp.", "model.mtp.")):
        return None
    bare = name[len("model."):] if name.startswith("model.") else name
    if bare in _TOP_NAMES:
        return _TOP_NAMES[bare]
    if bare.startswith("hc_head."):
        return "model." + bare
    if not bare.startswith("layers."):
        return name
    _, index, rest = bare.split(".", 2)
    for old, new in _LAYER_NAMES:
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    if rest.startswith("self_attn."):
        rest = "self_attn." + _attn_name(rest[len("self_attn."):])
    elif rest.startswith("mlp."):
        tail = rest[len("mlp."):]
        rest = "mlp." + _MLP_NAMES.get(tail, tail)
    return f"model.layers.{index}.{rest}"


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``mlp.experts.{e}.w1/w3/w2.weight`` -> the stacked ``gate_up_proj [E, 2I, d]`` and
    ``down_proj [E, d, I]``."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in tensors.items():
        head, sep, tail = name.partition(".mlp.experts.")
        pieces = tail.split(".")
        if not sep or len(pieces) != 3 or not pieces[0].isdigit():
            out[name] = t
            continue
        parts.setdefault(head, {}).setdefault(pieces[1], {})[int(pieces[0])] = t
    for head, kinds in parts.items():
        if set(kinds) != {"w1", "w2", "w3"} or len({len(v) for v in kinds.values()}) != 1:
            raise ValueError(f"{head}: routed experts need w1, w2 and w3 for every expert")
        order = sorted(kinds["w1"])
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([kinds["w1"][e], kinds["w3"][e]]) for e in order])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([kinds["w2"][e] for e in order])
    return out


def load_deepseek_v4(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                     par: ParallelContext = SINGLE_RANK) -> DeepseekV4ForCausalLM:
    """A ``deepseek_v4`` checkpoint (``config.json`` and ``*.safetensors``, in the released layout or transformers'
    names): bfloat16 or float32 tensors, or the released FP8 / MXFP4 ones, kept as stored (``v4_stored``) on
    ``device`` (default: where the tensors load, the CPU). Under tensor parallelism (``par``) this rank's shard
    (``v4_shards``): the routed experts of other ranks are not read."""
    root, raw, _ = read_checkpoint(path, ("deepseek_v4",), quantized=True, keep=lambda _: False)  # the config
    cfg = V4Config.from_raw(raw)
    # not read: the MTP layers, the other ranks' routed experts (and their scales)
    root, raw, stored = read_checkpoint(path, ("deepseek_v4",), quantized=True,
                                        keep=lambda name: _rank_name(cfg, name, par) is not None)
    quant = v4_quantization(raw)
    model = DeepseekV4ForCausalLM(cfg, dtype, par)
    if quant is not None:
        stored, pairs = split_stored(stored)
        matrices = {mine: shard_stored(cfg, mine, stored_matrix(name, w.to(device or w.device), s, quant,
                                                                ".mlp.experts." in mine, dtype), par)
                    for name, (w, s) in pairs.items() if (mine := _rank_name(cfg, name, par)) is not None}
        install_stored(model, matrices)
    tensors = {mine: t for name, t in stored.items() if (mine := _rank_name(cfg, name, par)) is not None}
    tensors = {k: shard_tensor(cfg, k, t, par) for k, t in _stack_experts(tensors).items()}
    own = model.state_dict()
    missing, unknown = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unknown:
        raise ValueError(f"{root}: not a deepseek_v4 checkpoint this config describes: missing {missing[:5]}, "
                         f"unexpected {unknown[:5]}")
    bad = [k for k, v in tensors.items() if v.shape != own[k].shape]
    if bad:
        raise ValueError(f"{root}: shapes differ from the config's: " + ", ".join(
            f"{k} {tuple(tensors[k].shape)} (expected {tuple(own[k].shape)})" for k in bad[:5]))
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in tensors.items()})
    return (model if device is None else model.to(device)).eval()


def _rank_name(cfg: V4Config, name: str, par: ParallelContext) -> str | None:
    """A checkpoint tensor's model name on this rank (a routed expert's renumbered among this rank's experts), None
    for what this rank does not read (the MTP layers, the other ranks' experts)."""
    mine = stored_name(name)
    return None if mine is None else expert_on_rank(cfg, mine, par)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def state_bytes(cfg: V4Config, tokens: int, dtype_bytes: int = 4) -> int:
    """Bytes one sequence of ``tokens`` tokens keeps (``V4SequenceState``): windows, compressed entries, partial
    windows and CSA's overlapping halves in the model's dtype (``dtype_bytes``), the overlapping halves' gates (their
    slot bias added) in float32."""
    total = 0
    for kind in cfg.layer_types:
        total += min(tokens, cfg.sliding_window - 1) * cfg.head_dim * dtype_bytes
        if kind == "sliding_attention":
            continue
        rate = cfg.compress_rates[kind]
        csa = kind == "compressed_sparse_attention"
        for dim in ((cfg.head_dim, cfg.index_head_dim) if csa else (cfg.head_dim,)):
            width = 2 * dim if csa else dim
            total += dtype_bytes * (tokens // rate * dim + 2 * (tokens % rate) * width)
            if csa and tokens >= rate:
                total += rate * dim * (dtype_bytes + 4)
    return total


__all__ = ["DeepseekV4ForCausalLM", "V4Config", "V4SequenceState", "V4StateCache", "load_deepseek_v4",
           "state_from_tensors", "state_tensors"]
