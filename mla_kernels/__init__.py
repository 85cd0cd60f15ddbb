"""mla_kernels: the attention kernels of mla-runtime (Triton on CUDA, vectorised torch on CPU).

Every public function takes ``backend="triton" | "torch" | None`` (None: "triton" for CUDA tensors, else
"torch"), except the CPU decode fast path of ``decode_cpu``, the plan builders and ``index_key_rows`` (torch
only); fp32 references for all of them live in :mod:`mla_kernels.reference`. DeepSeek Sparse Attention (the
indexer's key cache, its top-k selection, MLA over the selected tokens) is in :mod:`mla_kernels.sparse`.
This package never imports ``mla_runtime``.
"""

from .common import default_backend, dequantize_rows, quantize_per_token
from .decode import mla_decode
from .decode_cpu import DecodePlan, mla_decode_planned, plan_decode, plan_decode_lists, write_latent
from .latent_store import gather_latent, store_latent
from .prefill import prefill_attention, selected_prefill_attention
from .sparse import (
    index_key_rows,
    indexer_scores,
    indexer_topk,
    sparse_mla_decode,
    sparse_plan,
    store_index_keys,
    topk_lowest_first,
)

__all__ = [
    "DecodePlan",
    "default_backend",
    "dequantize_rows",
    "gather_latent",
    "index_key_rows",
    "indexer_scores",
    "indexer_topk",
    "mla_decode",
    "mla_decode_planned",
    "plan_decode",
    "plan_decode_lists",
    "prefill_attention",
    "selected_prefill_attention",
    "quantize_per_token",
    "sparse_mla_decode",
    "sparse_plan",
    "store_index_keys",
    "store_latent",
    "topk_lowest_first",
    "write_latent",
]
