"""Memory planner: the one owner of memory sizing.

Device memory is split three ways, per rank::

    usable      = floor(device_memory_bytes × memory_utilization)
    cache budget = usable − weights − activation reserve
    num_blocks  = floor(cache budget / (latent_bytes_per_token × block_size))

Latent cache layout (the contract the cache code allocates exactly), per layer::

    latent  [num_blocks, block_size, d_c + d_r]   cache dtype
    scales  [num_blocks, block_size, 2]           float32, only for fp8/int8 caches
                                                  (one scale for the d_c part, one for the d_r part)

so a token costs ``(d_c + d_r) × bytes(cache dtype) (+ 8 when quantised)`` per layer. DeepSeek-V3 in
bf16: 576 × 61 × 2 = 70,272 B/token; the same model's un-absorbed per-head K/V cache would cost
n_h × (d_n + d_r + d_v) × 61 × 2 = 4,997,120 B/token (71×).

The weights are what a rank holds once loaded (``weight_footprint``): the products in the model dtype, int8, int4 or
FP8 blocks (``quantization``; an FP8 checkpoint keeps its own blocks without it: DeepSeek-V3 on 8 ranks holds about
86 GB each), ``kv_b_proj`` and its absorbed factors' copies, and on a CPU the second layouts its products keep. They
are counted over the model the loader builds, made on the meta device (``mla_runtime.footprint``).
A load needs more than that while it runs (``load_requirement``); the worker refuses one that cannot fit before it
reads a weight (``check_load_memory``).

Tensor parallelism (``tensor_parallel_size = tp``) shards, per rank: attention heads (q/q_b, kv_b,
o_proj), the intermediate dims of the dense MLP and the shared experts (ceil division), the routed experts
themselves (each rank holds ``n_routed_experts / tp`` whole experts, which costs the same bytes as a ``tp``-th
of every expert's intermediate dim; the count below uses the latter), and the vocabulary of the embedding and
lm_head (ceil division); q_a/kv_a projections, norms and the router are replicated.
With ``latent_cache_layout="replicated"`` every rank caches every token; with ``"sharded"`` each
token's latent lives on one rank, so a rank pays ``latent / tp`` bytes per token and the whole group
holds ``tp×`` the tokens.

CLI: ``mla-runtime plan --model deepseek-v3 --max-seq-len 32768 --max-num-seqs 64
--device-memory 141GiB --tensor-parallel-size 8 [--quantization int4] [--device cpu]`` (also
``python -m mla_runtime.plan``); it exits 0 when the requested sequences fit, 1 when the weights fit but the
cache cannot hold the sequences, 2 on bad input or when the weights alone do not fit.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mla_runtime.cache.disk_tier import HEADER_ESTIMATE_BYTES
from mla_runtime.config import PRESET_DIR, ModelConfig
from mla_runtime.dtypes import (
    CACHE_DTYPES,
    MODEL_DTYPES,
    CacheDtype,
    auto_cache_dtype,
    dtype_name,
    index_bytes_per_token,
    index_cache_dtype,
    resolve_cache_dtype,
    resolve_model_dtype,
)
from mla_runtime.footprint import (  # the weights' bytes and parameters, counted over the model the loader builds
    WeightFootprint,
    check_tp,
    check_weight_quantization,
    parameter_count,
    weight_bytes,
    weight_footprint,
)
from mla_runtime.footprint import parameter_breakdown as parameter_breakdown
from mla_runtime.footprint import quantized_parameters as quantized_parameters
from mla_runtime.help_format import DefaultsHelpFormatter
from mla_runtime.kernel_plan import CpuLayouts
from mla_runtime.options import LATENT_CACHE_LAYOUTS, WEIGHT_QUANTIZATIONS, parse_bytes  # defined without torch

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
MIN_DEFAULT_BATCHED_TOKENS = 2048
ACTIVATION_OVERHEAD_BYTES = 256 * 2**20


# -- bytes per token -----------------------------------------------------------------------------
def latent_bytes_per_token(config: ModelConfig, cache_dtype: str | torch.dtype = "auto",
                           model_dtype: str | torch.dtype = "auto", num_mtp_layers: int = 0) -> int:
    """Exact bytes the paged latent cache stores per token, all layers (the MTP layers' too): ``[c ; k_r]``
    (+ scales), and the sparse-attention indexer's key beside it (``dtypes.index_cache_dtype``)."""
    model = resolve_model_dtype(model_dtype, config)
    cache = resolve_cache_dtype(cache_dtype, model)
    per_layer = config.latent_dim * cache.element_bytes + cache.scale_bytes
    per_layer += index_bytes_per_token(config.index_dim, index_cache_dtype(cache.dtype, model))
    # a LongCat layer caches each of its attention blocks
    return per_layer * (config.num_attention_layers + num_mtp_layers)


def mha_bytes_per_token(config: ModelConfig, dtype: str | torch.dtype = "auto") -> int:
    """Bytes per token of the un-absorbed per-head cache: ``n_h × (d_n + d_r + d_v) × layers × bytes``."""
    element = resolve_cache_dtype(dtype, resolve_model_dtype("auto", config)).element_bytes
    per_layer = config.num_attention_heads * (config.qk_head_dim + config.v_head_dim)
    return per_layer * config.num_attention_layers * element


# -- weights ---------------------------------------------------------------------------------------
def _tp_splits(config: ModelConfig, tp: int) -> bool:
    """Whether the model splits ``tp`` ways (``parallel.check_tensor_parallel``, without the cache layout's rule)."""
    m = config.moe
    if config.num_attention_heads % tp:
        return False
    if m is not None and (m.n_routed_experts % tp or (m.moe_intermediate_size * m.n_shared_experts) % tp):
        return False
    dense = any(config.dense_mlps(i) for i in range(config.num_hidden_layers))
    return not (dense and config.intermediate_size % tp)


# -- activations -------------------------------------------------------------------------------
def default_max_num_batched_tokens(max_seq_len: int, max_num_seqs: int) -> int:
    """Token budget of one step when the caller sets none: room for one whole sequence up to 8,192 tokens
    (longer prompts are chunked), and at least 2,048 tokens (when that many can be in flight) so that a burst
    of short prompts prefills in a few large steps rather than many small ones."""
    return max(min(max_seq_len, DEFAULT_MAX_NUM_BATCHED_TOKENS),
               min(MIN_DEFAULT_BATCHED_TOKENS, max_seq_len * max_num_seqs), max_num_seqs)


def activation_reserve_bytes(config: ModelConfig, *, dtype: str | torch.dtype = "auto",
                             max_num_batched_tokens: int, max_num_seqs: int,
                             tensor_parallel_size: int = 1) -> int:
    """Conservative bytes for one step's activations, per rank.

    With ``T = max_num_batched_tokens`` tokens in flight, ``b`` bytes per model-dtype element,
    ``h = n_h / tp`` local heads and ``s(x) = ceil(x / tp)``::

        per_token = b × (2·d + widest) + router
          2·d      residual stream + the current layer's input/output (hidden states)
          widest   the largest intermediate alive at once, the max of
                   attention  h·(2·(d_n + d_r) + 2·d_v)   q, up-projected k and v, attention output
                   absorbed   h·(2·d_c + d_r)              q̃ = [W_UKᵀ q_n ; q_r] and the latent output
                   dense MLP  3·s(I)                       gate/up output + activated product
                   MoE        3·(k·s(I_e) + s(n_s·I_e)) + k·d   per-expert gate/up/act for k routed
                                                                copies, shared experts, dispatched copies
          router   8·n_routed                              fp32 router logits + scores (MoE models)
        reserve = T·per_token + 2·4·min(max_num_seqs, T)·vocab + ACTIVATION_OVERHEAD_BYTES

    The logits term is fp32 logits and probabilities for one sampled row per sequence (full vocab:
    vocab-parallel logits are gathered). The fixed 256 MiB overhead covers kernel workspaces
    (split-KV partial outputs), sampler buffers and allocator slack. Each term is an upper bound
    of what lives at once; nothing is assumed to be freed early.
    """
    check_tp(config, tensor_parallel_size)
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    tp = tensor_parallel_size

    def shard(n: int) -> int:
        return -(-n // tp)

    b = resolve_model_dtype(dtype, config).itemsize
    d, heads = config.hidden_size, config.num_attention_heads // tp
    widths = [heads * (2 * config.qk_head_dim + 2 * config.v_head_dim),
              heads * (2 * config.kv_lora_rank + config.qk_rope_head_dim)]
    layers = range(config.num_hidden_layers)
    if any(config.dense_mlps(i) for i in layers):
        widths.append(3 * shard(config.intermediate_size))
    router = 0
    m = config.moe
    if m is not None and any(config.is_moe_layer(i) for i in layers):
        experts = m.num_experts_per_tok * shard(m.moe_intermediate_size)
        widths.append(3 * (experts + shard(m.n_shared_experts * m.moe_intermediate_size))
                      + m.num_experts_per_tok * d)
        router = 2 * 4 * m.router_experts
    per_token = b * (2 * d + max(widths)) + router
    logits = 2 * 4 * min(max_num_seqs, max_num_batched_tokens) * config.vocab_size
    return max_num_batched_tokens * per_token + logits + ACTIVATION_OVERHEAD_BYTES


# -- the engine's cache size ----------------------------------------------------------------------
GPU_MEMORY_UTILIZATION = 0.9  # of the GPU memory free once the weights are loaded
CPU_CACHE_FRACTION = 0.25  # of the RAM available once the weights are loaded (activations share the rest)


def cache_budget_bytes(*, on_gpu: bool, free_bytes: int, activation_bytes: int, bytes_per_token: int,
                       block_size: int, max_model_len: int, max_num_seqs: int) -> int:
    """Latent-cache bytes of one rank when ``kv_cache_memory`` is not given, from the memory free after loading:
    on a GPU ``free × GPU_MEMORY_UTILIZATION − activation reserve``; on a CPU ``CPU_CACHE_FRACTION`` of the
    available RAM, but no more than ``max_num_seqs`` sequences of ``max_model_len`` tokens can use."""
    if on_gpu:
        return int(free_bytes * GPU_MEMORY_UTILIZATION) - activation_bytes
    per_sequence = -(-max_model_len // block_size) * block_size * bytes_per_token
    return min(int(free_bytes * CPU_CACHE_FRACTION), per_sequence * max_num_seqs)


def cache_capacity_tokens(budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """Tokens in the whole blocks of ``block_size`` tokens that fit ``budget_bytes``."""
    return max(0, budget_bytes) // (bytes_per_token * block_size) * block_size


def cache_num_blocks(budget_bytes: int, bytes_per_token: int, block_size: int, max_model_len: int) -> int:
    """Blocks that fit ``budget_bytes``; a ``ValueError`` naming ``kv_cache_memory`` when not even one sequence of
    ``max_model_len`` tokens fits."""
    num_blocks = cache_capacity_tokens(budget_bytes, bytes_per_token, block_size) // block_size
    per_block = bytes_per_token * block_size
    seq_blocks = -(-max_model_len // block_size)
    if num_blocks < seq_blocks:
        raise ValueError(
            f"kv_cache_memory: {budget_bytes:,} B hold {num_blocks} blocks of {block_size} tokens ({per_block:,} B "
            f"each), but one sequence of max_model_len={max_model_len} needs {seq_blocks}; raise kv_cache_memory "
            f"to at least {seq_blocks * per_block:,} B or lower max_model_len")
    return num_blocks


# -- the plan ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank memory split and cache capacity. All byte counts are per rank unless named total."""

    dtype: torch.dtype
    cache_dtype: CacheDtype
    block_size: int
    tensor_parallel_size: int
    latent_cache_layout: str
    max_seq_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    device_memory_bytes: int
    memory_utilization: float
    usable_bytes: int
    parameter_count: int              # whole model
    weight_bytes: int                 # per rank
    total_weight_bytes: int           # whole model
    activation_bytes: int
    cache_budget_bytes: int
    latent_bytes_per_token: int       # whole token, all layers
    cache_bytes_per_token_per_rank: float  # latent / tp when sharded
    mha_bytes_per_token: int
    num_blocks: int                   # per rank
    max_tokens: int                   # tokens the whole group can cache
    max_sequences: int                # sequences of max_seq_len that fit at once
    blocks_per_sequence: int
    disk_bytes: int | None = None     # the disk tier's bound (kv_cache_disk_bytes), whole directory
    disk_file_bytes: int = 0          # one block on disk: its latents (all shards) plus file headers
    disk_capacity_tokens: int = 0     # tokens the disk tier holds
    host_bytes: int | None = None     # the host-RAM tier of one rank (kv_cache_host_bytes)
    host_capacity_tokens: int = 0     # tokens the host tier holds
    weights: WeightFootprint | None = None  # the per-rank weights by part (their total is weight_bytes)

    @property
    def fits(self) -> bool:
        """Whether ``max_num_seqs`` sequences of ``max_seq_len`` tokens fit in the cache at once."""
        return self.max_sequences >= self.max_num_seqs

    @property
    def absorption_ratio(self) -> float:
        """How many times smaller the latent cache is than the un-absorbed MHA cache."""
        return self.mha_bytes_per_token / self.latent_bytes_per_token

    @property
    def cache_bytes(self) -> int:
        """Bytes the cache tensors actually take on one rank (≤ the budget)."""
        return self.num_blocks * self.block_size * self.latent_bytes_per_token


def disk_tier_capacity(disk_bytes: int, latent_bytes_per_token: int, block_size: int,
                       files_per_block: int = 1) -> tuple[int, int]:
    """``(bytes of one block on disk, tokens that fit)`` for a disk tier bounded by ``disk_bytes``: each block is
    its latents (exactly the cache's bytes per token × block size) plus one header per file (one file per rank
    under the sharded layout)."""
    per_block = latent_bytes_per_token * block_size + files_per_block * HEADER_ESTIMATE_BYTES
    return per_block, disk_bytes // per_block * block_size


def host_tier_capacity(host_bytes: int, cache_bytes_per_token_per_rank: float, block_size: int) -> int:
    """Tokens a host tier of ``host_bytes`` per rank holds: whole blocks of the rank's latents (its shard of each
    token under the sharded layout)."""
    return int(host_bytes // (cache_bytes_per_token_per_rank * block_size)) * block_size


def _min_tp_that_fits(config: ModelConfig, dtype: torch.dtype, usable: int, quantization: str | None = None,
                      cpu: CpuLayouts | None = None) -> int | None:
    """The fewest ranks the model splits across whose per-rank weights (in ``quantization``) fit ``usable`` bytes."""
    for tp in range(1, config.num_attention_heads + 1):
        if _tp_splits(config, tp) and weight_bytes(config, dtype, tp, quantization, cpu=cpu) <= usable:
            return tp
    return None


def _check_plan_args(config: ModelConfig, memory_utilization: float, latent_cache_layout: str,
                     tensor_parallel_size: int, **positive: int) -> None:
    check_tp(config, tensor_parallel_size)
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if latent_cache_layout not in LATENT_CACHE_LAYOUTS:
        raise ValueError(f"latent_cache_layout must be one of {LATENT_CACHE_LAYOUTS}, "
                         f"got {latent_cache_layout!r}")


def _smaller_formats(config: ModelConfig, quantization: str | None) -> list[str]:
    """The weight formats smaller than ``quantization`` (None: the checkpoint's own) worth suggesting: none for a
    pre-quantised checkpoint, which loads as stored."""
    if config.stored_quantization is not None:
        return []
    order = [None, "bf16", "fp16", "fp8", "int8", "int4"] if config.fp8_block_size is None else \
        ["fp8", None, "bf16", "fp16", "int8", "int4"]
    return [q for q in order[order.index(quantization) + 1:] if q in ("int8", "int4")]


def _weights_do_not_fit(config: ModelConfig, model_dtype: torch.dtype, tp: int, weights: int, usable: int,
                        device_memory_bytes: int, memory_utilization: float, quantization: str | None = None,
                        cpu: CpuLayouts | None = None) -> str:
    """By how much the weights miss, and what would fit: more ranks, a smaller weight format, memory, dtype."""
    fmt = weight_footprint(config, model_dtype, tp, quantization, cpu=cpu).format
    name = dtype_name(model_dtype)
    held = name if fmt == name else f"{fmt} (the rest in {name})"
    options = []
    need_tp = _min_tp_that_fits(config, model_dtype, usable, quantization, cpu)
    if need_tp:
        per_rank = weight_bytes(config, model_dtype, need_tp, quantization, cpu=cpu)
        options.append(f"tensor_parallel_size >= {need_tp} ({_gib(per_rank)} per rank)")
    for q in _smaller_formats(config, quantization):
        smaller = weight_bytes(config, model_dtype, tp, q, cpu=cpu)
        if smaller <= usable:
            options.append(f'quantization="{q}" ({_gib(smaller)} per rank)')
        elif (q_tp := _min_tp_that_fits(config, model_dtype, usable, q, cpu)) is not None:
            per_rank = weight_bytes(config, model_dtype, q_tp, q, cpu=cpu)
            options.append(f'quantization="{q}" with tensor_parallel_size >= {q_tp} ({_gib(per_rank)} per rank)')
    if model_dtype == torch.float32 and quantization is None:
        options.append("a smaller dtype (dtype='bfloat16' halves the float weights)")
    fits = "; ".join(options) if options else f"none of int8, int4 or up to {config.num_attention_heads} ranks"
    return (f"model weights do not fit: {weights:,} B ({_gib(weights)}) per rank in {held} at "
            f"tensor_parallel_size={tp}, but only {usable:,} B "
            f"({_gib(usable)}) of {device_memory_bytes:,} B are usable at memory_utilization="
            f"{memory_utilization} — short by {weights - usable:,} B ({_gib(weights - usable)}). "
            f"Use more device memory, or what fits: {fits}")


def _activations_that_fit(config: ModelConfig, dtype: torch.dtype, max_num_batched_tokens: int, max_num_seqs: int,
                          tp: int, weights: int, usable: int) -> int:
    """The activation reserve, or a ``ValueError`` saying by how much it and the weights exceed ``usable``."""
    activations = activation_reserve_bytes(config, dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
                                           max_num_seqs=max_num_seqs, tensor_parallel_size=tp)
    if weights + activations > usable:
        raise ValueError(
            f"weights ({weights:,} B) plus the activation reserve ({activations:,} B for "
            f"max_num_batched_tokens={max_num_batched_tokens}) exceed the {usable:,} B usable per rank by "
            f"{weights + activations - usable:,} B: lower max_num_batched_tokens or max_num_seqs, or add "
            f"memory / tensor parallelism")
    return activations


def plan_memory(config: ModelConfig, *, dtype: str | torch.dtype, cache_dtype: str | torch.dtype = "auto",
                device_memory_bytes: int, memory_utilization: float = 0.92, max_seq_len: int,
                max_num_seqs: int, block_size: int = 64, max_num_batched_tokens: int | None = None,
                tensor_parallel_size: int = 1, latent_cache_layout: str = "replicated",
                disk_bytes: int | None = None, quantization: str | None = None,
                host_bytes: int | None = None, cpu: CpuLayouts | None = None) -> MemoryPlan:
    """Split one rank's ``device_memory_bytes`` into weights, activations and latent cache blocks.

    The weights are what the rank holds once loaded (``weight_footprint``): ``quantization`` ``int8``/``int4``/``fp8``
    for weight-only quantised products, an FP8 checkpoint's products in its FP8 blocks without it. ``cpu``: a CPU's
    probed layouts (``KernelPlan.layouts``) add the float weights' second layout; None (a GPU): none.

    Raises ``ValueError`` naming the argument for bad input, and when weights (plus the activation
    reserve) do not fit, saying by how much and what to change. ``disk_bytes``: the disk tier's bound, and
    ``host_bytes``: the host-RAM tier's size per rank, whose capacities in tokens the plan then reports.
    """
    checkpoint_dtype = resolve_model_dtype(dtype, config)
    model_dtype = checkpoint_dtype if cpu is None else cpu.dtype
    quantization = check_weight_quantization(quantization)
    cache = resolve_cache_dtype(cache_dtype, auto_cache_dtype(dtype, checkpoint_dtype, model_dtype, quantization))
    _check_plan_args(config, memory_utilization, latent_cache_layout, tensor_parallel_size,
                     device_memory_bytes=device_memory_bytes, max_seq_len=max_seq_len, max_num_seqs=max_num_seqs,
                     block_size=block_size)
    tp = tensor_parallel_size
    if max_num_batched_tokens is None:
        max_num_batched_tokens = default_max_num_batched_tokens(max_seq_len, max_num_seqs)
    usable = math.floor(device_memory_bytes * memory_utilization)
    footprint = weight_footprint(config, model_dtype, tp, quantization, cpu=cpu,
                                 latent_cache_layout=latent_cache_layout)
    weights = footprint.total
    if weights > usable:
        raise ValueError(_weights_do_not_fit(config, model_dtype, tp, weights, usable, device_memory_bytes,
                                             memory_utilization, quantization, cpu))
    activations = _activations_that_fit(config, model_dtype, max_num_batched_tokens, max_num_seqs, tp, weights,
                                        usable)
    budget = usable - weights - activations
    latent = latent_bytes_per_token(config, cache.dtype, model_dtype)
    holders = tp if latent_cache_layout == "sharded" else 1  # ranks that split the tokens between them
    num_blocks = budget // (latent * block_size)
    blocks_per_sequence = -(-max_seq_len // block_size)
    disk_file_bytes, disk_tokens = (0, 0) if disk_bytes is None else disk_tier_capacity(
        disk_bytes, latent, block_size, holders)
    return MemoryPlan(
        dtype=model_dtype, cache_dtype=cache, block_size=block_size, tensor_parallel_size=tp,
        latent_cache_layout=latent_cache_layout, max_seq_len=max_seq_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, device_memory_bytes=device_memory_bytes,
        memory_utilization=memory_utilization, usable_bytes=usable,
        parameter_count=parameter_count(config), weight_bytes=weights,
        total_weight_bytes=weight_bytes(config, model_dtype, 1, quantization, cpu=cpu),
        activation_bytes=activations,
        cache_budget_bytes=budget, latent_bytes_per_token=latent,
        cache_bytes_per_token_per_rank=latent / holders,
        mha_bytes_per_token=mha_bytes_per_token(config, cache.dtype),
        num_blocks=num_blocks, max_tokens=num_blocks * block_size * holders,
        max_sequences=num_blocks * holders // blocks_per_sequence, blocks_per_sequence=blocks_per_sequence,
        disk_bytes=disk_bytes, disk_file_bytes=disk_file_bytes, disk_capacity_tokens=disk_tokens,
        host_bytes=host_bytes,
        host_capacity_tokens=0 if host_bytes is None else host_tier_capacity(host_bytes, latent / holders, block_size),
        weights=footprint,
    )


# -- the load's memory check ----------------------------------------------------------------------
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
                     latent_rank: int | None = None, cpu: CpuLayouts | None = None) -> LoadRequirement:
    """The bytes one rank needs to load ``config``'s checkpoint (the worker's settings) and start:

        weights     the loaded weights (``weight_footprint``, with ``cpu``: the probed layouts of a CPU ``device``)
        transient   the load's peak on top of them: the largest checkpoint tensor it converts (its part on this
                    rank; an FP8 one loaded dequantised is read whole) as float32, + ``LOAD_MARGIN_CPU_BYTES`` on a CPU
        activations the reserve for one step (``activation_reserve_bytes``)
        cache       ``kv_cache_memory`` when set, else one sequence of ``max_model_len`` tokens (whole blocks): the
                    least cache the engine starts with

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
    cache = kv_cache_memory if kv_cache_memory is not None else \
        -(-max_model_len // block_size) * block_size * per_token
    return LoadRequirement(weights, transient, activations, cache, per_token, block_size, max_model_len,
                           kv_cache_memory is not None)


def check_load_memory(config: ModelConfig, available_bytes: int, settings: dict[str, Any], where: str = ""
                      ) -> LoadRequirement:
    """``load_requirement(config, **settings)``, checked against the ``available_bytes`` the rank can have: an
    ``errors.InsufficientMemory`` (a ``ValueError``) when it needs more, saying how much, of what, and which settings
    would fit (``quantization="int8"`` / ``"int4"``, more tensor-parallel ranks, a lower ``max_model_len`` or
    ``kv_cache_memory``), each with what it needs. ``where``: the memory's name for the message."""
    from mla_runtime.errors import InsufficientMemory

    need = load_requirement(config, **settings)
    if need.total <= available_bytes:
        return need
    w = need.weights
    margin = f" + {_size(LOAD_MARGIN_CPU_BYTES)} margin" if torch.device(settings["device"]).type == "cpu" else ""
    cache_why = ("kv_cache_memory" if need.kv_cache_memory else
                 f"one sequence of max_model_len={need.max_model_len:,} tokens")
    held = w.format if w.format == dtype_name(w.dtype) else f"{w.format}, the rest in {dtype_name(w.dtype)}"
    parts = (f"weights {_size(need.weight_bytes)} ({held}), load peak "
             f"{_size(need.transient_bytes)} (its largest tensor in float32{margin}), activation reserve "
             f"{_size(need.activation_bytes)}, latent cache {_size(need.cache_bytes)} ({cache_why})")
    options = []
    for q in _smaller_formats(config, check_weight_quantization(settings.get("quantization"))):
        smaller = load_requirement(config, **{**settings, "quantization": q}).total
        if smaller <= available_bytes:
            options.append(f'quantization="{q}" needs {_size(smaller)}')
    tp = settings.get("tensor_parallel_size", 1)
    for more in range(tp + 1, config.num_attention_heads + 1):
        if _tp_splits(config, more):
            per_rank = load_requirement(config, **{**settings, "tensor_parallel_size": more}).total
            if per_rank <= available_bytes:
                options.append(f"tensor_parallel_size={more} needs {_size(per_rank)} per rank, in memory of its own")
                break
    others = need.total - need.cache_bytes
    block = need.cache_bytes_per_token * need.block_size
    if others + block <= available_bytes:
        if need.kv_cache_memory:
            options.append(f"kv_cache_memory <= {_size(available_bytes - others)}")
        else:
            tokens = (available_bytes - others) // block * need.block_size
            options.append(f"max_model_len <= {tokens:,} (the cache takes {_size(1000 * need.cache_bytes_per_token)} "
                           f"per 1,000 tokens)")
    fits = "; ".join(options) if options else "none of int8, int4, more tensor-parallel ranks or a shorter context"
    raise InsufficientMemory(
        f"not enough memory to load the model{' on ' + where if where else ''}: it needs {_size(need.total)} "
        f"({need.total:,} B: {parts}) but {_size(available_bytes)} ({available_bytes:,} B) are available. "
        f"Settings that fit: {fits}", need.total, available_bytes)


# -- byte strings and the report -------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _size(n: float) -> str:
    """GiB from 1 GiB up, else MiB or KiB (two decimals)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n / 2**10:,.2f} KiB"


def _row(label: str, value: str, note: str = "") -> str:
    return f"  {label:<36}{value:>20}{'  ' + note if note else ''}"


def format_per_token(config: ModelConfig, cache: CacheDtype, tensor_parallel_size: int = 1,
                     latent_cache_layout: str = "replicated") -> list[str]:
    """Report lines for the cache cost of one token: latent, per rank when sharded, MHA, saving."""
    layers, tp = config.num_attention_layers, tensor_parallel_size  # cache layers: a LongCat layer has two
    latent = latent_bytes_per_token(config, cache.dtype)
    mha = mha_bytes_per_token(config, cache.dtype)
    per_layer = (f"({config.latent_dim} x {cache.element_bytes} B + {cache.scale_bytes} B scales)"
                 if cache.quantized else f"{config.latent_dim} values x {cache.element_bytes} B")
    index = index_bytes_per_token(config.index_dim, index_cache_dtype(cache.dtype, resolve_model_dtype("auto", config)))
    if index:
        per_layer = f"({per_layer} + {index} B indexer key)"
    lines = [_row("latent cache per token", f"{latent:,} B", f"= {per_layer} x {layers} layers")]
    if latent_cache_layout == "sharded" and tp > 1:
        lines.append(_row("latent cache per token per rank", f"{latent / tp:,.1f} B",
                          f"(each token on one of {tp} ranks)"))
    return lines + [
        _row("un-absorbed MHA cache per token", f"{mha:,} B",
             f"= {config.num_attention_heads} heads x {config.qk_head_dim + config.v_head_dim} x {layers} "
             f"layers x {cache.element_bytes} B"),
        _row("absorption saving", f"{mha / latent:,.2f}x", "smaller cache per token than MHA"),
    ]


def _blocks_note(config: ModelConfig) -> str:
    k = config.attention_blocks_per_layer
    return "" if k == 1 else f" of {k} attention blocks"


def format_report(plan: MemoryPlan, config: ModelConfig, model: str = "") -> str:
    """A readable, operator-facing account of the plan (what the CLI prints)."""
    tp = plan.tensor_parallel_size

    def bytes_row(label: str, n: int, note: str = "") -> str:
        return _row(label, f"{n:,} B", f"{_gib(n):>13}" + (f"  {note}" if note else ""))

    w = plan.weights
    fmt = w.format if w is not None else dtype_name(plan.dtype)
    parts = [] if w is None else [bytes_row(f"  {label}", n) for label, n in (
        ("quantised matrices + scales", w.quantized_bytes),
        (f"in {dtype_name(w.dtype)} (embedding, kv_b...)", w.float_bytes),
        ("absorbed copies (w_uk, w_uv_t)", w.absorbed_bytes),
        ("CPU-only copies (packed layouts)", w.packed_bytes)) if n]

    lines = [
        f"Memory plan for {model or config.model_type} ({config.model_type}: {config.num_hidden_layers} "
        f"layers{_blocks_note(config)}, {config.num_attention_heads} heads, d_c={config.d_c}, d_r={config.d_r}, "
        f"{plan.parameter_count:,} parameters)",
        f"  model dtype {dtype_name(plan.dtype)}, weights {fmt}, cache dtype {plan.cache_dtype.name}, block size "
        f"{plan.block_size}, tensor parallel {tp} ({plan.latent_cache_layout} latent cache)",
        "",
        bytes_row("device memory per rank", plan.device_memory_bytes),
        bytes_row(f"usable at utilization {plan.memory_utilization}", plan.usable_bytes),
        bytes_row("weights per rank", plan.weight_bytes,
                  f"(total {plan.total_weight_bytes:,} B)" if tp > 1 else ""),
        *parts,
        bytes_row("activation reserve", plan.activation_bytes,
                  f"({plan.max_num_batched_tokens:,} batched tokens, {plan.max_num_seqs:,} seqs)"),
        bytes_row("latent cache budget", plan.cache_budget_bytes),
        "",
        *format_per_token(config, plan.cache_dtype, tp, plan.latent_cache_layout),
        "",
        _row("blocks per rank", f"{plan.num_blocks:,}",
             f"x {plan.block_size} tokens ({_gib(plan.cache_bytes)} allocated)"),
        _row("tokens that fit", f"{plan.max_tokens:,}"),
        _row(f"sequences of {plan.max_seq_len:,} tokens that fit", f"{plan.max_sequences:,}"),
    ]
    if plan.host_bytes is not None:
        lines.append(_row("host tier: tokens that fit", f"{plan.host_capacity_tokens:,}",
                          f"in {plan.host_bytes:,} B ({_gib(plan.host_bytes)}) of host RAM per rank"))
    if plan.disk_bytes is not None:
        lines.append(_row("disk tier: tokens that fit", f"{plan.disk_capacity_tokens:,}",
                          f"in {plan.disk_bytes:,} B ({_gib(plan.disk_bytes)}), {plan.disk_file_bytes:,} B per "
                          f"block of {plan.block_size} on disk"))
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    needed = plan.max_num_seqs * plan.blocks_per_sequence
    lines += ["", f"  requested {plan.max_num_seqs:,} x {plan.max_seq_len:,} tokens: {verdict} "
              f"(needs {needed:,} blocks of {plan.block_size} tokens, the cache holds "
              f"{plan.max_tokens // plan.block_size:,})"]
    if not plan.fits:
        lines.append(f"  to fit: --max-num-seqs {plan.max_sequences:,} at {plan.max_seq_len:,} tokens, or "
                     f"--max-seq-len {_fitting_len(plan):,} for {plan.max_num_seqs:,} sequences; or more memory "
                     "(--device-memory, --tensor-parallel-size), a smaller --cache-dtype or --quantization")
    return "\n".join(lines)


def _fitting_len(plan: MemoryPlan) -> int:
    """A sequence length (whole blocks) of which ``plan.max_num_seqs`` fit this plan's cache; a shorter length also
    shrinks the activation reserve, so it fits with room to spare."""
    return plan.max_tokens // plan.block_size // plan.max_num_seqs * plan.block_size


def build_parser(prog: str = "python -m mla_runtime.plan") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, formatter_class=DefaultsHelpFormatter,
                                     description="Plan how one rank's memory splits into weights, activations "
                                                 "and latent cache blocks. Exits 1 when the cache cannot hold the "
                                                 "sequences, 2 when the weights alone do not fit (or on bad input).")
    parser.add_argument("--model", required=True, help="checkpoint dir, config.json, or preset name "
                                                       "(" + ", ".join(sorted(p.stem for p in
                                                                             PRESET_DIR.glob("*.json"))) + ")")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="tokens per sequence (default: the model's max_position_embeddings)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences that must fit at once")
    parser.add_argument("--device-memory", type=parse_bytes, required=True,
                        help="memory of one device, e.g. 80GiB, 141GB, 1.5e11")
    parser.add_argument("--memory-utilization", type=float, default=0.92, help="fraction of it the runtime uses")
    parser.add_argument("--dtype", default="auto", choices=["auto", *MODEL_DTYPES], help="weight dtype")
    parser.add_argument("--cache-dtype", default="auto", choices=list(CACHE_DTYPES), help="latent-cache dtype")
    parser.add_argument("--quantization", default="none", choices=["none", *WEIGHT_QUANTIZATIONS],
                        help="weight-only quantisation of the model's matrices (none: the checkpoint's own format, "
                             "an FP8 checkpoint's FP8 blocks)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="cpu: also count the second layout this machine's CPU products keep of the float "
                             "weights, and pick dtype auto as a CPU load does (default: no particular machine)")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per cache block")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one step (default: max-seq-len capped at 8192, at least 2048)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the model is sharded across")
    parser.add_argument("--latent-cache-layout", default="replicated", choices=list(LATENT_CACHE_LAYOUTS),
                        help="sharded: each token's latent on one rank")
    parser.add_argument("--kv-cache-disk-bytes", type=parse_bytes, default=None,
                        help="the disk tier's bound, e.g. 1TB: show how many tokens of prefix it holds")
    parser.add_argument("--kv-cache-host-bytes", type=parse_bytes, default=None,
                        help="the host-RAM tier per rank, e.g. 256GiB: show how many tokens of prefix it holds")
    return parser


def _probed_cpu(dtype: str, config: ModelConfig, quantization: str | None) -> tuple[CpuLayouts, str | None]:
    """``--device cpu``: this CPU's probes and the products' format, as a model loaded here would run them (the
    planner's facts)."""
    from mla_runtime.kernel_plan import kernel_plan, resolve_cpu_format

    stored, plan = quantization or config.stored_quantization, kernel_plan()
    model_dtype, chosen = resolve_cpu_format(dtype, resolve_model_dtype(dtype, config), stored, plan)
    return plan.layouts(model_dtype), quantization if chosen == stored else chosen


def main(argv: Sequence[str] | None = None, prog: str = "python -m mla_runtime.plan") -> int:
    """Print the plan; 0 when the requested sequences fit, 1 when they do not, 2 on bad input."""
    args = build_parser(prog).parse_args(argv)
    try:
        config = ModelConfig.from_pretrained(args.model)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    note = ""
    try:
        cpu, quantization = _probed_cpu(args.dtype, config, check_weight_quantization(args.quantization)) \
            if args.device is not None and torch.device(args.device).type == "cpu" else (None, args.quantization)

        def planned(layouts: CpuLayouts | None) -> MemoryPlan:
            return plan_memory(
                config, dtype=args.dtype, cache_dtype=args.cache_dtype, device_memory_bytes=args.device_memory,
                memory_utilization=args.memory_utilization,
                max_seq_len=args.max_seq_len or config.max_position_embeddings, max_num_seqs=args.max_num_seqs,
                block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                tensor_parallel_size=args.tensor_parallel_size, latent_cache_layout=args.latent_cache_layout,
                disk_bytes=args.kv_cache_disk_bytes, quantization=quantization, host_bytes=args.kv_cache_host_bytes,
                cpu=layouts)

        try:
            plan = planned(cpu)
        except ValueError:
            # as the engine does: where the weights fit only without their second layouts, it loads them so
            lean = None if cpu is None else cpu.with_one_layout()
            if lean is None:
                raise
            plan = planned(lean)
            note = ("  (each weight in one layout: with oneDNN's blocked copies or AMX tiles the weights do not "
                    "fit, and the engine leaves them out)")
    except ValueError as e:
        try:  # the per-token cost does not depend on memory: still worth showing
            cache = resolve_cache_dtype(args.cache_dtype, resolve_model_dtype(args.dtype, config))
            print(f"Cache cost per token for {args.model} (no plan: see the error below)")
            print("\n".join(format_per_token(config, cache, args.tensor_parallel_size,
                                             args.latent_cache_layout)))
        except ValueError:
            pass
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(format_report(plan, config, args.model) + (f"\n{note}" if note else ""))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
