"""Hunyuan V4 (``models/hy_v4.py``) against transformers' own classes on a tiny random checkpoint: dense and MoE
MLPs, layers with their own DSA indexer and layers sharing the last one's selection (a top-k below the prompt's
length, so that the selection matters), learnable sinks, the output gate, independent hyper-connections and the
clamped routed experts; greedy tokens whole, in chunks and decoded one by one; what it refuses, by name."""

from __future__ import annotations

import pytest
import torch

from mla_runtime.models.hy_v4 import HyV4Config, HyV4ForCausalLM, load_hy_v4
from tests.conformance import _recorded_selections

tf = pytest.importorskip("transformers")

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, index_topk=6, index_head_dim=16,
            index_n_heads=2, hc_mult=2, swiglu_limit=1.0, pad_token_id=None, bos_token_id=0, eos_token_id=None,
            mlp_layer_types=["dense", "sparse", "sparse", "dense"], indexer_types=["full", "shared", "full", "shared"])


def _tiny(**over: object) -> tuple[torch.nn.Module, HyV4ForCausalLM]:
    config = tf.HYV4Config(**{**TEXT, **over})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = tf.HYV4ForCausalLM(config).eval()
    with torch.no_grad():
        bias = [(n, b) for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]
        for name, p in [*hf.named_parameters(), *bias]:
            if name.endswith(("base", "scale", "bias", "sinks")):  # sinks, gates and biases away from their inits
                p.copy_(0.3 * torch.randn(p.shape) + name.endswith("scale"))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    ours = HyV4ForCausalLM(HyV4Config.from_raw({"model_type": "hy_v4", **TEXT, **over}))
    ours.load_state_dict_hf(hf.state_dict())
    return hf, ours


def _prompt() -> list[int]:
    return [int(x) for x in torch.randint(1, 64, (29,), generator=torch.Generator().manual_seed(1))]


def test_hy_v4_matches_transformers_whole_chunked_and_decoded():
    hf, ours = _tiny()
    prompt = _prompt()
    with torch.no_grad(), _recorded_selections([float("inf")]):
        ref = hf(input_ids=torch.tensor([prompt])).logits[0]
    whole = ours(prompt, ours.new_state())
    assert float((whole - ref).abs().max() / ref.abs().max()) <= 1e-4
    st = ours.new_state()
    chunked = torch.cat([ours(prompt[:5], st), ours(prompt[5:6], st), ours(prompt[6:], st)])
    assert float((chunked - ref).abs().max() / ref.abs().max()) <= 1e-4
    dense = HyV4ForCausalLM(HyV4Config.from_raw({"model_type": "hy_v4", **TEXT, "index_topk": 64}))
    dense.load_state_dict(ours.state_dict())
    assert float((dense(prompt, dense.new_state()) - whole).abs().max()) > 1e-2  # the selection drops keys
    want: list[int] = []
    with torch.no_grad(), _recorded_selections([float("inf")]):
        for _ in range(6):
            want.append(int(hf(input_ids=torch.tensor([prompt + want])).logits[0, -1].argmax()))
    st, got = ours.new_state(), []
    logits = ours(prompt, st)[-1]
    for _ in range(6):
        got.append(int(logits.argmax()))
        logits = ours([got[-1]], st)[-1]
    assert got == want


def test_hy_v4_refuses_what_it_does_not_run(tmp_path):
    with pytest.raises(ValueError, match="layer 0 shares a previous layer's indexer selection"):
        HyV4Config.from_raw({**TEXT, "indexer_types": ["shared", "full", "full", "full"]})
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        HyV4Config.from_raw({**TEXT, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    with pytest.raises(ValueError, match="mlp_layer_types must list 4 layers"):
        HyV4Config.from_raw({**TEXT, "mlp_layer_types": ["dense", "moe", "sparse", "dense"]})
    from mla_runtime import LLM
    from mla_runtime.errors import InvalidParam

    hf, ours = _tiny()
    hf.save_pretrained(tmp_path)  # transformers' saved names (its hyper-connections', sinks', gates')
    model = load_hy_v4(tmp_path)
    assert torch.equal(model(_prompt()[:9], model.new_state()), ours(_prompt()[:9], ours.new_state()))
    for setting in ({"quantization": "int8"}, {"latent_cache_layout": "sharded", "tensor_parallel_size": 2},
                    {"num_speculative_tokens": 2}):
        with pytest.raises(InvalidParam, match=f"{next(iter(setting))}=.*hy_v4 runs with"):
            LLM(str(tmp_path), dtype="float32", **setting)
