"""DeepSeek Sparse Attention's lightning indexer: which earlier tokens each query attends to.

Per layer, beside MLA's projections (``d_I = head_dim``, ``n_I = n_heads``, ``d_r = qk_rope_head_dim``)::

    q_I = wq_b(q_resid)            [T, n_I, d_I]   from the query's low-rank, normed q_resid
    k_I = LayerNorm(wk(h))         [T, d_I]        one key per token, cached beside the latent (same slot)
    w   = weights_proj(h) n_I^-1/2 d_I^-1/2        [T, n_I]
    RoPE on the first d_r dims of q_I and k_I (halves: DeepSeek-V3.2; interleaved pairs: GLM-5)
    score[t, j] = sum_h w[t, h] relu(q_I[t, h] . k_I[j])      for the keys j that token t sees (causal)

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

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from mla_kernels import store_index_keys
from torch import nn

from mla_runtime.attention.metadata import AttentionMetadata
from mla_runtime.cache.latent_cache import LayerCache
from mla_runtime.layers.linear import Linear
from mla_runtime.resolved_config import ResolvedConfig

if TYPE_CHECKING:
    from mla_runtime.layers.mla import MLAttention

INDEXER_NORM_EPS = 1e-6  # the eps of the reference's key LayerNorm, whatever the model's norms use


class Indexer(nn.Module):
    def __init__(self, rc: ResolvedConfig) -> None:
        super().__init__()
        cfg, dtype = rc.model, rc.dtype
        idx = cfg.indexer
        assert idx is not None and cfg.q_lora_rank is not None
        self.n_heads, self.head_dim, self.topk = idx.n_heads, idx.head_dim, idx.topk
        self.d_r, self.interleave = cfg.qk_rope_head_dim, idx.rope_interleave
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype)
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
        return (None, True) if idx.is_shared(layer) else (cls(rc), False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first ``d_r`` dims of ``x [T, ..., d_I]`` (the rest pass through). An interleaved layout's
        rotated dims come out de-interleaved, in queries and keys alike: their dot products are unchanged."""
        rot, rest = x[..., :self.d_r], x[..., self.d_r:]
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
        if self.interleave:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = rot[..., :self.d_r // 2], rot[..., self.d_r // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    def forward(self, h: torch.Tensor, q_resid: torch.Tensor, meta: AttentionMetadata, cache: LayerCache
                ) -> torch.Tensor | None:
        """Store the new tokens' indexer keys; return each query's selected token positions ``[T, topk]`` int32
        (``-1``: none), or None when no query of the step sees more than ``topk`` keys (attend to all of them)."""
        assert cache.index is not None, "a sparse-attention layer needs a cache with indexer keys"
        cos, sin = meta.rope.cos, meta.rope.sin
        k = self.rotate(F.layer_norm(self.wk(h), (self.head_dim,), self.k_norm.weight, self.k_norm.bias,
                                     INDEXER_NORM_EPS), cos, sin)
        store_index_keys(cache.index, cache.index_scales, k, meta.slot_mapping)
        batch = meta.batch
        if max(c + q for c, q in zip(batch.context_lens_list, batch.query_lens)) <= self.topk:
            return None
        q = self.rotate(self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim), cos, sin)
        w = self.weights_proj(h).float() * self.weight_scale
        return meta.backend.select(q, w, meta, cache, self.topk)


def sparse_selection(attn: MLAttention, h: torch.Tensor, q_resid: torch.Tensor | None, meta: AttentionMetadata,
                     cache: LayerCache) -> torch.Tensor | None:
    """The token positions each query of ``attn``'s layer attends to ``[T, topk]``: its indexer's choice, or on a
    layer that shares it the previous layer's (kept in ``meta.selections``); None: every query attends to all its
    keys (no sparse attention, or no query sees more than ``topk``)."""
    if attn.indexer is not None:
        assert q_resid is not None
        selected = attn.indexer(h, q_resid, meta, cache)
    elif attn.shares_selection:
        selected = meta.selections.get(attn.layer - 1)
    else:
        return None
    meta.selections[attn.layer] = selected
    return selected
