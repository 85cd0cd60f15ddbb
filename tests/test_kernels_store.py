"""store_latent and gather_latent against their fp32 references: exact slots, untouched neighbours, quantisation."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # kernels: interpret Triton on CPU (must precede the first triton import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mla_kernels import gather_latent, store_latent  # noqa: E402
from mla_kernels.dtypes import is_quantized  # noqa: E402
from mla_kernels.reference import ref_gather_latent, ref_store_latent  # noqa: E402
from tests.kernel_utils import BACKENDS, DEVICE, assert_close_dtype, make_paged_case, poisoned_cache  # noqa: E402

CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8]


def _store_inputs(n_tokens: int, d_c: int, d_r: int, num_blocks: int, block_size: int, seed: int,
                  slot_dtype: torch.dtype = torch.int64):
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(n_tokens, d_c, generator=gen) * 3
    latent[1] = 0.0  # an all-zero latent quantises with scale 1, not NaN
    k_rope = torch.randn(n_tokens, d_r, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n_tokens]
    slots[::7] = -1  # skipped tokens
    return latent.to(DEVICE), k_rope.to(DEVICE), slots.to(slot_dtype).to(DEVICE)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # bytewise, so NaN poison compares equal to itself


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("dims,block_size", [((512, 64), 64), ((32, 16), 16)], ids=["512x64-bs64", "32x16-bs16"])
def test_store_latent_matches_reference(backend: str, dtype: torch.dtype, dims: tuple[int, int],
                                        block_size: int) -> None:
    d_c, d_r = dims
    num_blocks = 5
    latent, k_rope, slots = _store_inputs(37, d_c, d_r, num_blocks, block_size, seed=d_c + block_size,
                                          slot_dtype=torch.int32 if d_c == 32 else torch.int64)
    if dtype == torch.float16:
        latent, k_rope = latent.half(), k_rope.half()  # also covers 16-bit inputs
    cache, scales = poisoned_cache(num_blocks, block_size, d_c + d_r, dtype)
    ref_cache, ref_scales = cache.clone(), None if scales is None else scales.clone()
    ref_store_latent(ref_cache, ref_scales, latent, k_rope, slots)
    store_latent(cache, scales, latent, k_rope, slots, backend=backend)

    assert torch.equal(_raw(cache), _raw(ref_cache)), "written slots differ or untouched slots changed"
    if scales is not None:
        assert torch.equal(_raw(scales), _raw(ref_scales))
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0].long().cpu()] = True
    flat = cache.view(-1, d_c + d_r).float().cpu()
    if dtype != torch.int8:
        assert torch.isnan(flat[~written]).all(), "a slot that was not in slot_mapping was written"
    assert not torch.isnan(flat[written]).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8], ids=str)
def test_quantised_round_trip_within_one_step(backend: str, dtype: torch.dtype) -> None:
    d_c, d_r, block_size = 64, 16, 16
    latent, k_rope, slots = _store_inputs(20, d_c, d_r, 2, block_size, seed=3)
    cache, scales = poisoned_cache(2, block_size, d_c + d_r, dtype)
    store_latent(cache, scales, latent, k_rope, slots, backend=backend)
    keep = slots >= 0
    blk, off = slots[keep].long() // block_size, slots[keep].long() % block_size
    for part, x, cols in ((0, latent[keep], slice(0, d_c)), (1, k_rope[keep], slice(d_c, d_c + d_r))):
        scale = scales[blk, off, part]  # [T']
        amax = x.abs().amax(dim=-1)
        expected_scale = torch.where(amax > 0, amax / (127.0 if dtype == torch.int8 else 448.0), 1.0)
        torch.testing.assert_close(scale, expected_scale, rtol=0, atol=0)
        y = x / scale[:, None]  # the value in quantised units
        if dtype == torch.int8:
            step = torch.ones_like(y)
        else:  # e4m3: 3 mantissa bits, subnormal step 2**-9
            step = torch.exp2(torch.floor(torch.log2(y.abs().clamp_min(2.0**-6))) - 3)
        err = (cache[blk, off][:, cols].float() - y).abs()
        assert (err <= step / 2 * (1 + 1e-6)).all(), f"round-trip error {float((err / step).max())} steps"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float8_e4m3fn, torch.float32), (torch.int8, torch.bfloat16)],
                         ids=str)
def test_gather_latent_matches_reference(backend: str, dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    seq_lens = [63, 0, 1, 65, 300, 64]
    block_size = 16 if dtype == torch.int8 else 64
    case = make_paged_case(seq_lens, 32, 16, block_size, dtype, seed=7)
    out = gather_latent(case.cache, case.scales, case.block_tables, case.seq_lens, out_dtype, d_c=case.d_c,
                        backend=backend)
    ref = ref_gather_latent(case.cache, case.scales, case.block_tables, case.seq_lens, case.d_c)
    assert out.shape == (sum(seq_lens), 48) and out.dtype == out_dtype
    assert_close_dtype(out, ref, out_dtype)
    if not is_quantized(dtype):  # the cached values themselves, in batch order
        torch.testing.assert_close(out[:, :32].float(), case.latent.to(dtype).float(), rtol=0, atol=0)


def test_gather_latent_empty_batch_and_bad_arguments() -> None:
    case = make_paged_case([0, 0], 32, 16)
    out = gather_latent(case.cache, None, case.block_tables, case.seq_lens, torch.float32, backend="torch")
    assert out.shape == (0, 48)
    q_case = make_paged_case([5], 32, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="d_c"):
        gather_latent(q_case.cache, q_case.scales, q_case.block_tables, q_case.seq_lens, torch.float32)
    with pytest.raises(ValueError, match="scales"):
        gather_latent(q_case.cache, None, q_case.block_tables, q_case.seq_lens, torch.float32, d_c=32)


def test_store_latent_rejects_bad_arguments() -> None:
    cache, scales = poisoned_cache(2, 16, 48, torch.float32)
    latent, k_rope = torch.randn(3, 32, device=DEVICE), torch.randn(3, 16, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="k_rope"):
        store_latent(cache, scales, latent, k_rope[:, :8], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_latent(cache, scales, latent, k_rope, slots.float())
    with pytest.raises(ValueError, match="block_size"):
        store_latent(torch.zeros(2, 24, 48, device=DEVICE), None, latent, k_rope, slots)
    with pytest.raises(ValueError, match="backend"):
        store_latent(cache, scales, latent, k_rope, slots, backend="cuda")
