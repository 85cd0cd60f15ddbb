"""The sharded latent cache under tensor parallelism: each rank keeps every N-th token of each block.

A rank owns ``n_h / N`` heads but only its share of the tokens, so attention always takes the absorbed path: all
heads' queries are gathered, each rank attends over its own tokens, and the partial outputs are merged by
log-sum-exp before each rank keeps its heads. The latent is written where this rank keeps it (slot -1 elsewhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from mla_kernels import mla_decode

from mla_runtime.attention.metadata import AttentionDims, AttentionMetadata, host_cu_seqlens
from mla_runtime.attention.paged import PagedBackend
from mla_runtime.cache.latent_cache import LatentCache, LayerCache
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.layers.rotary import RopeTables
from mla_runtime.parallel import ParallelContext, local_latent_view

if TYPE_CHECKING:
    from mla_runtime.layers.mla import MLAttention


class ShardedBackend(PagedBackend):
    def __init__(self, kernels: str, par: ParallelContext) -> None:
        super().__init__(kernels, "absorbed")
        self.name = "sharded"
        self.par = par

    def prepare(self, batch: ForwardBatch, rope: RopeTables, dims: AttentionDims, cache: LatentCache
                ) -> AttentionMetadata:
        slots, seq_lens = local_latent_view(batch.positions, batch.slot_mapping, batch.token_seq_lens,
                                            batch.block_size, self.par)
        return AttentionMetadata(self, batch, rope, slots, seq_lens, "absorbed", host_cu_seqlens(batch))

    def latent_attention(self, q_cat: torch.Tensor, attn: MLAttention, meta: AttentionMetadata, cache: LayerCache
                         ) -> torch.Tensor:
        """This rank's tokens attended by every head's query, merged across ranks by LSE -> this rank's heads."""
        par = self.par
        q_all = par.all_gather(q_cat, dim=1)  # [T, n_h_total, d_c + d_r]
        o_part, lse = mla_decode(q_all, cache.kv, cache.scales, meta.batch.block_tables, meta.token_seq_lens,
                                 attn.scale, attn.d_c, req_indices=meta.batch.token_req_idx, backend=self.kernels,
                                 validate=attn.validate)
        lse_all = par.all_gather(lse.unsqueeze(0), dim=0)  # [N, T, n_h_total]
        weight = torch.exp(lse - torch.logsumexp(lse_all, dim=0))  # 0 where this rank saw no token
        merged = par.all_reduce(o_part.float() * weight.unsqueeze(-1))  # [T, n_h_total, d_c]
        first = par.rank * attn.n_h
        return merged[:, first:first + attn.n_h].to(q_cat.dtype)
