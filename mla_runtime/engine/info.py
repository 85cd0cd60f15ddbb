"""What the engine tells the server: ``EngineInfo`` (fixed at start-up) and ``EngineStats`` (a snapshot per step).

Both are frozen dataclasses: the server's logs and Prometheus metrics read named fields, not dictionary keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mla_runtime.dtypes import dtype_name

if TYPE_CHECKING:
    from mla_runtime.engine.worker import Worker


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

    @classmethod
    def of(cls, worker: Worker, num_blocks: int, num_threads: int) -> EngineInfo:
        c, m = worker.config, worker.model_config
        assert worker.model is not None and worker.cache is not None
        return cls(
            model=c.model, checkpoint=worker.model_path, family=m.family, layers=m.num_hidden_layers,
            heads=m.num_attention_heads,
            d_c=m.kv_lora_rank, d_r=m.qk_rope_head_dim, dtype=dtype_name(worker.model.dtype),
            cache_dtype=worker.cache_dtype.name, tensor_parallel_size=c.tensor_parallel_size,
            latent_cache_layout=c.latent_cache_layout, cache_bytes_per_token=worker.bytes_per_token,
            cache_bytes_per_token_per_rank=worker.bytes_per_token_per_rank, block_size=c.block_size,
            num_blocks=num_blocks, cache_bytes=worker.cache.nbytes(), weight_bytes=worker.weight_bytes,
            activation_bytes=worker.activation_bytes, max_model_len=worker.max_model_len,
            max_concurrent_tokens=num_blocks * c.block_size, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=worker.max_num_batched_tokens, device=str(worker.device), num_threads=num_threads)


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_blocks: int
    cache_usage: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    num_preemptions: int
    num_computed_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    speculative_method: str = "prompt_lookup"
    num_spec_steps: int = 0  # decodes that carried drafts
    drafts_by_position: tuple[int, ...] = ()  # [j]: decodes whose (j+1)-th draft was proposed
    accepted_by_position: tuple[int, ...] = ()  # [j]: ... and accepted
