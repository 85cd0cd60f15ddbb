"""GLM-5-Next's text model (``models/glm5_next.py``) against transformers' own classes on a tiny random checkpoint:
its linear-attention and sparse MLA layers (a pooled indexer, a layer sharing the previous one's selection),
hyper-connections, clamped SwiGLU and packed experts; greedy tokens whole, in chunks and decoded one by one."""

from __future__ import annotations

import pytest
import torch

from mla_runtime.models.glm5_next import Glm5NextConfig, Glm5NextForCausalLM
from tests.conformance import _recorded_selections

tf = pytest.importorskip("transformers")
glm = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=0,
            v_head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            linear_head_dim=8, linear_num_heads=2, hc_mult=2, hc_sinkhorn_iters=5, index_topk=8, index_head_dim=8,
            index_n_heads=2, index_kpool=4, pad_token_id=0,
            layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
            indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse", "dense"])


def _tiny() -> tuple[torch.nn.Module, torch.Tensor, Glm5NextForCausalLM]:
    config = tf.Glm5NextTextConfig(**TEXT)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = glm.Glm5NextTextModel(config).eval()
    with torch.no_grad():
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            if name.endswith(("A_log", "dt_bias", "base", "scale", "e_score_correction_bias", "bias")):
                p.copy_(0.3 * torch.randn(p.shape) + name.endswith("scale"))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    head = torch.randn(64, 32) * 32 ** -0.5
    ours = Glm5NextForCausalLM(Glm5NextConfig.from_raw({"model_type": "glm5_next_text", **TEXT}))
    ours.load_state_dict_hf({**{f"model.{k}": v for k, v in hf.state_dict().items()}, "lm_head.weight": head})
    return hf, head, ours


def _greedy_hf(hf: torch.nn.Module, head: torch.Tensor, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad(), _recorded_selections([float("inf")]):
        for _ in range(n):
            h = hf(input_ids=torch.tensor([ids + out])).last_hidden_state[0, -1]
            out.append(int((h @ head.t()).argmax()))
    return out


def test_glm5_next_text_model_matches_transformers_whole_chunked_and_decoded():
    hf, head, ours = _tiny()
    prompt = [int(x) for x in torch.randint(1, 64, (29,), generator=torch.Generator().manual_seed(1))]
    with torch.no_grad(), _recorded_selections([float("inf")]):
        ref = hf(input_ids=torch.tensor([prompt])).last_hidden_state[0] @ head.t()
    whole = ours(prompt, ours.new_state())
    assert float((whole - ref).abs().max() / ref.abs().max()) <= 1e-4
    st = ours.new_state()
    chunked = torch.cat([ours(prompt[:5], st), ours(prompt[5:6], st), ours(prompt[6:], st)])
    assert float((chunked - ref).abs().max() / ref.abs().max()) <= 1e-4
    want = _greedy_hf(hf, head, prompt, 6)
    st, got = ours.new_state(), []
    logits = ours(prompt, st)[-1]
    for _ in range(6):
        got.append(int(logits.argmax()))
        logits = ours([got[-1]], st)[-1]
    assert got == want


def test_glm5_next_refuses_media_tokens_and_impossible_sharing():
    cfg = Glm5NextConfig.from_raw({"model_type": "glm5_next", "image_token_id": 60, "text_config": TEXT})
    model = Glm5NextForCausalLM(cfg)
    with pytest.raises(ValueError, match="image/video placeholder"):
        model([1, 60, 2], model.new_state())
    bad = {**TEXT, "indexer_types": ["full", "shared", "full", "full"]}
    with pytest.raises(ValueError, match="shares the previous layer's indexer selection"):
        Glm5NextConfig.from_raw(bad)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be 0"):
        Glm5NextConfig.from_raw({**TEXT, "qk_rope_head_dim": 8})


def test_glm5_next_checkpoint_serves_text_and_refuses_image_prompts(tmp_path):
    """transformers' multimodal checkpoint (vision tower included) loads as the text model, generates transformers'
    greedy tokens, and a prompt holding the image placeholder is refused by name before it is scheduled."""
    from mla_runtime import LLM, SamplingParams
    from mla_runtime.errors import InvalidParam
    from mla_runtime.models.glm5_next import load_glm5_next
    from tests import conformance as C

    hf = C.build("glm5_next")
    hf.config.image_token_id = 250  # within the tiny vocabulary
    hf.save_pretrained(tmp_path)
    model = load_glm5_next(tmp_path)
    ids = C.prompts((21,))[0]
    want = C.reference(hf, ids, 4).tokens
    st = model.new_state()
    logits, got = model(ids, st)[-1], []
    for _ in range(4):
        got.append(int(logits.argmax()))
        logits = model([got[-1]], st)[-1]
    assert got == want
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, block_size=16)
    try:
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        with pytest.raises(InvalidParam, match=r"placeholder tokens \[250\].*vision tower is not served"):
            llm.generate([{"prompt_token_ids": [5, 250, 6]}], greedy)
        assert list(llm.generate([{"prompt_token_ids": ids}], greedy)[0].outputs[0].token_ids) == want
    finally:
        llm.shutdown()
