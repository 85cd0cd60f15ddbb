"""The gated delta rule of a linear-attention layer (Kimi Delta Attention), in float32 torch.

Per head, a state ``S [d_k, d_v]`` carries the sequence so far. One token ``t`` (query ``q_t``, key ``k_t``, value
``v_t``, a per-channel log forget gate ``g_t [d_k]`` (<= 0) and a write strength ``beta_t``) updates it::

    S' = exp(g_t)[:, None] * S          (each key channel decays on its own)
    u_t = beta_t (v_t - S'^T k_t)       (the delta: what the state mispredicts for k_t)
    S_t = S' + k_t u_t^T;   o_t = S_t^T q_t

``recurrent_step`` runs one token of many sequences at once (decodes). ``chunked`` runs a sequence's many tokens
(a prefill chunk) in blocks of ``chunk`` tokens in the WY form: within a block, with ``G_t`` the running sum of
``g`` and ``D_ts = exp(G_t - G_s)`` (s <= t, never above 1), the deltas solve one unit-lower-triangular system
``(I + diag(beta) A) U = diag(beta) (V - (K * exp(G)) S_0)``, ``A_ts = sum_c k_t D_ts k_s`` (s < t); the outputs
are ``(Q * exp(G)) S_0 + B U`` with ``B_ts = sum_c q_t D_ts k_s`` (s <= t), and the state after the block
``exp(G_C) * S_0 + sum_s (k_s * exp(G_C - G_s)) u_s^T``. Products over the block replace the per-token loop.

Queries and keys are L2-normalised (``sqrt(sum x^2 + 1e-6)``) and the queries scaled by ``d_k^-1/2`` first
(``prepared``), as the reference does.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 32  # tokens per block of the chunked form (its [H, C, C, d_k] decay tensor bounds the memory)


def l2_normalised(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def prepared(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q, k [..., d_k]`` in float32, L2-normalised, the queries scaled by ``d_k^-1/2``."""
    q, k = l2_normalised(q.float()), l2_normalised(k.float())
    return q * q.shape[-1] ** -0.5, k


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of ``B`` sequences: ``q, k, g [B, H, d_k]`` (q, k ``prepared``), ``v [B, H, d_v]``, ``beta [B, H]``,
    ``state [B, H, d_k, d_v]`` float32. Returns the outputs ``[B, H, d_v]`` and the new states."""
    s = state * g.exp().unsqueeze(-1)
    u = (v.float() - torch.einsum("bhkv,bhk->bhv", s, k)) * beta.float().unsqueeze(-1)
    s = s + k.unsqueeze(-1) * u.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """``L`` tokens of one sequence: ``q, k, g [L, H, d_k]`` (q, k ``prepared``), ``v [L, H, d_v]``, ``beta [L, H]``,
    ``state [H, d_k, d_v]`` float32 (the state before the first). Returns the outputs ``[L, H, d_v]`` and the state
    after the last token."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    q, k, g = (t.float().transpose(0, 1) for t in (q, k, g))  # [H, L, d_k]
    v, beta = v.float().transpose(0, 1), beta.float().transpose(0, 1)  # [H, L, d_v], [H, L]
    outs = []
    for a in range(0, q.shape[1], chunk):
        o, state = _block(q[:, a:a + chunk], k[:, a:a + chunk], v[:, a:a + chunk], g[:, a:a + chunk],
                          beta[:, a:a + chunk], state)
        outs.append(o)
    return torch.cat(outs, dim=1).transpose(0, 1), state


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of ``C`` tokens per head (``[H, C, ...]``) from ``state [H, d_k, d_v]``: its outputs and the state
    after it (the WY form of the module's docstring)."""
    c = q.shape[1]
    cum = g.cumsum(dim=1)  # G_t [H, C, d_k]
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(~lower[None, :, :, None], float("-inf"))
    decay = diff.exp()  # D_ts [H, C, C, d_k], 0 above the diagonal
    a = torch.einsum("htc,htsc,hsc->hts", k, decay, k).tril(-1)  # strictly lower
    b = torch.einsum("htc,htsc,hsc->hts", q, decay, k)  # lower, diagonal included
    grown = cum.exp()
    rhs = beta.unsqueeze(-1) * (v - (k * grown) @ state)  # [H, C, d_v]
    system = torch.eye(c, dtype=q.dtype, device=q.device) + beta.unsqueeze(-1) * a
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = (q * grown) @ state + b @ u
    last = cum[:, -1:]  # G_C [H, 1, d_k]
    state = state * last.transpose(1, 2).exp() + ((k * (last - cum).exp()).transpose(1, 2) @ u)
    return out, state
