"""GLM-5-Next's text model (``glm5_next``, ``glm5_next_text``) in torch: one sequence at a time, over its state.

A hybrid (``docs/hybrid-models.md``): Kimi Delta Attention layers (``layers/kda.py``, Kimi Linear's low-rank gates
with a flat ``A_log [H]`` and the bounded forget gate) between MLA layers without RoPE (``qk_rope_head_dim`` 0: the
cached latent is the normed ``d_c`` row alone) whose attention is sparse: a pooled indexer (``layers/pooled_indexer``)
chooses each query's tokens, and a layer whose ``indexer_types`` entry is ``shared`` reuses the selection of the
layer before it (which must be a ``full`` MLA layer, as transformers requires). The residual is ``hc_mult`` streams
mixed around every block (``layers/hyper.py``), collapsed by their mean before the final norm. The MLPs, dense or
MoE (``mlp_layer_types``), clamp their SwiGLU at ``swiglu_limit``; the routed experts are stored packed
(``gate_up_proj [E, 2 i, d]``, ``down_proj [E, d, i]``), the router is DeepSeek-V3's.

``Glm5NextState`` is what one sequence keeps between steps: per MLA layer its latents and its indexer's keys and
pool gate scores, per linear layer its recurrent and convolution states (a one-slot ``StateCache``). A step may hold
any number of the sequence's tokens (a prompt, a chunk of one, a decode). Only the text model: the vision tower's
weights are not read, and a prompt holding an image or video placeholder token is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mla_runtime.cache.state_cache import StateCache
from mla_runtime.config import LinearAttentionConfig, MoEConfig
from mla_runtime.families import _indexer_kinds, _kimi_linear_name
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.layers.hyper import ClampedMLP, HyperConnection, PackedExperts, frozen_linear, pack_experts
from mla_runtime.layers.kda import KimiDeltaAttention
from mla_runtime.layers.moe import Router
from mla_runtime.layers.pooled_indexer import PooledIndexer
from mla_runtime.models.own_checkpoint import read_checkpoint

_DEFAULTS: dict[str, Any] = dict(
    vocab_size=154880, hidden_size=4096, intermediate_size=12288, num_hidden_layers=45, num_attention_heads=64,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=256, qk_rope_head_dim=0, v_head_dim=256,
    moe_intermediate_size=2048, num_experts_per_tok=8, n_routed_experts=288, n_shared_experts=1, n_group=1,
    topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-5, swiglu_limit=10.0,
    linear_head_dim=128, linear_num_heads=64, linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4,
    hc_eps=1e-6, hc_sinkhorn_iters=20, index_topk=2048, index_head_dim=128, index_n_heads=32, index_kpool=16,
    index_kpool_always_select_tail=True, tie_word_embeddings=False, hidden_act="silu")
MODEL_TYPES = ("glm5_next", "glm5_next_text")
MEDIA_TOKENS = ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                "video_start_token_id", "video_end_token_id")


@dataclass(frozen=True)
class Glm5NextConfig:
    """The text model's settings (transformers' ``Glm5NextTextConfig`` defaults where ``config.json`` is silent)."""

    g: dict[str, Any]
    linear: tuple[bool, ...]
    moe: tuple[bool, ...]
    shared: tuple[bool, ...]
    media_tokens: frozenset[int] = field(default_factory=frozenset)

    @staticmethod
    def from_raw(raw: dict[str, Any]) -> Glm5NextConfig:
        """From a ``glm5_next`` (its ``text_config``, or flat) or ``glm5_next_text`` ``config.json``."""
        text = raw.get("text_config") or {k: v for k, v in raw.items() if k != "vision_config"}
        g = {**_DEFAULTS, **{k: v for k, v in text.items() if v is not None or k == "linear_lower_bound"}}
        _linear_settings(g)
        n = int(g["num_hidden_layers"])
        kinds = [("indexed_attention" if k == "full_attention" else k) for k in
                 (g.get("layer_types") or ["indexed_attention" if i % 4 == 3 else "linear_attention"
                                           for i in range(n)])]
        mlp = g.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
        indexers = _indexer_kinds({**g, "index_skip_topk_offset": g.get("index_skip_topk_offset", 2)})
        _check(g, n, kinds, mlp, indexers)
        shared = tuple(k == "indexed_attention" and s == "shared" for k, s in zip(kinds, indexers))
        media = frozenset(int(raw[k]) for k in MEDIA_TOKENS if raw.get(k) is not None)
        return Glm5NextConfig(g, tuple(k == "linear_attention" for k in kinds), tuple(m == "sparse" for m in mlp),
                              shared, media)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.g[name]
        except KeyError:
            raise AttributeError(name) from None

    def linear_attention(self) -> LinearAttentionConfig:
        return LinearAttentionConfig(layers=self.linear, num_heads=int(self.linear_num_heads),
                                     head_dim=int(self.linear_head_dim), conv_kernel=int(self.linear_conv_kernel_dim),
                                     gate_lower_bound=self.linear_lower_bound, flat_a_log=True)


def _linear_settings(g: dict[str, Any]) -> None:
    """The original layout's ``linear_attn_config`` over the flat ``linear_*`` fields, as transformers reads it."""
    lin = g.get("linear_attn_config") or {}
    for name, key in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                      ("linear_conv_kernel_dim", "short_conv_kernel_size"), ("linear_lower_bound", "gate_lower_bound")):
        g[name] = lin.get(key, g[name])
    if lin and lin.get("safe_gate", True) and g["linear_lower_bound"] is None:
        g["linear_lower_bound"] = -5.0


def _check(g: dict[str, Any], n: int, kinds: list[str], mlp: list[str], indexers: list[str]) -> None:
    """Refuse what transformers' model would not run, by name."""
    for name, values, allowed in (("layer_types", kinds, {"linear_attention", "indexed_attention"}),
                                  ("mlp_layer_types", mlp, {"dense", "sparse"}),
                                  ("indexer_types", indexers, {"full", "shared"})):
        if len(values) != n or set(values) - allowed:
            raise ValueError(f"glm5_next: {name} must list {n} layers, each one of {sorted(allowed)}: got {values}")
    if int(g["qk_rope_head_dim"]) != 0:
        raise ValueError(f"glm5_next: qk_rope_head_dim must be 0 (its MLA layers carry no RoPE), got "
                         f"{g['qk_rope_head_dim']}")
    if g.get("q_lora_rank") is None:
        raise ValueError("glm5_next: q_lora_rank is required (the indexer reads the query's low-rank q_resid)")
    if g["hidden_act"] != "silu":
        raise ValueError(f"glm5_next: hidden_act {g['hidden_act']!r} is not supported (silu)")
    for i, (kind, mode) in enumerate(zip(kinds, indexers)):
        if kind == "indexed_attention" and mode == "shared" and not (
                i and kinds[i - 1] == "indexed_attention" and indexers[i - 1] == "full"):
            raise ValueError(f"glm5_next: layer {i} shares the previous layer's indexer selection (indexer_types "
                             f"'shared'), but layer {i - 1} is not an MLA layer with its own indexer ('full')")
    if not g["index_kpool_always_select_tail"] and int(g["index_kpool"]) > 1:
        raise ValueError("glm5_next: index_kpool_always_select_tail false is not supported (a query before its first "
                         "complete pool would attend to nothing)")
    if not any(k == "indexed_attention" for k in kinds):
        raise ValueError("glm5_next: no MLA layer (layer_types lists no 'indexed_attention')")




class Norm(nn.Module):
    """Weighted RMS norm, as transformers' ``LlamaRMSNorm``: float32, cast back before the weight."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)


# -- per-sequence state ------------------------------------------------------------------------------------------------
@dataclass
class Glm5NextState:
    """One sequence's state: per MLA layer its latents ``[L, d_c]``, indexer keys and pool gate scores
    ``[L, d_I]``; its linear layers' states in slot 0 of ``states``."""

    states: StateCache
    latents: list[torch.Tensor]
    index_keys: list[torch.Tensor]
    index_gates: list[torch.Tensor]
    length: int = 0

    def copy(self) -> Glm5NextState:
        """A copy that later steps of either leave alone: the linear layers' states copied; the per-token tensors
        shared (a step appends by building new ones, never writing into them)."""
        lin = self.states.layers
        device = lin[0].recurrent.device if lin else "cpu"
        out = Glm5NextState(StateCache(self.states.lin, 1, device), list(self.latents), list(self.index_keys),
                            list(self.index_gates), self.length)
        for dst, src in zip(out.states.layers, lin):
            dst.recurrent.copy_(src.recurrent)
            dst.conv.copy_(src.conv)
        return out

    @staticmethod
    def empty(cfg: Glm5NextConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> Glm5NextState:
        mla = sum(not x for x in cfg.linear)
        blank = [torch.zeros(0, int(cfg.kv_lora_rank), dtype=dtype, device=device) for _ in range(mla)]
        keys = [torch.zeros(0, int(cfg.index_head_dim), dtype=dtype, device=device) for _ in range(2 * mla)]
        return Glm5NextState(StateCache(cfg.linear_attention(), 1, device), blank, keys[:mla], keys[mla:])


# -- attention ---------------------------------------------------------------------------------------------------------
class Glm5NextAttention(nn.Module):
    """MLA without RoPE over the sequence's latents, each query attending to the tokens its selection names."""

    def __init__(self, cfg: Glm5NextConfig, layer: int, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        d, r, c = int(cfg.hidden_size), int(cfg.q_lora_rank), int(cfg.kv_lora_rank)
        self.index, self.heads = index, int(cfg.num_attention_heads)
        self.nope, self.v_dim = int(cfg.qk_nope_head_dim), int(cfg.v_head_dim)
        self.q_a_proj, self.kv_a_proj_with_mqa = frozen_linear(r, d, dtype), frozen_linear(c, d, dtype)
        self.q_a_layernorm, self.kv_a_layernorm = Norm(r, cfg.rms_norm_eps, dtype), Norm(c, cfg.rms_norm_eps, dtype)
        self.q_b_proj = frozen_linear(self.heads * self.nope, r, dtype)
        self.kv_b_proj = frozen_linear(self.heads * (self.nope + self.v_dim), c, dtype)
        self.o_proj = frozen_linear(d, self.heads * self.v_dim, dtype)
        self.indexer = None if cfg.shared[layer] else PooledIndexer(
            d, r, int(cfg.index_n_heads), int(cfg.index_head_dim), int(cfg.index_topk), int(cfg.index_kpool),
            bool(cfg.index_kpool_always_select_tail), dtype)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, st: Glm5NextState, shared: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output ``[T, d]`` and the step's selection ``[T, width]`` (for a ``shared`` layer after it)."""
        t, j = h.shape[0], self.index
        q_resid = self.q_a_layernorm(self.q_a_proj(h))
        q = self.q_b_proj(q_resid).view(t, self.heads, self.nope)
        st.latents[j] = torch.cat([st.latents[j], self.kv_a_layernorm(self.kv_a_proj_with_mqa(h))])
        if self.indexer is not None:
            keys, gates = self.indexer.keys(h)
            st.index_keys[j] = torch.cat([st.index_keys[j], keys])
            st.index_gates[j] = torch.cat([st.index_gates[j], gates])
            selection = self.indexer(h, q_resid, positions, st.index_keys[j], st.index_gates[j])
        else:
            assert shared is not None
            selection = shared
        kv = self.kv_b_proj(st.latents[j]).view(-1, self.heads, self.nope + self.v_dim)
        k, v = kv.split([self.nope, self.v_dim], dim=-1)
        n = st.latents[j].shape[0]
        visible = torch.zeros(t, n + 1, dtype=torch.bool, device=h.device)
        visible.scatter_(1, torch.where(selection >= 0, selection, n), True)  # column n: nothing chosen
        logits = torch.einsum("thd,khd->htk", q, k) * self.nope ** -0.5
        logits = logits.masked_fill(~visible[:, :n].unsqueeze(0), float("-inf"))
        probs = logits.float().softmax(dim=-1).to(q.dtype)
        out = torch.einsum("htk,khd->thd", probs, v).reshape(t, -1)
        return self.o_proj(out), selection


# -- MLP and MoE -------------------------------------------------------------------------------------------------------
class Glm5NextMoE(nn.Module):
    def __init__(self, cfg: Glm5NextConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d, i, limit = int(cfg.hidden_size), int(cfg.moe_intermediate_size), float(cfg.swiglu_limit)
        moe = MoEConfig(n_routed_experts=int(cfg.n_routed_experts), n_shared_experts=int(cfg.n_shared_experts),
                        num_experts_per_tok=int(cfg.num_experts_per_tok), moe_intermediate_size=i,
                        n_group=int(cfg.n_group), topk_group=int(cfg.topk_group), topk_method="noaux_tc",
                        scoring_func="sigmoid", routed_scaling_factor=float(cfg.routed_scaling_factor),
                        norm_topk_prob=bool(cfg.norm_topk_prob))
        self.gate = Router(moe, d)
        self.experts = PackedExperts(moe.n_routed_experts, d, i, limit, dtype)
        self.shared_experts = ClampedMLP(d, i * moe.n_shared_experts, limit, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        return self.experts(x, weights, experts) + self.shared_experts(x)


# -- the model ---------------------------------------------------------------------------------------------------------
class Glm5NextDecoderLayer(nn.Module):
    def __init__(self, cfg: Glm5NextConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        d, eps, n = int(cfg.hidden_size), float(cfg.rms_norm_eps), int(cfg.hc_mult)
        self.linear = cfg.linear[layer]
        self.index = index = sum(cfg.linear[i] == self.linear for i in range(layer))
        kda_cfg = SimpleNamespace(linear_attention=cfg.linear_attention(), hidden_size=d, rms_norm_eps=eps)
        self.self_attn: nn.Module = (KimiDeltaAttention(cast(Any, kda_cfg), dtype, index) if self.linear
                                     else Glm5NextAttention(cfg, layer, index, dtype))
        self.mlp: nn.Module = (Glm5NextMoE(cfg, dtype) if cfg.moe[layer] else
                               ClampedMLP(d, int(cfg.intermediate_size), float(cfg.swiglu_limit), dtype))
        self.input_layernorm, self.post_attention_layernorm = Norm(d, eps, dtype), Norm(d, eps, dtype)
        self.attn_hc = HyperConnection(n, d, int(cfg.hc_sinkhorn_iters), float(cfg.hc_eps), eps)
        self.ffn_hc = HyperConnection(n, d, int(cfg.hc_sinkhorn_iters), float(cfg.hc_eps), eps)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, st: Glm5NextState,
                selection: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The streams ``[T, N, d]`` after the layer, and its selection (None: a linear layer)."""
        post, comb, x = self.attn_hc(streams)
        h = self.input_layernorm(x)
        if self.linear:
            start, t = int(positions[0]), h.shape[0]
            blocks = list(range((start + t + 15) // 16))
            batch = ForwardBatch.build([[0] * t], [start], [blocks], 16, device=h.device, state_slots=[0])
            out, selection = self.self_attn(h, batch, st.states.layers[self.index]), None
        else:
            out, selection = self.self_attn(h, positions, st, selection)
        streams = HyperConnection.merge(streams, out, post, comb)
        post, comb, x = self.ffn_hc(streams)
        return HyperConnection.merge(streams, self.mlp(self.post_attention_layernorm(x)), post, comb), selection


class Glm5NextModel(nn.Module):
    def __init__(self, cfg: Glm5NextConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d = int(cfg.hidden_size)
        self.embed_tokens = nn.Embedding(int(cfg.vocab_size), d, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Glm5NextDecoderLayer(cfg, i, dtype) for i in range(len(cfg.linear)))
        self.norm = Norm(d, float(cfg.rms_norm_eps), dtype)


class Glm5NextForCausalLM(nn.Module):
    """The text model. Parameter names are transformers' text model's (``model.layers...``, ``lm_head``);
    ``load_state_dict_hf`` also reads the multimodal wrapper's (``model.language_model...``)."""

    def __init__(self, cfg: Glm5NextConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.model = Glm5NextModel(cfg, dtype)
        self.lm_head = frozen_linear(int(cfg.vocab_size), int(cfg.hidden_size), dtype)

    def new_state(self) -> Glm5NextState:
        return Glm5NextState.empty(self.config, self.dtype, self.lm_head.weight.device)

    def check_text_only(self, ids: list[int]) -> None:
        """Refuse image and video placeholder tokens: the vision tower is not served."""
        media = sorted(set(ids) & self.config.media_tokens)
        if media:
            raise ValueError(f"glm5_next: the prompt holds image/video placeholder tokens {media}; only the text "
                             f"model is served (images and videos are not supported)")

    @torch.no_grad()
    def hidden(self, ids: list[int], st: Glm5NextState) -> torch.Tensor:
        """The hidden states ``[T, d]`` (after the final norm) of the sequence's next tokens ``ids``; ``st``
        advances by them."""
        self.check_text_only(ids)
        if not ids:
            raise ValueError("glm5_next: a step needs at least one token")
        device = self.lm_head.weight.device
        positions = torch.arange(st.length, st.length + len(ids), device=device)
        x = self.model.embed_tokens(torch.tensor(ids, device=device))
        streams = x.unsqueeze(1).expand(-1, int(self.config.hc_mult), -1).contiguous()
        selection: torch.Tensor | None = None
        for layer in self.model.layers:
            streams, selection = layer(streams, positions, st, selection)
        st.length += len(ids)
        return cast(torch.Tensor, self.model.norm(streams.mean(dim=1)))

    def forward(self, ids: list[int], st: Glm5NextState) -> torch.Tensor:
        """The logits ``[T, vocab]`` float32 of the sequence's next tokens ``ids``; ``st`` advances by them."""
        return self.compute_logits(self.hidden(ids, st))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.weight).float()

    def forward_batch(self, batch: ForwardBatch, states: Glm5NextStateCache) -> torch.Tensor:
        """Hidden states ``[T, d]`` of an engine step, each sequence over its own slot's state
        (``Glm5NextStateCache.run_batch``)."""
        return states.run_batch(batch, self.hidden)

    def load_state_dict_hf(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load a checkpoint's tensors (transformers' saved layout or its in-memory names, of the text model or the
        multimodal wrapper); the vision tower's are not read."""
        mine = pack_experts(_join_convs({n: t for name, t in tensors.items()
                                          if (n := stored_name(name)) is not None}))
        if self.config.tie_word_embeddings and "lm_head.weight" not in mine and "model.embed_tokens.weight" in mine:
            mine["lm_head.weight"] = mine["model.embed_tokens.weight"]
        own = self.state_dict()
        missing, unknown = sorted(set(own) - set(mine)), sorted(set(mine) - set(own))
        bad = [k for k in set(own) & set(mine) if own[k].shape != mine[k].shape]
        if missing or unknown or bad:
            raise ValueError(f"glm5_next: not the checkpoint this config describes: missing {missing[:5]}, "
                             f"unexpected {unknown[:5]}, shapes differ {bad[:5]}")
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in mine.items()})


# -- the engine's slots and loading ------------------------------------------------------------------------------------
class Glm5NextStateCache:
    """The running sequences' states, one per slot of the engine's state slots; a sequence's first step (no cached
    tokens) starts its slot afresh (``model.new_state()``), whatever the slot held. Any model of its own whose
    per-sequence state has ``length`` and ``copy()`` runs its steps over it (GLM-5-Next, Hunyuan V4)."""

    def __init__(self, model: Any, num_slots: int, num_snapshots: int = 0) -> None:
        if num_slots < 1 or num_snapshots < 0:
            raise ValueError(f"num_slots must be >= 1 and num_snapshots >= 0, got {num_slots}, {num_snapshots}")
        self.model = model
        self.slots: list[Any] = [None] * num_slots
        self.snapshots: list[Any] = [None] * num_snapshots  # the prefix cache's, by id

    def state(self, slot: int, context_len: int) -> Any:
        if not 0 <= slot < len(self.slots):
            raise ValueError(f"state slot {slot} is out of range (0..{len(self.slots) - 1})")
        if context_len == 0:
            self.slots[slot] = self.model.new_state()
        st = self.slots[slot]
        if st is None or st.length != context_len:
            raise RuntimeError(f"state slot {slot} holds {0 if st is None else st.length} tokens; the step continues "
                               f"after {context_len}")
        return st

    def release(self, slot: int) -> None:
        self.slots[slot] = None

    def run_batch(self, batch: ForwardBatch, hidden: Callable[[list[int], Any], torch.Tensor]) -> torch.Tensor:
        """Hidden states ``[T, d]`` of an engine step (any mix of prompts, chunks and decodes, each sequence with its
        state slot): ``hidden(ids, state)`` over each sequence's slot, its snapshots (``batch.state_snapshots``: after
        its first ``n`` new tokens, into snapshot ``s``) taken on the way."""
        if batch.state_slots is None:
            raise ValueError("a step of a model of its own needs each sequence's state slot (ForwardBatch.state_slots)")
        starts, ids = batch.query_start_loc.tolist(), batch.input_ids.tolist()
        outs = []
        for b, (q, ctx, slot) in enumerate(zip(batch.query_lens, batch.context_lens_list, batch.state_slots)):
            st, done = self.state(slot, ctx), 0
            for n, s in sorted((n, s) for sb, n, s in batch.state_snapshots if sb == b):
                if n > done:
                    outs.append(hidden(ids[starts[b] + done:starts[b] + n], st))
                    done = n
                self.snapshots[s] = st.copy()
            if done < q:
                outs.append(hidden(ids[starts[b] + done:starts[b] + q], st))
        return torch.cat(outs)

    def restore(self, snapshot: int, slot: int) -> None:
        """Slot ``slot`` resumes from snapshot ``snapshot`` (a prefix hit): a copy of its state."""
        st = self.snapshots[snapshot]
        if st is None:
            raise RuntimeError(f"state snapshot {snapshot} was never taken")
        self.slots[slot] = st.copy()

    def drop(self, snapshot: int) -> None:
        """Drop snapshot ``snapshot``'s state (the scheduler freed it): its rows go now, not when it is next taken."""
        self.snapshots[snapshot] = None


_HC = {"hc_attn_": "attn_hc.", "hc_ffn_": "ffn_hc."}


def stored_name(name: str) -> str | None:
    """A checkpoint tensor's name -> the model's (None: the vision tower's, not read). The multimodal wrapper's
    ``model.language_model.`` is the text model's ``model.``; transformers saves the hyper-connections as
    ``hc_attn_fn`` (``attn_hc.fn``), the forget gate's tensors beside the projections (Kimi Linear's layout)."""
    if name.startswith(("model.visual.", "visual.")):
        return None
    name = name.replace("model.language_model.", "model.")
    if not name.startswith(("model.", "lm_head.")):
        name = "model." + name
    for old, new in _HC.items():
        name = name.replace(f".{old}", f".{new}")
    return _kimi_linear_name(name)


def _join_convs(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The saved ``q_conv1d``/``k_conv1d``/``v_conv1d`` taps -> one ``conv1d`` over ``[q ; k ; v]``."""
    out = {k: v for k, v in tensors.items() if not k.endswith(("q_conv1d.weight", "k_conv1d.weight",
                                                               "v_conv1d.weight"))}
    for name in tensors:
        if name.endswith(".q_conv1d.weight"):
            head = name[:-len("q_conv1d.weight")]
            out[head + "conv1d.weight"] = torch.cat([tensors[f"{head}{p}_conv1d.weight"] for p in "qkv"])
    return out


def load_glm5_next(path: str | Path, dtype: torch.dtype = torch.float32) -> Glm5NextForCausalLM:
    """A ``glm5_next`` (or ``glm5_next_text``) checkpoint: ``config.json`` and ``*.safetensors``, float tensors."""
    _, raw, tensors = read_checkpoint(path, MODEL_TYPES)
    model = Glm5NextForCausalLM(Glm5NextConfig.from_raw(raw), dtype)
    model.load_state_dict_hf(tensors)
    return model.eval()
