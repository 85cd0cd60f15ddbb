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

    # -- one block as bytes (the payload of the prefix cache's lower tiers) --------------------------
    def block_views(self, block: int) -> list[torch.Tensor]:
        """``block``'s rows as flat uint8 views, in payload order: every layer's latents, then every layer's
        scales (fp8/int8 caches). Their sizes add up to ``block_bytes()``."""
        views = [layer.kv[block].view(-1).view(torch.uint8) for layer in self.layers]
        views += [layer.scales[block].view(-1).view(torch.uint8) for layer in self.layers if layer.scales is not None]
        return views

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
