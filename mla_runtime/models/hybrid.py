"""Hybrid decoders: MLA layers between linear-attention layers (Kimi Linear).

A layer of a hybrid is DeepSeek's (input norm, attention, post-attention norm, dense MLP or MoE) with one of two
attentions: MLA over the paged latent cache, or Kimi Delta Attention (``layers.kda``) over the sequence's state slot.
Only the MLA layers are layers of the latent cache (``cache.layers[j]`` for the ``j``-th MLA layer); the ``j``-th
linear layer's states are ``cache.states.layers[j]`` (``cache/state_cache.py``), allocated by the worker beside the
latent cache. Every step carries each sequence's state slot (``ForwardBatch.state_slots``).

The layers run call by call (no compiled whole-layer decode step), and the model has no MTP layers.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from mla_kernels import cpu_tables
from mla_runtime.attention import AttentionMetadata
from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.layers.kda import KimiDeltaAttention
from mla_runtime.layers.mla import MLAttention
from mla_runtime.layers.mlp import GatedMLP
from mla_runtime.layers.moe import MoE
from mla_runtime.layers.norm import RMSNorm
from mla_runtime.models.deepseek import DeepseekForCausalLM
from mla_runtime.resolved_config import ResolvedConfig


class HybridDecoderLayer(nn.Module):
    def __init__(self, rc: ResolvedConfig, layer: int) -> None:
        super().__init__()
        cfg, dtype, par = rc.model, rc.dtype, rc.par
        self.linear = cfg.is_linear_layer(layer)
        # this layer's index among the layers of its kind: its latent cache layer, or its state layer
        self.index = sum(cfg.is_linear_layer(i) == self.linear for i in range(layer))
        self.self_attn: nn.Module = (KimiDeltaAttention(cfg, dtype, self.index) if self.linear
                                     else MLAttention(rc, self.index))
        if cfg.is_moe_layer(layer):
            assert cfg.moe is not None
            self.mlp: nn.Module = MoE(cfg.moe, cfg.hidden_size, dtype, cfg.mlp_bias, par)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, cfg.mlp_bias, par)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def prepare_kernel(self, one_path: bool = False) -> None:
        """No compiled table: the layer runs call by call."""

    def kernel_table(self) -> None:
        return None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: LatentCache) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.linear:
            if cache.states is None:
                raise ValueError("a hybrid model's cache needs its state cache (LatentCache.states)")
            x = x + self.self_attn(h, meta.batch, cache.states.layers[self.index])
        else:
            x = x + self.self_attn(h, meta, cache.layers[self.index])
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridForCausalLM(DeepseekForCausalLM):
    def __init__(self, rc: ResolvedConfig) -> None:
        cfg = rc.model
        if cfg.linear_attention is None:
            raise ValueError(f"{cfg.model_type}: not a hybrid model (no linear-attention layers)")
        if rc.num_mtp_layers:
            raise ValueError(f"{cfg.model_type}: a hybrid model has no MTP layers")
        if rc.par.enabled:
            raise ValueError(f"{cfg.model_type}: hybrid models run on one rank (tensor_parallel_size 1)")
        super().__init__(rc)

    def decoder_layer(self, rc: ResolvedConfig, i: int) -> nn.Module:
        return HybridDecoderLayer(rc, i)

    def attention_layers(self) -> list[MLAttention]:
        """The MLA layers, in cache order."""
        return [cast(MLAttention, layer.self_attn) for layer in self.model.layers
                if not cast(HybridDecoderLayer, layer).linear]

    def linear_layers(self) -> list[KimiDeltaAttention]:
        """The linear-attention layers, in state order."""
        return [cast(KimiDeltaAttention, layer.self_attn) for layer in self.model.layers
                if cast(HybridDecoderLayer, layer).linear]

    @property
    def num_cache_layers(self) -> int:
        return self.config.num_attention_layers

    def forward(self, batch: ForwardBatch, cache: LatentCache, meta: AttentionMetadata | None = None
                ) -> torch.Tensor:
        """Hidden states ``[T, d]`` after the final norm: the MLA layers write their latents into ``cache``, the
        linear layers update each sequence's states in ``cache.states``."""
        meta = meta or self.attention_metadata(batch, cache)
        x = self.model.embed_tokens(batch.input_ids)
        for layer in self.model.layers:
            x = layer(x, meta, cache)
        return cast(torch.Tensor, self.model.norm(x))

    def _decode_step(self, meta: AttentionMetadata, cache: LatentCache) -> cpu_tables.DecodeStep | None:
        return None


def causal_lm(rc: ResolvedConfig) -> DeepseekForCausalLM:
    """The model ``rc`` describes: a hybrid where the config has linear-attention layers, else DeepSeek's."""
    return HybridForCausalLM(rc) if rc.model.linear_attention is not None else DeepseekForCausalLM(rc)
