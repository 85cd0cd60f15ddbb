"""RMSNorm, computed in fp32 and cast back, exactly as the DeepSeek reference does.

A decode step normalises a few rows dozens of times; ``F.rms_norm`` costs about 35 µs a call on one row there
(measured on a 2-core EPYC, torch 2.13), so once the model is prepared, float32 CPU rows up to
``NORM_MAX_ROWS`` take the compiled one-thread kernel of ``mla_kernels.cpu_gemv`` where it builds (the same
formula, another summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mla_kernels import cpu_gemv
from torch import nn

from mla_runtime.layers.cpu_gemm import row_kernel_failure


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.kernel = False  # prepare_inference(): whether few float32 CPU rows take the compiled kernel

    def prepare_inference(self) -> None:
        w = self.weight
        self.kernel = w.device.type == "cpu" and w.dtype == torch.float32 and row_kernel_failure() is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused op
            if self.kernel and x.numel() <= cpu_gemv.NORM_MAX_ROWS * x.shape[-1] and x.stride(-1) == 1:
                return cpu_gemv.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)  # round, then scale
