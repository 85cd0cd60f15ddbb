"""Mistral Large 4 (``mistral_large4``, a vision tower around its text model ``mistral_large4_text``) equals
transformers' ``MistralLarge4ForConditionalGeneration`` on a tiny random checkpoint (stored, as transformers saves it,
in Mistral's own tensor names): sparse attention without a Q-LoRA (the indexer's queries from the hidden state), the
learned per-head log-position query scalings, a NoPE layer, a ``shared`` indexer layer, LeRoPE's learned frequencies
and soft-capped logits, with ``index_topk`` below the prompts' lengths. Prefill logits (fp32, relative error <= 1e-4,
chunked too), greedy tokens through ``LLM`` on one and two tensor-parallel ranks (both cache layouts), int8 weights,
the planner's counts, and what is refused by name."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.config import ModelConfig
from mla_runtime.families import FAMILIES
from mla_runtime.kernel_plan import kernel_plan
from mla_runtime.layers.quantization import finish_quantization
from mla_runtime.loader import load_model
from mla_runtime.plan import latent_bytes_per_token, parameter_count, weight_footprint
from tests.checkpoints import VOCAB
from tests.model_utils import PagedRunner, hf_logits
from tests.test_engine import hf_greedy
from tests.test_plan import _resident_bytes

TOPK = 12  # below most prompts' lengths: the indexer's choice matters
TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=512,
    routed_scaling_factor=1.5, index_topk=TOPK, index_n_heads=8, index_head_dim=32, no_rope_layers=[1, 0, 1],
    indexer_types=["full", "full", "shared"], final_logit_softcapping=3.0, bos_token_id=0, eos_token_id=1,
    pad_token_id=None)
VISION: dict[str, Any] = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, head_dim=8, patch_size=4, image_size=16)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def build():
    """transformers' tiny Mistral Large 4 (layer 1 NoPE, layer 2 reusing layer 1's selection), weights re-randomised
    so that every tensor matters: the query scalings, LeRoPE's alpha and the LayerNorms' biases included."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.MistralLarge4ForConditionalGeneration(tf.MistralLarge4Config(text_config=TEXT, vision_config=VISION))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("softmax_scaling.scale") or name.endswith("rotary_emb.alpha"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("softmax_scaling.bias"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "mlp.gate.weight" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "indexer" in name:  # scores spread wide: no near-ties between the kept and the dropped keys
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(checkpoint dir, transformers model), built once."""
    hf = build()
    path = tmp_path_factory.mktemp("mistral_large4")
    hf.save_pretrained(path)
    return path, hf


def prompts(lens=(5, 17, 40, 1), seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lens]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def prefill(model, ps: list[list[int]], chunk: int | None = None) -> list[torch.Tensor]:
    return PagedRunner(model, len(ps), max(map(len, ps))).prefill(ps, chunk)


def text_parameters(hf) -> int:
    """The text model's parameters (the vision tower and the projector are not served)."""
    return sum(p.numel() for n, p in hf.named_parameters()
               if not n.startswith(("model.vision_tower.", "model.multi_modal_projector.")))


def test_config_and_layout(checkpoint):
    path, hf = checkpoint
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.model_type == "mistral_large4" and cfg.q_lora_rank is None and cfg.query_log_scaling
    assert cfg.rope_layers == (True, False, True) and cfg.rope.learned_frequency_scale and cfg.logit_softcap == 3.0
    idx = cfg.indexer
    assert idx is not None and (idx.topk, idx.rope_interleave, idx.query_source) == (TOPK, True, "hidden")
    assert [idx.is_shared(i) for i in range(3)] == [False, False, True]
    assert cfg.moe is not None and (cfg.moe.scoring_func, cfg.moe.topk_method, cfg.moe.correction_bias) == (
        "softmax", "greedy", "none")
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    # one cache row width for every layer: [c ; k_r] and the indexer's key, fp32
    assert latent_bytes_per_token(cfg, "auto", "float32") == (32 + 16 + 32) * 4 * 3
    model = load_model(path, dtype="float32")
    layers = model.model.layers
    nope = layers[1].self_attn
    assert not nope.rope and nope.d_n == 32 and nope.kv_a_proj_with_mqa.out_features == 32
    assert layers[0].self_attn.rope and layers[0].self_attn.d_n == 16
    assert all(layer.kernel_table() is None for layer in layers)  # the variations run call by call
    assert parameter_count(cfg) == text_parameters(hf)
    assert weight_footprint(cfg, "float32", cpu=kernel_plan().layouts(torch.float32)).total == _resident_bytes(model)


def test_tensor_names_map_to_the_text_model():
    rename = FAMILIES["mistral_large4"].rename
    assert rename("layers.3.attention.wkv_a_with_mqa.weight") == "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"
    assert rename("layers.3.attention.indexer.ssmax_scaling.s") == \
        "model.layers.3.self_attn.indexer.softmax_scaling.scale"
    assert rename("layers.3.experts.5.w3.weight") == "model.layers.3.mlp.experts.5.up_proj.weight"
    assert rename("layers.0.feed_forward.w2.weight") == "model.layers.0.mlp.down_proj.weight"
    assert rename("layers.3.gate.weight") == "model.layers.3.mlp.gate.weight"
    assert rename("lerope.alpha") == "model.rotary_emb.alpha"
    assert rename("output.weight") == "lm_head.weight"
    assert rename("model.language_model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    for dropped in ("vision_encoder.ln_pre.weight", "patch_merger.merging_layer.weight", "mtp_dspark.norm.weight",
                    "model.vision_tower.ln_pre.weight", "model.multi_modal_projector.norm.weight"):
        assert rename(dropped) is None


def test_adapter_defaults_and_refusals():
    """A bare text config reads as the wrapper's text model; the NoPE schedule defaults to every fourth layer."""
    import transformers as tf

    cfg = ModelConfig.from_dict({"model_type": "mistral_large4_text"})
    ref = tf.MistralLarge4TextConfig()
    assert cfg.rope_layers == tuple(bool(r) for r in ref.no_rope_layers)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [k == "sparse" for k in ref.mlp_layer_types[:4]]
    assert (cfg.rope.factor, cfg.rope.original_max_position_embeddings, cfg.rope.cos_sin_scale) == (2048.0, 512, 1.0)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.logit_softcap, cfg.latent_eps) == (1, 2, 30.0, 1e-5)
    with pytest.raises(ValueError, match="kv_source_layers.*cross-layer KV sharing is not supported"):
        ModelConfig.from_dict({"model_type": "mistral_large4_text", "num_hidden_layers": 3,
                               "kv_source_layers": [0, 0, 2]})
    single = ModelConfig.from_dict({"model_type": "mistral_large4_text", "num_experts_per_tok": 1})
    assert single.moe is not None and single.moe.norm_topk_prob  # one expert's weight renormalised to 1
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_dict({"model_type": "mistral_large4"})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_dict({"model_type": "mistral_large4_text", "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}})


def test_preset_is_transformers_default_size():
    import transformers as tf

    with torch.device("meta"):
        hf = tf.MistralLarge4TextModel(tf.MistralLarge4TextConfig())
    lm_head = tf.MistralLarge4TextConfig().vocab_size * tf.MistralLarge4TextConfig().hidden_size
    assert parameter_count(ModelConfig.from_pretrained("mistral-large-4")) == sum(
        p.numel() for p in hf.parameters()) + lm_head


def test_prefill_logits_match_transformers(checkpoint):
    path, hf = checkpoint
    ps = prompts()
    model = load_model(path, dtype="float32")
    for p, got in zip(ps, prefill(model, ps)):
        assert rel_err(got, hf_logits(hf, p)) <= 1e-4
    for p, got in zip(ps, prefill(model, ps, chunk=7)):  # chunked: later chunks select among cached keys
        assert rel_err(got, hf_logits(hf, p)) <= 1e-4


def test_greedy_tokens_equal_transformers(checkpoint):
    path, hf = checkpoint
    ps = prompts()
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="4MiB", block_size=16)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    finally:
        llm.shutdown()
    for p, out in zip(ps, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, p, GREEDY.max_tokens)


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_two_ranks_equal_transformers(checkpoint, layout):
    """Each rank takes its heads' query rows and query scalings; the indexer and LeRoPE's alpha are replicated."""
    path, hf = checkpoint
    p = prompts((29,), seed=3)[0]
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory="2MiB", block_size=32,
              tensor_parallel_size=2, latent_cache_layout=layout)
    try:
        out = llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0]
    finally:
        llm.shutdown()
    assert list(out.token_ids) == hf_greedy(hf, p, GREEDY.max_tokens)


def test_int8_weights_close_to_float32(checkpoint):
    path, _ = checkpoint
    ps = prompts((21, 40, 9), seed=5)
    ref = torch.cat(prefill(load_model(path, dtype="float32"), ps))
    model = load_model(path, dtype="float32", quantization="int8")
    finish_quantization(model, "int8")
    assert model.model.layers[0].self_attn.q_proj.packed.quantized
    got = torch.cat(prefill(model, ps))
    assert rel_err(got, ref) > 0  # quantised, not the float32 weights
    # a near-tie of the router or of the indexer's ranking can pick another expert or key
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8
