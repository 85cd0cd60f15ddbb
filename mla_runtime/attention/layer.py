"""``AttentionLayer``: what an attention backend holds of one MLA layer, so that it takes tensors and a layer id.

The layer module (``layers/mla.py``) computes its projections; the backend stores the new latents and attends. What
the backend needs of the layer besides the step's tensors is handed over once its weights are final, and again
whenever they change (``DeepseekForCausalLM.prepare_attention``: after loading, a latent-rank truncation or
quantisation's rounding of the absorbed factors): its widths and softmax scale, the absorbed factors, the key and
value rebuild, the latent's norm and the RoPE. The backend keeps it per layer id (``PagedBackend.prepare_layer``)
and answers which compiled kernels take the layer (``LayerKernels``), which the layer records: that is decided there,
once per layer, and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mla_runtime.attention.rope_tables import RopeTables

Tensor = torch.Tensor


@dataclass(frozen=True)
class LayerKernels:
    """The compiled CPU kernels that run a layer (``CpuBackend.prepare_layer``); none on the other backends."""

    prefill: bool = False  # its latent side (norm, RoPE, cache write) and its prefill chunks' attention
    decode: bool = False  # the whole decode step (a float32 model's: ``layers/decoder_kernel.py``)
    attention: bool = False  # the absorbed attention of planned rows (float32 or bfloat16 factors)


@dataclass(frozen=True)
class AttentionLayer:
    """One layer as its backend reads it; every tensor on this rank (``n_h`` of its heads)."""

    layer_id: int  # the layer's cache index (a LongCat layer's blocks: one each; MTP layers after the decoder's)
    dtype: torch.dtype  # the model dtype of its weights (kv_b_proj's: float32 in a float32 model with int8 products)
    n_h: int
    d_c: int
    d_r: int
    d_n: int
    d_v: int
    scale: float  # the softmax scale
    validate: bool  # kernel arguments are checked by this layer (the first: once per step)
    w_uk: Tensor  # [n_h, d_n, d_c]: the absorbed key factor (prepared copies, or views of kv_b_proj)
    w_uv_t: Tensor  # [n_h, d_c, d_v]: the absorbed value factor, transposed
    # the two as the compiled decode kernels read them: the same tensors, or the same values as runs (uint8
    # [n_h, k + k / 4, n]: layers.factor_runs)
    kernel_factors: tuple[Tensor, Tensor]
    rebuild: Callable[[Tensor], Tensor]  # kv_b_proj: the latents c [S, d_c] -> keys and values [S, n_h (d_n + d_v)]
    rebuild_in_bfloat16: bool  # rebuild's products of many rows round them to bfloat16 (``CpuBackend.naive``)
    # project's queries and latent -> q_n [T, n_h, d_n], q_r [T, n_h, d_r], the normed (truncated) latent, k_r
    split: Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor, Tensor]]
    rotate: Callable[[Tensor, Tensor, Tensor, RopeTables], tuple[Tensor, Tensor]]  # (positions, q_r, k_r, tables)
    interleave: bool  # RoPE rotates interleaved pairs
    # the latent's RMSNorm (weight, eps) for a compiled latent side in place of split (the full latent rank); None
    # where the latent rank is truncated (the compiled latent side has no truncation)
    latent_norm: tuple[Tensor, float] | None
    kernels_allowed: bool  # the load's kernel plan lets the compiled CPU kernels run (cpu_gemm "auto", built here)
    sparse: bool  # it selects its keys with an indexer (the CPU backend's indexer operator is built at load)
