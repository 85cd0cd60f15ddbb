"""``AttentionMetadata``: what every layer's attention needs to know about a step, decided once per step.

The ``ForwardBatch`` says *which* tokens run (ids, positions, slots, block tables). The metadata, made by the
attention backend's ``prepare``, adds *how* the layers attend over them; every layer reads it and none writes it:

- the backend that attends (``backend``): each layer hands it its queries and new latents;
- the RoPE ``cos``/``sin`` of the step's positions (the same for every layer);
- this rank's view of the cache: the slot each new token's latent goes to and how many cached keys each
  query sees (under the sharded layout a rank keeps every N-th token, so both differ from the batch's);
- the attention path of the batch (``absorbed`` or ``naive``, by FLOP count unless a path is forced);
- with the CPU backend and a float cache, the gather plan (``mla_kernels.plan_decode``) of the step's leading
  one-token decodes and short speculative verifications, and the rest of the step as a batch of its own.

``prepare`` is a pure function of the batch, the model's attention settings and the cache, so every
tensor-parallel rank derives its own from the same step message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mla_kernels import DecodePlan
from mla_runtime.attention.rope_tables import RopeTables
from mla_runtime.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from mla_runtime.attention.paged import PagedBackend


@dataclass(frozen=True)
class AttentionDims:
    """The widths that decide the attention path: latent ``d_c``, RoPE ``d_r``, per-head ``d_n`` and ``d_v``."""

    d_c: int
    d_r: int
    d_n: int
    d_v: int


@dataclass(frozen=True)
class AttentionMetadata:
    backend: PagedBackend  # the backend that made it, and that every layer attends through this step
    batch: ForwardBatch
    rope: RopeTables  # the step's RoPE tables (the same for every layer)
    slot_mapping: torch.Tensor  # [T] int64: this rank's cache slot of each new token (-1: another rank's)
    token_seq_lens: torch.Tensor  # [T] int32: this rank's cached keys visible to each new token
    path: str  # "absorbed" or "naive": how the tokens after the planned decodes attend
    host_cu_seqlens: tuple[list[int], list[int]]  # query and key cu_seqlens on the host (no device sync per layer)
    decode_plan: DecodePlan | None = None  # CPU: the gather plan of tokens [:num_planned]
    num_planned: int = 0
    rest: AttentionMetadata | None = None  # the sequences after the planned decodes, as their own batch
    # sparse attention: the tokens each layer's queries attend to (``MLAttention.select``), kept for a next layer that
    # reuses its previous layer's choice: the one thing the layers write into the step's metadata
    selections: dict[int, torch.Tensor | None] = field(default_factory=dict)

    @property
    def all_planned(self) -> bool:
        """Every token of the step is a planned decode row."""
        return self.decode_plan is not None and self.num_planned == self.slot_mapping.shape[0]


def choose_path(batch: ForwardBatch, dims: AttentionDims, forced: str, rows_invariant: bool = False) -> str:
    """``absorbed`` or ``naive`` for the whole batch: decode steps always absorb; otherwise the cheaper of the two by
    a FLOP count per head (the causal half is the same for both), unless ``forced``. A rows-invariant backend's
    prefill rows take ``naive`` always: by the step's count a row's path would follow what shares its step."""
    if forced != "auto":
        return forced
    if batch.is_decode:
        return "absorbed"
    if rows_invariant:
        return "naive"
    pairs = sum(q * k for q, k in zip(batch.query_lens, batch.key_lens))
    keys = sum(batch.key_lens)
    absorbed = pairs * (2 * dims.d_c + dims.d_r) + batch.num_tokens * dims.d_c * (dims.d_n + dims.d_v)
    naive = keys * dims.d_c * (dims.d_n + dims.d_v) + pairs * (dims.d_n + dims.d_r + dims.d_v)
    return "absorbed" if absorbed <= naive else "naive"


def host_cu_seqlens(batch: ForwardBatch) -> tuple[list[int], list[int]]:
    """``cu_seqlens`` of the new tokens and of all keys, as host lists (from the batch's own host lists)."""
    cu_q, cu_k = [0], [0]
    for q, k in zip(batch.query_lens, batch.key_lens):
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + k)
    return cu_q, cu_k
