"""DeepSeek Sparse Attention (DSA): the lightning indexer's key cache, its top-k selection, and MLA over the
selected tokens.

Indexer key cache (one tensor per layer, sharing the latent cache's block ids and block tables)::

    cache  [num_blocks, block_size, d_I]            float32 / bfloat16 / float16, or float8_e4m3fn
    scales [num_blocks, block_size, ⌈d_I / 128⌉]    float32, only for fp8: one scale per group of 128 values

fp8 quantisation is symmetric absmax per token and group: ``scale = amax / 448`` (amax 0: scale 1),
``stored = float8_e4m3fn(clamp(x / scale, -448, 448))``; the dequantised value is ``stored * scale``.

Indexer scores of query row t (block-table row ``req_indices[t]``, seeing positions ``j < key_lens[t]``)::

    score[t, j] = Σ_h w[t, h] relu(q[t, h] · k_j)          (every positive scale already folded into w)

``indexer_topk`` keeps the ``topk`` positions of highest score, in descending order; a row seeing at most
``topk`` keys keeps all of them, ``0 .. key_len - 1``, then ``-1`` padding.

Sparse MLA (absorbed, as ``mla_decode``) of query row t over its selected positions ``indices[t]`` (``-1``: none)::

    s_j = sm_scale (q[:d_c]·c_j + q[d_c:]·k_r_j),   out = Σ_j softmax(s)_j c_j,   lse = log Σ_j exp(s_j)

A row without any selected position gets out 0 and lse -inf. ``sparse_plan`` turns a selection into the CPU
gather plan of ``decode_cpu`` (valid slots first, padding repeating the row's last valid slot).

The torch paths work on groups of query rows whose temporaries stay within a byte budget (a prefill can hold
16k rows over 16k keys); the Triton paths run one program per (query row, key tile) for the scores and one per
(query row, head tile) for the attention, walking the selected positions with an online softmax.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from . import cpu_ops
from .common import (
    check_cache,
    check_int_tensor,
    check_triton_cache,
    last_dim_contiguous,
    resolve_backend,
    triton_interpreting,
)
from .decode import _torch_compute_dtype
from .decode_cpu import PLAN_LEN_MULTIPLE, PLANNED_KV_BYTES, DecodePlan
from .dtypes import ACT_DTYPES, FLOAT_CACHE_DTYPES
from .latent_store import _quantize

INDEX_SCALE_GROUP = 128  # values of an fp8 indexer key sharing one scale
INDEX_CACHE_DTYPES = FLOAT_CACHE_DTYPES + (torch.float8_e4m3fn,)
_FP8_MAX = 448.0
# torch paths: gathered keys per group of rows, and per-chunk temporaries (head logits, scores, probabilities)
_TORCH_KEY_BYTES = PLANNED_KV_BYTES
_TORCH_LOGIT_BYTES = 64 << 20
# Triton scores: the score matrix is built (and reduced by topk) in chunks of rows of about this many bytes
_TRITON_SCORE_BYTES = 256 << 20
_BLOCK_H = 16  # heads per tile (tl.dot needs >= 16 rows; fewer heads are masked)


def index_scale_groups(d_index: int) -> int:
    """Scales per token of an fp8 indexer key of ``d_index`` values."""
    return -(-d_index // INDEX_SCALE_GROUP)


# ----------------------------------------------------------------------------------------------------------------
# indexer key cache: store and read back


def _check_index_cache(cache: torch.Tensor, scales: torch.Tensor | None) -> None:
    if cache.dim() != 3:
        raise ValueError(f"index cache must be [num_blocks, block_size, d_I], got shape {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError("index cache must be contiguous in its last dimension")
    if cache.dtype in FLOAT_CACHE_DTYPES:
        if scales is not None:
            raise ValueError(f"scales must be None for an unquantised {cache.dtype} index cache")
    elif cache.dtype == torch.float8_e4m3fn:
        want = (cache.shape[0], cache.shape[1], index_scale_groups(cache.shape[2]))
        if scales is None:
            raise ValueError(f"scales {list(want)} float32 are required for a float8_e4m3fn index cache")
        if tuple(scales.shape) != want or scales.dtype != torch.float32:
            raise ValueError(f"index scales must be float32 {want}, got {scales.dtype} {tuple(scales.shape)}")
        if scales.stride(-1) != 1 or scales.device != cache.device:
            raise ValueError("index scales must be contiguous in their last dimension and on the cache's device")
    else:
        raise ValueError(f"index cache dtype must be one of {INDEX_CACHE_DTYPES}, got {cache.dtype}")


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys ``[T, d_I]`` -> (float8_e4m3fn ``[T, d_I]``, scales float32 ``[T, ⌈d_I / 128⌉]``), per token and group."""
    n_tok, d_index = keys.shape
    groups = index_scale_groups(d_index)
    x = keys.float()
    padded = torch.nn.functional.pad(x, (0, groups * INDEX_SCALE_GROUP - d_index)).view(n_tok, groups, -1)
    amax = padded.abs().amax(dim=-1)  # [T, G]
    scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
    y = x / scale.repeat_interleave(INDEX_SCALE_GROUP, dim=1)[:, :d_index]
    return y.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn), scale


def _dequantize_index(rows: torch.Tensor, row_scales: torch.Tensor | None) -> torch.Tensor:
    """rows ``[..., d_I]`` (cache dtype), row_scales ``[..., G]`` or None -> float32 ``[..., d_I]``."""
    out = rows.float()
    if row_scales is None:
        return out
    return out.mul_(row_scales.repeat_interleave(INDEX_SCALE_GROUP, dim=-1)[..., : rows.shape[-1]])


@triton.jit
def _store_index_kernel(
    keys_ptr, slot_ptr, cache_ptr, scales_ptr,
    stride_kt, stride_cb, stride_cs, stride_sb, stride_ss,
    d_index,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, QUANT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # one (token, scale group) per program
    g = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs = g * GROUP + tl.arange(0, BLOCK_G)
    mask = offs < d_index
    x = tl.load(keys_ptr + t * stride_kt + offs, mask=mask, other=0.0)
    if QUANT:
        x, scale = _quantize(x.to(tl.float32), mask, 448.0, False)
        tl.store(scales_ptr + blk * stride_sb + off * stride_ss + g, scale)
    tl.store(cache_ptr + blk * stride_cb + off * stride_cs + offs, x.to(cache_ptr.dtype.element_ty), mask=mask)


def _store_index_torch(cache: torch.Tensor, scales: torch.Tensor | None, keys: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // cache.shape[1], slots % cache.shape[1]
    if scales is not None:
        values, key_scales = quantize_index_keys(keys[keep])
        cache[blk, off] = values
        scales[blk, off] = key_scales
    else:
        cache[blk, off] = keys[keep].to(cache.dtype)


def _store_index_triton(cache: torch.Tensor, scales: torch.Tensor | None, keys: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    n_tok, d_index = keys.shape
    quant = scales is not None
    if not quant:  # a plain copy: convert in torch (exact rounding)
        keys = keys.to(cache.dtype)
    sc = scales if scales is not None else cache  # dummy pointer when unquantised
    groups = index_scale_groups(d_index)
    _store_index_kernel[(n_tok, groups)](
        keys, slot_mapping, cache, sc,
        keys.stride(0), cache.stride(0), cache.stride(1), sc.stride(0), sc.stride(1),
        d_index,
        BLOCK_SIZE=cache.shape[1], GROUP=INDEX_SCALE_GROUP,
        BLOCK_G=triton.next_power_of_2(min(d_index, INDEX_SCALE_GROUP)), QUANT=quant,
    )


def store_index_keys(cache: torch.Tensor, scales: torch.Tensor | None, keys: torch.Tensor,
                     slot_mapping: torch.Tensor, backend: str | None = None) -> None:
    """Write each token's indexer key into its slot of the index cache, in place (fp8: quantised per group).

    cache ``[num_blocks, block_size, d_I]`` float or float8_e4m3fn, scales ``[num_blocks, block_size, ⌈d_I / 128⌉]``
    float32 for fp8 else None, keys ``[T, d_I]`` float, slot_mapping ``[T]`` int32/int64 (negative: skip the token).
    """
    _check_index_cache(cache, scales)
    if keys.dim() != 2 or keys.shape[1] != cache.shape[2] or keys.dtype not in ACT_DTYPES:
        raise ValueError(f"keys must be [T, d_I={cache.shape[2]}] float32/bfloat16/float16, got {keys.dtype} "
                         f"{tuple(keys.shape)}")
    if keys.device != cache.device:
        raise ValueError(f"keys are on {keys.device}, the index cache on {cache.device}")
    check_int_tensor("slot_mapping", slot_mapping, 1, cache.device, (torch.int32, torch.int64))
    if slot_mapping.shape[0] != keys.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {keys.shape[0]} keys")
    if keys.shape[0] == 0:
        return
    keys = last_dim_contiguous(keys)
    if resolve_backend(backend, cache) == "triton":
        check_triton_cache(cache)
        _store_index_triton(cache, scales, keys, slot_mapping)
    else:
        _store_index_torch(cache, scales, keys, slot_mapping)


def index_key_rows(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """The dequantised indexer keys of flat cache slots ``slots [N]`` -> float32 ``[N, d_I]`` (a negative slot
    reads as zeros)."""
    _check_index_cache(cache, scales)
    check_int_tensor("slots", slots, 1, cache.device, (torch.int32, torch.int64))
    valid = slots >= 0
    flat = torch.where(valid, slots, 0).long()
    rows = cache.view(-1, cache.shape[2]).index_select(0, flat)
    row_scales = None if scales is None else scales.view(-1, scales.shape[2]).index_select(0, flat)
    return _dequantize_index(rows, row_scales).masked_fill_(~valid[:, None], 0.0)


# ----------------------------------------------------------------------------------------------------------------
# lightning indexer: scores and top-k


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, cache_ptr, scales_ptr, block_tables_ptr, req_ptr, key_lens_ptr, out_ptr,
    n_heads, d_index, row0,
    stride_qt, stride_qh, stride_wt, stride_cb, stride_cs, stride_sb, stride_ss, stride_bt, stride_ot,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, NUM_GROUPS: tl.constexpr, QUANT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)  # row of this chunk; query row row0 + i
    tile = tl.program_id(1)
    t = row0 + i
    key_len = tl.load(key_lens_ptr + t)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # key positions in the sequence
    mask_n = offs_n < key_len
    out_row = out_ptr + i * stride_ot
    if tile * BLOCK_N >= key_len:  # nothing to score: the whole tile is past the row's keys
        tl.store(out_row + offs_n, tl.full([BLOCK_N], float("-inf"), dtype=tl.float32))
        return
    req = tl.load(req_ptr + t).to(tl.int64)
    blk = tl.load(block_tables_ptr + req * stride_bt + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    off = offs_n % BLOCK_SIZE
    key_row = cache_ptr + blk * stride_cb + off * stride_cs  # [BLOCK_N]
    offs_g = tl.arange(0, BLOCK_G)
    offs_h = tl.arange(0, BLOCK_H)
    score = tl.zeros([BLOCK_N], dtype=tl.float32)
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + offs_h
        mask_h = heads < n_heads
        q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh  # [BLOCK_H, 1]
        logits = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for g in range(NUM_GROUPS):  # per scale group: the scale multiplies the group's dot products
            dims = g * GROUP + offs_g
            mask_d = dims < d_index
            q = tl.load(q_row + dims[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
            k = tl.load(key_row[:, None] + dims[None, :], mask=mask_n[:, None] & mask_d[None, :],
                        other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_G]
            part = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
            if QUANT:
                scale = tl.load(scales_ptr + blk * stride_sb + off * stride_ss + g, mask=mask_n, other=0.0)
                part = part * scale[None, :]
            logits += part
        w = tl.load(w_ptr + t * stride_wt + heads, mask=mask_h, other=0.0)
        score += tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0)
    tl.store(out_row + offs_n, tl.where(mask_n, score, float("-inf")))


def _check_indexer_args(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                        block_tables: torch.Tensor, req_indices: torch.Tensor, key_lens: torch.Tensor) -> None:
    _check_index_cache(cache, scales)
    if q.dim() != 3 or q.shape[2] != cache.shape[2] or not q.is_floating_point():
        raise ValueError(f"q must be [T, n_I, d_I={cache.shape[2]}] float, got {q.dtype} {tuple(q.shape)}")
    n_rows, n_heads = q.shape[0], q.shape[1]
    if weights.shape != (n_rows, n_heads) or not weights.is_floating_point():
        raise ValueError(f"weights must be float [T={n_rows}, n_I={n_heads}], got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if q.device != cache.device or weights.device != cache.device:
        raise ValueError(f"q and weights must be on the index cache's device {cache.device}")
    check_int_tensor("block_tables", block_tables, 2, cache.device)
    check_int_tensor("req_indices", req_indices, 1, cache.device, (torch.int32, torch.int64))
    check_int_tensor("key_lens", key_lens, 1, cache.device, (torch.int32, torch.int64))
    if req_indices.shape[0] != n_rows or key_lens.shape[0] != n_rows:
        raise ValueError(f"req_indices ({req_indices.shape[0]}) and key_lens ({key_lens.shape[0]}) need one entry "
                         f"per query row ({n_rows})")


def _check_key_lens(key_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> int:
    """The longest row (a host sync); every row must see at least one key, all within its block table."""
    if key_lens.numel() == 0:
        return 0
    lo, hi = (int(v) for v in torch.stack([key_lens.min(), key_lens.max()]).long().tolist())
    if lo < 1:
        raise ValueError(f"every query row must see at least one key, got a key_len of {lo}")
    if hi > block_tables.shape[1] * block_size:
        raise ValueError(f"a key_len of {hi} needs more than the block table's {block_tables.shape[1]} blocks")
    return hi


def _scores_triton(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                   block_tables: torch.Tensor, req_indices: torch.Tensor, key_lens: torch.Tensor, max_len: int,
                   row0: int, row1: int) -> torch.Tensor:
    """Scores of query rows row0 .. row1 - 1 -> float32 ``[row1 - row0, max_len]`` (-inf past each key_len)."""
    d_index = cache.shape[2]
    block_n = 32 if triton_interpreting() else 64
    n_tiles = triton.cdiv(max_len, block_n)
    out = torch.empty(row1 - row0, n_tiles * block_n, dtype=torch.float32, device=q.device)
    quant = scales is not None
    sc = scales if scales is not None else cache  # dummy pointer when unquantised
    # fp32 products: tf32 inputs are exact for bf16/fp16 queries and bf16/fp16/fp8 keys; fp32 operands get ieee
    exact = q.dtype == torch.float32 or cache.dtype == torch.float32 or triton_interpreting()
    _indexer_scores_kernel[(row1 - row0, n_tiles)](
        q, weights, cache, sc, block_tables, req_indices, key_lens, out,
        q.shape[1], d_index, row0,
        q.stride(0), q.stride(1), weights.stride(0), cache.stride(0), cache.stride(1), sc.stride(0), sc.stride(1),
        block_tables.stride(0), out.stride(0),
        BLOCK_SIZE=cache.shape[1], BLOCK_N=block_n, BLOCK_H=_BLOCK_H, GROUP=INDEX_SCALE_GROUP,
        BLOCK_G=max(triton.next_power_of_2(min(d_index, INDEX_SCALE_GROUP)), 16),
        NUM_GROUPS=index_scale_groups(d_index), QUANT=quant, DOT_PRECISION="ieee" if exact else "tf32",
        num_warps=4,
    )
    return out[:, :max_len]


def _triton_score_chunks(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                         block_tables: torch.Tensor, req_indices: torch.Tensor, key_lens: torch.Tensor,
                         max_len: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(row ids, scores [n, max_len]) over chunks of rows within the Triton byte budget."""
    step = max(1, _TRITON_SCORE_BYTES // (4 * max_len))
    for r0 in range(0, q.shape[0], step):
        r1 = min(r0 + step, q.shape[0])
        yield (torch.arange(r0, r1, device=q.device),
               _scores_triton(q, weights, cache, scales, block_tables, req_indices, key_lens, max_len, r0, r1))


def _gather_index_keys(cache: torch.Tensor, scales: torch.Tensor | None, block_rows: torch.Tensor,
                       row_len: torch.Tensor) -> torch.Tensor:
    """Whole blocks of R block-table rows -> float32 keys ``[R, L, d_I]``; zero past each row's length (unused
    slots and pages may hold anything, NaN included)."""
    n_seq, n_blk = block_rows.shape
    block_size, d_index = cache.shape[1], cache.shape[2]
    used = torch.arange(n_blk, device=cache.device)[None, :] * block_size < row_len[:, None]  # [R, n_blk]
    blk = torch.where(used, block_rows, 0).long()  # unused entries may point anywhere, e.g. out of range
    keys = cache[blk].view(n_seq, n_blk * block_size, d_index)
    key_scales = None if scales is None else scales[blk].view(n_seq, n_blk * block_size, scales.shape[2])
    keys = _dequantize_index(keys, key_scales)
    past_end = torch.arange(n_blk * block_size, device=cache.device)[None, :] >= row_len[:, None]
    return keys.masked_fill_(past_end[..., None], 0.0)


def _torch_score_chunks(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                        block_tables: torch.Tensor, req_indices: torch.Tensor,
                        key_lens: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(row ids [n], scores [n, L]) over chunks of query rows, L the longest key_len among them, -inf past each
    row's own key_len. Rows sharing a block-table row (a prefill chunk) share one gather of their keys and are
    batched as one padded entry ``[Q, n_I, d_I]``; the head logits of a chunk stay within _TORCH_LOGIT_BYTES."""
    n_rows, n_heads, d_index = q.shape
    dev = q.device
    lens = key_lens.long()
    block_size = cache.shape[1]
    rows, row_of = torch.unique(req_indices.long(), return_inverse=True)  # [R], [T]
    n_seq = len(rows)
    counts = torch.bincount(row_of, minlength=n_seq)
    row_len = torch.zeros(n_seq, dtype=torch.long, device=dev).scatter_reduce_(0, row_of, lens, "amax")
    # rank of each query row within its block-table row, longest first: a chunk's first rows are its longest
    order = torch.argsort(row_of * (int(row_len.max()) + 1) - lens, stable=True)
    rank = torch.empty_like(row_of)
    rank[order] = torch.arange(n_rows, device=dev) - (counts.cumsum(0) - counts)[row_of[order]]
    max_q = int(counts.max())
    q_pad = torch.zeros(n_seq, max_q, n_heads, d_index, dtype=torch.float32, device=dev)
    q_pad[row_of, rank] = q.float()
    w_pad = torch.zeros(n_seq, max_q, n_heads, dtype=torch.float32, device=dev)
    w_pad[row_of, rank] = weights.float()
    len_pad = torch.zeros(n_seq, max_q, dtype=torch.long, device=dev)
    len_pad[row_of, rank] = lens
    id_pad = torch.full((n_seq, max_q), -1, dtype=torch.long, device=dev)
    id_pad[row_of, rank] = torch.arange(n_rows, device=dev)

    host_row_len = row_len.tolist()
    seq_order = sorted(range(n_seq), key=lambda r: -host_row_len[r])  # similar lengths share a group
    r0 = 0
    while r0 < n_seq:
        group_len = host_row_len[seq_order[r0]]  # the longest of the group
        n_blk = -(-group_len // block_size)
        key_bytes, logit_bytes = n_blk * block_size * d_index * 4, n_heads * group_len * 4  # per block-table row
        r1 = min(n_seq, r0 + max(1, min(_TORCH_KEY_BYTES // key_bytes, _TORCH_LOGIT_BYTES // logit_bytes)))
        sel = torch.tensor(seq_order[r0:r1], device=dev)
        n_g = r1 - r0
        keys = _gather_index_keys(cache, scales, block_tables[rows[sel], :n_blk], row_len[sel])  # [G, L, d_I]
        q_step = max(1, _TORCH_LOGIT_BYTES // (4 * n_g * n_heads * group_len))
        for q0 in range(0, max_q, q_step):
            q1 = min(q0 + q_step, max_q)
            len_c = len_pad[sel, q0:q1]  # [G, Q]
            length = int(len_c.max())
            if length == 0:  # ranks sort longest first: every later chunk is padding too
                break
            n_q = q1 - q0
            logits = torch.bmm(q_pad[sel, q0:q1].view(n_g, n_q * n_heads, d_index),
                               keys[:, :length].transpose(1, 2)).relu_()  # [G, Q * n_I, L]
            scores = torch.bmm(w_pad[sel, q0:q1].view(n_g * n_q, 1, n_heads),
                               logits.view(n_g * n_q, n_heads, length)).view(n_g * n_q, length)
            hidden = torch.arange(length, device=dev)[None, :] >= len_c.reshape(-1, 1)
            scores.masked_fill_(hidden, float("-inf"))
            ids = id_pad[sel, q0:q1].reshape(-1)
            real = ids >= 0
            yield ids[real], scores[real]
        r0 = r1


def _op_score_chunks(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                     block_tables: torch.Tensor, req_indices: torch.Tensor,
                     key_lens: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The compiled CPU operator over chunks of query rows whose score rows stay within _TORCH_LOGIT_BYTES. It
    reads each key where the block table puts it, widening it on the fly: no gathered copy of the keys."""
    n_rows = q.shape[0]
    lens = key_lens.long()
    host_lens = lens.tolist()
    q, weights = q.float().contiguous(), weights.float().contiguous()
    tables = block_tables.to(torch.int32)
    t0 = 0
    while t0 < n_rows:
        t1, longest = t0, 0
        while t1 < n_rows and (t1 == t0 or 4 * (t1 - t0 + 1) * max(longest, host_lens[t1]) <= _TORCH_LOGIT_BYTES):
            longest = max(longest, host_lens[t1])
            t1 += 1
        scores = torch.ops.mla_kernels.indexer_scores(q[t0:t1], weights[t0:t1], cache, scales, tables,
                                                      req_indices[t0:t1], lens[t0:t1], longest)
        yield torch.arange(t0, t1, device=q.device), scores
        t0 = t1


def cpu_operator_enabled() -> bool:
    """Whether the CPU paths score with the compiled operator (``mla_kernels.cpu_ops``); tests switch it off
    through ``use_cpu_operator`` to run the torch path on the same machine."""
    return _USE_CPU_OPERATOR[0] and cpu_ops.available()


_USE_CPU_OPERATOR = [True]


def use_cpu_operator(enabled: bool) -> None:
    _USE_CPU_OPERATOR[0] = bool(enabled)


def _score_chunks(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                  block_tables: torch.Tensor, req_indices: torch.Tensor, key_lens: torch.Tensor, max_len: int,
                  backend: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    if backend == "triton":
        return _triton_score_chunks(q, weights, cache, scales, block_tables, req_indices, key_lens, max_len)
    if q.device.type == "cpu" and cpu_operator_enabled():
        return _op_score_chunks(q, weights, cache, scales, block_tables, req_indices, key_lens)
    return _torch_score_chunks(q, weights, cache, scales, block_tables, req_indices, key_lens)


def _prepare_indexer(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                     block_tables: torch.Tensor, req_indices: torch.Tensor, key_lens: torch.Tensor,
                     backend: str | None) -> tuple[torch.Tensor, torch.Tensor, int, str]:
    _check_indexer_args(q, weights, cache, scales, block_tables, req_indices, key_lens)
    max_len = _check_key_lens(key_lens, block_tables, cache.shape[1])
    resolved = resolve_backend(backend, q)
    if resolved == "triton":
        check_triton_cache(cache)
        q, weights = last_dim_contiguous(q), last_dim_contiguous(weights.float())
    return q, weights, max_len, resolved


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                   block_tables: torch.Tensor, req_indices: torch.Tensor, key_lens: torch.Tensor,
                   backend: str | None = None) -> torch.Tensor:
    """The lightning indexer's scores: float32 ``[T, max(key_lens)]``, -inf past each row's key_len.

    q ``[T, n_I, d_I]`` float (computed in fp32), weights ``[T, n_I]``, cache/scales the index cache, block_tables
    ``[B, max_blocks]`` int32, req_indices ``[T]`` (block-table row of query row t), key_lens ``[T]`` (row t sees
    positions ``0 .. key_lens[t] - 1``; each >= 1). Materialises the whole matrix: for tests and references.
    """
    q, weights, max_len, resolved = _prepare_indexer(q, weights, cache, scales, block_tables, req_indices,
                                                     key_lens, backend)
    out = torch.full((q.shape[0], max_len), float("-inf"), dtype=torch.float32, device=q.device)
    for ids, scores in _score_chunks(q, weights, cache, scales, block_tables, req_indices, key_lens, max_len,
                                     resolved):
        out[ids, : scores.shape[1]] = scores
    return out


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                 block_tables: torch.Tensor, req_indices: torch.Tensor, key_lens: torch.Tensor, topk: int,
                 backend: str | None = None) -> torch.Tensor:
    """Each query row's ``topk`` key positions of highest indexer score -> int32 ``[T, topk]``.

    Arguments as ``indexer_scores``. Row t holds token positions within its sequence (not slots) in descending
    score order; a row seeing ``key_lens[t] <= topk`` keys holds ``0 .. key_lens[t] - 1`` then ``-1`` padding (the
    reference model keeps every key then). Never holds the whole ``[T, max_len]`` score matrix at once; reads the
    longest key_len back to the host (one sync) and skips the scoring when no row sees more than ``topk`` keys.
    """
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    q, weights, max_len, resolved = _prepare_indexer(q, weights, cache, scales, block_tables, req_indices,
                                                     key_lens, backend)
    n_rows, dev = q.shape[0], q.device
    pos = torch.arange(topk, device=dev, dtype=torch.int32)
    lens = key_lens.to(torch.int32)
    out = torch.where(pos[None, :] < lens[:, None], pos[None, :], -1)  # rows with key_len <= topk: all keys
    if max_len <= topk or n_rows == 0:
        return out
    for ids, scores in _score_chunks(q, weights, cache, scales, block_tables, req_indices, key_lens, max_len,
                                     resolved):
        if scores.shape[1] <= topk:  # every row of the chunk sees at most topk keys: it keeps the default
            continue
        long_rows = lens[ids] > topk  # more than topk finite scores: every pick is a real key
        ids, scores = ids[long_rows], scores[long_rows]
        out[ids] = topk_lowest_first(scores, topk).to(torch.int32)
    return out


def topk_lowest_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The columns of each row's ``k`` highest scores ``[n, k]`` int64, in descending score order, equal scores
    taken lowest column first (NaN counts as -inf); every row needs at least ``k`` columns.

    The indexer's scores tie exactly and often: ``relu`` makes every key that no head scores positively worth
    exactly 0, so the ``k``-th place is often shared. ``torch.topk`` settles a tie by the course of its selection
    algorithm over the whole row, padding included, so a query's choice would depend on how long the other rows of
    its batch are. Lowest position first makes each query's choice a function of its own scores alone: the same in
    every batch, chunking, cache hit and tensor-parallel layout.
    """
    scores = torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    kth = torch.topk(scores, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)  # [n, 1]
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(dim=1, keepdim=True, dtype=torch.int32)  # places left for the tied columns
    keep = above | (tied & (tied.cumsum(dim=1, dtype=torch.int32) <= room))
    cols = keep.nonzero()[:, 1].view(-1, k)  # exactly k per row, ascending
    order = torch.sort(scores.gather(1, cols), dim=1, descending=True, stable=True).indices
    return cols.gather(1, order)


# ----------------------------------------------------------------------------------------------------------------
# sparse MLA attention over the selected positions


@triton.jit
def _sparse_decode_kernel(
    q_ptr, cache_ptr, scales_ptr, block_tables_ptr, req_ptr, idx_ptr, out_ptr, lse_ptr,
    sm_scale, n_heads, d_c, d_r, n_idx, max_pos,
    stride_qn, stride_qh, stride_cb, stride_cs, stride_sb, stride_ss, stride_bt, stride_in,
    stride_on, stride_oh, stride_ln,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
    QUANT: tl.constexpr, COMPUTE_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < n_heads
    req = tl.load(req_ptr + n).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_DC)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_c = offs_c < d_c
    mask_r = offs_r < d_r
    dot_ty = tl.float32 if COMPUTE_FP32 else q_ptr.dtype.element_ty

    q_row = q_ptr + n * stride_qn + heads[:, None] * stride_qh  # [BLOCK_H, 1]
    q_c = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0).to(dot_ty)
    q_r = tl.load(q_row + d_c + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0).to(dot_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], dtype=tl.float32)
    for k0 in range(0, n_idx, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        pos = tl.load(idx_ptr + n * stride_in + offs_k, mask=offs_k < n_idx, other=-1)
        valid = (pos >= 0) & (pos < max_pos)  # -1 (anywhere in the row) selects nothing
        pos = tl.where(valid, pos, 0)
        blk = tl.load(block_tables_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs  # [BLOCK_K]
        c = tl.load(cache_ptr + row[:, None] + offs_c[None, :], mask=valid[:, None] & mask_c[None, :],
                    other=0.0).to(dot_ty)  # [BLOCK_K, BLOCK_DC]
        k_r = tl.load(cache_ptr + row[:, None] + d_c + offs_r[None, :], mask=valid[:, None] & mask_r[None, :],
                      other=0.0).to(dot_ty)
        s_c = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_K]
        s_r = tl.dot(q_r, tl.trans(k_r), input_precision=DOT_PRECISION)
        if QUANT:
            srow = scales_ptr + blk * stride_sb + (pos % BLOCK_SIZE) * stride_ss
            scale_c = tl.load(srow, mask=valid, other=0.0)
            scale_r = tl.load(srow + 1, mask=valid, other=0.0)
            s = s_c * scale_c[None, :] + s_r * scale_r[None, :]
        else:
            s = s_c + s_r
        s = tl.where(valid[None, :], s * sm_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # -inf while no valid position was seen yet
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])  # [BLOCK_H, BLOCK_K]; 0 at invalid positions
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:
            p = p * scale_c[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), c, input_precision=DOT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(nonempty, m_i + tl.log(l_safe), float("-inf"))
    tl.store(out_ptr + n * stride_on + heads[:, None] * stride_oh + offs_c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_h[:, None] & mask_c[None, :])
    tl.store(lse_ptr + n * stride_ln + heads, lse, mask=mask_h)


def _sparse_decode_triton(q: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                          block_tables: torch.Tensor, req_indices: torch.Tensor, indices: torch.Tensor,
                          sm_scale: float, d_c: int) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows, n_heads, width = q.shape
    d_r = width - d_c
    out = torch.empty(n_rows, n_heads, d_c, dtype=q.dtype, device=q.device)
    lse = torch.empty(n_rows, n_heads, dtype=torch.float32, device=q.device)
    quant = scales is not None
    sc = scales if scales is not None else cache  # dummy pointer when unquantised
    block_dc = triton.next_power_of_2(d_c)
    # the CPU interpreter multiplies bf16 tiles as raw integers, so it gets fp32 tiles instead
    compute_fp32 = q.dtype == torch.float32 or (triton_interpreting() and q.dtype == torch.bfloat16)
    block_k = 64 if block_dc <= 256 or triton_interpreting() else 32
    _sparse_decode_kernel[(n_rows, triton.cdiv(n_heads, _BLOCK_H))](
        q, cache, sc, block_tables, req_indices, indices, out, lse,
        sm_scale, n_heads, d_c, d_r, indices.shape[1], block_tables.shape[1] * cache.shape[1],
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), sc.stride(0), sc.stride(1),
        block_tables.stride(0), indices.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        BLOCK_SIZE=cache.shape[1], BLOCK_H=_BLOCK_H, BLOCK_K=block_k,
        BLOCK_DC=block_dc, BLOCK_DR=max(triton.next_power_of_2(d_r), 16),
        QUANT=quant, COMPUTE_FP32=compute_fp32, DOT_PRECISION="ieee" if compute_fp32 else "tf32",
        num_warps=4, num_stages=1 if compute_fp32 else 2,
    )
    return out, lse


def _selected_slots(indices: torch.Tensor, block_tables: torch.Tensor, req_indices: torch.Tensor,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """indices ``[n, K]`` positions -> (flat cache slots ``[n, K]`` int64, 0 where invalid; valid ``[n, K]``)."""
    max_pos = block_tables.shape[1] * block_size
    valid = (indices >= 0) & (indices < max_pos)
    pos = torch.where(valid, indices, 0).long()
    blk = block_tables[req_indices.long()].long().gather(1, pos // block_size)
    return torch.where(valid, blk * block_size + pos % block_size, 0), valid


def _sparse_decode_torch(q: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                         block_tables: torch.Tensor, req_indices: torch.Tensor, indices: torch.Tensor,
                         sm_scale: float, d_c: int) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows, n_heads, width = q.shape
    n_idx = indices.shape[1]
    compute = _torch_compute_dtype(q.dtype)
    flat = cache.view(-1, width)
    flat_scales = None if scales is None else scales.view(-1, 2)
    out = torch.empty(n_rows, n_heads, d_c, dtype=q.dtype, device=q.device)
    lse = torch.empty(n_rows, n_heads, dtype=torch.float32, device=q.device)
    row_bytes = n_idx * (width * compute.itemsize + n_heads * 8)  # gathered keys, scores and probabilities
    group = max(1, PLANNED_KV_BYTES // row_bytes)
    for r0 in range(0, n_rows, group):
        r1 = min(r0 + group, n_rows)
        slots, valid = _selected_slots(indices[r0:r1], block_tables, req_indices[r0:r1], cache.shape[1])
        n = r1 - r0
        kv = flat.index_select(0, slots.view(-1)).view(n, n_idx, width).to(compute)
        kv.masked_fill_(~valid[..., None], 0.0)  # unselected rows may be NaN poison: keep it out of the matmuls
        qc = q[r0:r1].to(compute)
        kv_t = kv.transpose(1, 2)  # [n, D, K]
        if flat_scales is None:
            scores = torch.bmm(qc, kv_t).float()  # [n, H, K]
            scale_c = None
        else:  # per-token scales multiply the dot products, as in the Triton kernel
            tok = flat_scales.index_select(0, slots.view(-1)).view(n, 1, n_idx, 2).masked_fill(~valid[:, None, :, None],
                                                                                                0.0)
            scale_c = tok[..., 0]
            scores = torch.bmm(qc[..., :d_c], kv_t[:, :d_c]).float().mul_(scale_c)
            scores += torch.bmm(qc[..., d_c:], kv_t[:, d_c:]).float().mul_(tok[..., 1])
        scores.mul_(sm_scale).masked_fill_(~valid[:, None, :], float("-inf"))
        m = scores.amax(dim=-1)  # [n, H]
        m = torch.where(torch.isfinite(m), m, 0.0)  # no valid position: p = 0, out 0, lse -inf
        p = torch.exp(scores.sub_(m[..., None]))
        denom = p.sum(dim=-1)
        if scale_c is not None:
            p.mul_(scale_c)
        o = torch.bmm(p.to(compute), kv[..., :d_c]).float()
        out[r0:r1] = (o / torch.where(denom > 0, denom, 1.0)[..., None]).to(q.dtype)
        lse[r0:r1] = m + torch.log(denom)
    return out, lse


def _check_selection(indices: torch.Tensor, req_indices: torch.Tensor, n_rows: int, device: torch.device) -> None:
    check_int_tensor("indices", indices, 2, device, (torch.int32, torch.int64))
    check_int_tensor("req_indices", req_indices, 1, device, (torch.int32, torch.int64))
    if indices.shape[0] != n_rows or req_indices.shape[0] != n_rows:
        raise ValueError(f"indices ({indices.shape[0]} rows) and req_indices ({req_indices.shape[0]}) need one "
                         f"entry per query row ({n_rows})")


def sparse_mla_decode(q: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor,
                      req_indices: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_c: int,
                      backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of each query row over only its selected token positions.

    q ``[T, H, d_c + d_r]``, cache ``[num_blocks, block_size, d_c + d_r]`` latent cache (scales ``[num_blocks,
    block_size, 2]`` fp32 for fp8/int8, else None), block_tables ``[B, max_blocks]`` int32, req_indices ``[T]``
    (block-table row of query row t), indices ``[T, K]`` int32 token positions within row t's sequence, in any order
    (``-1``: skip, anywhere in the row). Returns out ``[T, H, d_c]`` in q.dtype and lse ``[T, H]`` float32; a row
    without any selected position gets out 0 and lse -inf.
    """
    check_cache(cache, scales)
    if q.dim() != 3 or q.dtype not in ACT_DTYPES:
        raise ValueError(f"q must be [T, H, d_c + d_r] float32/bfloat16/float16, got {q.dtype} {tuple(q.shape)}")
    if q.shape[2] != cache.shape[2]:
        raise ValueError(f"q width {q.shape[2]} must equal the cache row width d_c + d_r = {cache.shape[2]}")
    if q.device != cache.device:
        raise ValueError(f"q is on {q.device}, the cache on {cache.device}")
    if not 0 < d_c < cache.shape[2]:
        raise ValueError(f"d_c must satisfy 0 < d_c < {cache.shape[2]}, got {d_c}")
    check_int_tensor("block_tables", block_tables, 2, q.device)
    _check_selection(indices, req_indices, q.shape[0], q.device)
    n_rows, n_heads = q.shape[0], q.shape[1]
    if n_rows == 0 or indices.shape[1] == 0:
        return (torch.zeros(n_rows, n_heads, d_c, dtype=q.dtype, device=q.device),
                torch.full((n_rows, n_heads), float("-inf"), dtype=torch.float32, device=q.device))
    q = last_dim_contiguous(q)
    if resolve_backend(backend, q) == "triton":
        check_triton_cache(cache)
        return _sparse_decode_triton(q, cache, scales, block_tables, req_indices, last_dim_contiguous(indices),
                                     float(sm_scale), d_c)
    return _sparse_decode_torch(q, cache, scales, block_tables, req_indices, indices, float(sm_scale), d_c)


def sparse_plan(indices: torch.Tensor, block_tables: torch.Tensor, req_indices: torch.Tensor,
                block_size: int) -> DecodePlan:
    """A selection ``indices [T, K]`` (token positions, ``-1``: none) as the CPU gather plan of ``decode_cpu``:
    row n's valid slots first (in their order in the row), padding repeating its last valid slot with mask -inf,
    the width rounded up to ``PLAN_LEN_MULTIPLE``, ``lens`` the valid count. ``mla_decode_planned`` (and the
    compiled decode kernel, which reads ``slots[n, :lens[n]]``) then attend over exactly the selected keys.
    Every row needs at least one valid index."""
    check_int_tensor("block_tables", block_tables, 2, block_tables.device)
    _check_selection(indices, req_indices, indices.shape[0], block_tables.device)
    n_rows = indices.shape[0]
    if n_rows == 0:
        raise ValueError("sparse_plan needs at least one query row")
    slots, valid = _selected_slots(indices, block_tables, req_indices, block_size)
    lens = valid.sum(dim=1)  # [T] int64
    if int(lens.min()) < 1:
        raise ValueError("every query row of a sparse plan needs at least one valid index")
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # valid positions first, in row order
    compact = slots.gather(1, order)  # [T, K]
    width = -(-int(lens.max()) // PLAN_LEN_MULTIPLE) * PLAN_LEN_MULTIPLE
    pos = torch.arange(width, device=indices.device)
    last = (lens - 1).unsqueeze(1)
    plan_slots = compact.gather(1, torch.minimum(pos[None, :], last))  # padding repeats the last valid slot
    mask = torch.where(pos[None, :] > last, float("-inf"), 0.0).unsqueeze(1)  # [T, 1, L] float32
    return DecodePlan(slots=plan_slots.contiguous(), mask=mask, max_len=width, lens=lens)
