"""Hunyuan V4 (``hy_v4``) in torch: one sequence at a time, over its state.

Its attention is DeepSeek-V3.2's MLA with DSA (``q_lora_rank``, the normed ``d_c`` latent and a ``d_r`` RoPE key per
token, RoPE on halves as GLM-5's), plus three things of its own:

- a **learnable sink** per head: one more logit in each query's softmax, whose weight is dropped;
- an **output gate**: each head's output times ``sigmoid(gate_proj(h))`` before ``o_proj``;
- **shared selections**: a layer whose ``indexer_types`` entry is ``shared`` has no indexer and reuses the top-k of the
  last layer that has one (``full``). The indexer is V3.2's lightning indexer with RoPE on the *last* ``d_r`` dims of
  its ``index_head_dim``, its key LayerNorm and head weights in float32; each query keeps the ``index_topk`` keys of
  highest score (exact ties lowest position first).

The residual is ``hc_mult`` streams (``layers/hyper.py``'s ``IndependentHyperConnection``: no stream mix), collapsed
by ``HyperHead`` before the final norm; the lm_head runs in float32. Per layer the MLP is dense or MoE
(``mlp_layer_types``): plain SwiGLU dense MLPs and shared experts, routed experts (stored packed) clamped at
``swiglu_limit``, DeepSeek-V3's sigmoid router with its correction bias. The checkpoint's MTP layers are not read.

``HyV4State`` is what one sequence keeps between steps: per layer its ``[L, d_c + d_r]`` latents (normed, rotated)
and, per ``full`` layer, its indexer's ``[L, index_head_dim]`` keys. A step may hold any number of the sequence's
tokens (a prompt, a chunk of one, a decode); the engine's slots are ``Glm5NextStateCache``'s.

Under tensor parallelism (``par``) each rank holds its shard (``v4_shards.HY_V4_SPLITS``: its heads, routed experts,
slices of the MLPs and of the vocabulary) and reads only it from the files; the latent projections, the indexer and
the hyper-connections are whole on every rank, so every rank keeps the same state. The attention's and the MLP's
partial outputs are summed over the ranks (one all-reduce each), the logits gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mla_kernels import topk_lowest_first
from mla_runtime.config import MoEConfig
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.layers.embedding import VocabEmbedding
from mla_runtime.layers.hyper import ClampedMLP, HyperHead, IndependentHyperConnection, PackedExperts, frozen_linear
from mla_runtime.layers.moe import Router
from mla_runtime.models.glm5_next import Glm5NextStateCache, Norm
from mla_runtime.models.own_checkpoint import read_checkpoint
from mla_runtime.models.v4_shards import HY_V4_SPLITS, check_parallel, read_shard
from mla_runtime.parallel import SINGLE_RANK, ParallelContext

_DEFAULTS: dict[str, Any] = dict(
    vocab_size=120832, hidden_size=2816, intermediate_size=6912, moe_intermediate_size=768, num_hidden_layers=34,
    num_attention_heads=32, rms_norm_eps=1e-5, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
    routed_scaling_factor=2.827, norm_topk_prob=True, n_group=1, topk_group=1, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_topk=2048, index_head_dim=128, index_n_heads=16,
    hc_mult=4, hc_magnitude=2.0, hc_eps=1e-6, swiglu_limit=10.0, hidden_act="silu", tie_word_embeddings=False,
    attention_bias=False, max_position_embeddings=262144)


@dataclass(frozen=True)
class HyV4Config:
    """The model's settings (transformers' ``HYV4Config`` defaults where ``config.json`` is silent)."""

    g: dict[str, Any]
    moe: tuple[bool, ...]
    shared: tuple[bool, ...]
    rope_theta: float

    @staticmethod
    def from_raw(raw: dict[str, Any]) -> HyV4Config:
        g = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
        n = int(g["num_hidden_layers"])
        kinds = g.get("layer_types") or ["indexed_attention"] * n
        mlp = g.get("mlp_layer_types") or ["dense"] * min(1, n) + ["sparse"] * max(n - 1, 0)
        indexers = g.get("indexer_types") or ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(n)]
        _check(g, n, kinds, mlp, indexers)
        rope = g.get("rope_parameters") or g.get("rope_scaling") or {}
        return HyV4Config(g, tuple(m == "sparse" for m in mlp), tuple(s == "shared" for s in indexers),
                          float(rope.get("rope_theta", g.get("rope_theta", 10000.0))))

    def __getattr__(self, name: str) -> Any:
        try:
            return self.g[name]
        except KeyError:
            raise AttributeError(name) from None


def _check(g: dict[str, Any], n: int, kinds: list[str], mlp: list[str], indexers: list[str]) -> None:
    """Refuse, by name, what transformers' model would not run or this one does not."""
    for name, values, allowed in (("layer_types", kinds, {"indexed_attention"}),
                                  ("mlp_layer_types", mlp, {"dense", "sparse"}),
                                  ("indexer_types", indexers, {"full", "shared"})):
        if len(values) != n or set(values) - allowed:
            raise ValueError(f"hy_v4: {name} must list {n} layers, each one of {sorted(allowed)}: got {values}")
    if indexers and indexers[0] != "full":
        raise ValueError("hy_v4: layer 0 shares a previous layer's indexer selection (indexer_types 'shared'), but "
                         "no layer before it has an indexer")
    rope = g.get("rope_parameters") or g.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"hy_v4: rope_type {rope.get('rope_type', rope.get('type'))!r} is not supported (default)")
    if g.get("q_lora_rank") is None:
        raise ValueError("hy_v4: q_lora_rank is required (the indexer reads the query's low-rank q_resid)")
    if g["hidden_act"] != "silu" or g["attention_bias"]:
        raise ValueError(f"hy_v4: hidden_act {g['hidden_act']!r} and attention_bias {g['attention_bias']!r} are not "
                         f"supported (silu, no attention biases)")
    if float(g["swiglu_limit"]) <= 0:
        raise ValueError(f"hy_v4: swiglu_limit {g['swiglu_limit']} is not supported (a positive clamp)")
    if int(g["index_head_dim"]) < int(g["qk_rope_head_dim"]):
        raise ValueError(f"hy_v4: index_head_dim ({g['index_head_dim']}) is narrower than qk_rope_head_dim "
                         f"({g['qk_rope_head_dim']})")


# -- per-sequence state ------------------------------------------------------------------------------------------------
@dataclass
class HyV4State:
    """One sequence's state: per layer its latents ``[L, d_c + d_r]``, per ``full`` layer its indexer keys."""

    latents: list[torch.Tensor]
    index_keys: list[torch.Tensor]
    length: int = 0

    def copy(self) -> HyV4State:
        """A copy that later steps of either leave alone (a step appends by building new tensors)."""
        return HyV4State(list(self.latents), list(self.index_keys), self.length)

    @staticmethod
    def empty(cfg: HyV4Config, dtype: torch.dtype, device: torch.device | str = "cpu") -> HyV4State:
        width = int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim)
        return HyV4State([torch.zeros(0, width, dtype=dtype, device=device) for _ in cfg.moe],
                         [torch.zeros(0, int(cfg.index_head_dim), dtype=dtype, device=device) for _ in cfg.moe])


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, dim: int) -> torch.Tensor:
    """RoPE on halves (``rotate_half``) of the last ``dim`` channels of ``x [T, ..., D]``; cos and sin rounded to
    ``x``'s dtype as transformers' tables are."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (dim,)
    cos, sin = emb.cos().to(x.dtype).view(shape), emb.sin().to(x.dtype).view(shape)
    rot = x[..., -dim:]
    half = torch.cat([-rot[..., dim // 2:], rot[..., :dim // 2]], dim=-1)
    return torch.cat([x[..., :-dim], rot * cos + half * sin], dim=-1)


# -- attention ---------------------------------------------------------------------------------------------------------
class HyV4Indexer(nn.Module):
    """The lightning indexer of a ``full`` layer (the module docstring): its keys, then each query's top-k."""

    def __init__(self, cfg: HyV4Config, dtype: torch.dtype) -> None:
        super().__init__()
        d, r = int(cfg.hidden_size), int(cfg.q_lora_rank)
        self.n_heads, self.head_dim, self.topk = int(cfg.index_n_heads), int(cfg.index_head_dim), int(cfg.index_topk)
        self.rope, self.theta = int(cfg.qk_rope_head_dim), cfg.rope_theta
        self.wq_b = frozen_linear(self.n_heads * self.head_dim, r, dtype)
        self.wk = frozen_linear(self.head_dim, d, dtype)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=float(cfg.rms_norm_eps), dtype=torch.float32)
        self.k_norm.requires_grad_(False)
        self.weights_proj = frozen_linear(self.n_heads, d, torch.float32)

    def keys(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        k = self.k_norm(self.wk(h).float()).to(h.dtype)
        return rotate(k.unsqueeze(1), positions, self.theta, self.rope).squeeze(1)

    def forward(self, h: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor
                ) -> torch.Tensor:
        """The chosen positions ``[T, min(topk, n)]`` among the sequence's ``n`` keys (future ones score -inf)."""
        t = h.shape[0]
        q = rotate(self.wq_b(q_resid).view(t, self.n_heads, self.head_dim), positions, self.theta, self.rope)
        scores = F.relu(torch.einsum("thd,nd->thn", q.float(), keys.float()))
        w = self.weights_proj(h.float()) * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        index = torch.einsum("th,thn->tn", w, scores)
        future = torch.arange(keys.shape[0], device=h.device)[None, :] > positions[:, None]
        return topk_lowest_first(index.masked_fill(future, float("-inf")), min(self.topk, keys.shape[0]))


class HyV4Attention(nn.Module):
    """MLA over the sequence's latents, each query attending to its selection, with sinks and an output gate; under
    tensor parallelism this rank's heads (its output a part of the sum over the ranks)."""

    def __init__(self, cfg: HyV4Config, layer: int, dtype: torch.dtype, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        d, r, c = int(cfg.hidden_size), int(cfg.q_lora_rank), int(cfg.kv_lora_rank)
        heads = int(cfg.num_attention_heads) // par.world_size
        self.layer, self.heads, self.c, self.theta = layer, heads, c, cfg.rope_theta
        self.nope, self.rope, self.v_dim = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
        self.q_a_proj, self.kv_a_proj_with_mqa = frozen_linear(r, d, dtype), frozen_linear(c + self.rope, d, dtype)
        self.q_a_layernorm, self.kv_a_layernorm = Norm(r, cfg.rms_norm_eps, dtype), Norm(c, cfg.rms_norm_eps, dtype)
        self.q_b_proj = frozen_linear(self.heads * (self.nope + self.rope), r, dtype)
        self.kv_b_proj = frozen_linear(self.heads * (self.nope + self.v_dim), c, dtype)
        self.o_proj = frozen_linear(d, self.heads * self.v_dim, dtype)
        self.gate_proj = frozen_linear(self.heads * self.v_dim, d, dtype)
        self.sinks = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32), requires_grad=False)
        self.indexer = None if cfg.shared[layer] else HyV4Indexer(cfg, dtype)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, st: HyV4State, shared: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output ``[T, d]`` and the step's selection (for the ``shared`` layers after it)."""
        t, j = h.shape[0], self.layer
        q_resid = self.q_a_layernorm(self.q_a_proj(h))
        q = rotate(self.q_b_proj(q_resid).view(t, self.heads, -1), positions, self.theta, self.rope)
        latent, k_pe = self.kv_a_proj_with_mqa(h).split([self.c, self.rope], dim=-1)
        k_pe = rotate(k_pe.unsqueeze(1), positions, self.theta, self.rope).squeeze(1)
        st.latents[j] = torch.cat([st.latents[j], torch.cat([self.kv_a_layernorm(latent), k_pe], dim=-1)])
        if self.indexer is not None:
            st.index_keys[j] = torch.cat([st.index_keys[j], self.indexer.keys(h, positions)])
            selection = self.indexer(h, q_resid, positions, st.index_keys[j])
        else:
            assert shared is not None
            selection = shared
        n = st.latents[j].shape[0]
        kv = self.kv_b_proj(st.latents[j][:, :self.c]).view(n, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        keys = torch.cat([k_nope, st.latents[j][:, None, self.c:].expand(-1, self.heads, -1)], dim=-1)
        visible = torch.zeros(t, n, dtype=torch.bool, device=h.device).scatter_(1, selection, True)
        visible &= torch.arange(n, device=h.device)[None, :] <= positions[:, None]
        logits = torch.einsum("thd,khd->htk", q, keys) * (self.nope + self.rope) ** -0.5
        logits = logits.masked_fill(~visible.unsqueeze(0), float("-inf"))
        both = torch.cat([logits.float(), self.sinks.view(-1, 1, 1).expand(-1, t, 1)], dim=-1)  # float32
        probs = (both - both.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
        out = torch.einsum("htk,khd->thd", probs.to(v.dtype), v)
        gate = torch.sigmoid(self.gate_proj(h).view(t, self.heads, self.v_dim))
        return self.o_proj((out * gate).reshape(t, -1)), selection


# -- MoE and the model -------------------------------------------------------------------------------------------------
class HyV4MoE(nn.Module):
    """The router (whole), this rank's routed experts (whole) and its slice of the shared experts: a part of the sum
    over the ranks."""

    def __init__(self, cfg: HyV4Config, dtype: torch.dtype, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        d, i = int(cfg.hidden_size), int(cfg.moe_intermediate_size)
        moe = MoEConfig(n_routed_experts=int(cfg.n_routed_experts), n_shared_experts=int(cfg.n_shared_experts),
                        num_experts_per_tok=int(cfg.num_experts_per_tok), moe_intermediate_size=i,
                        n_group=int(cfg.n_group), topk_group=int(cfg.topk_group), topk_method="noaux_tc",
                        scoring_func="sigmoid", routed_scaling_factor=float(cfg.routed_scaling_factor),
                        norm_topk_prob=bool(cfg.norm_topk_prob))
        n = par.world_size
        self.gate = Router(moe, d)
        self.experts = PackedExperts(moe.n_routed_experts // n, d, i, float(cfg.swiglu_limit), dtype,
                                     first=par.split(moe.n_routed_experts)[0])
        self.shared_experts = ClampedMLP(d, i * moe.n_shared_experts // n, float("inf"), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        return self.experts(x, weights, experts) + self.shared_experts(x)


class HyV4DecoderLayer(nn.Module):
    def __init__(self, cfg: HyV4Config, layer: int, dtype: torch.dtype, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        d, eps, n = int(cfg.hidden_size), float(cfg.rms_norm_eps), int(cfg.hc_mult)
        self.par = par
        self.self_attn = HyV4Attention(cfg, layer, dtype, par)
        self.mlp: nn.Module = (HyV4MoE(cfg, dtype, par) if cfg.moe[layer] else
                               ClampedMLP(d, int(cfg.intermediate_size) // par.world_size, float("inf"), dtype))
        self.input_layernorm, self.post_attention_layernorm = Norm(d, eps, dtype), Norm(d, eps, dtype)
        self.attn_hc = IndependentHyperConnection(n, d, float(cfg.hc_magnitude), float(cfg.hc_eps), eps)
        self.ffn_hc = IndependentHyperConnection(n, d, float(cfg.hc_magnitude), float(cfg.hc_eps), eps)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, st: HyV4State, selection: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        post, x = self.attn_hc(streams)
        out, selection = self.self_attn(self.input_layernorm(x), positions, st, selection)
        streams = IndependentHyperConnection.merge(streams, self.par.all_reduce(out), post)
        post, x = self.ffn_hc(streams)
        out = self.par.all_reduce(self.mlp(self.post_attention_layernorm(x)))
        return IndependentHyperConnection.merge(streams, out, post), selection


class HyV4Model(nn.Module):
    def __init__(self, cfg: HyV4Config, dtype: torch.dtype, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        d, eps = int(cfg.hidden_size), float(cfg.rms_norm_eps)
        self.embed_tokens = VocabEmbedding(int(cfg.vocab_size), d, dtype, par)
        self.layers = nn.ModuleList(HyV4DecoderLayer(cfg, i, dtype, par) for i in range(len(cfg.moe)))
        self.norm = Norm(d, eps, dtype)
        self.hc_head = HyperHead(int(cfg.hc_mult), d, float(cfg.hc_eps), eps)


class HyV4ForCausalLM(nn.Module):
    """The model; parameter names are transformers' in-memory ones (``load_state_dict_hf`` reads the saved layout).
    Under tensor parallelism (``par``) this rank's shard (the module docstring)."""

    def __init__(self, cfg: HyV4Config, dtype: torch.dtype = torch.float32, par: ParallelContext = SINGLE_RANK
                 ) -> None:
        super().__init__()
        check_hy_v4_parallel(cfg, par.world_size)
        self.config, self.dtype, self.par = cfg, dtype, par
        self.model = HyV4Model(cfg, dtype, par)
        rows = par.vocab_split(int(cfg.vocab_size))[2]
        self.lm_head = frozen_linear(rows, int(cfg.hidden_size), torch.float32)

    def new_state(self) -> HyV4State:
        return HyV4State.empty(self.config, self.dtype, self.lm_head.weight.device)

    @torch.no_grad()
    def hidden(self, ids: list[int], st: HyV4State) -> torch.Tensor:
        """The hidden states ``[T, d]`` (after the final norm) of the sequence's next tokens ``ids``; ``st``
        advances by them."""
        if not ids:
            raise ValueError("hy_v4: a step needs at least one token")
        device = self.lm_head.weight.device
        positions = torch.arange(st.length, st.length + len(ids), device=device)
        x = self.model.embed_tokens(torch.tensor(ids, device=device))
        streams = x.unsqueeze(1).expand(-1, int(self.config.hc_mult), -1).contiguous()
        selection: torch.Tensor | None = None
        for layer in self.model.layers:
            streams, selection = layer(streams, positions, st, selection)
        st.length += len(ids)
        return cast(torch.Tensor, self.model.norm(self.model.hc_head(streams)))

    def forward(self, ids: list[int], st: HyV4State) -> torch.Tensor:
        """The logits ``[T, vocab]`` float32 of the sequence's next tokens ``ids``; ``st`` advances by them."""
        return self.compute_logits(self.hidden(ids, st))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[R, V]`` (under tensor parallelism every rank's vocabulary rows, gathered)."""
        logits = F.linear(hidden.float(), self.lm_head.weight.float())
        if not self.par.enabled:
            return logits
        return self.par.all_gather(logits, dim=-1)[:, :int(self.config.vocab_size)]

    def forward_batch(self, batch: ForwardBatch, states: Glm5NextStateCache) -> torch.Tensor:
        """Hidden states ``[T, d]`` of an engine step, each sequence over its own slot's state."""
        return states.run_batch(batch, self.hidden)

    def load_state_dict_hf(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load a checkpoint's tensors (transformers' saved layout or its in-memory names); MTP layers not read."""
        mine = {n: t for name, t in tensors.items() if (n := stored_name(name)) is not None}
        if self.config.tie_word_embeddings and "lm_head.weight" not in mine and "model.embed_tokens.weight" in mine:
            mine["lm_head.weight"] = mine["model.embed_tokens.weight"]
        own = self.state_dict()
        missing, unknown = sorted(set(own) - set(mine)), sorted(set(mine) - set(own))
        bad = [k for k in set(own) & set(mine) if own[k].shape != mine[k].shape]
        if missing or unknown or bad:
            raise ValueError(f"hy_v4: not the checkpoint this config describes: missing {missing[:5]}, "
                             f"unexpected {unknown[:5]}, shapes differ {bad[:5]}")
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in mine.items()})


_RENAMES = ((".hc_pre.hc_", ".hc_"), (".learnable_sink_param", ".sinks"), (".linear_gate", ".gate_proj"),
            (".hc_attn_layer.hc_", ".attn_hc."), (".hc_mlp_layer.hc_", ".ffn_hc."), (".hc_head_", ".hc_"))


def stored_name(name: str) -> str | None:
    """A checkpoint tensor's name -> the model's (None: an MTP layer's, not read), as transformers renames them."""
    if ".mtp_layers." in name or name.startswith("mtp"):
        return None
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


def check_hy_v4_parallel(cfg: HyV4Config, world: int) -> None:
    """Refuse, saying what to change, a ``tensor_parallel_size`` that does not split ``cfg``'s heads, experts and
    MLPs."""
    sizes = {"num_attention_heads": int(cfg.num_attention_heads), "n_routed_experts": int(cfg.n_routed_experts),
             "moe_intermediate_size x n_shared_experts": int(cfg.moe_intermediate_size) * int(cfg.n_shared_experts),
             "intermediate_size": int(cfg.intermediate_size)}
    if all(cfg.moe):
        del sizes["intermediate_size"]  # no dense MLP
    if not any(cfg.moe):
        del sizes["n_routed_experts"], sizes["moe_intermediate_size x n_shared_experts"]
    check_parallel("hy_v4", sizes, world)


def load_hy_v4(path: str | Path, dtype: torch.dtype = torch.float32, par: ParallelContext = SINGLE_RANK
               ) -> HyV4ForCausalLM:
    """A ``hy_v4`` checkpoint: ``config.json`` and ``*.safetensors``, float tensors; under tensor parallelism
    (``par``) this rank's shard, the only part of the files it reads."""
    _, raw, _ = read_checkpoint(path, ("hy_v4",), keep=lambda _: False)  # the config
    cfg = HyV4Config.from_raw(raw)
    model = HyV4ForCausalLM(cfg, dtype, par)
    model.load_state_dict_hf(read_shard(path, ("hy_v4",), cfg, par, HY_V4_SPLITS, stored_name))
    return model.eval()
