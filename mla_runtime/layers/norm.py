"""RMSNorm, computed in fp32 and cast back, exactly as the DeepSeek reference does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused op
            return F.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)  # round, then scale
