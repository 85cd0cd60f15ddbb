"""The paged latent cache: per layer one tensor ``[num_blocks, block_size, d_c + d_r]``.

Each token's row is ``[norm(c) ; rope(k_r)]`` — the latent first, then the shared RoPE key. Quantised
caches (fp8 e4m3, int8) keep, beside it, ``scales [num_blocks, block_size, 2]`` fp32: one per-token scale
for the latent part and one for the RoPE part. Block ids are shared by every layer (and every
tensor-parallel rank): block ``i`` of a sequence is the same block in all layers.

A model with sparse attention (DeepSeek-V3.2's indexer) keeps, in the same blocks, each token's indexer key:
``index [num_blocks, block_size, d_I]`` per layer in its own element type (``dtypes.index_cache_dtype``; fp8 with
``index_scales [num_blocks, block_size, ceil(d_I / 128)]``). Whatever moves a block (prefix caching, the host and disk
tiers, ``warm``) moves its indexer keys with its latents: they are part of the block's payload (``block_views``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_kernels.dtypes import FLOAT_CACHE_DTYPES, is_quantized
from mla_kernels.sparse import index_scale_groups
from mla_runtime.cache.state_cache import StateCache


@dataclass
class LayerCache:
    kv: torch.Tensor  # [num_blocks, block_size, d_c + d_r]
    scales: torch.Tensor | None  # [num_blocks, block_size, 2] fp32 for fp8/int8, else None
    index: torch.Tensor | None = None  # [num_blocks, block_size, d_I]: the sparse-attention indexer's keys
    index_scales: torch.Tensor | None = None  # [num_blocks, block_size, ceil(d_I / 128)] fp32 for an fp8 index

    @property
    def flat_scales(self) -> torch.Tensor | None:
        """The scales as ``[num_slots, 2]`` (a view), as the compiled CPU kernels take them; None for a float cache."""
        return None if self.scales is None else self.scales.view(-1, self.scales.shape[-1])


class LatentCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, latent_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", index_dim: int = 0,
                 index_dtype: torch.dtype | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.latent_dim = latent_dim
        self.dtype = dtype
        self.index_dim = index_dim
        self.index_dtype = index_dtype or (dtype if dtype in FLOAT_CACHE_DTYPES else torch.bfloat16)
        if index_dim and self.index_dtype not in (*FLOAT_CACHE_DTYPES, torch.float8_e4m3fn):
            raise ValueError(f"index_dtype: the indexer's keys are kept as a float or fp8, not {self.index_dtype}")
        quantised = is_quantized(dtype)
        self.layers = [
            LayerCache(
                kv=torch.zeros(num_blocks, block_size, latent_dim, dtype=dtype, device=device),
                scales=(torch.ones(num_blocks, block_size, 2, dtype=torch.float32, device=device)
                        if quantised else None),
                index=(torch.zeros(num_blocks, block_size, index_dim, dtype=self.index_dtype, device=device)
                       if index_dim else None),
                index_scales=(torch.ones(num_blocks, block_size, index_scale_groups(index_dim), dtype=torch.float32,
                                         device=device)
                              if index_dim and self.index_dtype == torch.float8_e4m3fn else None))
            for _ in range(num_layers)]
        # a hybrid model's per-sequence states (its linear-attention layers'), allocated beside this cache by its owner
        self.states: StateCache | None = None

    @property
    def quantised(self) -> bool:
        return is_quantized(self.dtype)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def nbytes(self) -> int:
        """Bytes really allocated for the cache (all layers, scales included)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in _tensors(layer))

    def bytes_per_token(self) -> int:
        return self.nbytes() // self.num_slots

    # -- one block as bytes (the payload of the prefix cache's lower tiers) --------------------------
    def block_views(self, block: int) -> list[torch.Tensor]:
        """``block``'s rows as flat uint8 views, in payload order: every layer's latents, then every layer's
        scales (fp8/int8 caches), then every layer's indexer keys and their scales (sparse attention). Their sizes
        add up to ``block_bytes()``."""
        parts = [_tensors_in_order(layer)[k] for k in range(4) for layer in self.layers]
        return [t[block].reshape(-1).view(torch.uint8) for t in parts if t is not None]

    def block_bytes(self) -> int:
        return self.nbytes() // self.num_blocks

    def read_block(self, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``block``'s payload (``block_views`` concatenated) as one uint8 tensor on the cache's device, or written
        into ``out`` when it is on that device too."""
        return torch.cat(self.block_views(block), out=out)

    def write_block(self, block: int, payload: torch.Tensor) -> None:
        """Fill ``block`` from a payload laid out as ``read_block`` makes it (on any device)."""
        offset = 0
        for view in self.block_views(block):
            view.copy_(payload[offset:offset + view.numel()])
            offset += view.numel()


def _tensors_in_order(layer: LayerCache) -> tuple[torch.Tensor | None, ...]:
    return layer.kv, layer.scales, layer.index, layer.index_scales


def _tensors(layer: LayerCache) -> list[torch.Tensor]:
    return [t for t in _tensors_in_order(layer) if t is not None]
