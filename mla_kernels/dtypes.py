"""The element types of the latent cache: which are plain floats, which carry per-token scales.

One table for the whole project: ``mla_runtime.dtypes`` builds its user-facing names on it.
"""

from __future__ import annotations

import torch

FLOAT_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QUANTIZED_CACHE_DTYPES = (torch.float8_e4m3fn, torch.int8)
CACHE_DTYPES = FLOAT_CACHE_DTYPES + QUANTIZED_CACHE_DTYPES
ACT_DTYPES = FLOAT_CACHE_DTYPES  # activations (queries, latents written) are plain floats
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # largest stored magnitude of each quantised type


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_CACHE_DTYPES
