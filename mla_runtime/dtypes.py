"""Dtype names, one table: what ``dtype=`` and ``kv_cache_dtype=`` accept, and what a cache element costs.

The cache's element types themselves (plain floats, and the quantised types that carry per-token scales)
are defined once in ``mla_kernels.dtypes``; this module gives them their user-facing names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mla_kernels.dtypes import FLOAT_CACHE_DTYPES, QUANTIZED_CACHE_DTYPES, is_quantized
from mla_kernels.sparse import index_scale_groups

if TYPE_CHECKING:
    from mla_runtime.config import ModelConfig

__all__ = ["CACHE_DTYPES", "FLOAT_CACHE_DTYPES", "HALF_WEIGHT_SCHEMES", "MODEL_DTYPES", "QUANTIZED_CACHE_DTYPES",
           "CacheDtype", "auto_cache_dtype", "dtype_name", "index_bytes_per_token", "index_cache_dtype",
           "resolve_cache_dtype", "resolve_model_dtype"]

MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
# None = "auto": the cache uses the model dtype (``auto_cache_dtype``).
CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,
}
CACHE_SCALES_PER_TOKEN = 2  # per layer: one scale for the latent c, one for the RoPE key k_r
CACHE_SCALE_DTYPE = torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_model_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    """``"auto"`` → the checkpoint's ``torch_dtype``; FP8 checkpoints load (dequantised) at that dtype. (On a CPU, the
    loader and the Worker then ask ``kernel_plan.resolve_cpu_format`` whether this CPU keeps half precision.)"""
    if isinstance(dtype, torch.dtype):
        if dtype not in MODEL_DTYPES.values():
            raise ValueError(f"dtype: weights load as float32/bfloat16/float16, got {dtype}")
        return dtype
    name = config.torch_dtype if dtype == "auto" else dtype
    if name not in MODEL_DTYPES:
        field = "config torch_dtype" if dtype == "auto" else "dtype"
        raise ValueError(f"{field}: unsupported model dtype {name!r} (use one of {', '.join(MODEL_DTYPES)})")
    return MODEL_DTYPES[name]


@dataclass(frozen=True)
class CacheDtype:
    """The element type of the latent cache tensor and whether it carries per-token scales."""

    dtype: torch.dtype
    quantized: bool

    @property
    def name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def element_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def scale_bytes(self) -> int:
        """Scale bytes per token per layer (0 for unquantised caches)."""
        return CACHE_SCALES_PER_TOKEN * CACHE_SCALE_DTYPE.itemsize if self.quantized else 0


# the weight-only formats that hold a half-precision checkpoint's own values in a float32 model (layers.bf16)
HALF_WEIGHT_SCHEMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def auto_cache_dtype(requested: str | torch.dtype, checkpoint: torch.dtype, model: torch.dtype,
                     quantization: str | None) -> torch.dtype:
    """What a ``kv_cache_dtype`` of "auto" stands for: the model's dtype, except where ``dtype`` "auto"
    (``requested``) runs a bfloat16 or float16 ``checkpoint`` as a float32 ``model`` over its own half-precision
    weights (``quantization`` "bf16" / "fp16": a CPU's compiled decode path, which reads a cache of that dtype as fast
    as a float32 one). There the cache keeps the checkpoint's precision too, at half the bytes, as the checkpoint's
    own model would."""
    if requested == "auto" and model == torch.float32 and quantization is not None \
            and HALF_WEIGHT_SCHEMES.get(checkpoint) == quantization:
        return checkpoint
    return model


def resolve_cache_dtype(cache_dtype: str | torch.dtype, model_dtype: torch.dtype) -> CacheDtype:
    """Map a cache dtype name (``CACHE_DTYPES``) to the cache tensor's torch dtype and quantisation."""
    if isinstance(cache_dtype, torch.dtype):
        if cache_dtype not in FLOAT_CACHE_DTYPES + QUANTIZED_CACHE_DTYPES:
            raise ValueError(f"cache_dtype: unsupported cache dtype {cache_dtype}")
        dt = cache_dtype
    else:
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype: unsupported cache dtype {cache_dtype!r} "
                             f"(use one of {', '.join(CACHE_DTYPES)})")
        dt = CACHE_DTYPES[cache_dtype] or model_dtype
    return CacheDtype(dtype=dt, quantized=is_quantized(dt))


# -- the sparse-attention indexer's key cache, beside the latent ------------------------------------------------------
def index_cache_dtype(latent: torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the indexer's keys beside a latent cache of ``latent``: fp8 (with a scale per 128 values,
    ``mla_kernels.sparse.INDEX_SCALE_GROUP``, as DeepSeek stores them) beside an fp8 latent, the latent's own float
    type beside a float latent, and the model's float type beside an int8 latent (the indexer has no int8 kernel)."""
    if latent == torch.float8_e4m3fn or latent in FLOAT_CACHE_DTYPES:
        return latent
    return model_dtype


def index_bytes_per_token(index_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's indexer key in one layer: ``index_dim`` values (+ their fp32 scales when fp8)."""
    if not index_dim:
        return 0
    scales = index_scale_groups(index_dim) * CACHE_SCALE_DTYPE.itemsize if dtype == torch.float8_e4m3fn else 0
    return index_dim * dtype.itemsize + scales
