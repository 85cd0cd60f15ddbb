"""dots3-note's text model (``models/dots3_note.py``) against transformers' own classes on tiny random checkpoints:
indexed (a top-k below the prompt's length), full and sliding-window MLA layers (the sliding ones of their own widths),
the scaled latents, the normed RoPE key, the per-head gates, dense and MoE MLPs; greedy tokens whole, in chunks and
decoded one by one; the multimodal checkpoint served as its text model, its image, video and audio placeholders
refused."""

from __future__ import annotations

import pytest
import torch

from mla_runtime.models.dots3_note import Dots3Config, Dots3NoteForCausalLM
from tests.conformance import _recorded_selections

tf = pytest.importorskip("transformers")

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=5,
            num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8, head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
            topk_group=1, index_topk=6, index_head_dim=16, index_n_heads=2, shared_experts_intermediate_size=16,
            sliding_window=5, swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=8,
            swa_kv_lora_rank=24, swa_head_dim=12, swa_qk_nope_head_dim=8, swa_v_head_dim=4, pad_token_id=None,
            bos_token_id=0, eos_token_id=None,
            layer_types=["indexed_attention", "full_attention", "sliding_attention", "indexed_attention",
                         "sliding_attention"])


def _tiny() -> tuple[torch.nn.Module, Dots3NoteForCausalLM]:
    config = tf.Dots3NoteTextConfig(**TEXT)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = tf.Dots3NoteForCausalLM(config).eval()
    with torch.no_grad():
        bias = [(n, b) for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]
        for name, p in [*hf.named_parameters(), *bias]:
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    ours = Dots3NoteForCausalLM(Dots3Config.from_raw(config.to_dict()))
    ours.load_state_dict_hf(hf.state_dict())
    return hf, ours


def test_dots3_note_text_model_matches_transformers_whole_chunked_and_decoded():
    hf, ours = _tiny()
    assert [w["num_attention_heads"] for w in ours.config.widths] == [2, 2, 4, 2, 4]
    prompt = [int(x) for x in torch.randint(1, 64, (29,), generator=torch.Generator().manual_seed(1))]
    with torch.no_grad(), _recorded_selections([float("inf")]):
        ref = hf(input_ids=torch.tensor([prompt])).logits[0]
    whole = ours(prompt, ours.new_state())
    assert float((whole - ref).abs().max() / ref.abs().max()) <= 1e-4
    st = ours.new_state()
    chunked = torch.cat([ours(prompt[:5], st), ours(prompt[5:6], st), ours(prompt[6:], st)])
    assert float((chunked - ref).abs().max() / ref.abs().max()) <= 1e-4
    assert [t.shape[0] for t in st.latents] == [29, 29, 4, 29, 4]  # the sliding layers keep their window
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


def test_dots3_note_checkpoint_serves_text_and_refuses_media_prompts(tmp_path):
    """transformers' multimodal checkpoint (vision and audio towers included) loads as the text model and generates
    transformers' greedy tokens (batched, chunked and preempted: the conformance core's ``dots3_note`` cell); a prompt
    holding a placeholder token is refused by name before it is scheduled, as is what the model does not run."""
    from mla_runtime import LLM, SamplingParams
    from mla_runtime.errors import InvalidParam
    from tests import conformance as C

    with pytest.raises(ValueError, match=r"per_layer_config of layer 2 sets \['n_routed_experts'\]"):
        Dots3Config.from_raw({**TEXT, "per_layer_config": {"2": {"n_routed_experts": 2}}})
    hf = C.build("dots3_note")
    hf.config.image_token_id, hf.config.audio_token_id = 250, 252  # within the tiny vocabulary
    hf.save_pretrained(tmp_path)
    ps = C.prompts((9, 21))
    want = [C.reference(hf, p, 4).tokens for p in ps]
    with pytest.raises(InvalidParam, match="quantization=.*dots3_note runs with"):
        LLM(str(tmp_path), dtype="float32", quantization="int8")
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, block_size=16)
    try:
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        with pytest.raises(InvalidParam, match=r"placeholder tokens \[250, 252\].*towers are not served"):
            llm.generate([{"prompt_token_ids": [5, 250, 6, 252]}], greedy)
        assert [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in ps], greedy)
                ] == want
    finally:
        llm.shutdown()
