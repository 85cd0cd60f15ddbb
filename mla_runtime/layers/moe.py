"""Mixture of experts: routers of DeepSeek-V2 and V3 / Kimi-K2, grouped expert execution.

Routers (scores in fp32):
- V2 (``scoring_func="softmax"``): ``s = softmax(W_g h)``; ``greedy`` takes the top-k experts;
  ``group_limited_greedy`` keeps the ``topk_group`` groups with the highest max score, zeroes the rest,
  then takes the top-k. Weights are ``s`` of the chosen experts (renormalised if ``norm_topk_prob``).
- V3 (``scoring_func="sigmoid"``, ``topk_method="noaux_tc"``): ``s = sigmoid(W_g h)``; the choice uses
  ``s + e_score_correction_bias``; a group's score is the sum of its top-2 biased scores; dropped groups
  are masked with −inf; weights are the *unbiased* ``s`` of the chosen experts, renormalised when
  ``norm_topk_prob``.
Both then multiply by ``routed_scaling_factor``. Mistral 4 groups softmax scores as V3 does, without a correction
bias (``MoEConfig.correction_bias`` "none"); A.X-K1 adds an RMSNorm on the layer's output (``post_mlp_layernorm``).
LongCat-Flash routes softmax scores with a correction bias and no groups over its routed experts and
``MoEConfig.zero_experts`` zero experts (ids from ``n_routed_experts`` on), which hold no weights and return their
input times their weight (``zero_expert_output``); the compiled one-row kernel does not take them, so such a layer
runs the torch path.

Execution groups the (token, expert) pairs by expert — in Python for a decode step's few pairs, by a
stable sort for a prefill's many — and runs one matmul pair per expert that has tokens (oneDNN-packed
weights on CPU); the loop is over experts, never over tokens. A float32 token alone on a CPU where the compiled
kernels build (``mla_kernels.cpu_tables``) takes the whole layer in one call instead: router logits, the same routing,
its routed experts and the shared experts (``GatedMLPTable.moe_row``). On a GPU, experts whose weights are all
block-FP8 (``Fp8Weight``) run as two grouped Triton launches (``mla_kernels.fp8_gemm.fp8_grouped_gemm``: gate/up,
then down) over the pairs sorted by expert on the device, with no host synchronisation; float experts (none
quantised) run the same way through ``mla_kernels.grouped_gemm``. Either way a decode step's MoE never reads the
routing back to the host, so it can be captured in a CUDA graph (``engine/cuda_graphs.py``); int8 and int4 experts
take the loop over experts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mla_kernels import cpu_tables
from mla_runtime.config import MoEConfig
from mla_runtime.kernel_plan import KernelPlan
from mla_runtime.layers.bf16 import half_mlp
from mla_runtime.layers.cpu_gemm import PackedWeight, linear, onednn_rows, prepared
from mla_runtime.layers.elementwise import wide
from mla_runtime.layers.fp8 import Fp8Weight
from mla_runtime.layers.mlp import GatedMLP, row_table
from mla_runtime.layers.norm import RMSNorm
from mla_runtime.parallel import SINGLE_RANK, ParallelContext

# (token, expert) pairs a compiled call over experts in ggml block types takes (Experts._in_one_call): its scratch
# (each pair's gate_up, activations and output rows) stays within a few MB
PAIRS_PER_CALL = 256
HOST_GROUPING_MAX_PAIRS = 1024  # up to this many (token, expert) pairs, group them in Python instead of sorting


def sigmoid_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.sigmoid()`` for ``[T, E]`` in float32, computed in float64 (``elementwise.wide``): an expert's score
    does not depend on how many tokens share the step, nor on the thread count."""
    return wide(logits).sigmoid().float()


class Router(nn.Module):
    def __init__(self, cfg: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.router_experts, hidden, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(cfg.router_experts, dtype=torch.float32), requires_grad=False)
            if cfg.topk_method == "noaux_tc" and cfg.correction_bias != "none" else None)
        # True: the logits by oneDNN's product at every count of rows (the model's rows_invariant: onednn_rows);
        # else F.linear
        self.onednn = False

    def kernel_route(self) -> torch.Tensor | None:
        """This router's settings for the compiled one-row MoE kernel (``cpu_tables.route_config``), or None: also
        with zero experts, which the compiled kernel does not add (``MoE.forward`` then takes the torch path)."""
        if "route" not in self.__dict__:
            cfg = self.cfg
            self.__dict__["route"] = None if cfg.zero_experts else cpu_tables.route_config(
                cfg.scoring_func, cfg.topk_method, cfg.n_routed_experts, cfg.n_group, cfg.topk_group,
                cfg.num_experts_per_tok, cfg.norm_topk_prob)
        route: torch.Tensor | None = self.__dict__["route"]
        return route

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, d]`` → (weights ``[T, k]`` fp32, expert ids ``[T, k]``)."""
        cfg = self.cfg
        rows = x if x.dtype == torch.float32 else x.float()
        logits = onednn_rows(rows, self.weight) if self.onednn else F.linear(rows, self.weight)  # [T, E]
        num_tokens = logits.shape[0]
        per_group = cfg.router_experts // cfg.n_group
        if cfg.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = sigmoid_rows(logits)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if cfg.topk_method == "group_limited_greedy" or (cfg.topk_method == "noaux_tc" and cfg.n_group > 1):
            grouped = choice.view(num_tokens, cfg.n_group, per_group)
            if cfg.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
            else:
                group_scores = grouped.max(dim=-1).values
            group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            keep = keep.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, -1)
            fill = 0.0 if cfg.topk_method == "group_limited_greedy" else float("-inf")
            choice = choice.masked_fill(~keep, fill)
        expert_ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, expert_ids


class Fp8Stacks(NamedTuple):
    """A MoE layer's block-FP8 experts stacked for ``fp8_grouped_gemm``."""

    gate_up: torch.Tensor  # [E, 2I, d] float8_e4m3fn
    gate_up_scale: torch.Tensor  # [E, ceil(2I / bn), ceil(d / bk)] float32
    gate_up_block: tuple[int, int]
    down: torch.Tensor  # [E, d, I]
    down_scale: torch.Tensor
    down_block: tuple[int, int]


def _aligned(packed: list[PackedWeight | None], n: int) -> list[PackedWeight | None]:
    """``packed`` for ``n`` experts: None for each one not prepared yet."""
    return packed if len(packed) == n else [None] * n


def _stack_fp8(gate_up: list[PackedWeight | None], down: list[PackedWeight | None]) -> Fp8Stacks | None:
    """``Experts.fp8_stacks``: the stacks, each expert's ``Fp8Weight`` then viewing its slice, or None."""
    from mla_kernels.fp8_gemm import fp8_gemm_failure

    parts: list[tuple[torch.Tensor, torch.Tensor, tuple[int, int]]] = []
    for packed in (gate_up, down):
        if not packed or not all(isinstance(p, Fp8Weight) for p in packed):
            return None
        fp8 = [p for p in packed if isinstance(p, Fp8Weight)]
        first = fp8[0]
        if (any(p.weight.shape != first.weight.shape or p.block != first.block
                or p.weight.device != first.weight.device for p in fp8)
                or fp8_gemm_failure(first.weight.device) is not None or first.block[1] < 16
                or first.block[1] & (first.block[1] - 1)):
            return None
        parts.append((torch.stack([p.weight for p in fp8]), torch.stack([p.scale_inv for p in fp8]), first.block))
    for packed, (weight, scale, _) in zip((gate_up, down), parts):
        for e, p in enumerate(packed):
            if isinstance(p, Fp8Weight):
                p.weight, p.scale_inv = weight[e], scale[e]  # views of the stack: the separate copies are freed
    (gu, gu_s, gu_block), (dn, dn_s, dn_block) = parts
    return Fp8Stacks(gu, gu_s, gu_block, dn, dn_s, dn_block)


class Experts(nn.Module):
    """Routed experts stored stacked: ``gate_up_proj [E, 2I, d]``, ``down_proj [E, d, I]``.

    Under tensor parallelism a rank holds experts ``[first, first + E / N)`` and returns the partial sum
    of the (token, expert) pairs it owns.
    """

    # group (token, expert) pairs on the device and run the experts as grouped Triton products (``forward``): always
    # on CUDA; set on a CPU to run that path through the Triton interpreter (tests)
    device_grouping = False

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                 par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        self.first, last = par.split(num_experts)
        num_experts = last - self.first
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype),
                                      requires_grad=False)
        self.gate_up_packed: list[PackedWeight | None] = []
        self.down_packed: list[PackedWeight | None] = []
        self.gate_up_list: list[torch.Tensor] = []  # per-expert views, made once (indexing the stack is an op)
        self.down_list: list[torch.Tensor] = []
        # one-row kernel over these experts and the layer's shared experts (one_row_table); None: not made yet
        self.row_table: cpu_tables.GatedMLPTable | bool | None = None
        # the same of the experts alone where all are in ggml block types (ggml_table); None: not made yet
        self.ggml: cpu_tables.GatedMLPTable | bool | None = None
        # block-FP8 experts on a GPU: their matrices stacked for the grouped kernel (fp8_stacks), with the lists they
        # were made from; None: not made yet (or the lists changed)
        self._fp8: tuple[list, list, Fp8Stacks | None] | None = None

    def prepare_inference(self, plan: KernelPlan) -> None:
        """Prepare every expert's weights for ``plan`` (pack the float ones, bind the quantised ones)."""
        self.gate_up_list, self.down_list = list(self.gate_up_proj.unbind(0)), list(self.down_proj.unbind(0))
        self.gate_up_packed = [prepared(w, p, plan) for w, p in zip(self.gate_up_list, _aligned(self.gate_up_packed,
                                                                                                  self.num_experts))]
        self.down_packed = [prepared(w, p, plan) for w, p in zip(self.down_list, _aligned(self.down_packed,
                                                                                           self.num_experts))]
        self.row_table = self.ggml = None

    def one_row_table(self, shared: GatedMLP | None) -> cpu_tables.GatedMLPTable | bool:
        """The compiled kernel's table of this rank's experts (ids ``0..num_experts-1``), then the shared experts
        (id ``num_experts``), or False where they do not all take the compiled kernels."""
        if self.row_table is None:
            mlps = list(zip(self.gate_up_packed, self.down_packed))
            if shared is not None:
                mlps.append((shared.gate_up_packed, shared.down_packed) if not shared.biased else (None, None))
            self.row_table = row_table(mlps)
        return self.row_table

    def ggml_table(self) -> cpu_tables.GatedMLPTable | None:
        """The compiled table of this rank's experts where every one is in ggml block types the kernels read (a GGUF
        file's, as stored): then any number of rows runs as one call (``_in_one_call``); else None."""
        if self.ggml is None:
            table = row_table(list(zip(self.gate_up_packed, self.down_packed))) if self.gate_up_packed else False
            ggml = isinstance(table, cpu_tables.GatedMLPTable) and set(table.table.kinds()) == {"ggml"}
            self.ggml = table if ggml else False
        return self.ggml if isinstance(self.ggml, cpu_tables.GatedMLPTable) else None

    def _in_one_call(self, table: cpu_tables.GatedMLPTable, x: torch.Tensor, weights: torch.Tensor,
                     expert_ids: torch.Tensor) -> torch.Tensor:
        """Every (token, expert) pair of this rank in one compiled call (``GatedMLPTable.mlps_rows``: all experts'
        products in one parallel region, each row the bits it has alone), then weighted and summed into each token in
        ascending expert order, as expert by expert. The decode steps' layer kernel computes the same."""
        order, groups = self._groups(expert_ids)
        out = torch.zeros_like(x)
        if not groups:
            return out
        tokens = order // expert_ids.shape[1]
        listed, parts, ids, rows, start, done = tokens.tolist(), [], [], [], 0, 0
        for i, (e, n) in enumerate(groups):  # calls of about PAIRS_PER_CALL pairs: their scratch stays small
            ids.append(e)
            rows.append(listed[start:start + n])
            start += n
            if start - done >= PAIRS_PER_CALL or i == len(groups) - 1:
                parts.append(table.mlps_rows(x, ids, rows))
                ids, rows, done = [], [], start
        h = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.index_add_(0, tokens, h * weights.reshape(-1).index_select(0, order).unsqueeze(-1))

    def _groups(self, expert_ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """This rank's (token, slot) pair indices ``t * top_k + j`` grouped by local expert (experts ascending,
        pair order within), and each group's (local expert, size)."""
        local = expert_ids.reshape(-1) - self.first  # [T*k] local expert id of each pair
        if local.numel() <= HOST_GROUPING_MAX_PAIRS:  # a decode step: group on the host, no sort
            buckets: list[list[int]] = [[] for _ in range(self.num_experts)]
            for pair, e in enumerate(local.tolist()):
                if 0 <= e < self.num_experts:
                    buckets[e].append(pair)
            flat = [pair for bucket in buckets for pair in bucket]
            return (torch.tensor(flat, dtype=torch.long, device=local.device),
                    [(e, len(b)) for e, b in enumerate(buckets) if b])
        pairs = ((local >= 0) & (local < self.num_experts)).nonzero().squeeze(1)
        order = pairs[local[pairs].argsort(stable=True)]  # grouped by expert, pair order within
        counts = torch.bincount(local[order], minlength=self.num_experts).tolist()
        return order, [(e, n) for e, n in enumerate(counts) if n]

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if not self.gate_up_packed:  # not prepared
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, self.down_proj[e])
        if half_mlp(self.gate_up_packed[e], x):
            return self._expert(e, x.to(torch.bfloat16)).float()
        gate, up = linear(x, self.gate_up_list[e], None, self.gate_up_packed[e]).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_list[e], None, self.down_packed[e])

    def fp8_stacks(self) -> Fp8Stacks | None:
        """The experts' block-FP8 matrices stacked as the grouped Triton kernel reads them (``[E, N, K]`` weights,
        ``[E, ...]`` scales), or None where they are not all ``Fp8Weight`` of one shape and block on a device the
        kernel runs on. Made once (again when the weight lists are replaced); each expert's ``Fp8Weight`` then reads
        its slice of the stack, so no second copy is kept."""
        gate_up, down = self.gate_up_packed, self.down_packed
        if self._fp8 is None or self._fp8[0] is not gate_up or self._fp8[1] is not down:
            self._fp8 = (gate_up, down, _stack_fp8(gate_up, down))
        return self._fp8[2]

    def _fp8_grouped(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                     stacks: Fp8Stacks) -> torch.Tensor:
        """Every pair of this rank's experts in two grouped launches: the pairs sorted by local expert on the device
        (other ranks' pairs after them: rows of no expert, which the kernel leaves 0), each expert's rows
        ``offsets[e]:offsets[e + 1]``."""
        from mla_kernels.fp8_gemm import fp8_grouped_gemm  # Triton: imported where it runs

        order, offsets = self._sorted_pairs(expert_ids)
        tokens = order // expert_ids.shape[1]
        gate, up = fp8_grouped_gemm(x.index_select(0, tokens), stacks.gate_up, stacks.gate_up_scale, offsets,
                                    stacks.gate_up_block).chunk(2, dim=-1)
        h = fp8_grouped_gemm(F.silu(gate) * up, stacks.down, stacks.down_scale, offsets, stacks.down_block)
        h = h.float() * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, tokens, h.to(x.dtype))

    def float_stacks(self) -> bool:
        """Whether the experts run as float matrices read from the stacks ``gate_up_proj``/``down_proj`` (none of them
        quantised, the stacks not released): what ``mla_kernels.grouped_gemm`` reads."""
        packed = [*self.gate_up_packed, *self.down_packed]
        return (bool(packed) and not any(p is not None and p.quantized for p in packed)
                and self.gate_up_proj.stride(0) != 0 and self.gate_up_proj.dtype in (torch.float32, torch.bfloat16,
                                                                                       torch.float16))

    def _sorted_pairs(self, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (token, slot) pairs sorted by local expert on the device (other ranks' pairs after them) and
        each expert's rows ``offsets[e]:offsets[e + 1]`` of that order: no host synchronisation."""
        local = expert_ids.reshape(-1) - self.first
        mine = (local >= 0) & (local < self.num_experts)
        key, order = torch.sort(torch.where(mine, local, self.num_experts), stable=True)
        return order, torch.searchsorted(key, torch.arange(self.num_experts + 1, device=key.device, dtype=key.dtype))

    def _device_grouped(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Every pair of this rank's float experts in two grouped launches (``mla_kernels.grouped_gemm``), sorted on
        the device: a step that never reads the routing back to the host, so it can run inside a CUDA graph."""
        from mla_kernels.grouped_gemm import grouped_gemm  # Triton: imported where it runs

        order, offsets = self._sorted_pairs(expert_ids)
        tokens = order // expert_ids.shape[1]
        gate, up = grouped_gemm(x.index_select(0, tokens), self.gate_up_proj, offsets).chunk(2, dim=-1)
        h = grouped_gemm(F.silu(gate) * up, self.down_proj, offsets)
        h = h.float() * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, tokens, h.to(x.dtype))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        if (x.is_cuda or self.device_grouping) and self.gate_up_packed:
            stacks = self.fp8_stacks()
            if stacks is not None:
                return self._fp8_grouped(x, weights, expert_ids, stacks)
            if self.float_stacks():
                return self._device_grouped(x, weights, expert_ids)
        table = self.ggml_table() if x.dtype == torch.float32 and x.device.type == "cpu" else None
        if table is not None:
            return self._in_one_call(table, x, weights, expert_ids)
        top_k = expert_ids.shape[1]
        if x.shape[0] == 1:  # one token: no gathering or scattering; the weights as Python floats (exact)
            out: torch.Tensor | None = None
            for e, w in sorted(zip(expert_ids.tolist()[0], weights.tolist()[0])):
                if 0 <= e - self.first < self.num_experts:
                    h = self._expert(e - self.first, x)
                    h = h * w if h.dtype == torch.float32 else (h.float() * w).to(x.dtype)
                    out = h if out is None else out.add_(h)
            return torch.zeros_like(x) if out is None else out
        order, groups = self._groups(expert_ids)
        out = torch.zeros_like(x)
        if not groups:
            return out
        if order.numel() <= HOST_GROUPING_MAX_PAIRS:
            return self._together(x, weights, order, groups, out)
        flat_weights = weights.reshape(-1)
        start = 0
        for e, n in groups:  # many pairs (a prefill): expert by expert, so the gathered rows stay one expert's
            pairs = order[start:start + n]
            start += n
            tokens = pairs // top_k
            h = self._expert(e, x.index_select(0, tokens))  # [n, d]
            h = (h.float() * flat_weights.index_select(0, pairs).unsqueeze(-1)).to(x.dtype)
            out.index_add_(0, tokens, h)  # experts in ascending order: the same sums as one sorted index_add
        return out

    def _together(self, x: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, groups: list[tuple[int, int]],
                  out: torch.Tensor) -> torch.Tensor:
        """A few pairs (a decode or verification step): one gather, one weight product and one ``index_add_`` for
        every expert's pairs, in the groups' order (a token's experts are summed in ascending order, as one by
        one)."""
        tokens = order // weights.shape[1]
        xs = x.index_select(0, tokens)  # every pair's token, grouped by expert
        hs, start = [], 0
        for e, n in groups:
            hs.append(self._expert(e, xs[start:start + n]))
            start += n
        h = hs[0] if len(hs) == 1 else torch.cat(hs)
        w = weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        h = h * w if h.dtype == torch.float32 else (h.float() * w).to(x.dtype)
        return out.index_add_(0, tokens, h)


def zero_expert_output(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, n_routed: int
                       ) -> torch.Tensor:
    """What the zero (identity) experts add: each token ``x [T, d]`` times the sum of its weights ``[T, k]`` for
    the chosen ids ``>= n_routed``."""
    w = weights.masked_fill(expert_ids < n_routed, 0.0).sum(dim=-1, keepdim=True)
    return x * w if x.dtype == torch.float32 else (x.float() * w).to(x.dtype)


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig, hidden: int, dtype: torch.dtype, bias: bool = False,
                 par: ParallelContext = SINGLE_RANK, output_norm_eps: float | None = None) -> None:
        super().__init__()
        self.par = par
        # A.X-K1: an RMSNorm on the layer's whole output (after the reduction: the norm is of the full sum)
        self.post_mlp_layernorm = None if output_norm_eps is None else RMSNorm(hidden, output_norm_eps, dtype)
        self.gate = Router(cfg, hidden)
        self.experts = Experts(cfg.n_routed_experts, hidden, cfg.moe_intermediate_size, dtype, par)
        self.shared_experts = (GatedMLP(hidden, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype, bias,
                                        par, reduce=False) if cfg.n_shared_experts else None)
        self.row_call = True  # a lone row takes the one-row kernel here (the model's rows_invariant: only in its layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and x.dtype == torch.float32 and self.row_call:  # one token: the layer in one kernel call
            table = self.experts.one_row_table(self.shared_experts)
            route = self.gate.kernel_route()
            if isinstance(table, cpu_tables.GatedMLPTable) and route is not None:
                shared = self.experts.num_experts if self.shared_experts is not None else -1
                out = table.moe_row(x, self.gate.weight, route, self.gate.e_score_correction_bias,
                                    self.gate.cfg.routed_scaling_factor, self.experts.first, self.experts.num_experts,
                                    shared)
                return self._output(out)
        weights, expert_ids = self.gate(x)
        out = self.experts(x, weights, expert_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.gate.cfg.zero_experts and self.par.rank == 0:  # on one rank: the reduction sums the ranks' parts
            out = out + zero_expert_output(x, weights, expert_ids, self.gate.cfg.n_routed_experts)
        return self._output(out)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        out = self.par.all_reduce(out)  # one reduction for routed and shared experts
        return out if self.post_mlp_layernorm is None else self.post_mlp_layernorm(out)
