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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.models.deepseek import DeepseekForCausalLM

METHODS = ("svd", "pca")


def _attn_layers(model: DeepseekForCausalLM):
    return [layer.self_attn for layer in model.model.layers]


def svd_bases(model: DeepseekForCausalLM, rank: int) -> list[torch.Tensor]:
    bases = []
    for attn in _attn_layers(model):
        w = attn.kv_b_proj.weight.float()  # [n_h (d_n + d_v), d_c]
        _, _, vh = torch.linalg.svd(w, full_matrices=True)
        bases.append(vh[:rank].T.contiguous())  # [d_c, r]
    return bases


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
            cache = LatentCache(cfg.num_hidden_layers, blocks, block_size, model.model.layers[0].self_attn.d_c
                                + cfg.qk_rope_head_dim, model.dtype, device)
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
    bases = []
    for attn, sigma in zip(_attn_layers(model), latent_second_moments(model, token_chunks)):
        w = attn.kv_b_proj.weight.double().cpu()
        evals, evecs = torch.linalg.eigh(sigma)
        root = evecs @ torch.diag(evals.clamp(min=0).sqrt()) @ evecs.T  # Σ^{1/2}
        m = root @ (w.T @ w) @ root
        _, vecs = torch.linalg.eigh(m)
        top = root @ vecs[:, -rank:]  # directions in latent space, not yet orthonormal
        q, _ = torch.linalg.qr(top)
        bases.append(q.float().contiguous())
    return bases


def truncate_latent_rank(model: DeepseekForCausalLM, rank: int, method: str = "svd",
                         calibration: Sequence[Sequence[int]] | None = None) -> DeepseekForCausalLM:
    """Truncate every layer's cached latent to ``rank`` values, in place; returns the model, whose
    ``config.kv_lora_rank`` now reads ``rank`` (the cache width follows it)."""
    d_c = model.config.kv_lora_rank
    if not 1 <= rank <= d_c:
        raise ValueError(f"latent_rank must be in [1, kv_lora_rank={d_c}], got {rank}")
    if method not in METHODS:
        raise ValueError(f"latent projection method must be one of {METHODS}, got {method!r}")
    if model.par.enabled:
        raise ValueError("latent_rank is not supported with tensor_parallel_size > 1")
    if method == "pca":
        if not calibration:
            raise ValueError("latent projection 'pca' needs calibration text")
        bases = pca_bases(model, rank, calibration)
    else:
        bases = svd_bases(model, rank)
    for attn, basis in zip(_attn_layers(model), bases):
        attn.truncate_latent(basis)
    model.config = model.config.with_overrides(kv_lora_rank=rank)
    return model
