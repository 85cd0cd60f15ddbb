"""The int4 weight format (``Int4Weight``: ggml's Q4_0 numbers) and its compiled CPU kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mla_kernels import cpu_kernels, int4_format
from mla_runtime.kernel_plan import kernel_plan
from mla_runtime.layers import int4, qweight
from mla_runtime.layers.int4 import Int4Weight


def q4_0_reference(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``quantize_row_q4_0_ref`` transcribed with float32 scalars, row by row: (q [N, Kp] in [-8, 7], the
    float16 scales [N, Kp / 32]); a K that is not a multiple of 32 is padded with zeros."""
    n, k = w.shape
    kp = -(-k // 32) * 32
    x = np.zeros((n, kp), dtype=np.float32)
    x[:, :k] = w.float().numpy()
    q = np.zeros((n, kp), dtype=np.int8)
    scales = np.zeros((n, kp // 32), dtype=np.float16)
    for r in range(n):
        for b in range(kp // 32):
            block = x[r, 32 * b:32 * (b + 1)]
            amax, vmax = np.float32(0), np.float32(0)
            for v in block:
                if amax < abs(v):
                    amax, vmax = abs(v), v
            d = vmax / np.float32(-8)
            inv = np.float32(1) / d if d else np.float32(0)
            scales[r, b] = np.float16(d)
            for j, v in enumerate(block):
                q[r, 32 * b + j] = min(15, int(np.float32(v * inv) + np.float32(8.5))) - 8
    return q, scales


def _awkward(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random weights with the cases Q4_0's rule singles out: a group whose largest magnitude appears with both signs
    (the first counts), all-zero and negative-zero groups, and values on the rounding boundaries."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[0, :32] = 0.0
    if n > 1:
        w[1, :32] = -0.0
    if n > 2:
        w[2, 3], w[2, 9] = -2.5, 2.5  # ties in magnitude: the first (negative) sets d's sign
        w[2, :3] = 0.1
    if n > 3:  # x / d = j + 1/2 for every j: the boundaries of the rounding
        d = torch.tensor(-0.125)
        w[3, :16] = (torch.arange(-8, 8) + 0.5) * d
        w[3, 31] = 1.0  # the largest magnitude: d = 1.0 / -8
    if n > 4:
        w[4] *= 1e-3  # small and large scales
        w[4, 5] = 300.0
    return w


@pytest.mark.parametrize("shape", [(6, 96), (5, 40), (4, 64), (7, 32 * 9 + 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantisation_is_q4_0(shape, dtype):
    w = _awkward(*shape).to(dtype)
    q, scales = q4_0_reference(w)
    got = Int4Weight.quantize(w)
    got_q, got_scales = got.to_int()
    assert got_q.shape == shape and got_scales.dtype == torch.float16
    assert np.array_equal(got_q.numpy(), q[:, :shape[1]])
    assert np.array_equal(got_scales.view(torch.int16).numpy(), scales.view(np.int16))  # bit for bit (signed zeros)
    assert got.plain.shape == shape and got.plain.dtype == dtype and got.plain.untyped_storage().nbytes() <= 4
    dq = got.dequantize()
    assert dq.dtype == torch.float32 and dq.shape == shape
    want = q.astype(np.float32).reshape(shape[0], -1, 32) * scales.astype(np.float32)[..., None]
    assert np.array_equal(dq.numpy(), want.reshape(shape[0], -1)[:, :shape[1]])


def test_storage_is_q4_0_blocks():
    """The packed bytes are Q4_0's ``qs``: byte j of a group holds values j and j + 16, each plus 8."""
    w = _awkward(3, 64)
    q, _ = q4_0_reference(w)
    u = q.astype(np.int16) + 8
    want = (u[:, 0:16] | (u[:, 16:32] << 4), u[:, 32:48] | (u[:, 48:64] << 4))
    got = Int4Weight.quantize(w).packed
    assert got.dtype == torch.uint8 and got.shape == (3, 32)
    assert np.array_equal(got.numpy(), np.concatenate(want, axis=1).astype(np.uint8))


def test_quantisation_in_row_blocks(monkeypatch):
    w = torch.randn(37, 160)
    whole = Int4Weight.quantize(w)
    monkeypatch.setattr(int4, "CHUNK_ELEMENTS", 500)  # a few rows at a time
    blocks = Int4Weight.quantize(w)
    assert torch.equal(whole.packed, blocks.packed) and torch.equal(whole.scales, blocks.scales)


def test_cat_is_quantising_the_stacked_matrix():
    parts = [torch.randn(n, 96) for n in (5, 1, 12)]
    stacked = Int4Weight.quantize(torch.cat(parts))
    cat = Int4Weight.cat([Int4Weight.quantize(p) for p in parts])
    assert cat.shape == (18, 96) and cat.k == 96
    assert torch.equal(cat.packed, stacked.packed) and torch.equal(cat.scales, stacked.scales)
    with pytest.raises(ValueError, match="one K"):
        Int4Weight.cat([Int4Weight.quantize(torch.randn(2, 64)), Int4Weight.quantize(torch.randn(2, 96))])


@pytest.mark.parametrize("k", [64, 40])
def test_from_int_and_to_int(k):
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (9, k), generator=g, dtype=torch.int8)
    scales = torch.rand(9, -(-k // 32), generator=g).half()
    w = Int4Weight.from_int(q, scales, torch.bfloat16)
    assert w.shape == (9, k) and w.plain.dtype == torch.bfloat16
    back_q, back_scales = w.to_int()
    assert torch.equal(back_q, q) and torch.equal(back_scales, scales)
    assert torch.equal(w.dequantize(), (q.float().view(9, -1) * scales.float().repeat_interleave(32, 1)[:, :k]))
    again = Int4Weight.from_int(*Int4Weight.quantize(torch.randn(4, k)).to_int(), torch.float32)
    assert torch.equal(Int4Weight.from_int(*again.to_int(), torch.float32).packed, again.packed)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        Int4Weight.from_int(torch.full((2, k), 8, dtype=torch.int8), scales[:2], torch.float32)
    with pytest.raises(ValueError, match="scales"):
        Int4Weight.from_int(q, scales[:, :1] if k > 32 else scales[:1], torch.float32)


def test_select_rows():
    w = Int4Weight.quantize(torch.randn(20, 96))
    index = torch.tensor([7, 0, 19, 7])
    sub = w.select_rows(index)
    assert sub.shape == (4, 96)
    assert torch.equal(sub.dequantize(), w.dequantize()[index])
    x = torch.randn(3, 96)
    assert torch.equal(sub.matmul(x, None), w.matmul(x, None)[:, index])


def test_nbytes():
    w = Int4Weight.quantize(torch.randn(64, 1024))
    assert w.nbytes == 64 * 1024 * 0.5625  # 18 bytes per 32 weights, as Q4_0
    assert w.nbytes == w.packed.numel() + 2 * w.scales.numel()


def _tolerance(dq: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What the kernel may differ from the exact product by: the rounding of each group of 32 input values to int8
    (at most the group's largest magnitude / 254 per value) and float32 sums."""
    wa, xa = dq.double().abs(), x.double().abs()
    k = x.shape[-1]
    groups = torch.nn.functional.pad(xa, (0, -k % 32)).unflatten(-1, (-1, 32))
    step = (groups.amax(-1, keepdim=True) / 254).expand(groups.shape).flatten(-2)[..., :k]
    return step @ wa.T + 1e-5 * (xa @ wa.T) + 1e-30


def _variants() -> list[str]:
    """Every int4 kernel variant; one this CPU cannot execute is skipped by name."""
    return ["avx2", "avx512_vnni"]


def _variant_or_skip(variant: str) -> None:
    _kernel_or_skip()
    if variant not in cpu_kernels.variants("int4"):
        pytest.skip(f"this CPU does not execute the int4 kernel's {variant} variant (it runs "
                    f"{list(cpu_kernels.variants('int4'))})")


def _kernel_or_skip() -> None:
    why = cpu_kernels.failure("int4")
    if why is not None:
        pytest.skip(f"the int4 kernel is unavailable here: {why}")


@pytest.mark.parametrize("n,k", [(7, 64), (100, 96), (37, 1024)])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_is_the_dequantised_product(n, k, rows, threads):
    _kernel_or_skip()
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = Int4Weight.quantize(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, rows).unsqueeze(1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_kernels.linear(x, w.packed, w.scales)
        alone = torch.cat([cpu_kernels.linear(x[i:i + 1], w.packed, w.scales) for i in range(rows)])
    finally:
        torch.set_num_threads(before)
    dq = w.dequantize()
    want = x.double() @ dq.double().T
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert ((got.double() - want).abs() <= _tolerance(dq, x)).all()
    assert torch.equal(got, alone)  # a row's result does not depend on the rows beside it


def test_kernel_row_and_thread_independence():
    """The same row gives the same bits whatever tile, batch or thread count it runs in."""
    _kernel_or_skip()
    g = torch.Generator().manual_seed(3)
    w = Int4Weight.quantize(torch.randn(129, 256, generator=g))
    x = torch.randn(64, 256, generator=g)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            outs += [cpu_kernels.linear(x, w.packed, w.scales), cpu_kernels.linear(x[5:18], w.packed, w.scales)]
    finally:
        torch.set_num_threads(before)
    for full, part in zip(outs[::2], outs[1::2], strict=True):
        assert torch.equal(full, outs[0]) and torch.equal(part, outs[0][5:18])


@pytest.mark.parametrize("variant", _variants())
@pytest.mark.parametrize("n,k,rows", [(37, 1024, 1), (64, 96, 5), (9, 200, 13), (130, 2048, 8)])
def test_kernel_is_its_rounded_rows_times_the_weight(variant, n, k, rows):
    """Each variant computes the exact product of the Q8_0-rounded rows (``quantize_q8_groups``) with the int4
    weight, to float32 summation, and every variant gives the same bits."""
    _variant_or_skip(variant)
    g = torch.Generator().manual_seed(n * k + rows)
    w = Int4Weight.quantize(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, k)[torch.randperm(k, generator=g)]
    q, scale = int4_format.quantize_q8_groups(x)
    xr = (q.double().unflatten(-1, (-1, 32)) * scale.double().unsqueeze(-1)).flatten(-2)[:, :k]
    assert ((xr - x.double()).abs() <= _tolerance(torch.eye(k), x)).all()  # at most half a step per value
    dq = w.dequantize().double()
    got = cpu_kernels.linear(x, w.packed, w.scales, variant=variant)
    want = xr @ dq.T
    assert ((got.double() - want).abs() <= 2e-6 * (xr.abs() @ dq.abs().T) + 1e-30).all()
    assert torch.equal(got, cpu_kernels.linear(x, w.packed, w.scales))  # the default: the fastest variant


def test_variants_named():
    """The variants this CPU executes are a subset of those built, the fastest chosen; an unknown one is refused."""
    _kernel_or_skip()
    assert set(cpu_kernels.variants("int4")) <= set(cpu_kernels.variants("int4", runs_only=False)) == set(_variants())
    assert "avx2" in cpu_kernels.variants("int4")
    w = Int4Weight.quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match="unknown variant 'sse2'"):
        cpu_kernels.linear(torch.randn(1, 64), w.packed, w.scales, variant="sse2")


def test_kernel_non_finite_rows():
    _kernel_or_skip()
    w = Int4Weight.quantize(torch.randn(8, 64))
    x = torch.randn(3, 64)
    x[1, 7] = float("nan")
    y = cpu_kernels.linear(x, w.packed, w.scales)
    assert y[1].isnan().all() and y[[0, 2]].isfinite().all()


def test_kernel_rejects_bad_operands():
    _kernel_or_skip()
    w = Int4Weight.quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match="rows of 96 values do not fit a Byte weight"):
        cpu_kernels.linear(torch.randn(2, 96), w.packed, w.scales)
    with pytest.raises(ValueError, match="1 to 8 rows|rows of 64 values do not fit a Float weight"):
        cpu_kernels.linear(torch.randn(9, 64), w.dequantize())
    with pytest.raises(ValueError, match="the int4 group scales must be a contiguous CPU Half tensor"):
        cpu_kernels.linear(torch.randn(2, 64), w.packed, w.scales.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 64), (100, 96), (33, 40)])
def test_matmul_in_both_modes(gemm_mode, plan, dtype, shape, monkeypatch):
    """``cpu_gemm=auto`` takes the kernel for up to 64 rows, ``plain`` the dequantised fallback: both are the
    dequantised product within the kernel's tolerance."""
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    w = Int4Weight.quantize(torch.randn(n, k, generator=g).to(dtype)).bind(plan)
    assert w.kernel == (gemm_mode == "auto" and cpu_kernels.failure("int4") is None)
    dq = w.dequantize()
    bias = torch.randn(n, generator=g).to(dtype)
    monkeypatch.setattr(qweight, "WIDEN_CHUNK_ELEMENTS", 1000)  # the fallback dequantises a few rows at a time
    for lead in ((1,), (3,), (2, 5), (70,), (0,)):
        x = torch.randn(*lead, k, generator=g).to(dtype)
        got = w.matmul(x, bias)
        assert got.dtype == dtype and got.shape == (*lead, n)
        flat = x.reshape(-1, k).float()
        want = flat.double() @ dq.double().T + bias.double()
        slack = 1e-2 if dtype == torch.bfloat16 else 0.0  # the result rounded to bfloat16
        tol = _tolerance(dq, flat) + slack * want.abs() + 1e-5
        assert ((got.reshape(-1, n).double() - want).abs() <= tol).all()


def test_kernel_and_fallback_agree(monkeypatch):
    _kernel_or_skip()
    g = torch.Generator().manual_seed(5)
    w = torch.randn(50, 1024, generator=g)
    x = torch.randn(4, 1024, generator=g)
    fast = Int4Weight.quantize(w).bind(kernel_plan("auto"))
    slow = Int4Weight.quantize(w).bind(kernel_plan("plain"))
    assert fast.kernel and not slow.kernel
    gap = (fast.matmul(x, None).double() - slow.matmul(x, None).double()).abs()
    assert (gap <= _tolerance(fast.dequantize(), x)).all()  # the kernel's int8 groups: the only difference


def test_fallback_reason():
    assert kernel_plan("plain").int4_failure == "cpu_gemm=plain forces the fallback"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda():
    w = torch.randn(40, 96)
    cpu = Int4Weight.quantize(w)
    gpu = Int4Weight.quantize(w.cuda())
    assert not gpu.kernel
    assert torch.equal(gpu.packed.cpu(), cpu.packed) and torch.equal(gpu.scales.cpu(), cpu.scales)
    x = torch.randn(3, 96)
    assert torch.allclose(gpu.matmul(x.cuda(), None).cpu(), x @ cpu.dequantize().T, rtol=1e-4, atol=1e-4)


def test_from_words_equals_the_library_unpacked():
    """compressed-tensors' packed words moved into this format as bytes give the weights its own unpacking gives."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    g = torch.Generator().manual_seed(11)
    q = torch.randint(-8, 8, (9, 96), generator=g, dtype=torch.int8)
    scales = torch.rand(9, 3, generator=g).half()
    words = pack_to_int32(q, 4)
    fast = Int4Weight.from_words(words, scales, 96, torch.float32)
    slow = Int4Weight.from_int(unpack_from_int32(words, 4, torch.Size((9, 96))), scales, torch.float32)
    assert torch.equal(fast.packed, slow.packed) and torch.equal(fast.scales, slow.scales)
    half = Int4Weight.from_words(words[:, 4:], scales[:, 1:], 64, torch.float32)  # a rank's columns, on groups
    assert torch.equal(half.dequantize(), slow.dequantize()[:, 32:])
    with pytest.raises(ValueError, match="multiple of 32"):
        Int4Weight.from_words(pack_to_int32(q[:, :40], 4), scales[:, :2], 40, torch.float32)
