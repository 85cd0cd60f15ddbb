"""GLM-5-Next's pooled sparse-attention indexer: which earlier tokens each query attends to, chosen by pools.

DeepSeek Sparse Attention's lightning indexer (``layers/indexer.py``) scores single tokens; GLM-5-Next's scores
*pools* of ``kpool`` consecutive tokens (from the sequence's first token) and has no RoPE. Per layer::

    q_I = wq_b(q_resid)                         [T, n_I, d_I]
    k_I = LayerNorm(wk(h)),  g = h gate^T       [T, d_I] each, kept per token (``index_kpool_compress_gate``)
    pool key k_P = sum_j softmax_j(g[j] + ape[j]) k_I[j]      over the pool's kpool tokens j (``..._compress_ape``)
    score[t, P] = sum_h w[t, h] n_I^-1/2 relu(d_I^-1/2 q_I[t, h] . k_P)      w = weights_proj(h)

A query at position ``p`` may choose a pool once the pool is complete and its last token is at most ``p``; it keeps
the ``topk / kpool`` best (exact ties lowest pool first), expanded back to their tokens, and always adds the tokens
of its own incomplete pool (the ``p + 1 mod kpool`` last, ``index_kpool_always_select_tail``). Its selection is
``topk + kpool - 1`` token positions wide, ``-1`` where nothing is chosen, as transformers' ``Glm5NextTextIndexer``
computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mla_kernels import topk_lowest_first

INDEXER_NORM_EPS = 1e-6  # the eps of the reference's key LayerNorm


def _linear(rows: int, cols: int, dtype: torch.dtype) -> nn.Linear:
    layer = nn.Linear(cols, rows, bias=False, dtype=dtype)
    layer.weight.requires_grad_(False)
    return layer


class PooledIndexer(nn.Module):
    def __init__(self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, kpool: int,
                 tail: bool, dtype: torch.dtype) -> None:
        super().__init__()
        if kpool < 1 or topk % kpool:
            raise ValueError(f"index_topk ({topk}) must be a multiple of index_kpool ({kpool}) >= 1")
        self.n_heads, self.head_dim, self.topk, self.kpool, self.tail = n_heads, head_dim, topk, kpool, tail
        self.wq_b = _linear(n_heads * head_dim, q_lora_rank, dtype)
        self.wk = _linear(head_dim, hidden, dtype)
        self.k_norm = nn.LayerNorm(head_dim, eps=INDEXER_NORM_EPS, dtype=dtype)
        self.k_norm.requires_grad_(False)
        self.weights_proj = _linear(n_heads, hidden, dtype)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(kpool, head_dim, dtype=dtype), requires_grad=False)
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(head_dim, hidden, dtype=dtype), requires_grad=False)

    @property
    def width(self) -> int:
        """The selection's width: ``topk`` pooled tokens and, with the tail, up to ``kpool - 1`` more."""
        return self.topk + (self.kpool - 1 if self.tail else 0)

    def keys(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' keys and pool gate scores ``[T, d_I]`` each, kept by the sequence."""
        k = self.k_norm(self.wk(h))
        return k, F.linear(h, self.index_kpool_compress_gate)

    def pool_keys(self, keys: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """The complete pools' keys ``[L // kpool, d_I]`` from the sequence's ``keys``, ``gates [L, d_I]``."""
        n = keys.shape[0] // self.kpool * self.kpool
        grouped_keys = keys[:n].view(-1, self.kpool, self.head_dim)
        logits = gates[:n].view(-1, self.kpool, self.head_dim).float() + self.index_kpool_compress_ape.float()
        return (logits.softmax(dim=1).to(keys.dtype) * grouped_keys).sum(dim=1)

    def forward(self, h: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                gates: torch.Tensor) -> torch.Tensor:
        """The selection ``[T, width]`` int64 (``-1``: none) of the queries ``h``, ``q_resid`` at ``positions``
        over the sequence's ``keys`` and ``gates`` (every token so far, these included)."""
        t, kp = h.shape[0], self.kpool
        q = self.wq_b(q_resid).view(t, self.n_heads, self.head_dim)
        pools = self.pool_keys(keys, gates)  # [P, d_I]
        scores = F.relu(torch.matmul(q.float(), pools.float().t().unsqueeze(0)) * self.head_dim ** -0.5)
        w = self.weights_proj(h).float() * self.n_heads ** -0.5  # [T, n_I]
        index_scores = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)  # [T, P]
        pool_end = torch.arange(pools.shape[0], device=h.device) * kp + kp - 1
        visible = pool_end[None, :] <= positions[:, None]
        index_scores = index_scores.masked_fill(~visible, torch.finfo(index_scores.dtype).min)
        select = min(self.topk // kp, pools.shape[0])
        picked = topk_lowest_first(index_scores, select) if select else index_scores.new_zeros(t, 0).long()
        chosen = visible.gather(1, picked)
        tokens = (picked * kp).unsqueeze(-1) + torch.arange(kp, device=h.device)  # [T, select, kpool]
        selection = tokens.masked_fill(~chosen.unsqueeze(-1), -1).flatten(1)
        if self.tail and kp > 1:
            count = (positions + 1) % kp
            offsets = torch.arange(kp - 1, device=h.device)
            tail = (positions + 1 - count).unsqueeze(-1) + offsets
            selection = torch.cat([selection, tail.masked_fill(offsets >= count.unsqueeze(-1), -1)], dim=1)
        return F.pad(selection, (0, self.width - selection.shape[1]), value=-1)
