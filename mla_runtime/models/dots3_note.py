"""dots3-note's text model (``dots3_note``, ``dots3_note_text``) in torch: one sequence at a time, over its state.

Every layer is MLA with a query LoRA, of one of three kinds (``layer_types``): ``indexed_attention`` (DSA: a lightning
indexer keeps each query's ``index_topk`` best keys), ``full_attention`` (causal) and ``sliding_attention`` (the last
``sliding_window`` positions), the sliding layers with widths of their own (``per_layer_config``: heads, ranks, head
dims) and their own RoPE base. What dots adds to DeepSeek's MLA:

- the normed query and KV latents are scaled by ``sqrt(hidden / rank)`` (the indexer's query input too), and the
  shared RoPE key is RMS-normed (``k_rope_only_layernorm``) before its interleaved RoPE;
- each head's output times ``sigmoid(g_proj(h))``, one gate per head, before ``o_proj``;
- the indexer rotates the *first* ``d_r`` dims of its keys and queries (interleaved pairs), its scale inside the relu.

The MLPs are dense or MoE (``mlp_layer_types``: DeepSeek-V3's sigmoid router, plain SwiGLU experts and shared experts
of ``shared_experts_intermediate_size``). Every MoE layer has ``n_routed_experts``: the "pyramid" of per-layer expert
counts is the vision tower's (``pyramid_num_routed``), and transformers' text model reads one count for all layers.

``Dots3State`` is what one sequence keeps between steps: per layer its latents ``[L, d_c + d_r]`` (a sliding layer
only its last ``sliding_window - 1``, with the position of the first) and per indexed layer its indexer keys. Only the
text model: the vision and audio towers are not read, and a prompt holding one of their placeholder tokens is refused.

Under tensor parallelism (``par``) each rank holds its shard (``v4_shards.DOTS3_SPLITS``: each layer's share of its own
heads, its routed experts, slices of the MLPs and of the vocabulary) and reads only it from the files; the latent
projections and the indexers are whole on every rank, so every rank keeps the same state. The attention's and the
MLP's partial outputs are summed over the ranks (one all-reduce each), the logits gathered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mla_kernels import topk_lowest_first
from mla_runtime.config import MoEConfig
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.layers.embedding import VocabEmbedding
from mla_runtime.layers.hyper import ClampedMLP, PackedExperts, frozen_linear, pack_experts
from mla_runtime.layers.moe import Router
from mla_runtime.models.glm5_next import Glm5NextStateCache, Norm
from mla_runtime.models.own_checkpoint import read_checkpoint
from mla_runtime.models.v4_shards import DOTS3_SPLITS, check_parallel, read_shard
from mla_runtime.parallel import SINGLE_RANK, ParallelContext

MODEL_TYPES = ("dots3_note", "dots3_note_text")
MEDIA_TOKENS = ("image_token_id", "video_token_id", "audio_token_id")
KINDS = ("indexed_attention", "full_attention", "sliding_attention")
_DEFAULTS: dict[str, Any] = dict(
    vocab_size=152064, hidden_size=5120, intermediate_size=13824, moe_intermediate_size=1536, num_hidden_layers=46,
    num_attention_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=1.0, kv_lora_rank=512,
    q_lora_rank=1024, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1,
    num_experts_per_tok=8, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=524288, rms_norm_eps=1e-5,
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, index_topk=2048, index_head_dim=128,
    index_n_heads=64, head_dim=256, sliding_window=512, shared_experts_intermediate_size=1536, rope_theta=80_000_000.0,
    swa_rope_theta=50_000.0)
_SWA = dict(num_attention_heads=64, q_lora_rank=1024, kv_lora_rank=1024, head_dim=256, qk_nope_head_dim=192,
            v_head_dim=128)
_WIDTHS = ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
           "head_dim")


@dataclass(frozen=True)
class Dots3Config:
    """The text model's settings (transformers' ``Dots3NoteTextConfig`` defaults where ``config.json`` is silent):
    ``kinds`` and ``moe`` per layer, each layer's attention widths, each kind's RoPE (base, rotated dims)."""

    g: dict[str, Any]
    kinds: tuple[str, ...]
    moe: tuple[bool, ...]
    widths: tuple[dict[str, Any], ...]
    ropes: dict[str, tuple[float, int]]
    media_tokens: frozenset[int] = field(default_factory=frozenset)

    @staticmethod
    def from_raw(raw: dict[str, Any]) -> Dots3Config:
        """From a ``dots3_note`` (its ``text_config``) or ``dots3_note_text`` ``config.json``."""
        text = raw.get("text_config") or {k: v for k, v in raw.items() if k not in ("vision_config", "audio_config")}
        g = {**_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
        n = int(g["num_hidden_layers"])
        kinds = list(g.get("layer_types") or _default_kinds(g, n))
        first_dense = int(g.get("first_k_dense_replace", 1))
        mlp = g.get("mlp_layer_types") or ["sparse" if i >= first_dense else "dense" for i in range(n)]
        widths = tuple(_widths(g, i, kinds[i]) for i in range(n)) if len(kinds) == n else ()
        _check(g, n, kinds, mlp, widths)
        media = frozenset(int(raw[k]) for k in MEDIA_TOKENS if raw.get(k) is not None)
        return Dots3Config(g, tuple(kinds), tuple(m == "sparse" for m in mlp), widths, _ropes(g, kinds, widths),
                           media)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.g[name]
        except KeyError:
            raise AttributeError(name) from None


def _default_kinds(g: dict[str, Any], n: int) -> list[str]:
    """transformers' schedule: indexed (or full, ``use_dsa`` false) layers 0, 1 and every fourth from 1, the others
    sliding (all full-size with ``use_sliding_window`` false)."""
    dense = "full_attention" if g.get("use_dsa") is False else "indexed_attention"
    swa = g.get("use_sliding_window", True)
    return [dense if not swa or i < 2 or i % 4 == 1 else "sliding_attention" for i in range(n)]


def _widths(g: dict[str, Any], i: int, kind: str) -> dict[str, Any]:
    """Layer ``i``'s attention widths: the global ones, a sliding layer's ``swa_*`` defaults, ``per_layer_config``."""
    out = {k: g[k] for k in _WIDTHS}
    per = g.get("per_layer_config") or {}
    if kind == "sliding_attention" and not per:
        swa = {k: g.get(f"swa_{k}", v) for k, v in _SWA.items()}
        swa["qk_rope_head_dim"] = g.get("swa_qk_rope_head_dim", swa["head_dim"] - swa["qk_nope_head_dim"])
        out.update(swa)
    out.update(per.get(str(i)) or per.get(i) or {})
    return {k: (None if v is None else int(v)) if k in _WIDTHS else v for k, v in out.items()}


def _ropes(g: dict[str, Any], kinds: list[str], widths: tuple[dict[str, Any], ...]) -> dict[str, tuple[float, int]]:
    """Each kind's RoPE: its base and rotated dims (``head_dim x partial_rotary_factor``, as transformers)."""
    params = g.get("rope_parameters") or g.get("rope_scaling") or {}
    out = {}
    for kind in set(kinds):
        w = widths[kinds.index(kind)]
        nested = params.get(kind)
        p: dict[str, Any] = nested if isinstance(nested, dict) else (params if "rope_theta" in params else {})
        if p.get("rope_type", "default") != "default":
            raise ValueError(f"dots3_note: rope_type {p.get('rope_type')!r} of the {kind} layers is not supported "
                             f"(default)")
        theta = float(p.get("rope_theta", g["swa_rope_theta"] if kind == "sliding_attention" else g["rope_theta"]))
        out[kind] = (theta, int(w["head_dim"] * (w["qk_rope_head_dim"] / w["head_dim"])))  # transformers' factor
    return out


def _check(g: dict[str, Any], n: int, kinds: list[str], mlp: list[str], widths: tuple[dict[str, Any], ...]) -> None:
    """Refuse, by name, what transformers' model would not run or this one does not."""
    for name, values, allowed in (("layer_types", kinds, set(KINDS)), ("mlp_layer_types", mlp, {"dense", "sparse"})):
        if len(values) != n or set(values) - allowed:
            raise ValueError(f"dots3_note: {name} must list {n} layers, each one of {sorted(allowed)}: got {values}")
    for i, w in enumerate(widths):
        extra = sorted(set(w) - set(_WIDTHS) - {"num_key_value_heads", "sliding_window", "rope_theta"})
        if extra:
            raise ValueError(f"dots3_note: per_layer_config of layer {i} sets {extra}: only the attention's widths "
                             f"may differ by layer (transformers' text model reads one {extra[0]} for all layers)")
        if w["q_lora_rank"] is None:
            raise ValueError(f"dots3_note: layer {i} has no q_lora_rank (its MLA queries need one)")
    if g["hidden_act"] != "silu" or g["attention_bias"] or g["mlp_bias"]:
        raise ValueError("dots3_note: hidden_act must be silu, with no attention or MLP biases")


# -- per-sequence state ------------------------------------------------------------------------------------------------
@dataclass
class Dots3State:
    """One sequence's state: per layer its latents (a sliding layer's last ones, from position ``starts[i]``), per
    indexed layer its indexer keys."""

    latents: list[torch.Tensor]
    starts: list[int]
    index_keys: list[torch.Tensor]
    length: int = 0

    def copy(self) -> Dots3State:
        """A copy that later steps of either leave alone (a step replaces the tensors, never writes into them)."""
        return Dots3State(list(self.latents), list(self.starts), list(self.index_keys), self.length)

    @staticmethod
    def empty(cfg: Dots3Config, dtype: torch.dtype, device: torch.device | str = "cpu") -> Dots3State:
        rows = [torch.zeros(0, w["kv_lora_rank"] + w["qk_rope_head_dim"], dtype=dtype, device=device)
                for w in cfg.widths]
        keys = [torch.zeros(0, int(cfg.index_head_dim), dtype=dtype, device=device) for _ in cfg.widths]
        return Dots3State(rows, [0] * len(rows), keys)


def rotate_pairs(x: torch.Tensor, positions: torch.Tensor, theta: float, dim: int, table_dtype: torch.dtype
                 ) -> torch.Tensor:
    """Interleaved RoPE of ``x [T, ..., dim]`` as transformers' dots: pairs ``(x0, x1), (x2, x3)...`` rotated, written
    back as ``[rotated evens ; rotated odds]``; cos and sin rounded to ``table_dtype``, the result cast to ``x``'s."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (dim // 2,)
    cos, sin = freqs.cos().to(table_dtype).view(shape), freqs.sin().to(table_dtype).view(shape)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


# -- attention ---------------------------------------------------------------------------------------------------------
class Dots3Indexer(nn.Module):
    """The lightning indexer of an indexed layer (the module docstring)."""

    def __init__(self, cfg: Dots3Config, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        d, w = int(cfg.hidden_size), cfg.widths[layer]
        self.n_heads, self.head_dim, self.topk = int(cfg.index_n_heads), int(cfg.index_head_dim), int(cfg.index_topk)
        self.theta, self.rope = cfg.ropes[cfg.kinds[layer]]
        self.wq_b = frozen_linear(self.n_heads * self.head_dim, w["q_lora_rank"], dtype)
        self.wk, self.weights_proj = frozen_linear(self.head_dim, d, dtype), frozen_linear(self.n_heads, d, dtype)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        self.k_norm.requires_grad_(False)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        r = self.rope
        return torch.cat([rotate_pairs(x[..., :r], positions, self.theta, r, torch.float32), x[..., r:]], dim=-1)

    def keys(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._rotate(self.k_norm(self.wk(h)).unsqueeze(1), positions).squeeze(1)

    def forward(self, h: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor
                ) -> torch.Tensor:
        """The chosen positions ``[T, min(topk, n)]`` among the sequence's ``n`` keys (future ones score -inf)."""
        q = self._rotate(self.wq_b(q_resid).view(h.shape[0], self.n_heads, self.head_dim), positions)
        scores = F.relu(torch.einsum("thd,nd->thn", q.float(), keys.float()) * self.head_dim ** -0.5)
        index = torch.einsum("th,thn->tn", self.weights_proj(h).float() * self.n_heads ** -0.5, scores)
        future = torch.arange(keys.shape[0], device=h.device)[None, :] > positions[:, None]
        return topk_lowest_first(index.masked_fill(future, float("-inf")), min(self.topk, keys.shape[0]))


class Dots3Attention(nn.Module):
    """MLA over the sequence's latents (a sliding layer's window, an indexed layer's selection), gated per head;
    under tensor parallelism this rank's heads (its output a part of the sum over the ranks)."""

    def __init__(self, cfg: Dots3Config, layer: int, dtype: torch.dtype, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        w, d, eps = cfg.widths[layer], int(cfg.hidden_size), float(cfg.rms_norm_eps)
        heads = w["num_attention_heads"] // par.world_size
        self.layer, self.kind, self.heads, self.c = layer, cfg.kinds[layer], heads, w["kv_lora_rank"]
        self.nope, self.rope, self.v_dim = w["qk_nope_head_dim"], w["qk_rope_head_dim"], w["v_head_dim"]
        self.theta, rot = cfg.ropes[self.kind]
        if rot != self.rope:
            raise ValueError(f"dots3_note: layer {layer} rotates {rot} dims, its qk_rope_head_dim is {self.rope}")
        self.window = int(cfg.sliding_window) if self.kind == "sliding_attention" else 0
        r = w["q_lora_rank"]
        self.q_scale, self.kv_scale = math.sqrt(d / r), math.sqrt(d / self.c)
        self.q_a_proj, self.q_a_layernorm = frozen_linear(r, d, dtype), Norm(r, eps, dtype)
        self.q_b_proj = frozen_linear(self.heads * (self.nope + self.rope), r, dtype)
        self.kv_a_proj_with_mqa = frozen_linear(self.c + self.rope, d, dtype)
        self.kv_a_layernorm, self.k_rope_only_layernorm = Norm(self.c, eps, dtype), Norm(self.rope, eps, dtype)
        self.kv_b_proj = frozen_linear(self.heads * (self.nope + self.v_dim), self.c, dtype)
        self.o_proj, self.g_proj = frozen_linear(d, self.heads * self.v_dim, dtype), frozen_linear(self.heads, d, dtype)
        self.indexer = Dots3Indexer(cfg, layer, dtype) if self.kind == "indexed_attention" else None

    def _append(self, h: torch.Tensor, positions: torch.Tensor, st: Dots3State) -> None:
        latent, k_pe = self.kv_a_proj_with_mqa(h).split([self.c, self.rope], dim=-1)
        table = torch.float32 if self.kind == "indexed_attention" else h.dtype
        k_pe = rotate_pairs(self.k_rope_only_layernorm(k_pe), positions, self.theta, self.rope, table)
        j = self.layer
        st.latents[j] = torch.cat([st.latents[j], torch.cat([self.kv_a_layernorm(latent) * self.kv_scale, k_pe], -1)])

    def forward(self, h: torch.Tensor, positions: torch.Tensor, st: Dots3State) -> torch.Tensor:
        t, j = h.shape[0], self.layer
        q_resid = self.q_a_layernorm(self.q_a_proj(h)) * self.q_scale
        q = self.q_b_proj(q_resid).view(t, self.heads, -1)
        table = torch.float32 if self.kind == "indexed_attention" else h.dtype
        q = torch.cat([q[..., :self.nope], rotate_pairs(q[..., self.nope:], positions, self.theta, self.rope, table)],
                      dim=-1)
        self._append(h, positions, st)
        rows, first = st.latents[j], st.starts[j]
        cols = torch.arange(first, first + rows.shape[0], device=h.device)
        visible = cols[None, :] <= positions[:, None]
        if self.window:
            visible &= cols[None, :] > positions[:, None] - self.window
        if self.indexer is not None:
            st.index_keys[j] = torch.cat([st.index_keys[j], self.indexer.keys(h, positions)])
            chosen = self.indexer(h, q_resid, positions, st.index_keys[j])
            visible &= torch.zeros_like(visible).scatter_(1, chosen, True)
        kv = self.kv_b_proj(rows[:, :self.c]).view(rows.shape[0], self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        keys = torch.cat([k_nope, rows[:, None, self.c:].expand(-1, self.heads, -1)], dim=-1)
        logits = torch.einsum("thd,khd->htk", q, keys) * (self.nope + self.rope) ** -0.5
        probs = logits.masked_fill(~visible.unsqueeze(0), float("-inf")).float().softmax(dim=-1).to(q.dtype)
        out = torch.einsum("htk,khd->thd", probs, v) * torch.sigmoid(self.g_proj(h)).unsqueeze(-1)
        drop = rows.shape[0] - (self.window - 1)
        if self.window and drop > 0:  # keep the next step's window
            st.latents[j], st.starts[j] = rows[drop:].clone(), first + drop
        return cast(torch.Tensor, self.o_proj(out.reshape(t, -1)))


# -- MoE and the model -------------------------------------------------------------------------------------------------
class Dots3MoE(nn.Module):
    """The router (whole), this rank's routed experts (whole) and its slice of the shared experts: a part of the sum
    over the ranks."""

    def __init__(self, cfg: Dots3Config, dtype: torch.dtype, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        d, i = int(cfg.hidden_size), int(cfg.moe_intermediate_size)
        moe = MoEConfig(n_routed_experts=int(cfg.n_routed_experts), n_shared_experts=int(cfg.n_shared_experts),
                        num_experts_per_tok=int(cfg.num_experts_per_tok), moe_intermediate_size=i,
                        n_group=int(cfg.n_group), topk_group=int(cfg.topk_group), topk_method="noaux_tc",
                        scoring_func="sigmoid", routed_scaling_factor=float(cfg.routed_scaling_factor),
                        norm_topk_prob=bool(cfg.norm_topk_prob))
        n = par.world_size
        self.gate = Router(moe, d)
        self.experts = PackedExperts(moe.n_routed_experts // n, d, i, float("inf"), dtype,
                                     first=par.split(moe.n_routed_experts)[0])
        shared = int(cfg.shared_experts_intermediate_size) * moe.n_shared_experts
        self.shared_experts = ClampedMLP(d, shared // n, float("inf"), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        return self.experts(x, weights, experts) + self.shared_experts(x)


class Dots3DecoderLayer(nn.Module):
    def __init__(self, cfg: Dots3Config, layer: int, dtype: torch.dtype, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        d, eps = int(cfg.hidden_size), float(cfg.rms_norm_eps)
        self.par = par
        self.self_attn = Dots3Attention(cfg, layer, dtype, par)
        self.mlp: nn.Module = (Dots3MoE(cfg, dtype, par) if cfg.moe[layer] else
                               ClampedMLP(d, int(cfg.intermediate_size) // par.world_size, float("inf"), dtype))
        self.input_layernorm, self.post_attention_layernorm = Norm(d, eps, dtype), Norm(d, eps, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, st: Dots3State) -> torch.Tensor:
        x = x + self.par.all_reduce(self.self_attn(self.input_layernorm(x), positions, st))
        return cast(torch.Tensor, x + self.par.all_reduce(self.mlp(self.post_attention_layernorm(x))))


class Dots3Model(nn.Module):
    def __init__(self, cfg: Dots3Config, dtype: torch.dtype, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        d = int(cfg.hidden_size)
        self.embed_tokens = VocabEmbedding(int(cfg.vocab_size), d, dtype, par)
        self.layers = nn.ModuleList(Dots3DecoderLayer(cfg, i, dtype, par) for i in range(len(cfg.kinds)))
        self.norm = Norm(d, float(cfg.rms_norm_eps), dtype)


class Dots3NoteForCausalLM(nn.Module):
    """The text model; parameter names are transformers' text model's (``load_state_dict_hf`` also reads the
    multimodal wrapper's and the released layout's). Under tensor parallelism (``par``) this rank's shard (the module
    docstring)."""

    def __init__(self, cfg: Dots3Config, dtype: torch.dtype = torch.float32, par: ParallelContext = SINGLE_RANK
                 ) -> None:
        super().__init__()
        check_dots3_parallel(cfg, par.world_size)
        self.config, self.dtype, self.par = cfg, dtype, par
        self.model = Dots3Model(cfg, dtype, par)
        self.lm_head = frozen_linear(par.vocab_split(int(cfg.vocab_size))[2], int(cfg.hidden_size), dtype)

    def new_state(self) -> Dots3State:
        return Dots3State.empty(self.config, self.dtype, self.lm_head.weight.device)

    @torch.no_grad()
    def hidden(self, ids: list[int], st: Dots3State) -> torch.Tensor:
        """The hidden states ``[T, d]`` (after the final norm) of the sequence's next tokens ``ids``; ``st``
        advances by them."""
        media = sorted(set(ids) & self.config.media_tokens)
        if media:
            raise ValueError(f"dots3_note: the prompt holds image/video/audio placeholder tokens {media}; only the "
                             f"text model is served")
        if not ids:
            raise ValueError("dots3_note: a step needs at least one token")
        device = self.lm_head.weight.device
        positions = torch.arange(st.length, st.length + len(ids), device=device)
        x = self.model.embed_tokens(torch.tensor(ids, device=device))
        for layer in self.model.layers:
            x = layer(x, positions, st)
        st.length += len(ids)
        return cast(torch.Tensor, self.model.norm(x))

    def forward(self, ids: list[int], st: Dots3State) -> torch.Tensor:
        """The logits ``[T, vocab]`` float32 of the sequence's next tokens ``ids``; ``st`` advances by them."""
        return self.compute_logits(self.hidden(ids, st))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[R, V]`` (under tensor parallelism every rank's vocabulary rows, gathered)."""
        logits = F.linear(hidden, self.lm_head.weight).float()
        if not self.par.enabled:
            return logits
        return self.par.all_gather(logits, dim=-1)[:, :int(self.config.vocab_size)]

    def forward_batch(self, batch: ForwardBatch, states: Glm5NextStateCache) -> torch.Tensor:
        """Hidden states ``[T, d]`` of an engine step, each sequence over its own slot's state."""
        return states.run_batch(batch, self.hidden)

    def load_state_dict_hf(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load a checkpoint's tensors; the vision and audio towers' and the MTP layer's are not read."""
        n = len(self.config.kinds)
        mine = pack_experts({s: t for name, t in tensors.items() if (s := stored_name(name, n)) is not None})
        if self.config.tie_word_embeddings and "lm_head.weight" not in mine and "model.embed_tokens.weight" in mine:
            mine["lm_head.weight"] = mine["model.embed_tokens.weight"]
        own = self.state_dict()
        missing, unknown = sorted(set(own) - set(mine)), sorted(set(mine) - set(own))
        bad = [k for k in set(own) & set(mine) if own[k].shape != mine[k].shape]
        if missing or unknown or bad:
            raise ValueError(f"dots3_note: not the checkpoint this config describes: missing {missing[:5]}, "
                             f"unexpected {unknown[:5]}, shapes differ {bad[:5]}")
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in mine.items()})


_TOWERS = ("model.vision_tower.", "model.audio_tower.", "vision_encoder.", "audio_encoder.", "audio_adapter.",
           "model.vision_encoder.", "model.audio_encoder.", "model.audio_adapter.", "model.mtp.",
           "model.language_model.mtp.")


def stored_name(name: str, layers: int) -> str | None:
    """A checkpoint tensor's name -> the model's (None: a tower's or the MTP layer's, not read)."""
    if name.startswith(_TOWERS):
        return None
    name = name.replace("model.language_model.", "model.")
    if not name.startswith(("model.", "lm_head.")):
        name = "model." + name
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= layers:
        return None  # the MTP layer, stored as the layer after the last
    return name


def check_dots3_parallel(cfg: Dots3Config, world: int) -> None:
    """Refuse, saying what to change, a ``tensor_parallel_size`` that does not split every layer's heads, the experts
    and the MLPs of ``cfg``."""
    sizes: dict[str, int] = {}
    for i, w in enumerate(cfg.widths):  # each head count once, by the first layer that has it
        if w["num_attention_heads"] not in sizes.values():
            sizes[f"num_attention_heads of layer {i}"] = w["num_attention_heads"]
    if any(cfg.moe):
        sizes.update({"n_routed_experts": int(cfg.n_routed_experts),
                      "shared_experts_intermediate_size x n_shared_experts":
                          int(cfg.shared_experts_intermediate_size) * int(cfg.n_shared_experts)})
    if not all(cfg.moe):
        sizes["intermediate_size"] = int(cfg.intermediate_size)
    check_parallel("dots3_note", sizes, world)


def load_dots3_note(path: str | Path, dtype: torch.dtype = torch.float32, par: ParallelContext = SINGLE_RANK
                    ) -> Dots3NoteForCausalLM:
    """A ``dots3_note`` (or ``dots3_note_text``) checkpoint: ``config.json`` and ``*.safetensors``, float tensors;
    under tensor parallelism (``par``) this rank's shard, the only part of the files it reads."""
    _, raw, _ = read_checkpoint(path, MODEL_TYPES, keep=lambda _: False)  # the config
    cfg = Dots3Config.from_raw(raw)
    model = Dots3NoteForCausalLM(cfg, dtype, par)
    layers = len(cfg.kinds)
    model.load_state_dict_hf(read_shard(path, MODEL_TYPES, cfg, par, DOTS3_SPLITS, lambda n: stored_name(n, layers)))
    return model.eval()
