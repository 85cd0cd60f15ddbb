"""Absorbed MLA decode on CPU, planned once per step and shared by every layer.

A decode step runs the same attention pattern in every layer: query row n reads the first
``seq_lens[n]`` latent rows of block-table row ``req_indices[n]``. ``plan_decode`` turns the block
table into that pattern once — the flat cache slot of every key, padded to the longest row, and an
additive mask — and ``mla_decode_planned`` then needs three GEMM-shaped calls per layer::

    kv  = cache.view(-1, D)[slots]                    # [N, L, D], D = d_c + d_r; one gather
    s   = mask + sm_scale · q kvᵀ                      # [N, H, L]; one batched GEMM (d_c and d_r parts together)
    out = softmax(s) kv[..., :d_c]                     # [N, H, d_c]; one batched GEMM

Padding keys repeat the row's last real key (a slot this step has written), so no read ever leaves the
row's own tokens: unused pages may hold anything, NaN included, and the -inf mask gives the padding
exactly zero weight. Every row must see at least one key (a decoding row always sees itself).

Query rows are processed in groups whose gathered keys fit ``PLANNED_KV_BYTES`` (a usual decode step is one
group; 64 rows of 8,192 fp32 keys would otherwise gather 1.2 GB per layer).

The padded length ``L`` is rounded up to a multiple of ``PLAN_LEN_MULTIPLE``: oneDNN, which runs the
batched GEMMs, builds (JIT-compiles) a kernel for every new shape, and a length that grows by one each
step made that a new kernel every step — measured on a 2-core EPYC, the two GEMMs of a bf16 batch-1 layer
take 80 µs at a fixed length and 1.5 ms when the length changes (fp32: 70 vs 150 µs).

Semantics are those of ``mla_decode`` (``reference.ref_mla_decode``) for float caches and of its torch path
in bf16: with bf16 queries and cache the two GEMMs take bf16 inputs (fp32 accumulation, the dot products
rounded to bf16, as in transformers' bf16 attention) and the scale, mask and softmax run in fp32; every other
combination computes in fp32. An fp8/int8 cache comes with its per-token scales: each gathered row is dequantised
(``common.dequantize_rows``) and attended in fp32. CUDA tensors use ``mla_decode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .common import check_int_tensor, dequantize_rows
from .dtypes import FLOAT_CACHE_DTYPES

PLAN_LEN_MULTIPLE = 32
PLANNED_KV_BYTES = 256 << 20  # gathered keys per group of query rows: bounds a large batch's transient memory


@dataclass
class DecodePlan:
    slots: torch.Tensor  # [N, L] int64: cache slot of key j of query row n (padding: the row's last key)
    mask: torch.Tensor  # [N, 1, L] float32: 0 for j < seq_lens[n], -inf after
    max_len: int  # L: the longest row, rounded up to a multiple of PLAN_LEN_MULTIPLE
    lens: torch.Tensor  # [N] int64: seq_lens (the keys of each row; what the compiled decode kernel reads)


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                req_indices: torch.Tensor | None = None, len_range: tuple[int, int] | None = None) -> DecodePlan:
    """block_tables ``[B, max_blocks]`` int32, seq_lens ``[N]`` int32 (each >= 1), req_indices ``[N]`` (block-table
    row of query row n; default n) -> the step's ``DecodePlan``. ``len_range``: the smallest and largest of
    ``seq_lens`` when the caller knows them on the host (saves reading them back)."""
    check_int_tensor("block_tables", block_tables, 2, block_tables.device)
    check_int_tensor("seq_lens", seq_lens, 1, block_tables.device)
    lens = seq_lens.long().contiguous()
    n_rows = lens.shape[0]
    if n_rows == 0:
        raise ValueError("plan_decode needs at least one query row")
    lo, hi = len_range if len_range is not None else (int(v) for v in torch.stack([lens.min(), lens.max()]).tolist())
    if lo < 1:
        raise ValueError(f"every query row must see at least one key, got a seq_len of {lo}")
    if hi > block_tables.shape[1] * block_size:
        raise ValueError(f"a seq_len of {hi} needs more than the block table's {block_tables.shape[1]} blocks")
    rows = block_tables if req_indices is None else block_tables.index_select(0, req_indices.long())
    hi = -(-hi // PLAN_LEN_MULTIPLE) * PLAN_LEN_MULTIPLE  # a few shapes, not one per step
    pos = torch.arange(hi, device=lens.device)
    last = (lens - 1).unsqueeze(1)
    key = torch.minimum(pos, last)  # [N, L]: padding repeats the last key
    slots = rows.long().gather(1, key // block_size) * block_size + key % block_size
    mask = torch.where(pos > last, float("-inf"), 0.0).unsqueeze(1)  # [N, 1, L] float32
    return DecodePlan(slots=slots, mask=mask, max_len=hi, lens=lens)


def plan_decode_lists(block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int], block_size: int,
                      device: torch.device | str = "cpu") -> DecodePlan:
    """``plan_decode`` from host lists — the block table of each query row and its ``seq_len`` — for a small
    plan: the same ``DecodePlan``, built in Python and moved in two tensors instead of a dozen tensor ops."""
    if not seq_lens or len(block_tables) != len(seq_lens):
        raise ValueError("plan_decode_lists needs one block table per query row, and at least one row")
    width = -(-max(seq_lens) // PLAN_LEN_MULTIPLE) * PLAN_LEN_MULTIPLE
    slots: list[int] = []
    mask: list[float] = []
    for table, n in zip(block_tables, seq_lens):
        if not 1 <= n <= len(table) * block_size:
            raise ValueError(f"a seq_len of {n} needs between 1 key and the block table's {len(table)} blocks")
        row = [s for block in table[:-(-n // block_size)] for s in range(block * block_size, (block + 1) * block_size)]
        slots += row[:n] + [row[n - 1]] * (width - n)  # padding repeats the last key
        mask += [0.0] * n + [float("-inf")] * (width - n)
    rows = len(seq_lens)
    return DecodePlan(slots=torch.tensor(slots, dtype=torch.int64, device=device).view(rows, width),
                      mask=torch.tensor(mask, dtype=torch.float32, device=device).view(rows, 1, width),
                      max_len=width, lens=torch.tensor(seq_lens, dtype=torch.int64, device=device))


def mla_decode_planned(q: torch.Tensor, cache: torch.Tensor, plan: DecodePlan, sm_scale: float,
                       d_c: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """q ``[N, H, d_c + d_r]`` (absorbed no-RoPE query, then rotated RoPE query), cache ``[num_blocks,
    block_size, d_c + d_r]`` float, or int8 / fp8 with its ``scales [num_blocks, block_size, 2]`` (each gathered row
    dequantised) -> out ``[N, H, d_c]`` in q.dtype (see the module docstring)."""
    if (cache.dtype not in FLOAT_CACHE_DTYPES) != (scales is not None):
        raise ValueError(f"mla_decode_planned reads float caches, or quantised ones with their scales: a "
                         f"{cache.dtype} cache {'with' if scales is not None else 'without'} scales")
    n_rows, _, width = q.shape
    if width != cache.shape[2] or plan.slots.shape[0] != n_rows:
        raise ValueError(f"q {tuple(q.shape)} does not match the cache width {cache.shape[2]} or the plan's "
                         f"{plan.slots.shape[0]} rows")
    compute = torch.bfloat16 if q.dtype == cache.dtype == torch.bfloat16 else torch.float32
    flat = cache.view(-1, width)
    flat_scales = None if scales is None else scales.view(-1, scales.shape[-1])
    # rows in groups whose gathered keys stay within PLANNED_KV_BYTES (one group for usual decode steps)
    group = max(1, PLANNED_KV_BYTES // (plan.max_len * width * compute.itemsize))
    if group >= n_rows:  # the usual step: no slicing
        return _attend_planned(q, flat, plan.slots.view(-1), plan.mask, sm_scale, d_c, compute, flat_scales)
    outs = []
    for r0 in range(0, n_rows, group):
        r1 = min(r0 + group, n_rows)
        outs.append(_attend_planned(q[r0:r1], flat, plan.slots[r0:r1].reshape(-1), plan.mask[r0:r1], sm_scale,
                                    d_c, compute, flat_scales))
    return torch.cat(outs)


def _attend_planned(q: torch.Tensor, flat: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, sm_scale: float,
                    d_c: int, compute: torch.dtype, flat_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One group of query rows ``q [n, H, D]`` over their gathered keys ``flat[slots]`` (dequantised with
    ``flat_scales [S, 2]`` where given) -> ``[n, H, d_c]``. Every cast here is skipped where it would be a no-op: a
    decode step calls this once per layer."""
    n_rows, width = q.shape[0], flat.shape[1]
    kv = flat.index_select(0, slots)
    if flat_scales is not None:
        kv = dequantize_rows(kv, flat_scales.index_select(0, slots), d_c)
    kv = kv.view(n_rows, -1, width)
    if kv.dtype != compute:
        kv = kv.to(compute)
    if compute == torch.float32:
        q32 = q if q.dtype == torch.float32 else q.float()
        scores = torch.baddbmm(mask, q32, kv.transpose(1, 2), alpha=sm_scale)  # [n, H, L]
        p = torch.softmax(scores, dim=-1)
    else:  # bf16 products, fp32 accumulation; scale, mask and softmax in fp32
        scores = torch.bmm(q, kv.transpose(1, 2)).float().mul_(sm_scale).add_(mask)
        p = torch.softmax(scores, dim=-1).to(compute)
    out = torch.bmm(p, kv[..., :d_c])  # [n, H, d_c]
    return out if out.dtype == q.dtype else out.to(q.dtype)


def write_latent(cache: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``cache[slot_t] = [latent_t ; k_rope_t]`` for a float cache and slots that are all valid (>= 0): the
    decode step's cache write as one copy (``store_latent`` also skips negative slots and quantises)."""
    if cache.dtype not in FLOAT_CACHE_DTYPES:
        raise ValueError(f"write_latent writes float caches; use store_latent for {cache.dtype}")
    rows = torch.cat([latent, k_rope], dim=-1)  # [T, d_c + d_r]
    if rows.shape[-1] != cache.shape[2]:
        raise ValueError(f"latent + k_rope width {rows.shape[-1]} != cache row width {cache.shape[2]}")
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    cache.view(-1, cache.shape[2]).index_copy_(0, slots, rows if rows.dtype == cache.dtype else rows.to(cache.dtype))
