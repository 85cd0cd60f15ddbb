"""The model equals transformers' DeepseekV2/V3 on tiny random checkpoints (fp32, relative error <= 1e-4), on the
probed CPU GEMM paths and on the forced fallbacks (``gemm_mode``)."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mla_runtime.config import ModelConfig
from mla_runtime.kernel_plan import kernel_plan
from mla_runtime.layers.fp8 import Fp8Weight
from mla_runtime.layers.quantization import quantized_weights
from mla_runtime.loader import CheckpointError, load_model
from tests.checkpoints import VOCAB, dequantized_reference
from tests.model_utils import PagedRunner, hf_logits

PROMPT_LENS = [5, 17, 40, 1]


def prompts(lens=PROMPT_LENS, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lens]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("path", ["naive", "absorbed"])
def test_prefill_logits_match_transformers(tiny_checkpoint, variant, path, gemm_mode):
    ckpt, hf = tiny_checkpoint(variant)
    model = load_model(ckpt, dtype="float32", attention_path=path, cpu_gemm=gemm_mode)
    ps = prompts()
    ours = PagedRunner(model, len(ps), max(PROMPT_LENS)).prefill(ps)
    for p, got in zip(ps, ours):
        assert rel_err(got, hf_logits(hf, p)) <= 1e-4


def test_absorbed_equals_naive(tiny_checkpoint, variant):
    ckpt, _ = tiny_checkpoint(variant)
    ps = prompts(seed=1)
    out = {}
    for path in ("naive", "absorbed"):
        model = load_model(ckpt, dtype="float32", attention_path=path)
        out[path] = PagedRunner(model, len(ps), max(PROMPT_LENS)).prefill(ps)
    for a, b in zip(out["naive"], out["absorbed"]):
        assert rel_err(a, b) <= 2e-5


def test_token_by_token_decode_equals_full_forward(tiny_checkpoint, variant, gemm_mode):
    ckpt, hf = tiny_checkpoint(variant)
    model = load_model(ckpt, dtype="float32", cpu_gemm=gemm_mode)
    ps = prompts([9, 23, 14], seed=2)
    runner = PagedRunner(model, len(ps), max(len(p) for p in ps))
    first = runner.step({i: p[:3] for i, p in enumerate(ps)})  # a short prefill, then one token at a time
    logits = {i: [first[i]] for i in range(len(ps))}
    for t in range(3, max(len(p) for p in ps)):
        step = {i: [p[t]] for i, p in enumerate(ps) if t < len(p)}
        for i, lg in runner.step(step).items():
            logits[i].append(lg)
    for i, p in enumerate(ps):
        assert rel_err(torch.cat(logits[i]), hf_logits(hf, p)) <= 1e-4


def test_sharded_checkpoint(sharded_checkpoint):
    ckpt, hf = sharded_checkpoint
    assert (ckpt / "model.safetensors.index.json").is_file()
    assert len(list(ckpt.glob("*.safetensors"))) > 1
    model = load_model(ckpt, dtype="float32")
    p = prompts([21])[0]
    (got,) = PagedRunner(model, 1, len(p)).prefill([p])
    assert rel_err(got, hf_logits(hf, p)) <= 1e-4


def test_fp8_block_checkpoint_keeps_its_fp8_weights(fp8_checkpoint, tiny_checkpoint, tmp_path):
    _, hf = tiny_checkpoint("v3")
    tensors = load_file(str(fp8_checkpoint / "model.safetensors"))
    assert tensors["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)  # 160 rows → 2 blocks
    assert ModelConfig.from_pretrained(fp8_checkpoint).fp8_block_size == (128, 128)
    reference = dequantized_reference(fp8_checkpoint, tmp_path / "reference")
    model = load_model(fp8_checkpoint, dtype="float32")
    p = prompts([19])[0]
    (got,) = PagedRunner(model, 1, len(p)).prefill([p])
    assert rel_err(got, hf_logits(reference, p)) <= 1e-4
    # and the quantisation really changed the weights (the test would be vacuous otherwise)
    assert rel_err(got, hf_logits(hf, p)) > 1e-4
    # the FP8 matrices stay FP8, one byte per weight (plus a float32 scale per block)
    fp8 = [w for w in quantized_weights(model) if isinstance(w, Fp8Weight)]
    assert fp8 and all(w.weight.dtype == torch.float8_e4m3fn for w in fp8)
    assert sum(w.nbytes for w in fp8) < 1.1 * sum(w.weight.numel() for w in fp8)


def test_fp8_checkpoint_under_two_ranks(fp8_checkpoint):
    """Each rank keeps its whole FP8 blocks (the rest dequantised) and the two ranks compute what one does."""
    from mla_runtime import LLM, SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    p = [{"prompt_token_ids": prompts([13])[0]}]
    outs = []
    for tp in (1, 2):
        llm = LLM(str(fp8_checkpoint), dtype="float32", max_model_len=64, kv_cache_memory="2MiB", block_size=32,
                  tensor_parallel_size=tp)
        try:
            outs.append(llm.generate(p, sp)[0].outputs[0])
        finally:
            llm.shutdown()
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].logprobs, outs[1].logprobs):
        t = next(iter(a))
        assert abs(a[t] - b[t]) < 1e-3


def test_bfloat16_close_to_float32(tiny_checkpoint, gemm_mode):
    """An explicit bf16 load works on every CPU: on the probed fast path, or on the fallback it chose."""
    ckpt, hf = tiny_checkpoint("v3")
    p = prompts([30])[0]
    model = load_model(ckpt, dtype="bfloat16", cpu_gemm=gemm_mode)
    o_proj = model.model.layers[0].self_attn.o_proj
    assert o_proj.weight.dtype == torch.bfloat16
    path = kernel_plan(gemm_mode).choice(torch.bfloat16).path  # the layers were prepared for the path chosen for bf16
    assert (o_proj.packed is None) == (path == "plain")
    assert (path == "upcast") == bool(o_proj.packed and o_proj.packed.upcast)
    (got,) = PagedRunner(model, 1, len(p)).prefill([p])
    ref = hf_logits(hf, p)
    per_token = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    # Routing is discrete: a near-tied expert choice can flip under bf16 rounding and move that token's logits
    # (transformers' own bf16 model flips one token of this prompt), so the bound is per token, not per prompt.
    assert per_token.median() > 0.9995
    assert (per_token > 0.999).float().mean() >= 0.9
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_mtp_layer_is_skipped(tiny_checkpoint, tmp_path):
    ckpt, hf = tiny_checkpoint("v3")
    dst = tmp_path / "mtp"
    shutil.copytree(ckpt, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.3.embed_tokens.weight"] = torch.zeros(4, 4)  # layer index == num_hidden_layers
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(dst / "model.safetensors"))
    model = load_model(dst, dtype="float32")
    p = prompts([7])[0]
    (got,) = PagedRunner(model, 1, len(p)).prefill([p])
    assert rel_err(got, hf_logits(hf, p)) <= 1e-4


def _copy_with(ckpt, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(ckpt, dst)
    if edit_tensors:
        tensors = load_file(str(dst / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_loader_reports_every_problem_by_name(tiny_checkpoint, tmp_path):
    ckpt, _ = tiny_checkpoint("v3")

    def break_it(t):
        del t["model.layers.1.self_attn.kv_b_proj.weight"]
        t["model.layers.2.mlp.experts.3.up_proj.weight"] = torch.zeros(5, 64)
        t["model.layers.0.self_attn.made_up.weight"] = torch.zeros(2)

    dst = _copy_with(ckpt, tmp_path / "broken", edit_tensors=break_it)
    with pytest.raises(CheckpointError) as e:
        load_model(dst)
    msg = str(e.value)
    assert "missing: model.layers.1.self_attn.kv_b_proj.weight" in msg
    assert "shape mismatch: model.layers.2.mlp.experts.3.up_proj.weight: checkpoint [5, 64]" in msg
    assert "unexpected: model.layers.0.self_attn.made_up.weight" in msg
    assert "3 problems" in msg


def test_loader_shape_mismatch_from_config(tiny_checkpoint, tmp_path):
    ckpt, _ = tiny_checkpoint("v3")
    dst = _copy_with(ckpt, tmp_path / "rank", edit_config=lambda c: c.update(kv_lora_rank=24))
    with pytest.raises(CheckpointError, match=r"shape mismatch: model\.layers\.0\.self_attn\.kv_b_proj\.weight"):
        load_model(dst)


def test_non_mla_config_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 10,
         "num_hidden_layers": 1, "num_attention_heads": 4}))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        load_model(tmp_path)


def test_dtype_is_validated(tiny_checkpoint):
    ckpt, _ = tiny_checkpoint("v3")
    with pytest.raises(ValueError, match="dtype"):
        load_model(ckpt, dtype="float64")
