"""The MLA family: one adapter per ``model_type``, mapping its checkpoint onto the one model the runtime runs.

Every MLA architecture the runtime loads is DeepSeek's decoder with some variations named in ``ModelConfig`` (router,
RoPE layout, MLP/MoE layer schedule, ...). An adapter (``Family``) says which layout it follows (``deepseek_v2`` or
``deepseek_v3``: their router and RoPE rules), how to rewrite its ``config.json`` into the fields ``config.py`` reads
(``normalise``), and how its tensor names map onto the model's parameter names (``rename``: None drops a tensor the
text model does not use). A variation the runtime does not implement is refused by ``normalise`` with a message that
names it: never silently wrong output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Raw = dict[str, Any]


def _same(raw: Raw) -> Raw:
    return raw


def _same_name(name: str) -> str | None:
    return name


@dataclass(frozen=True)
class Family:
    model_type: str
    layout: str  # "deepseek_v2" | "deepseek_v3": the router and RoPE rules it follows
    example: str  # a checkpoint of this family (for the docs and messages)
    normalise: Callable[[Raw], Raw] = _same  # its config.json -> the fields config.py reads (raises on what is missing)
    rename: Callable[[str], str | None] = _same_name  # a checkpoint tensor name -> the model's (None: not used)


# -- dense and GLM MLA families: transformers' class defaults fill what a config.json leaves out ------------------
_MOE_FIELDS = ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
               "topk_group", "topk_method", "scoring_func", "routed_scaling_factor", "norm_topk_prob",
               "first_k_dense_replace", "moe_layer_freq")
REFERENCE_NORM_EPS = 1e-6  # the eps transformers builds q_a_layernorm and kv_a_layernorm with, whatever rms_norm_eps


def _with_defaults(raw: Raw, **defaults: Any) -> Raw:
    """``raw`` with ``defaults`` for the keys it does not have (a key present as null stays null)."""
    return {**defaults, **raw}


def _full_rotary(raw: Raw) -> None:
    """Refuse a partial rotary embedding: the runtime rotates all ``qk_rope_head_dim`` dims."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if factor is not None and float(factor) != 1.0:
        raise ValueError(f"{raw.get('model_type')}: partial_rotary_factor {factor} is not supported (the runtime "
                         f"rotates every one of the qk_rope_head_dim dims)")


def _dense(raw: Raw) -> Raw:
    """No MoE: transformers' dense MLA families have no experts, whatever MoE fields a config carries."""
    return {k: v for k, v in raw.items() if k not in _MOE_FIELDS}


def _minicpm3(raw: Raw) -> Raw:
    """MiniCPM3: dense MLA with µP scaling (``scale_emb``, ``scale_depth``, ``dim_model_base``) and RoPE over the
    two halves of ``d_r`` (not interleaved); ``v_head_dim`` defaults to ``hidden_size / num_attention_heads``."""
    _full_rotary(raw)
    out = _dense(_with_defaults(raw, vocab_size=73448, hidden_size=2560, intermediate_size=6400, num_hidden_layers=62,
                                num_attention_heads=40, max_position_embeddings=32768, rms_norm_eps=1e-5,
                                tie_word_embeddings=True, kv_lora_rank=256, q_lora_rank=768, qk_nope_head_dim=64,
                                qk_rope_head_dim=32, scale_emb=12, scale_depth=1.4, dim_model_base=256))
    layers, hidden = int(out["num_hidden_layers"]), int(out["hidden_size"])
    if out.get("v_head_dim") is None:
        out["v_head_dim"] = hidden // int(out["num_attention_heads"])
    depth = math.sqrt(layers) if out["scale_depth"] is None else float(out["scale_depth"])  # null: no scaling
    base = hidden if out["dim_model_base"] is None else int(out["dim_model_base"])
    out.update(embedding_scale=float(out["scale_emb"]), residual_scale=depth / math.sqrt(layers),
               lm_head_divisor=hidden / base, rope_interleave=False, latent_norm_eps=REFERENCE_NORM_EPS)
    return out


def _youtu(raw: Raw) -> Raw:
    """Youtu-LLM: DeepSeek-V3's attention (``rope_interleave``) in a dense Llama decoder with tied embeddings."""
    _full_rotary(raw)
    out = _dense(_with_defaults(raw, vocab_size=128256, hidden_size=2048, intermediate_size=6144,
                                num_hidden_layers=32, num_attention_heads=16, max_position_embeddings=131072,
                                rms_norm_eps=1e-6, tie_word_embeddings=True, kv_lora_rank=512, q_lora_rank=1536,
                                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rope_interleave=True))
    out["latent_norm_eps"] = REFERENCE_NORM_EPS
    return out


def _glm4_moe_lite(raw: Raw) -> Raw:
    """GLM-4.7-Flash: DeepSeek-V3's attention and router (sigmoid scores, correction bias, groups scored by their
    top-2, ``norm_topk_prob``, ``routed_scaling_factor``) with the MoE layers listed by ``mlp_layer_types``
    (transformers' default: every layer but the first)."""
    _full_rotary(raw)
    out = _with_defaults(raw, vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
                         num_hidden_layers=47, num_attention_heads=20, n_shared_experts=1, n_routed_experts=64,
                         routed_scaling_factor=1.8, kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64,
                         v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=4,
                         norm_topk_prob=True, max_position_embeddings=202752, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, rope_interleave=True)
    kinds = out.get("mlp_layer_types") or ["dense"] + ["sparse"] * (int(out["num_hidden_layers"]) - 1)
    unknown = sorted(set(kinds) - {"dense", "sparse"})
    if unknown:
        raise ValueError(f"glm4_moe_lite: mlp_layer_types {unknown} are not supported (use 'dense' or 'sparse')")
    # the router is fixed by the architecture: fields a config may carry for it are not read by the reference
    out.update(moe_layers=[k == "sparse" for k in kinds], topk_method="noaux_tc", scoring_func="sigmoid",
               first_k_dense_replace=0, moe_layer_freq=1, latent_norm_eps=REFERENCE_NORM_EPS)
    return out


# -- DeepSeek-V3 variants: transformers' DeepSeek-V3 decoder with their own defaults and the variations named here ---
V3_ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}  # fixed by the architecture


def _sarvam_mla(raw: Raw) -> Raw:
    """Sarvam (``sarvam_mla``): transformers runs it as DeepseekV3ForCausalLM with SarvamMLAConfig's defaults (no
    Q-LoRA, one dense first layer, one expert group). The original config's names ``num_experts``,
    ``num_shared_experts`` and ``num_mtp_layers`` are read as DeepSeek's; ``head_dim``/``q_head_dim`` are derived."""
    out = {k: v for k, v in raw.items() if k not in ("head_dim", "q_head_dim")}
    for old, new in (("num_experts", "n_routed_experts"), ("num_shared_experts", "n_shared_experts"),
                     ("num_mtp_layers", "num_nextn_predict_layers")):
        if old in out:
            value = out.pop(old)
            out.setdefault(new, value)
    out = _with_defaults(out, vocab_size=262144, hidden_size=4096, intermediate_size=16384, moe_intermediate_size=2048,
                         num_hidden_layers=32, num_attention_heads=64, n_shared_experts=1, n_routed_experts=128,
                         routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                         v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=8,
                         first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True, bos_token_id=0,
                         eos_token_id=1)
    return {**out, **V3_ROUTER, "latent_norm_eps": REFERENCE_NORM_EPS}


# Kimi-K2.5's text model: the wrapper's names for it (original checkpoint, then transformers' own), and what
# transformers renames on the way (its ``blocks`` -> ``layers``)
_KIMI_K25_TEXT = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def _kimi_k25(raw: Raw) -> Raw:
    """Kimi-K2.5/K2.6 (``kimi_k25``): a vision tower around a DeepSeek-V3 language model; the runtime serves the
    text model, read from ``text_config``. transformers ties lm_head to the embeddings by the wrapper's
    ``tie_word_embeddings`` (default true), not the text config's."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("kimi_k25: config.json has no text_config (the language model's config)")
    out = {**text, "model_type": "kimi_k25", "architectures": None,
           "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True))}
    for key in ("quantization_config", "torch_dtype", "dtype", "bos_token_id", "eos_token_id"):
        if out.get(key) is None and raw.get(key) is not None:
            out[key] = raw[key]
    return out


def _kimi_k25_name(name: str) -> str | None:
    """A Kimi-K2.5 tensor's name in the text model, or None for the vision tower's and the projector's. A name
    already the text model's stays (a checkpoint the runtime wrote)."""
    if name.startswith(("model.layers.", "model.embed_tokens.", "model.norm.")):
        return name
    for old, new in _KIMI_K25_TEXT:
        if name.startswith(old):
            name = new + name[len(old):]
            return "model.layers." + name[len("model.blocks."):] if name.startswith("model.blocks.") else name
    return None


def _axk1(raw: Raw) -> Raw:
    """A.X-K1 (``axk1``): DeepSeek-V3 with an RMSNorm on each MoE layer's output (``post_mlp_layernorm``), MoE
    layers listed by ``mlp_layer_types`` (else from ``first_k_dense_replace``/``moe_layer_freq``, default 1 and 1),
    always Q-LoRA, no MTP layers, and a router whose correction bias the released checkpoints leave out (zeros)."""
    out = _with_defaults(raw, vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                         num_hidden_layers=61, num_attention_heads=64, n_shared_experts=1, n_routed_experts=192,
                         routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                         v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                         norm_topk_prob=True, max_position_embeddings=32768, rms_norm_eps=1e-6, bos_token_id=163691,
                         eos_token_id=163691, tie_word_embeddings=False, rope_interleave=True)
    if out.get("q_lora_rank") is None:
        raise ValueError("axk1: q_lora_rank is required (A.X-K1's attention always has a Q-LoRA)")
    layers = int(out["num_hidden_layers"])
    first, freq = int(out.get("first_k_dense_replace") or 1), int(out.get("moe_layer_freq") or 1)
    kinds = out.get("mlp_layer_types") or ["sparse" if i >= first and i % freq == 0 else "dense"
                                           for i in range(layers)]
    unknown = sorted(set(kinds) - {"dense", "sparse"})
    if unknown:
        raise ValueError(f"axk1: mlp_layer_types {unknown} are not supported (use 'dense' or 'sparse')")
    return {**out, **V3_ROUTER, "moe_layers": [k == "sparse" for k in kinds], "first_k_dense_replace": 0,
            "correction_bias": "optional", "moe_output_norm": True, "num_nextn_predict_layers": 0,
            "latent_norm_eps": REFERENCE_NORM_EPS}


def _axk1_name(name: str) -> str:
    """transformers' in-memory name of the MoE output norm -> the checkpoints' (beside the layer's other norms)."""
    return name.replace(".mlp.post_mlp_layernorm.", ".post_mlp_layernorm.")


MISTRAL4_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                 "llama_4_scaling_beta": 0.1}


def _mistral4(raw: Raw) -> Raw:
    """Mistral 4 (``mistral4``): DeepSeek-V3's MLA with a softmax router (no correction bias; groups, when more than
    one, ranked by their top-2 scores), every layer from ``first_k_dense_replace`` (default 0) a MoE layer, YaRN over
    the ``d_r`` rotary dims, and the Llama-4 query scaling (``llama_4_scaling_beta``: ``query_scale_beta``)."""
    out = _with_defaults(raw, vocab_size=131072, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
                         num_hidden_layers=36, num_attention_heads=32, n_shared_experts=1, n_routed_experts=128,
                         routed_scaling_factor=1.0, kv_lora_rank=256, q_lora_rank=1024, qk_rope_head_dim=64,
                         v_head_dim=128, qk_nope_head_dim=64, n_group=1, topk_group=1, num_experts_per_tok=4,
                         first_k_dense_replace=0, norm_topk_prob=True, max_position_embeddings=1048576,
                         rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         rope_interleave=True)
    rope = dict(out.get("rope_parameters") or out.get("rope_scaling") or MISTRAL4_ROPE)
    d_n, d_r = int(out["qk_nope_head_dim"]), int(out["qk_rope_head_dim"])
    partial = rope.get("partial_rotary_factor")
    if partial is not None and int((d_n + d_r) * float(partial)) != d_r:
        raise ValueError(f"mistral4: partial_rotary_factor {partial} rotates {int((d_n + d_r) * float(partial))} "
                         f"dims; the runtime rotates the qk_rope_head_dim ({d_r}) dims")
    grouped = int(out.get("n_group") or 1) > 1
    return {**out, "rope_parameters": rope, "rope_scaling": None,
            "query_scale_beta": float(rope.get("llama_4_scaling_beta") or 0.0), "scoring_func": "softmax",
            "topk_method": "noaux_tc" if grouped else "greedy", "correction_bias": "none", "moe_layer_freq": 1,
            "latent_norm_eps": REFERENCE_NORM_EPS}


# -- DeepSeek Sparse Attention (DSA): DeepSeek-V3's decoder with the lightning indexer on every layer -----------------
def _mlp_layer_kinds(out: Raw, model_type: str, first_dense: int) -> list[bool]:
    """The MoE layers of a config listing ``mlp_layer_types`` (else the first ``first_k_dense_replace`` dense)."""
    layers = int(out["num_hidden_layers"])
    first = int(out["first_k_dense_replace"] if out.get("first_k_dense_replace") is not None else first_dense)
    kinds = out.get("mlp_layer_types") or ["dense"] * min(first, layers) + ["sparse"] * max(layers - first, 0)
    unknown = sorted(set(kinds) - {"dense", "sparse"})
    if unknown:
        raise ValueError(f"{model_type}: mlp_layer_types {unknown} are not supported (use 'dense' or 'sparse')")
    return [k == "sparse" for k in kinds]


def _dsa_common(out: Raw, model_type: str) -> Raw:
    if out.get("q_lora_rank") is None:
        raise ValueError(f"{model_type}: q_lora_rank is required (the indexer reads the query's low-rank q_resid)")
    return {**out, **V3_ROUTER, "moe_layers": _mlp_layer_kinds(out, model_type, 3), "first_k_dense_replace": 0,
            "rope_interleave": True, "latent_norm_eps": REFERENCE_NORM_EPS}


def _deepseek_v32(raw: Raw) -> Raw:
    """DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3 with an indexer on every layer whose RoPE rotates halves."""
    out = _with_defaults(raw, vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                         num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                         routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                         v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                         norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6, bos_token_id=0,
                         eos_token_id=1, tie_word_embeddings=False, index_topk=2048, index_head_dim=128,
                         index_n_heads=64)
    return {**_dsa_common(out, "deepseek_v32"), "index_rope_interleave": False, "indexer_types": None}


def _glm_moe_dsa(raw: Raw) -> Raw:
    """GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2's attention with an interleaved indexer RoPE, and layers that reuse the
    previous layer's selection (``indexer_types``: else from ``index_topk_pattern``, or ``index_topk_freq`` and
    ``index_skip_topk_offset``, as transformers derives it)."""
    out = _with_defaults(raw, vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
                         num_hidden_layers=78, num_attention_heads=64, n_shared_experts=1, n_routed_experts=256,
                         routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64,
                         v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=8,
                         norm_topk_prob=True, max_position_embeddings=202752, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, index_topk=2048, index_head_dim=128, index_n_heads=32)
    return {**_dsa_common(out, "glm_moe_dsa"), "index_rope_interleave": True, "indexer_types": _indexer_kinds(out)}


def _indexer_kinds(out: Raw) -> list[str]:
    """GLM-5's ``indexer_types``: as listed, else from ``index_topk_pattern``, or ``index_topk_freq`` and
    ``index_skip_topk_offset``, as transformers derives them."""
    kinds = out.get("indexer_types")
    if kinds is None:
        pattern = out.get("index_topk_pattern")
        if pattern is not None:
            letters = {"F": "full", "S": "shared"}
            kinds = [letters.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq, offset = max(int(out.get("index_topk_freq") or 1), 1), int(out.get("index_skip_topk_offset", 2))
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                     for i in range(int(out["num_hidden_layers"]))]
    return list(kinds)


def _axk2(raw: Raw) -> Raw:
    """A.X-K2 (``axk2``): DeepSeek-V3.2's sparse attention and router with three variations. No ``q_b_proj``: one
    projection of ``[q_resid ; q_a_proj(h)]`` gives each head's query and a sigmoid gate on its attention output
    (``query_gate``; the checkpoints store it as ``q_b_proj``). A low-rank sigmoid gate on every layer's input norm and
    on a MoE layer's post-attention norm (``gated_norm_rank``). MoE layers listed by ``mlp_layer_types``, else from
    ``first_k_dense_replace``/``moe_layer_freq`` (default 1 and 1). The router takes no expert groups unless
    ``n_group`` is set; grouped routing is refused: A.X-K2 scores the dropped groups' experts 0 where the runtime
    drops them (-inf), which can pick other experts. No MTP layers (transformers reads none)."""
    out = _with_defaults(raw, vocab_size=163840, hidden_size=2048, intermediate_size=5120, moe_intermediate_size=512,
                         num_hidden_layers=48, num_attention_heads=32, n_shared_experts=1, n_routed_experts=128,
                         routed_scaling_factor=2.5, kv_lora_rank=128, q_lora_rank=384, qk_rope_head_dim=32,
                         v_head_dim=64, qk_nope_head_dim=64, n_group=None, topk_group=None, num_experts_per_tok=8,
                         norm_topk_prob=True, max_position_embeddings=131072, rms_norm_eps=1e-6, bos_token_id=163691,
                         eos_token_id=163691, tie_word_embeddings=False, index_topk=2048, index_head_dim=128,
                         index_n_heads=16, gated_norm_rank=16)
    groups, kept = out.get("n_group"), out.get("topk_group")
    if (groups is None) != (kept is None):
        raise ValueError(f"axk2: n_group ({groups}) and topk_group ({kept}) must be set together (both null: no "
                         f"expert groups)")
    if groups is not None and int(groups) > 1:
        raise ValueError(f"axk2: grouped routing (n_group {groups}) is not supported: A.X-K2 scores the experts of "
                         f"the groups it drops 0, not -inf, which the runtime's router does not implement")
    if out.get("gated_norm_rank") is None or int(out["gated_norm_rank"]) < 1:
        raise ValueError(f"axk2: gated_norm_rank must be >= 1, got {out.get('gated_norm_rank')}")
    if out.get("mlp_layer_types") is None:
        first = 1 if out.get("first_k_dense_replace") is None else int(out["first_k_dense_replace"])
        freq = int(out.get("moe_layer_freq") or 1)
        out["mlp_layer_types"] = ["sparse" if i >= first and i % freq == 0 else "dense"
                                  for i in range(int(out["num_hidden_layers"]))]
    return {**_dsa_common(out, "axk2"), "index_rope_interleave": False, "indexer_types": None, "query_gate": True,
            "gated_norm_rank": int(out["gated_norm_rank"]), "num_nextn_predict_layers": 0}


MISTRAL_LARGE4_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2048.0,
                       "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0,
                       "attention_factor": 1.0}


def _mistral_large4(raw: Raw) -> Raw:
    """Mistral Large 4 (``mistral_large4``: a vision tower around the text model ``mistral_large4_text``, which is
    served; a bare ``mistral_large4_text`` config too). GLM-5's sparse attention with these variations: no Q-LoRA, so
    the indexer's queries come from the hidden state (``index_query_source`` ``hidden``); the attention's and the
    indexer's queries times a learned per-head ``scale ln(1 + p) + bias`` (``query_log_scaling``,
    ``index_query_log_scaling``); NoPE layers (``no_rope_layers[i]`` 0: ``rope_layers``), whose indexer rotates
    nothing either; YaRN with learned per-frequency scales (LeRoPE: ``rope_learned_frequency_scale``), interleaved
    pairs in the attention and the indexer; the final logits soft-capped (``final_logit_softcapping``). The router is
    Mistral 4's: softmax, groups ranked by their top-2 scores (a dropped group's experts scored 0, which no kept
    expert's positive softmax score loses to: the runtime's -inf), no correction bias, always renormalised.
    Cross-layer KV sharing (``kv_source_layers`` naming another layer) is refused. The MTP head (``mtp_dspark``) is
    not read, as transformers does not. kv_a_layernorm uses ``rms_norm_eps`` (not DeepSeek's 1e-6)."""
    if raw.get("model_type") == "mistral_large4":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("mistral_large4: config.json has no text_config (the language model's config)")
        out = {**text, "architectures": None, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False))}
        for key in ("quantization_config", "torch_dtype", "dtype"):
            if out.get(key) is None and raw.get(key) is not None:
                out[key] = raw[key]
    else:
        out = dict(raw)
    out["model_type"] = "mistral_large4"
    out = _with_defaults(out, vocab_size=204800, hidden_size=6144, intermediate_size=24576, moe_intermediate_size=6144,
                         num_hidden_layers=72, num_attention_heads=64, n_shared_experts=1, n_routed_experts=128,
                         routed_scaling_factor=1.0, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128,
                         qk_nope_head_dim=64, n_group=1, topk_group=1, num_experts_per_tok=4,
                         max_position_embeddings=1048576, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                         index_topk=2048, index_head_dim=128, index_n_heads=32, first_k_dense_replace=1,
                         tie_word_embeddings=False, final_logit_softcapping=30.0)
    if not any(out.get(k) is not None for k in ("rope_parameters", "rope_scaling")):
        out["rope_parameters"] = dict(MISTRAL_LARGE4_ROPE)
    _full_rotary(out)
    layers = int(out["num_hidden_layers"])
    sources = out.get("kv_source_layers")
    if sources is not None and list(sources) != list(range(layers)):
        shared = [i for i, s in enumerate(sources) if s != i]
        raise ValueError(f"mistral_large4: kv_source_layers {list(sources)} make layers {shared} reuse another "
                         f"layer's KV: cross-layer KV sharing is not supported (every layer must own its cache)")
    rope = out.get("no_rope_layers")
    if rope is None:
        every = int(out.get("no_rope_layer_interval") or 4)
        rope = [int((i + 1) % every != 0) for i in range(layers)]
    if len(rope) < layers:
        raise ValueError(f"mistral_large4: no_rope_layers lists {len(rope)} layers, the model has {layers}")
    grouped = int(out.get("n_group") or 1) > 1
    softcap = out.get("final_logit_softcapping")
    return {**out, "q_lora_rank": None, "moe_layers": _mlp_layer_kinds(out, "mistral_large4", 1),
            "first_k_dense_replace": 0, "moe_layer_freq": 1, "scoring_func": "softmax",
            "topk_method": "noaux_tc" if grouped else "greedy", "correction_bias": "none", "norm_topk_prob": True,
            "rope_interleave": True, "index_rope_interleave": True, "indexer_types": _indexer_kinds(out),
            "index_query_source": "hidden", "index_query_log_scaling": True, "query_log_scaling": True,
            "rope_layers": [bool(r) for r in rope[:layers]], "rope_learned_frequency_scale": True,
            "logit_softcap": float(softcap or 0.0), "num_nextn_predict_layers": 0, "latent_norm_eps": None,
            "mlp_bias": False}


# Mistral Large 4's checkpoint names (Mistral's own layout, as transformers saves it) -> the model's
_MISTRAL_LARGE4_TOP = {"tok_embeddings.": "model.embed_tokens.", "norm.": "model.norm.", "output.": "lm_head.",
                       "lerope.alpha": "model.rotary_emb.alpha"}
_MISTRAL_LARGE4_PARTS = (
    (".attention.", ".self_attn."), (".wq.", ".q_proj."), (".wkv_a_with_mqa.", ".kv_a_proj_with_mqa."),
    (".wkv_b.", ".kv_b_proj."), (".wo.", ".o_proj."), (".attention_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."), (".kv_a_norm.", ".kv_a_layernorm."),
    (".ssmax_scaling.s", ".softmax_scaling.scale"), (".ssmax_scaling.b", ".softmax_scaling.bias"))
_MISTRAL_LARGE4_MLP = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_MISTRAL_LARGE4_DROPPED = ("vision_encoder.", "pre_mm_projector_norm.", "patch_merger.", "vision_language_adapter.",
                           "mtp_dspark.", "model.vision_tower.", "model.multi_modal_projector.")


def _mistral_large4_name(name: str) -> str | None:
    """A Mistral Large 4 tensor's name in the text model, or None for the vision tower's, the projector's and the
    MTP head's. Reads Mistral's layout (``layers.{i}.attention.wq``, ``experts.{e}.w1``, ``lerope.alpha``, ...) and
    transformers' in-memory one (``model.language_model.*``); a name already the model's stays."""
    if name.startswith(_MISTRAL_LARGE4_DROPPED):
        return None
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head.")):
        if name.startswith(old):
            return new + name[len(old):]
    if name.startswith(("model.", "lm_head.")):
        return name
    for old, new in _MISTRAL_LARGE4_TOP.items():
        if name.startswith(old):
            return new + name[len(old):]
    if not name.startswith("layers."):
        return name  # reported as unexpected by the loader
    name = "model." + name
    for old, new in _MISTRAL_LARGE4_PARTS:
        name = name.replace(old, new)
    parts = name.split(".")  # model.layers.{i}.<rest>
    rest = parts[3:]
    if rest[:1] == ["feed_forward"] and len(rest) == 3:  # a dense MLP: feed_forward.w1.weight
        rest = ["mlp", _MISTRAL_LARGE4_MLP.get(rest[1], rest[1]), rest[2]]
    elif rest[:1] == ["shared_experts"] and len(rest) == 3:
        rest = ["mlp", "shared_experts", _MISTRAL_LARGE4_MLP.get(rest[1], rest[1]), rest[2]]
    elif rest[:1] == ["experts"] and len(rest) == 4:  # experts.{e}.w1.weight
        rest = ["mlp", "experts", rest[1], _MISTRAL_LARGE4_MLP.get(rest[2], rest[2]), rest[3]]
    elif rest[:1] == ["gate"]:
        rest = ["mlp", *rest]
    return ".".join(parts[:3] + rest)


# -- LongCat-Flash: two attention blocks a layer and a shortcut MoE with zero-computation experts --------------------
def _alias(out: Raw, name: str, alias: str) -> None:
    """``out[name]`` from transformers' alias of it (``attribute_map``) where the config uses only the alias."""
    if out.get(name) is None and out.get(alias) is not None:
        out[name] = out[alias]


def _longcat_flash(raw: Raw) -> Raw:
    """LongCat-Flash (``longcat_flash``): ``num_layers`` layers of two MLA blocks each (cache layers ``2i`` and
    ``2i + 1``) with a dense MLP after each, and a MoE fed by the first block's post-attention norm whose output is
    added at the layer's end. The router: softmax over the routed and ``zero_expert_num`` zero (identity) experts,
    the top-k chosen with a correction bias, their weights unnormalised times ``routed_scaling_factor``; no shared
    experts. The MLA always has a Q-LoRA, scales the queries by ``sqrt(hidden_size / q_lora_rank)`` and the normed
    latent by ``sqrt(hidden_size / kv_lora_rank)``, and rotates ``head_dim`` (= ``qk_rope_head_dim``) interleaved
    dims. The checkpoint's MTP layer (``model.mtp``) is not read, as transformers does not."""
    out = dict(raw)
    for name, alias in (("moe_topk", "num_experts_per_tok"), ("ffn_hidden_size", "intermediate_size"),
                        ("expert_ffn_hidden_size", "moe_intermediate_size"), ("n_routed_experts", "num_local_experts")):
        _alias(out, name, alias)
    if out.get("num_layers") is None and out.get("num_hidden_layers") is not None:
        out["num_layers"] = int(out["num_hidden_layers"]) // 2  # transformers: num_hidden_layers = 2 * num_layers
    if not any(out.get(k) is not None for k in ("rope_parameters", "rope_scaling", "rope_theta")):
        out["rope_theta"] = 10000000.0
    out = _with_defaults(out, vocab_size=131072, hidden_size=6144, num_layers=28, num_attention_heads=64,
                         ffn_hidden_size=12288, max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False, attention_bias=False, q_lora_rank=1536,
                         kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, head_dim=64, v_head_dim=128,
                         moe_topk=12, n_routed_experts=512, zero_expert_num=256, expert_ffn_hidden_size=2048,
                         routed_scaling_factor=6.0)
    _full_rotary(out)
    missing = []
    if out.get("q_lora_rank") is None:
        missing.append("q_lora_rank null (LongCat's attention always has a Q-LoRA)")
    d_r, d_n = int(out["qk_rope_head_dim"]), int(out["qk_nope_head_dim"])
    if out.get("head_dim") is not None and int(out["head_dim"]) != d_r:
        missing.append(f"head_dim {out['head_dim']} != qk_rope_head_dim {d_r} (the rotary dims are head_dim)")
    if out.get("qk_head_dim") is not None and int(out["qk_head_dim"]) != d_n + d_r:
        missing.append(f"qk_head_dim {out['qk_head_dim']} != qk_nope_head_dim + qk_rope_head_dim ({d_n + d_r})")
    if not out.get("n_routed_experts"):
        missing.append("n_routed_experts 0 (a MoE of zero experts only)")
    if out.get("router_bias"):
        missing.append("router_bias (a bias on the router's classifier)")
    if out.get("zero_expert_type", "identity") not in (None, "identity"):
        missing.append(f"zero_expert_type {out['zero_expert_type']!r} (only identity zero experts)")
    for flag in ("mla_scale_q_lora", "mla_scale_kv_lora"):
        if out.get(flag) is False:
            missing.append(f"{flag} false (transformers always scales)")
    if out.get("attention_method", "MLA") not in (None, "MLA"):
        missing.append(f"attention_method {out['attention_method']!r} (only MLA)")
    if missing:
        raise ValueError("longcat_flash: not supported: " + "; ".join(missing))
    hidden = int(out["hidden_size"])
    return {**out, "num_hidden_layers": int(out["num_layers"]), "attention_blocks_per_layer": 2,
            "intermediate_size": out["ffn_hidden_size"], "moe_intermediate_size": out["expert_ffn_hidden_size"],
            "num_experts_per_tok": out["moe_topk"], "zero_experts": int(out.get("zero_expert_num") or 0),
            "n_shared_experts": 0, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "softmax",
            "norm_topk_prob": False, "correction_bias": "required", "first_k_dense_replace": 0, "moe_layer_freq": 1,
            "moe_layers": None, "mlp_bias": False, "rope_interleave": True, "num_nextn_predict_layers": 0,
            "latent_norm_eps": REFERENCE_NORM_EPS, "query_lora_scale": math.sqrt(hidden / int(out["q_lora_rank"])),
            "latent_scale": math.sqrt(hidden / int(out["kv_lora_rank"]))}


def _longcat_flash_name(name: str) -> str | None:
    """LongCat's router (``mlp.router.classifier``, ``mlp.router.e_score_correction_bias``) -> the model's
    ``mlp.gate``; its MTP layer (``model.mtp.*``) is dropped."""
    if name.startswith("model.mtp."):
        return None
    return name.replace(".mlp.router.classifier.", ".mlp.gate.").replace(".mlp.router.", ".mlp.gate.")


# -- hybrids: MLA layers between linear-attention (Kimi Delta Attention) layers ----------------------------------------
_KIMI_LINEAR_ALIASES = (("n_group", "num_expert_group"), ("n_routed_experts", "num_experts"),
                        ("n_routed_experts", "num_local_experts"), ("num_experts_per_tok", "num_experts_per_token"),
                        ("n_shared_experts", "num_shared_experts"), ("norm_topk_prob", "moe_renormalize"),
                        ("max_position_embeddings", "model_max_length"))


def _hybrid_layer_kinds(model_type: str, kinds: list[Any], layers: int) -> list[bool]:
    """``layer_types`` checked (one per layer, each ``full_attention`` or ``linear_attention``) -> True for the
    linear-attention layers."""
    if len(kinds) != layers:
        raise ValueError(f"{model_type}: layer_types lists {len(kinds)} layers, the model has {layers}")
    unknown = sorted({str(k) for k in kinds} - {"full_attention", "linear_attention"})
    if unknown:
        raise ValueError(f"{model_type}: layer_types {unknown} are not supported (use 'full_attention' or "
                         f"'linear_attention')")
    return [k == "linear_attention" for k in kinds]


def _hybrid_mlp_kinds(model_type: str, out: Raw, layers: int, dense_first: int) -> list[bool]:
    """``mlp_layer_types`` (else the first ``first_k_dense_replace`` layers dense) -> True for the MoE layers."""
    kinds = out.get("mlp_layer_types") or [
        "dense" if i < int(out.get("first_k_dense_replace") or dense_first) else "sparse" for i in range(layers)]
    unknown = sorted(set(kinds) - {"dense", "sparse"})
    if unknown:
        raise ValueError(f"{model_type}: mlp_layer_types {unknown} are not supported (use 'dense' or 'sparse')")
    return [k == "sparse" for k in kinds]


def _kimi_linear_layer_kinds(out: Raw, layers: int) -> list[bool]:
    """Which layers are linear-attention ones: ``layer_types``, else the original config's 1-indexed
    ``linear_attn_config`` lists, else transformers' default (full attention at every fourth layer but the first)."""
    lin = out.get("linear_attn_config") or {}
    kinds = out.get("layer_types")
    if kinds is None and "full_attn_layers" in lin and "kda_layers" in lin:
        kinds = [None] * layers
        for i in lin["full_attn_layers"]:
            kinds[int(i) - 1] = "full_attention"
        for i in lin["kda_layers"]:
            kinds[int(i) - 1] = "linear_attention"
    if kinds is None:
        kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    return _hybrid_layer_kinds("kimi_linear", kinds, layers)


def _kimi_linear(raw: Raw) -> Raw:
    """Kimi Linear (``kimi_linear``): DeepSeek-V3's decoder (its router: sigmoid scores, correction bias, grouped
    top-k) whose attention is MLA without RoPE (the shared ``d_r`` key dims carry no position: RoPE kind ``none``;
    no Q-LoRA by default) in the ``full_attention`` layers and Kimi Delta Attention (``layers.kda``) in the
    ``linear_attention`` ones; dense MLP or MoE per ``mlp_layer_types`` (default: the first
    ``first_k_dense_replace`` = 1 dense)."""
    out = dict(raw)
    for name, alias in _KIMI_LINEAR_ALIASES:
        _alias(out, name, alias)
    lin = out.get("linear_attn_config") or {}
    out = _with_defaults(out, vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
                         num_hidden_layers=27, num_attention_heads=32, n_shared_experts=1, routed_scaling_factor=2.446,
                         kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
                         qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True,
                         max_position_embeddings=1048576, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         n_routed_experts=256, bos_token_id=163584, eos_token_id=163586,
                         linear_head_dim=lin.get("head_dim", 128), linear_num_heads=lin.get("num_heads", 32),
                         linear_conv_kernel_dim=lin.get("short_conv_kernel_size", 4))
    layers = int(out["num_hidden_layers"])
    return {**out, **V3_ROUTER, "moe_layers": _hybrid_mlp_kinds("kimi_linear", out, layers, 1),
            "first_k_dense_replace": 0,
            "rope_parameters": {"rope_type": "none"}, "rope_scaling": None, "rope_interleave": False,
            "latent_norm_eps": REFERENCE_NORM_EPS, "num_nextn_predict_layers": 0,
            "linear_layers": _kimi_linear_layer_kinds(out, layers), "linear_num_heads": out["linear_num_heads"],
            "linear_head_dim": out["linear_head_dim"], "linear_conv_kernel": out["linear_conv_kernel_dim"]}


_KIMI_LINEAR_EXPERT = {".w1.": ".gate_proj.", ".w2.": ".down_proj.", ".w3.": ".up_proj."}
_KIMI_LINEAR_GATE = ("A_log", "dt_bias", "f_a_proj.", "f_b_proj.")


def _kimi_linear_name(name: str) -> str | None:
    """Kimi Linear's stored names (its original layout, which transformers saves too) -> the model's:
    ``block_sparse_moe`` is the MLP or MoE (experts' ``w1``/``w2``/``w3``: gate, down, up), and the forget gate's
    tensors (``self_attn.A_log``, ``dt_bias``, ``f_a_proj``, ``f_b_proj``) live in ``self_attn.forget_gate``."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if ".mlp.experts." in name:
        for old, new in _KIMI_LINEAR_EXPERT.items():
            name = name.replace(old, new)
    head, sep, tail = name.partition(".self_attn.")
    if sep and tail.startswith(_KIMI_LINEAR_GATE):
        return f"{head}.self_attn.forget_gate.{tail}"
    return name


def _bailing_hybrid(raw: Raw) -> Raw:
    """Ling's hybrid (``bailing_hybrid``): Kimi Linear's plan with these variations: the MLA layers rotate (RoPE,
    interleaved pairs) and gate each head's output by ``sigmoid(g_proj(x))`` (``attention_head_gate``); the KDA
    layers' forget and output gates are full projections (``f_proj``, ``g_proj``) and the forget gate is bounded
    (``kda_safe_gate``: ``kda_lower_bound * sigmoid(exp(A_log) x)``), with ``num_attention_heads`` heads of
    ``head_dim``; the last layer of every ``layer_group_size`` is MLA by default. The checkpoint's MTP layers are not
    read, as transformers does not."""
    out = dict(raw)
    for name, alias in (*_KIMI_LINEAR_ALIASES, ("num_nextn_predict_layers", "num_mtp_layers")):
        _alias(out, name, alias)
    out = _with_defaults(out, vocab_size=157184, hidden_size=2560, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=42, num_attention_heads=32, n_routed_experts=512, num_experts_per_tok=8,
                         n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                         first_k_dense_replace=2, max_position_embeddings=262144, rms_norm_eps=1e-6,
                         eos_token_id=156895, tie_word_embeddings=False, kv_lora_rank=512, q_lora_rank=None,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=6000000.0,
                         head_dim=128, short_conv_kernel_size=4, layer_group_size=6, kda_safe_gate=True,
                         kda_lower_bound=-5.0)
    _full_rotary(out)
    layers, group = int(out["num_hidden_layers"]), int(out["layer_group_size"])
    kinds = out.get("layer_types") or ["full_attention" if (i + 1) % group == 0 else "linear_attention"
                                       for i in range(layers)]
    if not any(out.get(k) for k in ("rope_parameters", "rope_scaling")):
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": out["rope_theta"]}
    return {**out, **V3_ROUTER, "moe_layers": _hybrid_mlp_kinds("bailing_hybrid", out, layers, 2),
            "first_k_dense_replace": 0, "rope_interleave": True, "latent_norm_eps": REFERENCE_NORM_EPS,
            "num_nextn_predict_layers": 0, "attention_head_gate": True,
            "linear_layers": _hybrid_layer_kinds("bailing_hybrid", kinds, layers),
            "linear_num_heads": out.get("linear_num_heads") or out["num_attention_heads"],
            "linear_head_dim": out.get("linear_head_dim") or out["head_dim"],
            "linear_conv_kernel": out.get("linear_conv_kernel_dim") or out["short_conv_kernel_size"],
            "linear_low_rank_gates": False,
            "linear_gate_lower_bound": float(out["kda_lower_bound"]) if out["kda_safe_gate"] else None}


def _bailing_hybrid_name(name: str) -> str | None:
    """Ling's stored names -> the model's: ``word_embeddings``, ``attention`` (its output ``dense``), the router's
    ``expert_bias``; the KDA forget gate's ``A_log``, ``dt_bias``, ``f_proj`` live in ``self_attn.forget_gate``."""
    if name.startswith("model.word_embeddings."):
        return "model.embed_tokens." + name[len("model.word_embeddings."):]
    name = name.replace(".attention.", ".self_attn.").replace(".self_attn.dense.", ".self_attn.o_proj.")
    name = name.replace(".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias")
    head, sep, tail = name.partition(".self_attn.")
    if sep and tail.startswith(("A_log", "dt_bias", "f_proj.")):
        return f"{head}.self_attn.forget_gate.{tail}"
    return name


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("deepseek_v2", "deepseek_v2", "deepseek-ai/DeepSeek-V2-Lite"),
    Family("deepseek_v3", "deepseek_v3", "deepseek-ai/DeepSeek-V3"),
    Family("kimi_k2", "deepseek_v3", "moonshotai/Kimi-K2-Instruct"),
    Family("minicpm3", "deepseek_v3", "openbmb/MiniCPM3-4B", _minicpm3),
    Family("youtu", "deepseek_v3", "tencent/Youtu-LLM-2B", _youtu),
    Family("glm4_moe_lite", "deepseek_v3", "zai-org/GLM-4.7-Flash", _glm4_moe_lite),
    Family("sarvam_mla", "deepseek_v3", "sarvamai/sarvam-105b", _sarvam_mla),
    Family("kimi_k25", "deepseek_v3", "moonshotai/Kimi-K2.6", _kimi_k25, _kimi_k25_name),
    Family("axk1", "deepseek_v3", "skt/A.X-K1", _axk1, _axk1_name),
    Family("mistral4", "deepseek_v3", "mistralai/Mistral-Small-4-119B-2603", _mistral4),
    Family("deepseek_v32", "deepseek_v3", "deepseek-ai/DeepSeek-V3.2", _deepseek_v32),
    Family("glm_moe_dsa", "deepseek_v3", "zai-org/GLM-5", _glm_moe_dsa),
    Family("axk2", "deepseek_v3", "skt/A.X-K2-Light", _axk2),
    Family("mistral_large4", "deepseek_v3", "mistralai/Mistral-Large-4-1T-A52B", _mistral_large4,
           _mistral_large4_name),
    Family("mistral_large4_text", "deepseek_v3", "mistralai/Mistral-Large-4-1T-A52B", _mistral_large4,
           _mistral_large4_name),
    Family("longcat_flash", "deepseek_v3", "meituan-longcat/LongCat-Flash-Chat", _longcat_flash, _longcat_flash_name),
    Family("kimi_linear", "deepseek_v3", "moonshotai/Kimi-Linear-48B-A3B-Instruct", _kimi_linear,
           _kimi_linear_name),
    Family("bailing_hybrid", "deepseek_v3", "inclusionAI/Ling-3.0-Flash", _bailing_hybrid, _bailing_hybrid_name),
)}
# families with a model of their own, not the MLA decoder ``ModelConfig`` describes: the engine builds it
# (``engine/v4_worker.py``, ``engine/glm5_worker.py``, ``engine/hy_v4_worker.py``, ``engine/dots3_worker.py``), the
# planner sizes V4's (``v4_plan``), Hunyuan V4's and dots3-note's (``row_plan``); DeepSeek's MLA loader and its tools
# do not
OWN_MODEL = {"deepseek_v4": (
    "model_type 'deepseek_v4' has its own model (mla_runtime.models.deepseek_v4; docs/deepseek-v4.md): LLM, the "
    "server and `mla-runtime plan` load and size it; the MLA model's loader and tools (latent rank, sweep, export) "
    "do not read it"), "glm5_next": (
    "model_type 'glm5_next' (GLM-5-Next's text model) has its own model (mla_runtime.models.glm5_next; "
    "docs/hybrid-models.md): LLM and the server load it; the MLA model's loader and tools (plan, latent rank, sweep, "
    "export) do not read it, and its vision tower is not served")}
OWN_MODEL["glm5_next_text"] = OWN_MODEL["glm5_next"]
OWN_MODEL["hy_v4"] = (
    "model_type 'hy_v4' (Hunyuan V4) has its own model (mla_runtime.models.hy_v4; docs/deepseek-v4.md): LLM, the "
    "server and `mla-runtime plan` load and size it; the MLA model's loader and tools (latent rank, sweep, export) do "
    "not read it")
OWN_MODEL["dots3_note"] = (
    "model_type 'dots3_note' (dots3-note's text model) has its own model (mla_runtime.models.dots3_note; "
    "docs/deepseek-v4.md): LLM, the server and `mla-runtime plan` load and size it; the MLA model's loader and tools "
    "(latent rank, sweep, export) do not read it, and its vision and audio towers are not served")
OWN_MODEL["dots3_note_text"] = OWN_MODEL["dots3_note"]
# checkpoints that name only their architecture
ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}


def family_of(raw: Raw) -> Family:
    """The adapter of a ``config.json`` (by ``model_type``, else by ``architectures``), or a ``ValueError`` that names
    the supported ones."""
    model_type = raw.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    for arch in raw.get("architectures") or []:
        if arch in ARCHITECTURES:
            return FAMILIES[ARCHITECTURES[arch]]
    if model_type in OWN_MODEL:
        raise ValueError(OWN_MODEL[model_type])
    raise ValueError(
        f"model_type {model_type!r} (architectures {raw.get('architectures')}) is not supported: mla-runtime runs the "
        f"multi-head latent attention architectures with model_type one of {sorted(FAMILIES)} (or architectures "
        f"{sorted(ARCHITECTURES)})")
