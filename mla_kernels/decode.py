"""Absorbed MLA attention over the paged latent cache (decode, and short chunks of a chunked prefill).

With weight absorption every head is an MQA head over one shared key ``[c_j ; k_r_j]`` (d_c + d_r wide)
whose value is the latent prefix ``c_j`` (d_c wide). For query row n (block-table row r = req_indices[n])
and head h, with q = q[n, h] = [W_UK_hᵀ q_n ; RoPE(q_r)]:

    s_j   = sm_scale * (q[:d_c]·c_j + q[d_c:]·k_r_j)           j < seq_lens[n]  (tokens of row r)
    out   = Σ_j softmax(s)_j c_j                                -> [N, H, d_c]
    lse   = log Σ_j exp(s_j)                                    -> [N, H]   (seq_len 0: out 0, lse -inf)

fp8/int8 caches store c and k_r with per-token scales σ_c, σ_r; since they are per token they are applied
after the dot products: s_j = sm_scale (σ_c,j q[:d_c]·ĉ_j + σ_r,j q[d_c:]·k̂_r_j), out = Σ_j (p_j σ_c,j) ĉ_j.

Triton: stage 1 runs a grid (N, ⌈H / BLOCK_H⌉, num_kv_splits); each program holds BLOCK_H heads of one
query row and walks its share of the sequence in BLOCK_N-token tiles, loading each latent tile once for all
its heads, with an online softmax. Stage 2 merges the splits by their log-sum-exp:
    m = max_s lse_s,   out = Σ_s e^{lse_s - m} out_s / Σ_s e^{lse_s - m},   lse = m + log Σ_s e^{lse_s - m}.
With one split stage 1 writes the final output directly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import (
    check_cache,
    check_int_tensor,
    check_triton_cache,
    last_dim_contiguous,
    resolve_backend,
    triton_interpreting,
)
from .dtypes import ACT_DTYPES

_BLOCK_H = 16  # heads per program (tl.dot needs >= 16 rows; fewer heads are masked)
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64
# the torch path works on groups of sequences of about this many latent / score bytes (cache-sized temporaries)
_TORCH_KV_BYTES = 8 << 20
_TORCH_SCORE_BYTES = 32 << 20


@triton.jit
def _decode_split_kernel(
    q_ptr, cache_ptr, scales_ptr, block_tables_ptr, seq_lens_ptr, req_ptr, out_ptr, lse_ptr,
    sm_scale, n_heads, d_c, d_r,
    stride_qn, stride_qh, stride_cb, stride_cs, stride_sb, stride_ss, stride_bt,
    stride_on, stride_oh, stride_os, stride_ln, stride_lh, stride_ls,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr, NUM_SPLITS: tl.constexpr,
    QUANT: tl.constexpr, COMPUTE_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)  # part_out offsets can pass 2**31
    head_group = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + n)
    req = tl.load(req_ptr + n).to(tl.int64)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    heads = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < n_heads
    offs_c = tl.arange(0, BLOCK_DC)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_c = offs_c < d_c
    mask_r = offs_r < d_r
    dot_ty = tl.float32 if COMPUTE_FP32 else q_ptr.dtype.element_ty

    # load q for BLOCK_H heads: it stays in registers for the whole sequence walk
    q_row = q_ptr + n * stride_qn + heads[:, None] * stride_qh  # [BLOCK_H, 1]
    q_c = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0).to(dot_ty)
    q_r = tl.load(q_row + d_c + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0).to(dot_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], dtype=tl.float32)
    for tok0 in range(start, end, BLOCK_N):
        offs_n = tok0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end  # never touch the block table or cache past seq_len
        blk = tl.load(block_tables_ptr + req * stride_bt + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
        row = blk.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs  # [BLOCK_N]
        # the latent tile is loaded once and shared by all BLOCK_H heads (as key and as value)
        c = tl.load(cache_ptr + row[:, None] + offs_c[None, :], mask=mask_n[:, None] & mask_c[None, :],
                    other=0.0).to(dot_ty)  # [BLOCK_N, BLOCK_DC]
        k_r = tl.load(cache_ptr + row[:, None] + d_c + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :],
                      other=0.0).to(dot_ty)  # [BLOCK_N, BLOCK_DR]
        s_c = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        s_r = tl.dot(q_r, tl.trans(k_r), input_precision=DOT_PRECISION)
        if QUANT:
            srow = scales_ptr + blk.to(tl.int64) * stride_sb + (offs_n % BLOCK_SIZE) * stride_ss
            scale_c = tl.load(srow, mask=mask_n, other=0.0)  # [BLOCK_N]
            scale_r = tl.load(srow + 1, mask=mask_n, other=0.0)
            s = s_c * scale_c[None, :] + s_r * scale_r[None, :]
        else:
            s = s_c + s_r
        s = tl.where(mask_n[None, :], s * sm_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds at least one token
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:
            p = p * scale_c[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), c, input_precision=DOT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(nonempty, m_i + tl.log(l_safe), float("-inf"))
    out_row = out_ptr + n * stride_on + heads[:, None] * stride_oh + split * stride_os
    tl.store(out_row + offs_c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_c[None, :])
    tl.store(lse_ptr + n * stride_ln + heads * stride_lh + split * stride_ls, lse, mask=mask_h)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    n_heads, d_c,
    stride_pn, stride_ph, stride_ps, stride_qn, stride_qh, stride_qs,
    stride_on, stride_oh, stride_ln, stride_lh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DC: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < n_heads
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = tl.arange(0, BLOCK_DC)
    mask_hc = mask_h[:, None] & (offs_c[None, :] < d_c)
    lse_row = part_lse_ptr + n * stride_qn + heads * stride_qh  # [BLOCK_H]
    mask_hs = mask_h[:, None] & (offs_s[None, :] < NUM_SPLITS)  # [BLOCK_H, BLOCK_S]
    lse_s = tl.load(lse_row[:, None] + offs_s[None, :] * stride_qs, mask=mask_hs, other=float("-inf"))
    m = tl.max(lse_s, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights 0, output 0
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], dtype=tl.float32)
    part_row = part_out_ptr + n * stride_pn + heads[:, None] * stride_ph + offs_c[None, :]  # [BLOCK_H, BLOCK_DC]
    for s in range(NUM_SPLITS):
        w = tl.exp(tl.load(lse_row + s * stride_qs, mask=mask_h, other=float("-inf")) - m)  # empty split -> 0
        denom += w
        acc += w[:, None] * tl.load(part_row + s * stride_ps, mask=mask_hc, other=0.0)
    denom_safe = tl.where(denom > 0, denom, 1.0)
    out = acc / denom_safe[:, None]
    lse = tl.where(denom > 0, m + tl.log(denom_safe), float("-inf"))
    tl.store(out_ptr + n * stride_on + heads[:, None] * stride_oh + offs_c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_hc)
    tl.store(lse_ptr + n * stride_ln + heads * stride_lh, lse, mask=mask_h)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def _default_num_kv_splits(n_rows: int, n_heads: int, max_len_bound: int, device: torch.device) -> int:
    """Enough programs to fill the device (about two waves), but at least 256 tokens per split. Uses only
    shapes (no device sync), so it is CUDA-graph safe; pass num_kv_splits to tune it."""
    sms = _multiprocessors(device)
    programs = n_rows * triton.cdiv(n_heads, _BLOCK_H)
    splits = min(triton.cdiv(2 * sms, programs), triton.cdiv(max_len_bound, _MIN_TOKENS_PER_SPLIT), _MAX_SPLITS)
    return max(splits, 1)


def _mla_decode_triton(q: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, d_c: int,
                       req_indices: torch.Tensor, num_kv_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows, n_heads, width = q.shape
    d_r = width - d_c
    out = torch.empty(n_rows, n_heads, d_c, dtype=q.dtype, device=q.device)
    lse = torch.empty(n_rows, n_heads, dtype=torch.float32, device=q.device)
    if num_kv_splits == 1:  # stage 1 writes the result directly
        part_out, part_lse = out.unsqueeze(2), lse.unsqueeze(2)
    else:
        part_out = torch.empty(n_rows, n_heads, num_kv_splits, d_c, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(n_rows, n_heads, num_kv_splits, dtype=torch.float32, device=q.device)
    quant = scales is not None
    sc = scales if scales is not None else cache  # dummy pointer when unquantised (check_cache: scales iff quantised)
    block_dc = triton.next_power_of_2(d_c)
    # the CPU interpreter multiplies bf16 tiles as raw integers, so it gets fp32 tiles instead
    compute_fp32 = q.dtype == torch.float32 or (triton_interpreting() and q.dtype == torch.bfloat16)
    block_n = 64 if block_dc <= 256 or triton_interpreting() else 32
    grid = (n_rows, triton.cdiv(n_heads, _BLOCK_H), num_kv_splits)
    _decode_split_kernel[grid](
        q, cache, sc, block_tables, seq_lens, req_indices, part_out, part_lse,
        sm_scale, n_heads, d_c, d_r,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), sc.stride(0), sc.stride(1),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        BLOCK_SIZE=cache.shape[1], BLOCK_H=_BLOCK_H, BLOCK_N=block_n,
        BLOCK_DC=block_dc, BLOCK_DR=max(triton.next_power_of_2(d_r), 16), NUM_SPLITS=num_kv_splits,
        QUANT=quant, COMPUTE_FP32=compute_fp32, DOT_PRECISION="ieee" if compute_fp32 else "tf32",
        num_warps=4, num_stages=1 if compute_fp32 else 2,
    )
    if num_kv_splits > 1:
        _merge_splits_kernel[(n_rows, triton.cdiv(n_heads, _BLOCK_H))](
            part_out, part_lse, out, lse,
            n_heads, d_c,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            NUM_SPLITS=num_kv_splits, BLOCK_S=triton.next_power_of_2(num_kv_splits), BLOCK_H=_BLOCK_H,
            BLOCK_DC=block_dc,
        )
    return out, lse


def _rank_within_group(group: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, int]:
    """For each element its index among the elements of the same group, and the largest group size."""
    counts = torch.bincount(group, minlength=n_groups)
    order = torch.argsort(group, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(group)
    rank[order] = torch.arange(group.numel(), device=group.device) - starts[group[order]]
    return rank, int(counts.max())


def _torch_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """bf16 inputs: bf16 matmuls (fp32 accumulation, bf16 result; ~2x faster on CPU); everything else fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _gather_rows(cache: torch.Tensor, scales: torch.Tensor | None, block_rows: torch.Tensor, row_len: torch.Tensor,
                 compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Whole blocks of R block-table rows -> latent [R, L, D] in ``compute`` (fp8/int8 left unscaled) and
    per-token scales [R, L, 2]; everything past a row's length is zeroed (it may be NaN poison)."""
    n_seq, n_blk = block_rows.shape
    block_size, width = cache.shape[1], cache.shape[2]
    used = torch.arange(n_blk, device=cache.device)[None, :] * block_size < row_len[:, None]  # [R, n_blk]
    blk = torch.where(used, block_rows, 0).long()  # unused entries may point anywhere, e.g. out of range
    kv = cache[blk].view(n_seq, n_blk * block_size, width).to(compute)
    pos = torch.arange(n_blk * block_size, device=cache.device)
    past_end = torch.nonzero((pos[None, :] >= row_len[:, None]).flatten()).squeeze(1)
    kv.view(-1, width)[past_end] = 0.0  # 0 * NaN = NaN: the poison must not reach the matmuls
    if scales is None:
        return kv, None
    tok_scales = scales[blk].view(n_seq, n_blk * block_size, 2)
    tok_scales.view(-1, 2)[past_end] = 0.0
    return kv, tok_scales


def _attend(q: torch.Tensor, q_lens: torch.Tensor, kv: torch.Tensor, tok_scales: torch.Tensor | None,
            sm_scale: float, d_c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [R, Q, H, D] over kv [R, L, D], query (r, i) seeing q_lens[r, i] tokens -> (out [R, Q, H, d_c], lse)."""
    n_seq, n_q, n_heads, width = q.shape
    max_len = kv.shape[1]
    q = q.reshape(n_seq, n_q * n_heads, width)
    kv_t = kv.transpose(1, 2)  # [R, D, L]
    if tok_scales is None:  # one matmul covers the d_c and d_r parts
        scores = torch.bmm(q, kv_t).float()  # [R, Q * H, L]
    else:  # per-token scales multiply the dot products, as in the Triton kernel
        scale_c, scale_r = tok_scales[:, None, :, 0], tok_scales[:, None, :, 1]  # [R, 1, L]
        scores = torch.bmm(q[..., :d_c], kv_t[:, :d_c]).float().mul_(scale_c)
        scores += torch.bmm(q[..., d_c:], kv_t[:, d_c:]).float().mul_(scale_r)
    hidden = torch.arange(max_len, device=kv.device)[None, None, :] >= q_lens[..., None]  # [R, Q, L]
    bias = torch.zeros(hidden.shape, device=kv.device).masked_fill_(hidden, float("-inf"))  # shared by all heads
    scores = scores.view(n_seq, n_q, n_heads, max_len).mul_(sm_scale).add_(bias[:, :, None, :])
    m = scores.amax(dim=-1)  # [R, Q, H]
    m = torch.where(torch.isfinite(m), m, 0.0)  # seq_len 0: p = 0, out 0, lse -inf
    p = torch.exp(scores - m[..., None]).view(n_seq, n_q * n_heads, max_len)
    denom = p.sum(dim=-1).view(n_seq, n_q, n_heads)
    if tok_scales is not None:
        p = p * scale_c
    out = torch.bmm(p.to(kv.dtype), kv[..., :d_c]).view(n_seq, n_q, n_heads, d_c)
    return out / torch.where(denom > 0, denom, 1.0)[..., None], m + torch.log(denom)


def _mla_decode_torch(q: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, d_c: int,
                      req_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows, n_heads, width = q.shape
    dev = q.device
    lens = seq_lens.long()
    max_len = int(lens.max())
    if max_len == 0:
        return (torch.zeros(n_rows, n_heads, d_c, dtype=q.dtype, device=dev),
                torch.full((n_rows, n_heads), float("-inf"), dtype=torch.float32, device=dev))
    compute = _torch_compute_dtype(q.dtype)
    n_blk = -(-max_len // cache.shape[1])

    # query rows sharing a block-table row (a chunk) become one padded batch entry: [R, Q, H, D]
    rows, row_of = torch.unique(req_indices.long(), return_inverse=True)  # [R], [N]
    n_seq = len(rows)
    row_len = torch.zeros(n_seq, dtype=torch.long, device=dev).scatter_reduce_(0, row_of, lens, "amax")
    rank, max_q = _rank_within_group(row_of, n_seq)
    q_pad = torch.zeros(n_seq, max_q, n_heads, width, dtype=compute, device=dev)
    q_pad[row_of, rank] = q.to(compute)
    len_pad = torch.zeros(n_seq, max_q, dtype=torch.long, device=dev)
    len_pad[row_of, rank] = lens
    out_pad = torch.empty(n_seq, max_q, n_heads, d_c, dtype=torch.float32, device=dev)
    lse_pad = torch.empty(n_seq, max_q, n_heads, dtype=torch.float32, device=dev)

    # batched over rows, but in groups that keep the gathered latent and the scores cache-sized
    kv_row_bytes = n_blk * cache.shape[1] * width * compute.itemsize
    group = max(1, _TORCH_KV_BYTES // kv_row_bytes)
    for r0 in range(0, n_seq, group):
        r1 = min(r0 + group, n_seq)
        kv, tok_scales = _gather_rows(cache, scales, block_tables[rows[r0:r1], :n_blk], row_len[r0:r1], compute)
        q_step = max(1, _TORCH_SCORE_BYTES // (4 * (r1 - r0) * n_heads * kv.shape[1]))
        for q0 in range(0, max_q, q_step):
            q1 = min(q0 + q_step, max_q)
            out_pad[r0:r1, q0:q1], lse_pad[r0:r1, q0:q1] = _attend(
                q_pad[r0:r1, q0:q1], len_pad[r0:r1, q0:q1], kv, tok_scales, sm_scale, d_c)
    return out_pad[row_of, rank].to(q.dtype), lse_pad[row_of, rank]


def _check_decode_args(q: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, d_c: int, req_indices: torch.Tensor | None,
                       num_kv_splits: int | None) -> None:
    check_cache(cache, scales)
    n_rows = q.shape[0]
    if q.dim() != 3 or q.dtype not in ACT_DTYPES:
        raise ValueError(f"q must be [N, H, d_c + d_r] float32/bfloat16/float16, got {q.dtype} {tuple(q.shape)}")
    if q.shape[2] != cache.shape[2]:
        raise ValueError(f"q width {q.shape[2]} must equal the cache row width d_c + d_r = {cache.shape[2]}")
    if q.device != cache.device:
        raise ValueError(f"q is on {q.device}, the cache on {cache.device}")
    if not 0 < d_c < cache.shape[2]:
        raise ValueError(f"d_c must satisfy 0 < d_c < {cache.shape[2]} (the RoPE part needs at least one value), "
                         f"got {d_c}")
    check_int_tensor("block_tables", block_tables, 2, q.device)
    check_int_tensor("seq_lens", seq_lens, 1, q.device)
    if seq_lens.shape[0] != n_rows:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for {n_rows} query rows")
    if req_indices is None:
        if block_tables.shape[0] < n_rows:
            raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {n_rows} query rows; pass "
                             "req_indices to map query rows to block-table rows")
    else:
        check_int_tensor("req_indices", req_indices, 1, q.device, (torch.int32, torch.int64))
    if req_indices is not None and req_indices.shape[0] != n_rows:
        raise ValueError(f"req_indices has {req_indices.shape[0]} entries for {n_rows} query rows")
    if num_kv_splits is not None and not (isinstance(num_kv_splits, int) and num_kv_splits >= 1):
        raise ValueError(f"num_kv_splits must be a positive int or None, got {num_kv_splits!r}")


def mla_decode(q: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, sm_scale: float, d_c: int, req_indices: torch.Tensor | None = None,
               num_kv_splits: int | None = None, backend: str | None = None,
               validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of query rows over their paged latent sequences.

    q ``[N, H, d_c + d_r]`` (absorbed no-RoPE query, then rotated RoPE query), cache ``[num_blocks, block_size,
    d_c + d_r]``, scales ``[num_blocks, block_size, 2]`` fp32 for fp8/int8 caches else None, block_tables
    ``[B, max_blocks]`` int32, seq_lens ``[N]`` int32 (tokens row n attends), req_indices ``[N]`` int32 (block-table
    row of query row n; default n). Returns out ``[N, H, d_c]`` in q.dtype and lse ``[N, H]`` float32.
    ``validate=False`` skips the argument checks (for callers that checked the step's arguments once already).
    """
    n_rows = q.shape[0]
    if validate:
        _check_decode_args(q, cache, scales, block_tables, seq_lens, d_c, req_indices, num_kv_splits)
    if req_indices is None:
        req_indices = torch.arange(n_rows, dtype=torch.int32, device=q.device)
    if n_rows == 0:
        return (torch.empty(0, q.shape[1], d_c, dtype=q.dtype, device=q.device),
                torch.empty(0, q.shape[1], dtype=torch.float32, device=q.device))
    q = last_dim_contiguous(q)
    if resolve_backend(backend, q) == "triton":
        check_triton_cache(cache)
        if num_kv_splits is None:
            max_len_bound = block_tables.shape[1] * cache.shape[1]
            num_kv_splits = _default_num_kv_splits(n_rows, q.shape[1], max_len_bound, q.device)
        return _mla_decode_triton(q, cache, scales, block_tables, seq_lens, float(sm_scale), d_c, req_indices,
                                  num_kv_splits)
    return _mla_decode_torch(q, cache, scales, block_tables, seq_lens, float(sm_scale), d_c, req_indices)
