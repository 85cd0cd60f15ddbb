"""The whole model through the paged latent cache, through each attention backend (the torch reference, Triton and
the CPU backend's planned and compiled decodes), equals transformers; quantised caches stay within a bounded logit
error of the 16-bit cache. (The sharded backend's reference test is in test_tensor_parallel.py.)"""

from __future__ import annotations

import pytest
import torch

from mla_runtime.loader import load_model
from tests.model_utils import PagedRunner, hf_logits
from tests.test_model_parity import prompts, rel_err

BACKENDS = ["torch", "triton", "cpu"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [None, 1, 7, 64])
def test_chunked_prefill_matches_transformers(tiny_checkpoint, backend, chunk):
    ckpt, hf = tiny_checkpoint("v3")
    model = load_model(ckpt, dtype="float32", backend=backend)
    ps = prompts([70, 23, 9] if chunk != 1 else [20, 9], seed=5)
    for p, got in zip(ps, PagedRunner(model, len(ps), 80).prefill(ps, chunk=chunk)):
        assert rel_err(got, hf_logits(hf, p)) <= 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["naive", "absorbed"])
def test_prefix_then_decode_matches_transformers(tiny_checkpoint, backend, path):
    ckpt, hf = tiny_checkpoint("v2_group")
    model = load_model(ckpt, dtype="float32", backend=backend, attention_path=path)
    ps = prompts([33, 18], seed=6)
    runner = PagedRunner(model, len(ps), 40, block_size=16)
    first = runner.step({i: p[:-4] for i, p in enumerate(ps)})
    logits = {i: [first[i]] for i in range(len(ps))}
    for t in range(4, 0, -1):
        for i, lg in runner.step({i: [p[-t]] for i, p in enumerate(ps)}).items():
            logits[i].append(lg)
    for i, p in enumerate(ps):
        assert rel_err(torch.cat(logits[i]), hf_logits(hf, p)) <= 1e-4


def test_each_backend_name_resolves_for_its_device(tiny_checkpoint):
    from mla_runtime import attention

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attention.resolve(None, cpu) == "cpu" and attention.resolve(None, cuda) == "triton"
    assert attention.resolve("torch", cuda) == "torch"
    with pytest.raises(ValueError, match="runs on the CPU"):
        attention.resolve("cpu", cuda)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        attention.resolve("flash", cpu)
    ckpt, _ = tiny_checkpoint("v3")
    assert [load_model(ckpt, dtype="float32", backend=b).attention.name for b in (None, "torch")] == ["cpu", "torch"]


@pytest.mark.parametrize("cache_dtype, median_bound, min_agree", [(torch.int8, 0.02, 0.95),
                                                                    (torch.float8_e4m3fn, 0.08, 0.85)])
def test_quantised_cache_logit_error_is_bounded(tiny_checkpoint, cache_dtype, median_bound, min_agree):
    """Quantisation error alone: an fp32 model with a quantised cache against the same model with an
    unquantised cache. The random tiny MoE model is chaotic (a flipped expert choice moves a token's
    logits far), so the bound is on the median token and on top-1 agreement; the maximum is printed."""
    ckpt, _ = tiny_checkpoint("v3")
    model = load_model(ckpt, dtype="float32", backend="torch")
    ps = prompts([60, 31, 45], seed=7)
    ref = torch.cat(PagedRunner(model, len(ps), 64).prefill(ps, chunk=16))
    got = torch.cat(PagedRunner(model, len(ps), 64, cache_dtype=cache_dtype).prefill(ps, chunk=16))
    per_token = (got - ref).abs().amax(-1) / ref.abs().amax(-1)
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"\n{cache_dtype} cache vs fp32 cache: relative logit error median {per_token.median():.4f}, "
          f"p90 {per_token.quantile(0.9):.4f}, max {per_token.max():.4f}; top-1 agreement {agree:.3f}")
    assert 0 < float(per_token.median()) <= median_bound
    assert agree >= min_agree
