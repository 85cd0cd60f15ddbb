"""The tables the whole-MLP and whole-layer CPU kernels read (``mla_kernels::MlpTable``, ``LayerTable``,
``DecodeStep``: custom classes built and checked by ``csrc/ops/cpu_kernels.cpp``, each holding the tensors it points
into), from a model's weights. Only where ``cpu_kernels.failure()`` is None."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_kernels

# a weight operand: a float32 / bfloat16 / float16 [N, K] matrix; int8 [N, K] with float32 row scales [N] (rows rounded
# to int16, as cpu_kernels.linear rounds them) or [N, 1] (W8A8: rows rounded to int8 per row, as cpu_kernels.w8a8_linear
# rounds them, the scales shaped as W8A8 checkpoints store them); int4 nibbles [N, Kp / 2] (int4_format.pack_int4) with
# float16 group scales [N, Kp / 32]; FP4 nibbles [N, K / 2] with their int64 FP4 table (cpu_kernels.fp4_table: {format,
# N, K, ...}); or the int64 parts table of a matrix in ggml block types (cpu_kernels.ggml_parts: {parts, N, K, ...})
Operand = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

ROUTE_SCORING = ("softmax", "sigmoid")
ROUTE_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def route_config(scoring: str, method: str, n_experts: int, n_group: int, topk_group: int, top_k: int,
                 norm_topk_prob: bool) -> torch.Tensor | None:
    """The routing settings ``GatedMLPTable.moe_row`` passes to the kernel, or None where it does not route them."""
    if (scoring not in ROUTE_SCORING or method not in ROUTE_METHODS
            or not 1 <= top_k <= min(n_experts, cpu_kernels.max_topk()) or n_group < 1 or n_experts % n_group
            or not 1 <= topk_group <= n_group or (method == "noaux_tc" and n_group > 1 and n_experts // n_group < 2)):
        return None
    return torch.tensor([ROUTE_SCORING.index(scoring), ROUTE_METHODS.index(method), n_group, topk_group, top_k,
                         int(norm_topk_prob), n_experts, 0], dtype=torch.int64)


def split(operand: Operand | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An operand as (weight, scales or None)."""
    return operand if isinstance(operand, tuple) else (operand, None)


def operand_rows(operand: Operand) -> int:
    """The number of rows ``N`` of an operand's matrix."""
    weight = operand[0] if isinstance(operand, tuple) else operand
    return int(weight[1]) if weight.dtype == torch.int64 else weight.shape[0]


class GatedMLPTable:
    """Gated MLPs as the one-row kernels read them: ``mlps`` lists each MLP's ``(gate_up [2I, d], down [d, I])``
    operands (a MoE layer's experts and shared experts, or one dense MLP)."""

    def __init__(self, mlps: list[tuple[Operand, Operand]]) -> None:
        ops = cpu_kernels.ops()
        gate_up, down = [split(g) for g, _ in mlps], [split(d) for _, d in mlps]
        self.table = ops.mlp_table([w for w, _ in gate_up], [s for _, s in gate_up], [w for w, _ in down],
                                   [s for _, s in down])
        self.hidden = operand_rows(mlps[0][1])

    def __call__(self, x: torch.Tensor, ids: list[int], weights: list[float]) -> torch.Tensor:
        """``sum_i weights[i] * mlp_{ids[i]}(x)`` for one float32 row ``x [..., d]``."""
        return cpu_kernels.ops().gated_mlps(x, self.table, list(ids), [float(w) for w in weights])  # type: ignore[no-any-return]

    def mlps_rows(self, x: torch.Tensor, ids: list[int], rows: list[list[int]]) -> torch.Tensor:
        """MLP ``ids[i]`` over the rows ``rows[i]`` of ``x [t, d]`` (float32): their outputs stacked in that order,
        unweighted, ``[sum of len(rows[i]), d]``, as the whole-layer kernel computes a step's: where every MLP is in
        ggml block types (any ``t``), or for one row, all in one parallel region; else MLP by MLP (``t`` at most
        ``max_rows``)."""
        flat = [r for group in rows for r in group]
        return cpu_kernels.ops().mlps_rows(x, self.table, list(ids), [len(g) for g in rows], flat)  # type: ignore[no-any-return]

    def moe_row(self, x: torch.Tensor, router: torch.Tensor, route: torch.Tensor, bias: torch.Tensor | None,
                scaling: float, first: int, count: int, shared: int) -> torch.Tensor:
        """A MoE layer for one float32 row ``x [..., d]`` in one call: router logits (``router [E, d]`` float32), the
        routing ``route`` (``route_config``; ``bias`` its noaux_tc correction), then the chosen experts this table
        holds (global ids ``first .. first + count - 1`` are its rows ``0 .. count - 1``) and the shared experts
        (row ``shared``, or -1), summed."""
        return cpu_kernels.ops().moe_row(x, self.table, router, route, bias, scaling, first, count, shared)  # type: ignore[no-any-return]


LAYER_DIMS = ("d", "q_lora", "heads", "d_n", "d_r", "d_c", "d_v")


@dataclass
class LayerWeights:
    """One decoder layer's weights for ``DecoderLayerTable`` (float32 unless said): ``norms`` the input,
    post-attention, ``q_a`` (None without ``q_lora``) and ``kv_a`` RMSNorm weights with ``eps`` theirs; ``qa`` the
    stacked ``[q_a ; kv_a]`` projection with ``q_lora``, else ``q_proj`` (and ``kva`` then ``kv_a``); ``qb`` ``q_b``
    with ``q_lora``; ``w_uk [H, d_n, d_c]``, ``w_uv_t [H, d_c, d_v]`` (float32, or both bfloat16); ``o`` ``o_proj``.
    ``mlp``: the MLP's ``GatedMLPTable`` (a dense MLP: its row 0) or None (the caller runs the MLP); a MoE layer adds
    ``moe``: its router weight ``[E, d]``, ``route_config``, correction bias (or None), scaling factor and the
    table's first expert id, expert count and shared row, as ``GatedMLPTable.moe_row`` takes them."""

    dims: dict[str, int]  # LAYER_DIMS
    norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]
    eps: tuple[float, float, float, float]
    scale: float
    interleave: bool
    qa: Operand
    kva: Operand | None
    qb: Operand | None
    w_uk: torch.Tensor
    w_uv_t: torch.Tensor
    o: Operand
    mlp: GatedMLPTable | None = None
    moe: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float, int, int, int] | None = None
    one_path: bool = False  # one row's MLP takes the path of several (a row's bits then do not depend on the step)


class DecoderLayerTable:
    """A decoder layer's weights as ``decoder_layer`` reads them (``LayerWeights``), checked once when built."""

    def __init__(self, w: LayerWeights) -> None:
        router, route, bias, scaling, first, count, shared = w.moe or (None, None, None, 0.0, 0, 0, -1)
        self.table = cpu_kernels.ops().layer_table(
            *w.norms, *split(w.qa), *split(w.kva), *split(w.qb), w.w_uk, w.w_uv_t, *split(w.o),
            None if w.mlp is None else w.mlp.table, router, route, bias, first, count, shared,
            [w.dims[k] for k in LAYER_DIMS], w.interleave, [*w.eps, w.scale, scaling], w.one_path)
        self.heads, self.hidden, self.d_c = w.dims["heads"], w.dims["d"], w.dims["d_c"]


class DecodeStep:
    """A decode step's rows as ``decoder_layer`` reads them: RoPE tables ``cos``/``sin [T, d_r / 2]`` (rows with a
    stride), each row's cache slot ``slots [T]`` and its keys' slots ``keys [T, L]`` with their counts ``lens [T]``
    (int64; ``DecodePlan``), for layers of ``heads`` heads and latent width ``d_c``; one scratch buffer serves every
    layer of the step."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                 lens: torch.Tensor, heads: int, d_c: int) -> None:
        self.step = cpu_kernels.ops().decode_step(cos, sin, slots, keys, lens, heads, d_c)
        self.rows, self.heads, self.d_c = slots.shape[0], heads, d_c


def decoder_layer(table: DecoderLayerTable, step: DecodeStep, x: torch.Tensor, cache: torch.Tensor,
                  scales: torch.Tensor | None = None) -> torch.Tensor | None:
    """One decoder layer over ``step``'s rows: ``x [T, d]`` (contiguous float32) updated in place, the new latents
    written into ``cache`` (the layer's ``[S, d_c + d_r]`` rows: float32, bfloat16, float16, or int8 / float8_e4m3fn
    with their ``scales [S, 2]``). Returns None when the layer's MLP ran too (the table has one), else ``RMSNorm(x)``
    (post-attention, a view of the step's scratch, valid until the next call) for the caller's MLP."""
    ops = cpu_kernels.ops()
    if ops.decoder_layer(table.table, step.step, x, cache, scales):
        return None
    return ops.decoder_layer_hidden(step.step, table.hidden)  # type: ignore[no-any-return]
