"""Tiny random MLA checkpoints built with transformers (the reference implementation) for the tests.

Weights are re-randomised after construction so that norm weights are not 1, biases are not 0 and the
router's correction bias matters: a test that passes must have used every tensor correctly.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

VOCAB = 256


def _v3_config(**overrides: Any):
    from transformers import DeepseekV3Config

    kw: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, first_k_dense_replace=1,
        max_position_embeddings=512, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None,
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def _v2_config(**overrides: Any):
    from transformers import DeepseekV2Config

    kw: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=2, num_experts_per_tok=3, n_group=4, topk_group=2, topk_method="group_limited_greedy",
        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        first_k_dense_replace=1, max_position_embeddings=512, routed_scaling_factor=1.5,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None,
    )
    kw.update(overrides)
    return DeepseekV2Config(**kw)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}

# name → (family, config overrides). Together they cover q_lora_rank null/set, YaRN with mscale,
# rope_interleave true/false, V2 group-limited and greedy routing, V3 noaux_tc, v_head_dim != d_n.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "v3": ("v3", {"rope_parameters": YARN}),
    "v3_noq_halfsplit": ("v3", {"q_lora_rank": None, "rope_interleave": False, "v_head_dim": 16,
                                "tie_word_embeddings": True}),
    "v2_group": ("v2", {"rope_parameters": YARN}),
    "v2_greedy_qlora": ("v2", {"topk_method": "greedy", "n_group": 1, "topk_group": 1, "q_lora_rank": 48,
                               "v_head_dim": 24}),
}


def build_hf_model(variant: str, seed: int = 0):
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    family, overrides = VARIANTS[variant]
    torch.manual_seed(seed)
    if family == "v3":
        model = DeepseekV3ForCausalLM(_v3_config(**overrides))
    else:
        model = DeepseekV2ForCausalLM(_v2_config(**overrides))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif "mlp.gate.weight" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


def save_checkpoint(model, out: Path, max_shard_size: str | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    if max_shard_size:
        model.save_pretrained(out, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(out)
    return out


def byte_tokenizer(corpus: list[str], vocab_size: int, tokens: tuple[str, ...] = (), template: str | None = None):
    """A byte-level BPE tokenizer (any text encodes, and decodes back exactly) trained on ``corpus``, with ``<|bos|>``
    and ``<|eos|>``, ``tokens`` added as ordinary tokens and ``template`` as its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False) for t in tokens])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = template
    return fast


def chat_checkpoint(out: Path, tokenizer) -> Path:
    """A tiny V3 model whose vocabulary is ``tokenizer``'s, saved with it in ``out``."""
    hf = build_hf_model("v3")
    hf.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    path = save_checkpoint(hf, out)
    tokenizer.save_pretrained(path)
    return path


FP8_MAX = 448.0


def quantize_fp8_checkpoint(src: Path, dst: Path, block: int = 128) -> Path:
    """Rewrite ``src`` as a DeepSeek-V3-style FP8 checkpoint: every linear weight of attention and MLPs
    becomes float8_e4m3fn with a ``weight_scale_inv`` per ``block × block`` tile."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        quantise = (t.dim() == 2 and name.endswith("proj.weight") and ".layers." in name)
        if not quantise:
            out[name] = t
            continue
        rows, cols = t.shape
        nr, nc = -(-rows // block), -(-cols // block)
        scale = torch.empty(nr, nc)
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(nr):
            for j in range(nc):
                tile = t[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
                s = tile.abs().max().clamp(min=1e-12) / FP8_MAX
                scale[i, j] = s
                q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).to(torch.float8_e4m3fn)
        out[name] = q
        out[name[: -len("weight")] + "weight_scale_inv"] = scale
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def dequantized_reference(path: Path, out: Path):
    """transformers' model holding the FP8 checkpoint's weights dequantised to fp32 (the reference)."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    save_file(dequantized_state_dict(path), str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def dequantized_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint's weights as the reference should see them (fp32, dequantised)."""
    from mla_runtime.loader import dequantize_fp8_block

    tensors = load_file(str(path / "model.safetensors"))
    block = tuple(json.loads((path / "config.json").read_text())["quantization_config"]["weight_block_size"])
    out = {}
    for name, t in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale = tensors.get(name[: -len("weight")] + "weight_scale_inv")
        out[name] = dequantize_fp8_block(t, scale, block) if scale is not None else t.float()
    return out


def _randomise(module, seed: int) -> None:
    """The same re-randomisation as ``build_hf_model``: norms not 1, router bias relevant."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "mlp.gate.weight" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def build_mtp_layer(hf_model, seed: int = 7):
    """A random DeepSeek-V3-style multi-token-prediction layer for ``hf_model``: its own decoder block (with the
    family's attention: a DSA family's carries its indexer) plus ``enorm``, ``hnorm``, ``eh_proj`` and
    ``shared_head.norm``, whose parameter names are the checkpoint's."""
    from torch import nn
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    decoder = hf_model.get_decoder()
    config = copy.deepcopy(decoder.config)
    n = config.num_hidden_layers
    for key, value in list(vars(config).items()):  # per-layer lists (layer kinds): one more entry, the MTP layer's
        if isinstance(value, list) and len(value) == n:
            setattr(config, key, [*value, "full" if key == "indexer_types" else value[-1]])
    layer = type(decoder.layers[-1])(config, n)
    h = config.hidden_size
    layer.enorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
    layer.hnorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
    layer.eh_proj = nn.Linear(2 * h, h, bias=False)
    layer.shared_head = nn.Module()
    layer.shared_head.norm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
    _randomise(layer, seed)
    return layer.eval()


def add_mtp_layer(src: Path, dst: Path, hf_model, seed: int = 7):
    """Copy the checkpoint at ``src`` to ``dst`` with one random MTP layer stored as DeepSeek-V3 stores it: the layer
    after the last (named as the checkpoint names its layers) in the same file, with its own copies of the embedding
    and head. Returns the MTP layer (transformers modules, for the reference)."""
    import shutil

    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    layer = build_mtp_layer(hf_model, seed)
    first = next(k for k in tensors if k.endswith(("layers.0.input_layernorm.weight",
                                                   "blocks.0.input_layernorm.weight")))
    layers = first[: -len("0.input_layernorm.weight")]  # model.layers., or Kimi-K2.5's language_model.model.blocks.
    text = hf_model.get_decoder().config
    prefix = f"{layers}{text.num_hidden_layers}."
    state = dict(layer.state_dict())
    state["embed_tokens.weight"] = hf_model.get_input_embeddings().weight.detach()
    state["shared_head.head.weight"] = hf_model.get_output_embeddings().weight.detach()
    tensors.update({prefix + name: t.detach().clone().contiguous() for name, t in state.items()})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (cfg.get("text_config") or cfg)["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return layer


def mtp_reference(hf_model, layer, token_ids: list[int], chain: list[int]) -> torch.Tensor:
    """fp32 MTP logits written from the DeepSeek-V3 description: for positions ``i = 0 .. n-2`` of
    ``token_ids`` (n tokens), ``x_i = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])`` with ``h`` the main model's
    last hidden state (after its final norm), ``y = block(x)`` causal, ``logits = head(shared_head.norm(y))``;
    then one chained position per token of ``chain``: ``x = eh_proj([enorm(embed(c)) ; hnorm(y_prev)])`` at the
    next position, attending to every earlier row. Returns ``[n - 1 + len(chain), V]``."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        h = hf_model.model(input_ids=ids[:, :-1]).last_hidden_state  # [1, n-1, d]
        embed = hf_model.model.embed_tokens

        def fuse(tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
            return layer.eh_proj(torch.cat([layer.enorm(embed(tokens)), layer.hnorm(hidden)], dim=-1))

        def block(x: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(x.shape[1])[None]
            return layer(x, position_embeddings=hf_model.model.rotary_emb(x, pos))

        x = fuse(ids[:, 1:], h)
        y = block(x)
        for token in chain:
            x = torch.cat([x, fuse(torch.tensor([[token]]), y[:, -1:])], dim=1)
            y = block(x)
        return hf_model.lm_head(layer.shared_head.norm(y))[0]
