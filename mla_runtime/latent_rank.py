"""Latent-rank truncation: cache ``r < d_c`` values per token and fold the rest into the weights.

For each layer an orthonormal basis ``B [d_c, r]`` is chosen; the cache then holds ``c' = Bᵀ c`` (``c``
the normalised latent) and ``kv_b_proj`` becomes ``W B``, so keys and values are rebuilt from the
projection ``B Bᵀ c`` of the latent. Two ways to choose ``B``:

- ``svd``: the top right-singular vectors of ``kv_b_proj`` (``W = U S Vᵀ``, ``B = V[:, :r]``): the
  directions of latent space the up-projection amplifies most; needs no data;
- ``pca``: the top eigenvectors of the latents' second moment ``E[c cᵀ]`` collected on calibration
  text, weighted by ``W``: ``B`` maximises ``E‖W B Bᵀ c‖²``, i.e. the eigenvectors of
  ``Σ^{1/2} WᵀW Σ^{1/2}`` mapped back — usually better, because it spends the rank where the
  latents actually are.

At ``r = d_c`` both bases are square orthonormal and the model is reproduced exactly (up to rounding).

Under tensor parallelism every rank calls these functions together: the calibration forward passes run
on every shard (they contain the model's collectives), the heads' rows of each ``kv_b_proj`` are
gathered on rank 0, which computes the basis from the whole matrix — so it is the single-rank basis —
and broadcasts it; each rank then folds it into its own rows. The latent is replicated across ranks,
so one basis serves every head and both cache layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.kernel_plan import KernelPlan
from mla_runtime.layers.linear import Linear
from mla_runtime.layers.mla import MLAttention
from mla_runtime.models.deepseek import DeepseekForCausalLM

METHODS = ("svd", "pca")


def _attn_layers(model: DeepseekForCausalLM) -> list[MLAttention]:
    return model.attention_layers()


def _layer_bases(model: DeepseekForCausalLM, rank: int,
                 basis: Callable[[int, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """``basis(layer, W)`` for every layer, ``W`` the layer's whole ``kv_b_proj`` weight ``[n_h (d_n + d_v), d_c]``
    in fp32. Under tensor parallelism ``W`` is gathered on rank 0 (one layer at a time), the basis is
    computed there and broadcast, so every rank returns the same ``[d_c, r]`` bases."""
    par = model.par
    bases = []
    for i, attn in enumerate(_attn_layers(model)):
        w = par.gather_to_first(attn.kv_b_proj.weight.float(), dim=0)  # heads' rows in order
        if w is not None:
            b = basis(i, w).float().contiguous()
        else:
            b = torch.empty(attn.d_c, rank, dtype=torch.float32, device=attn.kv_b_proj.weight.device)
        bases.append(par.broadcast_from_first(b))
    return bases


def svd_bases(model: DeepseekForCausalLM, rank: int) -> list[torch.Tensor]:
    def top_right_singular(_layer: int, w: torch.Tensor) -> torch.Tensor:
        _, _, vh = torch.linalg.svd(w, full_matrices=True)
        return vh[:rank].T  # [d_c, r]

    return _layer_bases(model, rank, top_right_singular)


@torch.inference_mode()
def latent_second_moments(model: DeepseekForCausalLM, token_chunks: Sequence[Sequence[int]],
                          block_size: int = 64) -> list[torch.Tensor]:
    """``E[c cᵀ]`` per layer (fp64) of the normalised latents the model produces on ``token_chunks``."""
    cfg = model.config
    moments = [torch.zeros(a.d_c, a.d_c, dtype=torch.float64) for a in _attn_layers(model)]
    device = model.lm_head_weight.device
    count = 0
    hooks = []
    for i, attn in enumerate(_attn_layers(model)):
        def hook(_module, _inp, out, i=i):
            c = out.double().reshape(-1, out.shape[-1])
            moments[i] += (c.T @ c).cpu()
        hooks.append(attn.kv_a_layernorm.register_forward_hook(hook))
    try:
        for chunk in token_chunks:
            blocks = -(-len(chunk) // block_size)
            local_block = block_size // model.par.world_size if model.par.sharded_cache else block_size
            cache = LatentCache(model.num_cache_layers, blocks, local_block, _attn_layers(model)[0].d_c
                                + cfg.qk_rope_head_dim, model.dtype, device, cfg.index_dim)
            batch = ForwardBatch.build([list(chunk)], [0], [list(range(blocks))], block_size, device)
            model(batch, cache)
            count += len(chunk)
    finally:
        for h in hooks:
            h.remove()
    if count == 0:
        raise ValueError("calibration text is empty")
    return [m / count for m in moments]


def pca_bases(model: DeepseekForCausalLM, rank: int, token_chunks: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    moments = latent_second_moments(model, token_chunks)

    def weighted_pca(layer: int, w: torch.Tensor) -> torch.Tensor:
        if not moments[layer].any():  # a layer the calibration pass does not run (the MTP layer): its SVD basis
            return torch.linalg.svd(w, full_matrices=True)[2][:rank].T
        w = w.double().cpu()
        evals, evecs = torch.linalg.eigh(moments[layer])
        root = evecs @ torch.diag(evals.clamp(min=0).sqrt()) @ evecs.T  # Σ^{1/2}
        m = root @ (w.T @ w) @ root
        _, vecs = torch.linalg.eigh(m)
        top = root @ vecs[:, -rank:]  # directions in latent space, not yet orthonormal
        q, _ = torch.linalg.qr(top)
        return q.to(model.lm_head_weight.device)

    return _layer_bases(model, rank, weighted_pca)


CALIBRATION_TOKENS = 16384  # calibration tokens the PCA reads by default
CALIBRATION_CHUNK = 512  # tokens per calibration sequence


def calibration_chunks(docs: Sequence[Sequence[int]], max_tokens: int = CALIBRATION_TOKENS) -> list[list[int]]:
    """The first ``max_tokens`` tokens of ``docs`` (token-id lists), as sequences of ``CALIBRATION_CHUNK``."""
    ids = [t for doc in docs for t in doc][:max_tokens]
    return [ids[i:i + CALIBRATION_CHUNK] for i in range(0, len(ids), CALIBRATION_CHUNK)]


def calibration_from_file(projection: str, path: str | None, encode: Callable[[str], list[int]] | None
                          ) -> list[list[int]] | None:
    """Token chunks of the calibration text file for the PCA projection (None for SVD, which needs no data)."""
    if projection != "pca":
        return None
    text = Path(path or "").read_text(encoding="utf-8")
    if encode is None:
        raise ValueError("latent_calibration needs a tokenizer in the checkpoint directory")
    return calibration_chunks([encode(text)])


def check_latent_rank(rank: object, kv_lora_rank: int) -> None:
    """A latent rank must be an integer in ``[1, kv_lora_rank]`` (it can only drop latent dimensions)."""
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= kv_lora_rank:
        raise ValueError(f"latent_rank must be an integer in [1, kv_lora_rank={kv_lora_rank}], got {rank!r}")


def truncate_latent_rank(model: DeepseekForCausalLM, rank: int, method: str = "svd",
                         calibration: Sequence[Sequence[int]] | None = None) -> DeepseekForCausalLM:
    """Truncate every layer's cached latent to ``rank`` values, in place; returns the model, whose
    ``config.kv_lora_rank`` now reads ``rank`` (the cache width follows it). Under tensor parallelism every
    rank calls it, with the same ``calibration``."""
    check_latent_rank(rank, model.config.kv_lora_rank)
    if method not in METHODS:
        raise ValueError(f"latent projection method must be one of {METHODS}, got {method!r}")
    if method == "pca":
        if not calibration:
            raise ValueError("latent projection 'pca' needs calibration text")
        bases = pca_bases(model, rank, calibration)
    else:
        bases = svd_bases(model, rank)
    for attn, basis in zip(_attn_layers(model), bases):
        fold_latent_basis(attn, basis, model.plan)
    model.config = model.config.with_overrides(kv_lora_rank=rank)
    model.prepare_attention()  # the backend holds the truncated layers
    return model


def fold_latent_basis(attn: MLAttention, basis: torch.Tensor, plan: KernelPlan) -> None:
    """Cache ``r`` values per token instead of ``d_c``: ``c' = basisᵀ norm(c)`` with ``basis [d_c, r]``
    orthonormal, and ``kv_b_proj`` folded to ``W · basis`` so that ``W c ≈ (W basis) c'`` (prepared for ``plan``)."""
    basis = basis.to(attn.kv_b_proj.weight.device, attn.kv_b_proj.weight.dtype)
    down = basis.T.contiguous() if attn.latent_down is None else (attn.latent_down.T @ basis).T.contiguous()
    folded = attn.kv_b_proj.weight @ basis  # [n_h (d_n + d_v), r]
    attn.kv_b_proj = Linear(basis.shape[1], folded.shape[0], folded.dtype)
    attn.kv_b_proj.weight.data.copy_(folded)
    attn.latent_down = torch.nn.Parameter(down, requires_grad=False)
    attn.d_c = basis.shape[1]
    if attn.w_uk is not None:
        attn.kv_b_proj.prepare_inference(plan)
        attn.prepare_inference(plan)
