"""Absorbed factors as runs: a quantised checkpoint's ``W_UK`` and ``W_UV^T`` read by the compiled decode kernels at
1.25 bytes a value instead of 4, with the same values.

A GGUF file stores ``kv_b_proj`` split (``attn_k_b``, ``attn_v_b``) in block types whose 32-value blocks run along the
dimension the absorbed products sum over (``d_n`` for ``W_UK [H, d_n, d_c]``, ``d_c`` for ``W_UV^T [H, d_c, d_v]``).
Each run of 32 values down a column is ``A q + B``: one float scale ``A`` and offset ``B`` (``gguf_weight.run_scales``)
and a small integer ``q`` per value. ``absorbed_runs`` stores a head's ``k x n`` factor as its ``q`` (int8, ``k``
rows of ``n``) followed by ``A`` and ``B`` (float32 ``[k / 32, n]`` each, ``k / 4`` rows of ``n`` bytes): uint8
``[H, k + k / 4, n]``, the layout of the kernels' ``FACTOR_RUNS`` (``mla_kernels/csrc/mla_cpu.h``).

The kernels widen a value as ``fma(A, q, B)``. ``A q`` is exact in float32 (checked), so that is the float32 value
the file's dequantiser gives, ``A q + B`` rounded once: the runs are kept only where every value comes back equal,
and the decode then computes exactly what it computes on the widened float32 factors, reading less than a third of
their bytes (DeepSeek-V2-Lite: 8.4 MB a layer and token in float32, 2.6 MB as runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_runtime.layers.gguf_weight import RUN


def absorbed_runs(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """The factor ``w`` (float32 ``[H, k, n]``) as runs (uint8 ``[H, k + k / 4, n]``, the module docstring) under the
    scales ``a`` and offsets ``b`` (``[H, k / 32, n]``), or None where they do not give back every value of ``w``
    exactly (another factor than the one they came with, a value outside int8, a product ``A q`` that rounds)."""
    if w.dim() != 3 or w.dtype != torch.float32 or w.device.type != "cpu":
        return None
    h, k, n = w.shape
    if k % RUN or a.shape != (h, k // RUN, n) or b.shape != a.shape:
        return None
    aa, bb = a.repeat_interleave(RUN, dim=1), b.repeat_interleave(RUN, dim=1)
    q = torch.where(aa != 0, (w - bb) / torch.where(aa != 0, aa, 1.0), 0.0).round()
    if not bool(torch.isfinite(q).all()) or bool((q.abs() > 127).any()):
        return None
    product = aa * q
    if not torch.equal(product.double(), aa.double() * q.double()) or not torch.equal(product + bb, w):
        return None
    out = torch.empty(h, k + k // 4, n, dtype=torch.uint8)
    out[:, :k] = q.to(torch.int8).view(torch.uint8)
    out[:, k:] = torch.cat([a, b], dim=1).contiguous().view(torch.uint8).reshape(h, k // 4, n)
    return out


@dataclass
class FactorRuns:
    """A layer's factors as runs: the run scales and offsets the loader read (``(A, B)`` of ``W_UK``, then of
    ``W_UV^T``; released by ``absorbed_factors``) and, where it found them exact, the two runs tensors the kernels
    read."""

    scales: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None  # released once used
    runs: tuple[torch.Tensor, torch.Tensor] | None = None


def absorbed_factors(fr: FactorRuns | None, w_uk: torch.Tensor, w_uv: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The float ``W_UK`` and ``W_UV^T`` a layer keeps from the views ``w_uk [H, d_n, d_c]``, ``w_uv [H, d_v, d_c]``:
    contiguous copies; or, where ``fr``'s runs give back every value (``fr.runs`` is then set), the views themselves
    (the kernels read the runs, and the torch paths multiply views as well)."""
    if fr is not None:
        fr.runs = None
        if fr.scales is not None:  # (a second call, the scales released: the weights may have changed, no runs)
            (a_uk, b_uk), (a_uv, b_uv) = fr.scales
            uk, uv = absorbed_runs(w_uk, a_uk, b_uk), absorbed_runs(w_uv.transpose(1, 2), a_uv, b_uv)
            fr.scales = None  # the runs hold them
            if uk is not None and uv is not None:
                fr.runs = (uk, uv)
                return w_uk, w_uv.transpose(1, 2)
    return w_uk.contiguous(), w_uv.transpose(1, 2).contiguous()
