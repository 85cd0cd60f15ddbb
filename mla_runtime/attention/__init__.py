"""Attention backends: how the layers attend over the paged latent cache.

``MLAttention`` (``layers/mla.py``) computes its projections and hands them to the step's backend in two calls:
``write`` (store the new latents, return the queries) and ``forward`` (attend). Each backend decides its own paths,
once per step in ``prepare(batch) -> AttentionMetadata``:

============ ==========================================================================================
``triton``   the Triton kernels of ``mla_kernels`` (CUDA); naive or absorbed path by FLOP count
``torch``    the same paths through the torch reference kernels (any device): the oracle of the others
``cpu``      planned decodes over one gather plan, compiled decode kernels where they build (``attention/cpu.py``)
``sharded``  tensor parallelism over the sharded latent cache: absorbed, merged across ranks by LSE
============ ==========================================================================================

The engine setting ``attention_backend`` names one of the first three (default: ``triton`` on CUDA, ``cpu``
elsewhere); the sharded cache layout wraps the chosen kernels in ``sharded``.
"""

from __future__ import annotations

import torch

from mla_runtime.attention.cpu import CpuBackend
from mla_runtime.attention.metadata import AttentionDims, AttentionMetadata
from mla_runtime.attention.paged import PagedBackend
from mla_runtime.attention.sharded import ShardedBackend
from mla_runtime.resolved_config import ResolvedConfig

BACKENDS = ("triton", "torch", "cpu")

__all__ = ["BACKENDS", "AttentionDims", "AttentionMetadata", "CpuBackend", "PagedBackend", "ShardedBackend",
           "make_backend", "resolve"]


def resolve(name: str | None, device: torch.device) -> str:
    """The backend an ``attention_backend`` setting means on ``device`` (None: the device's own)."""
    if name is None:
        return "triton" if device.type == "cuda" else "cpu"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)} or None, got {name!r}")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU, not on {device}")
    return name


def make_backend(rc: ResolvedConfig) -> PagedBackend:
    """The model's backend for its resolved configuration."""
    name = resolve(rc.attention_backend, rc.device)
    kernels = "triton" if name == "triton" else "torch"
    if rc.par.sharded_cache:
        return ShardedBackend(kernels, rc.par)
    if name == "cpu":
        return CpuBackend(rc.attention_path)
    return PagedBackend(kernels, rc.attention_path)
