"""DeepSeek-V4's cache, kind by kind: what one sequence keeps (``V4SequenceState``), in bytes.

Two parts grow with the sequence, one compressed entry every ``rate`` tokens per compressed layer:

- the CSA attention's entries (``head_dim`` values every ``rate_csa`` tokens) and its indexer's keys (``index_head_dim``
  values every ``rate_csa`` tokens);
- the HCA attention's entries (``head_dim`` values every ``rate_hca`` tokens).

The rest is fixed per sequence, whatever its length (at most):

- every layer's sliding window: the last ``sliding_window - 1`` latents of ``head_dim`` values;
- every compressor's partial state: the incomplete window's projections and gates (fewer than ``rate`` tokens, each
  ``2 width`` values, ``width`` = ``2 dim`` for CSA's overlapping series, ``dim`` for HCA), and for CSA the previous
  window's overlapping half (``rate × dim`` values, and its gates with their slot bias in float32).

The values are in the model's dtype (``dtype_bytes``); ``models.deepseek_v4.state_bytes`` counts one sequence's
bytes at a given length from the same rules, and these functions agree with it (tests/test_v4_sizes.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mla_runtime.config import ModelConfig
from mla_runtime.models.deepseek_v4 import DeepseekV4ForCausalLM, V4Config, state_bytes
from mla_runtime.parallel import SINGLE_RANK, ParallelContext

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
# prefix caching's default snapshot budget: room for one snapshot per sequence slot of a prefix this long (or the
# context limit if shorter): a system prompt, a conversation's first turns; longer ones fit while the budget holds them
SNAPSHOT_TOKENS = 8192


@dataclass(frozen=True)
class V4CacheKinds:
    """The bytes of each kind of V4 cache for a whole model (all its layers of the kind)."""

    csa_layers: int
    hca_layers: int
    sliding_layers: int
    csa_entry_bytes: int  # one CSA entry, all CSA layers: head_dim values each
    index_key_bytes: int  # one indexer key, all CSA layers: index_head_dim values each
    hca_entry_bytes: int  # one HCA entry, all HCA layers
    csa_rate: int
    hca_rate: int
    window_bytes: int  # per sequence: every layer's sliding window (sliding_window - 1 latents)
    partial_bytes: int  # per sequence, at most: every compressor's incomplete window and CSA's overlapping halves

    def entries_bytes(self, tokens: int) -> int:
        """The compressed entries (CSA's, the indexer's keys, HCA's) of a sequence of ``tokens`` tokens."""
        return (tokens // self.csa_rate * (self.csa_entry_bytes + self.index_key_bytes)
                + tokens // self.hca_rate * self.hca_entry_bytes)

    def sequence_bytes(self, tokens: int) -> int:
        """A sequence of ``tokens`` tokens, at most: its entries, its windows (full once it is that long) and the
        largest partial state."""
        return self.entries_bytes(tokens) + self.window_bytes + self.partial_bytes

    @property
    def fixed_bytes(self) -> int:
        """Per sequence, whatever its length (at most): windows and partial states."""
        return self.window_bytes + self.partial_bytes

    @property
    def bytes_per_token(self) -> float:
        """The entries' bytes per token of sequence (exact as a fraction: one entry every ``rate`` tokens)."""
        return ((self.csa_entry_bytes + self.index_key_bytes) / self.csa_rate
                + self.hca_entry_bytes / self.hca_rate)

    @property
    def block_bytes_per_token(self) -> int:
        """The entries' bytes per token rounded up, for a paged budget: ``ceil(bytes_per_token)``."""
        csa = self.csa_entry_bytes + self.index_key_bytes
        return -(-(csa * self.hca_rate + self.hca_entry_bytes * self.csa_rate) // (self.csa_rate * self.hca_rate))


def cache_kinds(cfg: V4Config, dtype_bytes: int) -> V4CacheKinds:
    """The cache kinds of ``cfg`` with values of ``dtype_bytes`` bytes (2: bfloat16)."""
    kinds = list(cfg.layer_types)
    csa, hca = kinds.count(CSA), kinds.count(HCA)
    rate_csa, rate_hca = cfg.compress_rates[CSA], cfg.compress_rates[HCA]
    d, di, b = cfg.head_dim, cfg.index_head_dim, dtype_bytes
    # the incomplete window: up to rate - 1 tokens of kv and gate, each ``width`` values; CSA: width 2 dim, and the
    # previous window's half (rate x dim values, its gates float32)
    csa_partial = sum(2 * (rate_csa - 1) * 2 * dim * b + rate_csa * dim * (b + 4) for dim in (d, di))
    hca_partial = 2 * (rate_hca - 1) * d * b
    return V4CacheKinds(
        csa_layers=csa, hca_layers=hca, sliding_layers=kinds.count(SLIDING), csa_entry_bytes=csa * d * b,
        index_key_bytes=csa * di * b, hca_entry_bytes=hca * d * b, csa_rate=rate_csa, hca_rate=rate_hca,
        window_bytes=len(kinds) * (cfg.sliding_window - 1) * d * b,
        partial_bytes=csa * csa_partial + hca * hca_partial)


def model_config(cfg: V4Config) -> ModelConfig:
    """What the engine reads of any model (vocabulary, special tokens, context, the widths ``EngineInfo`` shows), for
    a V4 checkpoint: its latent is ``head_dim`` wide, ``rope_dim`` of it rotated."""
    return ModelConfig(
        family="deepseek_v4", model_type="deepseek_v4", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, kv_lora_rank=cfg.head_dim - cfg.rope_dim,
        q_lora_rank=cfg.q_lora_rank, qk_nope_head_dim=cfg.head_dim - cfg.rope_dim, qk_rope_head_dim=cfg.rope_dim,
        v_head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)


def meta_weights(build: Callable[[], torch.nn.Module]) -> tuple[int, int]:
    """The weights of the model ``build`` makes, counted on the meta device (nothing allocated): (bytes of its
    parameters and buffers, each at its own dtype; parameters: buffers, such as V4's hash-routing tables, not
    counted)."""
    with torch.device("meta"):
        model = build()
    params = list(model.parameters())
    return (sum(t.numel() * t.element_size() for t in (*params, *model.buffers())), sum(p.numel() for p in params))


def v4_weights(cfg: V4Config, dtype: torch.dtype, par: ParallelContext = SINGLE_RANK) -> tuple[int, int]:
    """The V4 model's weights (``meta_weights``): one rank's shard under tensor parallelism (``par``)."""
    return meta_weights(lambda: DeepseekV4ForCausalLM(cfg, dtype, par))


def default_snapshot_bytes(cfg: V4Config, max_num_seqs: int, max_model_len: int, dtype_bytes: int) -> int:
    """The default ``state_snapshot_memory`` of a V4 model served with ``max_num_seqs`` slots: ``max_num_seqs``
    snapshots of ``SNAPSHOT_TOKENS`` tokens (``max_model_len`` if shorter), each the whole state at its prefix's end
    (``state_bytes``)."""
    return max_num_seqs * state_bytes(cfg, min(max_model_len, SNAPSHOT_TOKENS), dtype_bytes)


__all__ = ["SNAPSHOT_TOKENS", "V4CacheKinds", "cache_kinds", "default_snapshot_bytes", "meta_weights", "model_config",
           "v4_weights"]
