"""The memory a load needs, and the check that refuses one a rank cannot hold before any weight is read.

``load_requirement`` adds up what a rank holds while it loads: the weights in their final form (``footprint``), the
largest tensor a load converts at once (on a CPU plus a margin for the quantisers' temporaries and the allocator), the
activation reserve and the latent cache the settings ask for (``plan``). ``check_load_memory`` compares it with the
memory available and, where it does not fit, names settings that do (a smaller weight format, more ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mla_runtime.config import ModelConfig
from mla_runtime.dtypes import dtype_name, resolve_model_dtype
from mla_runtime.errors import InsufficientMemory
from mla_runtime.footprint import WeightFootprint, check_weight_quantization, weight_footprint
from mla_runtime.kernel_plan import CpuLayouts
from mla_runtime.plan import (
    activation_reserve_bytes,
    default_max_num_batched_tokens,
    latent_bytes_per_token,
    smaller_formats,
    tp_splits,
)


def human_size(n: float) -> str:
    """GiB from 1 GiB up, else MiB or KiB (two decimals)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n / 2**10:,.2f} KiB"


LOAD_MARGIN_CPU_BYTES = 2**30  # a CPU load's slack on top: quantisers' temporaries, allocator, page tables


@dataclass(frozen=True)
class LoadRequirement:
    """Bytes one rank needs to load a model and start serving it (``load_requirement``)."""

    weights: WeightFootprint  # the loaded weights, by part
    transient_bytes: int  # the load's peak on top of them
    activation_bytes: int  # the planner's reserve for one step
    cache_bytes: int  # the smallest cache: kv_cache_memory, or one sequence of max_model_len tokens
    cache_bytes_per_token: int  # this rank's latent bytes per token (all cache layers)
    block_size: int
    max_model_len: int
    kv_cache_memory: bool  # cache_bytes is the kv_cache_memory setting

    @property
    def weight_bytes(self) -> int:
        return self.weights.total

    @property
    def total(self) -> int:
        return self.weight_bytes + self.transient_bytes + self.activation_bytes + self.cache_bytes


def load_requirement(config: ModelConfig, *, dtype: str | torch.dtype, device: str | torch.device,
                     max_model_len: int, tensor_parallel_size: int = 1, quantization: str | None = None,
                     num_mtp_layers: int = 0, latent_cache_layout: str = "replicated",
                     cache_dtype: str | torch.dtype = "auto", block_size: int = 64, max_num_seqs: int = 256,
                     max_num_batched_tokens: int | None = None, kv_cache_memory: int | None = None,
                     latent_rank: int | None = None, cpu: CpuLayouts | None = None,
                     state_snapshots: int = 0) -> LoadRequirement:
    """The bytes one rank needs to load ``config``'s checkpoint (the worker's settings) and start:

        weights     the loaded weights (``weight_footprint``, with ``cpu``: the probed layouts of a CPU ``device``)
        transient   the load's peak on top of them: the largest checkpoint tensor it converts (its part on this
                    rank; an FP8 one loaded dequantised is read whole) as float32, + ``LOAD_MARGIN_CPU_BYTES`` on a CPU
        activations the reserve for one step (``activation_reserve_bytes``)
        cache       ``kv_cache_memory`` when set, else one sequence of ``max_model_len`` tokens (whole blocks): the
                    least cache the engine starts with; plus a hybrid's ``max_num_seqs`` state slots and its
                    ``state_snapshots`` (prefix caching)

    ``config`` is the checkpoint's own: the load holds its weights before any truncation to ``latent_rank``, which
    sets the width the cache and the activations have."""
    tp = tensor_parallel_size
    model_dtype = resolve_model_dtype(dtype, config)
    weights = weight_footprint(config, model_dtype, tp, quantization, cpu=cpu, num_mtp_layers=num_mtp_layers,
                               latent_cache_layout=latent_cache_layout)
    on_cpu = torch.device(device).type == "cpu"
    transient = 4 * weights.largest_read_elements + (LOAD_MARGIN_CPU_BYTES if on_cpu else 0)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = default_max_num_batched_tokens(max_model_len, max_num_seqs)
    served = config if latent_rank is None else config.with_overrides(kv_lora_rank=latent_rank)
    activations = activation_reserve_bytes(served, dtype=model_dtype, max_num_batched_tokens=max_num_batched_tokens,
                                           max_num_seqs=max_num_seqs, tensor_parallel_size=tp)
    per_token = latent_bytes_per_token(served, cache_dtype, model_dtype, num_mtp_layers)
    if latent_cache_layout == "sharded" and tp > 1:
        per_token //= tp
    cache = config.state_bytes_per_sequence * (max_num_seqs + state_snapshots) + (
        kv_cache_memory if kv_cache_memory is not None else -(-max_model_len // block_size) * block_size * per_token)
    return LoadRequirement(weights, transient, activations, cache, per_token, block_size, max_model_len,
                           kv_cache_memory is not None)


def check_load_memory(config: ModelConfig, available_bytes: int, settings: dict[str, Any], where: str = ""
                      ) -> LoadRequirement:
    """``load_requirement(config, **settings)``, checked against the ``available_bytes`` the rank can have: an
    ``errors.InsufficientMemory`` (a ``ValueError``) when it needs more, saying how much, of what, and which settings
    would fit (``quantization="int8"`` / ``"int4"``, more tensor-parallel ranks, a lower ``max_model_len`` or
    ``kv_cache_memory``), each with what it needs. ``where``: the memory's name for the message."""

    need = load_requirement(config, **settings)
    if need.total <= available_bytes:
        return need
    w = need.weights
    cpu = torch.device(settings["device"]).type == "cpu"
    margin = f" + {human_size(LOAD_MARGIN_CPU_BYTES)} margin" if cpu else ""
    cache_why = ("kv_cache_memory" if need.kv_cache_memory else
                 f"one sequence of max_model_len={need.max_model_len:,} tokens")
    held = w.format if w.format == dtype_name(w.dtype) else f"{w.format}, the rest in {dtype_name(w.dtype)}"
    parts = (f"weights {human_size(need.weight_bytes)} ({held}), load peak "
             f"{human_size(need.transient_bytes)} (its largest tensor in float32{margin}), activation reserve "
             f"{human_size(need.activation_bytes)}, latent cache {human_size(need.cache_bytes)} ({cache_why})")
    options = []
    for q in smaller_formats(config, check_weight_quantization(settings.get("quantization"))):
        smaller = load_requirement(config, **{**settings, "quantization": q}).total
        if smaller <= available_bytes:
            options.append(f'quantization="{q}" needs {human_size(smaller)}')
    tp = settings.get("tensor_parallel_size", 1)
    for more in range(tp + 1, config.num_attention_heads + 1):
        if tp_splits(config, more):
            per_rank = load_requirement(config, **{**settings, "tensor_parallel_size": more}).total
            if per_rank <= available_bytes:
                options.append(f"tensor_parallel_size={more} needs {human_size(per_rank)} per rank, in memory of "
                               "its own")
                break
    others = need.total - need.cache_bytes
    block = need.cache_bytes_per_token * need.block_size
    if others + block <= available_bytes:
        if need.kv_cache_memory:
            options.append(f"kv_cache_memory <= {human_size(available_bytes - others)}")
        else:
            tokens = (available_bytes - others) // block * need.block_size
            per_thousand = human_size(1000 * need.cache_bytes_per_token)
            options.append(f"max_model_len <= {tokens:,} (the cache takes {per_thousand} per 1,000 tokens)")
    fits = "; ".join(options) if options else "none of int8, int4, more tensor-parallel ranks or a shorter context"
    raise InsufficientMemory(
        f"not enough memory to load the model{' on ' + where if where else ''}: it needs {human_size(need.total)} "
        f"({need.total:,} B: {parts}) but {human_size(available_bytes)} ({available_bytes:,} B) are available. "
        f"Settings that fit: {fits}", need.total, available_bytes)


