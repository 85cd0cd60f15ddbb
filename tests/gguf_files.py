"""GGUF files written at test time from tiny transformers models, in llama.cpp's ``deepseek2`` layout, with the ``gguf``
package's writer: names from the package's own tensor-name map (so the runtime's name table is checked against it),
routed experts stacked ``[E, N, K]``, ``kv_b_proj`` whole or split into ``attn_k_b`` (each head's ``W_UK``
transposed) and ``attn_v_b``, the router's correction bias as ``exp_probs_b.bias``; each tensor in the type ``types``
picks, quantised with ``gguf.quants.quantize``, or for the K-quants the package cannot quantise with the plain
rounding quantisers here (Q4_K, Q6_K) or as random valid blocks (``kquant_bytes``: Q2_K, Q3_K, Q5_K)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

TypePick = Callable[[str, tuple[int, ...]], str]  # (GGUF tensor name, torch shape) -> ggml type name


def products_in(type_name: str, others: str = "F32") -> TypePick:
    """Every matrix ``type_name`` (where its rows are whole blocks), norms, router and anything else ``others``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]

    def pick(name: str, shape: tuple[int, ...]) -> str:
        matrix = len(shape) >= 2 and "ffn_gate_inp" not in name
        return type_name if matrix and shape[-1] % block == 0 else others
    return pick


# the byte offsets of each K-quant block's float16 super-block scale d (and dmin), and the values given them here:
# small enough that a value (scale x sub-block scale x quant) stays near the transformers model's 0.08
KQUANT_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q5_K": (0, 2)}
KQUANT_VALUES = {"Q2_K": (2e-3, 2e-3), "Q3_K": (5e-4,), "Q5_K": (5e-5, 5e-5)}


QUANTISABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # by gguf.quants.quantize


def kquant_bytes(type_name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Rows of a K-quant type (``rows x k`` values) with random quants and small positive super-block scales: valid
    blocks of the published layout, whose values the tests take from ``gguf.quants.dequantize``. Another type
    nothing here quantises (IQ...): random blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    # d (and dmin): small, fixed
    for offset, value in zip(KQUANT_SCALES.get(type_name, ()), KQUANT_VALUES.get(type_name, ())):
        data[..., offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def q8_rounded(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Float32 rows ``x [rows, K]`` as the compiled GGUF kernels round them before their products: each group of
    ``group`` values (32 for the 32-value types, 256 for the K-quants) to int8, ``round(x · 127 / amax)`` to nearest
    even, times its scale ``amax / 127`` (float32 arithmetic)."""
    rows, k = x.shape
    groups = x.float().reshape(rows, -1, group)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    return (torch.round(groups * inv).clamp(-127, 127) * (amax / 127.0)).reshape(rows, k)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape[:-1], -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Rows ``[n, k]`` (``k`` a multiple of 256) to Q6_K by plain rounding, in the published block layout: per
    super-block of 256 values ``ql`` (128 bytes: the low 4 bits), ``qh`` (64 bytes: the high 2 bits), 16 int8
    sub-block scales and a float16 ``d``; a value is ``d * scale[j] * (q - 32)``, ``q`` in [0, 63], ``j`` its
    sub-block of 16. Value ``f`` of a super-block has its low bits in byte ``64 (f // 128) + f % 64`` of ``ql``
    (high nibble when ``f % 128 >= 64``) and its high bits at bit ``2 ((f % 128) // 32)`` of byte
    ``32 (f // 128) + f % 32`` of ``qh``."""
    blocks = x.astype(np.float32).reshape(-1, 16, 16)  # [super-blocks, sub-block, value]
    sub = np.abs(blocks).max(axis=-1) / 31  # each sub-block's scale in float
    d = (sub.max(axis=-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.where(d > 0, np.round(sub / np.where(d > 0, d, 1)), 0).clip(-128, 127).astype(np.int8)
    step = d[:, :, None] * sc[:, :, None].astype(np.float32)
    q = np.where(step != 0, np.round(blocks / np.where(step != 0, step, 1)), 0).clip(-32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 256).astype(np.uint8)
    low, high = q & 0x0F, q >> 4
    half = low.reshape(-1, 2, 2, 64)  # [.., f // 128, (f % 128) // 64, f % 64]
    ql = (half[:, :, 0] | (half[:, :, 1] << 4)).reshape(-1, 128)
    hi = high.reshape(-1, 2, 4, 32)  # [.., f // 128, (f % 128) // 32, f % 32]
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=-1)
    return out.reshape(x.shape[0], -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Rows ``[n, k]`` to Q4_K by plain rounding, in the published block layout: per super-block of 256 values a
    float16 ``d`` and ``dmin``, 12 bytes of eight 6-bit sub-block scales and mins, 128 bytes of 4-bit quants; a value
    is ``d * sc[j] * q - dmin * m[j]``, ``q`` in [0, 15], ``j`` its sub-block of 32. Scales and mins ``j < 4`` are the
    low 6 bits of bytes ``j`` and ``4 + j``, whose top 2 bits hold the high bits of ``j + 4``'s, whose low 4 bits are
    byte ``8 + j``'s low (scale) and high (min) nibble. Value ``f`` is nibble ``(f % 64) // 32`` of byte
    ``32 (f // 64) + f % 32``."""
    blocks = x.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(blocks.min(axis=-1), 0)
    scale, low = (blocks.max(axis=-1) - lo) / 15, -lo
    d = (scale.max(axis=-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = (low.max(axis=-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.where(d > 0, np.round(scale / np.where(d > 0, d, 1)), 0).clip(0, 63).astype(np.uint8)
    m = np.where(dmin > 0, np.round(low / np.where(dmin > 0, dmin, 1)), 0).clip(0, 63).astype(np.uint8)
    step, offset = (d * sc)[..., None], (dmin * m)[..., None]
    q = np.where(step > 0, np.round((blocks + offset) / np.where(step > 0, step, 1)), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)  # [.., f // 64, (f % 64) // 32, f % 32]
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=-1)
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=-1)
    return out.reshape(x.shape[0], -1)


OWN_QUANTISERS = {"Q6_K": quantize_q6_k, "Q4_K": quantize_q4_k}


def _quantized(name: str, values: np.ndarray, type_name: str, seed: int) -> tuple[np.ndarray, Any]:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[type_name]
    if type_name in OWN_QUANTISERS:
        flat = values.reshape(-1, values.shape[-1])
        return OWN_QUANTISERS[type_name](flat).reshape(*values.shape[:-1], -1), qtype
    if type_name in KQUANT_SCALES or type_name not in QUANTISABLE:
        flat = values.reshape(-1, values.shape[-1])
        data = kquant_bytes(type_name, flat.shape[0], flat.shape[1], seed)
        return data.reshape(*values.shape[:-1], -1), qtype
    if type_name == "F32":
        return values.astype(np.float32), None
    if type_name == "F16":
        return values.astype(np.float16), None
    return quantize(values.astype(np.float32), qtype), qtype


def _arch(cfg: Any) -> Any:
    import gguf

    return gguf.MODEL_ARCH.MINICPM3 if cfg.model_type == "minicpm3" else gguf.MODEL_ARCH.DEEPSEEK2


def hf_tensors(model: Any, split_kv_b: bool) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors under the names llama.cpp's converter gives them, in its layout."""
    import gguf

    cfg = model.config
    n = cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(_arch(cfg), n)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    out: list[tuple[str, torch.Tensor]] = []
    experts: dict[tuple[int, str], list[torch.Tensor]] = {}
    for key, value in state.items():
        if key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and cfg.tie_word_embeddings):
            continue  # a tied head is the embedding: llama.cpp's converter leaves it out
        if ".mlp.experts." in key and key.split(".")[5].isdigit():  # model.layers.i.mlp.experts.e.w.weight
            parts = key.split(".")
            experts.setdefault((int(parts[2]), parts[6]), []).append(value)
            continue
        if ".mlp.experts." in key:  # transformers' fused layout [E, 2I, d] / [E, d, I]
            layer = int(key.split(".")[2])
            if key.endswith("gate_up_proj"):
                half = value.shape[1] // 2
                experts[(layer, "gate_proj")] = list(value[:, :half])
                experts[(layer, "up_proj")] = list(value[:, half:])
            else:
                experts[(layer, "down_proj")] = list(value)
            continue
        if key.endswith("e_score_correction_bias"):
            key = key.replace("e_score_correction_bias", "e_score_correction.bias")
        if split_kv_b and key.endswith("kv_b_proj.weight"):
            heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
            kv_b = value.view(heads, nope + v, -1)
            k_b, v_b = kv_b[:, :nope].transpose(1, 2), kv_b[:, nope:]
            layer = key.split(".")[2]
            out += [(f"blk.{layer}.attn_k_b.weight", k_b), (f"blk.{layer}.attn_v_b.weight", v_b)]
            continue
        new = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert new is not None, key
        out.append((new, value))
    for (layer, w), values in sorted(experts.items()):
        new = names.get_name(f"model.layers.{layer}.mlp.experts.{w}", try_suffixes=(".weight",))
        out.append((f"{new}.weight", torch.stack(values)))
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":  # MiniCPM3: its LongRoPE factors as tensors
        out += [("rope_factors_long.weight", torch.tensor(rope["long_factor"], dtype=torch.float32)),
                ("rope_factors_short.weight", torch.tensor(rope["short_factor"], dtype=torch.float32))]
    return out


def dequantized(type_name: str, data: np.ndarray) -> torch.Tensor:
    """The float32 values of a stored tensor, by the ``gguf`` package's dequantiser (the reference)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if type_name in ("F32", "F16"):
        return torch.from_numpy(data.astype(np.float32))
    return torch.from_numpy(dequantize(data, GGMLQuantizationType[type_name]).copy())


def reference_model(model: Any, stored: dict[str, Any]) -> Any:
    """A copy of the transformers ``model`` holding the weights the GGUF file stores, dequantised to float32."""
    import copy

    ref = copy.deepcopy(model).float()
    values = {name: dequantized(*stored[name]) for name in stored}
    state = ref.state_dict()
    new: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        new[key] = _stored_value(key, value, values, ref.config)
    ref.load_state_dict(new)
    return ref.eval()


def _stored_value(key: str, like: torch.Tensor, values: dict[str, torch.Tensor], cfg: Any) -> torch.Tensor:
    import gguf

    names = gguf.get_tensor_name_map(_arch(cfg), cfg.num_hidden_layers)
    parts = key.split(".")
    if key.endswith("rotary_emb.inv_freq"):
        return like
    if ".mlp.experts." in key:
        layer = int(parts[2])

        def stack(w: str) -> torch.Tensor:
            return values[f"{names.get_name(f'model.layers.{layer}.mlp.experts.{w}', try_suffixes=('.weight',))}"
                          f".weight"]
        if parts[5].isdigit():
            return stack(parts[6])[int(parts[5])]
        if key.endswith("gate_up_proj"):
            return torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
        return stack("down_proj")
    if key.endswith("kv_b_proj.weight") and f"blk.{parts[2]}.attn_k_b.weight" in values:
        k_b, v_b = values[f"blk.{parts[2]}.attn_k_b.weight"], values[f"blk.{parts[2]}.attn_v_b.weight"]
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(like.shape)
    if key.endswith("e_score_correction_bias"):
        key = key.replace("e_score_correction_bias", "e_score_correction.bias")
    if key == "lm_head.weight" and "output.weight" not in values:
        return values["token_embd.weight"]
    return values[names.get_name(key, try_suffixes=(".weight", ".bias"))].reshape(like.shape)


def write_gguf(model: Any, out: Path, pick: TypePick | None = None, split_kv_b: bool = False,
               tokenizer: dict[str, Any] | None = None, split_tensors: int = 0,
               arch: str = "deepseek2") -> tuple[Path, dict[str, Any]]:
    """Write ``model`` (a transformers DeepSeek-V2/V3) to ``out``; returns the path to load and the stored tensors
    as the file holds them (name -> (type, numpy data))."""
    import gguf

    cfg = model.config
    pick = pick or products_in("F32")
    if cfg.model_type == "minicpm3":
        arch = "minicpm3"
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_tensors)
    (_metadata_minicpm3 if arch == "minicpm3" else _metadata)(w, cfg)
    if tokenizer is not None:
        _tokenizer(w, tokenizer)
    stored: dict[str, Any] = {}
    for i, (name, value) in enumerate(hf_tensors(model, split_kv_b)):
        type_name = pick(name, tuple(value.shape))
        data, qtype = _quantized(name, value.numpy(), type_name, seed=i)
        w.add_tensor(name, data, raw_dtype=qtype)
        stored[name] = (type_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    first = out if not split_tensors else out.with_name(f"{out.stem}-00001-of-{len(w.tensors):05d}.gguf")
    return first, stored


def _metadata(w: Any, cfg: Any) -> None:
    import gguf

    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if getattr(cfg, "norm_topk_prob", False):
        w.add_expert_weights_norm(True)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    v3 = cfg.model_type == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _metadata_minicpm3(w: Any, cfg: Any) -> None:
    """What llama.cpp's converter writes for MiniCPM3 (no value length, rope base, µP scales or LongRoPE lengths)."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)


def _tokenizer(w: Any, tok: dict[str, Any]) -> None:
    w.add_tokenizer_model(tok.get("model", "gpt2"))
    if "merges" in tok:
        w.add_tokenizer_pre(tok.get("pre", "deepseek-v3"))
        w.add_token_merges(tok["merges"])
    else:
        w.add_token_scores(tok["scores"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    w.add_add_bos_token(True)
    if tok.get("chat_template"):
        w.add_chat_template(tok["chat_template"])
