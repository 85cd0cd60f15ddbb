"""DeepSeek-V2 / V3 / Kimi-K2 decoder: embeddings, MLA + (dense MLP | MoE) layers, final norm, lm_head.

Parameter names mirror the Hugging Face checkpoints (``model.layers.{i}.self_attn.kv_b_proj.weight``...)
so the loader's name table stays short; the only layout changes are fused/stacked weights
(``gate_up_proj`` of an MLP, the ``[E, ...]`` stacks of routed experts).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mla_runtime.attention_metadata import AttentionMetadata, build_attention_metadata
from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.config import ModelConfig
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.layers.cpu_gemm import PackedWeight, linear
from mla_runtime.layers.mla import MLAttention
from mla_runtime.layers.mlp import GatedMLP
from mla_runtime.layers.moe import MoE
from mla_runtime.layers.norm import RMSNorm
from mla_runtime.parallel import SINGLE_RANK, ParallelContext


class VocabEmbedding(nn.Module):
    """Token embedding; under tensor parallelism each rank holds ``ceil(V / N)`` rows of the vocabulary."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, par: ParallelContext) -> None:
        super().__init__()
        self.par = par
        self.start, self.stop, rows = par.vocab_split(vocab)
        self.weight = nn.Parameter(torch.zeros(rows, hidden, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.par.enabled:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        return self.par.all_reduce(F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, attention_path: str,
                 backend: str | None, par: ParallelContext) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, dtype, attention_path, backend, par, layer)
        if cfg.is_moe_layer(layer):
            assert cfg.moe is not None
            self.mlp: nn.Module = MoE(cfg.moe, cfg.hidden_size, dtype, cfg.mlp_bias, par)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, cfg.mlp_bias, par)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, par: ParallelContext) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, par)
        self.layers = nn.ModuleList()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DeepseekForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, attention_path: str = "auto",
                 backend: str | None = None, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.par = par
        self.model = DeepseekModel(cfg, dtype, par)
        for i in range(cfg.num_hidden_layers):
            self.model.layers.append(DecoderLayer(cfg, i, dtype, attention_path, backend, par))
        rows = self.model.embed_tokens.weight.shape[0]
        self.lm_head = (None if cfg.tie_word_embeddings else
                        nn.Parameter(torch.zeros(rows, cfg.hidden_size, dtype=dtype), requires_grad=False))

        self.lm_head_packed: PackedWeight | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head

    def prepare_inference(self) -> DeepseekForCausalLM:
        """Derive the inference layouts of the final weights (oneDNN-packed GEMM weights on CPU, contiguous
        absorbed attention weights). Call once the weights are loaded, and again after changing any."""
        for module in self.modules():
            if module is not self and hasattr(module, "prepare_inference"):
                cast(Any, module).prepare_inference()
        self.lm_head_packed = PackedWeight.make(self.lm_head_weight)
        return self

    def attention_layers(self) -> list[MLAttention]:
        return [cast(DecoderLayer, layer).self_attn for layer in self.model.layers]

    def set_attention(self, path: str, backend: str | None) -> None:
        """Choose the attention path (``auto``/``naive``/``absorbed``) and kernel backend (None = by device)."""
        for attn in self.attention_layers():
            attn.path = path
            attn.backend = backend

    def attention_metadata(self, batch: ForwardBatch, cache: LatentCache) -> AttentionMetadata:
        """How every layer attends over ``batch`` this step (one object per step; see ``attention_metadata``)."""
        attn = self.attention_layers()[0]
        rope = attn.rotary.tables(batch.positions, self.dtype)  # every layer's RoPE is the same
        return build_attention_metadata(batch, rope, attn.dims, attn.path, attn.backend, cache.layers[0].kv,
                                        cache.quantised, self.par)

    def forward(self, batch: ForwardBatch, cache: LatentCache, meta: AttentionMetadata | None = None
                ) -> torch.Tensor:
        """Hidden states ``[T, d]`` after the final norm, writing each layer's latent into ``cache``; ``meta``
        defaults to ``attention_metadata(batch, cache)``."""
        meta = meta or self.attention_metadata(batch, cache)
        x = self.model.embed_tokens(batch.input_ids)
        for layer, layer_cache in zip(self.model.layers, cache.layers):
            x = layer(x, meta, layer_cache)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits ``[R, V]`` (under tensor parallelism: on rank 0, None elsewhere)."""
        logits = linear(hidden, self.lm_head_weight, None, self.lm_head_packed).float()
        if not self.par.enabled:
            return logits
        full = self.par.gather_to_first(logits, dim=-1)
        return None if full is None else full[:, : self.config.vocab_size]
