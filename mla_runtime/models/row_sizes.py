"""What a Hunyuan V4 (``hy_v4``) or dots3-note (``dots3_note``) sequence keeps, kind by kind, in bytes.

Both keep MLA latent rows per token, each over a state of its own (``HyV4State``, ``Dots3State``):

- **latent rows**: every token's ``d_c + d_r`` values in each layer that keeps every token (Hunyuan V4: every layer;
  dots3-note: its indexed and full layers, at each layer's widths);
- **indexer keys**: every token's ``index_head_dim`` values in each layer with an indexer of its own (Hunyuan V4's
  ``full`` layers, not those that share a selection; dots3-note's indexed layers);
- **windows**: fixed per sequence, each sliding layer's last ``sliding_window - 1`` latent rows (dots3-note only).

Against them ``plain_values`` is what the same layers keep as a plain MLA stack with DSA: every layer every token's
latent row at its own widths, and every layer that selects by an indexer (its own or a shared one) its key, as
DeepSeek-V3.2's layers do. The workers (``engine/hy_v4_worker.py``, ``engine/dots3_worker.py``) count the blocks with
``bytes_per_token`` and the slots' fixed part with ``window_bytes``; the planner (``row_plan.py``) reports the same.
The values are in the model's dtype (``dtype_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_runtime.config import ModelConfig
from mla_runtime.models.dots3_note import Dots3Config
from mla_runtime.models.hy_v4 import HyV4Config

SLIDING = "sliding_attention"


@dataclass(frozen=True)
class RowCacheKinds:
    """The cache kinds of a whole model (all its layers of the kind), in values and in bytes."""

    layers: int
    latent_layers: int  # layers keeping every token's latent row
    latent_values: int  # per token: their d_c + d_r, summed over them
    index_layers: int  # layers keeping every token's indexer key
    index_values: int  # per token: index_head_dim, summed over them
    sliding_layers: int
    window_values: int  # per sequence: the sliding layers' last sliding_window - 1 rows
    plain_values: int  # per token: the same layers as a plain MLA stack with DSA keeps them
    dtype_bytes: int

    @property
    def latent_bytes(self) -> int:
        return self.latent_values * self.dtype_bytes

    @property
    def index_key_bytes(self) -> int:
        return self.index_values * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """What grows with a sequence: its latent rows and indexer keys (what the block pool counts)."""
        return self.latent_bytes + self.index_key_bytes

    @property
    def window_bytes(self) -> int:
        """A sequence's fixed part (a state slot's): the sliding layers' windows."""
        return self.window_values * self.dtype_bytes

    @property
    def plain_bytes_per_token(self) -> int:
        return self.plain_values * self.dtype_bytes

    def sequence_bytes(self, tokens: int) -> int:
        """A sequence of ``tokens`` tokens: its rows and keys and its windows (full once it is that long)."""
        return tokens * self.bytes_per_token + self.window_bytes


def _row(width: dict) -> int:
    return int(width["kv_lora_rank"]) + int(width["qk_rope_head_dim"])


def hy_v4_kinds(cfg: HyV4Config, dtype_bytes: int) -> RowCacheKinds:
    """Hunyuan V4: every layer's latent row, the indexer key of each layer with its own indexer (``full``)."""
    layers, own = len(cfg.moe), sum(not s for s in cfg.shared)
    row, index = _row(cfg.g), int(cfg.index_head_dim)
    return RowCacheKinds(layers, layers, layers * row, own, own * index, 0, 0, layers * (row + index), dtype_bytes)


def dots3_kinds(cfg: Dots3Config, dtype_bytes: int) -> RowCacheKinds:
    """dots3-note: the latent rows of every layer that is not sliding, the indexed layers' keys, the sliding
    layers' windows."""
    rows = [_row(w) for w in cfg.widths]
    sliding = [k == SLIDING for k in cfg.kinds]
    indexed, index = cfg.kinds.count("indexed_attention"), int(cfg.index_head_dim)
    kept = sum(r for r, s in zip(rows, sliding) if not s)
    window = sum(r for r, s in zip(rows, sliding) if s) * max(int(cfg.sliding_window) - 1, 0)
    return RowCacheKinds(len(rows), len(rows) - sum(sliding), kept, indexed, indexed * index, sum(sliding), window,
                         sum(rows) + indexed * index, dtype_bytes)


def hy_v4_model_config(cfg: HyV4Config) -> ModelConfig:
    """What the engine reads of any model (vocabulary, special tokens, context, widths) for a Hunyuan V4
    checkpoint."""
    g = cfg.g
    return ModelConfig(
        family="hy_v4", model_type="hy_v4", vocab_size=int(g["vocab_size"]), hidden_size=int(g["hidden_size"]),
        intermediate_size=int(g["intermediate_size"]), num_hidden_layers=len(cfg.moe),
        num_attention_heads=int(g["num_attention_heads"]), kv_lora_rank=int(g["kv_lora_rank"]),
        q_lora_rank=int(g["q_lora_rank"]), qk_nope_head_dim=int(g["qk_nope_head_dim"]),
        qk_rope_head_dim=int(g["qk_rope_head_dim"]), v_head_dim=int(g["v_head_dim"]),
        max_position_embeddings=int(g["max_position_embeddings"]), rms_norm_eps=float(g["rms_norm_eps"]),
        tie_word_embeddings=bool(g["tie_word_embeddings"]), bos_token_id=g.get("bos_token_id"),
        eos_token_id=g.get("eos_token_id"))


def dots3_model_config(cfg: Dots3Config) -> ModelConfig:
    """What the engine reads of any model (vocabulary, special tokens, context, widths) for a dots3-note checkpoint:
    the widths of its first layer that is not sliding."""
    g = cfg.g
    w = next((w for w, k in zip(cfg.widths, cfg.kinds) if k != SLIDING), cfg.widths[0])
    return ModelConfig(
        family="dots3_note", model_type="dots3_note", vocab_size=int(g["vocab_size"]),
        hidden_size=int(g["hidden_size"]), intermediate_size=int(g["intermediate_size"]),
        num_hidden_layers=len(cfg.kinds), num_attention_heads=w["num_attention_heads"],
        kv_lora_rank=w["kv_lora_rank"], q_lora_rank=w["q_lora_rank"], qk_nope_head_dim=w["qk_nope_head_dim"],
        qk_rope_head_dim=w["qk_rope_head_dim"], v_head_dim=w["v_head_dim"],
        max_position_embeddings=int(g["max_position_embeddings"]), rms_norm_eps=float(g["rms_norm_eps"]),
        tie_word_embeddings=bool(g["tie_word_embeddings"]), bos_token_id=g.get("bos_token_id"),
        eos_token_id=g.get("eos_token_id"))


__all__ = ["RowCacheKinds", "dots3_kinds", "dots3_model_config", "hy_v4_kinds", "hy_v4_model_config"]
