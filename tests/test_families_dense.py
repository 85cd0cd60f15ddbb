"""The MiniCPM3, Youtu and GLM-4.7-Flash families equal transformers on tiny random checkpoints built by its own
classes, at their real attention widths (MiniCPM3: d_c 256 + d_r 32 with LongRoPE and µP scaling; GLM: qk_nope 192,
v_head_dim 256, a per-layer MoE schedule and group routing): prefill logits, greedy tokens through ``LLM.generate``
(the compiled decode kernels where the layer takes them), two tensor-parallel ranks, and int8 weights."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.config import ModelConfig
from mla_runtime.kernel_plan import kernel_plan
from mla_runtime.layers.decoder_kernel import layer_weights
from mla_runtime.layers.quantization import quantize_model
from mla_runtime.loader import load_model
from tests.checkpoints import VOCAB, _randomise
from tests.model_utils import PagedRunner, hf_logits

SHORT_FACTOR = [1.0 + 0.15 * i for i in range(16)]  # LongRoPE's per-frequency divisors (d_r / 2 of them)
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                              num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                              bos_token_id=0, eos_token_id=None, pad_token_id=None)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "minicpm3": ("MiniCPM3", dict(
        kv_lora_rank=256, q_lora_rank=48, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT_FACTOR,
                         "long_factor": [4.0] * 16, "factor": 1.0, "original_max_position_embeddings": 512})),
    "youtu": ("Youtu", dict(kv_lora_rank=512, q_lora_rank=96, qk_nope_head_dim=128, qk_rope_head_dim=64,
                            v_head_dim=128, rope_interleave=True)),
    "glm4_moe_lite": ("Glm4MoeLite", dict(
        kv_lora_rank=512, q_lora_rank=48, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True, mlp_layer_types=["sparse", "dense", "sparse"],
        tie_word_embeddings=False)),
}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lens]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():  # the checkpoints have no eos: greedy runs the n tokens, as the runtime's ignore_eos
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def new_llm(path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "16MiB")
    return LLM(str(path), dtype="float32", max_model_len=128, block_size=16, **kw)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(model_type, checkpoint path, transformers' model) of a tiny random checkpoint of the family."""
    import transformers

    prefix, overrides = FAMILIES[request.param]
    config = getattr(transformers, f"{prefix}Config")(**{**COMMON, **overrides})
    torch.manual_seed(0)
    hf = getattr(transformers, f"{prefix}ForCausalLM")(config)
    _randomise(hf, seed=1)
    path = tmp_path_factory.mktemp(request.param)
    hf.eval().save_pretrained(path)
    return request.param, path, hf


def test_prefill_logits_match_transformers(family):
    name, path, hf = family
    model = load_model(path, dtype="float32")
    assert model.config.model_type == name
    ps = prompts([5, 17, 40, 1])
    for p, got in zip(ps, PagedRunner(model, len(ps), 40).prefill(ps)):
        assert rel_err(got, hf_logits(hf, p)) <= 1e-4


def test_greedy_tokens_equal_transformers(family):
    """Decode steps of one row: the compiled whole-layer kernel where the layer takes it, call by call where its
    variation is not in the kernel (MiniCPM3's scaled residual branches)."""
    name, path, hf = family
    llm = new_llm(path)
    try:
        ps = prompts([7, 23, 2], seed=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
        for p, out in zip(ps, outs):
            assert out.outputs[0].token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
    finally:
        llm.shutdown()


def test_scaled_residual_layers_run_call_by_call(family):
    """The compiled whole-layer kernel takes every family's widths; MiniCPM3's layers stay out of it only because
    their residual branches are scaled."""
    name, path, _ = family
    model = load_model(path, dtype="float32")
    scaled = model.config.residual_scale != 1.0
    assert scaled == (name == "minicpm3")
    for layer in model.model.layers:
        assert (layer.kernel_table() is None) == scaled or not kernel_plan().row_kernels
        if kernel_plan().row_kernels:
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            assert layer_weights(norms, layer.self_attn, layer.mlp) is not None  # unscaled, these widths take it


def test_two_ranks_equal_transformers(family):
    _, path, hf = family
    llm = new_llm(path, tensor_parallel_size=2)
    try:
        p = prompts([19], seed=2)[0]
        (out,) = llm.generate([{"prompt_token_ids": p}], GREEDY)
        assert out.outputs[0].token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
    finally:
        llm.shutdown()


def test_int8_weights_close_to_float32(family):
    _, path, _ = family
    ps = prompts([30, 12], seed=3)
    ref = PagedRunner(load_model(path, dtype="float32"), len(ps), 30).prefill(ps)
    model = load_model(path, dtype="float32")
    assert quantize_model(model, "int8") > 0
    got = PagedRunner(model, len(ps), 30).prefill(ps)
    agree = torch.cat([(g.argmax(-1) == r.argmax(-1)).float() for g, r in zip(got, ref)])
    assert agree.mean().item() >= 0.9
    assert 0 < max(rel_err(g, r) for g, r in zip(got, ref)) < 0.2  # quantised (not exact), and close


def _config(model_type: str, **changes: Any) -> dict[str, Any]:
    import transformers

    prefix, overrides = FAMILIES[model_type]
    raw = getattr(transformers, f"{prefix}Config")(**{**COMMON, **overrides}).to_dict()
    return {**raw, **changes}


def test_family_fields():
    mini = ModelConfig.from_dict(_config("minicpm3"))
    assert mini.moe is None and mini.tie_word_embeddings and not mini.rope.interleave
    assert (mini.embedding_scale, mini.lm_head_divisor) == (12.0, 64 / 256)
    assert mini.residual_scale == pytest.approx(1.4 / 3 ** 0.5) and mini.rope.kind == "longrope"
    assert mini.latent_norm_eps == 1e-6 and mini.rms_norm_eps == 1e-5
    youtu = ModelConfig.from_dict(_config("youtu", n_routed_experts=4))  # transformers drops MoE fields
    assert youtu.moe is None and youtu.rope.interleave and youtu.residual_scale == 1.0
    glm = ModelConfig.from_dict(_config("glm4_moe_lite"))
    assert [glm.is_moe_layer(i) for i in range(4)] == [True, False, True, True]  # past the list: the last kind
    assert glm.moe is not None and (glm.moe.scoring_func, glm.moe.topk_method) == ("sigmoid", "noaux_tc")
    default = ModelConfig.from_dict(_config("glm4_moe_lite", mlp_layer_types=None))
    assert [default.is_moe_layer(i) for i in range(3)] == [False, True, True]


@pytest.mark.parametrize("model_type, changes, message", [
    ("minicpm3", {"max_position_embeddings": 1024}, "long_factor"),
    ("minicpm3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "dynamic"),
    ("glm4_moe_lite", {"mlp_layer_types": ["sparse", "hybrid", "dense"]}, "hybrid"),
    ("glm4_moe_lite", {"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ("youtu", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
])
def test_missing_features_are_refused_by_name(model_type, changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(_config(model_type, **changes))


def test_bfloat16_decode_steps_stay_near_float32(family):
    """A bfloat16 model's decode step (the compiled layers in float32 over its bfloat16 weights where the layer takes
    them, call by call where it does not) gives the float32 model's logits to bfloat16 rounding."""
    _, path, _ = family
    ps = prompts([9, 20, 4], seed=3)
    logits = []
    for dtype in ("bfloat16", "float32"):
        runner = PagedRunner(load_model(path, dtype=dtype), len(ps), 40)
        runner.step({i: p[:-1] for i, p in enumerate(ps)})
        out = runner.step({i: p[-1:] for i, p in enumerate(ps)})
        logits.append(torch.cat([out[i] for i in range(len(ps))]).float())
    assert rel_err(logits[0], logits[1]) <= 3e-2
