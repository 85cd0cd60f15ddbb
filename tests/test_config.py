"""ModelConfig parses the published MLA configs (mla_runtime/model_configs/) and rejects bad ones by field name."""

import json
import math

import pytest

from mla_runtime.config import PRESET_DIR, ModelConfig

# the MLA presets (DeepSeek-V4's have a model of their own: tests/test_v4_sizes.py)
PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.json") if '"deepseek_v4"' not in p.read_text())


def _raw(name: str) -> dict:
    return json.loads((PRESET_DIR / f"{name}.json").read_text())


def test_all_expected_presets_exist():
    assert set(PRESETS) >= {"deepseek-v2-lite", "deepseek-v2", "deepseek-v3", "kimi-k2",
                            "tiny-deepseek-v2", "tiny-deepseek-v3"}


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_parses(name):
    cfg = ModelConfig.from_pretrained(name)
    assert cfg.family in ("deepseek_v2", "deepseek_v3")
    assert cfg.latent_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert cfg.moe is not None or cfg.model_type in ("minicpm3", "youtu")  # the dense MLA families


def test_deepseek_v3_fields():
    cfg = ModelConfig.from_pretrained("deepseek-v3")
    assert (cfg.family, cfg.num_hidden_layers, cfg.num_attention_heads) == ("deepseek_v3", 61, 128)
    assert (cfg.d_c, cfg.d_r, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank) == (512, 64, 128, 128, 1536)
    assert cfg.rope.kind == "yarn"
    assert (cfg.rope.factor, cfg.rope.mscale, cfg.rope.mscale_all_dim) == (40.0, 1.0, 1.0)
    assert cfg.rope.original_max_position_embeddings == 4096
    assert (cfg.rope.beta_fast, cfg.rope.beta_slow) == (32.0, 1.0)
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    assert cfg.fp8_block_size == (128, 128)
    moe = cfg.moe
    assert (moe.topk_method, moe.scoring_func, moe.norm_topk_prob) == ("noaux_tc", "sigmoid", True)
    assert (moe.n_routed_experts, moe.n_shared_experts, moe.num_experts_per_tok) == (256, 1, 8)
    assert (moe.n_group, moe.topk_group, moe.first_k_dense_replace) == (8, 4, 3)
    assert moe.routed_scaling_factor == 2.5
    assert cfg.num_nextn_predict_layers == 1
    assert not cfg.is_moe_layer(2) and cfg.is_moe_layer(3)


def test_deepseek_v2_lite_fields():
    cfg = ModelConfig.from_pretrained("deepseek-v2-lite")
    assert cfg.family == "deepseek_v2"
    assert cfg.q_lora_rank is None
    assert (cfg.d_c, cfg.d_r, cfg.num_hidden_layers, cfg.num_attention_heads) == (512, 64, 27, 16)
    assert (cfg.moe.topk_method, cfg.moe.scoring_func) == ("greedy", "softmax")
    assert (cfg.moe.n_routed_experts, cfg.moe.num_experts_per_tok, cfg.moe.n_shared_experts) == (64, 6, 2)
    assert cfg.fp8_block_size is None
    assert cfg.rope.softmax_mscale == pytest.approx(0.1 * 0.707 * math.log(40) + 1)


def test_deepseek_v2_fields():
    cfg = ModelConfig.from_pretrained("deepseek-v2")
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.q_lora_rank) == (60, 128, 1536)
    assert (cfg.moe.topk_method, cfg.moe.n_group, cfg.moe.topk_group) == ("group_limited_greedy", 8, 3)
    assert cfg.moe.n_routed_experts == 160


def test_kimi_k2_is_a_deepseek_v3():
    cfg = ModelConfig.from_pretrained("kimi-k2")
    assert (cfg.family, cfg.model_type) == ("deepseek_v3", "kimi_k2")
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (163840, 61, 64)
    assert (cfg.moe.n_routed_experts, cfg.moe.n_group, cfg.moe.topk_group) == (384, 1, 1)
    assert cfg.moe.first_k_dense_replace == 1
    assert (cfg.moe.topk_method, cfg.moe.scoring_func) == ("noaux_tc", "sigmoid")
    assert cfg.fp8_block_size == (128, 128)


@pytest.mark.parametrize("name,layers", [("tiny-deepseek-v2", 2), ("tiny-deepseek-v3", 3)])
def test_tiny_presets_shape(name, layers):
    cfg = ModelConfig.from_pretrained(name)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, layers, 4)
    assert (cfg.d_c, cfg.d_r, cfg.qk_nope_head_dim, cfg.v_head_dim) == (32, 16, 16, 24)
    assert cfg.moe.n_routed_experts == 4


def test_checkpoint_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_raw("tiny-deepseek-v3")))
    assert ModelConfig.from_pretrained(tmp_path) == ModelConfig.from_pretrained("tiny-deepseek-v3")


def test_unknown_model_lists_presets():
    with pytest.raises(ValueError, match="deepseek-v3"):
        ModelConfig.from_pretrained("no-such-model")


def test_non_mla_config_names_model_type():
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
             "intermediate_size": 14336, "vocab_size": 128256}
    with pytest.raises(ValueError, match="model_type 'llama'"):
        ModelConfig.from_dict(llama)


def test_unsupported_mla_model_is_not_called_non_mla():
    # an architecture that uses multi-head latent attention (kv_lora_rank and all) but that no adapter covers
    unknown = _raw("deepseek-v2-lite") | {"architectures": ["FutureMLAForCausalLM"], "model_type": "future_mla"}
    with pytest.raises(ValueError) as e:
        ModelConfig.from_dict(unknown)
    message = str(e.value)
    assert "model_type 'future_mla'" in message and "not supported" in message
    assert "not a multi-head latent attention" not in message
    assert "multi-head latent attention architectures" in message and "'deepseek_v3'" in message


def test_experts_not_divisible_by_n_group():
    raw = _raw("tiny-deepseek-v3") | {"n_routed_experts": 6, "n_group": 4}
    with pytest.raises(ValueError, match="n_group"):
        ModelConfig.from_dict(raw)


def test_missing_kv_lora_rank():
    raw = _raw("deepseek-v3")
    del raw["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        ModelConfig.from_dict(raw)


def test_bad_rope_type():
    raw = _raw("deepseek-v3")
    raw["rope_scaling"] = raw["rope_scaling"] | {"type": "dynamic"}
    with pytest.raises(ValueError, match="rope_scaling.type.*dynamic"):
        ModelConfig.from_dict(raw)
