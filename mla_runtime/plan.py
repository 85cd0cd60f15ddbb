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

import math
import sys
from dataclasses import dataclass

import torch

from mla_runtime.cache.disk_tier import HEADER_ESTIMATE_BYTES
from mla_runtime.config import ModelConfig
from mla_runtime.dtypes import (
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
from mla_runtime.kernel_plan import CpuLayouts
from mla_runtime.options import LATENT_CACHE_LAYOUTS  # defined without torch

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
def tp_splits(config: ModelConfig, tp: int) -> bool:
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
                             tensor_parallel_size: int = 1, residual_streams: int = 0) -> int:
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

    A model with ``residual_streams`` hyper-connection streams (DeepSeek-V4's and its relatives' ``hc_mult``; 0
    without) also keeps ``T·streams·d·b`` for them.

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
    per_token = b * (2 * d + max(widths) + residual_streams * d) + router
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
    state_bytes_per_sequence: int = 0  # a hybrid's linear-attention states of one sequence (0: not a hybrid)
    state_snapshots: int = 0  # a hybrid's state snapshots for prefix caching (state_snapshot_memory)

    @property
    def state_bytes(self) -> int:
        """A hybrid's state slots, one per sequence of ``max_num_seqs``, beside the latent cache."""
        return self.state_bytes_per_sequence * self.max_num_seqs

    @property
    def state_snapshot_bytes(self) -> int:
        return self.state_bytes_per_sequence * self.state_snapshots

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
        if tp_splits(config, tp) and weight_bytes(config, dtype, tp, quantization, cpu=cpu) <= usable:
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


def smaller_formats(config: ModelConfig, quantization: str | None) -> list[str]:
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
        options.append(f"tensor_parallel_size >= {need_tp} ({gib(per_rank)} per rank)")
    for q in smaller_formats(config, quantization):
        smaller = weight_bytes(config, model_dtype, tp, q, cpu=cpu)
        if smaller <= usable:
            options.append(f'quantization="{q}" ({gib(smaller)} per rank)')
        elif (q_tp := _min_tp_that_fits(config, model_dtype, usable, q, cpu)) is not None:
            per_rank = weight_bytes(config, model_dtype, q_tp, q, cpu=cpu)
            options.append(f'quantization="{q}" with tensor_parallel_size >= {q_tp} ({gib(per_rank)} per rank)')
    if model_dtype == torch.float32 and quantization is None:
        options.append("a smaller dtype (dtype='bfloat16' halves the float weights)")
    fits = "; ".join(options) if options else f"none of int8, int4 or up to {config.num_attention_heads} ranks"
    return (f"model weights do not fit: {weights:,} B ({gib(weights)}) per rank in {held} at "
            f"tensor_parallel_size={tp}, but only {usable:,} B "
            f"({gib(usable)}) of {device_memory_bytes:,} B are usable at memory_utilization="
            f"{memory_utilization} — short by {weights - usable:,} B ({gib(weights - usable)}). "
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
                host_bytes: int | None = None, cpu: CpuLayouts | None = None,
                state_snapshots: int | None = None) -> MemoryPlan:
    """Split one rank's ``device_memory_bytes`` into weights, activations and latent cache blocks.

    The weights are what the rank holds once loaded (``weight_footprint``): ``quantization`` ``int8``/``int4``/``fp8``
    for weight-only quantised products, an FP8 checkpoint's products in its FP8 blocks without it. ``cpu``: a CPU's
    probed layouts (``KernelPlan.layouts``) add the float weights' second layout; None (a GPU): none.

    Raises ``ValueError`` naming the argument for bad input, and when weights (plus the activation reserve) do not
    fit, saying by how much and what to change. ``disk_bytes``: the disk tier's bound, and ``host_bytes``: the
    host-RAM tier's size per rank, whose capacities in tokens the plan then reports. ``state_snapshots``: a hybrid's
    state snapshots for prefix caching (default the engine's, one per sequence)."""
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
    activations = _activations_that_fit(config, model_dtype, max_num_batched_tokens, max_num_seqs, tp, weights, usable)
    snapshots = max_num_seqs if state_snapshots is None and config.state_bytes_per_sequence else state_snapshots or 0
    budget = usable - weights - activations - config.state_bytes_per_sequence * (max_num_seqs + snapshots)  # hybrids
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
        total_weight_bytes=weight_bytes(config, model_dtype, 1, quantization, cpu=cpu), activation_bytes=activations,
        cache_budget_bytes=budget, latent_bytes_per_token=latent,
        cache_bytes_per_token_per_rank=latent / holders,
        mha_bytes_per_token=mha_bytes_per_token(config, cache.dtype),
        num_blocks=num_blocks, max_tokens=num_blocks * block_size * holders,
        max_sequences=num_blocks * holders // blocks_per_sequence, blocks_per_sequence=blocks_per_sequence,
        disk_bytes=disk_bytes, disk_file_bytes=disk_file_bytes, disk_capacity_tokens=disk_tokens,
        host_bytes=host_bytes, state_bytes_per_sequence=config.state_bytes_per_sequence, state_snapshots=snapshots,
        host_capacity_tokens=0 if host_bytes is None else host_tier_capacity(host_bytes, latent / holders, block_size),
        weights=footprint,
    )


def gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


if __name__ == "__main__":
    from mla_runtime.plan_cli import main

    sys.exit(main())
