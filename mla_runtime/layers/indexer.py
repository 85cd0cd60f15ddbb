"""DeepSeek Sparse Attention's lightning indexer: which earlier tokens each query attends to.

Per layer, beside MLA's projections (``d_I = head_dim``, ``n_I = n_heads``, ``d_r = qk_rope_head_dim``)::

    q_I = wq_b(q_resid)            [T, n_I, d_I]   from the query's low-rank, normed q_resid
    k_I = LayerNorm(wk(h))         [T, d_I]        one key per token, cached beside the latent (same slot)
    w   = weights_proj(h) n_I^-1/2 d_I^-1/2        [T, n_I]
    RoPE on the first d_r dims of q_I and k_I (halves: DeepSeek-V3.2; interleaved pairs: GLM-5)
    score[t, j] = sum_h w[t, h] relu(q_I[t, h] . k_I[j])      for the keys j that token t sees (causal)

Mistral Large 4 (``IndexerConfig.query_source`` ``"hidden"``: its attention has no Q-LoRA) takes the queries from the
hidden state, ``q_I = wq_b(LayerNorm(h))`` (``q_input_norm``, with a bias), and scales each head's by
``scale_h ln(1 + p) + bias_h`` before RoPE (``query_log_scaling``; a per-head factor of a token commutes with the
rotation, but not with the relu when it is negative: it is applied to ``q_I``, not folded into ``w``). Its NoPE layers
(``ModelConfig.rope_layers``) rotate neither queries nor keys.

Each query keeps the ``topk`` keys of highest score (the backend's ``select``: ``mla_kernels.indexer_topk``) and
attends only to those;
while a query sees at most ``topk`` keys it attends to all of them, and when no query of a step sees more, the step
skips the scoring and runs dense attention: exactly the reference's result, at the dense kernels' speed.
The scale ``d_I^-1/2`` of the reference's ``relu(d_I^-1/2 q.k)`` is folded into ``w`` (relu commutes with a
positive factor).

Under tensor parallelism the indexer's weights are replicated: each rank computes every indexer head. With the
replicated latent cache every rank holds every indexer key and selects the same tokens with no exchange. With the
sharded latent cache a rank keeps the indexer keys of its own tokens only, beside their latents: replicated, they
would cost each rank 132 B per token per layer at DeepSeek-V3.2's fp8 widths, beside its 73 B share of the latent on
8 ranks (2.3 times the cache per rank). Each rank scores its own tokens and the ranks' candidates are merged into the
global top-k (``attention/sharded.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from mla_kernels import store_index_keys
from mla_runtime.attention.metadata import AttentionMetadata
from mla_runtime.cache.latent_cache import LayerCache
from mla_runtime.layers.linear import Linear
from mla_runtime.resolved_config import ResolvedConfig

if TYPE_CHECKING:
    from mla_runtime.layers.mla import MLAttention

INDEXER_NORM_EPS = 1e-6  # the eps of the reference's key LayerNorm, whatever the model's norms use


class LogPositionScaling(nn.Module):
    """Mistral Large 4's per-head query scaling: head ``i``'s query at position ``p`` times
    ``scale_i ln(1 + p) + bias_i`` (``scale``, ``bias``: ``[heads]``, learned; the checkpoint's ``softmax_scaling``).
    Computed in the queries' dtype, as the reference does."""

    def __init__(self, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(heads, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.ones(heads, dtype=dtype), requires_grad=False)

    def forward(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``q [T, heads, ...]`` (or ``[T, heads * width]``) scaled per token and head."""
        log_pos = torch.log((positions[: q.shape[0]] + 1).to(torch.float32)).to(q.dtype)
        factor = self.scale.to(q.dtype)[None, :] * log_pos[:, None] + self.bias.to(q.dtype)[None, :]  # [T, heads]
        heads = self.scale.shape[0]
        return (q.view(q.shape[0], heads, -1) * factor.unsqueeze(-1)).view(q.shape)


def log_position_scaled(q: torch.Tensor, positions: torch.Tensor, scaling: LogPositionScaling | None
                        ) -> torch.Tensor:
    """``q`` through ``scaling`` (None: as it is)."""
    return q if scaling is None else scaling(q, positions)


class Indexer(nn.Module):
    def __init__(self, rc: ResolvedConfig, layer: int = 0) -> None:
        super().__init__()
        cfg, dtype = rc.model, rc.dtype
        idx = cfg.indexer
        assert idx is not None
        self.n_heads, self.head_dim, self.topk = idx.n_heads, idx.head_dim, idx.topk
        self.d_r, self.interleave = cfg.qk_rope_head_dim, idx.rope_interleave
        self.rope = cfg.uses_rope(layer)  # a NoPE layer's indexer rotates nothing
        self.q_input_norm: nn.LayerNorm | None = None  # query_source "hidden": LayerNorm of h before wq_b
        if idx.query_source == "hidden":
            self.q_input_norm = nn.LayerNorm(cfg.hidden_size, eps=INDEXER_NORM_EPS, dtype=dtype)
            self.q_input_norm.requires_grad_(False)
        else:
            assert cfg.q_lora_rank is not None
        q_in = cfg.hidden_size if self.q_input_norm is not None else cast(int, cfg.q_lora_rank)
        self.softmax_scaling = LogPositionScaling(self.n_heads, dtype) if idx.query_log_scaling else None
        self.wq_b = Linear(q_in, self.n_heads * self.head_dim, dtype)
        self.wk = Linear(cfg.hidden_size, self.head_dim, dtype)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS, dtype=dtype)
        self.k_norm.requires_grad_(False)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, dtype)
        self.weight_scale = (self.n_heads * self.head_dim) ** -0.5

    @classmethod
    def of_layer(cls, rc: ResolvedConfig, layer: int) -> tuple[Indexer | None, bool]:
        """``layer``'s indexer (None: the model has no sparse attention, or the layer shares its previous layer's
        selection) and whether it shares that selection."""
        idx = rc.model.indexer
        if idx is None:
            return None, False
        return (None, True) if idx.is_shared(layer) else (cls(rc, layer), False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first ``d_r`` dims of ``x [T, ..., d_I]`` (the rest pass through). An interleaved layout's
        rotated dims come out de-interleaved, in queries and keys alike: their dot products are unchanged. A NoPE
        layer's ``x`` as it is."""
        if not self.rope:
            return x
        rot, rest = x[..., :self.d_r], x[..., self.d_r:]
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
        if self.interleave:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = rot[..., :self.d_r // 2], rot[..., self.d_r // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    def forward(self, h: torch.Tensor, q_resid: torch.Tensor | None, meta: AttentionMetadata, cache: LayerCache
                ) -> torch.Tensor | None:
        """Store the new tokens' indexer keys; return each query's selected token positions ``[T, topk]`` int32
        (``-1``: none), or None when no query of the step sees more than ``topk`` keys (attend to all of them), a
        decision of the whole step that a rows-invariant backend never takes (a row of a short prompt would attend by
        one path alone and by another beside a long one)."""
        assert cache.index is not None, "a sparse-attention layer needs a cache with indexer keys"
        cos, sin = meta.rope.cos, meta.rope.sin
        k = self.rotate(F.layer_norm(self.wk(h), (self.head_dim,), self.k_norm.weight, self.k_norm.bias,
                                     INDEXER_NORM_EPS), cos, sin)
        store_index_keys(cache.index, cache.index_scales, k, meta.slot_mapping)
        batch = meta.batch
        if max(batch.key_lens) <= self.topk and not meta.backend.rows_invariant:
            return None
        q = self.rotate(self.queries(h, q_resid, meta.batch.positions), cos, sin)
        w = self.weights_proj(h).float() * self.weight_scale
        return meta.backend.select(q, w, meta, cache, self.topk)

    def queries(self, h: torch.Tensor, q_resid: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        """The queries ``[T, n_I, d_I]`` before RoPE: ``wq_b`` of ``q_resid``, or of ``LayerNorm(h)``
        (``query_source`` ``"hidden"``), scaled by position where the layer has ``softmax_scaling``."""
        norm = self.q_input_norm
        if norm is not None:
            q_resid = F.layer_norm(h, (h.shape[-1],), norm.weight, norm.bias, INDEXER_NORM_EPS)
        assert q_resid is not None
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        return log_position_scaled(q, positions, self.softmax_scaling)


def sparse_selection(attn: MLAttention, h: torch.Tensor, q_resid: torch.Tensor | None, meta: AttentionMetadata,
                     cache: LayerCache) -> torch.Tensor | None:
    """The token positions each query of ``attn``'s layer attends to ``[T, topk]``: its indexer's choice, or on a
    layer that shares it the previous layer's (kept in ``meta.selections``); None: every query attends to all its
    keys (no sparse attention, or no query sees more than ``topk``)."""
    if attn.indexer is not None:
        selected = attn.indexer(h, q_resid, meta, cache)
    elif attn.shares_selection:
        selected = meta.selections.get(attn.layer - 1)
    else:
        return None
    meta.selections[attn.layer] = selected
    return selected
