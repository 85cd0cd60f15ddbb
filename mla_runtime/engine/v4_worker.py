"""``V4Worker``: the engine's worker for DeepSeek-V4 (``deepseek_v4``, ``models/deepseek_v4.py``).

V4 keeps no paged latent rows: each running sequence owns a state slot (``V4StateCache``: its layers' sliding
windows, its compressors' partial windows and every compressed entry so far). The engine around it is the one every
model runs under (scheduler, block pool, sampler, ``LLM``, the server); only what the worker builds differs:

- **slots**: ``max_num_seqs`` of them, handed out by the scheduler's ``StateSlots`` as for a hybrid model, given back
  on finish, abort and preemption; a slot given back drops its state at once (``ReleasingSlots``), so a finished
  sequence's entries never outlive it;
- **blocks**: the block pool counts the part of a sequence that grows, its compressed entries: ``bytes_per_token`` is
  their bytes per token (``models.v4_sizes``, rounded up), and ``num_blocks`` the blocks ``kv_cache_memory`` (or the
  memory left after the weights, the slots' fixed part and the activations) holds. A sequence holds blocks for its
  tokens as under any model, so the scheduler preempts when the entries would outgrow the budget; the latent cache it
  allocates has no layers (nothing is written to it);
- **steps**: ``execute`` runs ``DeepseekV4ForCausalLM.forward_batch`` over the slots (any mix of prompts, prefill
  chunks and decodes), then the logits of the rows asked for;
- **ranks** (``tensor_parallel_size``): each rank loads its shard (``models/v4_shards.py``: its query heads and output
  groups, routed experts, a slice of the shared expert and of the vocabulary; the KV head, compressors, indexer and
  hyper-connections whole) and holds every slot's whole state, as every rank computes the same latents and entries;
  rank 0's slots given back and snapshots freed reach the other ranks with the next step (``StepInput.state_releases``,
  ``snapshot_drops``).

- **prefix caching**: state snapshots of the whole state (every window, partial window, compressed entry and
  indexer key) at block boundaries, taken and restored as a hybrid's (``V4StateCache.run_batch``, ``restore``). A
  snapshot is as large as its prefix (``snapshot_bytes``), so the scheduler's side is ``SizedSnapshots``: they stay
  within ``state_snapshot_memory`` bytes (default room for ``max_num_seqs`` snapshots of ``SNAPSHOT_TOKENS`` tokens;
  0: no prefix caching), least recently used evicted first, their tensors dropped as they are freed. A sequence
  restored from one keeps its own copy of the prefix's entries, so it holds fresh blocks for them
  (``own_prefix_copies``).

What V4 does not do here is refused by name at start-up (``check_v4_settings``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from mla_runtime import checksums
from mla_runtime.cache.disk_tier import DiskTier, model_fingerprint
from mla_runtime.cache.host_tier import HostTier
from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.cache.snapshot_tier import FORMAT_VERSION as SNAPSHOT_FORMAT
from mla_runtime.cache.snapshot_tier import Snapshot, SnapshotDisk, SnapshotTier
from mla_runtime.cache.state_cache import SizedSnapshots, StateSlots, StateSnapshots
from mla_runtime.config import ModelConfig, load_config_dict
from mla_runtime.dtypes import resolve_cache_dtype
from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.worker import StepInput, Worker, available_host_memory, rank_device, sequence_limits
from mla_runtime.errors import InsufficientMemory, InvalidParam
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.hub import resolve_model
from mla_runtime.kernel_plan import OFF_CPU
from mla_runtime.models.deepseek_v4 import (
    V4Config,
    V4StateCache,
    load_deepseek_v4,
    state_bytes,
    state_from_tensors,
    state_tensors,
)
from mla_runtime.models.glm5_next import MODEL_TYPES as GLM5_NEXT_TYPES
from mla_runtime.models.v4_shards import check_v4_parallel
from mla_runtime.models.v4_sizes import (
    V4CacheKinds,
    cache_kinds,
    default_snapshot_bytes,
    meta_weights,
    model_config,
    v4_weights,
)
from mla_runtime.models.v4_stored import stored_weight_bytes, v4_quantization
from mla_runtime.parallel import SINGLE_RANK, ParallelContext
from mla_runtime.plan import (
    activation_reserve_bytes,
    cache_budget_bytes,
    cache_num_blocks,
)
from mla_runtime.v4_plan import SPLIT_FAMILIES, refusal

logger = logging.getLogger("mla_runtime")
V4_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


class ReleasingSlots(StateSlots):
    """``StateSlots`` that also drop a slot's state when the scheduler gives the slot back."""

    def __init__(self, num_slots: int, release: Callable[[int], None]) -> None:
        super().__init__(num_slots)
        self.release = release

    def give_back(self, slot: int) -> None:
        super().give_back(slot)
        self.release(slot)


def check_v4_settings(config: EngineConfig, family: str = "deepseek_v4", doc: str = "docs/deepseek-v4.md") -> None:
    """Refuse, by name, the settings a V4 (or GLM-5-Next) model does not run with: its states advance with every
    token a step computes (no drafts to verify), only V4's state snapshots go to the prefix-cache tiers (on one
    rank), it runs in torch in bfloat16 or float32 (V4, Hunyuan V4 and dots3-note on any number of ranks that splits
    them, every rank holding every state; GLM-5-Next on one)."""
    tiers_refused = family != "deepseek_v4" or config.tensor_parallel_size > 1
    refused = {"tensor_parallel_size": config.tensor_parallel_size > 1 and family not in SPLIT_FAMILIES,
               "latent_cache_layout": config.tensor_parallel_size > 1 and config.latent_cache_layout != "replicated",
               "num_speculative_tokens": config.num_speculative_tokens > 0,
               "speculative_method": config.speculative_method == "mtp", "latent_rank": config.latent_rank is not None,
               "kv_cache_dir": tiers_refused and config.kv_cache_dir is not None,
               "kv_cache_host_bytes": tiers_refused and bool(config.kv_cache_host_bytes),
               "quantization": config.quantization is not None,
               "kv_cache_dtype": config.kv_cache_dtype not in ("auto", None),
               "dtype": config.dtype not in V4_DTYPES}
    for name, bad in refused.items():
        if bad:
            raise InvalidParam(name, refusal(name, getattr(config, name), family, doc))


class SnapshotStore:
    """The lower tiers of ``SizedSnapshots`` on the worker's side (``cache/state_cache.SnapshotLower``): a snapshot's
    state handed to the ``SnapshotTier`` as named host tensors, and loaded back into a snapshot only once it checks
    out against this model (``state_from_tensors``; one that does not is logged, dropped and recomputed)."""

    def __init__(self, worker: V4Worker, tier: SnapshotTier) -> None:
        self.worker, self.tier = worker, tier

    def snapshot(self, snapshot: int) -> Snapshot | None:
        """Snapshot ``snapshot``'s state as the tier keeps it (None: it holds none)."""
        states = self.worker.states
        st = None if states is None else states.snapshots[snapshot]
        if st is None:
            return None
        return Snapshot({k: t.to("cpu") for k, t in state_tensors(st).items()}, st.length)

    def store(self, block_hash: int, snapshot: int, persist: bool = False) -> None:
        held = self.snapshot(snapshot)
        if held is not None:
            self.tier.store(block_hash, held, persist)

    def tokens(self, block_hash: int) -> int | None:
        return self.tier.tokens(block_hash)

    def load(self, block_hash: int, snapshot: int, tokens: int) -> bool:
        w = self.worker
        held = self.tier.load(block_hash)
        if held is None or w.states is None:
            return False
        try:
            if held.tokens != tokens:
                raise ValueError(f"a snapshot of {held.tokens} tokens where {tokens} were expected")
            w.states.snapshots[snapshot] = state_from_tensors(w.v4_config, held.tensors, tokens, w.dtype, w.device)
        except ValueError as e:
            self.tier.reject(block_hash, str(e))
            return False
        return True


class V4Worker(Worker):
    """The ``Worker`` of a ``deepseek_v4`` checkpoint (the module's docstring): same start-up calls, same steps."""

    sized_snapshots = False  # V4's own (set in its ``__init__``): snapshots as large as their prefixes
    # every model run over state slots keeps each token's rows in the sequence's own state: a sequence restored from a
    # snapshot holds its own copy of the prefix's rows (its first step extends a copy of them), so it holds fresh
    # blocks for them (``Scheduler.own_prefix_copies``) and the pool counts every running sequence's rows once
    own_prefix_copies = True

    def _open(self, config: EngineConfig, par: ParallelContext) -> dict[str, Any]:
        """Hold the settings and find the checkpoint; its raw config."""
        self.config, self.par = config, par
        self.model_path = resolve_model(config.model, config.revision)
        return load_config_dict(self.model_path)

    def _settle(self, cfg: ModelConfig, checkpoint_dtype: object) -> ModelConfig:
        """What every model run in torch over state slots resolves alike: the device, the dtype (the setting's, else
        the checkpoint's ``checkpoint_dtype``, else float32), no quantization or CPU plan, the sequence limits."""
        self.checkpoint_config = self.model_config = cfg
        self.device = rank_device(self.config.device, self.config.tensor_parallel_size, self.par.rank)
        self.dtype = V4_DTYPES[self.config.dtype] or V4_DTYPES.get(str(checkpoint_dtype), None) or torch.float32
        self.quantization, self.num_mtp_layers, self.plan, self.heap = None, 0, OFF_CPU, ""
        self.cache_dtype = resolve_cache_dtype("auto", self.dtype)
        self.max_model_len, self.max_num_batched_tokens = sequence_limits(self.config, cfg.max_position_embeddings)
        return cfg

    def __init__(self, config: EngineConfig, par: ParallelContext = SINGLE_RANK) -> None:
        check_v4_settings(config)
        raw = self._open(config, par)
        self.v4_config = V4Config.from_raw(raw)
        check_v4_parallel(self.v4_config, config.tensor_parallel_size)
        cfg = self._settle(model_config(self.v4_config), raw.get("dtype") or raw.get("torch_dtype"))
        self.kinds: V4CacheKinds = cache_kinds(self.v4_config, self.dtype.itemsize)
        self.bytes_per_token = self.bytes_per_token_per_rank = self.kinds.block_bytes_per_token
        self.state_bytes_per_sequence = self.kinds.fixed_bytes
        self.state_bytes = self.state_bytes_per_sequence * config.max_num_seqs
        self.sized_snapshots = True  # a snapshot holds the whole state: it grows
        self.num_state_snapshots, self.state_snapshot_bytes = self._v4_snapshots()
        self.weight_bytes = v4_weights(self.v4_config, self.dtype, par)[0]  # this rank's shard
        if v4_quantization(raw) is not None:  # the released FP8 / MXFP4 weights, kept as stored
            self.weight_bytes = stored_weight_bytes(Path(self.model_path), self.dtype, self.v4_config, par)
        self.activation_bytes = activation_reserve_bytes(
            cfg, dtype=self.dtype, max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, residual_streams=self.v4_config.hc_mult)
        self._unloaded()

    def snapshot_bytes(self, tokens: int) -> int:
        """Bytes of a state snapshot after ``tokens`` tokens: the whole state of a sequence that long (windows,
        partial windows, every compressed entry and indexer key so far; ``models.deepseek_v4.state_bytes``)."""
        return state_bytes(self.v4_config, tokens, self.dtype.itemsize)

    def _v4_snapshots(self) -> tuple[int, int]:
        """Prefix caching's state snapshots: how many ids, and the bytes they may hold together
        (``state_snapshot_memory``; default ``models.v4_sizes.default_snapshot_bytes``: room for ``max_num_seqs``
        snapshots, one per slot as a hybrid's, of ``SNAPSHOT_TOKENS`` tokens or ``max_model_len`` if shorter). A
        snapshot is as large as the prefix it ends (``snapshot_bytes``): the ids are as many as snapshots of one block
        fit; ``SizedSnapshots`` keeps those held within the bytes. (0, 0): no prefix caching."""
        c = self.config
        if not c.enable_prefix_caching:
            return 0, 0
        default = default_snapshot_bytes(self.v4_config, c.max_num_seqs, self.max_model_len, self.dtype.itemsize)
        budget = default if c.state_snapshot_memory is None else int(c.state_snapshot_memory)
        smallest = self.snapshot_bytes(c.block_size)
        if 0 < budget < smallest:
            raise InvalidParam("state_snapshot_memory", f"state_snapshot_memory ({budget:,} B) holds no state snapshot "
                               f"of deepseek_v4 (one of a {c.block_size}-token prefix takes {smallest:,} B): give at "
                               f"least that, or 0 for no prefix caching")
        return budget // smallest, budget

    def _size_streams(self, cfg: ModelConfig, build: Callable[[], torch.nn.Module], streams: int) -> None:
        """The weights' bytes (of the model ``build`` makes, on the meta device) and the activations' reserve, with
        ``streams`` residual streams (hyper-connections; 0 without) per token of a step."""
        self.weight_bytes = meta_weights(build)[0]
        self.activation_bytes = activation_reserve_bytes(
            cfg, dtype=self.dtype, max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs, residual_streams=streams)

    def _count_stored(self, raw: dict[str, Any], family: str, cfg: Any, rename: Callable[[str], str | None],
                      splits: dict[str, tuple[str, int]]) -> None:
        """A checkpoint in V4's stored scheme (FP8 blocks, MXFP4 experts) is held as stored: its weights are counted
        from its files' headers (``rename``: a stored name -> the model's, None for a tensor it does not read), this
        rank's shard of them under tensor parallelism (``cfg``'s experts, ``splits``), not at the float model's
        size."""
        if v4_quantization(raw, family) is not None:
            self.weight_bytes = stored_weight_bytes(Path(self.model_path), self.dtype, cfg, self.par,
                                                    keep=lambda name: rename(name) is not None, rename=rename,
                                                    splits=splits)

    def _unloaded(self) -> None:
        """What a worker of a model of its own holds before ``load``: no model, slots, cache, tiers or graphs."""
        self.model = None
        self.own_model: Any = None  # the model of its own (``forward_batch``, ``compute_logits``)
        self.states: Any = None  # its slots' states (``state``, ``release``; ``restore`` with state snapshots)
        # rank 0's slots given back and snapshots freed since the last step (``take_state_releases``)
        self.released: list[int] = []
        self.dropped: list[int] = []
        self.cache: LatentCache | None = None
        self.last_step = None
        self.quantized = False
        self.weights_fingerprint: str | None = None
        self.disk_tier: DiskTier | None = None
        self.host_tier: HostTier | None = None
        self.snapshot_tier: SnapshotTier | None = None  # the state snapshots' lower tiers (``open_lower_tier``)
        self.snapshot_store: SnapshotStore | None = None
        self.graphs = None

    @property
    def model_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def attention_name(self) -> str:
        return "torch"

    def check_memory(self) -> None:
        """Refuse a load whose weights, slots, state snapshots and activations the memory cannot hold, before any
        weight is read."""
        on_gpu = self.device.type == "cuda"
        available = torch.cuda.mem_get_info(self.device)[0] if on_gpu else available_host_memory()
        needed = self.weight_bytes + self.state_bytes + self.state_snapshot_bytes + self.activation_bytes
        if needed > available:
            raise InsufficientMemory(
                f"{self.model_config.family}: the weights ({self.weight_bytes / 2**30:.2f} GiB), "
                f"{self.config.max_num_seqs} state slots ({self.state_bytes / 2**30:.2f} GiB), the state snapshots "
                f"({self.state_snapshot_bytes / 2**30:.2f} GiB) and the activations "
                f"({self.activation_bytes / 2**30:.2f} GiB) need {needed / 2**30:.2f} GiB; "
                f"{available / 2**30:.2f} GiB are available on {self.device}: lower max_num_seqs, "
                f"state_snapshot_memory or max_num_batched_tokens", needed, available)

    def load(self) -> None:  # type: ignore[override]
        """Load the weights (checked against the sha256 manifest first with ``verify_weights``)."""
        self.check_memory()
        if self.config.verify_weights:
            self.weights_fingerprint = checksums.verify(self.model_path)
        else:
            self.weights_fingerprint = checksums.manifest_fingerprint(self.model_path)
        self.own_model = self._load_model().to(self.device)

    def _load_model(self) -> torch.nn.Module:
        return load_deepseek_v4(self.model_path, self.dtype, self.device, self.par)

    def num_blocks(self) -> int:
        """Blocks of ``block_size`` tokens whose compressed entries fit the budget: ``kv_cache_memory``, else the
        planner's share of the memory left after the slots' fixed part and the state snapshots."""
        c = self.config
        if c.kv_cache_memory is not None:
            budget = int(c.kv_cache_memory)
        else:
            on_gpu = self.device.type == "cuda"
            free = torch.cuda.mem_get_info(self.device)[0] if on_gpu else available_host_memory()
            free = max(0, free - self.state_bytes - self.state_snapshot_bytes)  # allocated beside the blocks
            budget = cache_budget_bytes(on_gpu=on_gpu, free_bytes=free,
                                        activation_bytes=self.activation_bytes, bytes_per_token=self.bytes_per_token,
                                        block_size=c.block_size, max_model_len=self.max_model_len,
                                        max_num_seqs=c.max_num_seqs)
        return cache_num_blocks(budget, self.bytes_per_token, c.block_size, self.max_model_len)

    def allocate(self, num_blocks: int, cache_dtype: torch.dtype | None = None) -> LatentCache:
        """The block pool's bookkeeping cache (no layers: nothing is written to it) and the ``max_num_seqs`` state
        slots (``_new_states``), logged (``_allocation_line``)."""
        assert self.own_model is not None
        cfg = self.model_config
        self.cache = LatentCache(0, num_blocks, self.config.block_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                 self.dtype, self.device)
        self.states = self._new_states()
        logger.info(self._allocation_line(num_blocks))
        return self.cache

    def _new_states(self) -> Any:
        return V4StateCache(self.v4_config, self.config.max_num_seqs, self.num_state_snapshots)

    def _allocation_line(self, num_blocks: int) -> str:
        snapshots = (f"state snapshots in {self.state_snapshot_bytes / 2**20:.1f} MiB (each the whole state at its "
                     f"prefix's end: {self.snapshot_bytes(self.config.block_size):,} B after one block)"
                     if self.prefix_caching else "off")
        return (f"deepseek_v4: {self.config.max_num_seqs} state slots of up to "
                f"{self.state_bytes_per_sequence / 2**10:.1f} KiB fixed (windows, partial windows) plus "
                f"{self.bytes_per_token} B of compressed entries per token ({num_blocks} blocks of "
                f"{self.config.block_size} tokens); prefix caching: {snapshots}")

    @property
    def prefix_caching(self) -> bool:
        """As configured, with state snapshots (a cached prefix resumes from a copy of the state at its end)."""
        return self.config.enable_prefix_caching and self.num_state_snapshots > 0

    def state_slots(self) -> StateSlots:
        return ReleasingSlots(self.config.max_num_seqs, self._release)

    def state_snapshots(self) -> StateSnapshots | None:
        """V4's snapshots, sized by the prefix they end (``SizedSnapshots`` within ``state_snapshot_bytes``); the
        fixed-size ones of a model whose worker runs as this one. Either way a freed snapshot's tensors (its rows grow
        with its prefix) are dropped at once, on every rank (``_drop_snapshot``); V4's go to the lower tiers first,
        when it has any (``SnapshotStore``)."""
        if not self.num_state_snapshots:
            return None
        if not self.sized_snapshots:
            return StateSnapshots(self.num_state_snapshots, self._drop_snapshot)
        store = None if self.snapshot_tier is None else SnapshotStore(self, self.snapshot_tier)
        self.snapshot_store = store
        return SizedSnapshots(self.num_state_snapshots, self.state_snapshot_bytes, self.snapshot_bytes,
                              self._drop_snapshot, store, self.config.kv_cache_write_through)

    def state_snapshot_nbytes(self) -> int:
        """V4's snapshot budget (``state_snapshot_memory``), what its snapshots may hold together."""
        return self.state_snapshot_bytes if self.sized_snapshots else super().state_snapshot_nbytes()

    def _release(self, slot: int) -> None:
        if self.states is not None:
            self.states.release(slot)
        if self.par.enabled:
            self.released.append(slot)

    def take_state_releases(self) -> tuple[list[int], list[int]]:
        out = self.released, self.dropped
        self.released, self.dropped = [], []
        return out

    def _drop_snapshot(self, snapshot: int) -> None:
        if self.states is not None:
            self.states.drop(snapshot)
        if self.par.enabled:
            self.dropped.append(snapshot)

    def state_cache_bytes(self) -> int:
        """The slots' fixed part set aside (windows, partial windows: ``max_num_seqs`` of them); the entries are the
        blocks' (``states.nbytes()``: what the running sequences hold now)."""
        return 0 if self.states is None else self.state_bytes

    def open_lower_tier(self) -> None:
        """No latent tiers (the blocks hold no rows); the state snapshots' tiers (``cache/snapshot_tier.py``) under
        the same settings, on one rank: the disk tier when ``kv_cache_dir`` is set, host RAM over it when
        ``snapshot_host_bytes()`` is not 0."""
        c = self.config
        if not (self.sized_snapshots and self.prefix_caching) or self.par.enabled:
            return None
        disk = None
        if c.kv_cache_dir is not None:
            bound = None if c.kv_cache_disk_bytes is None else int(c.kv_cache_disk_bytes)
            disk = SnapshotDisk(c.kv_cache_dir, self.snapshot_fingerprint(), bound)
        host = self.snapshot_host_bytes()
        if host or disk is not None:
            self.snapshot_tier = SnapshotTier(host, disk)
        return None

    def snapshot_fingerprint(self) -> str:
        """What decides a state snapshot's bytes (beside the checkpoint, which ``model_fingerprint`` covers): a
        snapshot written under any other value is never looked up."""
        settings = {"kind": "deepseek_v4 state snapshots", "format": SNAPSHOT_FORMAT, "dtype": str(self.dtype),
                    "block_size": self.config.block_size}
        return model_fingerprint(self.model_path, settings)

    def snapshot_host_bytes(self) -> int:
        """Host RAM for the snapshots that leave ``state_snapshot_memory``: ``kv_cache_host_bytes``, or by default a
        quarter of the available RAM on CUDA and none on a CPU (whose snapshots are in host RAM already)."""
        c = self.config
        if c.kv_cache_host_bytes is not None:
            n, smallest = int(c.kv_cache_host_bytes), self.snapshot_bytes(c.block_size)
            if 0 < n < smallest:
                raise InvalidParam("kv_cache_host_bytes", f"kv_cache_host_bytes ({n:,} B) holds no state snapshot of "
                                   f"deepseek_v4 ({smallest:,} B after one block): give at least that, or 0 for none")
            return n
        return available_host_memory() // 4 if self.device.type == "cuda" else 0

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor | None:
        """Run one step over the sequences' slots; fp32 logits ``[len(logit_rows), V]`` (None without rows)."""
        assert self.own_model is not None and self.states is not None
        for slot in step.state_releases:  # rank 0's slots given back and snapshots freed (done there already)
            self.states.release(slot)
        for snapshot in step.snapshot_drops:
            self.states.drop(snapshot)
        for snapshot, slot in step.state_restores:  # prefix hits (models with state snapshots)
            self.states.restore(snapshot, slot)
        batch = ForwardBatch.build(step.token_chunks, step.context_lens, step.block_tables, self.config.block_size,
                                   self.device, step.state_slots, step.state_snapshots)
        hidden = self.own_model.forward_batch(batch, self.states)
        if not step.logit_rows:
            return None
        return cast(torch.Tensor, self.own_model.compute_logits(hidden[step.logit_rows]))


def checkpoint_model_type(config: EngineConfig) -> str | None:
    """``config.model``'s ``model_type`` (a folder, or a hub repo id it downloads); None where it cannot be read."""
    try:
        raw = load_config_dict(resolve_model(config.model, config.revision))
    except (OSError, ValueError):
        return None  # the ordinary worker reports what is wrong with it
    return raw.get("model_type")


def is_v4_checkpoint(config: EngineConfig) -> bool:
    """Whether ``config.model`` is a ``deepseek_v4`` checkpoint (a folder, or a hub repo id it downloads)."""
    return checkpoint_model_type(config) == "deepseek_v4"


def make_worker(config: EngineConfig, par: ParallelContext = SINGLE_RANK) -> Worker:
    """The worker of ``config.model``: ``V4Worker`` for a ``deepseek_v4`` checkpoint, ``Glm5NextWorker`` for a
    ``glm5_next`` one, ``HyV4Worker`` for a ``hy_v4`` one, ``Dots3Worker`` for a ``dots3_note`` one, else
    ``Worker``."""
    model_type = checkpoint_model_type(config)
    if model_type in GLM5_NEXT_TYPES:
        from mla_runtime.engine.glm5_worker import Glm5NextWorker

        return Glm5NextWorker(config, par)
    if model_type in ("dots3_note", "dots3_note_text"):
        from mla_runtime.engine.dots3_worker import Dots3Worker

        return Dots3Worker(config, par)
    if model_type == "hy_v4":
        from mla_runtime.engine.hy_v4_worker import HyV4Worker

        return HyV4Worker(config, par)
    return V4Worker(config, par) if model_type == "deepseek_v4" else Worker(config, par)


__all__ = ["ReleasingSlots", "SnapshotStore", "V4Worker", "check_v4_settings", "make_worker"]
