"""The compiled CPU products with weights in ggml's block types as a GGUF file stores them (``ggml_linear``), and
``GgufWeight``'s use of them."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mla_kernels import cpu_kernels, cpu_ops
from mla_kernels.cpu_check import GGML_TYPES
from mla_runtime.kernel_plan import kernel_plan
from mla_runtime.layers.gguf_weight import KERNEL_TYPES, GgufWeight, q4_k_from_r8, type_number
from tests.gguf_files import dequantized, kquant_bytes, q8_rounded, quantize_q4_k, quantize_q6_k

VARIANTS = ("avx2", "avx512_vnni")


def _kernel_or_skip() -> None:
    why = cpu_kernels.failure("ggml")
    if why is not None:
        pytest.skip(f"the ggml-type kernels are unavailable here: {why}")


def _variant_or_skip(variant: str) -> None:
    _kernel_or_skip()
    if variant not in cpu_kernels.variants("ggml"):
        pytest.skip(f"this CPU does not execute the ggml-type kernels' {variant} variant (it runs "
                    f"{list(cpu_kernels.variants('ggml'))})")


def _type_number(type_name: str) -> int:
    from gguf import GGMLQuantizationType

    return int(GGMLQuantizationType[type_name])


def blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """``[n, k]`` in ``type_name``: a random matrix quantised (the package's quantisers, the test ones for Q4_K and
    Q6_K), or random valid blocks for the K-quants nothing here quantises."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    if type_name == "Q4_K":
        return quantize_q4_k(w)
    if type_name == "Q6_K":
        return quantize_q6_k(w)
    if type_name in ("Q2_K", "Q3_K", "Q5_K"):
        return kquant_bytes(type_name, n, k, seed)
    return np.asarray(quantize(w, GGMLQuantizationType[type_name]))


def _operands(type_name: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the stored bytes [n, row bytes], the package's dequantised float32 matrix)."""
    data = np.ascontiguousarray(blocks(type_name, n, k, seed)).view(np.uint8).reshape(n, -1)
    return torch.from_numpy(data.copy()), dequantized(type_name, data).reshape(n, k)


def _shapes(type_name: str) -> list[tuple[int, int]]:
    """(n, k): several blocks a row, an odd count of 32-value blocks, and a thread's block of rows left short."""
    return [(37, 1024), (9, 768)] if type_name.endswith("_K") else [(37, 256), (9, 96), (130, 160)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("type_name", sorted(GGML_TYPES))
def test_each_kernel_is_its_rounded_rows_times_the_dequantised_weight(type_name, variant):
    """Within float32 summation order of the exact product of the rounded rows (``q8_rounded``: groups of 32, and of
    256 for the K-quants) and the weight the ``gguf`` package dequantises; a row's bits the same alone and among 5 and
    64 rows, and in every variant."""
    _variant_or_skip(variant)
    for n, k in _shapes(type_name):
        w, wide = _operands(type_name, n, k, seed=n + k)
        g = torch.Generator().manual_seed(n * k)
        x = torch.randn(64, k, generator=g) * torch.logspace(-2, 2, k)[torch.randperm(k, generator=g)]
        xr = q8_rounded(x, 256 if type_name.endswith("_K") else 32).double()
        got = cpu_kernels.ggml_linear(x, w, _type_number(type_name), variant=variant)
        want = xr @ wide.double().T
        assert got.dtype == torch.float32 and got.shape == (64, n)
        assert ((got.double() - want).abs() <= 2e-6 * (xr.abs() @ wide.double().abs().T) + 1e-30).all()
        for rows in (1, 5):
            for first in (0, 64 - rows):
                part = cpu_kernels.ggml_linear(x[first:first + rows], w, _type_number(type_name), variant=variant)
                assert torch.equal(part, got[first:first + rows])
        assert torch.equal(got, cpu_kernels.ggml_linear(x, w, _type_number(type_name)))  # "auto": the same bits


def test_rows_past_one_call_and_threads():
    """More rows than one kernel call takes, and any thread count: each row the bits it has alone."""
    _kernel_or_skip()
    w, _ = _operands("Q4_K", 70, 512, seed=1)
    x = torch.randn(150, 512)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(cpu_kernels.ggml_linear(x, w, _type_number("Q4_K")))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(outs[0][149:], cpu_kernels.ggml_linear(x[149:], w, _type_number("Q4_K")))


def test_a_non_finite_group_makes_its_row_nan():
    _kernel_or_skip()
    w, _ = _operands("Q8_0", 8, 64, seed=2)
    x = torch.randn(3, 64)
    x[1, 40] = float("inf")
    x[2, :32] = 0.0
    x[2, 3] = 1e-40  # a subnormal group: 127 / amax is infinite, its zeros stay zeros
    y = cpu_kernels.ggml_linear(x, w, _type_number("Q8_0"))
    assert y[1].isnan().all() and y[[0, 2]].isfinite().all()
    x[2, 3] = 0.0
    assert torch.equal(y[2], cpu_kernels.ggml_linear(x[2:], w, _type_number("Q8_0"))[0])


def test_bad_operands_are_refused():
    _kernel_or_skip()
    w, _ = _operands("Q6_K", 4, 256, seed=3)
    with pytest.raises(ValueError, match="no kernel reads ggml type 14 in rows of 128 values"):
        cpu_kernels.ggml_linear(torch.randn(2, 128), w, _type_number("Q6_K"))
    with pytest.raises(ValueError, match="no kernel reads ggml type 2 in rows"):  # Q4_0: the int4 format's
        cpu_kernels.ggml_linear(torch.randn(2, 256), w, _type_number("Q4_0"))
    with pytest.raises(ValueError, match=r"the weight's blocks must be CPU uint8 rows \[N, 210\]"):
        cpu_kernels.ggml_linear(torch.randn(2, 256), w[:, :-1], _type_number("Q6_K"))
    with pytest.raises(ValueError, match=r"the weight's blocks must be CPU uint8 rows \[N, 210\]"):
        cpu_kernels.ggml_linear(torch.randn(2, 256), w.t().contiguous().t(), _type_number("Q6_K"))
    with pytest.raises(ValueError, match="unknown variant 'sse2'"):
        cpu_kernels.ggml_linear(torch.randn(2, 256), w, _type_number("Q6_K"), variant="sse2")


def test_rows_apart_read_as_rows_back_to_back():
    """A weight whose rows lie apart (a rank's columns of a mapped file) gives what its contiguous copy gives."""
    _kernel_or_skip()
    w, _ = _operands("Q4_K", 9, 1024, seed=4)
    columns = w[:, 144:432]  # super-blocks 1 and 2 of each row: K = 512
    assert not columns.is_contiguous()
    x = torch.randn(3, 512)
    got = cpu_kernels.ggml_linear(x, columns, _type_number("Q4_K"))
    assert torch.equal(got, cpu_kernels.ggml_linear(x, columns.contiguous(), _type_number("Q4_K")))


_CAPPED = """
import sys, torch
from mla_kernels import cpu_kernels
data = torch.load(sys.argv[1])
print(",".join(cpu_kernels.variants("ggml")))
torch.save([cpu_kernels.ggml_linear(data["x"], w, t) for t, w in data["weights"]], sys.argv[2])
"""


def test_a_process_capped_at_avx2_computes_the_same_bits(tmp_path):
    """``MLA_CPU_ISA=avx2`` runs the AVX2 variant only, and its products are this process's bit for bit (the
    variants compute the same operations)."""
    _kernel_or_skip()
    weights = [(_type_number(t), _operands(t, 19, 512, seed=5)[0]) for t in sorted(GGML_TYPES)]
    x = torch.randn(9, 512)
    torch.save({"x": x, "weights": weights}, tmp_path / "in.pt")
    env = {**os.environ, cpu_ops.ISA_ENV: "avx2"}
    done = subprocess.run([sys.executable, "-c", _CAPPED, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "avx2"
    for (t, w), got in zip(weights, torch.load(tmp_path / "out.pt"), strict=True):
        assert torch.equal(got, cpu_kernels.ggml_linear(x, w, t)), t
        assert torch.equal(got, cpu_kernels.ggml_linear(x, w, t, variant="avx2")), t


def test_a_gguf_weight_takes_the_kernels_for_their_parts_and_widens_the_others():
    """A matrix stacked from a Q4_K, an F16 and a Q6_K part: the block parts' rows are the kernel's, the F16 part's
    the widened product; under ``cpu_gemm=plain`` every part is widened."""
    _kernel_or_skip()
    (q4, q4_wide), (q6, q6_wide) = _operands("Q4_K", 12, 256, seed=6), _operands("Q6_K", 7, 256, seed=7)
    f16 = torch.randn(5, 256).half()
    weight = GgufWeight([("Q4_K", q4), ("F16", f16.view(torch.uint8)), ("Q6_K", q6)], 256, torch.float32)
    assert weight.kernel and {"Q4_K", "Q6_K"} <= KERNEL_TYPES and "F16" not in KERNEL_TYPES
    x = torch.randn(2, 3, 256)
    got = weight.matmul(x, torch.ones(24))
    rows = x.reshape(6, 256)
    assert torch.equal(got[..., :12].reshape(6, 12), cpu_kernels.ggml_linear(rows, q4, _type_number("Q4_K")) + 1)
    assert torch.equal(got[..., 17:].reshape(6, 7), cpu_kernels.ggml_linear(rows, q6, _type_number("Q6_K")) + 1)
    torch.testing.assert_close(got[..., 12:17], x @ f16.float().T + 1)
    torch.testing.assert_close(got[..., :12], q8_rounded(rows, 256).reshape(2, 3, 256) @ q4_wide.T + 1)
    weight.bind(kernel_plan("plain"))
    assert not weight.kernel
    want = x @ torch.cat([q4_wide, f16.float(), q6_wide]).T + 1
    torch.testing.assert_close(weight.matmul(x, torch.ones(24)), want)
    assert kernel_plan("plain").ggml_failure == "cpu_gemm=plain forces the fallback"


def test_the_mlps_of_a_steps_rows_in_one_region_equal_each_mlp_alone():
    """``mlps_rows``, the whole-layer kernel's MoE over a step's rows (in ggml types every MLP's products in one
    parallel region, for any number of rows): each MLP's output for each of its rows equals, bit for bit, that row
    through that MLP alone (``gated_mlps`` with weight 1). MLPs of mixed types (gate and up apart) and intermediate
    sizes, rows in any order, a shared MLP over every row, enough rows for the interleaved kernels, 1 to 3
    threads."""
    _kernel_or_skip()
    from mla_kernels.cpu_tables import GatedMLPTable

    d, keep = 256, []

    def matrix(types: list[str], n: int, k: int, seed: int) -> torch.Tensor:
        parts = [_operands(t.removesuffix("_R8"), n // len(types), k, seed + i)[0] for i, t in enumerate(types)]
        parts = [cpu_kernels.ggml_repack(p, k) if t == "Q4_K_R8" else p for p, t in zip(parts, types)]
        keep.extend(parts)
        return cpu_kernels.ggml_parts(parts, [type_number(t) for t in types], k)

    mlps = [(matrix(["Q4_K", "Q6_K"], 2 * 96, d, 1), matrix(["Q8_0"], d, 96, 2)),
            (matrix(["Q5_0"], 2 * 256, d, 3), matrix(["Q4_K"], d, 256, 4)),
            (matrix(["Q8_0", "Q5_K"], 2 * 128, d, 5), matrix(["Q5_0"], d, 128, 6)),
            (matrix(["Q6_K", "Q4_K_R8"], 2 * 256, d, 7), matrix(["Q4_K_R8"], d, 256, 8))]
    table = GatedMLPTable(mlps)
    x = torch.randn(20, d, generator=torch.Generator().manual_seed(0))
    ids, rows = [2, 0, 3, 1, 2], [[3], [7, 1, 4], [5, 0, 11, 2, 9], list(range(19, 5, -1)), list(range(20))]
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(table.mlps_rows(x, ids, rows))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs)
    alone = torch.stack([table(x[r], [i], [1.0]) for i, group in zip(ids, rows) for r in group])
    assert outs[0].shape == (sum(map(len, rows)), d) and bool((outs[0] != 0).any())
    assert torch.equal(outs[0], alone)
    with pytest.raises(ValueError, match="mlps_rows: row 20 of 20"):
        table.mlps_rows(x, [0], [[20]])
    with pytest.raises(ValueError, match="mlps_rows: MLP 4 of 4"):
        table.mlps_rows(x, [4], [[0]])


@pytest.mark.parametrize("variant", VARIANTS)
def test_q4_k_repacked_eight_rows_at_a_time_has_the_stored_rows_bits(variant):
    """Q4_K rows repacked for the kernels (``ggml_repack``: eight rows interleaved a super-block at a time, scales
    unpacked to bytes) hold the stored bytes exactly (turned back by ``q4_k_from_r8``), and their products equal the
    stored rows' bit for bit: for 1 to 30 input rows (every tail of the kernel's passes of four, and the counts where
    the stored path switches to its interleaved kernel), several super-blocks a row, and rows past a thread's block,
    at 1 and 3 threads."""
    _variant_or_skip(variant)
    before = torch.get_num_threads()
    try:
        for n, k in ((8, 256), (48, 1024), (520, 512)):
            stored = _operands("Q4_K", n, k, n)[0]
            repacked = cpu_kernels.ggml_repack(stored, k)
            assert repacked.shape == (n, k // 256 * 148) and torch.equal(q4_k_from_r8(repacked), stored)
            for threads in (1, 3):
                torch.set_num_threads(threads)
                for m in (1, 2, 3, 4, 5, 7, 9, 24, 30):
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                    want = cpu_kernels.ggml_linear(x, stored, _type_number("Q4_K"), variant=variant)
                    got = cpu_kernels.ggml_linear(x, repacked, cpu_kernels.Q4_K_R8, variant=variant)
                    assert torch.equal(got, want), (n, k, m, threads)
    finally:
        torch.set_num_threads(before)


def test_a_repacked_matrix_is_whole_groups_of_eight_rows():
    """The repack takes whole groups of eight Q4_K rows; a repacked part must start on a group and lie back to back;
    a GgufWeight repacks only the parts that are whole groups, with the same products and values."""
    _kernel_or_skip()
    stored = _operands("Q4_K", 24, 256, 1)[0]
    with pytest.raises(ValueError, match="ggml_repack: Q4_K rows must be .* a multiple of 8"):
        cpu_kernels.ggml_repack(stored[:12], 256)
    with pytest.raises(ValueError, match="ggml_repack: Q4_K rows of 200 values"):
        cpu_kernels.ggml_repack(stored, 200)
    repacked = cpu_kernels.ggml_repack(stored, 256)
    with pytest.raises(ValueError, match="ggml_linear: a repacked Q4_K weight is whole groups of 8 rows"):
        cpu_kernels.ggml_linear(torch.randn(1, 256), repacked[:12], cpu_kernels.Q4_K_R8)
    q8 = _operands("Q8_0", 5, 256, 2)[0]
    with pytest.raises(ValueError, match="ggml_parts: part 1 .* whole groups of 8 rows from a multiple of 8"):
        cpu_kernels.ggml_parts([q8, repacked], [_type_number("Q8_0"), cpu_kernels.Q4_K_R8], 256)
    weight = GgufWeight([("Q4_K", stored), ("Q4_K", stored[:12]), ("Q8_0", q8)], 256, torch.float32)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    before, values = weight.matmul(x, None), weight.dequantize()
    assert weight.repack() and weight.types == ["Q4_K_R8", "Q4_K", "Q8_0"]
    assert torch.equal(weight.matmul(x, None), before) and torch.equal(weight.dequantize(), values)
    assert torch.equal(weight.gather_rows(torch.tensor([30, 3, 17, 3])), values[[30, 3, 17, 3]])
    assert not GgufWeight([("Q8_0", q8)], 256, torch.float32).repack()
