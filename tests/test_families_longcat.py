"""LongCat-Flash (``longcat_flash``) equals transformers' own class on a tiny random checkpoint: two attention blocks
a layer (four cache layers for two layers), a shortcut MoE with zero (identity) experts, the MLA's LoRA scales.
Prefill logits (fp32, relative error <= 1e-4), greedy tokens through ``LLM`` on one and two tensor-parallel ranks,
transformers' fused expert layout, and int8 weights close to their float32 run."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from mla_runtime import LLM, SamplingParams
from mla_runtime.config import ModelConfig
from mla_runtime.families import FAMILIES
from mla_runtime.layers.moe import MoE, Router
from mla_runtime.layers.quantization import finish_quantization
from mla_runtime.loader import load_model
from mla_runtime.models.deepseek import LongcatDecoderLayer
from mla_runtime.plan import latent_bytes_per_token, parameter_count
from tests.checkpoints import VOCAB
from tests.model_utils import PagedRunner, hf_logits

CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=96, q_lora_rank=48,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, head_dim=16, v_head_dim=24, moe_topk=3,
    n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=32, routed_scaling_factor=2.0,
    max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=None)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def build():
    """transformers' LongCat-Flash (tiny, weights re-randomised so that every tensor matters)."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LongcatFlashForCausalLM(tf.LongcatFlashConfig(**CONFIG))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "classifier" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = build()
    path = tmp_path_factory.mktemp("longcat")
    hf.save_pretrained(path)  # experts one by one, with gate/up tensors for the zero experts
    return path, hf


def prompts(lens=(5, 17, 40, 1), seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lens]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def prefill(model, ps: list[list[int]]) -> list[torch.Tensor]:
    runner = PagedRunner(model, len(ps), max(map(len, ps)))  # one cache layer per attention block
    assert len(runner.cache.layers) == model.num_cache_layers
    return runner.prefill(ps)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_prefill_logits_and_greedy_tokens_match_transformers(checkpoint):
    path, hf = checkpoint
    model = load_model(path, dtype="float32")
    assert model.num_cache_layers == 4 and len(model.attention_layers()) == 4
    layer = model.model.layers[0]
    assert isinstance(layer, LongcatDecoderLayer) and layer.kernel_table() is None  # call by call
    assert isinstance(layer.mlp, MoE) and layer.mlp.gate.kernel_route() is None  # zero experts: the torch path
    chosen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: chosen.append(out[1]))
             for m in model.modules() if isinstance(m, Router)]
    ps = prompts()
    for p, got in zip(ps, prefill(model, ps)):
        assert rel_err(got, hf_logits(hf, p)) <= 1e-4
    for h in hooks:
        h.remove()
    assert bool((torch.cat([c.flatten() for c in chosen]) >= CONFIG["n_routed_experts"]).any())  # zero experts ran
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="4MiB", block_size=16)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps[:3]], GREEDY)
    finally:
        llm.shutdown()
    for p, out in zip(ps, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, p, GREEDY.max_tokens)


def test_two_ranks_match_transformers(checkpoint):
    path, hf = checkpoint
    p = prompts((13,), seed=3)[0]
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory="2MiB", block_size=32,
              tensor_parallel_size=2)
    try:
        out = llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0]
    finally:
        llm.shutdown()
    assert list(out.token_ids) == hf_greedy(hf, p, GREEDY.max_tokens)


def test_fused_expert_layout(checkpoint, tmp_path):
    """transformers' in-memory names: ``gate_up_proj [routed + zero experts, 2I, d]``, ``down_proj [routed, d, I]``,
    the router as ``mlp.router.classifier``."""
    path, hf = checkpoint
    tensors = {n: t.contiguous() for n, t in hf.state_dict().items()}
    assert tensors["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 6
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ps = prompts((17, 6), seed=7)
    for p, got in zip(ps, prefill(load_model(tmp_path, dtype="float32"), ps)):
        assert rel_err(got, hf_logits(hf, p)) <= 1e-4


def test_int8_weights_close_to_float32(checkpoint):
    path, _ = checkpoint
    ps = prompts((21, 40, 9), seed=5)
    ref = torch.cat(prefill(load_model(path, dtype="float32"), ps))
    model = load_model(path, dtype="float32", quantization="int8")
    finish_quantization(model, "int8")
    got = torch.cat(prefill(model, ps))
    assert rel_err(got, ref) > 0  # quantised, not the float32 weights
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85


def test_config_fields_and_plan(checkpoint):
    path, _ = checkpoint
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.num_hidden_layers, cfg.attention_blocks_per_layer, cfg.num_attention_layers) == (2, 2, 4)
    assert cfg.moe is not None and (cfg.moe.router_experts, cfg.moe.zero_experts, cfg.moe.n_shared_experts) == (6, 2, 0)
    assert (cfg.moe.scoring_func, cfg.moe.topk_method, cfg.moe.norm_topk_prob) == ("softmax", "noaux_tc", False)
    assert cfg.query_lora_scale == pytest.approx((64 / 48) ** 0.5) and cfg.latent_scale == pytest.approx(2 ** 0.5)
    assert cfg.rope.interleave and cfg.rope.theta == 1e7 and cfg.latent_eps == 1e-6
    assert latent_bytes_per_token(cfg, "float32", "float32") == 4 * (32 + 16) * 4  # every attention block
    rename = FAMILIES["longcat_flash"].rename
    assert rename("model.layers.1.mlp.router.classifier.weight") == "model.layers.1.mlp.gate.weight"
    assert rename("model.layers.1.mlp.router.e_score_correction_bias") == \
        "model.layers.1.mlp.gate.e_score_correction_bias"
    assert rename("model.mtp.layers.0.self_attn.0.q_a_proj.weight") is None
    real = ModelConfig.from_pretrained("longcat-flash")  # the preset: 560B parameters, 56 cache layers
    assert 5.5e11 < parameter_count(real) < 5.7e11
    assert latent_bytes_per_token(real) == 56 * 576 * 2
    raw = {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k != "num_layers"}
    assert ModelConfig.from_dict({**raw, "num_hidden_layers": 4}).num_hidden_layers == 2  # transformers' 2 * layers


def _config(**changes: Any) -> dict[str, Any]:
    import transformers

    return {**transformers.LongcatFlashConfig(**CONFIG).to_dict(), **changes}


@pytest.mark.parametrize("changes, message", [
    ({"router_bias": True}, "router_bias"),
    ({"zero_expert_type": "constant"}, "zero_expert_type"),
    ({"head_dim": 32}, "head_dim"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"mla_scale_kv_lora": False}, "mla_scale_kv_lora"),
    ({"attention_method": "GQA"}, "attention_method"),
    ({"n_routed_experts": 0}, "n_routed_experts"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
])
def test_missing_features_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(_config(**changes))
