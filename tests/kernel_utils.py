"""Case builders shared by the kernel tests and the kernel benchmark (FlashMLA-style poisoned paged caches).

A paged case places each sequence's tokens on randomly shuffled blocks, fills every byte the kernels must
not read with poison (NaN; int8 caches get NaN scales), and points unused block-table entries at a block id
far out of range, so any stray read either produces NaN or faults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():  # kernels: interpret Triton on CPU (must precede the first triton import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mla_kernels import store_latent  # noqa: E402
from mla_kernels.dtypes import is_quantized  # noqa: E402

OUT_OF_RANGE_BLOCK = 10**6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ("torch", "triton")


@dataclass
class PagedCase:
    cache: torch.Tensor  # [num_blocks, block_size, d_c + d_r]
    scales: torch.Tensor | None  # [num_blocks, block_size, 2] fp32 for fp8/int8 caches
    block_tables: torch.Tensor  # [B, max_blocks] int32; unused entries = OUT_OF_RANGE_BLOCK
    seq_lens: torch.Tensor  # [B] int32
    latent: torch.Tensor  # [sum(seq_lens), d_c] fp32, what was stored (batch order)
    k_rope: torch.Tensor  # [sum(seq_lens), d_r] fp32
    d_c: int


def poisoned_cache(num_blocks: int, block_size: int, width: int, dtype: torch.dtype,
                   device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A cache whose every value reads back as NaN until written."""
    if dtype == torch.int8:
        cache = torch.full((num_blocks, block_size, width), 77, dtype=dtype, device=device)
    else:
        cache = torch.full((num_blocks, block_size, width), float("nan"), device=device).to(dtype)
    scales = None
    if is_quantized(dtype):
        scales = torch.full((num_blocks, block_size, 2), float("nan"), device=device)
    return cache, scales


def slots_for(block_tables: torch.Tensor, seq_lens: list[int], block_size: int) -> torch.Tensor:
    """Slot of every token of every sequence, in batch order: [sum(seq_lens)] int64."""
    slots = []
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots.append(block_tables[b, pos // block_size].long().cpu() * block_size + pos % block_size)
    return torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)


def make_paged_case(seq_lens: list[int], d_c: int, d_r: int, block_size: int = 64,
                    dtype: torch.dtype = torch.float32, extra_blocks: int = 3, seed: int = 0,
                    device: str = DEVICE) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + extra_blocks
    max_blocks = max(need, default=0) + 2  # always some unused entries
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seq_lens), max_blocks), OUT_OF_RANGE_BLOCK, dtype=torch.int32)
    used = 0
    for b, k in enumerate(need):
        block_tables[b, :k] = perm[used : used + k].int()
        used += k
    total = sum(seq_lens)
    latent = torch.randn(total, d_c, generator=gen)
    k_rope = torch.randn(total, d_r, generator=gen)
    cache, scales = poisoned_cache(num_blocks, block_size, d_c + d_r, dtype, device)
    slots = slots_for(block_tables, seq_lens, block_size)
    store_latent(cache, scales, latent.to(device), k_rope.to(device), slots.to(device), backend="torch")
    return PagedCase(cache, scales, block_tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                     latent.to(device), k_rope.to(device), d_c)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-30))


def assert_close_dtype(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: 1e-5 relative. bf16/fp16: a couple of units in the last place plus cosine > 0.9999."""
    assert not torch.isnan(actual).any(), "NaN in the output (a stray read of poisoned memory?)"
    if dtype == torch.float32:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-5, atol=1e-6)
        return
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2 * ulp, atol=2 * ulp)
    if actual.numel() > 1:
        assert cosine(actual, expected) > 0.9999


def assert_lse_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """lse is float32; bf16 inputs may be multiplied in bf16 (torch CPU path), which rounds each score."""
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), finite), "lse must be -inf exactly where the sequence is empty"
    tol = dict(rtol=2.0**-8, atol=2.0**-7) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actual[finite], expected[finite], **tol)
