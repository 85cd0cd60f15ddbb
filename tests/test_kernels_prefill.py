"""prefill_attention (Triton and torch) against the fp32 causal varlen reference."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():  # kernels: interpret Triton on CPU (must precede the first triton import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mla_kernels import prefill_attention  # noqa: E402
from mla_kernels.reference import ref_prefill_attention  # noqa: E402
from tests.kernel_utils import BACKENDS, DEVICE, assert_close_dtype, assert_lse_close  # noqa: E402


@dataclass(frozen=True)
class PrefillCase:
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]  # k_len > q_len: cached context before the chunk
    heads: int
    d_n: int
    d_r: int
    d_v: int
    dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        return (f"B{len(self.q_lens)}-q{max(self.q_lens)}-k{max(self.k_lens)}-H{self.heads}"
                f"-{self.d_n}x{self.d_r}x{self.d_v}-{str(self.dtype).removeprefix('torch.')}")


CASES = [
    PrefillCase((1,), (1,), 1, 32, 16, 32),
    PrefillCase((63, 64, 65), (63, 100, 65), 3, 128, 64, 128),  # around one tile, with and without context
    PrefillCase((0, 200, 5), (0, 300, 5), 2, 48, 16, 40),  # empty sequence, a long one, odd head dims
    PrefillCase((1, 2, 0, 4, 9, 1, 3, 17), (1, 40, 10, 4, 9, 64, 3, 129), 1, 16, 16, 16),  # q_len 0 with context
    PrefillCase((7, 70), (50, 70), 16, 64, 32, 48, torch.bfloat16),
    PrefillCase((3, 5), (3, 9), 128, 16, 16, 32),
    PrefillCase((33, 20), (97, 20), 4, 64, 32, 64, torch.float16),
    PrefillCase((5, 9), (12, 9), 2, 16, 16, 48),  # d_v wider than the query/key head
    PrefillCase((6, 11), (6, 30), 3, 32, 16, 64, torch.bfloat16),
]


def _inputs(case: PrefillCase):
    gen = torch.Generator().manual_seed(sum(case.q_lens) + case.heads)
    n_q, n_k = sum(case.q_lens), sum(case.k_lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(case.dtype).to(DEVICE)

    cu_q = torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(case.k_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return (rand(n_q, case.heads, case.d_n), rand(n_q, case.heads, case.d_r), rand(n_k, case.heads, case.d_n),
            rand(n_k, case.d_r), rand(n_k, case.heads, case.d_v), cu_q, cu_k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_matches_reference(case: PrefillCase, backend: str) -> None:
    q_n, q_r, k_n, k_r, v, cu_q, cu_k = _inputs(case)
    sm_scale = (case.d_n + case.d_r) ** -0.5
    out, lse = prefill_attention(q_n, q_r, k_n, k_r, v, cu_q, cu_k, sm_scale, backend=backend)
    ref_out, ref_lse = ref_prefill_attention(q_n, q_r, k_n, k_r, v, cu_q, cu_k, sm_scale)
    assert out.shape == (sum(case.q_lens), case.heads, case.d_v) and out.dtype == case.dtype
    assert lse.shape == (sum(case.q_lens), case.heads) and lse.dtype == torch.float32
    assert_close_dtype(out, ref_out, case.dtype)
    assert_lse_close(lse, ref_lse, case.dtype)


def test_prefill_k_rope_is_shared_not_per_head() -> None:
    """A strided k_rope view (as split off a gathered latent) works and is broadcast over heads."""
    case = PrefillCase((6,), (10,), 2, 16, 16, 16)
    q_n, q_r, k_n, _, v, cu_q, cu_k = _inputs(case)
    latent = torch.randn(10, 48, device=DEVICE)
    k_r = latent[:, 32:]  # [S, d_r] with row stride 48
    ref = ref_prefill_attention(q_n, q_r, k_n, k_r, v, cu_q, cu_k, 0.3)
    for backend in BACKENDS:
        out, lse = prefill_attention(q_n, q_r, k_n, k_r, v, cu_q, cu_k, 0.3, backend=backend)
        torch.testing.assert_close(out, ref[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, ref[1], rtol=1e-5, atol=1e-6)


def test_prefill_rejects_bad_arguments() -> None:
    q_n, q_r, k_n, k_r, v, cu_q, cu_k = _inputs(PrefillCase((4,), (6,), 2, 16, 16, 16))
    with pytest.raises(ValueError, match="k_rope"):
        prefill_attention(q_n, q_r, k_n, k_r.unsqueeze(1), v, cu_q, cu_k, 0.1)
    with pytest.raises(ValueError, match="v"):
        prefill_attention(q_n, q_r, k_n, k_r, v[:, :1], cu_q, cu_k, 0.1)
    with pytest.raises(ValueError, match="q_len <= k_len"):
        prefill_attention(q_n, q_r, k_n[:3], k_r[:3], v[:3], cu_q, torch.tensor([0, 3], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        prefill_attention(q_n, q_r, k_n, k_r, v, cu_q.long(), cu_k, 0.1)


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype != torch.float16], ids=str)
def test_padded_torch_path_matches_reference(case: PrefillCase) -> None:
    """The padded torch path (CUDA tensors with backend="torch", float16) on the cases that CPU float32/bf16
    send to torch's flash kernel instead."""
    from mla_kernels.prefill import _prefill_torch

    q_n, q_r, k_n, k_r, v, cu_q, cu_k = _inputs(case)
    sm_scale = (case.d_n + case.d_r) ** -0.5
    out, lse = _prefill_torch(q_n, q_r, k_n, k_r, v, cu_q, cu_k, sm_scale, max(case.q_lens), max(case.k_lens))
    ref_out, ref_lse = ref_prefill_attention(q_n, q_r, k_n, k_r, v, cu_q, cu_k, sm_scale)
    assert_close_dtype(out, ref_out, case.dtype)
    assert_lse_close(lse, ref_lse, case.dtype)


@pytest.mark.parametrize("budget", [256, 4096])
def test_cpu_flash_path_blocks_query_rows_after_context(monkeypatch, budget) -> None:
    """A chunk after cached context builds its causal mask in blocks of query rows (bounded memory for long
    contexts); every block size gives the reference result."""
    import mla_kernels.prefill as prefill_module

    monkeypatch.setattr(prefill_module, "_TORCH_SCORE_BYTES", budget)
    case = PrefillCase((9, 40, 6), (9, 75, 30), 2, 16, 16, 24)
    q_n, q_r, k_n, k_r, v, cu_q, cu_k = _inputs(case)
    out, lse = prefill_attention(q_n, q_r, k_n, k_r, v, cu_q, cu_k, 0.25, backend="torch")
    ref_out, ref_lse = ref_prefill_attention(q_n, q_r, k_n, k_r, v, cu_q, cu_k, 0.25)
    assert_close_dtype(out, ref_out, torch.float32)
    assert_lse_close(lse, ref_lse, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_selected_prefill_attends_exactly_the_selection(dtype):
    """Sparse prefill's masked dense form: each row's softmax over only its selected keys (``-1`` padding ignored,
    selections in any order), equal to attention over the gathered selection computed in float64."""
    from mla_kernels import selected_prefill_attention

    g = torch.Generator().manual_seed(7)
    heads, d_n, d_r, d_v, topk = 3, 16, 8, 12, 5
    seqs = [(6, 9), (300, 300)]  # (query rows, keys): a chunk after cached context, and a whole long prompt
    cu_q, cu_k = [0], [0]
    for q_len, k_len in seqs:
        cu_q.append(cu_q[-1] + q_len)
        cu_k.append(cu_k[-1] + k_len)
    q_n, q_r = torch.randn(cu_q[-1], heads, d_n, generator=g), torch.randn(cu_q[-1], heads, d_r, generator=g)
    k_n, k_r = torch.randn(cu_k[-1], heads, d_n, generator=g), torch.randn(cu_k[-1], d_r, generator=g)
    v = torch.randn(cu_k[-1], heads, d_v, generator=g)
    selected = torch.full((cu_q[-1], topk), -1, dtype=torch.int32)
    for (q_len, k_len), q0 in zip(seqs, cu_q):
        for i in range(q_len):
            sees = k_len - q_len + i + 1
            pick = torch.randperm(sees, generator=g)[:min(topk, sees)]
            selected[q0 + i, :len(pick)] = pick.int()
    got = selected_prefill_attention(*(t.to(dtype) for t in (q_n, q_r, k_n, k_r, v)), cu_q, cu_k, 0.3, selected)
    assert got.dtype == dtype and got.shape == (cu_q[-1], heads, d_v)
    for (q_len, _), q0, k0 in zip(seqs, cu_q, cu_k):
        for i in range(q_len):
            sel = selected[q0 + i][selected[q0 + i] >= 0].long() + k0
            scores = 0.3 * (torch.einsum("hd,khd->hk", q_n[q0 + i].double(), k_n[sel].double())
                            + torch.einsum("hd,kd->hk", q_r[q0 + i].double(), k_r[sel].double()))
            want = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), v[sel].double())
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(got[q0 + i].double(), want, rtol=tol, atol=tol)
