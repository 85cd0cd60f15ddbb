"""Up-projected ("compute-friendly") causal variable-length attention for prefill and chunked prefill.

The latent of the chunk and of its cached context has been up-projected per head (k_n = W_UK c, v = W_UV c);
the RoPE key k_r is ONE vector per token shared by all heads and is never broadcast to heads. For sequence b
with q_len queries (the newest tokens) and k_len >= q_len keys (context + chunk), query i and key j:

    s_ij = sm_scale * (q_n_i·k_n_j + q_r_i·k_r_j)      visible iff j <= k_len - q_len + i   (bottom-right causal)
    out_i = Σ_j softmax_j(s_i) v_j                      -> [T, H, d_v]
    lse_i = log Σ_j exp(s_ij)                           -> [T, H]

Triton: a flash-attention style kernel, grid (⌈max q_len / BLOCK_M⌉, B, H); each program keeps a BLOCK_M × d
query tile in registers and walks the keys in BLOCK_N tiles up to its causal limit with an online softmax;
the d_n and d_r parts are two dot products; head dims are padded to powers of two and masked.

torch backend: CPU float32/bfloat16 tensors go to torch's CPU flash-attention kernel, one call per sequence
(there the RoPE key is repeated per head, as that kernel wants one key tensor; measured on a 2-core EPYC,
8 × 128 tokens × 16 heads fp32: 31.6 → 20.8 ms per layer, 2 × 1,024 tokens: 342 → 106 ms); other devices
and float16 take a padded, vectorised implementation of the same formula.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_int_tensor, last_dim_contiguous, resolve_backend, triton_interpreting
from .dtypes import ACT_DTYPES

_TORCH_SCORE_BYTES = 64 << 20  # the torch path processes queries in chunks of at most this many score bytes


@triton.jit
def _prefill_kernel(
    qn_ptr, qr_ptr, kn_ptr, kr_ptr, v_ptr, cu_q_ptr, cu_k_ptr, out_ptr, lse_ptr,
    sm_scale, d_n, d_r, d_v,
    stride_qnt, stride_qnh, stride_qrt, stride_qrh, stride_knt, stride_knh, stride_krt,
    stride_vt, stride_vh, stride_ot, stride_oh, stride_lt, stride_lh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    COMPUTE_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_k_ptr + b)
    k_len = tl.load(cu_k_ptr + b + 1) - k_start
    diag = k_len - q_len  # query i sees keys j <= diag + i

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_dr = tl.arange(0, BLOCK_DR)
    offs_dv = tl.arange(0, BLOCK_DV)
    dot_ty = tl.float32 if COMPUTE_FP32 else qn_ptr.dtype.element_ty

    # load the query tile: it stays in registers throughout
    tok_q = (q_start + offs_m).to(tl.int64)
    q_n = tl.load(qn_ptr + tok_q[:, None] * stride_qnt + h * stride_qnh + offs_dn[None, :],
                  mask=mask_m[:, None] & (offs_dn[None, :] < d_n), other=0.0).to(dot_ty)  # [BLOCK_M, BLOCK_DN]
    q_r = tl.load(qr_ptr + tok_q[:, None] * stride_qrt + h * stride_qrh + offs_dr[None, :],
                  mask=mask_m[:, None] & (offs_dr[None, :] < d_r), other=0.0).to(dot_ty)  # [BLOCK_M, BLOCK_DR]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    hi = tl.minimum(k_len, diag + (m_block + 1) * BLOCK_M)  # keys past this are hidden from the whole tile
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < k_len
        tok_k = (k_start + offs_n).to(tl.int64)
        k_n = tl.load(kn_ptr + tok_k[:, None] * stride_knt + h * stride_knh + offs_dn[None, :],
                      mask=mask_n[:, None] & (offs_dn[None, :] < d_n), other=0.0).to(dot_ty)
        k_r = tl.load(kr_ptr + tok_k[:, None] * stride_krt + offs_dr[None, :],
                      mask=mask_n[:, None] & (offs_dr[None, :] < d_r), other=0.0).to(dot_ty)  # shared by heads
        s = tl.dot(q_n, tl.trans(k_n), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        s += tl.dot(q_r, tl.trans(k_r), input_precision=DOT_PRECISION)  # the RoPE part: a second dot
        visible = mask_n[None, :] & (offs_n[None, :] <= diag + offs_m[:, None])
        s = tl.where(visible, s * sm_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key 0 is visible to every row of the first tile
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + tok_k[:, None] * stride_vt + h * stride_vh + offs_dv[None, :],
                    mask=mask_n[:, None] & (offs_dv[None, :] < d_v), other=0.0).to(dot_ty)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + tok_q[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_dv[None, :] < d_v))
    tl.store(lse_ptr + tok_q * stride_lt + h * stride_lh, m_i + tl.log(l_i), mask=mask_m)


def _prefill_triton(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor,
                    v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, sm_scale: float,
                    max_q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    n_tokens, n_heads, d_n = q_nope.shape
    d_r, d_v = q_rope.shape[2], v.shape[2]
    out = torch.empty(n_tokens, n_heads, d_v, dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty(n_tokens, n_heads, dtype=torch.float32, device=q_nope.device)
    if max_q_len == 0:
        return out, lse
    block_m = block_n = 64
    # the CPU interpreter multiplies bf16 tiles as raw integers, so it gets fp32 tiles instead
    compute_fp32 = q_nope.dtype == torch.float32 or (triton_interpreting() and q_nope.dtype == torch.bfloat16)
    grid = (triton.cdiv(max_q_len, block_m), cu_seqlens_q.shape[0] - 1, n_heads)
    _prefill_kernel[grid](
        q_nope, q_rope, k_nope, k_rope, v, cu_seqlens_q, cu_seqlens_k, out, lse,
        sm_scale, d_n, d_r, d_v,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_rope.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_DN=max(triton.next_power_of_2(d_n), 16), BLOCK_DR=max(triton.next_power_of_2(d_r), 16),
        BLOCK_DV=max(triton.next_power_of_2(d_v), 16),
        COMPUTE_FP32=compute_fp32, DOT_PRECISION="ieee" if compute_fp32 else "tf32",
        num_warps=4, num_stages=1 if compute_fp32 else 2,
    )
    return out, lse


def _pad_index(cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token t of a packed varlen batch -> (its sequence, its position in the sequence)."""
    lens = (cu[1:] - cu[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(len(lens), device=cu.device), lens)
    return seq, torch.arange(seq.numel(), device=cu.device) - cu[:-1].long()[seq]


def _prefill_torch(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor,
                   v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, sm_scale: float,
                   max_q_len: int, max_k_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    n_tokens, n_heads, d_n = q_nope.shape
    d_r, d_v = q_rope.shape[2], v.shape[2]
    n_seq = cu_seqlens_q.shape[0] - 1
    dev = q_nope.device
    out = torch.empty(n_tokens, n_heads, d_v, dtype=q_nope.dtype, device=dev)
    lse = torch.empty(n_tokens, n_heads, dtype=torch.float32, device=dev)
    if n_tokens == 0:
        return out, lse

    # pad the packed sequences into [B, len, ...] batches (padding keys are zeros and masked)
    seq_q, pos_q = _pad_index(cu_seqlens_q)
    seq_k, pos_k = _pad_index(cu_seqlens_k)
    # bf16: bf16 matmuls (fp32 accumulation inside, ~2x faster on CPU), softmax in fp32; else fp32 throughout
    compute = torch.bfloat16 if q_nope.dtype == torch.bfloat16 else torch.float32
    qn = q_nope.new_zeros(n_seq, max_q_len, n_heads, d_n, dtype=compute)
    qr = q_nope.new_zeros(n_seq, max_q_len, n_heads, d_r, dtype=compute)
    kn = q_nope.new_zeros(n_seq, max_k_len, n_heads, d_n, dtype=compute)
    kr = q_nope.new_zeros(n_seq, max_k_len, d_r, dtype=compute)
    vv = q_nope.new_zeros(n_seq, max_k_len, n_heads, d_v, dtype=compute)
    qn[seq_q, pos_q], qr[seq_q, pos_q] = q_nope.to(compute), q_rope.to(compute)
    kn[seq_k, pos_k], kr[seq_k, pos_k], vv[seq_k, pos_k] = k_nope.to(compute), k_rope.to(compute), v.to(compute)
    kn_t = kn.permute(0, 2, 3, 1)  # [B, H, d_n, K]
    vv = vv.transpose(1, 2)  # [B, H, K, d_v]
    kr_t = kr.transpose(1, 2)  # [B, d_r, K]

    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    key_pos = torch.arange(max_k_len, device=dev)
    out_pad = torch.empty(n_seq, n_heads, max_q_len, d_v, dtype=torch.float32, device=dev)
    lse_pad = torch.empty(n_seq, n_heads, max_q_len, dtype=torch.float32, device=dev)
    chunk = max(1, _TORCH_SCORE_BYTES // (4 * n_seq * n_heads * max(max_k_len, 1)))
    for q0 in range(0, max_q_len, chunk):
        q1 = min(q0 + chunk, max_q_len)
        scores = torch.matmul(qn[:, q0:q1].transpose(1, 2), kn_t).float()  # [B, H, Qc, K]
        # the head-shared RoPE key: [B, Qc * H, d_r] @ [B, d_r, K], no per-head copy of k_r
        rope = torch.bmm(qr[:, q0:q1].reshape(n_seq, -1, d_r), kr_t).view(n_seq, q1 - q0, n_heads, -1)
        scores = scores.add_(rope.transpose(1, 2).float()).mul_(sm_scale)
        limit = (k_lens - q_lens)[:, None] + torch.arange(q0, q1, device=dev)[None, :]  # [B, Qc]
        hidden = (key_pos[None, None, :] > limit[..., None]) | (key_pos[None, None, :] >= k_lens[:, None, None])
        scores.add_(torch.zeros(hidden.shape, device=dev).masked_fill_(hidden, float("-inf"))[:, None])  # all heads
        m = scores.amax(dim=-1)
        m = torch.where(torch.isfinite(m), m, 0.0)  # padding query rows see nothing
        p = torch.exp(scores - m[..., None])
        denom = p.sum(dim=-1)
        out_pad[:, :, q0:q1] = torch.matmul(p.to(compute), vv).float() / torch.where(denom > 0, denom, 1.0)[..., None]
        lse_pad[:, :, q0:q1] = m + torch.log(denom)
    out.copy_(out_pad[seq_q, :, pos_q])
    lse.copy_(lse_pad[seq_q, :, pos_q])
    return out, lse


_SDPA_CPU_DTYPES = (torch.float32, torch.bfloat16)
_SELECTED_BLOCK_ROWS = 256  # selected_prefill_attention: query rows per masked block


def _flash_operands(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor,
                    v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[T, H, w]``, k and v ``[S, H, w]`` for torch's CPU flash kernel, which wants one head size: the queries
    ``[q_n ; q_r]``, the keys ``[k_n ; k_r]`` with the shared RoPE key repeated per head, and the narrower of
    (q·k, v) zero-padded to ``w`` (zeros change neither a dot product nor the kept part of the output)."""
    n_heads, d_n = q_nope.shape[1:]
    d_r, d_v = q_rope.shape[2], v.shape[2]
    width = max(d_n + d_r, d_v)
    q = torch.cat([q_nope, q_rope], dim=-1)
    k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, n_heads, -1)], dim=-1)
    if d_n + d_r < width:
        q, k = (torch.nn.functional.pad(t, (0, width - d_n - d_r)) for t in (q, k))
    if d_v < width:
        v = torch.nn.functional.pad(v, (0, width - d_v))
    return q, k, v


def _prefill_cpu_flash(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor,
                       v: torch.Tensor, cu_q: list[int], cu_k: list[int], sm_scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU path: torch's flash-attention kernel for CPU, one call per sequence.

    That kernel wants one head size for q, k and v, so the queries are ``[q_n ; q_r]``, the keys
    ``[k_n ; k_r]`` with the shared RoPE key repeated per head, and the narrower of (q·k, v) is zero-padded
    (zeros change neither a dot product nor the kept part of the output). A chunk whose cached context
    precedes it (q_len < k_len) passes its bottom-right causal mask, built for blocks of query rows so that
    no mask exceeds ``_TORCH_SCORE_BYTES``; a whole prompt uses the kernel's own causal mask. Scores,
    softmax and accumulation are fp32 (bf16 GEMM inputs for bf16 tensors).
    """
    n_tokens, n_heads, _ = q_nope.shape
    d_v = v.shape[2]
    q, k, v = _flash_operands(q_nope, q_rope, k_nope, k_rope, v)
    out = torch.empty(n_tokens, n_heads, d_v, dtype=q_nope.dtype)
    lse = torch.empty(n_tokens, n_heads, dtype=torch.float32)
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        q_len, k_len = q1 - q0, k1 - k0
        if q_len == k_len:  # a whole prompt: the kernel's own causal mask, no mask tensor
            spans = [(0, q_len)] if q_len else []
        else:  # after cached context: query rows in blocks whose additive mask stays within the byte budget
            rows = max(1, _TORCH_SCORE_BYTES // (k_len * q.element_size()))
            spans = [(r, min(r + rows, q_len)) for r in range(0, q_len, rows)]
        for r0, r1 in spans:
            mask, keys = None, k_len
            if q_len < k_len:  # query i sees keys j <= k_len - q_len + i; the block's last row sees `keys`
                keys = k_len - q_len + r1
                hidden = torch.ones(r1 - r0, keys, dtype=torch.bool).triu_(k_len - q_len + r0 + 1)
                mask = torch.zeros(r1 - r0, keys, dtype=q.dtype).masked_fill_(hidden, float("-inf"))
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[q0 + r0:q0 + r1].transpose(0, 1).unsqueeze(0), k[k0:k0 + keys].transpose(0, 1).unsqueeze(0),
                v[k0:k0 + keys].transpose(0, 1).unsqueeze(0), 0.0, mask is None, attn_mask=mask, scale=sm_scale)
            out[q0 + r0:q0 + r1] = o[0, :, :, :d_v].transpose(0, 1)
            lse[q0 + r0:q0 + r1] = l[0].transpose(0, 1)
    return out, lse


def _check_cu_seqlens(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, device: torch.device) -> None:
    check_int_tensor("cu_seqlens_q", cu_seqlens_q, 1, device)
    check_int_tensor("cu_seqlens_k", cu_seqlens_k, 1, device)
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both be [B + 1], got {tuple(cu_seqlens_q.shape)} "
                         f"and {tuple(cu_seqlens_k.shape)}")


def _check_prefill_args(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor,
                        v: torch.Tensor, cu_q: list[int], cu_k: list[int], q_lens: list[int],
                        k_lens: list[int]) -> None:
    if q_nope.dim() != 3 or q_nope.dtype not in ACT_DTYPES:
        raise ValueError(f"q_nope must be [T, H, d_n] float32/bfloat16/float16, got {q_nope.dtype} "
                         f"{tuple(q_nope.shape)}")
    n_tokens, n_heads, d_n = q_nope.shape
    dev = q_nope.device
    expected = {
        "q_rope": (3, (n_tokens, n_heads)),
        "k_nope": (3, (None, n_heads, d_n)),
        "k_rope": (2, (None,)),
        "v": (3, (None, n_heads)),
    }
    tensors = {"q_rope": q_rope, "k_nope": k_nope, "k_rope": k_rope, "v": v}
    for name, (dim, prefix) in expected.items():
        t = tensors[name]
        if t.dim() != dim or any(p is not None and p != s for p, s in zip(prefix, t.shape)):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {dim} dims starting with "
                             f"{tuple('S' if p is None else p for p in prefix)}")
        if t.dtype != q_nope.dtype or t.device != dev:
            raise ValueError(f"{name} must be {q_nope.dtype} on {dev} like q_nope, got {t.dtype} on {t.device}")
    n_keys = k_nope.shape[0]
    if k_rope.shape[0] != n_keys or v.shape[0] != n_keys:
        raise ValueError(f"k_nope, k_rope and v must have the same number of keys, got {n_keys}, "
                         f"{k_rope.shape[0]}, {v.shape[0]}")
    if k_rope.shape[1] != q_rope.shape[2]:
        raise ValueError(f"k_rope width {k_rope.shape[1]} must equal q_rope width {q_rope.shape[2]}")
    if cu_q[0] != 0 or cu_k[0] != 0 or min(q_lens + k_lens, default=0) < 0:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must start at 0 and be non-decreasing")
    if cu_q[-1] != n_tokens or cu_k[-1] != n_keys:
        raise ValueError(f"cu_seqlens_q / cu_seqlens_k end at {cu_q[-1]} / {cu_k[-1]}, expected {n_tokens} "
                         f"queries / {n_keys} keys")
    if any(ql > kl for ql, kl in zip(q_lens, k_lens)):
        raise ValueError("every sequence needs q_len <= k_len (queries are the newest keys)")


def prefill_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor,
                      v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, sm_scale: float,
                      backend: str | None = None, host_cu_seqlens: tuple[list[int], list[int]] | None = None,
                      validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal varlen attention with a head-shared RoPE key, bottom-right aligned.

    q_nope ``[T, H, d_n]``, q_rope ``[T, H, d_r]``, k_nope ``[S, H, d_n]``, k_rope ``[S, d_r]`` (one per token,
    shared by all heads), v ``[S, H, d_v]``, cu_seqlens_q / cu_seqlens_k ``[B + 1]`` int32 with q_len_b <= k_len_b.
    Returns out ``[T, H, d_v]`` in q_nope.dtype and lse ``[T, H]`` float32.

    ``host_cu_seqlens``: the same two cu_seqlens as host lists, when the caller has them (saves a device sync);
    ``validate=False`` skips the argument checks (for callers that checked the step's arguments once already).
    """
    if validate:
        _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q_nope.device)
    cu_q, cu_k = host_cu_seqlens or (cu_seqlens_q.tolist(), cu_seqlens_k.tolist())
    q_lens = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    k_lens = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
    if validate:
        _check_prefill_args(q_nope, q_rope, k_nope, k_rope, v, cu_q, cu_k, q_lens, k_lens)
    dev = q_nope.device
    q_nope, q_rope, k_nope, k_rope, v = (last_dim_contiguous(t) for t in (q_nope, q_rope, k_nope, k_rope, v))
    max_q_len, max_k_len = max(q_lens, default=0), max(k_lens, default=0)
    if resolve_backend(backend, q_nope) == "triton":
        return _prefill_triton(q_nope, q_rope, k_nope, k_rope, v, cu_seqlens_q, cu_seqlens_k, float(sm_scale),
                               max_q_len)
    if dev.type == "cpu" and q_nope.dtype in _SDPA_CPU_DTYPES:
        return _prefill_cpu_flash(q_nope, q_rope, k_nope, k_rope, v, cu_q, cu_k, float(sm_scale))
    return _prefill_torch(q_nope, q_rope, k_nope, k_rope, v, cu_seqlens_q, cu_seqlens_k, float(sm_scale),
                          max_q_len, max_k_len)


def selected_prefill_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor,
                               k_rope: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int],
                               sm_scale: float, selected: torch.Tensor) -> torch.Tensor:
    """Attention of prefill rows over only their selected keys, on the CPU: sparse attention in its up-projected
    form, the reference model's own (its indexer's choice as a mask over the dense scores).

    Arguments as ``prefill_attention`` (host ``cu_q`` / ``cu_k`` lists), plus ``selected [T, K]``: row t's key
    positions within its sequence (``-1``: none; at least one valid per row). Returns out ``[T, H, d_v]`` in
    q_nope.dtype. Each row attends to exactly its selected keys: the same result as ``sparse_mla_decode`` over the
    latents the keys and values were built from, at the cost of dense attention (torch's CPU flash kernel, an
    additive mask per block of rows within ``_TORCH_SCORE_BYTES``) instead of a gather per row.
    """
    n_tokens, n_heads, _ = q_nope.shape
    d_v = v.shape[2]
    if selected.dim() != 2 or selected.shape[0] != n_tokens:
        raise ValueError(f"selected must be [T, K] with T = {n_tokens} query rows, got {tuple(selected.shape)}")
    q, k, v = _flash_operands(q_nope, q_rope, k_nope, k_rope, v)
    sel = selected.long()
    # an invalid entry (-1) points at the row's first selection (always valid: a row sees at least one key)
    sel = torch.where(sel >= 0, sel, sel[:, :1])
    out = torch.empty(n_tokens, n_heads, d_v, dtype=q_nope.dtype)
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        q_len, k_len = q1 - q0, k1 - k0
        # blocks of rows: each attends up to its own last selected key (a staircase, as a causal kernel skips the
        # upper triangle), its mask within the byte budget
        rows = max(1, min(_SELECTED_BLOCK_ROWS, _TORCH_SCORE_BYTES // (max(k_len, 1) * q.element_size())))
        for r0 in range(0, q_len, rows):
            r1 = min(r0 + rows, q_len)
            part = sel[q0 + r0:q0 + r1]
            keys = int(part.max()) + 1  # the block's last selectable key
            mask = torch.full((r1 - r0, keys), float("-inf"), dtype=q.dtype).scatter_(1, part, 0.0)
            o, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[q0 + r0:q0 + r1].transpose(0, 1).unsqueeze(0), k[k0:k0 + keys].transpose(0, 1).unsqueeze(0),
                v[k0:k0 + keys].transpose(0, 1).unsqueeze(0), 0.0, False, attn_mask=mask, scale=sm_scale)
            out[q0 + r0:q0 + r1] = o[0, :, :, :d_v].transpose(0, 1)
    return out
