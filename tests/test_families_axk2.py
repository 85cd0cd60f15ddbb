"""A.X-K2 (``axk2``) equals transformers' ``AXK2ForCausalLM`` on a tiny random checkpoint: DeepSeek-V3.2's sparse
attention with the fused query and output-gate projection (``query_gate``) and gated norms (``gated_norm_rank``), with
``index_topk`` below the prompts' lengths. Prefill logits (fp32, relative error <= 1e-4, chunked too), greedy tokens
through ``LLM`` on one and two tensor-parallel ranks (both cache layouts), int8 weights, the planner's counts."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.config import ModelConfig
from mla_runtime.families import FAMILIES
from mla_runtime.kernel_plan import kernel_plan
from mla_runtime.layers.norm import GatedRMSNorm, RMSNorm
from mla_runtime.layers.quantization import finish_quantization, quantized_parameter_names
from mla_runtime.loader import load_model
from mla_runtime.plan import parameter_count, weight_footprint
from tests.checkpoints import VOCAB
from tests.model_utils import PagedRunner, hf_logits
from tests.test_engine import hf_greedy
from tests.test_plan import _resident_bytes

TOPK = 12  # below most prompts' lengths: the indexer's choice matters
TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
    max_position_embeddings=512, routed_scaling_factor=2.5, mlp_layer_types=["dense", "sparse", "sparse"],
    index_topk=TOPK, index_n_heads=8, index_head_dim=32, gated_norm_rank=8, bos_token_id=0, eos_token_id=1,
    pad_token_id=None)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def build():
    """transformers' tiny A.X-K2 (no expert groups), weights re-randomised so that every tensor matters."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AXK2ForCausalLM(tf.AXK2Config(**TEXT))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.fc" in name:  # the gated norms' low-rank gates: sigmoids well away from constant
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
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
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(checkpoint dir, transformers model), built once."""
    hf = build()
    path = tmp_path_factory.mktemp("axk2")
    hf.save_pretrained(path)
    return path, hf


def prompts(lens=(5, 17, 40, 1), seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lens]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def prefill(model, ps: list[list[int]], chunk: int | None = None) -> list[torch.Tensor]:
    return PagedRunner(model, len(ps), max(map(len, ps))).prefill(ps, chunk)


def test_config_and_layout(checkpoint):
    path, hf = checkpoint
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.model_type == "axk2" and cfg.query_gate and cfg.gated_norm_rank == 8
    assert cfg.indexer is not None and (cfg.indexer.topk, cfg.indexer.rope_interleave) == (TOPK, False)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert cfg.moe is not None and (cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.topk_method) == (1, 1, "noaux_tc")
    model = load_model(path, dtype="float32")
    layers = model.model.layers
    assert all(isinstance(layer.input_layernorm, GatedRMSNorm) for layer in layers)
    assert [type(layer.post_attention_layernorm) for layer in layers] == [RMSNorm, GatedRMSNorm, GatedRMSNorm]
    attn = layers[0].self_attn
    assert attn.q_b_proj is None and attn.q_gate_proj is not None
    assert all(layer.kernel_table() is None for layer in layers)  # the variations run call by call
    assert "model.layers.0.self_attn.q_gate_proj.weight" in quantized_parameter_names(model)
    # the planner: every parameter of transformers' model (the routers' correction biases are buffers there)
    expected = sum(p.numel() for p in hf.parameters()) + sum(
        b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert parameter_count(cfg) == expected
    assert weight_footprint(cfg, "float32", cpu=kernel_plan().layouts(torch.float32)).total == _resident_bytes(model)


def test_adapter_derives_the_layer_kinds_and_refuses_grouped_routing():
    """Without ``mlp_layer_types``: transformers' derivation from ``first_k_dense_replace``/``moe_layer_freq``."""
    import transformers as tf

    raw = {"model_type": "axk2", "num_hidden_layers": 6, "first_k_dense_replace": 1, "moe_layer_freq": 2}
    want = tf.AXK2Config(num_hidden_layers=6, first_k_dense_replace=1, moe_layer_freq=2).mlp_layer_types
    out = FAMILIES["axk2"].normalise(raw)
    assert out["moe_layers"] == [k == "sparse" for k in want] == [False, False, True, False, True, False]
    assert FAMILIES["axk2"].normalise({"model_type": "axk2"})["moe_layers"] == [False] + [True] * 47
    cfg = ModelConfig.from_dict({"model_type": "axk2", "n_group": 1, "topk_group": 1})
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.num_nextn_predict_layers) == (163691, 163691, 0)
    with pytest.raises(ValueError, match="grouped routing"):
        ModelConfig.from_dict({"model_type": "axk2", "n_group": 8, "topk_group": 4})
    with pytest.raises(ValueError, match="set together"):
        ModelConfig.from_dict({"model_type": "axk2", "n_group": 8})


def test_preset_is_transformers_default_size():
    import transformers as tf

    with torch.device("meta"):
        hf = tf.AXK2ForCausalLM(tf.AXK2Config())
    expected = sum(p.numel() for p in hf.parameters()) + sum(
        b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert parameter_count(ModelConfig.from_pretrained("ax-k2-light")) == expected


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
    """Each rank takes its heads' query and gate rows of q_gate_proj; the gated norms are replicated."""
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
    assert model.model.layers[0].self_attn.q_gate_proj.packed.quantized
    got = torch.cat(prefill(model, ps))
    assert rel_err(got, ref) > 0  # quantised, not the float32 weights
    # a near-tie of the router or of the indexer's ranking can pick another expert or key
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8
