"""A decode step's decoder layer as one compiled call (``mla_kernels.cpu_tables.decoder_layer``).

A float32 CPU decode step of one to eight rows runs, per layer, two norms, three or four products, the latent side,
the absorbed attention, a third norm and the MLP: about fifteen torch and kernel calls, each some microseconds of
Python and dispatch, where the products of a small model take tens. Where the compiled kernels build and every
product of the layer takes them (float32 weights, or int8 ones: ``layers.quantization``), the layer is one call
instead: the same kernels in the same order, so its attention equals the call-by-call path's bit for bit. A layer's
table (``layer_weights``, kept by ``DecoderLayer.prepare_kernel``) is made when the model's weights are prepared, and
again whenever they change (``DeepseekForCausalLM.prepare_attention``: quantisation, a truncated latent); the step's
rows (``decode_step``) once per step.

A bfloat16 model's layers take the call too (``_half``), computing the step in float32 over their bfloat16 weights and
cache, as a float32 model with bfloat16 weights (``quantization="bf16"``) does: the norms' weights widened into the
table, the step's RoPE tables made in float32, the hidden state widened before the first layer and rounded back to
bfloat16 after the last (``DeepseekForCausalLM._decode_step``). Such a step needs every layer and its MLP to take it,
so that the float32 hidden state never meets a bfloat16 product; its logits are within bfloat16 rounding of the
call-by-call path's, which rounds every intermediate to bfloat16.

The MLP is part of the call where its weights take the compiled kernels: a dense MLP, or a MoE layer (router,
DeepSeek's routing, then expert by expert the rows that chose it, each expert's weights read once for all of them,
then the shared experts); the routing's float32 arithmetic is the kernel's own, so a MoE layer's output equals the
torch path's to float rounding rather than bit for bit. Left to the torch path: tensor parallelism, biased
projections, a truncated latent rank, steps with prefill chunks or more than eight rows (except in a model whose
products round their rows to int8: there a step's planned rows take the compiled call, eight at a time, and the rest
of the step the torch path: ``PlannedRows``),
layers whose residual branches are scaled (µP: the compiled call adds them as they are), and A.X-K2's variations
(its gated query projection and output gate, its gated norms): the compiled call has neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from mla_kernels import cpu_kernels, cpu_tables
from mla_runtime.attention.metadata import AttentionMetadata
from mla_runtime.attention.rope_tables import RopeTables
from mla_runtime.layers.cpu_gemm import PackedWeight
from mla_runtime.layers.linear import Linear
from mla_runtime.layers.mla import MLAttention, kernel_factors
from mla_runtime.layers.mlp import GatedMLP
from mla_runtime.layers.moe import MoE
from mla_runtime.layers.norm import RMSNorm


def _operand(packed: PackedWeight | None) -> cpu_tables.Operand | None:
    return None if packed is None else packed.row_operand()


def _half(norms: tuple[nn.Module, nn.Module]) -> bool:
    """A bfloat16 model's layer (its norms hold the model dtype): its compiled call computes the step in float32 over
    the bfloat16 weights and cache, as ``dtype="auto"``'s float32 model with bfloat16 weights does."""
    weight = getattr(norms[0], "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16


def _norm_weight(norm: RMSNorm, half: bool) -> torch.Tensor | None:
    """A norm's weight as the compiled call reads it: float32 (its own where its kernel runs, a bfloat16 model's
    widened), or None where the call does not take it."""
    if norm.kernel:
        return norm.weight
    if half and norm.weight.dtype == torch.bfloat16 and norm.weight.device.type == "cpu":
        return norm.weight.float()
    return None


def _unbiased(*linears: Linear | None) -> bool:
    return all(lin is None or lin.bias is None for lin in linears)


def _call_by_call(norms: tuple[nn.Module, nn.Module], attn: MLAttention) -> bool:
    """Whether the layer has a variation the compiled call does not implement, whatever its weights: A.X-K2's
    gated query projection (``query_gate``) or gated norms (``gated_norm_rank``)."""
    return attn.q_gate_proj is not None or not all(isinstance(n, RMSNorm) for n in norms)


def _mlp_table(mlp: nn.Module) -> tuple[cpu_tables.GatedMLPTable | None, tuple | None]:
    """The MLP's one-row table and, for a MoE layer, what ``moe_row`` takes beside it (None: the caller runs it)."""
    if isinstance(mlp, GatedMLP) and mlp.par.world_size == 1:
        table = mlp.one_row_table()
        return (table, None) if isinstance(table, cpu_tables.GatedMLPTable) else (None, None)
    if isinstance(mlp, MoE) and mlp.par.world_size == 1 and mlp.post_mlp_layernorm is None:  # else: the caller's
        table, route = mlp.experts.one_row_table(mlp.shared_experts), mlp.gate.kernel_route()
        if not isinstance(table, cpu_tables.GatedMLPTable) or route is None:
            return None, None
        shared = mlp.experts.num_experts if mlp.shared_experts is not None else -1
        return table, (mlp.gate.weight, route, mlp.gate.e_score_correction_bias, mlp.gate.cfg.routed_scaling_factor,
                       mlp.experts.first, mlp.experts.num_experts, shared)
    return None, None


def layer_weights(norms: tuple[nn.Module, nn.Module], attn: MLAttention, mlp: nn.Module,
                  residual_scale: float = 1.0, one_path: bool = False) -> cpu_tables.LayerWeights | None:
    """The layer (input and post-attention norms, attention, MLP) as the compiled call reads it, or None where any
    part of its attention does not take the compiled kernels, or its residual branches are scaled, or it has
    A.X-K2's variations (``_call_by_call``). ``one_path``: one row's MLP computed as several rows' are (the model's
    ``rows_invariant``)."""
    first, second = norms
    if _call_by_call(norms, attn) or not (isinstance(first, RMSNorm) and isinstance(second, RMSNorm)):
        return None
    if attn.query_scale[0]:  # Mistral 4's position-scaled queries (mla.position_scaled) take the torch path
        return None
    if attn.indexer is not None or attn.shares_selection:  # sparse attention: the indexer runs call by call
        return None
    if attn.softmax_scaling is not None or not attn.rope:  # Mistral Large 4's log-scaled queries, NoPE layers
        return None
    q_lora = attn.q_proj is None
    scaled_residual = residual_scale != 1.0
    half = _half(norms)
    ready = attn.kernels.attention and attn.w_uk is not None and attn.w_uk.dtype == torch.bfloat16 if half \
        else attn.kernels.decode
    in_norm, post_norm, kv_norm = (_norm_weight(n, half) for n in (first, second, attn.kv_a_layernorm))
    q_norm = attn.q_a_layernorm if q_lora else None
    q_norm_weight = None if q_norm is None else _norm_weight(q_norm, half)
    if (scaled_residual or not ready or attn.par.world_size != 1 or attn.latent_down is not None
            or attn.w_uk is None or attn.w_uv_t is None or in_norm is None or post_norm is None or kv_norm is None
            or (q_lora and q_norm_weight is None)):
        return None
    if q_lora:
        assert attn.q_b_proj is not None  # a Q-LoRA without query_gate
        if attn.qkv_a_bias is not None or not _unbiased(attn.q_a_proj, attn.kv_a_proj_with_mqa, attn.q_b_proj):
            return None
        qa, kva, qb = _operand(attn.qkv_a), None, _operand(attn.q_b_proj.packed)
    else:
        assert attn.q_proj is not None
        if not _unbiased(attn.q_proj, attn.kv_a_proj_with_mqa):
            return None
        qa, kva, qb = _operand(attn.q_proj.packed), _operand(attn.kv_a_proj_with_mqa.packed), None
    o = _operand(attn.o_proj.packed)
    if qa is None or o is None or not _unbiased(attn.o_proj) or (kva is None) == (qb is None):
        return None
    table, moe = _mlp_table(mlp)
    factors = (attn.w_uk, attn.w_uv_t) if half else kernel_factors(attn) or (attn.w_uk, attn.w_uv_t)
    if half and table is None:  # the caller's MLP would take float32 rows to bfloat16 weights
        return None
    dims = dict(d=attn.o_proj.out_features, q_lora=attn.q_a_proj.out_features if q_lora else 0, heads=attn.n_h,
                d_n=attn.d_n, d_r=attn.d_r, d_c=attn.d_c, d_v=attn.d_v)
    eps = (first.eps, second.eps, q_norm.eps if q_norm is not None else 0.0, attn.kv_a_layernorm.eps)
    return cpu_tables.LayerWeights(
        dims=dims, norms=(in_norm, post_norm, q_norm_weight, kv_norm),
        eps=eps, scale=attn.scale, interleave=attn.rotary.interleave, qa=qa, kva=kva, qb=qb, w_uk=factors[0],
        w_uv_t=factors[1], o=o, mlp=table, moe=cast(tuple, moe) if moe is not None else None, one_path=one_path)


def decode_step(meta: AttentionMetadata, first: cpu_tables.DecoderLayerTable | None,
                rope: RopeTables | None = None) -> cpu_tables.DecodeStep | None:
    """The rows of a step that takes the compiled kernels (the backend's ``compiled_rows``) for the compiled layers
    (``first``: the first layer's table), or None where the layers run call by call: no table, or more rows than
    ``cpu_kernels.max_rows``. ``rope``: the step's float32 RoPE tables (default: the step's own, a float32 model's)."""
    plan, rows = meta.decode_plan, meta.slot_mapping.shape[0]
    if first is None or plan is None or not 1 <= rows <= cpu_kernels.max_rows(torch.float32):
        return None
    rope = meta.rope if rope is None else rope
    return cpu_tables.DecodeStep(rope.cos, rope.sin, meta.slot_mapping.contiguous(), plan.slots, plan.lens,
                                 first.heads, first.d_c)


@dataclass(frozen=True)
class PlannedRows:
    """A step of a model whose every part must give a row the same bits whatever shares its step
    (``DeepseekForCausalLM.rows_invariant``): its leading planned rows ``[0, rows)`` (decodes and short chunks,
    ``attention/cpu.py``) run the compiled layers, ``chunks`` of at most ``cpu_kernels.max_rows`` rows each, and the
    rows after them (``rest``: their own batch) the torch path. Whether a row is planned depends on its own sequence's
    chunk alone, so a token takes the same path, and gets the same bits, batched or alone."""

    chunks: tuple[tuple[int, int, cpu_tables.DecodeStep], ...]
    rows: int
    rest: AttentionMetadata | None


def planned_rows(meta: AttentionMetadata, first: cpu_tables.DecoderLayerTable | None) -> PlannedRows | None:
    """The step's planned rows as compiled calls (``PlannedRows``), or None where there are none, the first layer has
    no table or the step's RoPE tables are not float32 (a float32 model's)."""
    plan, rows = meta.decode_plan, meta.num_planned
    if first is None or plan is None or not rows or meta.rope.cos.dtype != torch.float32:
        return None
    most = cpu_kernels.max_rows(torch.float32)
    bounds = [(r0, min(r0 + most, rows)) for r0 in range(0, rows, most)]
    chunks = tuple((r0, r1, cpu_tables.DecodeStep(meta.rope.cos[r0:r1], meta.rope.sin[r0:r1],
                                                  meta.slot_mapping[r0:r1].contiguous(), plan.slots[r0:r1],
                                                  plan.lens[r0:r1], first.heads, first.d_c)) for r0, r1 in bounds)
    return PlannedRows(chunks, rows, meta.rest)
