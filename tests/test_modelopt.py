"""NVIDIA ModelOpt exports (``hf_quant_config.json`` / ``quant_method: modelopt``), loaded as stored.

The checkpoints are written here by a small writer that follows ModelOpt's NVFP4 export (the layout NVIDIA publishes
DeepSeek-R1/V3 and GLM in): each quantised Linear ``X`` as ``X.weight`` (uint8 ``[N, K / 2]``, two E2M1 values a
byte, the even one in the low nibble), ``X.weight_scale`` (float8_e4m3fn ``[N, K / 16]``), ``X.weight_scale_2`` (a
float32 scalar that multiplies) and ``X.input_scale``; the modules ``exclude_modules`` names stay bfloat16. The
reference is transformers on ModelOpt's dequantisation, ``e2m1 × weight_scale × weight_scale_2``.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mla_runtime import LLM, SamplingParams
from mla_runtime.compressed import main as quantize_main
from mla_runtime.config import ModelConfig, UnsupportedScheme, parse_modelopt_config
from mla_runtime.footprint import weight_footprint
from mla_runtime.layers.fp4 import Nvfp4Weight
from mla_runtime.layers.fp8 import Fp8Weight
from mla_runtime.layers.quantization import finish_quantization, quantized_weights
from mla_runtime.loader import load_model
from tests.checkpoints import build_hf_model, save_checkpoint

VARIANT = "v3"  # q_lora_rank set, untied head: every product's K a multiple of 16
# NVIDIA's R1-FP4 leaves the head, the routers and the attention unquantised; here layer 0's attention only, so that
# the other layers' attention (kv_b_proj included) loads from NVFP4 as well
EXCLUDE = ["lm_head", "*.mlp.gate", "model.layers.0.self_attn*"]
PROMPTS = [[5, 9, 2, 7, 11], list(range(3, 40)), [200, 17, 4]]
NEW_TOKENS = 8
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def modelopt_nvfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt's NVFP4 export of one matrix: ``weight_scale_2 = amax / (6 × 448)`` over the tensor; a group of 16's
    scale ``amax_g / 6 / weight_scale_2`` rounded to E4M3; each value divided by ``scale × weight_scale_2`` and rounded
    to the nearest E2M1 magnitude, its sign in bit 3 of the nibble."""
    w = weight.float()
    n, k = w.shape
    scale_2 = w.abs().amax() / (6 * 448)
    groups = w.view(n, k // 16, 16)
    scale = (groups.abs().amax(-1) / 6 / scale_2).to(torch.float8_e4m3fn)
    step = (scale.float() * scale_2).unsqueeze(-1)
    x = torch.where(step > 0, groups / step, torch.zeros(()))
    codes = (x.abs().clamp(max=6).unsqueeze(-1) - E2M1).abs().argmin(-1) | (x < 0).long() << 3
    codes = codes.view(n, k).to(torch.uint8)
    return {"weight": codes[:, 0::2] | codes[:, 1::2] << 4, "weight_scale": scale,
            "weight_scale_2": scale_2.reshape(()), "input_scale": torch.tensor(0.02)}


def modelopt_fp8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt's FP8 export of one matrix: one float32 ``weight_scale = amax / 448`` for the tensor, the values
    divided by it and rounded to float8_e4m3fn."""
    scale = weight.float().abs().amax() / 448
    return {"weight": (weight.float() / scale).to(torch.float8_e4m3fn), "weight_scale": scale.reshape(()),
            "input_scale": torch.tensor(0.02)}


def modelopt_dequantized(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """ModelOpt's dequantisation: ``e2m1 × weight_scale × weight_scale_2``, in float32."""
    n = weight.shape[0]
    codes = torch.stack((weight & 15, weight >> 4), dim=-1).view(n, -1).long()
    values = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return (values.view(n, -1, 16) * (scale.float() * scale_2.float()).unsqueeze(-1)).view(n, -1)


def excluded(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name[: -len(".weight")], p) for p in EXCLUDE)


def write_modelopt(src: Path, out: Path, form: str = "hf_quant_config", algo: str = "NVFP4") -> Path:
    """``src`` (a float checkpoint) in ModelOpt's ``algo`` layout (NVFP4, FP8): every Linear of the decoder layers
    not in ``EXCLUDE`` quantised, the rest bfloat16, the KV cache scales an FP8 KV cache export adds; the
    quantization config in ``hf_quant_config.json`` (``form``: the published R1-FP4 form) or in config.json
    (``config``: newer exports)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    quantize = modelopt_nvfp4 if algo == "NVFP4" else modelopt_fp8
    for name, t in load_file(str(src / "model.safetensors")).items():
        if t.dim() == 2 and ".layers." in name and name.endswith(".weight") and not excluded(name):
            base = name[: -len("weight")]
            tensors.update({base + key: v for key, v in quantize(t).items()})
        else:
            tensors[name] = t.to(torch.bfloat16)
        if name.endswith("self_attn.kv_b_proj.weight"):
            attn = name[: -len("kv_b_proj.weight")]
            tensors[attn + "k_scale"], tensors[attn + "v_scale"] = torch.tensor(1.0), torch.tensor(1.0)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    body = {"quant_algo": algo, "kv_cache_quant_algo": "FP8", "group_size": 16, "exclude_modules": EXCLUDE}
    if form == "config":
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16,
                                      "ignore": EXCLUDE, "kv_cache_scheme": {"type": "float", "num_bits": 8}}
    else:
        (out / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.23.0"}, "quantization": body}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def reference_model(path: Path):
    """transformers on the checkpoint's weights as ModelOpt defines them (NVFP4 ones dequantised, bfloat16 ones
    widened), ``kv_b_proj`` rounded to bfloat16 as the runtime holds it beside quantised products."""
    from transformers import AutoModelForCausalLM

    stored = load_file(str(path / "model.safetensors"))
    state = {}
    for name, t in stored.items():
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")):
            continue
        base = name[: -len("weight")]
        if base + "weight_scale_2" in stored:
            w = modelopt_dequantized(t, stored[base + "weight_scale"], stored[base + "weight_scale_2"])
        else:  # FP8: its value times the tensor's scale; else bfloat16
            w = t.float() * stored[base + "weight_scale"] if base + "weight_scale" in stored else t.float()
        state[name] = w.to(torch.bfloat16).float() if name.endswith("kv_b_proj.weight") else w
    ref = path.parent / (path.name + "_reference")
    ref.mkdir(exist_ok=True)
    save_file(state, str(ref / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (ref / "config.json").write_text(json.dumps(cfg))
    return AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    src = save_checkpoint(build_hf_model(VARIANT), tmp_path_factory.mktemp("modelopt_src"))
    root = tmp_path_factory.mktemp("modelopt")
    out = {form: write_modelopt(src, root / form, form) for form in ("hf_quant_config", "config")}
    return {**out, "fp8": write_modelopt(src, root / "fp8", "hf_quant_config", "FP8")}


def generate(hf) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False)
        out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def reference_tokens(written):
    return generate(reference_model(written["hf_quant_config"]))


@pytest.fixture(scope="module")
def fp8_reference_tokens(written):
    return generate(reference_model(written["fp8"]))


def runtime_tokens(path: Path, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB", **kwargs)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    finally:
        llm.shutdown()


def test_both_config_forms_read_with_their_exclusions(written):
    for form, path in written.items():
        cfg = ModelConfig.from_pretrained(path)
        assert cfg.stored_quantization == ("fp8" if form == "fp8" else "nvfp4")
        assert cfg.stored_exclude == tuple(EXCLUDE) and cfg.stored_float_head and cfg.fp8_block_size is None


def test_the_loaded_weights_are_the_stored_bytes_and_modelopts_values(written):
    path = written["hf_quant_config"]
    model = load_model(path, dtype="float32")
    layer = model.model.layers[1]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for prefix, weight in (("model.layers.1.self_attn.o_proj.", layer.self_attn.o_proj.packed),
                               ("model.layers.1.mlp.experts.3.down_proj.", layer.mlp.experts.down_packed[3])):
            stored = [f.get_tensor(prefix + n) for n in ("weight", "weight_scale", "weight_scale_2")]
            assert isinstance(weight, Nvfp4Weight)
            assert torch.equal(weight.packed, stored[0])
            assert torch.equal(weight.scales.view(torch.uint8), stored[1].view(torch.uint8))
            # the runtime's global scale divides: ModelOpt's multiplier's reciprocal, within one float32 rounding
            torch.testing.assert_close(weight.dequantize(), modelopt_dequantized(*stored), rtol=2.5e-7, atol=0)
        gate = f.get_tensor("model.layers.1.mlp.experts.3.gate_proj.weight_scale_2")
        up = f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight_scale_2")
    gate_up = layer.mlp.experts.gate_up_packed[3]  # two tensors' global scales, held row by row
    inter = gate_up.shape[0] // 2
    assert torch.equal(gate_up.global_scales, torch.cat([1 / gate.expand(inter), 1 / up.expand(inter)]))
    assert isinstance(layer.self_attn.qkv_a, Nvfp4Weight)  # q_a_proj and kv_a_proj_with_mqa, stacked
    # excluded modules stay in the model dtype: layer 0's attention, the head (the routers are never quantised)
    attn = model.model.layers[0].self_attn
    for linear in (attn.q_a_proj, attn.kv_a_proj_with_mqa, attn.q_b_proj, attn.o_proj):
        assert not isinstance(linear.packed, Nvfp4Weight) and linear.weight.dtype == torch.float32
    assert not isinstance(getattr(model, "lm_head_packed", None), Nvfp4Weight)


def test_greedy_tokens_in_a_batch_equal_transformers_on_the_dequantised_weights(written, reference_tokens):
    assert runtime_tokens(written["hf_quant_config"]) == reference_tokens
    assert runtime_tokens(written["config"], cpu_gemm="plain") == reference_tokens


def test_two_ranks_equal_one_rank(written, reference_tokens):
    assert runtime_tokens(written["hf_quant_config"], tensor_parallel_size=2) == reference_tokens


@pytest.mark.parametrize(("form", "scheme"), [("hf_quant_config", "nvfp4"), ("fp8", "fp8")])
def test_the_planner_counts_the_bytes_the_model_holds(written, form, scheme):
    path = written[form]
    model = load_model(path, dtype="float32")
    finish_quantization(model, scheme)
    weights = quantized_weights(model)
    assert {w.scheme for w in weights} == {scheme}
    planned = weight_footprint(ModelConfig.from_pretrained(path), "float32")
    assert planned.format == scheme and planned.quantized_bytes == sum(w.nbytes for w in weights)


def test_fp8_weights_load_as_stored_with_modelopts_values(written):
    path = written["fp8"]
    model = load_model(path, dtype="float32")
    layer = model.model.layers[1]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for prefix, weight in (("model.layers.1.self_attn.o_proj.", layer.self_attn.o_proj.packed),
                               ("model.layers.1.mlp.experts.3.down_proj.", layer.mlp.experts.down_packed[3])):
            stored, scale = f.get_tensor(prefix + "weight"), f.get_tensor(prefix + "weight_scale")
            assert isinstance(weight, Fp8Weight)
            assert torch.equal(weight.weight.view(torch.uint8), stored.view(torch.uint8))
            assert torch.equal(weight.dequantize(), stored.float() * scale)  # exactly: the scale multiplies
    assert isinstance(layer.mlp.experts.gate_up_packed[3], Fp8Weight)  # gate and up, each with its own scale
    assert not isinstance(model.model.layers[0].self_attn.o_proj.packed, Fp8Weight)


def test_fp8_greedy_tokens_equal_transformers_and_two_ranks_equal_one(written, fp8_reference_tokens):
    assert runtime_tokens(written["fp8"]) == fp8_reference_tokens
    assert runtime_tokens(written["fp8"], tensor_parallel_size=2) == fp8_reference_tokens


@pytest.mark.parametrize("algo", ["W4A8_AWQ", "MIXED_PRECISION", "FP8_PB_WO", "FP8_PER_CHANNEL_PER_TOKEN"])
def test_an_algorithm_the_runtime_cannot_run_is_refused_naming_it(written, tmp_path, algo):
    with pytest.raises(UnsupportedScheme, match=f"quant_algo='{algo}' is not supported"):
        parse_modelopt_config({"quant_method": "modelopt", "quantization": {"quant_algo": algo}})
    path = tmp_path / algo
    path.mkdir()
    (path / "config.json").write_text((written["hf_quant_config"] / "config.json").read_text())
    (path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": algo, "exclude_modules": EXCLUDE}}))
    (path / "model.safetensors").write_bytes(b"not read")  # refused before any weight is read
    with pytest.raises(UnsupportedScheme, match=algo):
        load_model(path, dtype="float32")
    with pytest.raises(UnsupportedScheme, match="group_size=32"):
        parse_modelopt_config({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32})


def test_quantize_refuses_a_modelopt_checkpoint_as_already_quantised(written, tmp_path, capsys):
    assert quantize_main(["--model", str(written["config"]), "--quantization", "int8", "--out",
                          str(tmp_path / "copy")]) == 1
    assert "already quantised (nvfp4)" in capsys.readouterr().err
