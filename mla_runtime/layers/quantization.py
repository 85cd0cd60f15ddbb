"""Weight-only int8 quantisation (``quantization="int8"``), done at load from any checkpoint.

Each matrix ``W [N, K]`` of a quantised product becomes ``q [N, K]`` int8 and one scale per output channel::

    s_n = absmax(W[n, :]) / 127   (rounded up to a bfloat16 value, so the same grid serves every compute dtype)
    q[n, k] = round(W[n, k] / s_n)  ∈ [-127, 127]          y = (x · qᵀ) ⊙ s  (+ bias)

Activations stay in the model dtype (weight-only): the product reads 1 byte per weight instead of 4 (float32)
or 2, which is what bounds a decode step on a CPU. On CPU it runs ``torch.ops.aten._weight_int8pack_mm``
(ATen's int8-weight matrix product; ``bench/bench_gemv.py`` times it against the other candidates), computing
in float32 (a bfloat16/float16 input is widened and the result narrowed back; on AVX2 the kernel's bfloat16-input
variant measured several times faster, at the cost of rounding activations to bfloat16); elsewhere, or under
``MLA_CPU_GEMM=plain``, the int8 weight is widened per call and multiplied with ``F.linear`` (same values,
another summation order).

What is quantised (``quantize_model``): every projection of the attention except ``kv_b_proj`` (its absorbed
factors ``W_UK``/``W_UV`` and the up-projection of long prefills stay exact), the dense MLPs, the shared and
routed experts, and the lm_head. The embedding, norms and router stay in the model dtype. A quantised
float weight is released: its parameter keeps its shape and dtype but no storage (a broadcast single
element), so the resident weights are the int8 copies; nothing may re-derive a layout from it afterwards
(``MLAttention.prepare_inference`` or a latent-rank truncation must come first).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mla_runtime.errors import InvalidParam
from mla_runtime.layers.cpu_gemm import PackedWeight, gemm_mode
from mla_runtime.layers.linear import Linear
from mla_runtime.layers.mla import MLAttention
from mla_runtime.layers.mlp import GatedMLP
from mla_runtime.layers.moe import Experts

WEIGHT_QUANTIZATIONS = ("int8",)  # None (or "none"): weights in the model dtype
QMAX = 127


def check_quantization(value: object) -> str | None:
    """The normalised ``quantization`` setting (None: off); anything else is ``InvalidParam('quantization')``."""
    if value is None or value == "none":
        return None
    if not isinstance(value, str) or value not in WEIGHT_QUANTIZATIONS:
        raise InvalidParam("quantization", f"quantization must be one of none, {', '.join(WEIGHT_QUANTIZATIONS)}, "
                                           f"got {value!r}")
    return value


def _round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value >= each (positive, finite, float32) element."""
    near = x.to(torch.bfloat16)
    up = (near.view(torch.int16) + 1).view(torch.bfloat16)  # the next bfloat16 above a positive value
    return torch.where(near.float() >= x, near, up).float()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (``q [N, K]`` int8, ``scales [N]`` float32): symmetric, per output channel."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    scales = _round_up_to_bf16(torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax)))
    q = torch.round(w / scales.unsqueeze(1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scales


def released(weight: torch.Tensor) -> torch.Tensor:
    """A stand-in for a released weight: same shape, dtype and device, one element of storage."""
    return torch.empty((), dtype=weight.dtype, device=weight.device).expand(weight.shape)


class Int8Weight(PackedWeight):
    """A weight-only int8 ``[N, K]`` matrix: what ``cpu_gemm.linear`` runs in place of the float weight."""

    __slots__ = ("qweight", "scales", "kernel")
    quantized = True

    def __init__(self, weight: torch.Tensor) -> None:  # no PackedWeight.__init__: no float layout is kept
        self.qweight, self.scales = quantize_int8(weight)
        self.plain = released(weight)  # callers pass it as the "weight" argument: shape and dtype only
        self.blocked = self.wide = None
        self.upcast = self.plain_gemv = False
        self.aten_max_rows = 0
        self.kernel = weight.device.type == "cpu" and gemm_mode() == "auto"

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + 4 * self.scales.numel()

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix the int8 one stands for."""
        return self.qweight.float() * self.scales.unsqueeze(1)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K]`` (any float dtype) -> ``x · Wᵀ (+ bias)`` in ``x``'s dtype."""
        k = self.qweight.shape[1]
        rows = x.reshape(-1, k)
        if self.kernel and rows.shape[0]:
            y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(rows.float().contiguous(), self.qweight, self.scales)
        else:
            y = F.linear(rows.float(), self.qweight.float()) * self.scales
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.qweight.shape[0])


def _release(param: nn.Parameter) -> None:
    param.data = released(param.data)


def _quantize_attention(attn: MLAttention) -> None:
    """Its projections (not ``kv_b_proj``); the stacked ``q_a``/``kv_a`` input projection as one matrix."""
    if attn.q_proj is None:
        weights: list[nn.Parameter] = [attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight]
        attn.qkv_a = Int8Weight(torch.cat(tuple(weights)))
        a_bias, kv_bias = attn.q_a_proj.bias, attn.kv_a_proj_with_mqa.bias
        attn.qkv_a_bias = None if a_bias is None or kv_bias is None else torch.cat([a_bias, kv_bias])
        for w in weights:
            _release(w)
        linears = [attn.q_b_proj, attn.o_proj]
    else:
        linears = [attn.q_proj, attn.kv_a_proj_with_mqa, attn.o_proj]
    for lin in linears:
        _quantize_linear(lin)


def _quantize_linear(lin: Linear) -> None:
    lin.packed = Int8Weight(lin.weight)
    _release(lin.weight)


def _quantize_mlp(mlp: GatedMLP) -> None:
    mlp.gate_up_packed, mlp.down_packed = Int8Weight(mlp.gate_up_proj), Int8Weight(mlp.down_proj)
    _release(mlp.gate_up_proj)
    _release(mlp.down_proj)


def _quantize_experts(experts: Experts) -> None:
    experts.gate_up_packed = [Int8Weight(w) for w in experts.gate_up_proj]
    experts.down_packed = [Int8Weight(w) for w in experts.down_proj]
    _release(experts.gate_up_proj)
    _release(experts.down_proj)


@torch.no_grad()
def quantize_model(model: nn.Module, quantization: str | None) -> int:
    """Quantise ``model``'s products in place (see the module docstring); returns the int8 bytes it holds.

    ``model`` is a prepared ``DeepseekForCausalLM`` (its ``lm_head_weight`` / ``lm_head_packed``); a tied
    lm_head keeps the embedding it shares and adds the int8 copy.
    """
    if check_quantization(quantization) is None:
        return 0
    for module in model.modules():
        if isinstance(module, MLAttention):
            _quantize_attention(module)
        elif isinstance(module, GatedMLP):
            _quantize_mlp(module)
        elif isinstance(module, Experts):
            _quantize_experts(module)
    head_weight = cast(torch.Tensor, model.lm_head_weight)
    model.__dict__["lm_head_packed"] = Int8Weight(head_weight)  # a plain attribute, as prepare_inference sets it
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Parameter):  # untied; a tied lm_head is the embedding, which stays
        _release(head)
    return sum(w.nbytes for w in quantized_weights(model))


def quantized_weights(model: nn.Module) -> list[Int8Weight]:
    """Every ``Int8Weight`` the model's modules hold."""
    found: list[Int8Weight] = []
    for module in model.modules():
        for value in vars(module).values():
            items = value if isinstance(value, list) else [value]
            found += [v for v in items if isinstance(v, Int8Weight)]
    return found
