"""The paged latent cache: per layer one tensor ``[num_blocks, block_size, d_c + d_r]``.

Each token's row is ``[norm(c) ; rope(k_r)]`` — the latent first, then the shared RoPE key. Quantised
caches (fp8 e4m3, int8) keep, beside it, ``scales [num_blocks, block_size, 2]`` fp32: one per-token scale
for the latent part and one for the RoPE part. Block ids are shared by every layer (and every
tensor-parallel rank): block ``i`` of a sequence is the same block in all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mla_kernels.dtypes import is_quantized


@dataclass
class LayerCache:
    kv: torch.Tensor  # [num_blocks, block_size, d_c + d_r]
    scales: torch.Tensor | None  # [num_blocks, block_size, 2] fp32 for fp8/int8, else None


class LatentCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, latent_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.latent_dim = latent_dim
        self.dtype = dtype
        quantised = is_quantized(dtype)
        self.layers = [
            LayerCache(
                kv=torch.zeros(num_blocks, block_size, latent_dim, dtype=dtype, device=device),
                scales=(torch.ones(num_blocks, block_size, 2, dtype=torch.float32, device=device)
                        if quantised else None))
            for _ in range(num_layers)]

    @property
    def quantised(self) -> bool:
        return is_quantized(self.dtype)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def nbytes(self) -> int:
        """Bytes really allocated for the cache (all layers, scales included)."""
        total = 0
        for layer in self.layers:
            total += layer.kv.numel() * layer.kv.element_size()
            if layer.scales is not None:
                total += layer.scales.numel() * layer.scales.element_size()
        return total

    def bytes_per_token(self) -> int:
        return self.nbytes() // self.num_slots
