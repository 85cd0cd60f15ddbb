"""``mla_kernels.grouped_gemm``: several experts' float products in one launch over tokens sorted by expert, equal to
one product per expert; and a MoE layer's experts through it (the path CUDA takes) equal to the loop over experts."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # kernels: interpret Triton on CPU (must precede the first triton import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mla_kernels.grouped_gemm import grouped_gemm  # noqa: E402
from mla_runtime.kernel_plan import kernel_plan  # noqa: E402
from mla_runtime.layers.moe import Experts  # noqa: E402
from tests.kernel_utils import DEVICE  # noqa: E402


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 17, 0], [1, 1, 1, 1], [40, 2, 0, 9]])
def test_each_expert_s_rows_take_its_matrix(dtype, tol, counts):
    g = torch.Generator().manual_seed(sum(counts))
    n_experts, n, k = len(counts), 24, 40  # K not a multiple of the K tile, N not of the column tile
    weight = torch.randn(n_experts, n, k, generator=g).to(dtype).to(DEVICE)
    spare = 3  # rows after every expert's: no expert's, left 0
    x = torch.randn(sum(counts) + spare, k, generator=g).to(dtype).to(DEVICE)
    offsets = torch.tensor([0] + counts, device=DEVICE).cumsum(0)
    got = grouped_gemm(x, weight, offsets)
    assert got.dtype == dtype and got.shape == (x.shape[0], n)
    for e in range(n_experts):
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        want = x[rows].float() @ weight[e].float().T
        torch.testing.assert_close(got[rows].float(), want, rtol=tol, atol=tol * 4)
    assert not got[-spare:].any()


def test_bad_arguments_are_named():
    w = torch.zeros(2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="offsets"):
        grouped_gemm(torch.zeros(3, 8, device=DEVICE), w, torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="x must be"):
        grouped_gemm(torch.zeros(3, 7, device=DEVICE), w, torch.zeros(3, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_moe_experts_grouped_on_the_device_equal_the_loop(monkeypatch, tokens):
    torch.manual_seed(tokens)
    experts = Experts(6, 32, 16, torch.float32)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    experts.prepare_inference(kernel_plan())
    x = torch.randn(tokens, 32)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2)
    want = experts(x, weights, ids)
    monkeypatch.setattr(Experts, "device_grouping", True)
    assert experts.float_stacks()
    torch.testing.assert_close(experts(x, weights, ids), want, rtol=1e-5, atol=1e-6)
