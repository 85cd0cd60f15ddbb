"""The linear-attention layers' gated delta rule in Triton (CUDA; the interpreter under ``TRITON_INTERPRET=1``), each
sequence's state updated in place in its slot: one token of many sequences (``recurrent_step``, the decode rows), and
the tokens of whole sequences one after another (``sequence_steps``, prefill chunks).

For each sequence ``b`` and head ``h``, the state ``S = state[slots[b], h]`` (``[d_k, d_v]`` float32) takes the token
(``q, k`` prepared: L2-normalised, ``q`` scaled by ``d_k^-1/2``; ``g`` the log forget gate, <= 0)::

    S' = exp(g)[:, None] * S;   u = beta (v - S'^T k);   S = S' + k u^T;   o = S^T q

as ``mla_runtime.layers.delta_rule.recurrent_step`` (the fp32 reference). Every column of ``S`` evolves on its own
(``u`` and ``o`` are per column), so a program takes one (sequence, head) pair and ``BLOCK_V`` columns: it reads its
``[d_k, BLOCK_V]`` tile once and writes it back once, where the torch path gathers the states, computes and scatters
them (three more passes over ``H d_k d_v`` floats a sequence). ``sequence_steps`` is the same program looping over a
sequence's tokens with the tile held in registers: the state is read and written once per call, whatever the tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import triton_interpreting

BLOCK_V = 32  # state columns a program takes


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
def _sequence_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, cu_ptr, out_ptr, heads, dk, dv,
                     BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    pair = tl.program_id(0)  # s * heads + h
    s_id = pair // heads
    h = pair % heads
    slot = tl.load(slots_ptr + s_id)
    first = tl.load(cu_ptr + s_id)
    last = tl.load(cu_ptr + s_id + 1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < dk
    mv = offs_v < dv
    tile = state_ptr + ((slot * heads + h) * dk + offs_k[:, None]) * dv + offs_v[None, :]
    m = mk[:, None] & mv[None, :]
    s = tl.load(tile, mask=m, other=0.0)
    for t in range(first, last):
        row = t * heads + h
        q = tl.load(q_ptr + row * dk + offs_k, mask=mk, other=0.0)
        k = tl.load(k_ptr + row * dk + offs_k, mask=mk, other=0.0)
        g = tl.load(g_ptr + row * dk + offs_k, mask=mk, other=0.0)
        v = tl.load(v_ptr + row * dv + offs_v, mask=mv, other=0.0)
        beta = tl.load(beta_ptr + row)
        s = s * tl.exp(g)[:, None]
        u = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * u[None, :]
        tl.store(out_ptr + row * dv + offs_v, tl.sum(s * q[:, None], axis=0), mask=mv)
    tl.store(tile, s, mask=m)


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


def sequence_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, slots: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """The tokens ``cu[s] .. cu[s + 1]`` of sequence ``s`` (rows ``[T, H, ...]`` as ``recurrent_step``'s), in order,
    from its state ``state[slots[s]]`` (updated in place; a fresh sequence's slot zeroed by the caller). Returns the
    outputs ``[T, H, d_v]`` float32."""
    if cu.dim() != 1 or cu.shape[0] < 1 or cu.device != q.device:
        raise ValueError(f"sequence_steps: cu must be [S + 1] on {q.device}, got {list(cu.shape)} on {cu.device}")
    _check(q, k, v, g, beta, state, slots, cu.shape[0] - 1, "sequence_steps")
    rows, heads, dk = q.shape
    dv = v.shape[-1]
    out = torch.empty(rows, heads, dv, dtype=torch.float32, device=q.device)
    if rows == 0 or slots.shape[0] == 0:
        return out
    grid = (slots.shape[0] * heads, triton.cdiv(dv, BLOCK_V))
    _sequence_kernel[grid](q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state,
                           slots.to(torch.int64), cu.to(torch.int64), out, heads, dk, dv,
                           BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=BLOCK_V)
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
