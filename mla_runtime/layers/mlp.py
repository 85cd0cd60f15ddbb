"""SwiGLU feed-forward (dense layers and shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mla_kernels import cpu_tables
from mla_runtime.kernel_plan import KernelPlan
from mla_runtime.layers.bf16 import half_mlp
from mla_runtime.layers.cpu_gemm import PackedWeight, linear, prepared
from mla_runtime.layers.w8a8 import share_row_amax
from mla_runtime.parallel import SINGLE_RANK, ParallelContext


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``[2I, d]`` weight.

    Under tensor parallelism each rank holds ``I / N`` of the intermediate dimension and returns a
    partial sum (the down bias is added on rank 0 only); ``reduce`` all-reduces it here, or the caller
    reduces several partial sums at once.
    """

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, bias: bool = False,
                 par: ParallelContext = SINGLE_RANK, reduce: bool = True) -> None:
        super().__init__()
        self.par = par
        self.reduce = reduce
        intermediate //= par.world_size
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(hidden, intermediate, dtype=dtype), requires_grad=False)
        self.gate_up_bias = (nn.Parameter(torch.zeros(2 * intermediate, dtype=dtype), requires_grad=False)
                             if bias else None)
        self.down_bias = nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False) if bias else None
        self.gate_up_packed: PackedWeight | None = None
        self.down_packed: PackedWeight | None = None
        self.row_table: cpu_tables.GatedMLPTable | bool | None = None  # one-row kernel (row_table); None: not made yet
        self.row_call = True  # a lone row takes that kernel here (the model's rows_invariant: only in its layer call)

    def prepare_inference(self, plan: KernelPlan) -> None:
        """Prepare the weights for ``plan`` (pack the float ones, bind the quantised ones)."""
        self.gate_up_packed = prepared(self.gate_up_proj, self.gate_up_packed, plan)
        self.down_packed = prepared(self.down_proj, self.down_packed, plan)
        share_row_amax(self.down_packed, self.par)  # down_proj's columns are this rank's share of the intermediate
        self.row_table = None

    @property
    def biased(self) -> bool:
        return self.gate_up_bias is not None or self.down_bias is not None

    def one_row_table(self) -> cpu_tables.GatedMLPTable | bool:
        """The compiled one-row kernel's table of this MLP (row 0), or False where it does not take it."""
        if self.row_table is None:
            self.row_table = False if self.biased else row_table([(self.gate_up_packed, self.down_packed)])
        return self.row_table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1] and x.dtype == torch.float32 and self.row_call:  # one row: one kernel call
            table = self.one_row_table()
            if isinstance(table, cpu_tables.GatedMLPTable):
                out = table(x, [0], [1.0])
                return self.par.all_reduce(out) if self.reduce else out
        if self.par.world_size == 1 and half_mlp(self.gate_up_packed, x):
            return self.forward(x.to(torch.bfloat16)).float()
        gate, up = linear(x, self.gate_up_proj, self.gate_up_bias, self.gate_up_packed).chunk(2, dim=-1)
        bias = self.down_bias if self.par.rank == 0 else None
        out = linear(F.silu(gate) * up, self.down_proj, bias, self.down_packed)
        return self.par.all_reduce(out) if self.reduce else out


def row_table(mlps: list[tuple[PackedWeight | None, PackedWeight | None]]) -> cpu_tables.GatedMLPTable | bool:
    """The compiled one-row kernel's table of these gated MLPs' ``(gate_up, down)`` weights, or False where any of
    them does not take the compiled kernels (no kernel on this CPU, another dtype or mode)."""
    operands = []
    for gate_up, down in mlps:
        a = gate_up.row_operand() if gate_up is not None else None
        b = down.row_operand() if down is not None else None
        if a is None or b is None:
            return False
        operands.append((a, b))
    return cpu_tables.GatedMLPTable(operands) if operands else False
