"""The conformance matrix: every supported ``model_type`` against transformers, in every way the engine batches.

For each family a tiny checkpoint is built by transformers' own class, with ordinary initialisation (every matrix at
1/sqrt(fan_in), norms near 1, small biases: nothing widened to keep choices apart), from a fixed configuration or
from one drawn from a seed (head counts, ranks, RoPE and indexer widths, top-k, expert counts and layer patterns).
A batch of prompts of mixed lengths (1 token, odd lengths, across block boundaries, past the indexer's top-k several
times) runs greedily through ``LLM.generate`` under each cell of ``CELLS``, and every prompt's tokens must equal
transformers run on that prompt alone. A divergence passes only where the reference itself was at a near-tie: its
two best logits at the first differing token within ``LOGIT_TIE`` of each other, or an indexer selection decided
by two different scores within ``SCORE_TIE`` at or before that token; the report names it.

The reference breaks exact ties of the indexer's scores (``relu`` makes every key that no head scores positively
worth exactly 0) as the runtime does, lowest position first (``mla_kernels.topk_lowest_first``): transformers' own
``torch.topk`` settles them by the course of its selection algorithm over the row, which no other implementation
reproduces.

The int8 cell compares the batch with the same int8 engine run one prompt at a time: its integer products make a
row's result the same bits whatever rows share its step, so only the float parts (embeddings, norms, routers, the
indexer, the attention) may differ, by summation order. Its near-ties are measured along the one-at-a-time tokens by
transformers holding the int8 engine's weights (``int8_weights``: each quantised matrix as its int8 values times
their scales, ``kv_b_proj`` rounded to bfloat16), with both bounds at ``INT8_TIE``: the int16 rounding of the rows
makes a float rounding difference between batch shapes (the float32 kernels of a few rows against oneDNN's of many,
the one-token MoE call against the grouped one) a change of up to 2^-15 of a row's largest value where an element lies
near a rounding boundary, so bit-identical int8 answers across batches would need every float path to be bit-identical
across row counts.

The stored-format cells (``stored-int4``, ``stored-w4a16``, ``stored-w8a8``, ``stored-mxfp4``, ``stored-nvfp4``,
``gguf-q8_0``, ``gguf-q4_k_m``, ``modelopt-nvfp4``) write the family's checkpoint in a format the runtime loads as
stored (``stored_formats``), and compare the batch with the same checkpoint run one prompt at a time as the int8 cell
does, within the same bounds, near-ties measured on transformers holding the checkpoint's dequantised weights. Every
product of every format gives a row the same bits whatever rows share its call. The formats whose products round
their input rows to int8 (in groups of 32: int4, W4A16 loaded as int4, the GGUF block types; per row: W8A8) would
turn the float parts' rounding differences between batch shapes into changes of up to 1/254 of a group's largest
value; such a model runs every part so that a row's bits do not depend on the batch
(``DeepseekForCausalLM.rows_invariant``, ``docs/testing.md``), and its batch equals its prompts alone.

``bench/conformance.py`` runs the whole matrix; ``tests/test_conformance.py`` a fixed core and cells drawn from a
printed seed.
"""

from __future__ import annotations

import contextlib
import copy
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mla_kernels import topk_lowest_first
from tests import stored_formats

VOCAB = 256
PROMPT_LENS = (1, 5, 16, 17, 63, 64, 65, 130, 200, 3, 33, 97)
NEW_TOKENS = 24
LOGIT_TIE = 1e-4  # relative to the row's largest |logit|
SCORE_TIE = 1e-5  # relative to the row's largest |score|
# int8 weights: both bounds (module docstring). The integer products round each input row to int16 (2^-15 of its
# largest value), which turns the float parts' rounding differences between batch shapes (1e-7) into changes of that
# size at the few elements near a rounding boundary: measured, a prompt's logits batched and alone differ by up to
# 5.5e-4 (deepseek_v2, fixed configuration)
INT8_TIE = 1e-3
SPARSE = ("deepseek_v32", "glm_moe_dsa", "axk2", "mistral_large4")
DENSE = ("deepseek_v2", "deepseek_v3", "kimi_k25", "sarvam_mla", "axk1", "mistral4", "glm4_moe_lite", "minicpm3",
         "youtu", "longcat_flash")
HYBRID = ("kimi_linear", "bailing_hybrid")  # MLA layers between linear-attention layers
# DeepSeek-V4: sliding, CSA and HCA layers over per-sequence state slots (runs in torch, one sequence at a time within
# a step: its prompts are fewer, still past the window, several compressed entries and the indexer's top-k)
V4 = ("deepseek_v4",)
V4_PROMPT_LENS = (1, 9, 17, 40, 70)
V4_NEW_TOKENS = 8
# GLM-5-Next's text model: linear-attention layers between pooled-indexer MLA layers, hyper-connections; it runs in
# torch over per-sequence state slots as V4 does (V4's fewer prompts), with state snapshots for prefix caching
GLM5 = ("glm5_next",)
# Hunyuan V4: MLA with DSA (shared selections), sinks, an output gate and hyper-connections; in torch over per-sequence
# state slots as GLM-5-Next (V4's fewer prompts; a top-k of 6, below all but the shortest)
HYV4 = ("hy_v4",)
# dots3-note's text model: indexed (DSA) and sliding-window MLA layers of their own widths, gated heads; in torch over
# per-sequence state slots as GLM-5-Next (V4's fewer prompts: past its window of 5 and its top-k of 6)
DOTS3 = ("dots3_note",)
OWN = V4 + GLM5 + HYV4 + DOTS3  # models of their own
MODEL_TYPES = DENSE + SPARSE + HYBRID + OWN
DRAWN_TYPES = DENSE + SPARSE + HYBRID  # the drawn cells' families (V4's steps are too slow for the suite's draws)
# hybrids run on one rank without speculative decoding (their linear layers' states advance with every token)
ONE_RANK_NO_DRAFTS = DENSE + SPARSE
# (DeepSeek-V4, Hunyuan V4 and dots3-note run on two ranks too: their heads and experts split, every rank holding every
# sequence's state)
# V4 and GLM-5-Next run in torch in float32 or bfloat16: no quantised weights, no attention backend to choose
NOT_V4 = DENSE + SPARSE + HYBRID
# the families whose checkpoints' MTP layers the runtime serves (A.X-K1/K2, LongCat-Flash and Mistral Large 4 drop
# theirs, as transformers does); the MTP cell adds one to the checkpoint, built by the family's own decoder layer
MTP_FAMILIES = tuple(t for t in ONE_RANK_NO_DRAFTS if t not in ("axk1", "axk2", "longcat_flash", "mistral_large4"))
# the stored formats' families (stored_formats): compressed-tensors checkpoints of every family over the paged cache
# (write_quantized_checkpoint writes them under the model's names, as loading reads them); GGUF files of
# DeepSeek-V2/V3 (llama.cpp's
# deepseek2: MiniCPM3's metadata carries no value head width, which llama.cpp takes as hidden_size / heads, and the
# matrix's configurations have widths of their own);
# ModelOpt's NVFP4 exports of the DeepSeek layouts NVIDIA publishes
COMPRESSED_FAMILIES = NOT_V4
# Mistral Large 4's stored FP4 cells part from the prompts alone beyond the bounds on one drawn configuration (a
# prompt of 16 tokens, stored-nvfp4, at an indexer boundary gap of 2.7e-3; docs/testing.md): in the bench matrix only
STORED_BENCH_ONLY = ("mistral_large4",)
GGUF_FAMILIES = ("deepseek_v2", "deepseek_v3")
MODELOPT_FAMILIES = ("deepseek_v2", "deepseek_v3")


# ------------------------------------------------------------------------------------------------------------------
# checkpoints


def _pick(rng: random.Random | None, fixed: Any, *choices: Any) -> Any:
    return fixed if rng is None else rng.choice(choices)


def text_config(model_type: str, rng: random.Random | None) -> dict[str, Any]:
    """The family's text configuration: the fixed one (rng None) or one drawn from ``rng``."""
    heads = _pick(rng, 6, 2, 3, 4, 6)  # the hidden sizes below are multiples of every head count
    rope = _pick(rng, 16, 8, 16, 32)
    cfg: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=_pick(rng, 96, 48, 96, 144), intermediate_size=_pick(rng, 160, 96, 160),
        moe_intermediate_size=_pick(rng, 32, 16, 32, 48), num_hidden_layers=_pick(rng, 3, 2, 3, 4),
        num_attention_heads=heads, num_key_value_heads=heads, n_routed_experts=8,
        n_shared_experts=_pick(rng, 1, 1, 2), num_experts_per_tok=_pick(rng, 2, 1, 2, 3),
        n_group=_pick(rng, 4, 1, 2, 4), topk_group=None,
        kv_lora_rank=_pick(rng, 32, 16, 32, 48, 64), q_lora_rank=_pick(rng, 48, 24, 48, 64),
        qk_rope_head_dim=rope, qk_nope_head_dim=_pick(rng, 16, 8, 16, 24, 32), v_head_dim=_pick(rng, 24, 8, 16, 24, 40),
        max_position_embeddings=512, routed_scaling_factor=_pick(rng, 2.5, 1.0, 1.5, 2.5),
        first_k_dense_replace=_pick(rng, 1, 0, 1), rope_interleave=_pick(rng, True, True, False),
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, pad_token_id=None)
    cfg["topk_group"] = max(1, cfg["n_group"] // 2)
    layers = cfg["num_hidden_layers"]
    if model_type in SPARSE:
        cfg.update(index_topk=_pick(rng, 8, 4, 8, 12, 16), index_n_heads=_pick(rng, 4, 2, 4, 8),
                   # the indexer's width: at least the RoPE width, sometimes equal to it, sometimes twice it
                   index_head_dim=_pick(rng, 32, rope, 2 * rope, 32, 64) if rope <= 32 else 64)
        cfg["index_head_dim"] = max(cfg["index_head_dim"], rope)
    if model_type == "deepseek_v2":
        cfg.update(topk_method=_pick(rng, "group_limited_greedy", "group_limited_greedy", "greedy"),
                   q_lora_rank=_pick(rng, None, None, 48))
        cfg.pop("rope_interleave")
        if cfg["topk_method"] == "greedy":
            cfg.update(n_group=1, topk_group=1)
    if model_type == "sarvam_mla":
        cfg.update(q_lora_rank=None, rope_interleave=False, num_experts=8, num_shared_experts=cfg["n_shared_experts"])
    if model_type == "axk1":
        cfg["mlp_layer_types"] = ["dense"] + ["sparse"] * (layers - 1)
    if model_type == "mistral4":  # YaRN over the rotary part of the head, Llama-4 query scaling from position 16
        cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "mscale": 0.9, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.3,
                                  "partial_rotary_factor": rope / (rope + cfg["qk_nope_head_dim"])}
        cfg.update(rope_interleave=True, first_k_dense_replace=1, n_group=2, topk_group=1)
    if model_type == "glm4_moe_lite":
        cfg["mlp_layer_types"] = [_pick(rng, t, "sparse", "dense") for t in ["sparse", "dense", "sparse", "sparse"]][
            :layers]
    if model_type == "minicpm3":  # LongRoPE (d_r / 2 divisors), µP scaling; dense
        half = rope // 2
        cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0 + 0.15 * i for i in range(half)], "long_factor": [4.0] * half,
                                  "factor": 1.0, "original_max_position_embeddings": 512}
    if model_type == "glm_moe_dsa":  # layer 1 reuses layer 0's selection
        cfg["indexer_types"] = (["full", "shared"] + ["full"] * layers)[:layers]
    if model_type == "axk2":
        cfg.update(mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), gated_norm_rank=8, n_group=1, topk_group=1)
    if model_type == "kimi_linear":  # at least one MLA layer, one linear-attention layer
        kinds = ["linear_attention", "full_attention"] + [_pick(rng, "linear_attention", "linear_attention",
                                                                 "full_attention") for _ in range(layers)]
        cfg.update(q_lora_rank=_pick(rng, None, None, 48), linear_num_heads=_pick(rng, 2, 1, 2, 4),
                   linear_head_dim=_pick(rng, 16, 8, 16, 32), linear_conv_kernel_dim=_pick(rng, 4, 2, 3, 4),
                   layer_types=kinds[:max(layers, 2)], num_hidden_layers=max(layers, 2), num_local_experts=8,
                   mlp_layer_types=["dense" if i < cfg["first_k_dense_replace"] else "sparse"
                                    for i in range(max(layers, 2))])
        for name in ("n_routed_experts", "first_k_dense_replace", "rope_interleave"):
            cfg.pop(name)
    if model_type == "bailing_hybrid":  # the last layer of every group is MLA
        group = _pick(rng, 2, 2, 3)
        cfg.update(num_hidden_layers=max(layers, group), layer_group_size=group, q_lora_rank=_pick(rng, None, None, 48),
                   num_local_experts=8, head_dim=_pick(rng, 16, 8, 16, 32), short_conv_kernel_size=_pick(rng, 4, 2, 4),
                   kda_safe_gate=_pick(rng, True, True, False),
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        for name in ("n_routed_experts", "rope_interleave"):
            cfg.pop(name)
    if model_type == "deepseek_v4":
        return v4_config(rng)
    if model_type == "glm5_next":
        return glm5_next_config(rng)
    if model_type == "hy_v4":
        return hy_v4_config(rng)
    if model_type == "dots3_note":
        return dots3_note_config(rng)
    if model_type == "mistral_large4":
        cfg.update(q_lora_rank=None, no_rope_layers=([1, 0] + [1] * layers)[:layers],
                   indexer_types=(["full", "full", "shared"] + ["full"] * layers)[:layers],
                   final_logit_softcapping=3.0, n_group=1, topk_group=1)
    return cfg


def v4_config(rng: random.Random | None) -> dict[str, Any]:
    """DeepSeek-V4's text configuration: every layer kind (sliding, CSA, HCA), a window of 8, CSA every 4 tokens
    with a top-k below the longest prompts' entries, HCA every 16, hash-routed and scored MoE layers."""
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
             _pick(rng, "compressed_sparse_attention", *V4_LAYER_KINDS)]
    return dict(
        vocab_size=VOCAB, hidden_size=_pick(rng, 64, 32, 64), num_hidden_layers=4,
        num_attention_heads=_pick(rng, 4, 2, 4), head_dim=_pick(rng, 32, 16, 32), partial_rotary_factor=0.25,
        q_lora_rank=_pick(rng, 32, 16, 32), o_groups=2, o_lora_rank=16, sliding_window=_pick(rng, 8, 4, 8, 12),
        layer_types=kinds, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        index_n_heads=_pick(rng, 4, 2, 4), index_head_dim=16, index_topk=_pick(rng, 3, 2, 3, 5), hc_mult=2,
        hc_sinkhorn_iters=4,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], max_position_embeddings=512, bos_token_id=0,
        eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def glm5_next_config(rng: random.Random | None) -> dict[str, Any]:
    """GLM-5-Next's text configuration: linear-attention and MLA layers (one reusing the previous one's selection),
    pools of 4 tokens with a top-k of 8 below the longer prompts, two hyper-connection streams, dense and MoE MLPs."""
    heads = _pick(rng, 2, 2, 4)
    return dict(
        vocab_size=VOCAB, hidden_size=_pick(rng, 48, 32, 48), intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=24,
        kv_lora_rank=_pick(rng, 32, 16, 32), qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, linear_head_dim=8,
        linear_num_heads=2, hc_mult=2, hc_sinkhorn_iters=4, index_topk=8, index_head_dim=16,
        index_n_heads=_pick(rng, 2, 2, 4), index_kpool=4, max_position_embeddings=512, pad_token_id=None,
        bos_token_id=0, eos_token_id=None,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse", "dense"])


def hy_v4_config(rng: random.Random | None) -> dict[str, Any]:
    """Hunyuan V4's configuration: dense and MoE MLPs, layers with their own indexer and layers sharing the last one's
    selection (index_topk 6), two hyper-connection streams, learnable sinks, a tight SwiGLU clamp."""
    heads = _pick(rng, 2, 2, 4)
    return dict(
        vocab_size=VOCAB, hidden_size=_pick(rng, 48, 32, 48), intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=24, kv_lora_rank=_pick(rng, 32, 16, 32),
        qk_nope_head_dim=16, qk_rope_head_dim=_pick(rng, 8, 8, 16), v_head_dim=16, moe_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, hc_mult=2, index_topk=6, index_head_dim=16,
        index_n_heads=_pick(rng, 2, 2, 4), swiglu_limit=2.0, max_position_embeddings=512, pad_token_id=None,
        bos_token_id=0, eos_token_id=None, mlp_layer_types=["dense", "sparse", "sparse", "dense"],
        indexer_types=["full", "shared", "full", "shared"])


def dots3_note_config(rng: random.Random | None) -> dict[str, Any]:
    """dots3-note's text configuration: indexed layers (top-k 6) and sliding-window layers (a window of 5) with widths
    of their own, dense and MoE MLPs, two expert groups."""
    heads = _pick(rng, 2, 2, 4)
    return dict(
        vocab_size=VOCAB, hidden_size=_pick(rng, 48, 32, 48), intermediate_size=64, num_hidden_layers=5,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=24, kv_lora_rank=_pick(rng, 32, 16, 32),
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=24, moe_intermediate_size=16,
        shared_experts_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        index_topk=6, index_head_dim=16, index_n_heads=_pick(rng, 2, 2, 4), sliding_window=_pick(rng, 5, 3, 5, 8),
        swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=16, swa_kv_lora_rank=24,
        swa_head_dim=20, swa_qk_nope_head_dim=12, swa_v_head_dim=8, max_position_embeddings=512, pad_token_id=None,
        bos_token_id=0, eos_token_id=None)


def dots3_note_multimodal(text: dict[str, Any]) -> Any:
    """transformers' multimodal dots3-note configuration (as the checkpoints ship) around the text configuration
    ``text``, with the smallest vision and audio towers."""
    import transformers as tf

    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                  moe_intermediate_size=16, adapter_in_dim=16, adapter_out_dim=text["hidden_size"],
                  pyramid_num_routed=[-1])
    audio = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 downsample_hidden_size=8, adapter_input_size=16, adapter_out_dim=text["hidden_size"],
                 feature_size=16)
    return tf.Dots3NoteConfig(text_config=text, vision_config=vision, audio_config=audio)


V4_LAYER_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


def ordinary_init(model: torch.nn.Module, seed: int) -> None:
    """Every matrix at 1/sqrt(fan_in), norms 1 + 0.1 N(0, 1), biases 0.02 N(0, 1), the router's correction bias
    0.1 N(0, 1); the other vectors (learned scalings) as transformers initialises them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def build(model_type: str, seed: int | None = None, width: int | None = None) -> torch.nn.Module:
    """transformers' model of ``model_type``: the fixed configuration (seed None) or one drawn from ``seed``; with
    ``width``, at that hidden size."""
    import transformers as tf

    rng = None if seed is None else random.Random(seed)
    cfg = text_config(model_type, rng)
    if width is not None:
        cfg["hidden_size"] = width
    torch.manual_seed(0 if seed is None else seed)
    if model_type == "longcat_flash":
        lc = dict(vocab_size=VOCAB, hidden_size=cfg["hidden_size"], num_layers=_pick(rng, 2, 1, 2),
                  num_attention_heads=cfg["num_attention_heads"], ffn_hidden_size=cfg["intermediate_size"],
                  q_lora_rank=cfg["q_lora_rank"], kv_lora_rank=cfg["kv_lora_rank"],
                  qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                  head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"], moe_topk=_pick(rng, 3, 2, 3),
                  n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=cfg["moe_intermediate_size"],
                  routed_scaling_factor=2.0, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0,
                  eos_token_id=None, pad_token_id=None)
        model = tf.LongcatFlashForCausalLM(tf.LongcatFlashConfig(**lc))
    elif model_type == "kimi_k25":
        vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                      pos_emb_height=4, pos_emb_width=4)
        model = tf.Kimi_K25ForConditionalGeneration(tf.Kimi_K25Config(
            text_config={**cfg, "model_type": "deepseek_v3"}, vision_config=vision, projection_hidden_size=32))
    elif model_type == "glm5_next":  # the multimodal wrapper, as the checkpoints ship (its vision tower unused)
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=cfg["hidden_size"],
                      projection_intermediate_size=32, patch_size=4, spatial_merge_size=2, temporal_patch_size=1)
        model = tf.Glm5NextForConditionalGeneration(tf.Glm5NextConfig(text_config=cfg, vision_config=vision))
    elif model_type == "dots3_note":  # the multimodal wrapper, as the checkpoints ship (its towers unused)
        model = tf.Dots3NoteForConditionalGeneration(dots3_note_multimodal(cfg))
    elif model_type == "mistral_large4":
        vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, head_dim=8, patch_size=4, image_size=16)
        model = tf.MistralLarge4ForConditionalGeneration(tf.MistralLarge4Config(text_config=cfg,
                                                                                vision_config=vision))
    else:
        prefix = {"deepseek_v2": "DeepseekV2", "deepseek_v3": "DeepseekV3", "sarvam_mla": "SarvamMLA", "axk1": "AXK1",
                  "mistral4": "Mistral4", "glm4_moe_lite": "Glm4MoeLite", "minicpm3": "MiniCPM3", "youtu": "Youtu",
                  "deepseek_v32": "DeepseekV32", "glm_moe_dsa": "GlmMoeDsa", "axk2": "AXK2",
                  "kimi_linear": "KimiLinear", "bailing_hybrid": "BailingHybrid",
                  "deepseek_v4": "DeepseekV4", "hy_v4": "HYV4"}[model_type]
        config = getattr(tf, f"{prefix}Config")(**cfg)
        model = getattr(tf, f"{prefix}ForCausalLM", None)
        model = tf.AutoModelForCausalLM.from_config(config) if model is None else model(config)
    ordinary_init(model, 1 if seed is None else seed + 1)
    return model.float().eval()


def prompts(lens: tuple[int, ...] = PROMPT_LENS, shared_prefix: int = 0, seed: int = 0) -> list[list[int]]:
    """One prompt per length; with ``shared_prefix``, every prompt longer than it starts with the same tokens."""
    rng = random.Random(seed)
    head = [rng.randrange(2, VOCAB) for _ in range(shared_prefix)]
    out = []
    for n in lens:
        own = [rng.randrange(2, VOCAB) for _ in range(n)]
        out.append(head + own[shared_prefix:] if n > shared_prefix else own)
    return out


# ------------------------------------------------------------------------------------------------------------------
# the reference


INT8_MATRICES = ("q_proj", "q_a_proj", "q_b_proj", "q_gate_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj",
                 "up_proj", "down_proj", "gate_up_proj", "lm_head")


def product_params(hf: torch.nn.Module) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """(name, owner, parameter) of each matrix a quantising load turns into a product (the attention's projections
    but the indexer's, the MLPs and experts, an untied lm_head) and of ``kv_b_proj``, which it holds in bfloat16;
    embeddings, norms, routers, the indexer and a hybrid's linear-attention layers are none."""
    kinds = getattr(hf.config.get_text_config(), "layer_types", None) or []
    tied = hf.config.get_text_config().tie_word_embeddings
    for name, param in hf.named_parameters():
        parts = name.split(".")
        owner = parts[-2] if parts[-1] == "weight" else parts[-1]
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else len(kinds)
        linear = layer < len(kinds) and kinds[layer] == "linear_attention" and "self_attn" in parts
        if "indexer" in parts or param.dim() < 2 or linear or (owner == "lm_head" and tied):
            continue
        if owner == "kv_b_proj" or owner in INT8_MATRICES:
            yield name, owner, param


@torch.no_grad()
def int8_weights(hf: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``hf`` with the values ``quantization="int8"`` computes with: each matrix the engine quantises
    (``product_params``) as its int8 values times their per-row scales, ``kv_b_proj`` rounded to bfloat16; embeddings,
    norms, routers, the indexer and a hybrid's linear-attention layers as they are."""
    from mla_runtime.layers.quantization import quantize_int8

    out = copy.deepcopy(hf)
    for _, owner, param in product_params(out):
        if owner == "kv_b_proj":
            param.copy_(param.to(torch.bfloat16))
        else:
            rows = param.reshape(-1, param.shape[-1])
            q, scales = quantize_int8(rows)
            param.copy_((q.float() * scales.float().unsqueeze(1)).view_as(param))
    return out


@dataclass
class Reference:
    tokens: list[int]
    logit_gaps: list[float]  # per generated token: the two best logits' gap, relative to the row's largest |logit|
    score_gaps: list[float]  # per forward (0: the prompt): the smallest non-zero gap at an indexer's boundary


@contextlib.contextmanager
def _recorded_selections(gaps: list[float]) -> Iterator[None]:
    """``Tensor.topk`` with exact ties lowest index first, and the boundary gaps of the indexer's selections (3-D
    score tensors ``[B, S, T]``) recorded; every other top-k (the routers') as torch's."""
    original = torch.Tensor.topk

    def topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):  # noqa: A002
        if self.dim() != 3 or not largest or dim not in (-1, 2) or not self.is_floating_point() or not self.numel():
            return original(self, k, dim=dim, largest=largest, sorted=sorted)
        flat = self.reshape(-1, self.shape[-1]).float()
        idx = topk_lowest_first(flat, k)
        if flat.shape[1] > k:
            top = original(flat, k + 1, dim=1).values
            finite = torch.isfinite(top[:, k]) & (top[:, k] > -1e30)
            gap = (top[:, k - 1] - top[:, k]) / flat.masked_fill(flat < -1e30, 0).abs().amax(1).clamp(min=1e-30)
            real = finite & (gap > 0)
            if real.any():
                gaps[-1] = min(gaps[-1], float(gap[real].min()))
        values = self.reshape(-1, self.shape[-1]).gather(1, idx)
        shape = (*self.shape[:-1], k)
        return torch.return_types.topk((values.view(shape), idx.view(shape)))

    torch.Tensor.topk = topk  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.topk = original  # type: ignore[method-assign]


@torch.no_grad()
def reference(hf: torch.nn.Module, ids: list[int], n: int = NEW_TOKENS, forced: list[int] | None = None) -> Reference:
    """transformers' greedy continuation of ``ids`` (``n`` tokens, no stop), with its ties measured; ``forced``: these
    tokens fed instead of its own choices (the ties measured along them)."""
    logit_gaps: list[float] = []
    score_gaps: list[float] = []
    tokens: list[int] = []
    past = None
    step = torch.tensor([ids])
    with _recorded_selections(score_gaps):
        for _ in range(n if forced is None else len(forced)):
            score_gaps.append(float("inf"))
            out = hf(input_ids=step, past_key_values=past, use_cache=True)
            past = out.past_key_values
            row = out.logits[0, -1].float()
            top = row.topk(2).values
            logit_gaps.append(float((top[0] - top[1]) / row.abs().max().clamp(min=1e-30)))
            tok = int(row.argmax()) if forced is None else forced[len(tokens)]
            tokens.append(tok)
            step = torch.tensor([[tok]])
    return Reference(tokens, logit_gaps, score_gaps)


def explain(ref: Reference, got: list[int], logit_tie: float = LOGIT_TIE, score_tie: float = SCORE_TIE
            ) -> tuple[bool, str]:
    """(equal or accepted, what happened) for ``got`` against the reference, near-ties within the bounds given."""
    if got == ref.tokens:
        return True, "equal"
    i = next((j for j, (a, b) in enumerate(zip(got, ref.tokens)) if a != b), min(len(got), len(ref.tokens)))
    if i >= len(ref.tokens) or i >= len(got):
        return False, f"{len(got)} tokens where the reference has {len(ref.tokens)}"
    logit_gap = ref.logit_gaps[i]
    score_gap = min(ref.score_gaps[: i + 1])
    said = (f"first differs at token {i} (got {got[i]}, reference {ref.tokens[i]}); the reference's top-2 logit gap "
            f"there {logit_gap:.2e}, its smallest indexer boundary gap up to there {score_gap:.2e}")
    if logit_gap <= logit_tie:
        return True, "near-tie of the logits: " + said
    if score_gap <= score_tie:
        return True, "near-tie of an indexer selection: " + said
    return False, said


# ------------------------------------------------------------------------------------------------------------------
# the cells


@dataclass(frozen=True)
class Cell:
    name: str
    llm: dict[str, Any] = field(default_factory=dict)
    one_at_a_time: bool = False  # the prompts sent one by one
    shared_prefix: int = 0  # prompts sharing a prefix; the batch runs twice, the second on the cached prefixes
    # "int8": compared with the same settings run one prompt at a time, near-ties measured on transformers holding
    # the int8 engine's weights (int8_weights); "stored": the same, for a checkpoint stored quantised (checkpoint),
    # near-ties measured on transformers holding its dequantised weights (stored_formats)
    weights: str = ""
    checkpoint: str = ""  # "mtp": a random MTP layer added; a stored format (stored_formats.FORMATS): written in it
    must_preempt: bool = False  # the cache is small enough that sequences are preempted (checked)
    families: tuple[str, ...] = MODEL_TYPES


CELLS: dict[str, Cell] = {c.name: c for c in (
    Cell("batched"),
    Cell("one-at-a-time", {"max_num_seqs": 1}, one_at_a_time=True),
    Cell("chunked", {"max_num_batched_tokens": 24}),
    Cell("prefix-cache", shared_prefix=40),
    Cell("preemption", {"kv_cache_tokens": 320, "max_num_seqs": 12}, must_preempt=True, families=NOT_V4),
    # V4's and GLM-5-Next's fewer prompts: a cache of 10 blocks for their 13, a budget that chunks the longer prompts
    Cell("chunked-preemption", {"max_model_len": 128, "kv_cache_tokens": 160, "max_num_seqs": 5,
                                "max_num_batched_tokens": 24},
         must_preempt=True, families=OWN),
    Cell("torch-backend", {"attention_backend": "torch"}, families=NOT_V4),
    Cell("triton-interpreted", {"attention_backend": "triton"}, families=NOT_V4),
    Cell("tp2-replicated", {"tensor_parallel_size": 2}, families=ONE_RANK_NO_DRAFTS + V4 + HYV4 + DOTS3),
    Cell("tp2-sharded", {"tensor_parallel_size": 2, "latent_cache_layout": "sharded", "block_size": 32},
         families=ONE_RANK_NO_DRAFTS),
    Cell("int8", {"quantization": "int8"}, weights="int8", families=NOT_V4),
    Cell("prompt-lookup", {"num_speculative_tokens": 3}, families=ONE_RANK_NO_DRAFTS),
    Cell("mtp", {"speculative_method": "mtp", "num_speculative_tokens": 1}, checkpoint="mtp",
         families=MTP_FAMILIES),
    *(Cell(kind, weights="stored", checkpoint=kind, families=COMPRESSED_FAMILIES)
      for kind in stored_formats.FORMATS if kind.startswith("stored-")),
    *(Cell(kind, weights="stored", checkpoint=kind, families=GGUF_FAMILIES) for kind in stored_formats.GGUF),
    Cell("modelopt-nvfp4", weights="stored", checkpoint="modelopt-nvfp4", families=MODELOPT_FAMILIES),
)}


@dataclass
class Result:
    model_type: str
    seed: int | None
    cell: str
    equal: int
    accepted: list[str]
    failed: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.failed

    def line(self) -> str:
        config = "fixed" if self.seed is None else f"seed {self.seed}"
        total = self.equal + len(self.accepted) + len(self.failed)
        head = f"{self.model_type} ({config}) {self.cell}: {self.equal}/{total} equal"
        notes = [f"accepted: {a}" for a in self.accepted] + [f"FAILED: {f}" for f in self.failed]
        return "; ".join([head, *notes]) + f" [{self.seconds:.1f} s]"


class Family:
    """One checkpoint (a family, a fixed or seeded configuration) and its references, built once."""

    def __init__(self, model_type: str, seed: int | None, root: Path) -> None:
        self.model_type, self.seed = model_type, seed
        self.hf = build(model_type, seed)
        self.path = root / f"{model_type}-{'fixed' if seed is None else seed}"
        self.hf.save_pretrained(self.path)
        self._refs: dict[int, list[Reference]] = {}
        self._mtp: Path | None = None
        self._stored: dict[str, tuple[Path, torch.nn.Module]] = {}

    def references(self, ps: list[list[int]], shared_prefix: int) -> list[Reference]:
        if shared_prefix not in self._refs:
            self._refs[shared_prefix] = [reference(self.hf, p, new_tokens(self.model_type)) for p in ps]
        return self._refs[shared_prefix]

    def forced(self, ps: list[list[int]], tokens: list[list[int]], weights: str, kind: str = "") -> list[Reference]:
        """``tokens`` (one list per prompt) with their near-ties measured on the reference holding ``weights`` (for
        a stored format, the dequantised weights of the checkpoint ``kind``)."""
        hf = int8_weights(self.hf) if weights == "int8" else self.stored(kind)[1] if weights == "stored" else self.hf
        return [reference(hf, p, forced=t) for p, t in zip(ps, tokens)]

    def stored(self, kind: str) -> tuple[Path, torch.nn.Module]:
        """The checkpoint written in the stored format ``kind`` and transformers on its dequantised weights."""
        if kind not in self._stored:
            hf, src = self.hf, self.path
            if stored_formats.needs_wide(kind):  # the same configuration at a hidden size of whole K-quant blocks
                hf = build(self.model_type, self.seed, width=stored_formats.KQUANT_WIDTH)
                src = self.path.with_name(f"{self.path.name}-wide")
                hf.save_pretrained(src)
            self._stored[kind] = stored_formats.write(kind, hf, src, self.path.with_name(f"{self.path.name}-{kind}"))
        return self._stored[kind]

    def checkpoint(self, kind: str) -> Path:
        if kind in stored_formats.FORMATS:
            return self.stored(kind)[0]
        if kind != "mtp":
            return self.path
        if self._mtp is None:
            from tests.checkpoints import add_mtp_layer

            self._mtp = self.path.with_name(self.path.name + "-mtp")
            add_mtp_layer(self.path, self._mtp, self.hf)
        return self._mtp


def _generate(path: Path, settings: dict[str, Any], ps: list[list[int]], one_at_a_time: bool,
              repeat: bool = False, must_preempt: bool = False, n: int = NEW_TOKENS) -> list[list[int]]:
    from mla_runtime import LLM, SamplingParams

    kw: dict[str, Any] = dict(dtype="float32", max_model_len=256, block_size=16)
    kw.update(settings)
    if "kv_cache_tokens" in kw:  # a cache of about this many tokens (in this model's latent bytes)
        kw["kv_cache_memory"] = _bytes_per_token(path) * kw.pop("kv_cache_tokens")
    llm = LLM(str(path), **kw)
    try:
        greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        reqs = [{"prompt_token_ids": p} for p in ps]

        def run() -> list[list[int]]:
            if one_at_a_time:
                return [list(llm.generate([r], greedy)[0].outputs[0].token_ids) for r in reqs]
            return [list(o.outputs[0].token_ids) for o in llm.generate(reqs, greedy)]

        out = run()
        if must_preempt and not llm.engine.scheduler.num_preemptions:
            raise AssertionError("the cell is meant to preempt sequences, and none was preempted")
        if kw.get("num_speculative_tokens") and not llm.engine.counts.draft:
            raise AssertionError("the cell is meant to verify drafts, and none was proposed")
        if repeat:  # the same batch again, on the cached prefixes: must give the same tokens
            again = run()
            if again != out:
                bad = [i for i, (a, b) in enumerate(zip(out, again)) if a != b]
                raise AssertionError(f"the re-run on the prefix cache changed the tokens of prompts {bad}")
            if not llm.engine.stats().prefix_hit_tokens:  # a hybrid's hits too (from its state snapshots)
                raise AssertionError("the cell is meant to take prefixes from the cache, and none was taken")
        return out
    finally:
        llm.shutdown()


def _bytes_per_token(path: Path) -> int:
    """What the engine's cache budget pays per token of a sequence: its latent rows, or for V4 its compressed
    entries (``models.v4_sizes``), in float32."""
    from mla_runtime.config import ModelConfig, load_config_dict
    from mla_runtime.plan import latent_bytes_per_token

    raw = load_config_dict(path)
    if raw.get("model_type") == "deepseek_v4":
        from mla_runtime.models.deepseek_v4 import V4Config
        from mla_runtime.models.v4_sizes import cache_kinds

        return cache_kinds(V4Config.from_raw(raw), 4).block_bytes_per_token
    if raw.get("model_type") == "glm5_next":
        from mla_runtime.engine.glm5_worker import bytes_per_token
        from mla_runtime.models.glm5_next import Glm5NextConfig

        return bytes_per_token(Glm5NextConfig.from_raw(raw), 4)
    if raw.get("model_type") == "dots3_note":
        from mla_runtime.models.dots3_note import Dots3Config
        from mla_runtime.models.row_sizes import dots3_kinds

        return dots3_kinds(Dots3Config.from_raw(raw), 4).bytes_per_token
    if raw.get("model_type") == "hy_v4":
        from mla_runtime.models.hy_v4 import HyV4Config
        from mla_runtime.models.row_sizes import hy_v4_kinds

        return hy_v4_kinds(HyV4Config.from_raw(raw), 4).bytes_per_token
    return latent_bytes_per_token(ModelConfig.from_pretrained(path), "auto", "float32")


def prompt_lens(model_type: str) -> tuple[int, ...]:
    """The lengths of a family's prompts: ``PROMPT_LENS``, V4's fewer ``V4_PROMPT_LENS``."""
    return V4_PROMPT_LENS if model_type in OWN else PROMPT_LENS


def new_tokens(model_type: str) -> int:
    """The greedy tokens generated after each prompt: ``NEW_TOKENS``, V4's fewer ``V4_NEW_TOKENS``."""
    return V4_NEW_TOKENS if model_type in OWN else NEW_TOKENS


def run_cell(family: Family, cell: Cell, lens: tuple[int, ...] | None = None) -> Result:
    start = time.perf_counter()
    lens = lens or prompt_lens(family.model_type)
    ps = prompts(lens, cell.shared_prefix)
    path = family.checkpoint(cell.checkpoint)
    got = _generate(path, cell.llm, ps, cell.one_at_a_time, repeat=cell.shared_prefix > 0,
                    must_preempt=cell.must_preempt, n=new_tokens(family.model_type))
    if cell.weights:
        from mla_runtime.engine.config import EngineConfig
        from mla_runtime.plan import default_max_num_batched_tokens

        # one at a time under the batch's token budget: a budget of one sequence's would cut the longer prompts into
        # other chunks than the batch's (a batch-invariant model's chunks are half the budget)
        budget = cell.llm.get("max_num_batched_tokens") or default_max_num_batched_tokens(
            int(cell.llm.get("max_model_len", 256)), int(cell.llm.get("max_num_seqs", EngineConfig.max_num_seqs)))
        alone = _generate(path, {**cell.llm, "max_num_seqs": 1, "max_num_batched_tokens": budget}, ps, True,
                          n=new_tokens(family.model_type))
        refs = family.forced(ps, alone, cell.weights, cell.checkpoint)
    else:
        refs = family.references(ps, cell.shared_prefix)
    equal, accepted, failed = 0, [], []
    for n, ref, tokens in zip(lens, refs, got):
        ok, why = explain(ref, tokens, *((INT8_TIE, INT8_TIE) if cell.weights else (LOGIT_TIE, SCORE_TIE)))
        if why == "equal":
            equal += 1
        elif ok:
            accepted.append(f"prompt of {n} tokens: {why}")
        else:
            failed.append(f"prompt of {n} tokens: {why}")
    return Result(family.model_type, family.seed, cell.name, equal, accepted, failed, time.perf_counter() - start)


def applicable(family: Family, cell: Cell) -> bool:
    """The cell runs on the family's checkpoint: its family has what the cell needs, and its ranks split every layer's
    heads (a drawn configuration with an odd head count has no two-rank layout, and says so at start)."""
    ranks = int(cell.llm.get("tensor_parallel_size", 1))
    text = family.hf.config.get_text_config().to_dict()  # dots3-note's sliding layers have head counts of their own
    per_layer = (text.get("per_layer_config") or {}).values()
    heads = [int(text["num_attention_heads"])] + [int(p["num_attention_heads"]) for p in per_layer
                                                  if p.get("num_attention_heads")]
    return family.model_type in cell.families and all(h % ranks == 0 for h in heads)


def sample(rng: random.Random, count: int) -> list[tuple[str, int, str]]:
    """``count`` cells drawn from ``rng``: (model_type, config seed, cell name)."""
    # the others start processes or interpret; ModelOpt's cell runs in the bench matrix only: its writer takes every
    # decoder matrix's rows in whole groups of 16 (drawn widths of 24 are not)
    cheap = [c for c in CELLS if not c.startswith(("tp2", "triton", "mtp")) and c != "modelopt-nvfp4"]
    out = []
    for _ in range(count):
        model_type = rng.choice(DRAWN_TYPES)
        out.append((model_type, rng.randrange(10_000),
                    rng.choice([c for c in cheap if model_type in CELLS[c].families
                                and not (c.startswith("stored") and model_type in STORED_BENCH_ONLY)])))
    return out


def cleanup(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)

