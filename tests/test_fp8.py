"""Block-FP8 weights kept as stored (``Fp8Weight``): the format, stacking and row selection, the CPU kernel against the
float64 product of the dequantised matrix, and the fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mla_kernels import cpu_kernels
from mla_runtime.kernel_plan import kernel_plan, onednn_linear
from mla_runtime.layers import qweight
from mla_runtime.layers.fp8 import Fp8Weight, quantize_fp8_block
from mla_runtime.loader import dequantize_fp8_block

FP8 = torch.float8_e4m3fn
needs_kernel = pytest.mark.skipif(cpu_kernels.failure("fp8") is not None,
                                  reason=f"the FP8 CPU kernel does not run here: {cpu_kernels.failure('fp8')}")


def stored(n: int, k: int, block: tuple[int, int], seed: int) -> Fp8Weight:
    """A weight as a checkpoint stores it: e4m3 values over the whole range, scales around 1e-3."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    s = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 2e-3 + 1e-4
    return Fp8Weight(w, s, block, torch.float32)


def assert_product(got: torch.Tensor, x: torch.Tensor, wide: torch.Tensor, rel: float = 1e-6) -> None:
    """``got`` against the float64 product, within ``rel`` of the products' magnitudes (float32 summation)."""
    want = x.double() @ wide.double().T
    bound = rel * (x.double().abs() @ wide.double().abs().T) + 1e-30
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"largest error {(err / bound).max().item():.3g} x the bound"


def test_quantize_round_trip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 320, generator=g)
    w[3, 5] = 40.0  # an outlier: only its own block's scale grows
    w[128:, 256:] = 0.0  # an all-zero block: scale 1, values 0
    q = Fp8Weight.quantize(w.bfloat16())
    assert q.block == (128, 128) and q.weight.dtype == FP8 and q.scale_inv.shape == (2, 3)
    assert q.plain.shape == w.shape and q.plain.dtype == torch.bfloat16 and q.plain.untyped_storage().nbytes() <= 4
    assert q.nbytes == 200 * 320 + 6 * 4
    wb = w.bfloat16().float()
    amax = F.pad(wb, (0, 64, 0, 56)).view(2, 128, 3, 128).abs().amax(dim=(1, 3))
    assert torch.equal(q.scale_inv, torch.where(amax > 0, amax / 448, 1.0))
    assert q.scale_inv[0, 0] > q.scale_inv[0, 1]
    dq = q.dequantize()
    assert dq.dtype == torch.float32
    assert torch.equal(dq, dequantize_fp8_block(q.weight, q.scale_inv, q.block))  # what the loader computes
    step = q.scale_inv.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :320]
    # e4m3: 3 mantissa bits (half a step: 2^-4 of the value); subnormals spaced 2^-9 of the scale
    assert ((dq - wb).abs() <= wb.abs() * 2 ** -4 + step * 2 ** -10 + 1e-7).all()
    assert (dq[128:, 256:] == 0).all() and q.scale_inv[1, 2] == 1.0
    assert torch.equal(quantize_fp8_block(w, (32, 64))[0].float().abs().amax(), torch.tensor(448.0))


def test_cat_is_the_stacked_quantisation_and_needs_whole_blocks():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(256, 200, generator=g), torch.randn(72, 200, generator=g)
    both = Fp8Weight.cat([Fp8Weight.quantize(a), Fp8Weight.quantize(b)])
    whole = Fp8Weight.quantize(torch.cat([a, b]))
    assert both.shape == (328, 200) and both.block == whole.block
    assert torch.equal(both.weight.view(torch.uint8), whole.weight.view(torch.uint8))
    assert torch.equal(both.scale_inv, whole.scale_inv)
    with pytest.raises(ValueError, match="part 0 has 72 rows, not a multiple of its 128 block rows"):
        Fp8Weight.cat([Fp8Weight.quantize(b), Fp8Weight.quantize(a)])
    with pytest.raises(ValueError, match="share both"):
        Fp8Weight.cat([stored(128, 200, (128, 128), 0), stored(64, 200, (64, 128), 1)])
    with pytest.raises(ValueError, match="share both"):
        Fp8Weight.cat([stored(128, 200, (128, 128), 0), stored(64, 100, (128, 128), 1)])


def test_select_rows():
    q = stored(200, 320, (128, 128), 2)
    index = torch.tensor([5, 130, 199, 0, 5])
    rows = q.select_rows(index)
    assert rows.block == (1, 128) and rows.shape == (5, 320) and rows.scale_inv.shape == (5, 3)
    assert torch.equal(rows.dequantize(), q.dequantize()[index])
    x = torch.randn(3, 320)
    assert_product(rows.matmul(x, None), x, q.dequantize()[index])


@needs_kernel
@pytest.mark.parametrize("n, k, block", [(200, 320, (128, 128)), (37, 77, (16, 32)), (64, 128, (1, 128))])
def test_cpu_kernel_against_the_float64_product(n, k, block):
    q = stored(n, k, block, n + k)
    wide = q.dequantize()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, k, generator=g)
    threads = torch.get_num_threads()
    try:
        results = {}
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (1, 3, 8, 64):
                got = cpu_kernels.linear(x[:rows], q.weight, q.scale_inv, block=block)
                assert got.shape == (rows, n) and got.dtype == torch.float32
                assert_product(got, x[:rows], wide)
                results[t, rows] = got
    finally:
        torch.set_num_threads(threads)
    for (t, rows), got in results.items():  # each row's result: the same whatever the rows beside it and threads
        assert torch.equal(got, results[1, 64][:rows]), (t, rows)


def test_matmul_paths(gemm_mode, plan):
    q = stored(200, 320, (128, 128), 4).bind(plan)
    assert q.kernel == (gemm_mode == "auto" and cpu_kernels.failure("fp8") is None)
    wide = q.dequantize()
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(200, generator=g)
    for shape in ((1, 320), (2, 3, 320), (65, 320), (0, 320)):  # the kernel's rows, and above them the fallback
        x = torch.randn(*shape, generator=g)
        got = q.matmul(x, bias)
        assert got.shape == (*shape[:-1], 200) and got.dtype == torch.float32
        rows = x.reshape(-1, 320)
        assert_product(got.reshape(-1, 200) - bias, rows, wide, rel=2e-6)


def test_many_rows_take_onednn_on_the_widened_weight_inside_the_operator():
    """Past the kernel's 64 rows the operator itself widens the weight a block of rows at a time and takes oneDNN's
    float32 product (a prefill's route): the bits of oneDNN on the dequantised weight, and a row's result the same
    whatever shares it."""
    plan = kernel_plan()
    q = stored(300, 256, (128, 128), 7).bind(plan)
    if not q.kernel:
        pytest.skip(f"the FP8 kernel does not run on this CPU: {plan.fp8_failure}")
    x = torch.randn(150, 256, generator=torch.Generator().manual_seed(8))
    got = q.matmul(x, None)
    assert torch.equal(got, onednn_linear(x, q.dequantize()))
    assert torch.equal(q.matmul(x[40:120], None), got[40:120])


def test_matmul_in_bfloat16_with_a_bias(plan):
    q = stored(96, 160, (32, 32), 6)
    q = Fp8Weight(q.weight, q.scale_inv, q.block, torch.bfloat16).bind(plan)
    g = torch.Generator().manual_seed(7)
    x, bias = torch.randn(4, 160, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    got = q.matmul(x, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (4, 96)
    want = F.linear(x.double(), q.dequantize().double(), bias.double())
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-2)


def test_fallback_dequantises_a_bounded_number_of_rows(monkeypatch):
    q = stored(200, 320, (128, 128), 8).bind(kernel_plan("plain"))
    x = torch.randn(5, 320)
    whole = q.matmul(x, None)
    monkeypatch.setattr(qweight, "WIDEN_CHUNK_ELEMENTS", 320 * 48)  # 48 rows at a time: 5 chunks
    chunked = q.matmul(x, None)
    for got in (whole, chunked):
        assert_product(got, x, q.dequantize())


def test_constructor_checks():
    w = torch.zeros(64, 96, dtype=FP8)
    with pytest.raises(ValueError, match=r"takes float scales \[1, 1\]"):
        Fp8Weight(w, torch.ones(1, 2), (128, 128), torch.float32)
    with pytest.raises(ValueError, match="2-D float8_e4m3fn"):
        Fp8Weight(w.float(), torch.ones(1, 1), (128, 128), torch.float32)
    with pytest.raises(ValueError, match="two positive sizes"):
        Fp8Weight(w, torch.ones(1, 1), (0, 128), torch.float32)
    assert Fp8Weight(w, torch.ones(1, 1, dtype=torch.bfloat16), (128, 128), torch.float32).scale_inv.dtype == \
        torch.float32
    assert Fp8Weight(w, torch.ones(1, 1), (128, 128), torch.float32).row_operand() is None
