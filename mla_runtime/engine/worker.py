"""``Worker``: one rank's model and latent cache, and the steps it runs.

Every place that runs the model builds it the same way — the engine's own rank, each tensor-parallel rank,
and the latent-rank sweep:

1. ``Worker(config, par)`` finds the checkpoint (a folder, or a hub repo id it downloads), reads its config
   (with the latent rank applied), picks the device and the weight and cache dtypes;
2. ``load()`` loads this rank's shard of the weights, once ``check_memory()`` has found that the memory this rank can
   have holds them, the load's peak, the activation reserve and the least cache (before any weight is read);
3. ``truncate_latent(calibration)`` folds the latent-rank basis into the weights (when ``latent_rank`` is set);
   with ``quantization`` the products were quantised as they streamed in (``loader``), and the absorbed factors
   are rounded after truncation (``layers.quantization.finish_quantization``), once, before the cache is sized:
   by the first ``num_blocks()`` or ``allocate()``;
4. ``num_blocks()`` sizes the paged cache by the planner's rule (``plan.cache_budget_bytes``), fed the memory
   free at that moment;
5. ``allocate(num_blocks)`` allocates the cache; ``open_lower_tier()`` then opens this rank's lower tiers of the
   prefix cache: the disk tier when ``kv_cache_dir`` is set, and the host-RAM tier over it (by default on CUDA, or
   with ``kv_cache_host_bytes``) — on rank 0 alone under the replicated layout; every rank, for its shard, under
   the sharded one;
6. ``execute(step)`` runs one ``StepInput``: builds the ``ForwardBatch`` and runs ``forward`` over it (the attention
   metadata, then the model), and returns the logits of the requested rows (None on ranks other than 0); a pure
   decode step goes to the decode graphs instead when the engine plugged them in at start-up (``graphs``:
   ``engine/cuda_graphs.py``), which run the same ``forward`` over their static buffers;
7. with ``speculative_method="mtp"``, ``draft(d)`` then runs the checkpoint's MTP layer over the step's
   positions (a ``DraftInput``) and chains it into draft tokens (``engine/mtp.py`` describes the scheme).

A ``StepInput`` is plain integer lists, so it is also the compact message rank 0 sends each tensor-parallel
rank per step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mla_runtime import attention, checksums, env, host_heap
from mla_runtime.attention import AttentionMetadata
from mla_runtime.cache.disk_tier import DiskTier, file_sha256, model_fingerprint
from mla_runtime.cache.host_tier import HostTier
from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.cache.state_cache import StateCache, StateSlots, StateSnapshots
from mla_runtime.config import ModelConfig
from mla_runtime.dtypes import CacheDtype, auto_cache_dtype, index_cache_dtype, resolve_cache_dtype
from mla_runtime.engine.config import EngineConfig
from mla_runtime.errors import InsufficientMemory, InvalidParam
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.hub import resolve_model
from mla_runtime.kernel_plan import OFF_CPU, CpuLayouts, KernelPlan, kernel_plan, resolve_cpu_format
from mla_runtime.latent_rank import check_latent_rank, truncate_latent_rank
from mla_runtime.layers.quantization import finish_quantization
from mla_runtime.load_check import check_load_memory, load_requirement
from mla_runtime.loader import load_resolved
from mla_runtime.models.deepseek import DeepseekForCausalLM
from mla_runtime.parallel import SINGLE_RANK, ParallelContext, check_tensor_parallel
from mla_runtime.plan import (
    activation_reserve_bytes,
    cache_budget_bytes,
    cache_num_blocks,
    default_max_num_batched_tokens,
    latent_bytes_per_token,
    resolve_model_dtype,
    weight_bytes,
)
from mla_runtime.resolved_config import ResolvedConfig
from mla_runtime.token_map import resolve_token_map

logger = logging.getLogger("mla_runtime")


@dataclass(frozen=True)
class StepInput:
    """One step as plain lists, in the order the model runs the sequences."""

    token_chunks: list[list[int]]  # new tokens of each sequence (a prefill chunk, a decode, a decode + drafts)
    context_lens: list[int]  # tokens of each sequence already in the cache
    block_tables: list[list[int]]  # block ids of each sequence
    logit_rows: list[int]  # rows of the step's new tokens whose logits are needed
    state_slots: list[int] | None = None  # a hybrid model's state slot of each sequence (None: no linear layers)
    # a hybrid's prefix hits: (snapshot, slot) copied before the step; (sequence, tokens, snapshot): the states
    # after that many of the sequence's new tokens written to the snapshot (``cache/state_cache.py``)
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    # state slots rank 0 gave back, and state snapshots it freed, since the last step: every other rank drops them
    # before the step (models whose every rank holds every state: DeepSeek-V4)
    state_releases: list[int] = field(default_factory=list)
    snapshot_drops: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class DraftInput:
    """The MTP layer's part of a step, as plain lists (see ``engine/mtp.py``). The MTP pass runs over the rows of
    the last ``execute`` (same positions, slots and attention metadata), each fed the token after its position;
    per sequence: the row of its last kept position, the position after it and how many drafts to chain from it
    (0: only the latents)."""

    token_ids: list[int]  # one per row of the last step, in its order (past a sequence's last kept row: any)
    last_rows: list[int]
    next_positions: list[int]
    block_tables: list[list[int]]
    num_drafts: list[int]


class DecodeGraphRunner(Protocol):
    """Pure decode steps through CUDA graphs (``engine/cuda_graphs.DecodeGraphs``, plugged in by the engine at
    start-up): ``run`` returns the hidden states of the step's rows, or None for a step it does not take."""

    def run(self, step: StepInput) -> torch.Tensor | None: ...


def available_host_memory() -> int:
    """Bytes of RAM available now (``MemAvailable``), or half the physical RAM where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2



def sequence_limits(config: EngineConfig, max_positions: int) -> tuple[int, int]:
    """``(max_model_len, max_num_batched_tokens)`` of ``config`` for a model of ``max_positions`` positions (its
    own where the config leaves them 0); a longer ``max_model_len`` is refused."""
    max_model_len = config.max_model_len or max_positions
    if max_model_len > max_positions:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                         f"({max_positions})")
    return max_model_len, config.max_num_batched_tokens or default_max_num_batched_tokens(max_model_len,
                                                                                          config.max_num_seqs)

class Worker:
    # whether a prefix hit's sequence keeps its own copy of the prefix's rows (a state of its own, the models over
    # state slots: ``V4Worker``) and so holds fresh blocks for them (``Scheduler.own_prefix_copies``); the paged
    # latent cache shares the cached ones
    own_prefix_copies = False

    def __init__(self, config: EngineConfig, par: ParallelContext = SINGLE_RANK) -> None:
        self.config = config
        self.par = par
        self.model_path = resolve_model(config.model, config.revision)  # a hub repo id -> its local snapshot
        cfg = self.checkpoint_config = ModelConfig.from_pretrained(self.model_path)  # what the load reads
        if config.latent_rank is not None:
            check_latent_rank(config.latent_rank, cfg.kv_lora_rank)
            cfg = cfg.with_overrides(kv_lora_rank=config.latent_rank)  # the cache's d_c
        self.model_config = cfg
        check_hybrid_settings(config, cfg)
        # the weights' format: the one asked for, or the one a pre-quantised checkpoint is stored in
        self.quantization = config.quantization or cfg.stored_quantization
        self.num_mtp_layers = 1 if config.speculative_method == "mtp" else 0
        if self.num_mtp_layers > cfg.num_nextn_predict_layers:
            raise InvalidParam("speculative_method", f"speculative_method 'mtp' needs a checkpoint with a "
                               f"multi-token-prediction layer; {self.model_path} has num_nextn_predict_layers = "
                               f"{cfg.num_nextn_predict_layers}: use speculative_method 'prompt_lookup'")
        tp = config.tensor_parallel_size
        check_tensor_parallel(cfg, tp, config.block_size, config.latent_cache_layout)
        self.device = rank_device(config.device, tp, par.rank)
        self.dtype = resolve_model_dtype(config.dtype, cfg)
        # what computes the products (``kernel_plan``): on a CPU its probes under the cpu_gemm setting, resolved once;
        # the dtype "auto" keeps there follows from it, and every weight is prepared against it
        self.plan: KernelPlan = kernel_plan(config.cpu_gemm or "auto") if self.device.type == "cpu" else OFF_CPU
        self.heap = ""  # what the CPU heap keeps between steps (host_heap.py), for EngineInfo (CPU only)
        checkpoint_dtype = self.dtype
        if self.device.type == "cpu":
            self.dtype, self.quantization = resolve_cpu_format(config.dtype, self.dtype, self.quantization, self.plan)
        self.cache_dtype: CacheDtype = resolve_cache_dtype(
            config.kv_cache_dtype, auto_cache_dtype(config.dtype, checkpoint_dtype, self.dtype, self.quantization))
        self.max_model_len, self.max_num_batched_tokens = sequence_limits(config, cfg.max_position_embeddings)
        # what the model is built from: the checkpoint's shape and the settings resolved for this machine, once
        self.resolved = ResolvedConfig(
            self.checkpoint_config, self.dtype, self.device, par, attention.resolve(config.attention_backend,
                                                                                     self.device),
            config.attention_path, self.num_mtp_layers, self.quantization, self.cache_dtype, config.block_size,
            self.max_model_len, self.max_num_batched_tokens, config.max_num_seqs, self.plan,
            config.batch_invariant)
        self._size()
        self.model: DeepseekForCausalLM | None = None
        self.cache: LatentCache | None = None
        # the last step's batch, attention metadata and hidden states, for the MTP layer's pass over the same rows
        self.last_step: tuple[ForwardBatch, AttentionMetadata, torch.Tensor] | None = None
        self.quantized = False  # the model's weights are quantised (config.quantization): no more truncation
        self.weights_fingerprint: str | None = None  # from the sha256 manifest (None: the folder has none)
        self.disk_tier: DiskTier | None = None
        self.host_tier: HostTier | None = None
        self.graphs: DecodeGraphRunner | None = None  # set at start-up where decode steps run as CUDA graphs

    def _size(self) -> None:
        """The planner's byte counts of this rank: a token's latent, the weights, the activations' reserve."""
        config, cfg, tp = self.config, self.model_config, self.config.tensor_parallel_size
        self.bytes_per_token = latent_bytes_per_token(cfg, self.cache_dtype.dtype, self.dtype, self.num_mtp_layers)
        sharded = tp > 1 and config.latent_cache_layout == "sharded"
        self.bytes_per_token_per_rank = self.bytes_per_token // tp if sharded else self.bytes_per_token
        # a hybrid's linear layers: a fixed state per running sequence, one slot for each of max_num_seqs
        self.state_bytes_per_sequence = cfg.state_bytes_per_sequence
        self.state_bytes = self.state_bytes_per_sequence * config.max_num_seqs
        self.num_state_snapshots = self._num_state_snapshots()
        self.state_snapshot_bytes = self.state_bytes_per_sequence * self.num_state_snapshots
        self.weight_bytes = weight_bytes(self.checkpoint_config, self.dtype, tp, self.quantization,
                                         cpu=self.cpu, num_mtp_layers=self.num_mtp_layers,
                                         latent_cache_layout=config.latent_cache_layout)
        self.activation_bytes = activation_reserve_bytes(
            cfg, dtype=self.dtype, max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, tensor_parallel_size=tp)

    def _num_state_snapshots(self) -> int:
        """A hybrid's state snapshots for prefix caching: what ``state_snapshot_memory`` holds (default one per state
        slot); 0 without prefix caching or linear-attention layers."""
        c, per = self.config, self.state_bytes_per_sequence
        if not per or not c.enable_prefix_caching:
            return 0
        if c.state_snapshot_memory is None:
            return c.max_num_seqs
        n = int(c.state_snapshot_memory) // per
        if int(c.state_snapshot_memory) and not n:
            raise InvalidParam("state_snapshot_memory", f"state_snapshot_memory ({int(c.state_snapshot_memory):,} B) "
                               f"holds no state snapshot of {per:,} B: give at least that, or 0 for no prefix "
                               f"caching of this hybrid model")
        return n

    @property
    def model_dtype(self) -> torch.dtype:
        """The loaded model's weights and activations dtype."""
        assert self.model is not None
        return self.model.dtype

    @property
    def attention_name(self) -> str:
        """The loaded model's attention backend (``attention/``)."""
        assert self.model is not None
        return self.model.attention.name

    def state_cache_bytes(self) -> int:
        """Bytes of the per-sequence state slots allocated (0: none)."""
        return 0 if self.cache is None or self.cache.states is None else self.cache.states.nbytes()

    def state_snapshot_nbytes(self) -> int:
        """Bytes of the prefix-cache state snapshots allocated (0: none)."""
        return 0 if self.cache is None or self.cache.states is None else self.cache.states.snapshot_nbytes()

    @property
    def cpu(self) -> CpuLayouts | None:
        """The planner's facts about the plan's layouts for this model's weights (None off a CPU)."""
        return self.resolved.cpu

    @property
    def gemm_info(self) -> dict[str, str]:
        """The product paths of the model's weights under the plan, for ``EngineInfo`` (empty off a CPU)."""
        return {} if self.plan is OFF_CPU else self.plan.info(self.dtype)

    # -- set-up ----------------------------------------------------------------------------------
    def check_memory(self) -> None:
        """Refuse a load this rank's memory cannot hold, before any weight is read: ``load_check.check_load_memory``
        against the RAM available (``available_host_memory``) on a CPU, the free device memory on CUDA. Raises
        ``errors.InsufficientMemory`` (a ``ValueError``) with the sizes and the settings that would fit."""
        c = self.config
        on_gpu = self.device.type == "cuda"
        available = torch.cuda.mem_get_info(self.device)[0] if on_gpu else available_host_memory()
        where = f"{self.device} (free device memory)" if on_gpu else "this host (its available RAM)"
        settings: dict[str, Any] = dict(
            dtype=self.dtype, device=self.device, max_model_len=self.max_model_len,
            tensor_parallel_size=c.tensor_parallel_size, quantization=self.quantization,
            num_mtp_layers=self.num_mtp_layers, latent_cache_layout=c.latent_cache_layout,
            cache_dtype=self.cache_dtype.dtype, block_size=c.block_size, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_memory=None if c.kv_cache_memory is None else int(c.kv_cache_memory),
            latent_rank=c.latent_rank, cpu=self.cpu, state_snapshots=self.num_state_snapshots)
        try:
            check_load_memory(self.checkpoint_config, available, settings, where)
        except InsufficientMemory as e:
            # a CPU's second layouts (oneDNN's blocked copies, AMX's tiles) speed up products of many rows a little;
            # where the load fits without them, it goes ahead without them
            lean = None if self.cpu is None else self.cpu.with_one_layout()
            if lean is None:
                raise
            need = load_requirement(self.checkpoint_config, **{**settings, "cpu": lean}).total
            if need > available:
                raise
            logger.warning("the weights keep one layout each (no oneDNN blocked copies or AMX tiles): with them the "
                           "load needs %.2f GiB, without %.2f GiB, and %.2f GiB are available", e.needed / 2**30,
                           need / 2**30, available / 2**30)
            self.use_plan(self.plan.with_one_layout())

    def use_plan(self, plan: KernelPlan) -> None:
        """Prepare the weights for ``plan`` (before the load): the resolved configuration and the weights' bytes
        follow."""
        self.plan = plan
        self.resolved = dataclasses.replace(self.resolved, plan=plan)
        self.weight_bytes = weight_bytes(self.checkpoint_config, self.dtype, self.config.tensor_parallel_size,
                                         self.quantization, cpu=self.cpu, num_mtp_layers=self.num_mtp_layers,
                                         latent_cache_layout=self.config.latent_cache_layout)

    def load(self) -> DeepseekForCausalLM:
        """Load the weights (checked against the checkpoint's sha256 manifest first with ``verify_weights``), once
        ``check_memory`` has found room for them."""
        self.check_memory()
        c = self.config
        if c.verify_weights and self.par.rank == 0:
            t0 = time.monotonic()
            self.weights_fingerprint = checksums.verify(self.model_path)
            logger.info("weights verified against their sha256 manifest in %.1f s", time.monotonic() - t0)
        else:
            self.weights_fingerprint = checksums.manifest_fingerprint(self.model_path)
        self.model = load_resolved(self.model_path, self.resolved)
        if self.num_mtp_layers:
            ids, source = resolve_token_map(c.speculative_token_map, self.model_path, self.model_config.vocab_size)
            self.model.set_draft_vocab(ids)
            if self.par.rank == 0:
                logger.info("MTP draft vocabulary: %s", source)
        return self.model

    @property
    def rows_invariant(self) -> bool:
        """Whether the model's rows must not depend on the batch (``DeepseekForCausalLM.rows_invariant``): the
        scheduler then cuts its prompts into fixed chunks (``Scheduler.chunk_size``)."""
        return bool(getattr(self.model, "rows_invariant", False))

    def truncate_latent(self, calibration: Sequence[Sequence[int]] | None, rank: int | None = None,
                        method: str | None = None) -> None:
        """Cache ``rank`` (default ``latent_rank``) values per token, with the ``method`` (default
        ``latent_projection``) basis; ``calibration``: token chunks for ``pca``, None for ``svd``."""
        rank = rank or self.config.latent_rank
        assert self.model is not None and rank is not None
        if self.quantized:
            raise RuntimeError("truncate_latent: the absorbed factors are already rounded; truncate before sizing "
                               "the cache")
        truncate_latent_rank(self.model, rank, method or self.config.latent_projection, calibration)

    def quantize(self) -> None:
        """Finish the quantisation of the weights (``config.quantization``), once they are final: the products were
        quantised as they loaded; the absorbed factors and a tied head follow truncation (``finish_quantization``).
        Once (later calls do nothing), before the cache is sized."""
        if self.quantized or self.quantization is None:
            return
        assert self.model is not None
        finish_quantization(self.model, self.quantization, self.plan)
        self.quantized = True

    def num_blocks(self) -> int:
        """Cache blocks of ``block_size`` tokens that fit this rank's budget (see ``plan.cache_budget_bytes``)."""
        c = self.config
        self.quantize()
        if c.kv_cache_memory is not None:
            budget = int(c.kv_cache_memory)
        else:
            on_gpu = self.device.type == "cuda"
            free = torch.cuda.mem_get_info(self.device)[0] if on_gpu else available_host_memory()
            # the state slots and snapshots are allocated beside the latent cache
            free = max(0, free - self.state_bytes - self.state_snapshot_bytes)
            budget = cache_budget_bytes(on_gpu=on_gpu, free_bytes=free, activation_bytes=self.activation_bytes,
                                        bytes_per_token=self.bytes_per_token_per_rank, block_size=c.block_size,
                                        max_model_len=self.max_model_len, max_num_seqs=c.max_num_seqs)
        return cache_num_blocks(budget, self.bytes_per_token_per_rank, c.block_size, self.max_model_len)

    def allocate(self, num_blocks: int, cache_dtype: torch.dtype | None = None) -> LatentCache:
        """This rank's latent cache (in ``cache_dtype``, default the configured one), as wide as the model's
        latent: all tokens (replicated) or every N-th token of a block (sharded). It replaces any earlier one."""
        assert self.model is not None
        self.quantize()
        par, cfg = self.par, self.model.config
        block = self.config.block_size // par.world_size if par.sharded_cache else self.config.block_size
        self.cache = None  # free the old cache first
        dtype = cache_dtype or self.cache_dtype.dtype
        self.cache = LatentCache(self.model.num_cache_layers, num_blocks, block, cfg.latent_dim, dtype, self.device,
                                 cfg.index_dim, index_cache_dtype(dtype, self.dtype))
        if cfg.linear_attention is not None:
            self.cache.states = StateCache(cfg.linear_attention, self.config.max_num_seqs, self.device,
                                           self.num_state_snapshots)
            logger.info("hybrid model: %d linear-attention layers keep %.1f KiB of state per sequence (%d slots, "
                        "%.1f MiB); prefix caching: %s", cfg.linear_attention.num_layers,
                        self.state_bytes_per_sequence / 2**10, self.config.max_num_seqs, self.state_bytes / 2**20,
                        f"{self.num_state_snapshots} state snapshots ({self.state_snapshot_bytes / 2**20:.1f} MiB)"
                        if self.prefix_caching else "off (no state snapshot)")
        if self.device.type == "cpu":  # the load's transient buffers are gone: from here on, steps allocate
            self.heap = host_heap.retain(self.activation_bytes, self.config.cpu_heap)
        return self.cache

    @property
    def prefix_caching(self) -> bool:
        """Whether the block pool indexes prefixes: as configured; for a hybrid model only with state snapshots (a
        cached prefix resumes from its linear layers' states at its end)."""
        return self.config.enable_prefix_caching and (self.model_config.linear_attention is None
                                                      or self.num_state_snapshots > 0)

    def check_prompt(self, ids: list[int]) -> None:
        """Refuse a prompt this model cannot run (``InvalidParam``); every prompt here (a multimodal wrapper's
        placeholder tokens are refused by the worker of a model that serves its text model only)."""

    def state_slots(self) -> StateSlots | None:
        """The scheduler's allocator of the state cache's slots (None: the model has no linear layers)."""
        return None if self.model_config.linear_attention is None else StateSlots(self.config.max_num_seqs)

    def take_state_releases(self) -> tuple[list[int], list[int]]:
        """The state slots given back and the state snapshots freed since the last call, for the other ranks
        (``StepInput.state_releases``, ``snapshot_drops``)."""
        return [], []

    def state_snapshots(self) -> StateSnapshots | None:
        """The scheduler's side of a hybrid's state snapshots (None: no linear layers or no prefix caching)."""
        return StateSnapshots(self.num_state_snapshots) if self.num_state_snapshots else None

    def cache_fingerprint(self) -> str:
        """What decides the bytes of a cached latent (``cache/disk_tier.model_fingerprint``): a disk tier written
        under any other value is never read."""
        c = self.config
        calibration = file_sha256(c.latent_calibration) if c.latent_rank and c.latent_projection == "pca" else None
        settings = {"latent_rank": c.latent_rank, "latent_projection": c.latent_projection if c.latent_rank else None,
                    "latent_calibration_sha256": calibration, "dtype": str(self.dtype),
                    "quantization": self.quantization,
                    "cache_dtype": self.cache_dtype.name, "block_size": c.block_size,
                    "tensor_parallel_size": c.tensor_parallel_size,
                    "latent_cache_layout": c.latent_cache_layout if c.tensor_parallel_size > 1 else None}
        return model_fingerprint(self.model_path, settings)

    @property
    def lower_tier(self) -> HostTier | DiskTier | None:
        """The top of this rank's lower tiers: the host tier (over the disk tier, if any), else the disk tier."""
        return self.host_tier if self.host_tier is not None else self.disk_tier

    def open_lower_tier(self) -> HostTier | DiskTier | None:
        """Open this rank's lower tiers of the prefix cache over its cache, on the ranks that keep them (rank 0
        alone under the replicated layout; every rank, for its shard, under the sharded one): the disk tier when
        ``kv_cache_dir`` is set, the host tier over it when ``host_tier_bytes()`` is not 0. Returns the top one."""
        c, par = self.config, self.par
        if (par.rank != 0 and not par.sharded_cache) or not self.prefix_caching:
            return None
        assert self.cache is not None
        if c.kv_cache_dir is not None:
            disk_bytes = c.kv_cache_disk_bytes
            self.disk_tier = DiskTier(c.kv_cache_dir, self.cache_fingerprint(), self.cache, c.block_size,
                                      capacity_bytes=None if disk_bytes is None else int(disk_bytes),
                                      shard=par.rank if par.sharded_cache else None)
        host_bytes = self.host_tier_bytes()
        if host_bytes:
            self.host_tier = HostTier(self.cache, host_bytes, c.block_size, self.disk_tier, c.kv_cache_write_through)
        return self.lower_tier

    def host_tier_bytes(self) -> int:
        """The host tier's bytes on this rank: ``kv_cache_host_bytes``, or by default a quarter of the available RAM
        on CUDA with prefix caching (shared by the ranks of the sharded layout) and none on a CPU, whose cache is
        host RAM already. 0: no host tier."""
        c = self.config
        assert self.cache is not None
        block = self.cache.block_bytes()
        if c.kv_cache_host_bytes is not None:
            n = int(c.kv_cache_host_bytes)
            if 0 < n < block:
                raise InvalidParam("kv_cache_host_bytes", f"kv_cache_host_bytes ({n:,} B) holds no cache block of "
                                   f"{block:,} B: give at least that, or 0 for no host tier")
            return n
        if self.device.type != "cuda" or not c.enable_prefix_caching:
            return 0
        share = available_host_memory() // 4 // (self.par.world_size if self.par.sharded_cache else 1)
        return share if share >= block else 0

    # -- steps -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor | None:
        """Run one step; fp32 logits ``[len(logit_rows), V]`` on rank 0, None elsewhere or without rows."""
        assert self.model is not None and self.cache is not None
        hidden = self.graphs.run(step) if self.graphs is not None else None
        if hidden is None:
            batch = ForwardBatch.build(step.token_chunks, step.context_lens, step.block_tables,
                                       self.config.block_size, self.device, step.state_slots,
                                       self._snapshot_rows(step))
            hidden = self.forward(batch)
        if not step.logit_rows:
            return None
        return self.model.compute_logits(hidden[step.logit_rows])

    def _snapshot_rows(self, step: StepInput) -> list[tuple[int, int, int]]:
        """Restore a hybrid's prefix hits into their slots; the step's snapshots as state-cache rows."""
        if not (step.state_restores or step.state_snapshots):
            return []
        states = self.cache.states if self.cache is not None else None
        assert states is not None
        for snapshot, slot in step.state_restores:
            states.copy_row(states.snapshot_row(snapshot), slot)
        return [(b, n, states.snapshot_row(s)) for b, n, s in step.state_snapshots]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The model over one step's batch: the step's attention metadata, then every layer -> hidden states
        ``[T, d]``. Eager steps and the decode graphs (captured, or their stand-in) run this same function."""
        assert self.model is not None and self.cache is not None
        meta = self.model.attention_metadata(batch, self.cache)
        hidden: torch.Tensor = self.model(batch, self.cache, meta)
        if self.num_mtp_layers:
            self.last_step = batch, meta, hidden
        return hidden

    @torch.inference_mode()
    def draft(self, d: DraftInput) -> list[list[int]]:
        """Run the MTP layer over ``d`` (writing its latents) and chain it into each sequence's drafts; the same
        drafts on every rank."""
        assert self.model is not None and self.cache is not None and self.last_step is not None
        model, cache, bs = self.model, self.cache, self.config.block_size
        batch, meta, hidden = self.last_step
        self.last_step = None
        ids = torch.tensor(d.token_ids, dtype=torch.long, device=self.device)
        out = model.mtp_forward(batch, cache, hidden, meta, input_ids=ids)
        drafts: list[list[int]] = [[] for _ in d.num_drafts]
        active = [b for b, k in enumerate(d.num_drafts) if k > 0]
        if not active:
            return drafts
        out = out[torch.tensor([d.last_rows[b] for b in active], device=self.device)]  # last kept positions
        ends = [d.next_positions[b] for b in active]  # the first draft's position
        while True:
            for b, t in zip(active, model.mtp_greedy(out).tolist()):
                drafts[b].append(t)
            keep = [i for i, b in enumerate(active) if len(drafts[b]) < d.num_drafts[b]]
            if not keep:
                return drafts
            active, out = [active[i] for i in keep], out[keep]
            # the next link: the last draft at its own position, continuing from the layer's output
            batch = ForwardBatch.build([[drafts[b][-1]] for b in active],
                                       [ends[keep[j]] + len(drafts[b]) - 1 for j, b in enumerate(active)],
                                       [d.block_tables[b] for b in active], bs, self.device)
            ends = [ends[i] for i in keep]
            out = model.mtp_forward(batch, cache, out)


def check_hybrid_settings(config: EngineConfig, cfg: ModelConfig) -> None:
    """Refuse, by name, the settings a hybrid model (linear-attention layers) does not run with: its layers' states
    are advanced by every token a step computes, so drafts to verify are not possible; its prefix cache keeps state
    snapshots in memory only, so it has no prefix-cache tiers; it runs on one rank, and its latent rank is not
    truncated."""
    if cfg.linear_attention is None:
        return
    refused = {"tensor_parallel_size": config.tensor_parallel_size > 1,
               "num_speculative_tokens": config.num_speculative_tokens > 0,
               "speculative_method": config.speculative_method == "mtp", "latent_rank": config.latent_rank is not None,
               "kv_cache_dir": config.kv_cache_dir is not None, "kv_cache_host_bytes": bool(config.kv_cache_host_bytes)}
    for name, bad in refused.items():
        if bad:
            raise InvalidParam(name, f"{name}={getattr(config, name)!r}: {cfg.model_type} is a hybrid model "
                               f"(linear-attention layers) and runs with tensor_parallel_size 1, no speculative "
                               f"decoding, its full latent rank and no prefix-cache tiers (kv_cache_dir, "
                               f"kv_cache_host_bytes)")


def rank_device(device: str | None, world: int, rank: int) -> torch.device:
    """The device a rank runs on: the configured one (``cuda`` under tensor parallelism: this rank's own GPU,
    ``cuda:<local rank>``), else a GPU where one is (one per rank: tensor parallelism takes the GPUs only when there
    are as many as ranks), else the CPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device is None:
        device = "cuda" if gpus and (world == 1 or gpus >= world) else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and world > 1 and dev.index is None:
        return torch.device("cuda", local_rank(rank))
    return dev


def local_rank(rank: int) -> int:
    """A rank's index on its machine: torchrun's ``LOCAL_RANK``, or the rank itself (ranks spawned on one machine)."""
    local = env.torchrun_local_rank()
    return rank if local is None else local
