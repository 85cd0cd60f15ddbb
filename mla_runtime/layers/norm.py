"""RMSNorm, computed in fp32 and cast back, exactly as the DeepSeek reference does; and A.X-K2's gated RMSNorm.

A decode step normalises a few rows dozens of times; ``F.rms_norm`` costs about 35 µs a call on one row there
(measured on a 2-core EPYC, torch 2.13), so once the model is prepared, float32 CPU rows up to
``KERNEL_MAX_ROWS`` take the compiled one-thread kernel of ``mla_kernels.cpu_kernels`` where it builds (the same
formula, another summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mla_kernels import cpu_kernels
from mla_runtime.kernel_plan import KernelPlan
from mla_runtime.layers.linear import Linear

KERNEL_MAX_ROWS = 64  # more rows: torch's norm, on every thread, beats the one-thread kernel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.kernel = False  # prepare_inference(): whether few float32 CPU rows take the compiled kernel
        self.every_row = False  # True: every count of rows takes it (the model's rows_invariant)

    def prepare_inference(self, plan: KernelPlan) -> None:
        w = self.weight
        self.kernel = w.device.type == "cpu" and w.dtype == torch.float32 and plan.row_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused op
            if self.kernel and (self.every_row or x.numel() <= KERNEL_MAX_ROWS * x.shape[-1]) and x.stride(-1) == 1:
                return cpu_kernels.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)  # round, then scale


class GatedRMSNorm(nn.Module):
    """RMSNorm times a low-rank gate of its own output (A.X-K2's ``gated_norm_rank``)::

        y = RMSNorm(x);  out = y * sigmoid(gate_up(silu(gate_down(y))))     gate_down [r, d], gate_up [d, r]

    the product taken in fp32 and cast back, as the reference does. Checkpoints name the norm ``norm`` and the gate's
    matrices ``W_down`` and ``W_up``; every rank holds all of it."""

    def __init__(self, dim: int, rank: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, eps, dtype)
        self.gate_down = Linear(dim, rank, dtype)
        self.gate_up = Linear(rank, dim, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        gate = self.gate_up(F.silu(self.gate_down(y)))
        return (y * torch.sigmoid(gate.float())).to(y.dtype)


def decoder_norm(dim: int, eps: float, dtype: torch.dtype, gate_rank: int = 0) -> RMSNorm | GatedRMSNorm:
    """A decoder layer's norm: plain, or gated where ``gate_rank`` > 0."""
    return GatedRMSNorm(dim, gate_rank, eps, dtype) if gate_rank > 0 else RMSNorm(dim, eps, dtype)
