"""The CPU backend: decodes through one shared gather plan, and as compiled calls where the kernels build.

The leading sequences of a step attend through one gather plan
(``mla_kernels.plan_decode``) in which each query row gathers its own keys: every one-token decode, and a short
chunk (a speculative verification: at most ``PLANNED_MAX_QUERY_LEN`` tokens) while the keys its rows read beyond
one row's stay under ``PLANNED_EXTRA_KEY_BYTES``. Reading a few more keys costs less than the per-sequence path's two
dozen more operator calls per layer (on the demo model a one-draft verification step ran 730 operator calls that
way and 420 planned); longer chunks (prefills, verifications over long contexts) come after them in the step
(``StepPlan`` puts the shortest first) and take the reference paths as a batch of their own (``rest``), which gather a
sequence's latent once. An int8 / fp8 cache's gathered rows are dequantised (their per-token scales); a forced
``naive`` path takes the reference paths throughout.

A sparse-attention layer's indexer scores with the typed operator of ``mla_kernels.cpu_ops`` where it builds (built
while the model loads). Where the compiled kernels (``mla_kernels.cpu_kernels``) build and a layer's weights are float32
(``prepare_layer``), a step whose every row is planned (``compiled_rows``: any cache format) runs each layer's latent
side (norm, RoPE, cache write, the queries' RoPE) and its absorbed attention as two compiled calls after the
projections; ``models/deepseek.py`` may then run the whole decoder layer as one call (``layers/decoder_kernel.py``),
a bfloat16 model's too (in float32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mla_kernels import (
    DecodePlan,
    cpu_kernels,
    cpu_ops,
    gather_latent,
    mla_decode_planned,
    plan_decode,
    plan_decode_lists,
    selected_prefill_attention,
    sparse_plan,
    write_latent,
)
from mla_runtime.attention.metadata import AttentionDims, AttentionMetadata, choose_path, host_cu_seqlens
from mla_runtime.attention.paged import PagedBackend, absorb, unabsorb
from mla_runtime.cache.latent_cache import LatentCache, LayerCache
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.layers.bf16 import Bf16Weight
from mla_runtime.layers.cpu_gemm import row_kernel_failure
from mla_runtime.layers.rotary import RopeTables

if TYPE_CHECKING:
    from mla_runtime.layers.mla import MLAttention

PLANNED_MAX_QUERY_LEN = 8
# a sparse step's gathered rows cost about this many times their multiply-adds against dense attention's (the
# prefill of a 4,096-token prompt on a 128-head model: 217 s all gathered, 88 s with the masked dense form where this
# ratio chooses it, 51 s dense; bench/RESULTS.md, "Sparse attention")
GATHER_COST = 3
PLANNED_EXTRA_KEY_BYTES = 2 << 20
# A plan of at most this many (query row, key) entries is built on the host from the batch's block-table lists
# (``plan_decode_lists``: two tensors made, instead of a dozen tensor ops); larger ones by tensor ops.
HOST_PLAN_MAX_ENTRIES = 8192


class CpuBackend(PagedBackend):
    def __init__(self, path: str = "auto") -> None:
        super().__init__("torch", path)
        self.name = "cpu"

    def prepare_layer(self, attn: MLAttention) -> None:
        """A layer whose absorbed weights are float32 takes the compiled decode kernels where they build; a bfloat16
        model's layer their attention alone (its planned rows: float32 sums over its bfloat16 factors and cache, as its
        few-row products already sum)."""
        runs = attn.w_uk is not None and attn.w_uk.device.type == "cpu" and row_kernel_failure() is None
        attn.prefill_kernel = runs
        attn.decode_kernel = runs and attn.w_uk is not None and attn.w_uk.dtype == torch.float32
        attn.attention_kernel = runs and attn.w_uk is not None and attn.w_uk.dtype in (torch.float32, torch.bfloat16)
        if attn.indexer is not None:
            cpu_ops.available()  # the indexer's operator is built (or found built) while the model loads

    def prepare(self, batch: ForwardBatch, rope: RopeTables, dims: AttentionDims, cache: LatentCache
                ) -> AttentionMetadata:
        meta = super().prepare(batch, rope, dims, cache)
        kv = cache.layers[0].kv
        if self.path == "naive":
            return meta
        key_bytes = kv.shape[-1] * kv.element_size()
        seqs, d = batch.leading_short(PLANNED_MAX_QUERY_LEN, PLANNED_EXTRA_KEY_BYTES // key_bytes)
        if not d:
            return meta
        rest = None
        if seqs < batch.num_seqs:
            tail = batch.tail(seqs)
            rest = AttentionMetadata(self, tail, rope.tail(d), tail.slot_mapping, tail.token_seq_lens,
                                     choose_path(tail, dims, self.path), host_cu_seqlens(tail))
        return AttentionMetadata(self, batch, rope, meta.slot_mapping, meta.token_seq_lens, meta.path,
                                 meta.host_cu_seqlens, _plan(batch, seqs, d, kv.device), d, rest)

    def compiled_rows(self, meta: AttentionMetadata, cache: LayerCache) -> bool:
        """A step whose every row is a planned decode, of a float32 or bfloat16 model (the kernels read and write every
        cache format: float32, bfloat16, float16, int8 and float8_e4m3fn): the one place that decides whether a step
        takes the compiled kernels (on the layers that ``prepare_layer`` found take them: whether the kernels run here
        was decided once, when the weights were prepared). A bfloat16 model's compiled layers compute the step in
        float32, with float32 RoPE tables made for it (``DeepseekForCausalLM._decode_step``)."""
        return meta.all_planned and meta.rope.cos.dtype in (torch.float32, torch.bfloat16)

    def _compiled(self, attn: MLAttention, meta: AttentionMetadata) -> bool:
        """The layer's latent side (its norm, RoPE and cache write: ``rope_store``) runs compiled: a float32 model's
        rows of any step, decodes and prompts alike, on a layer that takes the kernels, with the full latent rank (the
        compiled latent side has no truncation). A prompt's 1,024 rows take 0.25 ms there, where torch's norm, complex
        product and copies take 1.6."""
        return (attn.prefill_kernel and attn.latent_down is None and attn.kv_a_layernorm.weight.dtype == torch.float32
                and meta.rope.cos.dtype == torch.float32)

    def write(self, attn: MLAttention, q: torch.Tensor, latent: torch.Tensor, meta: AttentionMetadata,
              cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._compiled(attn, meta):
            return super().write(attn, q, latent, meta, cache)
        q3 = q.view(q.shape[0], attn.n_h, attn.d_n + attn.d_r)
        norm = attn.kv_a_layernorm
        cpu_kernels.ops().rope_store(latent, norm.weight, norm.eps, q3, attn.d_n, meta.rope.cos, meta.rope.sin,
                                     cache.kv.view(-1, cache.kv.shape[-1]), meta.slot_mapping, attn.rotary.interleave,
                                     cache.flat_scales)
        q_n, q_r = q3.split([attn.d_n, attn.d_r], dim=-1)
        return q_n, q_r

    def store(self, attn: MLAttention, c: torch.Tensor, k_r: torch.Tensor, meta: AttentionMetadata,
              cache: LayerCache) -> None:
        if meta.decode_plan is None or cache.scales is not None:
            return super().store(attn, c, k_r, meta, cache)
        write_latent(cache.kv, c, k_r, meta.slot_mapping)  # a planned step: float cache, every slot valid

    def forward(self, q_n: torch.Tensor, q_r: torch.Tensor, attn: MLAttention, meta: AttentionMetadata,
                cache: LayerCache) -> torch.Tensor:
        d = meta.num_planned
        if not d:
            return super().forward(q_n, q_r, attn, meta, cache)
        planned = self._planned(q_n[:d], q_r[:d], attn, meta, cache)
        if meta.rest is None:
            return planned
        return torch.cat([planned, super().forward(q_n[d:], q_r[d:], attn, meta.rest, cache)])

    def naive(self, q_n: torch.Tensor, q_r: torch.Tensor, attn: MLAttention, meta: AttentionMetadata,
              cache: LayerCache) -> torch.Tensor:
        """The up-projected path; in bfloat16 for a chunk of many rows of a float32 model whose key and value rebuild
        rounds its rows to bfloat16 (``half_prefill``)."""
        half = half_prefill(attn, q_n)
        if half is None:
            return super().naive(q_n, q_r, attn, meta, cache)
        return super().naive(q_n.to(half), q_r.to(half), attn, meta, cache).to(q_n.dtype)

    def up_projected(self, q_n: torch.Tensor, q_r: torch.Tensor, k_n: torch.Tensor, k_r: torch.Tensor,
                     v: torch.Tensor, attn: MLAttention, meta: AttentionMetadata) -> torch.Tensor:
        """A chunk of a layer that takes the compiled kernels: the compiled prefill attention, which lays out each
        head's rebuilt keys (transposed) and values itself in one pass (torch's flash kernel wants them concatenated
        and zero-padded to one head size, copies that cost about as much as its attention), a half-precision chunk's
        widened exactly and summed in float32. Else torch's flash kernel."""
        if not attn.prefill_kernel:
            return super().up_projected(q_n, q_r, k_n, k_r, v, attn, meta)
        cu_q, cu_k = meta.host_cu_seqlens
        out, _ = cpu_kernels.ops().prefill_attention(q_n, q_r, k_n, k_r, v, cu_q, cu_k, attn.scale)
        return out if out.dtype == q_n.dtype else out.to(q_n.dtype)  # type: ignore[no-any-return]

    def sparse_forward(self, q_n: torch.Tensor, q_r: torch.Tensor, attn: MLAttention, meta: AttentionMetadata,
                       cache: LayerCache, selected: torch.Tensor) -> torch.Tensor:
        """Sparse attention: the selection as a gather plan (``sparse_plan``), attended like a planned decode (a
        compiled call where the layer takes the compiled kernels; an int8 / fp8 cache's rows dequantised)."""
        d = meta.num_planned if meta.decode_plan is not None else 0
        rest = meta.rest if d else meta
        if d == q_n.shape[0] or rest is None or not self._dense_cheaper(rest, attn, selected.shape[1]) \
                or q_n.dtype not in (torch.float32, torch.bfloat16):
            batch = meta.batch
            plan = sparse_plan(selected, batch.block_tables, batch.token_req_idx, batch.block_size)
            return self._attend_plan(q_n, q_r, attn, plan, cache)
        # prefill chunks: dense up-projected attention masked to each row's selection (a gather of its selected
        # keys per row costs several times more there); the planned short rows before them as above
        out = self._selected_prefill(q_n[d:], q_r[d:], attn, rest, cache, selected[d:])
        if not d:
            return out
        batch = meta.batch
        plan = sparse_plan(selected[:d], batch.block_tables, batch.token_req_idx[:d], batch.block_size)
        return torch.cat([self._attend_plan(q_n[:d], q_r[:d], attn, plan, cache), out])

    @staticmethod
    def _dense_cheaper(meta: AttentionMetadata, attn: MLAttention, topk: int) -> bool:
        """Whether the rows of ``meta`` take masked dense attention: rebuilding every key and value of their
        sequences (``L d_c H (d_n + d_v)``) and attending densely (``T L H (d_n + d_r + d_v)``) against gathering
        each row's selection (``T topk H (2 d_c + d_r)``, times ``GATHER_COST``: the gathered path's measured
        overhead)."""
        batch = meta.batch
        h, d_c, d_r = attn.n_h, attn.d_c, attn.d_r
        dense = sparse = 0
        for q, c in zip(batch.query_lens, batch.context_lens_list):
            keys = q + c
            dense += keys * d_c * h * (attn.d_n + attn.d_v) + q * keys * h * (attn.d_n + d_r + attn.d_v)
            sparse += q * min(topk, keys) * h * (2 * d_c + d_r)
        return dense < GATHER_COST * sparse

    def _selected_prefill(self, q_n: torch.Tensor, q_r: torch.Tensor, attn: MLAttention, meta: AttentionMetadata | None,
                          cache: LayerCache, selected: torch.Tensor) -> torch.Tensor:
        """Rows of prefill chunks over their selected keys: keys and values rebuilt from the sequences' gathered
        latents (as the naive path), then attention masked to each row's selection."""
        assert meta is not None
        batch = meta.batch
        key_lens = [c + q for q, c in zip(batch.query_lens, batch.context_lens_list)]
        latent = gather_latent(cache.kv, cache.scales, batch.block_tables, batch.seq_lens, q_n.dtype, attn.d_c,
                               backend=self.kernels, host_lens=key_lens)
        c_all, k_r_all = latent.split([attn.d_c, attn.d_r], dim=-1)
        k_n, v = attn.kv_b_proj(c_all).view(-1, attn.n_h, attn.d_n + attn.d_v).split([attn.d_n, attn.d_v], dim=-1)
        cu_q, cu_k = meta.host_cu_seqlens
        return selected_prefill_attention(q_n, q_r, k_n, k_r_all, v, cu_q, cu_k, attn.scale, selected)

    def _planned(self, q_n: torch.Tensor, q_r: torch.Tensor, attn: MLAttention, meta: AttentionMetadata,
                 cache: LayerCache) -> torch.Tensor:
        """The planned rows' absorbed attention: the whole layer in one compiled call where the layer takes it."""
        plan = meta.decode_plan
        assert plan is not None
        return self._attend_plan(q_n, q_r, attn, plan, cache)

    def _attend_plan(self, q_n: torch.Tensor, q_r: torch.Tensor, attn: MLAttention, plan: DecodePlan,
                     cache: LayerCache) -> torch.Tensor:
        """Absorbed attention of the plan's rows over the keys it gathers for each -> ``[N, n_h, d_v]``."""
        if attn.attention_kernel and attn.w_uk is not None and attn.w_uv_t is not None \
                and q_n.dtype in (torch.float32, torch.bfloat16):
            out = cpu_kernels.ops().absorbed_decode(q_n.float(), q_r.float(), attn.w_uk, attn.w_uv_t,
                                                    cache.kv.view(-1, cache.kv.shape[-1]), plan.slots, plan.lens,
                                                    attn.scale, scales=cache.flat_scales)
            return out if out.dtype == q_n.dtype else out.to(q_n.dtype)  # type: ignore[no-any-return]
        o_lat = mla_decode_planned(absorb(q_n, q_r, attn), cache.kv, plan, attn.scale, attn.d_c, cache.scales)
        return unabsorb(o_lat, attn)


def _plan(batch: ForwardBatch, seqs: int, rows: int, device: torch.device) -> DecodePlan:
    """The gather plan of the first ``rows`` tokens (those of the first ``seqs`` sequences)."""
    ctx, qs = batch.context_lens_list[:seqs], batch.query_lens[:seqs]
    len_range = (min(c + 1 for c in ctx), max(c + q for c, q in zip(ctx, qs)))  # keys seen by the plan's rows
    tables = batch.host_block_tables
    if tables is not None and rows * len_range[1] <= HOST_PLAN_MAX_ENTRIES:
        lens = [c + j for c, q in zip(ctx, qs) for j in range(1, q + 1)]
        return plan_decode_lists([tables[b] for b, q in enumerate(qs) for _ in range(q)], lens, batch.block_size,
                                 device)
    return plan_decode(batch.block_tables[:seqs], batch.token_seq_lens[:rows], batch.block_size,
                       batch.token_req_idx[:rows], len_range)


def half_prefill(attn: MLAttention, q_n: torch.Tensor) -> torch.dtype | None:
    """bfloat16 where a float32 layer's up-projected attention of the chunk ``q_n [T, n_h, d_n]`` runs in bfloat16, else
    None: where ``kv_b_proj`` holds a bfloat16 copy for oneDNN's bfloat16 products (bfloat16 weights, or quantised
    ones, on a CPU with native bfloat16 products: ``layers.quantization.round_absorbed_factors``) and the chunk has
    more rows than the few-row kernels take. Those products round their rows to bfloat16, as the model's other products
    of many rows do; the queries, keys and values they meet are then rounded likewise, and the attention runs as a
    bfloat16 model's does (over those bfloat16 values, summed in float32). The latents are cached in float32 all the
    same."""
    packed = attn.kv_b_proj.packed
    if q_n.dtype != torch.float32 or not isinstance(packed, Bf16Weight) or packed.native is None:
        return None
    return torch.bfloat16 if q_n.shape[0] > cpu_kernels.max_rows(torch.bfloat16) else None
