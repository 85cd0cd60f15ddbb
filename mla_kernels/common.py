"""Shared pieces of the kernels package: backend choice, the latent-cache format and its quantisation.

Latent cache (one tensor per layer)::

    cache  [num_blocks, block_size, d_c + d_r]     token slot s = block s // block_size, offset s % block_size
    scales [num_blocks, block_size, 2] float32     only for fp8/int8 caches: [..., 0] latent, [..., 1] RoPE key

Quantisation is symmetric absmax per token and per part (latent, RoPE key)::

    scale = amax(|x|) / Q        Q = 127 (int8) or 448 (float8_e4m3fn);  amax == 0  ->  scale = 1
    int8: stored = clamp(round_half_even(x / scale), -127, 127)
    fp8:  stored = float8_e4m3fn(clamp(x / scale, -448, 448))          (round to nearest even)
    dequantised value = stored.float() * scale
"""

from __future__ import annotations

import torch
import triton

from .dtypes import FLOAT_CACHE_DTYPES, QMAX, QUANTIZED_CACHE_DTYPES

BACKENDS = ("triton", "torch")


def default_backend(t: torch.Tensor) -> str:
    """The backend None resolves to: "triton" for CUDA tensors, else "torch" (the vectorised CPU path)."""
    return "triton" if t.is_cuda else "torch"


# Triton decides interpreter vs compiler when a kernel is decorated, i.e. when this package is imported.
_INTERPRETING = bool(triton.knobs.runtime.interpret)


def triton_interpreting() -> bool:
    """True when the kernels were built for the CPU interpreter (``TRITON_INTERPRET=1`` at import time)."""
    return _INTERPRETING


def resolve_backend(backend: str | None, t: torch.Tensor) -> str:
    if backend is None:
        return default_backend(t)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and not t.is_cuda and not triton_interpreting():
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
                         "imported); use backend='torch' on CPU")
    return backend


def check_triton_cache(cache: torch.Tensor) -> None:
    """Triton's float8_e4m3fn type needs sm_89+ (Ada, Hopper, ...)."""
    if cache.dtype == torch.float8_e4m3fn and cache.is_cuda and torch.cuda.get_device_capability(cache.device) < (8, 9):
        raise ValueError("a float8_e4m3fn cache needs an sm_89+ GPU for the Triton kernels; use an int8 cache "
                         "or backend='torch' on this device")


def qmax(dtype: torch.dtype) -> float:
    return QMAX[dtype]


def check_cache(cache: torch.Tensor, scales: torch.Tensor | None) -> None:
    """Validate the latent-cache contract (shape, dtype, scales present iff quantised)."""
    if cache.dim() != 3:
        raise ValueError(f"cache must be [num_blocks, block_size, d_c + d_r], got shape {tuple(cache.shape)}")
    if cache.shape[1] % 16 != 0:
        raise ValueError(f"cache block_size must be a multiple of 16, got {cache.shape[1]}")
    if cache.stride(-1) != 1:
        raise ValueError("cache must be contiguous in its last dimension")
    if cache.dtype in FLOAT_CACHE_DTYPES:
        if scales is not None:
            raise ValueError(f"scales must be None for an unquantised {cache.dtype} cache")
    elif cache.dtype in QUANTIZED_CACHE_DTYPES:
        if scales is None:
            raise ValueError(f"scales [num_blocks, block_size, 2] float32 are required for a {cache.dtype} cache")
        if scales.shape != (cache.shape[0], cache.shape[1], 2) or scales.dtype != torch.float32:
            raise ValueError(f"scales must be float32 {(cache.shape[0], cache.shape[1], 2)}, got "
                             f"{scales.dtype} {tuple(scales.shape)}")
        if scales.stride(-1) != 1 or scales.device != cache.device:
            raise ValueError("scales must be contiguous in its last dimension and on the cache's device")
    else:
        raise ValueError(f"cache dtype must be one of {FLOAT_CACHE_DTYPES + QUANTIZED_CACHE_DTYPES}, got {cache.dtype}")


def check_int_tensor(name: str, t: torch.Tensor, dim: int, device: torch.device,
                     dtypes: tuple[torch.dtype, ...] = (torch.int32,)) -> None:
    if t.dim() != dim or t.dtype not in dtypes:
        raise ValueError(f"{name} must be a {dim}-D tensor of {dtypes}, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def quantize_per_token(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Absmax-quantise each row of ``x`` [T, d] to ``dtype``; returns (stored [T, d], scale [T] fp32)."""
    x = x.float()
    amax = x.abs().amax(dim=-1)  # [T]
    scale = torch.where(amax > 0, amax / qmax(dtype), torch.ones_like(amax))
    y = x / scale[:, None]
    if dtype == torch.int8:
        return y.round().clamp(-127.0, 127.0).to(torch.int8), scale
    return y.clamp(-448.0, 448.0).to(dtype), scale


def dequantize_rows(rows: torch.Tensor, row_scales: torch.Tensor | None, d_c: int) -> torch.Tensor:
    """rows [..., d_c + d_r] (cache dtype), row_scales [..., 2] or None -> float32 [..., d_c + d_r]."""
    out = rows.float()
    if row_scales is None:
        return out
    out[..., :d_c] *= row_scales[..., 0:1]
    out[..., d_c:] *= row_scales[..., 1:2]
    return out
