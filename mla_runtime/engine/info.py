"""What the engine tells the server: ``EngineInfo`` (fixed at start-up) and ``EngineStats`` (a snapshot per step).

Both are frozen dataclasses: the server's logs and Prometheus metrics read named fields, not dictionary keys.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mla_runtime.cache.disk_tier import DiskTierStats
from mla_runtime.cache.host_tier import HostTierStats
from mla_runtime.dtypes import dtype_name

if TYPE_CHECKING:
    from mla_runtime.engine.block_pool import BlockPool
    from mla_runtime.engine.scheduler import Scheduler
    from mla_runtime.engine.sequence import Sequence
    from mla_runtime.engine.worker import Worker


@dataclass
class TokenCounts:
    """Tokens the engine has handled since it started (the running totals behind the throughput metrics)."""

    prompt: int = 0  # prompt tokens of admitted requests
    generation: int = 0  # tokens generated
    draft: int = 0  # speculative tokens proposed
    accepted: int = 0  # speculative tokens accepted
    method: str = "prompt_lookup"  # the speculative method
    spec_steps: int = 0  # decodes that verified drafts
    drafts_by_position: list[int] = field(default_factory=list)  # [j]: decodes whose (j+1)-th draft was proposed
    accepted_by_position: list[int] = field(default_factory=list)  # [j]: ... and accepted

    @classmethod
    def for_speculation(cls, method: str, num_speculative_tokens: int) -> TokenCounts:
        k = num_speculative_tokens
        return cls(method=method, drafts_by_position=[0] * k, accepted_by_position=[0] * k)

    def count_drafts(self, seqs: Iterable[Sequence], drafts: Iterable[tuple[int, ...]],
                     accepted: dict[int, int]) -> None:
        """Count a step's verified drafts (``drafts``: each sequence's): in all, and by position (the j-th draft
        counts as accepted when the first j + 1 were)."""
        for seq, verified in zip(seqs, drafts):
            k, a = len(verified), accepted.get(seq.seq_id, 0)
            if not k:
                continue
            self.spec_steps += 1
            self.draft += k
            self.accepted += a
            for j in range(k):
                self.drafts_by_position[j] += 1
                self.accepted_by_position[j] += j < a


@dataclass(frozen=True)
class EngineInfo:
    model: str  # the checkpoint as given (a folder or a hub repo id)
    checkpoint: str  # the local folder it was loaded from (for logs: metrics never show paths)
    family: str
    layers: int
    heads: int
    d_c: int  # latent width cached per token (after latent-rank truncation)
    d_r: int  # RoPE key width cached per token
    dtype: str  # weights and activations
    cache_dtype: str
    tensor_parallel_size: int
    latent_cache_layout: str
    cache_bytes_per_token: int  # whole token, all layers
    cache_bytes_per_token_per_rank: int
    block_size: int
    num_blocks: int
    cache_bytes: int  # allocated on one rank
    weight_bytes: int  # one rank
    activation_bytes: int  # the planner's reserve for one step, one rank
    max_model_len: int
    max_concurrent_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    device: str
    num_threads: int
    weights_fingerprint: str | None  # 16 hex digits of the weight files' sha256 manifest (None: no manifest)
    weights_verified: bool  # the files were hashed against the manifest at start-up
    kv_cache_dir: str | None = None  # the disk tier (None: off)
    disk_capacity_bytes: int = 0
    disk_capacity_tokens: int = 0
    disk_file_bytes: int = 0  # one block's file
    kv_cache_write_through: bool = False
    host_capacity_bytes: int = 0  # the host-RAM tier (0: off)
    host_capacity_tokens: int = 0
    attention_backend: str = ""  # the model's attention backend (mla_runtime.attention): triton, torch, cpu, sharded
    cpu_gemm: dict[str, str] = field(default_factory=dict)  # on a CPU: the matrix-product path chosen and why
    cpu_heap: str = ""  # on a CPU: what its heap keeps between steps (host_heap.py)
    # a hybrid model's linear-attention states: bytes of one sequence's, and of every slot (0: no linear layers)
    state_bytes_per_sequence: int = 0
    state_bytes: int = 0
    # a hybrid's prefix caching: its state snapshots (the linear layers' states at cached prefixes' ends) and bytes
    state_snapshots: int = 0
    state_snapshot_bytes: int = 0
    prefix_caching: bool = True  # whether prefixes are cached (for a hybrid: only with state snapshots)

    @classmethod
    def of(cls, worker: Worker, num_blocks: int, num_threads: int) -> EngineInfo:
        c, m = worker.config, worker.model_config
        assert worker.cache is not None
        info = cls(
            model=c.model, checkpoint=worker.model_path, family=m.family, layers=m.num_hidden_layers,
            heads=m.num_attention_heads,
            d_c=m.kv_lora_rank, d_r=m.qk_rope_head_dim, dtype=dtype_name(worker.model_dtype),
            cache_dtype=worker.cache_dtype.name, tensor_parallel_size=c.tensor_parallel_size,
            latent_cache_layout=c.latent_cache_layout, cache_bytes_per_token=worker.bytes_per_token,
            cache_bytes_per_token_per_rank=worker.bytes_per_token_per_rank, block_size=c.block_size,
            num_blocks=num_blocks, cache_bytes=worker.cache.nbytes(), weight_bytes=worker.weight_bytes,
            activation_bytes=worker.activation_bytes, max_model_len=worker.max_model_len,
            max_concurrent_tokens=num_blocks * c.block_size, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=worker.max_num_batched_tokens, device=str(worker.device), num_threads=num_threads,
            weights_fingerprint=worker.weights_fingerprint, weights_verified=c.verify_weights,
            attention_backend=worker.attention_name,
            cpu_gemm=worker.gemm_info, cpu_heap=worker.heap,
            state_bytes_per_sequence=worker.state_bytes_per_sequence,
            state_bytes=worker.state_cache_bytes(),
            state_snapshots=worker.num_state_snapshots,
            state_snapshot_bytes=worker.state_snapshot_nbytes(),
            prefix_caching=worker.prefix_caching)
        host, disk = worker.host_tier, worker.disk_tier
        if host is not None:
            info = replace(info, host_capacity_bytes=host.capacity_bytes, host_capacity_tokens=host.capacity_tokens())
        if disk is not None:
            info = replace(info, kv_cache_dir=str(disk.root), disk_capacity_bytes=disk.capacity_bytes,
                           disk_capacity_tokens=disk.capacity_tokens(), disk_file_bytes=disk.file_bytes(),
                           kv_cache_write_through=c.kv_cache_write_through)
        return info


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_blocks: int
    cache_usage: float
    prefix_query_tokens: int
    prefix_hit_tokens: int  # every tier
    prefix_hit_rate: float
    num_preemptions: int
    num_computed_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_idle_cached_blocks: int  # free blocks that still hold an indexed prefix
    cache_watermark: float
    pressure_freed_blocks: int  # idle cached blocks freed above the watermark
    seconds_above_watermark: float
    num_evictions: int = 0  # device-pool blocks evicted
    prefix_device_hit_tokens: int = 0  # prefix_hit_tokens by tier
    prefix_host_query_tokens: int = 0  # tokens of blocks the device pool missed, looked up in host RAM
    prefix_host_hit_tokens: int = 0
    prefix_disk_query_tokens: int = 0  # tokens of blocks the tiers above missed, looked up on disk
    prefix_disk_hit_tokens: int = 0
    disk: DiskTierStats | None = None  # the disk tier's I/O (None: off)
    host: HostTierStats | None = None  # the host tier's copies and slots (None: off)
    speculative_method: str = "prompt_lookup"
    num_spec_steps: int = 0  # decodes that carried drafts
    drafts_by_position: tuple[int, ...] = ()  # [j]: decodes whose (j+1)-th draft was proposed
    accepted_by_position: tuple[int, ...] = ()  # [j]: ... and accepted

    @classmethod
    def of(cls, s: Scheduler, pool: BlockPool, counts: TokenCounts, disk: DiskTierStats | None,
           host: HostTierStats | None = None) -> EngineStats:
        hits = pool.hit_tokens + pool.lower_hit_tokens
        # the pool's lower-tier counts cover the host tier and the disk tier under it: split by the host's hits
        host_hits = min(host.hits_blocks * pool.block_size, pool.lower_hit_tokens) if host is not None else 0
        host_query = pool.lower_query_tokens if host is not None else 0
        return cls(
            num_waiting=len(s.waiting), num_running=len(s.running), num_free_blocks=pool.num_free_blocks,
            num_blocks=pool.num_blocks, cache_usage=pool.usage(), prefix_query_tokens=pool.query_tokens,
            prefix_hit_tokens=hits, prefix_hit_rate=hits / pool.query_tokens if pool.query_tokens else 0.0,
            num_preemptions=s.num_preemptions, num_computed_tokens=s.num_computed_tokens_total,
            num_prompt_tokens=counts.prompt, num_generation_tokens=counts.generation, num_draft_tokens=counts.draft,
            num_accepted_tokens=counts.accepted, num_idle_cached_blocks=pool.num_idle_cached_blocks,
            cache_watermark=pool.watermark, pressure_freed_blocks=pool.pressure_freed,
            seconds_above_watermark=s.seconds_above_watermark, num_evictions=pool.num_evictions,
            prefix_device_hit_tokens=pool.hit_tokens, prefix_host_query_tokens=host_query,
            prefix_host_hit_tokens=host_hits, prefix_disk_query_tokens=pool.lower_query_tokens - host_hits,
            prefix_disk_hit_tokens=pool.lower_hit_tokens - host_hits, disk=disk, host=host,
            speculative_method=counts.method,
            num_spec_steps=counts.spec_steps, drafts_by_position=tuple(counts.drafts_by_position),
            accepted_by_position=tuple(counts.accepted_by_position))
