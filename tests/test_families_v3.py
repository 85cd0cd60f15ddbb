"""The DeepSeek-V3 variants (``sarvam_mla``, ``kimi_k25``'s text model, ``axk1``, ``mistral4``) equal transformers'
own classes on tiny random checkpoints: prefill logits (fp32, relative error <= 1e-4), greedy tokens through ``LLM``
on one and two tensor-parallel ranks, and int8 weights close to their float32 run."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mla_runtime import LLM, SamplingParams
from mla_runtime.config import ModelConfig
from mla_runtime.families import FAMILIES as FAMILY_TABLE
from mla_runtime.layers.quantization import finish_quantization
from mla_runtime.loader import load_model
from tests.checkpoints import VOCAB
from tests.model_utils import PagedRunner, hf_logits
from tests.test_engine import hf_greedy

FAMILIES = ["sarvam_mla", "kimi_k25", "axk1", "mistral4"]
TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
    max_position_embeddings=512, routed_scaling_factor=2.5, bos_token_id=0, eos_token_id=1, pad_token_id=None)
# YaRN over the rotary half of the head (transformers' partial_rotary_factor), with the Llama-4 query scaling past
# original_max_position_embeddings: from position 16 on, within the prompts
MISTRAL4_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 1.0,
                 "llama_4_scaling_beta": 0.3, "partial_rotary_factor": 0.5}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def build(family: str):
    """transformers' model of ``family`` (tiny, weights re-randomised so that every tensor matters)."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "sarvam_mla":  # the original config's names for the expert counts; no Q-LoRA
        cfg = tf.SarvamMLAConfig(**{**TEXT, "q_lora_rank": None, "rope_interleave": False, "num_experts": 8,
                                    "num_shared_experts": 1})
        model = tf.AutoModelForCausalLM.from_config(cfg)
    elif family == "kimi_k25":
        vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                      pos_emb_height=4, pos_emb_width=4)
        cfg = tf.Kimi_K25Config(text_config={**TEXT, "model_type": "deepseek_v3", "n_group": 4, "topk_group": 2},
                                vision_config=vision, projection_hidden_size=32)
        model = tf.Kimi_K25ForConditionalGeneration(cfg)
    elif family == "axk1":
        model = tf.AXK1ForCausalLM(tf.AXK1Config(**{**TEXT, "n_group": 4, "topk_group": 2,
                                                    "mlp_layer_types": ["dense", "sparse", "sparse"]}))
    else:  # a dense first layer, grouped softmax routing
        model = tf.Mistral4ForCausalLM(tf.Mistral4Config(**{**TEXT, "routed_scaling_factor": 1.5, "n_group": 2,
                                                            "topk_group": 1, "first_k_dense_replace": 1,
                                                            "rope_parameters": dict(MISTRAL4_ROPE)}))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "mlp.gate.weight" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(family)`` → (checkpoint dir, transformers model), built once per module."""
    built: dict[str, tuple] = {}

    def get(family: str):
        if family not in built:
            hf = build(family)
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            built[family] = (path, hf)
        return built[family]

    return get


def prompts(lens=(5, 17, 40, 1), seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lens]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def prefill(model, ps: list[list[int]]) -> list[torch.Tensor]:
    return PagedRunner(model, len(ps), max(map(len, ps))).prefill(ps)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_and_greedy_tokens_match_transformers(checkpoint, family):
    path, hf = checkpoint(family)
    assert ModelConfig.from_pretrained(path).model_type == family
    ps = prompts()
    for p, got in zip(ps, prefill(load_model(path, dtype="float32"), ps)):
        assert rel_err(got, hf_logits(hf, p)) <= 1e-4
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="4MiB", block_size=16)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps[:3]], GREEDY)
    finally:
        llm.shutdown()
    for p, out in zip(ps, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, p, GREEDY.max_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_match_transformers(checkpoint, family):
    path, hf = checkpoint(family)
    p = prompts((13,), seed=3)[0]
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory="2MiB", block_size=32,
              tensor_parallel_size=2)
    try:
        out = llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0]
    finally:
        llm.shutdown()
    assert list(out.token_ids) == hf_greedy(hf, p, GREEDY.max_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_weights_close_to_float32(checkpoint, family):
    """Loaded quantised (through the adapter's tensor names): the prefill's top-1 token agrees with the float32 run
    at most positions (a near-tie of the router can pick another expert, so not at all of them)."""
    path, _ = checkpoint(family)
    ps = prompts((21, 40, 9), seed=5)
    ref = torch.cat(prefill(load_model(path, dtype="float32"), ps))
    model = load_model(path, dtype="float32", quantization="int8")
    finish_quantization(model, "int8")
    got = torch.cat(prefill(model, ps))
    assert rel_err(got, ref) > 0  # quantised, not the float32 weights
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85  # measured: 0.90-0.94


def test_axk1_released_layout(checkpoint, tmp_path):
    """A.X-K1 as released: no router correction bias (zeros) and a MoE output norm stored for the dense layer too,
    which does not use it."""
    path, hf = checkpoint("axk1")
    tensors = {n: t for n, t in load_file(str(path / "model.safetensors")).items()
               if not n.endswith("e_score_correction_bias")}
    tensors["model.layers.0.post_mlp_layernorm.weight"] = torch.full((TEXT["hidden_size"],), 7.0)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
    ps = prompts((17, 6), seed=7)
    for p, got in zip(ps, prefill(load_model(tmp_path, dtype="float32"), ps)):
        assert rel_err(got, hf_logits(hf, p)) <= 1e-4


def test_kimi_k25_reads_the_text_model(checkpoint):
    """The wrapper's config serves its text_config; its vision tensors are dropped; lm_head is the tied embedding."""
    path, _ = checkpoint("kimi_k25")
    raw = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.tie_word_embeddings) == (64, 3, True)
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_dict({"model_type": "kimi_k25"})
    rename = FAMILY_TABLE["kimi_k25"].rename
    assert rename("language_model.model.layers.3.mlp.gate.weight") == "model.layers.3.mlp.gate.weight"
    assert rename("language_model.lm_head.weight") == "lm_head.weight"
    assert rename("model.layers.3.mlp.gate.weight") == "model.layers.3.mlp.gate.weight"
    assert rename("vision_tower.encoder.blocks.0.wqkv.weight") is None
    assert rename("model.mm_projector.pre_norm.weight") is None


def test_mistral4_config(checkpoint):
    path, _ = checkpoint("mistral4")
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.query_scale_beta == MISTRAL4_ROPE["llama_4_scaling_beta"]
    assert cfg.moe is not None and (cfg.moe.scoring_func, cfg.moe.correction_bias) == ("softmax", "none")
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)
