"""A bias-optional linear layer whose weight is allocated empty: checkpoints fill it, nothing initialises it.

``prepare_inference(plan)`` (called once the weights are final) prepares the weight for the kernel plan's path on
CPU (``cpu_gemm``); a layer that was never prepared computes plain ``F.linear``. A row-parallel layer
(``row_parallel``: this rank holds a slice of the input columns, the ranks' outputs summed by its owner) has its W8A8
products round each input row with the whole row's amax (``w8a8.share_row_amax``).
"""

from __future__ import annotations

import torch
from torch import nn

from mla_runtime.kernel_plan import KernelPlan
from mla_runtime.layers.cpu_gemm import PackedWeight, linear, prepared
from mla_runtime.layers.w8a8 import share_row_amax
from mla_runtime.parallel import SINGLE_RANK, ParallelContext


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, bias: bool = False,
                 row_parallel: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        self.row_parallel = row_parallel
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed: PackedWeight | None = None
        self.fused = False  # True: its owner runs it stacked with another layer, so it keeps no packed copy
        # True: the weight keeps no second layout (``KernelPlan.one_layout``): the loader's choice for a float matrix
        # beside products kept as a GGUF file stores them, whose copies would outweigh the products' gain
        self.one_layout = False

    def prepare_inference(self, plan: KernelPlan) -> None:
        fused = self.fused and not (self.packed is not None and self.packed.quantized)
        plan = plan.with_one_layout() if self.one_layout else plan
        self.packed = None if fused else prepared(self.weight, self.packed, plan)
        share_row_amax(self.packed, self.row_parallel)

    def forward(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        return linear(x, self.weight, self.bias if bias else None, self.packed)
