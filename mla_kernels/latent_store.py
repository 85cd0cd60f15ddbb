"""Writing token latents into the paged latent cache, and reading whole sequences back out.

Cache layout (see ``common.py``): ``cache [num_blocks, block_size, d_c + d_r]``, token slot ``s`` at
block ``s // block_size``, offset ``s % block_size``; the row is ``[c ; k_r]`` — the normalised latent
(d_c values) then the rotated RoPE key (d_r values). fp8/int8 caches keep one float32 scale per token
and part in ``scales [num_blocks, block_size, 2]``.

store_latent:   cache[slot_t] = [c_t ; k_r_t]  (quantised per token and part)   for every t with slot_t >= 0
gather_latent:  out = concat_b [ dequant(cache[token j of sequence b]) for j < seq_lens[b] ]
                -> [sum(seq_lens), d_c + d_r], the input of the up-projected (compute-friendly) prefill.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    check_cache,
    check_int_tensor,
    check_triton_cache,
    dequantize_rows,
    last_dim_contiguous,
    quantize_per_token,
    resolve_backend,
)
from .dtypes import ACT_DTYPES, is_quantized

# 1.5 * 2**23: in fp32, (x + M) - M rounds |x| < 2**22 to the nearest integer, ties to even
_RNE_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _round_half_even(x):
    return (x + _RNE_MAGIC) - _RNE_MAGIC


@triton.jit
def _round_to_e4m3_grid(y):
    # Snap fp32 y (|y| <= 448) to the nearest float8_e4m3fn value, ties to even, so that the final
    # .to(float8) is exact. (The Triton CPU interpreter rounds fp32 -> fp8 wrongly when the mantissa
    # carries into the exponent; the GPU gets the same answer either way.)
    exp = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)  # below 2**-6 e4m3 is subnormal with a fixed step of 2**-9
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    inv_step = ((127 - (exp - 3)) << 23).to(tl.float32, bitcast=True)
    return _round_half_even(y * inv_step) * step


@triton.jit
def _quantize(x, mask, QMAX: tl.constexpr, IS_INT8: tl.constexpr):
    # x: fp32 row; returns (values on the target grid in fp32, scale)
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, QMAX), 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
    if IS_INT8:
        y = _round_half_even(y)
    else:
        y = _round_to_e4m3_grid(y)
    return y, scale


@triton.jit
def _store_latent_kernel(
    latent_ptr, k_rope_ptr, slot_ptr, cache_ptr, scales_ptr,
    stride_lt, stride_kt, stride_cb, stride_cs, stride_sb, stride_ss,
    d_c, d_r,
    BLOCK_SIZE: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # one token per program
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    row = cache_ptr + blk * stride_cb + off * stride_cs

    offs_c = tl.arange(0, BLOCK_DC)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_c = offs_c < d_c
    mask_r = offs_r < d_r
    c = tl.load(latent_ptr + t * stride_lt + offs_c, mask=mask_c, other=0.0)
    r = tl.load(k_rope_ptr + t * stride_kt + offs_r, mask=mask_r, other=0.0)
    dst_ty = cache_ptr.dtype.element_ty
    if QUANT:
        c, c_scale = _quantize(c.to(tl.float32), mask_c, QMAX, IS_INT8)
        r, r_scale = _quantize(r.to(tl.float32), mask_r, QMAX, IS_INT8)
        scale_row = scales_ptr + blk * stride_sb + off * stride_ss
        tl.store(scale_row, c_scale)
        tl.store(scale_row + 1, r_scale)
    tl.store(row + offs_c, c.to(dst_ty), mask=mask_c)
    tl.store(row + d_c + offs_r, r.to(dst_ty), mask=mask_r)


@triton.jit
def _gather_latent_kernel(
    cache_ptr, scales_ptr, block_tables_ptr, seq_lens_ptr, cu_ptr, out_ptr,
    stride_cb, stride_cs, stride_sb, stride_ss, stride_bt, stride_ot,
    d_c, d_r,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
    QUANT: tl.constexpr,
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    if tile * BLOCK_N >= seq_len:
        return
    out_start = tl.load(cu_ptr + b).to(tl.int64)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # token positions in the sequence
    mask_n = offs_n < seq_len
    blk = tl.load(block_tables_ptr + b * stride_bt + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    row = blk * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs  # [BLOCK_N]

    offs_c = tl.arange(0, BLOCK_DC)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_c = mask_n[:, None] & (offs_c[None, :] < d_c)
    mask_r = mask_n[:, None] & (offs_r[None, :] < d_r)
    c = tl.load(cache_ptr + row[:, None] + offs_c[None, :], mask=mask_c, other=0.0).to(tl.float32)
    r = tl.load(cache_ptr + row[:, None] + d_c + offs_r[None, :], mask=mask_r, other=0.0).to(tl.float32)
    if QUANT:
        srow = scales_ptr + blk * stride_sb + (offs_n % BLOCK_SIZE) * stride_ss
        c = c * tl.load(srow, mask=mask_n, other=0.0)[:, None]
        r = r * tl.load(srow + 1, mask=mask_n, other=0.0)[:, None]
    out_row = out_ptr + (out_start + offs_n)[:, None] * stride_ot  # [BLOCK_N, 1]
    dst_ty = out_ptr.dtype.element_ty
    tl.store(out_row + offs_c[None, :], c.to(dst_ty), mask=mask_c)
    tl.store(out_row + d_c + offs_r[None, :], r.to(dst_ty), mask=mask_r)


def _store_latent_torch(cache: torch.Tensor, scales: torch.Tensor | None, latent: torch.Tensor,
                        k_rope: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    block_size = cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // block_size, slots % block_size
    if is_quantized(cache.dtype):
        qc, sc = quantize_per_token(latent[keep], cache.dtype)  # [T', d_c], [T']
        qr, sr = quantize_per_token(k_rope[keep], cache.dtype)  # [T', d_r], [T']
        assert scales is not None  # check_cache: a quantised cache has scales
        cache[blk, off] = torch.cat([qc, qr], dim=-1)
        scales[blk, off] = torch.stack([sc, sr], dim=-1)
    else:
        cache[blk, off] = torch.cat([latent[keep], k_rope[keep]], dim=-1).to(cache.dtype)


def _store_latent_triton(cache: torch.Tensor, scales: torch.Tensor | None, latent: torch.Tensor,
                         k_rope: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    n_tokens, d_c = latent.shape
    d_r = k_rope.shape[1]
    quant = is_quantized(cache.dtype)
    if not quant:  # a plain copy: convert in torch (exact rounding) and keep the kernel a copy
        latent, k_rope = latent.to(cache.dtype), k_rope.to(cache.dtype)
    sc = scales if scales is not None else cache  # dummy pointer when unquantised (check_cache: scales iff quantised)
    _store_latent_kernel[(n_tokens,)](
        latent, k_rope, slot_mapping, cache, sc,
        latent.stride(0), k_rope.stride(0), cache.stride(0), cache.stride(1), sc.stride(0), sc.stride(1),
        d_c, d_r,
        BLOCK_SIZE=cache.shape[1], BLOCK_DC=triton.next_power_of_2(d_c), BLOCK_DR=triton.next_power_of_2(d_r),
        QUANT=quant, QMAX=127.0 if cache.dtype == torch.int8 else 448.0, IS_INT8=cache.dtype == torch.int8,
    )


def _check_store_args(cache: torch.Tensor, scales: torch.Tensor | None, latent: torch.Tensor, k_rope: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    check_cache(cache, scales)
    if latent.dim() != 2 or latent.dtype not in ACT_DTYPES:
        raise ValueError(f"latent must be [T, d_c] float32/bfloat16/float16, got {latent.dtype} "
                         f"{tuple(latent.shape)}")
    if k_rope.dim() != 2 or k_rope.shape[0] != latent.shape[0] or k_rope.dtype not in ACT_DTYPES:
        raise ValueError(f"k_rope must be [T={latent.shape[0]}, d_r] float, got {k_rope.dtype} "
                         f"{tuple(k_rope.shape)}")
    if latent.shape[1] + k_rope.shape[1] != cache.shape[2]:
        raise ValueError(f"latent width {latent.shape[1]} + k_rope width {k_rope.shape[1]} must equal the cache "
                         f"row width {cache.shape[2]}")
    if latent.device != cache.device or k_rope.device != cache.device:
        raise ValueError(f"latent and k_rope must be on the cache's device {cache.device}")
    check_int_tensor("slot_mapping", slot_mapping, 1, cache.device, (torch.int32, torch.int64))
    if slot_mapping.shape[0] != latent.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {latent.shape[0]} tokens")


def store_latent(cache: torch.Tensor, scales: torch.Tensor | None, latent: torch.Tensor, k_rope: torch.Tensor,
                 slot_mapping: torch.Tensor, backend: str | None = None, validate: bool = True) -> None:
    """Write ``[latent ; k_rope]`` of each token into its cache slot, in place, quantising fp8/int8 caches.

    cache ``[num_blocks, block_size, d_c + d_r]``, scales ``[num_blocks, block_size, 2]`` fp32 or None,
    latent ``[T, d_c]``, k_rope ``[T, d_r]``, slot_mapping ``[T]`` int32/int64 (negative = skip the token).
    ``validate=False`` skips the argument checks (for callers that checked the step's arguments once already).
    """
    if validate:
        _check_store_args(cache, scales, latent, k_rope, slot_mapping)
    if latent.shape[0] == 0:
        return
    latent, k_rope = last_dim_contiguous(latent), last_dim_contiguous(k_rope)
    if resolve_backend(backend, cache) == "triton":
        check_triton_cache(cache)
        _store_latent_triton(cache, scales, latent, k_rope, slot_mapping)
    else:
        _store_latent_torch(cache, scales, latent, k_rope, slot_mapping)


def _gather_latent_torch(cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, out_dtype: torch.dtype, d_c: int) -> torch.Tensor:
    block_size = cache.shape[1]
    lens = seq_lens.long()
    seq_idx = torch.repeat_interleave(torch.arange(len(lens), device=cache.device), lens)  # [S]
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(seq_idx.numel(), device=cache.device) - starts[seq_idx]  # position in its sequence
    blk = block_tables[seq_idx, pos // block_size].long()
    off = pos % block_size
    rows = cache[blk, off]  # [S, d_c + d_r]
    if scales is None:
        return rows.to(out_dtype)
    return dequantize_rows(rows, scales[blk, off], d_c).to(out_dtype)


def _gather_latent_triton(cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, out_dtype: torch.dtype, d_c: int,
                          host_lens: list[int] | None) -> torch.Tensor:
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64, device=cache.device)
    torch.cumsum(seq_lens, 0, out=cu[1:])
    if host_lens is not None:  # the caller's host copy: no device sync
        total, max_len = sum(host_lens), max(host_lens, default=0)
    else:
        total, max_len = (int(x) for x in torch.stack([cu[-1], seq_lens.max().long()]).tolist())
    d_r = cache.shape[2] - d_c
    out = torch.empty(total, cache.shape[2], dtype=out_dtype, device=cache.device)
    if total == 0:
        return out
    quant = scales is not None
    sc = scales if scales is not None else cache  # dummy pointer when unquantised
    block_n = 32
    _gather_latent_kernel[(len(seq_lens), triton.cdiv(max_len, block_n))](
        cache, sc, block_tables, seq_lens, cu, out,
        cache.stride(0), cache.stride(1), sc.stride(0), sc.stride(1), block_tables.stride(0), out.stride(0),
        d_c, d_r,
        BLOCK_SIZE=cache.shape[1], BLOCK_N=block_n, BLOCK_DC=triton.next_power_of_2(d_c),
        BLOCK_DR=triton.next_power_of_2(d_r), QUANT=quant,
    )
    return out


def gather_latent(cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, out_dtype: torch.dtype, d_c: int | None = None,
                  backend: str | None = None, host_lens: list[int] | None = None) -> torch.Tensor:
    """Dequantised latents of each sequence's first ``seq_lens[b]`` tokens, concatenated in batch order.

    block_tables ``[B, max_blocks]`` int32, seq_lens ``[B]`` int32 -> ``[sum(seq_lens), d_c + d_r]`` out_dtype.
    ``d_c`` is only needed for fp8/int8 caches (to apply the two per-token scales); ``host_lens``: ``seq_lens`` as
    a host list, when the caller has it (saves a device sync).
    """
    check_cache(cache, scales)
    check_int_tensor("block_tables", block_tables, 2, cache.device)
    check_int_tensor("seq_lens", seq_lens, 1, cache.device)
    if seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for {block_tables.shape[0]} block-table rows")
    if out_dtype not in ACT_DTYPES:
        raise ValueError(f"out_dtype must be one of {ACT_DTYPES}, got {out_dtype}")
    if scales is not None and (d_c is None or not 0 < d_c < cache.shape[2]):
        raise ValueError(f"d_c (latent width, 0 < d_c < {cache.shape[2]}) is required for a {cache.dtype} cache")
    d_c = cache.shape[2] - 1 if d_c is None else d_c  # unquantised: the split is irrelevant to a copy
    if resolve_backend(backend, cache) == "triton":
        check_triton_cache(cache)
        return _gather_latent_triton(cache, scales, block_tables, seq_lens, out_dtype, d_c, host_lens)
    return _gather_latent_torch(cache, scales, block_tables, seq_lens, out_dtype, d_c)
