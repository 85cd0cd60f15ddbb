"""The Triton block-FP8 kernels (``mla_kernels.fp8_gemm``) against the same computation in torch: the activation
quantisation value for value, the products against the float64 product of the dequantised operands (so the only
difference left is float32 summation), with partial blocks, one and many rows, and the grouped (MoE) kernel."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # kernels: interpret Triton on CPU (must precede the first triton import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mla_kernels.fp8_gemm import act_quant_fp8, fp8_gemm, fp8_grouped_gemm  # noqa: E402
from mla_runtime.kernel_plan import OFF_CPU, kernel_plan  # noqa: E402
from tests.kernel_utils import DEVICE  # noqa: E402

FP8 = torch.float8_e4m3fn


def ref_act_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, groups of ``group`` values: scale = max(amax, 1e-10) / 448, values rounded to nearest e4m3."""
    x = x.float()
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x, (0, groups * group - k)).view(m, groups, group)
    s = padded.abs().amax(-1).clamp(min=1e-10) / 448.0
    q = (padded / s[..., None]).clamp(-448.0, 448.0).to(FP8).view(m, groups * group)[:, :k]
    return q, s


def dequantize(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = w.shape
    return w.double() * s.double().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def random_fp8(shape: tuple[int, ...], block: tuple[int, int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-FP8 weight: values spread over e4m3's range, scales around 1e-3 (as real checkpoints)."""
    *lead, n, k = shape
    w = (torch.randn(*shape, generator=g) * 100).clamp(-448, 448).to(FP8)
    s = torch.rand(*lead, -(-n // block[0]), -(-k // block[1]), generator=g) * 2e-3 + 1e-4
    return w.to(DEVICE), s.to(DEVICE)


def reference(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float64 product of the quantised activations and the dequantised weight, the sum of the products'
    magnitudes: the scale of float32 summation's error)."""
    q, qs = ref_act_quant(x.cpu(), block[1])
    xd = q.double() * qs.double().repeat_interleave(block[1], 1)[:, :x.shape[1]]
    wd = dequantize(w.cpu(), s.cpu(), block)
    return xd @ wd.T, xd.abs() @ wd.abs().T


def assert_product(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype) -> None:
    # float32 sums: a few units of 2^-24 of the magnitudes; a bf16/fp16 result adds its own rounding (one bf16 unit:
    # the interpreter's conversion to bfloat16 truncates)
    rounding = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -11}[dtype]
    bound = 1e-6 * magnitude + rounding * want.abs() + 1e-30
    err = (got.cpu().double() - want).abs()
    assert (err <= bound).all(), f"largest error {(err / bound).max().item():.3g} x the bound"


def test_act_quant_rounds_as_torch():
    """Every tie between neighbouring e4m3 values (normal and subnormal) rounds to even, as torch's conversion."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()  # 0 .. 448, ascending
    ties = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(1e9)), grid])
    row = torch.cat([near, -near, torch.tensor([448.0])])  # amax 448: the scale is 1, the values pass unchanged
    g = torch.Generator().manual_seed(0)
    x = torch.stack([row, row.flip(0), torch.randn(row.numel(), generator=g) * 1e-3])
    x[2, :40] = 0.0  # an all-zero group: scale 1e-10 / 448, values 0
    for group in (32, 128, 100):
        q, s = act_quant_fp8(x.to(DEVICE), group)
        want_q, want_s = ref_act_quant(x, group)
        assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (3, -(-x.shape[1] // group))
        assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s.cpu(), want_s)


@pytest.mark.parametrize("n, k, block, rows", [
    (200, 320, (128, 128), 1),
    (200, 320, (128, 128), 70),
    (200, 300, (32, 32), 1),
    (200, 300, (32, 32), 3),
    (72, 96, (1, 32), 5),  # one scale row per output row (selected rows)
    (40, 72, (64, 16), 17),
])
def test_fp8_gemm_against_the_dequantised_product(n, k, block, rows):
    g = torch.Generator().manual_seed(n + k + rows)
    w, s = random_fp8((n, k), block, g)
    x = torch.randn(rows, k, generator=g)
    x[0, :5] *= 50  # an outlier: only its own group's scale grows
    got = fp8_gemm(x.to(DEVICE), w, s, block)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert_product(got, *reference(x, w, s, block), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_gemm_in_half_precision_with_a_bias_and_leading_dims(dtype):
    g = torch.Generator().manual_seed(1)
    block = (32, 32)
    w, s = random_fp8((48, 96), block, g)
    x = torch.randn(2, 3, 2 * 96, generator=g).to(dtype)[..., ::2]  # rows with a stride, inner stride 2
    bias = torch.randn(48, generator=g).to(dtype)
    got = fp8_gemm(x.to(DEVICE), w, s, block, bias.to(DEVICE))
    assert got.dtype == dtype and got.shape == (2, 3, 48)
    want, magnitude = reference(x.reshape(6, 96), w, s, block)
    assert_product(got.reshape(6, 48), want + bias.double(), magnitude + bias.double().abs(), dtype)
    assert fp8_gemm(x[:0].to(DEVICE), w, s, block).shape == (0, 3, 48)


def test_fp8_grouped_gemm_with_an_expert_without_tokens():
    g = torch.Generator().manual_seed(2)
    block = (32, 32)
    n, k = 72, 96
    counts = [5, 0, 19, 1]  # expert 1 has no tokens
    w, s = random_fp8((len(counts), n, k), block, g)
    x = torch.randn(sum(counts), k, generator=g)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    got = fp8_grouped_gemm(x.to(DEVICE), w, s, offsets.to(DEVICE), block)
    assert got.shape == (sum(counts), n) and got.dtype == torch.float32
    for e in range(len(counts)):
        lo, hi = offsets[e].item(), offsets[e + 1].item()
        if hi > lo:
            assert_product(got[lo:hi], *reference(x[lo:hi], w[e], s[e], block), torch.float32)
    part = fp8_grouped_gemm(x[[0, 5, 1, 2]].to(DEVICE), w, s, torch.tensor([0, 1, 1, 2, 2]).to(DEVICE), block)
    torch.testing.assert_close(part[:2], got[[0, 5]], rtol=1e-6, atol=1e-6)
    assert (part[2:] == 0).all()  # rows of no expert: 0
    one = fp8_grouped_gemm(x[:1].to(DEVICE).bfloat16(), w, s, torch.tensor([0, 0, 0, 1, 1]).to(DEVICE), block)
    want, magnitude = reference(x[:1].bfloat16(), w[2], s[2], block)  # the one token is expert 2's
    assert_product(one, want, magnitude, torch.bfloat16)


def test_fp8_gemm_rejects_what_it_cannot_run():
    g = torch.Generator().manual_seed(3)
    w, s = random_fp8((64, 64), (32, 32), g)
    x = torch.randn(2, 64).to(DEVICE)
    with pytest.raises(ValueError, match="scale_inv must be float32"):
        fp8_gemm(x, w, s[:1], (32, 32))
    with pytest.raises(ValueError, match="power of two"):
        fp8_gemm(x, w, torch.ones(2, 3, device=DEVICE), (32, 24))
    with pytest.raises(ValueError, match="weight must be a float8_e4m3fn"):
        fp8_gemm(x, w.float(), s, (32, 32))
    with pytest.raises(ValueError, match=r"x must be float32/bfloat16/float16 \[\.\.\., 64\]"):
        fp8_gemm(x[:, :32], w, s, (32, 32))
    with pytest.raises(ValueError, match="offsets must be"):
        fp8_grouped_gemm(x, w[None], s[None], torch.tensor([0, 2], dtype=torch.float32, device=DEVICE), (32, 32))


def test_moe_experts_run_as_two_grouped_launches(monkeypatch):
    """``Experts`` with block-FP8 weights: the grouped path (taken on CUDA; called directly here) against each pair
    run through the dense kernel, with a rank that holds experts 1-4 of 6 (pairs of other ranks add nothing)."""
    from mla_runtime.layers.fp8 import Fp8Weight, quantize_fp8_block
    from mla_runtime.layers.moe import Experts

    g = torch.Generator().manual_seed(4)
    n_experts, hidden, inter, block = 4, 64, 48, (32, 32)

    def fp8(n: int, k: int) -> Fp8Weight:
        q, s = quantize_fp8_block(torch.randn(n, k, generator=g) * 0.2, block)
        return Fp8Weight(q.to(DEVICE), s.to(DEVICE), block, torch.float32)

    experts = Experts(n_experts, hidden, inter, torch.float32)
    experts.first = 1
    experts.gate_up_packed = [fp8(2 * inter, hidden) for _ in range(n_experts)]
    experts.down_packed = [fp8(hidden, inter) for _ in range(n_experts)]
    experts.prepare_inference(OFF_CPU if DEVICE != "cpu" else kernel_plan())
    stacks = experts.fp8_stacks()
    assert stacks is not None and stacks.gate_up.shape == (n_experts, 2 * inter, hidden)
    assert experts.fp8_stacks() is stacks  # made once
    assert experts.gate_up_packed[2].weight.data_ptr() == stacks.gate_up[2].data_ptr()  # a view: no second copy
    x = torch.randn(7, hidden, generator=g).to(DEVICE)
    ids = torch.tensor([[1, 2], [0, 4], [3, 5], [2, 1], [4, 4], [5, 0], [1, 3]], device=DEVICE)  # 0, 5: other ranks
    weights = torch.rand(7, 2, generator=g).to(DEVICE)
    got = experts._fp8_grouped(x, weights, ids, stacks)
    want = torch.zeros(7, hidden, dtype=torch.float64)
    for t in range(7):
        for j in range(2):
            e = int(ids[t, j]) - 1
            if 0 <= e < n_experts:
                gu, dn = experts.gate_up_packed[e], experts.down_packed[e]
                gate, up = fp8_gemm(x[t:t + 1], gu.weight, gu.scale_inv, block).chunk(2, dim=-1)
                y = fp8_gemm(F.silu(gate) * up, dn.weight, dn.scale_inv, block)
                want[t] += float(weights[t, j]) * y[0].double().cpu()
    assert got.shape == x.shape and got.dtype == x.dtype
    assert (got[5] == 0).all()  # both of its experts are other ranks'
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    if not x.is_cuda:  # a CPU keeps its own path
        monkeypatch.setattr(Experts, "_fp8_grouped", lambda *a: pytest.fail("the grouped path ran on a CPU"))
        assert experts(x, weights, ids).shape == x.shape
