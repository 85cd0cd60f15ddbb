"""Latent-rank truncation: exact at full rank, byte arithmetic, and PCA never worse than SVD on its data."""

from __future__ import annotations

import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.latent_rank import latent_second_moments, pca_bases, svd_bases, truncate_latent_rank
from mla_runtime.loader import load_model
from tests.model_utils import PagedRunner
from tests.test_model_parity import prompts, rel_err


def logits(model, ps):
    return PagedRunner(model, len(ps), max(len(p) for p in ps)).prefill(ps, chunk=16)


def test_full_rank_reproduces_the_model(tiny_checkpoint):
    ckpt, _ = tiny_checkpoint("v3")
    ps = prompts([40, 25], seed=3)
    ref = logits(load_model(ckpt, dtype="float32"), ps)
    for method in ("svd", "pca"):
        model = truncate_latent_rank(load_model(ckpt, dtype="float32"), 32, method, calibration=ps)
        assert model.model.layers[0].self_attn.latent_down.shape == (32, 32)
        for got, want in zip(logits(model, ps), ref):
            assert rel_err(got, want) <= 1e-4


def test_truncated_cache_holds_r_values_per_token(tiny_checkpoint):
    ckpt, _ = tiny_checkpoint("v3")
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128, block_size=16, kv_cache_memory="1MiB", latent_rank=12)
    engine, worker = llm.engine, llm.engine.worker
    assert worker.model_config.kv_lora_rank == 12
    assert worker.bytes_per_token == (12 + 16) * 3 * 4
    assert worker.cache.layers[0].kv.shape[-1] == 12 + 16
    assert worker.cache.nbytes() == engine.pool.num_blocks * 16 * worker.bytes_per_token
    assert engine.pool.num_blocks == (1 << 20) // (16 * worker.bytes_per_token)
    out = llm.generate([{"prompt_token_ids": prompts([20])[0]}], SamplingParams(max_tokens=5, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 5
    engine.pool.check_whole()


def test_lower_rank_means_larger_error(tiny_checkpoint):
    ckpt, _ = tiny_checkpoint("v3")
    ps = prompts([48, 30], seed=4)
    ref = torch.cat(logits(load_model(ckpt, dtype="float32"), ps))
    errs = []
    for rank in (24, 8, 2):
        model = truncate_latent_rank(load_model(ckpt, dtype="float32"), rank, "pca", calibration=ps)
        errs.append(float((torch.cat(logits(model, ps)) - ref).abs().mean()))
    assert errs[0] < errs[1] < errs[2]


def test_pca_reconstructs_its_calibration_latents_at_least_as_well_as_svd(tiny_checkpoint):
    """Weighted PCA minimises E‖W (c − B Bᵀ c)‖² over the calibration latents; SVD ignores them."""
    ckpt, _ = tiny_checkpoint("v3")
    model = load_model(ckpt, dtype="float32")
    calib = prompts([64, 64, 40], seed=9)
    moments = latent_second_moments(model, calib)
    for rank in (4, 8, 16):
        for attn, sigma, b_pca, b_svd in zip([layer.self_attn for layer in model.model.layers], moments,
                                             pca_bases(model, rank, calib), svd_bases(model, rank)):
            w = attn.kv_b_proj.weight.double()
            assert reconstruction_error(w, sigma, b_pca) <= reconstruction_error(w, sigma, b_svd) * (1 + 1e-6)


def reconstruction_error(w: torch.Tensor, sigma: torch.Tensor, basis: torch.Tensor) -> float:
    """E‖W (c − B Bᵀ c)‖² for latents with second moment sigma."""
    residual = torch.eye(w.shape[1], dtype=torch.float64) - basis.double() @ basis.double().T
    return float(torch.trace(w @ residual @ sigma @ residual.T @ w.T))
