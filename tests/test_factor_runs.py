"""The absorbed factors as runs (``layers.factor_runs``): a GGUF file's ``attn_k_b`` / ``attn_v_b`` values rebuilt
exactly from their int8 values and per-run scales and offsets, and the compiled absorbed decode on them giving the
bits it gives on the widened float32 factors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mla_kernels import cpu_kernels
from mla_runtime.layers.factor_runs import absorbed_runs
from mla_runtime.layers.gguf_weight import RUN, dequantize_rows, row_bytes, run_scales
from tests.gguf_files import OWN_QUANTISERS, kquant_bytes

RUN_TYPES = ("Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K")


def _stored(type_name: str, rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows of ``k`` values in ``type_name`` as uint8 ``[rows, row_bytes]``: a quantiser's (the tests' own Q4_K and
    Q6_K, else the ``gguf`` package's), or valid random blocks for the other K-quants."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    x = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32) * 0.05
    if type_name in OWN_QUANTISERS:
        data = OWN_QUANTISERS[type_name](x)
    elif type_name.endswith("_K"):
        data = kquant_bytes(type_name, rows, k, seed)
    else:
        data = quantize(x, GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(rows, row_bytes(type_name, k)).copy())


def _factor(type_name: str, heads: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A factor ``[heads, k, n]`` whose columns are rows of a file (runs along ``k``), and its run scales and offsets
    laid out as the factor (``[heads, k / 32, n]``)."""
    data = _stored(type_name, heads * n, k, seed)
    w = dequantize_rows(type_name, data, k).reshape(heads, n, k).transpose(1, 2).contiguous()
    scales = run_scales(type_name, data, k)
    assert scales is not None
    a, b = (t.reshape(heads, n, k // RUN).transpose(1, 2).contiguous() for t in scales)
    return w, a, b


@pytest.mark.parametrize("type_name", RUN_TYPES)
def test_runs_give_back_every_value_of_the_dequantised_factor(type_name):
    w, a, b = _factor(type_name, 3, 256, 40, seed=1)
    runs = absorbed_runs(w, a, b)
    assert runs is not None and runs.dtype == torch.uint8 and runs.shape == (3, 256 + 64, 40)
    q = runs[:, :256].view(torch.int8).float()
    ab = runs[:, 256:].contiguous().view(torch.float32).reshape(3, 2, 256 // RUN, 40)
    values = torch.addcmul(ab[:, 1].repeat_interleave(RUN, 1), ab[:, 0].repeat_interleave(RUN, 1), q)
    assert torch.equal(values, w)


def test_runs_are_refused_where_they_do_not_give_back_the_factor():
    w, a, b = _factor("Q4_K", 2, 256, 8, seed=2)
    nudged = w.clone()
    nudged[1, 7, 3] = torch.nextafter(nudged[1, 7, 3], torch.tensor(1.0))  # not A q + B for any integer q
    assert absorbed_runs(nudged, a, b) is None
    assert absorbed_runs(w[:, :200], a, b) is None  # not whole runs
    assert absorbed_runs(w.transpose(1, 2).contiguous(), a, b) is None  # another layout
    assert run_scales("Q6_K", _stored("Q6_K", 2, 256, 3), 256) is None  # 16-value sub-blocks: no runs of 32


@pytest.mark.skipif(cpu_kernels.failure() is not None, reason="the compiled CPU kernels do not run here")
@pytest.mark.parametrize("variant", ["avx2", "avx512"])
def test_the_absorbed_decode_on_runs_is_the_decode_on_the_float_factors(variant):
    """Bit for bit, for one row and several, W_UK from Q5_0 rows and W_UV^T from Q4_K rows (a Q4_K_M file's)."""
    if variant not in cpu_kernels.variants("float"):
        pytest.skip(f"this CPU does not run the {variant} kernels")
    heads, d_n, d_c, d_r, d_v = 4, 64, 256, 16, 32
    w_uk, a_uk, b_uk = _factor("Q5_0", heads, d_n, d_c, seed=4)
    w_uv_t, a_uv, b_uv = _factor("Q4_K", heads, d_c, d_v, seed=5)
    uk, uv = absorbed_runs(w_uk, a_uk, b_uk), absorbed_runs(w_uv_t, a_uv, b_uv)
    assert uk is not None and uv is not None
    g = torch.Generator().manual_seed(6)
    cache = torch.randn(40, d_c + d_r, generator=g)
    for rows in (1, 5):
        q_n, q_r = torch.randn(rows, heads, d_n, generator=g), torch.randn(rows, heads, d_r, generator=g)
        slots = torch.stack([torch.randperm(40, generator=g)[:30] for _ in range(rows)])
        lens = torch.tensor([30 - 3 * r for r in range(rows)])
        want = cpu_kernels.ops().absorbed_decode(q_n, q_r, w_uk, w_uv_t, cache, slots, lens, 0.2, variant)
        got = cpu_kernels.ops().absorbed_decode(q_n, q_r, uk, uv, cache, slots, lens, 0.2, variant)
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="w_uv_t \\(runs\\)"):
        cpu_kernels.ops().absorbed_decode(q_n, q_r, uk, uv[:, :-1], cache, slots, lens, 0.2, variant)
