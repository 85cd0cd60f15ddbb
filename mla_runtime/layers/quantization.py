"""Weight-only int8 quantisation (``quantization="int8"``), done at load from any checkpoint.

Each matrix ``W [N, K]`` of a quantised product becomes ``q [N, K]`` int8 and one bfloat16 scale per output
channel::

    s_n = absmax(W[n, :]) / 127   (rounded up to a bfloat16 value: stored as bfloat16, exactly)
    q[n, k] = round(W[n, k] / s_n)  ∈ [-127, 127]          y = (x · qᵀ) ⊙ s  (+ bias)

The product reads 1 byte per weight instead of 4 (float32) or 2, which is what bounds a decode step on a CPU.
On CPU it runs ``torch.ops.aten._weight_int8pack_mm`` (ATen's int8-weight matrix product; ``bench/bench_gemv.py``
times it against the other candidates) with **bfloat16 activations**: the input rows are rounded to bfloat16
(8 significant bits, finer than the 8-bit activations ggml's Q8_0 products use), the kernel accumulates in
float32 and returns bfloat16, widened back to the model dtype before the bias. Its float32-input variant is the
unvectorised one (3-12x slower on AVX2 in that benchmark), so the bfloat16 variant is used on every CPU, and every
CPU computes the same values. The kernel is used for inner dimensions that are a multiple of 64 (its bfloat16
variant mishandles a tail: on AVX2 it returns wrong values, or crashes, when ``K`` is not a multiple of 8; every
MLA checkpoint's dimensions are multiples of 64) and once a probe has found it exact on this CPU
(``kernel_plan.int8_aten_failure``). Elsewhere, or under ``cpu_gemm=plain``, the int8 weight is widened per call and
multiplied in float32 with ``F.linear`` (float32 activations, another summation order). Every product (decoding,
a speculative verification, a batch, a prefill; 64 rows a pass) runs the compiled kernels of
``mla_kernels.cpu_kernels`` where they build (``cpu_gemm=auto``), reading one byte per weight: each row is rounded
to int16 with a power-of-two scale (within 2^-14 of its largest value, far finer than bfloat16) and multiplied with
integer multiply-adds: up to eight rows streaming the weight from memory, more by blocks of weight rows held in cache,
four input rows at a time. On a 2-core Zen 5 EPYC, 128 rows of ``[4096, 1024]`` take 3.0 ms with the AVX2 variant and
1.6 ms with the VNNI one (``bench/bench_quant_rows.py``), and a row's result does not depend on the rows beside it, so
a speculative verification computes what decoding the same tokens one by one would, and a prompt's answer does not
depend on what shares its step (a prefill or a decode batch of any size: the conformance matrix's int8 cell). Where
the kernels do not run (another CPU architecture, ``cpu_gemm=onednn``) every product takes ATen's kernel above, whose
rows are independent too.

What is quantised (``quantize_model``): every projection of the attention except ``kv_b_proj`` (A.X-K2's
``q_gate_proj`` included), the dense MLPs, the shared and routed experts, and the lm_head. ``kv_b_proj`` (the absorbed
factors ``W_UK``/``W_UV``) keeps its dtype but its values are rounded to bfloat16 (8 significant bits, finer than the
int8 matrices), on every CPU, so that the prefill's up-projection and the decode's absorbed attention read the same
factors; where the compiled decode kernel runs, its copies of them are stored in bfloat16, which halves the bytes a
decode step reads there, and where the CPU has native bfloat16 products and the int8 products are not integer ones
(the widened fallback) the prefill's up-projection runs them on a bfloat16 copy (``round_absorbed_factors``;
``bench/int8_quality.py`` and the sweep's perplexity measure the whole). The embedding, norms and router stay in the
model dtype, and so do the small low-rank gates of A.X-K2's gated norms. A quantised float weight is released: its
parameter keeps its shape and dtype but no storage (a broadcast single element), so the resident weights are the int8
copies; nothing may re-derive a layout from it afterwards (``MLAttention.prepare_inference`` or a latent-rank
truncation must come first).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mla_kernels import cpu_kernels
from mla_runtime.kernel_plan import KernelPlan
from mla_runtime.layers.bf16 import Bf16Weight, F16Weight
from mla_runtime.layers.cpu_gemm import PackedWeight
from mla_runtime.layers.embedding import VocabEmbedding
from mla_runtime.layers.fp4 import Mxfp4Weight, Nvfp4Weight
from mla_runtime.layers.fp8 import Fp8Weight
from mla_runtime.layers.int4 import Int4Weight, W4A16Weight
from mla_runtime.layers.linear import Linear
from mla_runtime.layers.mla import MLAttention
from mla_runtime.layers.mlp import GatedMLP
from mla_runtime.layers.moe import Experts
from mla_runtime.layers.qweight import QuantizedWeight, default_plan, released, released_like, stack_rows
from mla_runtime.layers.w8a8 import W8A8Weight
from mla_runtime.options import check_quantization  # noqa: F401

logger = logging.getLogger("mla_runtime")

QMAX = 127
KERNEL_K_MULTIPLE = 64  # the CPU kernel runs inner dimensions that are a multiple of this
# check_quantization: options' (the same names as WEIGHT_FORMATS, test_server_config checks), importable from here


def _round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value >= each (positive, finite, float32) element."""
    near = x.to(torch.bfloat16)
    up = (near.view(torch.int16) + 1).view(torch.bfloat16)  # the next bfloat16 above a positive value
    return torch.where(near.float() >= x, near, up).float()


ATEN_INT8_ALIGN = 64  # bytes: the alignment of a weight _weight_int8pack_mm reads in place (the allocator's)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (``q [N, K]`` int8, ``scales [N]`` bfloat16): symmetric, per output channel."""
    w = weight.detach().float()
    absmax = torch.linalg.vector_norm(w, float("inf"), dim=1)  # max |w| of each row, without an |w| temporary
    scales = _round_up_to_bf16(torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax)))
    q = torch.div(w, scales.unsqueeze(1)).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scales.to(torch.bfloat16)  # exact: the scales are bfloat16 values


class Int8Weight(QuantizedWeight):
    """A weight-only int8 ``[N, K]`` matrix: what ``cpu_gemm.linear`` runs in place of the float weight."""

    __slots__ = ("qweight", "scales", "kernel", "row_scales")
    scheme = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        """``qweight [N, K]`` int8 and ``scales [N]`` bfloat16, standing for a weight of ``dtype``."""
        self._release_float(qweight.shape, dtype, qweight.device)
        self.qweight, self.scales = qweight, scales
        self.bind(default_plan(qweight.device))

    def bind(self, plan: KernelPlan) -> Int8Weight:
        super().bind(plan)
        cpu = self.on_cpu
        # ATen's int8 products with bfloat16 rows, where exact here (else the matrix is widened per product)
        self.kernel = cpu and self.qweight.shape[1] % KERNEL_K_MULTIPLE == 0 and plan.int8_aten_failure is None
        # every product: the compiled kernels where they run (float32 rows and these float32 scales)
        self.row_scales = self.scales.float() if cpu and plan.integer_kernels("int8") else None
        return self

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        return cls(*quantize_int8(weight), weight.dtype)

    @classmethod
    def cat(cls, parts: Sequence[QuantizedWeight]) -> Int8Weight:
        int8 = [cast(Int8Weight, p) for p in parts]
        return cls(stack_rows([p.qweight for p in int8]), torch.cat([p.scales for p in int8]), int8[0].plain.dtype)

    def select_rows(self, index: torch.Tensor) -> Int8Weight:
        """The matrix of the output rows ``index`` (the MTP drafts' rows of the lm_head)."""
        return Int8Weight(self.qweight[index].contiguous(), self.scales[index].contiguous(), self.plain.dtype)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    @classmethod
    def stored_bytes(cls, rows: int, k: int, block: tuple[int, int] | None = None) -> int:
        """A byte a value and a bfloat16 scale a row."""
        return rows * k + 2 * rows

    def row_operand(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.row_scales is None else (self.qweight, self.row_scales)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix the int8 one stands for."""
        return self.qweight.float() * self.scales.float().unsqueeze(1)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K]`` (any float dtype) -> ``x · Wᵀ (+ bias)`` in ``x``'s dtype."""
        k = self.qweight.shape[1]
        if self.row_scales is not None and x.numel():  # the kernels, 64 rows a pass
            wide_bias = None if bias is None else bias.float()
            return cpu_kernels.linear(x, self.qweight, self.row_scales, bias=wide_bias).to(x.dtype)
        rows = x.reshape(-1, k)
        if self.kernel and rows.shape[0]:
            # ATen's kernel loads the weight 16 bytes at a time from aligned addresses; a matrix served from its
            # mapped checkpoint lies wherever the file put it, so it runs from an aligned copy for the call
            w = self.qweight if self.qweight.data_ptr() % ATEN_INT8_ALIGN == 0 else self.qweight.clone()
            y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16).contiguous(), w,
                                                                 self.scales)
        else:
            y = F.linear(rows.float(), self.qweight.float()) * self.scales.float()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.qweight.shape[0])


# the ``quantization`` values and the formats they make: int8 (above), int4 (``layers.int4``: groups of 32 with
# llama.cpp Q4_0's rounding; w4a16: asymmetric groups of 128 with zero points), fp8 (``layers.fp8``: DeepSeek's
# 128 x 128 FP8 blocks, which FP8 checkpoints keep) and bf16 / fp16 (``layers.bf16``: bfloat16 / float16 weights in a
# float32 model), w8a8 (``layers.w8a8``: int8 weights with rows rounded to int8 per token), mxfp4 / nvfp4
# (``layers.fp4``: E2M1 values with group scales)
WEIGHT_FORMATS: dict[str, type[QuantizedWeight]] = {"int8": Int8Weight, "int4": Int4Weight, "w4a16": W4A16Weight,
                                                    "fp8": Fp8Weight, "bf16": Bf16Weight, "fp16": F16Weight,
                                                    "w8a8": W8A8Weight, "mxfp4": Mxfp4Weight, "nvfp4": Nvfp4Weight}


def release(module: nn.Module, name: str, device: torch.device) -> None:
    """Replace the parameter ``module.<name>`` by a released stand-in on ``device`` (its shape and dtype; no
    storage): also one that was never allocated (on the meta device)."""
    param = getattr(module, name)
    setattr(module, name, nn.Parameter(released_like(param.shape, param.dtype, device), requires_grad=False))


def quantized_parameter_names(model: nn.Module) -> list[str]:
    """The parameters whose final form is a quantised matrix, by name: every projection of the attention except
    ``kv_b_proj``, the dense MLPs, the shared and routed experts (``[E, N, K]`` stacks: one matrix per expert), and
    an untied lm_head (a tied one is the embedding, which stays; ``finish_quantization`` quantises a copy)."""
    names: list[str] = []
    for prefix, module in model.named_modules():
        p = f"{prefix}." if prefix else ""
        if isinstance(module, MLAttention):
            inputs = ["q_proj"] if module.q_proj is not None else \
                ["q_a_proj", "q_b_proj" if module.q_gate_proj is None else "q_gate_proj"]
            names += [f"{p}{n}.weight" for n in (*inputs, "kv_a_proj_with_mqa", "o_proj")]
        elif isinstance(module, GatedMLP | Experts):
            names += [f"{p}gate_up_proj", f"{p}down_proj"]
    if isinstance(getattr(model, "lm_head", None), nn.Parameter):
        names.append("lm_head")
    return names


QuantizedMatrices = QuantizedWeight | list[QuantizedWeight]  # one matrix, or one per expert of a stack


def install_quantized(model: nn.Module, weights: dict[str, QuantizedMatrices]) -> None:
    """Put quantised matrices (by parameter name, as ``quantized_parameter_names`` names them) in place of their
    float parameters, which are released. ``q_a_proj`` and ``kv_a_proj_with_mqa`` become the attention's stacked
    input projection."""
    modules = dict(model.named_modules())
    for name, weight in weights.items():
        owner, _, attr = name.rpartition(".")
        module = modules[owner]
        if isinstance(module, Linear):
            if owner.endswith((".q_a_proj", ".kv_a_proj_with_mqa")) and module.fused:
                pass  # stacked below, with its partner
            else:
                module.packed = cast(QuantizedWeight, weight)
        elif isinstance(module, GatedMLP):
            setattr(module, "gate_up_packed" if attr == "gate_up_proj" else "down_packed", weight)
            module.row_table = None  # made again from the quantised weights
        elif isinstance(module, Experts):
            setattr(module, "gate_up_packed" if attr == "gate_up_proj" else "down_packed",
                    list(cast(list[QuantizedWeight], weight)))
            module.row_table = None
        elif attr == "lm_head":
            model.__dict__["lm_head_packed"] = weight  # a plain attribute, as prepare_inference sets it
        elif isinstance(module, VocabEmbedding):  # an embedding kept as stored: its rows widened per lookup
            module.stored = cast(QuantizedWeight, weight)
        else:
            raise ValueError(f"{name}: not a parameter that is quantised")
        first = weight[0] if isinstance(weight, list) else weight
        release(module, attr, first.plain.device)
    for prefix, module in modules.items():
        if isinstance(module, MLAttention) and module.q_proj is None:
            a, kv = weights.get(f"{prefix}.q_a_proj.weight"), weights.get(f"{prefix}.kv_a_proj_with_mqa.weight")
            if a is None or kv is None:  # one alone (a checkpoint storing only one in FP8): it runs on its own
                for lin, w in ((module.q_a_proj, a), (module.kv_a_proj_with_mqa, kv)):
                    if w is not None:
                        lin.packed = cast(QuantizedWeight, w)
                continue
            first, second = cast(QuantizedWeight, a), cast(QuantizedWeight, kv)
            try:
                module.qkv_a = type(first).cat([first, second])
            except ValueError:  # a format whose blocks span rows (FP8) and a q_lora_rank not a multiple of them
                module.q_a_proj.packed, module.kv_a_proj_with_mqa.packed = first, second
                continue
            a_bias, kv_bias = module.q_a_proj.bias, module.kv_a_proj_with_mqa.bias
            module.qkv_a_bias = None if a_bias is None or kv_bias is None else torch.cat([a_bias, kv_bias])


def round_absorbed_factors(attn: MLAttention, plan: KernelPlan, rows_independent: bool = False) -> None:
    """``kv_b_proj`` (the absorbed factors ``W_UK``/``W_UV``) keeps its dtype with its values rounded to bfloat16, so
    that every path (the prefill's up-projection, the absorbed copies) reads the same factors; where the compiled
    decode kernel runs, its copies of them are stored in bfloat16 (half the bytes a decode step reads there), and where
    the CPU has native bfloat16 products (``KernelPlan.bf16_products``) the up-projection's products run on a bfloat16
    copy (a ``Bf16Weight``) in place of the float32 blocked one, except beside products whose results do not depend on
    the rows beside them (``rows_independent``: ``KernelPlan.rows_independent``). Done after any latent-rank
    truncation, which folds its basis into ``kv_b_proj`` at full precision."""
    kv_b = attn.kv_b_proj
    kv_b.weight.data.copy_(kv_b.weight.data.to(torch.bfloat16))
    if kv_b.weight.device.type == "cpu" and plan.bf16_products and not rows_independent:
        # its values are bfloat16 ones: the prefill's key and value rebuild runs oneDNN's bfloat16 products (1.9x the
        # float32 products at 128 rows), a few rows the kernel reading them at two bytes. The same bytes as the float32
        # blocked copy it replaces; the float weight stays, for the views w_uk_uv gives.
        kv_b.packed = Bf16Weight(kv_b.weight.detach().to(torch.bfloat16), kv_b.weight.dtype).bind(plan)
    else:
        kv_b.packed = None
        kv_b.prepare_inference(plan)
    w_uk, w_uv = attn.w_uk_uv()
    dtype = torch.bfloat16 if attn.kernels.decode else w_uk.dtype
    attn.w_uk, attn.w_uv_t = w_uk.to(dtype).contiguous(), w_uv.transpose(1, 2).to(dtype).contiguous()
    attn.factor_runs = None  # the unrounded values' runs, if any, are not these factors


def plan_of(model: nn.Module) -> KernelPlan:
    """The kernel plan ``model`` was prepared for (a ``DeepseekForCausalLM``'s resolved one), else the default plan
    of its device (a bare module, in tests)."""
    plan = getattr(model, "plan", None)
    if isinstance(plan, KernelPlan):
        return plan
    first = next(iter(model.parameters()), None)
    return default_plan("cpu" if first is None else first.device)


@torch.no_grad()
def finish_quantization(model: nn.Module, quantization: str, plan: KernelPlan | None = None) -> None:
    """What follows the products' quantisation once the weights are final (loaded, and truncated to a latent rank
    if asked): the absorbed factors (``round_absorbed_factors``), a tied lm_head's quantised copy, and the MTP
    drafts' head, each prepared for ``plan`` (default: the model's, ``plan_of``)."""
    fmt = WEIGHT_FORMATS[quantization]
    plan = plan_of(model) if plan is None else plan
    rows_independent = plan.rows_independent(quantization)
    for module in model.modules():
        if isinstance(module, MLAttention):
            round_absorbed_factors(module, plan, rows_independent)
    prepare_attention = getattr(model, "prepare_attention", None)
    if prepare_attention is not None:  # the backend holds the rounded factors (a model; a bare test module has none)
        prepare_attention()
    head = cast(PackedWeight | None, getattr(model, "lm_head_packed", None))
    tied = not isinstance(getattr(model, "lm_head", None), nn.Parameter)
    if tied and (head is None or not head.quantized):  # the embedding stays, the head is a quantised copy of it
        head = model.__dict__["lm_head_packed"] = fmt.quantize(cast(torch.Tensor, model.lm_head_weight)).bind(plan)
    draft_head = getattr(model, "draft_head", None)  # the MTP drafts' rows of it (set_draft_vocab)
    quantized_head = head is not None and head.quantized  # an untied head a checkpoint left float stays so
    if quantized_head and draft_head is not None and draft_head.numel() and draft_head.untyped_storage().nbytes() > 4:
        model.__dict__["draft_head_packed"] = fmt.quantize(draft_head).bind(plan)
        model.__dict__["draft_head"] = released(draft_head)


@torch.no_grad()
def quantize_model(model: nn.Module, quantization: str | None, plan: KernelPlan | None = None) -> int:
    """Quantise a loaded model's products in place (``quantized_parameter_names``) and finish
    (``finish_quantization``), for ``plan`` (default: the model's, ``plan_of``); returns the bytes of quantised
    matrices it holds. (Loading with ``quantization`` quantises while the checkpoint streams in instead:
    ``loader.load_model``.)"""
    scheme = check_quantization(quantization)
    if scheme is None:
        return 0
    fmt = WEIGHT_FORMATS[scheme]
    params = dict(model.named_parameters())
    weights: dict[str, QuantizedMatrices] = {}
    for name in quantized_parameter_names(model):
        param = params[name]
        weights[name] = [fmt.quantize(w) for w in param] if param.dim() == 3 else fmt.quantize(param)
    install_quantized(model, weights)
    plan = plan_of(model) if plan is None else plan
    for weight in quantized_weights(model):
        weight.bind(plan)
    finish_quantization(model, scheme, plan)
    return sum(w.nbytes for w in quantized_weights(model))


def quantized_weights(model: nn.Module) -> list[QuantizedWeight]:
    """Every quantised matrix the model's modules hold. (``kv_b_proj``'s bfloat16 copy, which ``round_absorbed_factors``
    may give it, is a second layout of a float weight, as a float matrix's blocked copy is: not one of them.)"""
    found: list[QuantizedWeight] = []
    kv_b = {id(m.kv_b_proj) for m in model.modules() if isinstance(m, MLAttention)}
    for module in model.modules():
        if id(module) in kv_b:
            continue
        for value in vars(module).values():
            items = value if isinstance(value, list) else [value]
            found += [v for v in items if isinstance(v, QuantizedWeight)]
    return found
