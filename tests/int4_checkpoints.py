"""4-bit checkpoints as AWQ, GPTQ and compressed-tensors store them, written at test time from a float checkpoint.

The AWQ and GPTQ writers follow each published layout (``mla_runtime.stored_int4``'s docstring lists the tensors);
compressed-tensors checkpoints are written by the library's own compressor. Each writer quantises every linear
weight of the decoder layers (``kv_b_proj`` included, as these tools do; the router and lm_head stay float) with
min/max scales and zero points (or absmax scales where symmetric), float16 scales, and returns the weights its
checkpoint stands for: ``scale * (q - zero)`` in float32, the reference the loaded matrices must equal (and, for a
product the checkpoint leaves float other than the lm_head, the runtime's own int4 of it, which loading makes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mla_runtime.layers.int4 import Int4Weight
from tests.checkpoints import _randomise, _v2_config, _v3_config, save_checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's packing: nibble i of a word holds column AWQ_ORDER[i] of its 8


def build_wide_model(family: str, seed: int = 0):
    """A tiny random DeepSeek-V2/V3 (``family`` "v2", "v3"; with "_all", every token routed to every expert, so that
    its output moves continuously with its input) whose every projection's inputs are whole groups of 128 and
    outputs whole words of 8."""
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    dims: dict[str, Any] = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=128, kv_lora_rank=128,
                                qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, num_hidden_layers=2)
    if family.endswith("_all"):
        dims.update(num_experts_per_tok=8, n_group=1, topk_group=1)
        dims.update({"topk_method": "greedy"} if family.startswith("v2") else {})
    torch.manual_seed(seed)
    if family.startswith("v3"):
        model = DeepseekV3ForCausalLM(_v3_config(q_lora_rank=128, **dims))
    else:
        model = DeepseekV2ForCausalLM(_v2_config(**dims))
    _randomise(model, seed + 1)
    return model.eval()


def quantized_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n for n, t in tensors.items()
                  if t.dim() == 2 and ".layers." in n and n.endswith(("_proj.weight", "_proj_with_mqa.weight")))


def quantize_groups(w: torch.Tensor, group: int, symmetric: bool,
                    g_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (q [N, K] in 0..15, scales [N, G] float16, zeros [N, G] in 0..15) by the groups of ``g_idx``
    (default ``k // group``): min/max with a zero point, or absmax around 8 where ``symmetric``."""
    n, k = w.shape
    g_idx = torch.arange(k) // group if g_idx is None else g_idx.long()
    groups = k // group
    q = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, groups, dtype=torch.float16)
    zeros = torch.empty(n, groups, dtype=torch.uint8)
    for gi in range(groups):
        cols = (g_idx == gi).nonzero().flatten()
        v = w[:, cols].float()
        if symmetric:
            s = (v.abs().amax(1) / 7.5).clamp(min=1e-6).half()
            z = torch.full((n,), 8.0)
        else:
            lo, hi = v.amin(1).clamp(max=0), v.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).clamp(min=1e-6).half()
            z = (-lo / s.float()).round().clamp(0, 15)
        q[:, cols] = ((v / s.float().unsqueeze(1)).round() + z.unsqueeze(1)).clamp(0, 15).to(torch.uint8)
        scales[:, gi], zeros[:, gi] = s, z.to(torch.uint8)
    return q, scales, zeros


def dequantized(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    g = g_idx.long()
    return (q.float() - zeros[:, g].float()) * scales[:, g].float()


def pack_words(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """``values [R, 8W]`` (0..15) -> int32 ``[R, W]``: nibble ``i`` of word ``w`` (bits ``4i``) holds value
    ``8w + order[i]``."""
    v = values.long().view(values.shape[0], -1, 8)[:, :, list(order)]
    word = (v << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def act_order_g_idx(k: int, group: int, seed: int) -> torch.Tensor:
    """GPTQ's ``desc_act`` groups: the inputs taken in a (random) order, ``group`` at a time."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    return g_idx


def write_awq(src: Path, dst: Path, group: int = 128) -> dict[str, torch.Tensor]:
    """AWQ's GEMM layout: ``qweight [K, N / 8]`` and ``qzeros [K / g, N / 8]`` in AWQ's nibble order, ``scales
    [K / g, N]``. Returns the reference weights."""
    tensors = load_file(str(src / "model.safetensors"))
    out, ref = dict(tensors), {n: t.float() for n, t in tensors.items()}
    for name in quantized_names(tensors):
        q, s, z = quantize_groups(tensors[name], group, symmetric=False)
        base = name[: -len("weight")]
        del out[name]
        out[base + "qweight"] = pack_words(q.T.contiguous(), AWQ_ORDER)
        out[base + "qzeros"] = pack_words(z.T.contiguous(), AWQ_ORDER)
        out[base + "scales"] = s.T.contiguous()
        ref[name] = dequantized(q, s, z, torch.arange(q.shape[1]) // group)
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    _save(src, dst, out, config)
    return ref


def write_gptq(src: Path, dst: Path, group: int = 128, desc_act: bool = False, sym: bool = False,
               checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """GPTQ's layout: ``qweight [K / 8, N]``, ``qzeros [G, N / 8]`` (one less than the zero in the ``gptq`` format),
    ``scales [G, N]``, ``g_idx [K]`` (with ``desc_act`` a permuted grouping). Returns the reference weights."""
    tensors = load_file(str(src / "model.safetensors"))
    out, ref = dict(tensors), {n: t.float() for n, t in tensors.items()}
    offset = 1 if checkpoint_format == "gptq" else 0
    for i, name in enumerate(quantized_names(tensors)):
        k = tensors[name].shape[1]
        g_idx = act_order_g_idx(k, group, i) if desc_act else (torch.arange(k) // group).to(torch.int32)
        q, s, z = quantize_groups(tensors[name], group, sym, g_idx)
        if offset:  # the original format cannot store a zero of 0 (its stored zero would be -1)
            q = torch.where(z[:, g_idx.long()] == 0, q.clamp(min=1), q)
            z = z.clamp(min=1)
        base = name[: -len("weight")]
        del out[name]
        out[base + "qweight"] = pack_words(q).T.contiguous()  # word (i, n): inputs 8i + j of output n, bits 4j
        out[base + "qzeros"] = pack_words((z - offset).T.contiguous())
        out[base + "scales"] = s.T.contiguous()
        out[base + "g_idx"] = g_idx
        ref[name] = dequantized(q, s, z, g_idx)
    config = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": checkpoint_format, "true_sequential": True, "damp_percent": 0.01}
    _save(src, dst, out, config)
    return ref


def write_compressed_tensors(dst: Path, family: str, group: int, symmetric: bool) -> dict[str, torch.Tensor]:
    """A W4A16 checkpoint written by compressed-tensors' own compressor (pack-quantized, the way llm-compressor saves
    one), every decoder linear quantised. Returns the reference weights."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    model = build_wide_model(family)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head", "re:.*mlp\\.gate$"])
    apply_quantization_config(model, config)
    ref = {n: p.detach().float().clone() for n, p in model.state_dict().items()}
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            _, s, z = quantize_groups(module.weight.detach(), group, symmetric)
            module.weight_scale.data.copy_(s.to(module.weight_scale.dtype))
            if not symmetric:
                module.weight_zero_point.data.copy_((z.to(torch.int16) - 8).to(module.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    stored = load_file(str(dst / "model.safetensors"))
    for name in [n for n in stored if n.endswith(".weight_packed")]:
        base = name[: -len("weight_packed")]
        ref[base + "weight"] = _library_dequantized(stored, base, group)
    for name, t in ref.items():  # the routed experts (not Linear modules) stay float: the runtime's int4 at load
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            ref[name] = Int4Weight.quantize(t.reshape(-1, t.shape[-1])).dequantize().view(t.shape)
    return ref


def _library_dequantized(stored: dict[str, torch.Tensor], base: str, group: int) -> torch.Tensor:
    """A stored matrix unpacked by the library's own helpers: ``scale * (q - zero_point)`` in float32."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    shape = torch.Size(stored[base + "weight_shape"].tolist())
    q = unpack_from_int32(stored[base + "weight_packed"], 4, shape).float()
    scale = stored[base + "weight_scale"].float().repeat_interleave(group, 1)
    zp = stored.get(base + "weight_zero_point")
    if zp is None:
        return q * scale
    z = unpack_from_int32(zp, 4, torch.Size((shape[0], shape[1] // group)), packed_dim=0).float()
    return (q - z.repeat_interleave(group, 1)) * scale


def _save(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization: dict[str, Any]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def float_source(dst: Path, family: str) -> Path:
    return save_checkpoint(build_wide_model(family), dst)
