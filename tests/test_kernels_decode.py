"""mla_decode (Triton and torch) against the fp32 reference on poisoned, shuffled paged caches, plus the
absorbed-vs-naive oracle: a chunk decoded through the latent equals up-projected causal attention."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():  # kernels: interpret Triton on CPU (must precede the first triton import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mla_kernels import gather_latent, mla_decode, prefill_attention  # noqa: E402
from mla_kernels.dtypes import is_quantized  # noqa: E402
from mla_kernels.reference import ref_mla_decode  # noqa: E402
from tests.kernel_utils import (  # noqa: E402
    BACKENDS,
    DEVICE,
    assert_close_dtype,
    assert_lse_close,
    cosine,
    make_paged_case,
)


@dataclass(frozen=True)
class DecodeCase:
    seq_lens: tuple[int, ...]
    heads: int
    d_c: int
    d_r: int
    block_size: int = 64
    cache_dtype: torch.dtype = torch.float32
    q_dtype: torch.dtype = torch.float32
    splits: int | None = None

    def __str__(self) -> str:
        dt = str(self.cache_dtype).removeprefix("torch.")
        return (f"B{len(self.seq_lens)}-max{max(self.seq_lens)}-H{self.heads}-{self.d_c}x{self.d_r}"
                f"-bs{self.block_size}-{dt}-s{self.splits}")


# every batch size {1, 3, 8}, length {0, 1, bs-1, bs, bs+1, hundreds}, head count {1, 16, 128}, width pair,
# block size {16, 64} and cache dtype appears at least once; the interpreter keeps this under a minute
CASES = [
    DecodeCase((1,), 1, 32, 16),
    DecodeCase((63, 0, 65), 16, 512, 64, splits=2),
    DecodeCase((64, 300, 1, 0, 17, 15, 16, 33), 16, 32, 16, block_size=16, splits=4),
    DecodeCase((300,), 128, 512, 64, cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16),
    DecodeCase((63, 64, 65), 128, 32, 16, cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16, splits=3),
    DecodeCase((1, 300, 0), 16, 512, 64, cache_dtype=torch.float8_e4m3fn, q_dtype=torch.bfloat16, splits=2),
    DecodeCase((65, 0, 64), 16, 32, 16, block_size=16, cache_dtype=torch.int8, splits=1),
    DecodeCase((40, 7, 129), 5, 96, 24, cache_dtype=torch.float16, q_dtype=torch.float16, splits=8),
]


def _run_case(case: DecodeCase, backend: str):
    cache_case = make_paged_case(list(case.seq_lens), case.d_c, case.d_r, case.block_size, case.cache_dtype,
                                 seed=len(case.seq_lens) * 31 + case.heads)
    gen = torch.Generator().manual_seed(case.heads)
    q = torch.randn(len(case.seq_lens), case.heads, case.d_c + case.d_r, generator=gen).to(case.q_dtype).to(DEVICE)
    sm_scale = (case.d_c + case.d_r) ** -0.5
    out, lse = mla_decode(q, cache_case.cache, cache_case.scales, cache_case.block_tables, cache_case.seq_lens,
                          sm_scale, case.d_c, num_kv_splits=case.splits, backend=backend)
    # the reference runs on the same (dequantised) cache the kernel reads
    ref_out, ref_lse = ref_mla_decode(q, cache_case.cache, cache_case.scales, cache_case.block_tables,
                                      cache_case.seq_lens, sm_scale, case.d_c)
    return cache_case, q, sm_scale, out, lse, ref_out, ref_lse


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_matches_reference(case: DecodeCase, backend: str) -> None:
    cache_case, q, sm_scale, out, lse, ref_out, ref_lse = _run_case(case, backend)
    assert out.shape == (len(case.seq_lens), case.heads, case.d_c) and out.dtype == case.q_dtype
    assert lse.shape == (len(case.seq_lens), case.heads) and lse.dtype == torch.float32
    assert_close_dtype(out, ref_out, case.q_dtype)
    empty = torch.tensor([n == 0 for n in case.seq_lens], device=lse.device)
    assert torch.isneginf(lse[empty]).all() and (out[empty] == 0).all(), "seq_len 0 must give out 0, lse -inf"
    assert_lse_close(lse, ref_lse, case.q_dtype)

    if is_quantized(case.cache_dtype):  # quantisation error against the unquantised values (looser)
        exact = make_paged_case(list(case.seq_lens), case.d_c, case.d_r, case.block_size, torch.float32,
                                seed=len(case.seq_lens) * 31 + case.heads)
        exact_out, _ = ref_mla_decode(q, exact.cache, None, exact.block_tables, exact.seq_lens, sm_scale, case.d_c)
        assert cosine(out, exact_out) > (0.999 if case.cache_dtype == torch.int8 else 0.99)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_absorbed_equals_up_projected(backend: str) -> None:
    """Chunked prefill through the latent (req_indices + per-token seq_lens) == naive causal attention."""
    ctx_lens, chunk_lens = [70, 0, 3], [5, 9, 1]
    d_c, d_r, d_n, d_v, heads = 64, 16, 32, 24, 16
    total = [c + q for c, q in zip(ctx_lens, chunk_lens)]
    case = make_paged_case(total, d_c, d_r, seed=11)
    gen = torch.Generator().manual_seed(12)
    w_uk = (torch.randn(heads, d_n, d_c, generator=gen) * d_c**-0.5).to(DEVICE)  # [H, d_n, d_c]
    w_uv = (torch.randn(heads, d_v, d_c, generator=gen) * d_c**-0.5).to(DEVICE)  # [H, d_v, d_c]
    n_q = sum(chunk_lens)
    q_n = torch.randn(n_q, heads, d_n, generator=gen).to(DEVICE)
    q_r = torch.randn(n_q, heads, d_r, generator=gen).to(DEVICE)
    sm_scale = (d_n + d_r) ** -0.5

    # absorbed: every chunk token is a query row over its own causal prefix of the paged latent
    req = torch.cat([torch.full((q,), b) for b, q in enumerate(chunk_lens)]).int().to(DEVICE)
    seq_lens = torch.cat([c + torch.arange(1, q + 1) for c, q in zip(ctx_lens, chunk_lens)]).int().to(DEVICE)
    q_abs = torch.einsum("thn,hnc->thc", q_n, w_uk)  # [T, H, d_c]
    o_lat, lse_abs = mla_decode(torch.cat([q_abs, q_r], -1), case.cache, None, case.block_tables, seq_lens,
                                sm_scale, d_c, req_indices=req, backend=backend)
    out_abs = torch.einsum("thc,hvc->thv", o_lat, w_uv)

    # naive: gather the latent, up-project per head, causal varlen attention (context longer than the chunk)
    latent = gather_latent(case.cache, None, case.block_tables, case.seq_lens, torch.float32, backend=backend)
    c, k_r = latent[:, :d_c], latent[:, d_c:]
    k_n = torch.einsum("sc,hnc->shn", c, w_uk)
    v = torch.einsum("sc,hvc->shv", c, w_uv)
    cu_q = torch.tensor([0] + torch.tensor(chunk_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(total).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    out_naive, lse_naive = prefill_attention(q_n, q_r, k_n, k_r, v, cu_q, cu_k, sm_scale, backend=backend)

    torch.testing.assert_close(out_abs, out_naive, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse_abs, lse_naive, rtol=1e-5, atol=1e-5)


def test_default_splits_and_empty_splits_agree() -> None:
    """More splits than tiles (empty splits) and the automatic choice give the same answer as one split."""
    case = make_paged_case([65, 2], 32, 16, seed=5)
    q = torch.randn(2, 3, 48, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    outs = [mla_decode(q, case.cache, None, case.block_tables, case.seq_lens, 0.2, 32, num_kv_splits=s,
                       backend="triton") for s in (1, 16, None)]
    for out, lse in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, outs[0][1], rtol=1e-5, atol=1e-6)


def test_decode_rejects_bad_arguments() -> None:
    case = make_paged_case([5], 32, 16)
    q = torch.randn(1, 2, 48, device=DEVICE)
    with pytest.raises(ValueError, match="q width"):
        mla_decode(q[..., :40], case.cache, None, case.block_tables, case.seq_lens, 0.1, 32)
    with pytest.raises(ValueError, match="d_c"):
        mla_decode(q, case.cache, None, case.block_tables, case.seq_lens, 0.1, 48)
    with pytest.raises(ValueError, match="seq_lens"):
        mla_decode(q, case.cache, None, case.block_tables, case.seq_lens.long(), 0.1, 32)
    with pytest.raises(ValueError, match="req_indices"):
        mla_decode(q, case.cache, None, case.block_tables, case.seq_lens, 0.1, 32,
                   req_indices=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="num_kv_splits"):
        mla_decode(q, case.cache, None, case.block_tables, case.seq_lens, 0.1, 32, num_kv_splits=0)
