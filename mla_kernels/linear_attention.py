"""The linear-attention layers' gated delta rule in Triton (CUDA; the interpreter under ``TRITON_INTERPRET=1``), each
sequence's state updated in place in its slot: one token of many sequences (``recurrent_step``, the decode rows), and
the tokens of whole sequences in the chunked (WY) form (``chunked``, prefill chunks).

For each sequence ``b`` and head ``h``, the state ``S = state[slots[b], h]`` (``[d_k, d_v]`` float32) takes the token
(``q, k`` prepared: L2-normalised, ``q`` scaled by ``d_k^-1/2``; ``g`` the log forget gate, <= 0)::

    S' = exp(g)[:, None] * S;   u = beta (v - S'^T k);   S = S' + k u^T;   o = S^T q

as ``mla_runtime.layers.delta_rule.recurrent_step`` (the fp32 reference). Every column of ``S`` evolves on its own
(``u`` and ``o`` are per column), so a program takes one (sequence, head) pair and ``BLOCK_V`` columns: it reads its
``[d_k, BLOCK_V]`` tile once and writes it back once, where the torch path gathers the states, computes and scatters
them (three more passes over ``H d_k d_v`` floats a sequence).

``chunked`` is ``layers.delta_rule.chunked`` per program: the tile held in registers across the sequence, read and
written once per call, and its tokens taken ``CHUNK`` at a time. Per block, with ``G`` the running sum of the gates:
the pairs ``A_ts = sum_i k_ti D_ts,i k_si`` (s < t) and ``B_ts = sum_i q_ti D_ts,i k_si`` (s <= t), ``D_ts =
exp(G_t - G_s)``, from the keys decayed token after token (a product of ``exp(g)`` per step: no exp of a difference
that could overflow); ``U = beta (V - (K exp(G)) S)`` and the unit-lower-triangular system ``(I + beta A)`` solved by
forward substitution in registers; the outputs ``(Q exp(G)) S + B U`` and the state ``exp(G_c) S + (K exp(G_c -
G))^T U``, every product over the block a ``tl.dot`` in full float32 (``input_precision="ieee"``: no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import triton_interpreting

BLOCK_V = 32  # state columns a program takes
CHUNK = 32  # tokens a block of the chunked form


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, out_ptr, heads, dk, dv,
                      BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    pair = tl.program_id(0)  # b * heads + h
    b = pair // heads
    h = pair % heads
    slot = tl.load(slots_ptr + b)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < dk
    mv = offs_v < dv
    q = tl.load(q_ptr + pair * dk + offs_k, mask=mk, other=0.0)
    k = tl.load(k_ptr + pair * dk + offs_k, mask=mk, other=0.0)
    g = tl.load(g_ptr + pair * dk + offs_k, mask=mk, other=0.0)
    v = tl.load(v_ptr + pair * dv + offs_v, mask=mv, other=0.0)
    beta = tl.load(beta_ptr + pair)
    tile = state_ptr + ((slot * heads + h) * dk + offs_k[:, None]) * dv + offs_v[None, :]
    m = mk[:, None] & mv[None, :]
    s = tl.load(tile, mask=m, other=0.0) * tl.exp(g)[:, None]
    u = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * u[None, :]
    tl.store(tile, s, mask=m)
    tl.store(out_ptr + pair * dv + offs_v, tl.sum(s * q[:, None], axis=0), mask=mv)


@triton.jit
def _chunked_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, cu_ptr, out_ptr, heads, dk, dv,
                    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    pair = tl.program_id(0)  # s * heads + h
    s_id = pair // heads
    h = pair % heads
    slot = tl.load(slots_ptr + s_id)
    first = tl.load(cu_ptr + s_id)
    last = tl.load(cu_ptr + s_id + 1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_c = tl.arange(0, CHUNK)
    mk = offs_k < dk
    mv = offs_v < dv
    tile = state_ptr + ((slot * heads + h) * dk + offs_k[:, None]) * dv + offs_v[None, :]
    m = mk[:, None] & mv[None, :]
    s = tl.load(tile, mask=m, other=0.0)
    for a in range(first, last, CHUNK):
        rows = (a + offs_c) * heads + h
        mt = (a + offs_c) < last
        mtk = mt[:, None] & mk[None, :]
        q = tl.load(q_ptr + rows[:, None] * dk + offs_k[None, :], mask=mtk, other=0.0)
        k = tl.load(k_ptr + rows[:, None] * dk + offs_k[None, :], mask=mtk, other=0.0)
        g = tl.load(g_ptr + rows[:, None] * dk + offs_k[None, :], mask=mtk, other=0.0)
        v = tl.load(v_ptr + rows[:, None] * dv + offs_v[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        beta = tl.load(beta_ptr + rows, mask=mt, other=0.0)
        n = tl.minimum(last - a, CHUNK)  # the block's tokens
        pa, pb = _pairs(k_ptr, q_ptr, g_ptr, a, n, heads, h, dk, offs_k, offs_c, CHUNK, BLOCK_K)
        cum = tl.cumsum(g, axis=0)  # G_t; the rows past the sequence add nothing
        total = tl.sum(g, axis=0)  # G_c
        grown = tl.exp(cum)
        u = beta[:, None] * (v - tl.dot(k * grown, s, input_precision="ieee"))
        u = _substitute(u, beta[:, None] * pa, offs_c, n)
        out = tl.dot(q * grown, s, input_precision="ieee") + tl.dot(pb, u, input_precision="ieee")
        tl.store(out_ptr + rows[:, None] * dv + offs_v[None, :], out, mask=mt[:, None] & mv[None, :])
        kl = k * tl.exp(total[None, :] - cum)
        s = s * tl.exp(total)[:, None] + tl.dot(tl.trans(kl), u, input_precision="ieee")
    tl.store(tile, s, mask=m)


@triton.jit
def _pairs(k_ptr, q_ptr, g_ptr, a, n, heads, h, dk, offs_k, offs_c, CHUNK: tl.constexpr,
           BLOCK_K: tl.constexpr):
    """A_ts = sum_i k_ti D_ts,i k_si (s < t) and B_ts = sum_i q_ti D_ts,i k_si (s <= t) of the block's ``n`` tokens
    from ``a`` (zero past them), the keys decayed token by token in ``w`` (row s: k_s times the product of exp(g_r),
    s < r <= t)."""
    w = tl.zeros((CHUNK, BLOCK_K), dtype=tl.float32)
    pa = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
    pb = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
    mk = offs_k < dk
    for t in range(0, n):
        row = (a + t) * heads + h
        kt = tl.load(k_ptr + row * dk + offs_k, mask=mk, other=0.0)
        qt = tl.load(q_ptr + row * dk + offs_k, mask=mk, other=0.0)
        w = w * tl.exp(tl.load(g_ptr + row * dk + offs_k, mask=mk, other=0.0))[None, :]
        here = offs_c == t
        pa = tl.where(here[:, None], tl.sum(w * kt[None, :], axis=1)[None, :], pa)
        own = tl.where(here, tl.sum(qt * kt, axis=0), 0.0)
        pb = tl.where(here[:, None], (tl.sum(w * qt[None, :], axis=1) + own)[None, :], pb)
        w = tl.where(here[:, None], kt[None, :], w)
    return pa, pb


@triton.jit
def _substitute(u, pa, offs_c, n):
    """Forward substitution of ``(I + pa) U = u`` (``pa`` strictly lower: beta_t A_ts): row t final once the rows
    above it are subtracted (rows from ``n`` on: zero)."""
    for t in range(0, n):
        here = offs_c == t
        ut = tl.sum(tl.where(here[:, None], u, 0.0), axis=0)
        col = tl.sum(tl.where(here[None, :], pa, 0.0), axis=1)
        u = u - col[:, None] * ut[None, :]
    return u


def recurrent_failure(device: torch.device | str) -> str | None:
    """None where the Triton kernel runs on ``device``'s tensors (CUDA, or any under the interpreter)."""
    if torch.device(device).type == "cuda" or triton_interpreting():
        return None
    return "the Triton delta-rule kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is imported)"


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token of ``B`` sequences: ``q, k, g [B, H, d_k]``, ``v [B, H, d_v]``, ``beta [B, H]`` (float32), ``state
    [N, H, d_k, d_v]`` float32 and contiguous, updated in place in rows ``slots [B]`` (distinct). Returns the outputs
    ``[B, H, d_v]`` float32."""
    _check(q, k, v, g, beta, state, slots, q.shape[0], "recurrent_step")
    rows, heads, dk = q.shape
    dv = v.shape[-1]
    out = torch.empty(rows, heads, dv, dtype=torch.float32, device=q.device)
    if rows == 0:
        return out
    grid = (rows * heads, triton.cdiv(dv, BLOCK_V))
    _recurrent_kernel[grid](q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state,
                            slots.to(torch.int64), out, heads, dk, dv, BLOCK_K=triton.next_power_of_2(dk),
                            BLOCK_V=BLOCK_V)
    return out


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, slots: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """The tokens ``cu[s] .. cu[s + 1]`` of sequence ``s`` (rows ``[T, H, ...]`` as ``recurrent_step``'s) in the
    chunked (WY) form, ``CHUNK`` tokens a block, from its state ``state[slots[s]]`` (updated in place; a fresh
    sequence's slot zeroed by the caller). Returns the outputs ``[T, H, d_v]`` float32."""
    if cu.dim() != 1 or cu.shape[0] < 1 or cu.device != q.device:
        raise ValueError(f"chunked: cu must be [S + 1] on {q.device}, got {list(cu.shape)} on {cu.device}")
    _check(q, k, v, g, beta, state, slots, cu.shape[0] - 1, "chunked")
    rows, heads, dk = q.shape
    dv = v.shape[-1]
    out = torch.empty(rows, heads, dv, dtype=torch.float32, device=q.device)
    if rows == 0 or slots.shape[0] == 0:
        return out
    grid = (slots.shape[0] * heads, triton.cdiv(dv, BLOCK_V))
    _chunked_kernel[grid](q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state,
                          slots.to(torch.int64), cu.to(torch.int64), out, heads, dk, dv, CHUNK=CHUNK,
                          BLOCK_K=max(16, triton.next_power_of_2(dk)), BLOCK_V=BLOCK_V)
    return out


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor, slots: torch.Tensor, seqs: int, name: str) -> None:
    """The device, then every operand's dtype and shape (``seqs`` sequences, one slot each)."""
    why = recurrent_failure(q.device)
    if why is not None:
        raise ValueError(why)
    rows, heads, dk = q.shape
    dv = v.shape[-1]
    for arg, t, shape in (("q", q, (rows, heads, dk)), ("k", k, (rows, heads, dk)), ("g", g, (rows, heads, dk)),
                          ("v", v, (rows, heads, dv)), ("beta", beta, (rows, heads))):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != q.device:
            raise ValueError(f"{name}: {arg} must be float32 {list(shape)} on {q.device}, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")
    if (state.dim() != 4 or tuple(state.shape[1:]) != (heads, dk, dv) or state.dtype != torch.float32
            or not state.is_contiguous() or state.device != q.device):
        raise ValueError(f"{name}: state must be contiguous float32 [N, {heads}, {dk}, {dv}] on {q.device}, got "
                         f"{state.dtype} {list(state.shape)}")
    if tuple(slots.shape) != (seqs,) or slots.device != q.device:
        raise ValueError(f"{name}: slots must be [{seqs}] on {q.device}, got {list(slots.shape)}")
