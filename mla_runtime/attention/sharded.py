"""The sharded latent cache under tensor parallelism: each rank keeps every N-th token of each block.

A rank owns ``n_h / N`` heads but only its share of the tokens, so attention always takes the absorbed path: all
heads' queries are gathered, each rank attends over its own tokens, and the partial outputs are merged by
log-sum-exp before each rank keeps its heads. The latent is written where this rank keeps it (slot -1 elsewhere).
"""

from __future__ import annotations

import torch

from mla_kernels import indexer_scores, mla_decode, sparse_mla_decode, topk_lowest_first
from mla_runtime.attention.layer import AttentionLayer
from mla_runtime.attention.metadata import AttentionDims, AttentionMetadata, host_cu_seqlens
from mla_runtime.attention.paged import PagedBackend, absorb, unabsorb
from mla_runtime.attention.rope_tables import RopeTables
from mla_runtime.cache.latent_cache import LatentCache, LayerCache
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.parallel import ParallelContext, local_latent_view


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

    def latent_attention(self, q_cat: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata,
                         cache: LayerCache) -> torch.Tensor:
        """This rank's tokens attended by every head's query, merged across ranks by LSE -> this rank's heads."""
        q_all = self.par.all_gather(q_cat, dim=1)  # [T, n_h_total, d_c + d_r]
        o_part, lse = mla_decode(q_all, cache.kv, cache.scales, meta.batch.block_tables, meta.token_seq_lens,
                                 layer.scale, layer.d_c, req_indices=meta.batch.token_req_idx, backend=self.kernels,
                                 validate=layer.validate)
        return self._merge(o_part, lse, layer, q_cat.dtype)

    def _merge(self, o_part: torch.Tensor, lse: torch.Tensor, layer: AttentionLayer, dtype: torch.dtype
               ) -> torch.Tensor:
        """Every rank's partial attention (``o_part [T, n_h_total, d_c]`` over its tokens, with their ``lse``) merged
        by log-sum-exp -> this rank's heads ``[T, n_h, d_c]``."""
        par = self.par
        lse_all = par.all_gather(lse.unsqueeze(0), dim=0)  # [N, T, n_h_total]
        weight = torch.exp(lse - torch.logsumexp(lse_all, dim=0))  # 0 where this rank saw no token
        merged = par.all_reduce(o_part.float() * weight.unsqueeze(-1))  # [T, n_h_total, d_c]
        first = par.rank * layer.n_h
        return merged[:, first:first + layer.n_h].to(dtype)

    def select(self, q: torch.Tensor, w: torch.Tensor, meta: AttentionMetadata, cache: LayerCache, topk: int
               ) -> torch.Tensor:
        """The indexer's choice over every rank's tokens: each rank scores its own (local position ``j`` is global
        ``j N + rank``), keeps its ``topk`` best, and the ranks' candidates are merged into the global ``topk`` (the
        same on every rank) -> global token positions ``[T, topk]`` (``-1``: none)."""
        par, batch = self.par, meta.batch
        n, lens = par.world_size, meta.token_seq_lens
        assert cache.index is not None
        scores = indexer_scores(q, w, cache.index, cache.index_scales, batch.block_tables, batch.token_req_idx,
                                lens.clamp(min=1), backend=self.kernels)  # [T, L]: a row without keys reads one ...
        local = torch.arange(scores.shape[1], device=scores.device)
        scores = scores.masked_fill(local >= lens.unsqueeze(1), float("-inf"))  # ... that it then ignores
        k = min(topk, scores.shape[1])
        idx = topk_lowest_first(scores, k)  # ties: the lower local, hence global, position first
        values = scores.gather(1, idx)
        positions = torch.where(values > float("-inf"), idx * n + par.rank, -1)
        if k < topk:
            values = torch.cat([values, values.new_full((values.shape[0], topk - k), float("-inf"))], dim=1)
            positions = torch.cat([positions, positions.new_full((positions.shape[0], topk - k), -1)], dim=1)
        values, positions = par.all_gather(values, dim=1), par.all_gather(positions, dim=1)  # [T, N topk]
        # candidates in ascending global position (none last), so that equal scores go to the lower position
        by_pos = torch.argsort(torch.where(positions >= 0, positions, positions.new_tensor(2 ** 62)), dim=1)
        values, positions = values.gather(1, by_pos), positions.gather(1, by_pos)
        pick = topk_lowest_first(values, topk)
        best = values.gather(1, pick)
        return torch.where(best > float("-inf"), positions.gather(1, pick), -1).to(torch.int32)

    def sparse_forward(self, layer_id: int, q_n: torch.Tensor, q_r: torch.Tensor, meta: AttentionMetadata,
                       cache: LayerCache, selected: torch.Tensor) -> torch.Tensor:
        """Sparse attention: every head's query over the selected tokens this rank keeps, merged by LSE."""
        layer, n, rank, batch = self.layers[layer_id], self.par.world_size, self.par.rank, meta.batch
        local = torch.where((selected >= 0) & (selected % n == rank), selected // n, -1)
        q_cat = absorb(q_n, q_r, layer)
        q_all = self.par.all_gather(q_cat, dim=1)
        o_part, lse = sparse_mla_decode(q_all, cache.kv, cache.scales, batch.block_tables, batch.token_req_idx,
                                        local, layer.scale, layer.d_c, backend=self.kernels)
        return unabsorb(self._merge(o_part, lse, layer, q_cat.dtype), layer)
