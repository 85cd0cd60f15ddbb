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

import torch

from mla_kernels import (
    DecodePlan,
    cpu_kernels,
    cpu_ops,
    mla_decode_planned,
    plan_decode,
    plan_decode_lists,
    selected_prefill_attention,
    sparse_plan,
    write_latent,
)
from mla_runtime.attention.layer import AttentionLayer, LayerKernels
from mla_runtime.attention.metadata import AttentionDims, AttentionMetadata, choose_path, host_cu_seqlens
from mla_runtime.attention.paged import PagedBackend, absorb, rebuilt, unabsorb
from mla_runtime.attention.rope_tables import RopeTables
from mla_runtime.cache.latent_cache import LatentCache, LayerCache
from mla_runtime.forward_batch import ForwardBatch

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
        self.kernels_of: dict[int, LayerKernels] = {}  # prepare_layer's decisions, by layer id

    def prepare_layer(self, layer: AttentionLayer) -> LayerKernels:
        """Where the load's plan lets the compiled kernels run (``kernels_allowed``) on a CPU layer, a float32 model's
        layer takes them all (its decode step, prefill attention and latent side); a bfloat16 model's its prefill
        attention and its planned rows' attention (float32 sums over its bfloat16 factors and cache, as its few-row
        products already sum). The one place that decides it, once per layer."""
        super().prepare_layer(layer)
        runs = layer.kernels_allowed and layer.w_uk.device.type == "cpu"
        if layer.sparse:
            cpu_ops.available()  # the indexer's operator is built (or found built) while the model loads
        kernels = LayerKernels(prefill=runs, decode=runs and layer.dtype == torch.float32,
                               attention=runs and layer.dtype in (torch.float32, torch.bfloat16))
        self.kernels_of[layer.layer_id] = kernels
        return kernels

    def prepare(self, batch: ForwardBatch, rope: RopeTables, dims: AttentionDims, cache: LatentCache
                ) -> AttentionMetadata:
        """The step's metadata: with a gather plan of its leading short rows, and the sequences after them as a
        batch of their own (``rest``), where it has such rows. A short chunk whose rows read many keys ends the run
        (``PLANNED_EXTRA_KEY_BYTES``), and with it every short chunk after it, so a rows-invariant backend plans by
        the chunks' lengths alone: a chunk's path must not follow the chunks before it."""
        kv = cache.layers[0].kv
        key_bytes = kv.shape[-1] * kv.element_size()
        limit = None if self.rows_invariant else PLANNED_EXTRA_KEY_BYTES // key_bytes
        seqs, d = (0, 0) if self.path == "naive" else batch.leading_short(PLANNED_MAX_QUERY_LEN, limit)
        if not d:
            return super().prepare(batch, rope, dims, cache)
        rest = None
        if seqs < batch.num_seqs:
            tail = batch.tail(seqs)
            rest = AttentionMetadata(self, tail, rope.tail(d), tail.slot_mapping, tail.token_seq_lens,
                                     choose_path(tail, dims, self.path, self.rows_invariant), host_cu_seqlens(tail))
        return AttentionMetadata(self, batch, rope, batch.slot_mapping, batch.token_seq_lens,
                                 choose_path(batch, dims, self.path, self.rows_invariant), host_cu_seqlens(batch),
                                 _plan(batch, seqs, d, kv.device), d, rest)

    def compiled_rows(self, meta: AttentionMetadata, cache: LayerCache) -> bool:
        """A step whose every row is a planned decode, of a float32 or bfloat16 model (the kernels read and write every
        cache format: float32, bfloat16, float16, int8 and float8_e4m3fn): the one place that decides whether a step
        takes the compiled kernels (on the layers that ``prepare_layer`` found take them: whether the kernels run here
        was decided once, when the weights were prepared). A bfloat16 model's compiled layers compute the step in
        float32, with float32 RoPE tables made for it (``DeepseekForCausalLM._decode_step``)."""
        return meta.all_planned and meta.rope.cos.dtype in (torch.float32, torch.bfloat16)

    def _compiled_norm(self, layer: AttentionLayer, meta: AttentionMetadata) -> tuple[torch.Tensor, float] | None:
        """The layer's latent side (its norm, RoPE and cache write: ``rope_store``) runs compiled: a float32 model's
        rows of any step, decodes and prompts alike, on a layer that takes the kernels, with the full latent rank (the
        compiled latent side has no truncation). A prompt's 1,024 rows take 0.25 ms there, where torch's norm, complex
        product and copies take 1.6. The latent norm's weight and eps where it does, else None."""
        norm = layer.latent_norm
        compiled = self.kernels_of[layer.layer_id].prefill and norm is not None and norm[0].dtype == torch.float32 \
            and meta.rope.cos.dtype == torch.float32
        return norm if compiled else None

    def write(self, layer_id: int, q: torch.Tensor, latent: torch.Tensor, meta: AttentionMetadata,
              cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_id]
        norm = self._compiled_norm(layer, meta)
        if norm is None:
            return super().write(layer_id, q, latent, meta, cache)
        q3 = q.view(q.shape[0], layer.n_h, layer.d_n + layer.d_r)
        weight, eps = norm
        cpu_kernels.ops().rope_store(latent, weight, eps, q3, layer.d_n, meta.rope.cos, meta.rope.sin,
                                     cache.kv.view(-1, cache.kv.shape[-1]), meta.slot_mapping, layer.interleave,
                                     cache.flat_scales)
        q_n, q_r = q3.split([layer.d_n, layer.d_r], dim=-1)
        return q_n, q_r

    def store(self, layer: AttentionLayer, c: torch.Tensor, k_r: torch.Tensor, meta: AttentionMetadata,
              cache: LayerCache) -> None:
        if meta.decode_plan is None or cache.scales is not None:
            return super().store(layer, c, k_r, meta, cache)
        write_latent(cache.kv, c, k_r, meta.slot_mapping)  # a planned step: float cache, every slot valid

    def attend(self, q_n: torch.Tensor, q_r: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata,
               cache: LayerCache) -> torch.Tensor:
        """The planned rows through their gather plan, then the rest of the step as a batch of its own."""
        d = meta.num_planned
        if not d:
            return super().attend(q_n, q_r, layer, meta, cache)
        plan = meta.decode_plan
        assert plan is not None
        planned = self._attend_plan(q_n[:d], q_r[:d], layer, plan, cache)
        if meta.rest is None:
            return planned
        return torch.cat([planned, super().attend(q_n[d:], q_r[d:], layer, meta.rest, cache)])

    def naive(self, q_n: torch.Tensor, q_r: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata,
              cache: LayerCache) -> torch.Tensor:
        """The up-projected path; in bfloat16 for a chunk of many rows of a float32 model whose key and value rebuild
        rounds its rows to bfloat16 (``half_prefill``)."""
        half = half_prefill(layer, q_n)
        if half is None:
            return super().naive(q_n, q_r, layer, meta, cache)
        return super().naive(q_n.to(half), q_r.to(half), layer, meta, cache).to(q_n.dtype)

    def up_projected(self, q_n: torch.Tensor, q_r: torch.Tensor, k_n: torch.Tensor, k_r: torch.Tensor,
                     v: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata) -> torch.Tensor:
        """A chunk of a layer that takes the compiled kernels: the compiled prefill attention, which lays out each
        head's rebuilt keys (transposed) and values itself in one pass (torch's flash kernel wants them concatenated
        and zero-padded to one head size, copies that cost about as much as its attention), a half-precision chunk's
        widened exactly and summed in float32. Else torch's flash kernel."""
        if not self.kernels_of[layer.layer_id].prefill:
            return super().up_projected(q_n, q_r, k_n, k_r, v, layer, meta)
        cu_q, cu_k = meta.host_cu_seqlens
        out, _ = cpu_kernels.ops().prefill_attention(q_n, q_r, k_n, k_r, v, cu_q, cu_k, layer.scale)
        return out if out.dtype == q_n.dtype else out.to(q_n.dtype)  # type: ignore[no-any-return]

    def sparse_forward(self, layer_id: int, q_n: torch.Tensor, q_r: torch.Tensor, meta: AttentionMetadata,
                       cache: LayerCache, selected: torch.Tensor) -> torch.Tensor:
        """Sparse attention: the selection as a gather plan (``sparse_plan``), attended like a planned decode (a
        compiled call where the layer takes the compiled kernels; an int8 / fp8 cache's rows dequantised). Prefill
        chunks take masked dense attention where the step's rows make it cheaper, a decision of the whole step that
        a rows-invariant backend never takes."""
        layer = self.layers[layer_id]
        d = meta.num_planned if meta.decode_plan is not None else 0
        rest = meta.rest if d else meta
        if d == q_n.shape[0] or rest is None or self.rows_invariant \
                or not self._dense_cheaper(rest, layer, selected.shape[1]) \
                or q_n.dtype not in (torch.float32, torch.bfloat16):
            batch = meta.batch
            plan = sparse_plan(selected, batch.block_tables, batch.token_req_idx, batch.block_size)
            return self._attend_plan(q_n, q_r, layer, plan, cache)
        # prefill chunks: dense up-projected attention masked to each row's selection (a gather of its selected
        # keys per row costs several times more there); the planned short rows before them as above
        out = self._selected_prefill(q_n[d:], q_r[d:], layer, rest, cache, selected[d:])
        if not d:
            return out
        batch = meta.batch
        plan = sparse_plan(selected[:d], batch.block_tables, batch.token_req_idx[:d], batch.block_size)
        return torch.cat([self._attend_plan(q_n[:d], q_r[:d], layer, plan, cache), out])

    @staticmethod
    def _dense_cheaper(meta: AttentionMetadata, layer: AttentionLayer, topk: int) -> bool:
        """Whether the rows of ``meta`` take masked dense attention: rebuilding every key and value of their
        sequences (``L d_c H (d_n + d_v)``) and attending densely (``T L H (d_n + d_r + d_v)``) against gathering
        each row's selection (``T topk H (2 d_c + d_r)``, times ``GATHER_COST``: the gathered path's measured
        overhead)."""
        batch = meta.batch
        h, d_c, d_r = layer.n_h, layer.d_c, layer.d_r
        dense = sparse = 0
        for q, keys in zip(batch.query_lens, batch.key_lens):
            dense += keys * d_c * h * (layer.d_n + layer.d_v) + q * keys * h * (layer.d_n + d_r + layer.d_v)
            sparse += q * min(topk, keys) * h * (2 * d_c + d_r)
        return dense < GATHER_COST * sparse

    def _selected_prefill(self, q_n: torch.Tensor, q_r: torch.Tensor, layer: AttentionLayer,
                          meta: AttentionMetadata | None, cache: LayerCache, selected: torch.Tensor) -> torch.Tensor:
        """Rows of prefill chunks over their selected keys: keys and values rebuilt from the sequences' gathered
        latents (as the naive path), then attention masked to each row's selection."""
        assert meta is not None
        k_n, k_r_all, v = rebuilt(layer, meta, cache, q_n.dtype, self.kernels)
        cu_q, cu_k = meta.host_cu_seqlens
        return selected_prefill_attention(q_n, q_r, k_n, k_r_all, v, cu_q, cu_k, layer.scale, selected)

    def _attend_plan(self, q_n: torch.Tensor, q_r: torch.Tensor, layer: AttentionLayer, plan: DecodePlan,
                     cache: LayerCache) -> torch.Tensor:
        """Absorbed attention of the plan's rows over the keys it gathers for each -> ``[N, n_h, d_v]``: one compiled
        call where the layer takes the kernels."""
        if self.kernels_of[layer.layer_id].attention and q_n.dtype in (torch.float32, torch.bfloat16):
            out = cpu_kernels.ops().absorbed_decode(q_n.float(), q_r.float(), *layer.kernel_factors,
                                                    cache.kv.view(-1, cache.kv.shape[-1]), plan.slots, plan.lens,
                                                    layer.scale, scales=cache.flat_scales)
            return out if out.dtype == q_n.dtype else out.to(q_n.dtype)  # type: ignore[no-any-return]
        o_lat = mla_decode_planned(absorb(q_n, q_r, layer), cache.kv, plan, layer.scale, layer.d_c, cache.scales)
        return unabsorb(o_lat, layer)


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


def half_prefill(layer: AttentionLayer, q_n: torch.Tensor) -> torch.dtype | None:
    """bfloat16 where a float32 layer's up-projected attention of the chunk ``q_n [T, n_h, d_n]`` runs in bfloat16, else
    None: where ``kv_b_proj`` holds a bfloat16 copy for oneDNN's bfloat16 products (bfloat16 weights, or quantised
    ones, on a CPU with native bfloat16 products: ``layers.quantization.round_absorbed_factors``) and the chunk has
    more rows than the few-row kernels take. Those products round their rows to bfloat16, as the model's other products
    of many rows do; the queries, keys and values they meet are then rounded likewise, and the attention runs as a
    bfloat16 model's does (over those bfloat16 values, summed in float32). The latents are cached in float32 all the
    same."""
    if q_n.dtype != torch.float32 or not layer.rebuild_in_bfloat16:
        return None
    return torch.bfloat16 if q_n.shape[0] > cpu_kernels.max_rows(torch.bfloat16) else None
