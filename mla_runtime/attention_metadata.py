"""``AttentionMetadata``: what every layer's attention needs to know about a step, decided once per step.

The ``ForwardBatch`` says *which* tokens run (ids, positions, slots, block tables). The metadata adds *how*
the layers attend over them; every layer reads it and none writes it:

- the RoPE ``cos``/``sin`` of the step's positions (the same for every layer);
- this rank's view of the cache: the slot each new token's latent goes to and how many cached keys each
  query sees (under the sharded layout a rank keeps every N-th token, so both differ from the batch's);
- the attention path of the batch (``absorbed`` or ``naive``, by FLOP count unless a path is forced);
- on CPU with a float cache, the gather plan (``mla_kernels.plan_decode``) of the step's leading one-token
  decodes and short speculative verifications, and the rest of the step (prefill chunks) as a batch of its own.

``build_attention_metadata`` is a pure function of the batch, the model's attention settings and the cache,
so every tensor-parallel rank derives its own from the same step message.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mla_kernels import DecodePlan, plan_decode, plan_decode_lists
from mla_kernels.common import resolve_backend

from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.layers.rotary import RopeTables
from mla_runtime.parallel import ParallelContext, local_latent_view

# On CPU, the leading sequences of a step attend through one shared gather plan, in which each query row gathers
# its own keys: every one-token decode, and a short chunk (a speculative verification: at most
# PLANNED_MAX_QUERY_LEN tokens) while the keys its rows read beyond one row's stay under PLANNED_EXTRA_KEY_BYTES.
# Reading a few more keys costs less than the per-sequence path's two dozen more operator calls per layer (on the
# demo model a one-draft verification step ran 730 operator calls that way and 420 planned); longer chunks
# (prefills, verifications over long contexts) take the per-sequence path, which gathers a sequence's latent once.
PLANNED_MAX_QUERY_LEN = 8
PLANNED_EXTRA_KEY_BYTES = 2 << 20
# A plan of at most this many (query row, key) entries is built on the host from the batch's block-table lists
# (``plan_decode_lists``: two tensors made, instead of a dozen tensor ops); larger ones by tensor ops.
HOST_PLAN_MAX_ENTRIES = 8192


@dataclass(frozen=True)
class AttentionDims:
    """The widths that decide the attention path: latent ``d_c``, RoPE ``d_r``, per-head ``d_n`` and ``d_v``."""

    d_c: int
    d_r: int
    d_n: int
    d_v: int


@dataclass(frozen=True)
class AttentionMetadata:
    batch: ForwardBatch
    rope: RopeTables  # the step's RoPE tables (the same for every layer)
    slot_mapping: torch.Tensor  # [T] int64: this rank's cache slot of each new token (-1: another rank's)
    token_seq_lens: torch.Tensor  # [T] int32: this rank's cached keys visible to each new token
    path: str  # "absorbed" or "naive": how the tokens after the planned decodes attend
    host_cu_seqlens: tuple[list[int], list[int]]  # query and key cu_seqlens on the host (no device sync per layer)
    decode_plan: DecodePlan | None = None  # CPU: the gather plan of tokens [:num_planned]
    num_planned: int = 0
    rest: AttentionMetadata | None = None  # the sequences after the planned decodes, as their own batch

    @property
    def plain_write(self) -> bool:
        """A planned step writes its latents with a plain indexed copy (float cache, every slot valid)."""
        return self.decode_plan is not None


def choose_path(batch: ForwardBatch, dims: AttentionDims, forced: str, sharded: bool) -> str:
    """``absorbed`` or ``naive`` for the whole batch: the sharded cache and decode steps always absorb;
    otherwise the cheaper of the two by a FLOP count per head (the causal half is the same for both)."""
    if sharded:
        return "absorbed"
    if forced != "auto":
        return forced
    if batch.is_decode:
        return "absorbed"
    pairs = sum(q * (c + q) for q, c in zip(batch.query_lens, batch.context_lens_list))
    keys = sum(c + q for q, c in zip(batch.query_lens, batch.context_lens_list))
    absorbed = pairs * (2 * dims.d_c + dims.d_r) + batch.num_tokens * dims.d_c * (dims.d_n + dims.d_v)
    naive = keys * dims.d_c * (dims.d_n + dims.d_v) + pairs * (dims.d_n + dims.d_r + dims.d_v)
    return "absorbed" if absorbed <= naive else "naive"


def host_cu_seqlens(batch: ForwardBatch) -> tuple[list[int], list[int]]:
    """``cu_seqlens`` of the new tokens and of all keys, as host lists (from the batch's own host lists)."""
    cu_q, cu_k = [0], [0]
    for q, c in zip(batch.query_lens, batch.context_lens_list):
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + c + q)
    return cu_q, cu_k


def build_attention_metadata(batch: ForwardBatch, rope: RopeTables,
                             dims: AttentionDims, forced_path: str, backend: str | None, cache_kv: torch.Tensor,
                             quantised_cache: bool, par: ParallelContext) -> AttentionMetadata:
    """The step's metadata (see the module docstring). ``cache_kv``: one layer's cache tensor (its device and
    dtype choose the kernels); ``forced_path``: the configured attention path (``auto`` decides by cost)."""
    if par.sharded_cache:
        slots, seq_lens = local_latent_view(batch.positions, batch.slot_mapping, batch.token_seq_lens,
                                            batch.block_size, par)
    else:
        slots, seq_lens = batch.slot_mapping, batch.token_seq_lens
    path = choose_path(batch, dims, forced_path, par.sharded_cache)
    meta = AttentionMetadata(batch, rope, slots, seq_lens, path, host_cu_seqlens(batch))
    if (par.sharded_cache or quantised_cache or forced_path == "naive"
            or resolve_backend(backend, cache_kv) != "torch"):
        return meta
    # CPU, float cache: the leading decodes and short chunks share one gather plan; the chunks after them attend apart
    key_bytes = cache_kv.shape[-1] * cache_kv.element_size()
    seqs, d = batch.leading_short(PLANNED_MAX_QUERY_LEN, PLANNED_EXTRA_KEY_BYTES // key_bytes)
    if not d:
        return meta
    plan = _plan(batch, seqs, d, cache_kv.device)
    rest = None
    if seqs < batch.num_seqs:
        tail = batch.tail(seqs)
        rest = AttentionMetadata(tail, rope.tail(d), slots[d:], seq_lens[d:],
                                 choose_path(tail, dims, forced_path, False), host_cu_seqlens(tail))
    return AttentionMetadata(batch, rope, slots, seq_lens, path, meta.host_cu_seqlens, plan, d, rest)


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
