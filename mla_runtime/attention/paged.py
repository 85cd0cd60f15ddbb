"""The reference backend: attention over the paged latent cache with ``mla_kernels``' Triton or torch kernels.

A step takes one of two paths, equal up to rounding (each is the other's oracle; ``layers/mla.py`` has the math):

- **naive / up-projected** (long prefill chunks): gather each sequence's latents, rebuild its keys and values with
  ``kv_b_proj`` and run causal varlen attention per head;
- **absorbed** (decodes, short chunks): fold ``W_UK`` into the queries, attend over the latent as MQA with one
  ``d_c + d_r`` key per token (read once for all heads), and unfold the output through ``W_UV``.

``prepare`` picks the path of the whole step by FLOP count (or the forced one). ``write`` stores each layer's new
latents, ``forward`` attends: each takes the layer's id, its tensors and the step's metadata, and reads what it needs
of the layer from the ``AttentionLayer`` handed over by ``prepare_layer``. The CPU and sharded backends
(``attention/cpu.py``, ``attention/sharded.py``) change what they need and inherit the rest.
"""

from __future__ import annotations

import torch

from mla_kernels import gather_latent, indexer_topk, mla_decode, prefill_attention, sparse_mla_decode, store_latent
from mla_runtime.attention.layer import AttentionLayer, LayerKernels
from mla_runtime.attention.metadata import AttentionDims, AttentionMetadata, choose_path, host_cu_seqlens
from mla_runtime.attention.rope_tables import RopeTables
from mla_runtime.cache.latent_cache import LatentCache, LayerCache
from mla_runtime.forward_batch import ForwardBatch


class PagedBackend:
    """Attention through ``mla_kernels`` with ``kernels`` ("triton" or "torch") and a path (``auto`` by cost)."""

    def __init__(self, kernels: str, path: str = "auto") -> None:
        self.name = kernels  # the registry's name (attention.BACKENDS): triton or torch
        self.kernels = kernels
        self.path = path
        self.layers: dict[int, AttentionLayer] = {}  # prepare_layer's, by layer id
        # True: a row's bits must not depend on the rows beside it (the model's rows_invariant): a sparse layer's
        # indexer selects for every step, and every row attends over its selection by the same path
        self.rows_invariant = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kernels={self.kernels!r}, path={self.path!r})"

    # -- once per load and per step --------------------------------------------------------------
    def prepare_layer(self, layer: AttentionLayer) -> LayerKernels:
        """Keep ``layer`` (once its weights are final, and again whenever they change); the compiled kernels that run
        it (none here)."""
        self.layers[layer.layer_id] = layer
        return LayerKernels()

    def prepare(self, batch: ForwardBatch, rope: RopeTables, dims: AttentionDims, cache: LatentCache
                ) -> AttentionMetadata:
        """The step's metadata: every layer attends through it."""
        return AttentionMetadata(self, batch, rope, batch.slot_mapping, batch.token_seq_lens,
                                 choose_path(batch, dims, self.path, self.rows_invariant), host_cu_seqlens(batch))

    def compiled_rows(self, meta: AttentionMetadata, cache: LayerCache) -> bool:
        """Whether the step's rows take the compiled CPU decode kernels (never, here)."""
        return False

    # -- per layer -------------------------------------------------------------------------------
    def write(self, layer_id: int, q: torch.Tensor, latent: torch.Tensor, meta: AttentionMetadata,
              cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' ``[norm(c) ; rope(k_r)]`` and return the queries ``q_n [T, n_h, d_n]`` and rotated
        ``q_r [T, n_h, d_r]``; ``q``, ``latent``: the layer's projections (``MLAttention.project``)."""
        layer = self.layers[layer_id]
        q_n, q_r, c, k_r = layer.split(q, latent)
        q_r, k_r = layer.rotate(meta.batch.positions, q_r, k_r, meta.rope)
        self.store(layer, c, k_r, meta, cache)
        return q_n, q_r

    def store(self, layer: AttentionLayer, c: torch.Tensor, k_r: torch.Tensor, meta: AttentionMetadata,
              cache: LayerCache) -> None:
        store_latent(cache.kv, cache.scales, c, k_r, meta.slot_mapping, backend=self.kernels, validate=layer.validate)

    def forward(self, layer_id: int, q_n: torch.Tensor, q_r: torch.Tensor, meta: AttentionMetadata,
                cache: LayerCache) -> torch.Tensor:
        """Attention of ``meta.batch``'s queries over the latents in ``cache`` -> ``[T, n_h, d_v]``."""
        return self.attend(q_n, q_r, self.layers[layer_id], meta, cache)

    def attend(self, q_n: torch.Tensor, q_r: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata,
               cache: LayerCache) -> torch.Tensor:
        if meta.path == "absorbed":
            return unabsorb(self.latent_attention(absorb(q_n, q_r, layer), layer, meta, cache), layer)
        return self.naive(q_n, q_r, layer, meta, cache)

    def select(self, q: torch.Tensor, w: torch.Tensor, meta: AttentionMetadata, cache: LayerCache, topk: int
               ) -> torch.Tensor:
        """The sparse-attention indexer's choice: each query's ``topk`` token positions of highest score
        ``sum_h w[t, h] relu(q[t, h] . k_j)`` over the indexer keys in ``cache`` (``-1``: none) -> ``[T, topk]``."""
        batch = meta.batch
        assert cache.index is not None
        return indexer_topk(q, w, cache.index, cache.index_scales, batch.block_tables, batch.token_req_idx,
                            meta.token_seq_lens, topk, backend=self.kernels)

    def sparse_forward(self, layer_id: int, q_n: torch.Tensor, q_r: torch.Tensor, meta: AttentionMetadata,
                       cache: LayerCache, selected: torch.Tensor) -> torch.Tensor:
        """Sparse attention: each query over only the token positions ``selected [T, topk]`` for it (``-1``: none),
        absorbed -> ``[T, n_h, d_v]``."""
        layer, batch = self.layers[layer_id], meta.batch
        o_lat, _ = sparse_mla_decode(absorb(q_n, q_r, layer), cache.kv, cache.scales, batch.block_tables,
                                     batch.token_req_idx, selected, layer.scale, layer.d_c, backend=self.kernels)
        return unabsorb(o_lat, layer)

    def latent_attention(self, q_cat: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata,
                         cache: LayerCache) -> torch.Tensor:
        """MQA of the absorbed queries ``[T, n_h, d_c + d_r]`` over the latent -> ``[T, n_h, d_c]``."""
        batch = meta.batch
        o_lat, _ = mla_decode(q_cat, cache.kv, cache.scales, batch.block_tables, meta.token_seq_lens, layer.scale,
                              layer.d_c, req_indices=batch.token_req_idx, backend=self.kernels,
                              validate=layer.validate)
        return o_lat

    def naive(self, q_n: torch.Tensor, q_r: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata,
              cache: LayerCache) -> torch.Tensor:
        """The up-projected path: keys and values rebuilt from the gathered latents -> ``[T, n_h, d_v]``."""
        k_n, k_r_all, v = rebuilt(layer, meta, cache, q_n.dtype, self.kernels)
        return self.up_projected(q_n, q_r, k_n, k_r_all, v, layer, meta)

    def up_projected(self, q_n: torch.Tensor, q_r: torch.Tensor, k_n: torch.Tensor, k_r: torch.Tensor,
                     v: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata) -> torch.Tensor:
        """Causal attention of the batch's queries over its sequences' rebuilt keys ``k_n [S, n_h, d_n]``, RoPE keys
        ``k_r [S, d_r]`` and values ``v [S, n_h, d_v]`` -> ``[T, n_h, d_v]``."""
        batch = meta.batch
        o, _ = prefill_attention(q_n, q_r, k_n, k_r, v, batch.query_start_loc, batch.seq_start_loc, layer.scale,
                                 backend=self.kernels, host_cu_seqlens=meta.host_cu_seqlens, validate=layer.validate)
        return o


def rebuilt(layer: AttentionLayer, meta: AttentionMetadata, cache: LayerCache, dtype: torch.dtype, kernels: str
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys ``k_n [S, n_h, d_n]``, RoPE keys ``k_r [S, d_r]`` and values ``v [S, n_h, d_v]`` of the batch's
    sequences, rebuilt from their gathered latents (``kv_b_proj``)."""
    batch = meta.batch
    latent = gather_latent(cache.kv, cache.scales, batch.block_tables, batch.seq_lens, dtype, layer.d_c,
                           backend=kernels, host_lens=batch.key_lens)  # [S, d_c + d_r]; host lengths: no sync
    c_all, k_r_all = latent.split([layer.d_c, layer.d_r], dim=-1)
    kv = layer.rebuild(c_all).view(-1, layer.n_h, layer.d_n + layer.d_v)
    k_n, v = kv.split([layer.d_n, layer.d_v], dim=-1)
    return k_n, k_r_all, v


def absorbed_weights(layer: AttentionLayer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_UK [n_h, d_n, d_c]`` and ``W_UVᵀ [n_h, d_c, d_v]`` in ``dtype`` (widened where they are the compiled
    kernel's bfloat16 copies of an int8 model)."""
    if layer.w_uk.dtype != dtype:
        return layer.w_uk.to(dtype), layer.w_uv_t.to(dtype)
    return layer.w_uk, layer.w_uv_t


def absorb(q_n: torch.Tensor, q_r: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    """``[W_UKᵀ q_n ; q_r]`` -> ``[T, n_h, d_c + d_r]``."""
    w_uk, _ = absorbed_weights(layer, q_n.dtype)
    return torch.cat([torch.bmm(q_n.transpose(0, 1), w_uk).transpose(0, 1), q_r], dim=-1)


def unabsorb(o_lat: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    """``W_UV o_lat`` -> ``[T, n_h, d_v]``."""
    _, w_uv_t = absorbed_weights(layer, o_lat.dtype)
    return torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)
