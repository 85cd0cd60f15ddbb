"""Pre-quantised checkpoints (compressed-tensors): ours round-trip exactly, the library's own load as stored, and an
unsupported scheme is refused by name."""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from safetensors import safe_open

from mla_runtime import LLM, SamplingParams
from mla_runtime.compressed import main
from mla_runtime.config import ModelConfig, UnsupportedScheme, parse_quantization_config
from mla_runtime.layers.int4 import Int4Weight
from mla_runtime.layers.quantization import Int8Weight, finish_quantization, quantized_weights
from mla_runtime.loader import load_model
from mla_runtime.token_map import MAP_FILE, resolve_token_map
from tests.checkpoints import build_hf_model

SCHEMES = ("int8", "int4")


@pytest.fixture(scope="module")
def written(tiny_checkpoint, tmp_path_factory):
    """The tiny V3 checkpoint and its ``mla-runtime quantize`` copies."""
    src, _ = tiny_checkpoint("v3")
    out = {}
    for scheme in SCHEMES:
        out[scheme] = tmp_path_factory.mktemp(f"ct_{scheme}")
        assert main(["--model", str(src), "--quantization", scheme, "--out", str(out[scheme])]) == 0
    return src, out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_written_checkpoint_loads_the_same_weights_as_quantising_on_load(written, scheme):
    src, out = written
    raw = json.loads((out[scheme] / "config.json").read_text())
    q = raw["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    assert q["format"] == {"int8": "int-quantized", "int4": "pack-quantized"}[scheme]
    assert ModelConfig.from_pretrained(out[scheme]).stored_quantization == scheme
    assert (out[scheme] / "tokenizer.json").exists() == (src / "tokenizer.json").exists()
    on_load = load_model(src, dtype="float32", quantization=scheme)
    stored = load_model(out[scheme], dtype="float32")  # no quantization asked: the checkpoint's own
    for model in (on_load, stored):
        finish_quantization(model, scheme)
    a, b = quantized_weights(on_load), quantized_weights(stored)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert type(x) is type(y) and torch.equal(x.dequantize(), y.dequantize())
    for (name, p), (_, r) in zip(on_load.named_parameters(), stored.named_parameters()):
        assert torch.equal(p, r), name
    size = sum(f.stat().st_size for f in out[scheme].glob("*.safetensors"))
    assert size < 0.6 * sum(f.stat().st_size for f in src.glob("*.safetensors"))  # float32 source


@pytest.mark.parametrize("model_type", ["kimi_k25", "mistral_large4"])
def test_a_family_stored_under_names_of_its_own_is_quantised_when_written(tmp_path, model_type):
    """A checkpoint whose tensor names the family renames (Kimi-K2.5's multimodal layout, Mistral Large 4's own) is
    quantised under the model's names: the copy holds the same int4 weights as quantising the source while loading."""
    from tests.conformance import build

    src, out = tmp_path / "src", tmp_path / "int4"
    build(model_type).save_pretrained(src)
    assert main(["--model", str(src), "--quantization", "int4", "--out", str(out)]) == 0
    on_load = load_model(src, dtype="float32", quantization="int4")
    stored = load_model(out, dtype="float32")
    for model in (on_load, stored):
        finish_quantization(model, "int4")
    a, b = quantized_weights(on_load), quantized_weights(stored)
    assert len(a) == len(b) > 0
    assert all(torch.equal(x.dequantize(), y.dequantize()) for x, y in zip(a, b))
    with open(out / "model.safetensors.index.json") as f:
        packed = [n for n in json.load(f)["weight_map"] if n.endswith(".weight_packed")]
    assert len(packed) >= len(a)  # every quantised matrix stored packed (a stacked one from its parts)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_engine_serves_a_prequantised_checkpoint(written, scheme):
    src, out = written
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 2, 7, 11]}, {"prompt_token_ids": list(range(3, 40))}]
    want = [o.outputs[0].token_ids for o in LLM(str(src), dtype="float32", quantization=scheme,
                                                kv_cache_memory="8MiB").generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in LLM(str(out[scheme]), dtype="float32",
                                               kv_cache_memory="8MiB").generate(prompts, params)]
    assert got == want
    other = "int4" if scheme == "int8" else "int8"
    with pytest.raises(ValueError, match=f"stored quantised to {scheme}"):
        LLM(str(out[scheme]), dtype="float32", quantization=other, kv_cache_memory="8MiB")


def _library_checkpoint(path, scheme: str):
    """A checkpoint written by compressed-tensors' own API (the way llm-compressor saves one): the scheme applied to
    a transformers model, per-channel / per-group absmax scales, compressed and saved."""
    model = build_hf_model("v3")
    model = model[0] if isinstance(model, tuple) else model
    if scheme == "int8":
        args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    else:
        args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head", "re:.*kv_b_proj$", "re:.*mlp\\.gate$", "re:.*q_b_proj$"])
    apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.detach().float()
            s = w.abs().amax(1, keepdim=True) / 127 if scheme == "int8" else \
                w.view(w.shape[0], -1, 32).abs().amax(-1) / 7.5
            module.weight_scale.data.copy_(s.to(module.weight_scale.dtype))
    fmt = "int-quantized" if scheme == "int8" else "pack-quantized"
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_checkpoint_written_by_the_library_loads_as_stored(tmp_path, scheme):
    path = _library_checkpoint(tmp_path / scheme, scheme)
    model = load_model(path, dtype="float32")
    finish_quantization(model, scheme)
    o_proj = model.model.layers[0].self_attn.o_proj.packed
    prefix = "model.layers.0.self_attn.o_proj."
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        if scheme == "int8":
            assert isinstance(o_proj, Int8Weight)
            assert torch.equal(o_proj.qweight, f.get_tensor(prefix + "weight"))  # the stored integers, as stored
        else:
            assert isinstance(o_proj, Int4Weight)
            shape = torch.Size(f.get_tensor(prefix + "weight_shape").tolist())
            stored = unpack_from_int32(f.get_tensor(prefix + "weight_packed"), 4, shape)
            assert torch.equal(o_proj.to_int()[0], stored.to(torch.int8))
    # the stored scales are the ones used: every weight within half a step of the float weight it came from
    hf = build_hf_model("v3")
    hf = hf[0] if isinstance(hf, tuple) else hf
    w = hf.model.layers[0].self_attn.o_proj.weight.detach().float()
    step = w.abs().amax(1, keepdim=True) / 127 if scheme == "int8" else \
        (w.view(w.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 7.5).expand(-1, -1, 32).reshape(w.shape)
    # (int8 scales are held in bfloat16, the int8 kernels' scale type: a float32 scale moves by up to 2^-8 of itself,
    # so a weight of up to 127 steps by up to half a step more)
    slack = 0.51 if scheme == "int4" else 0.51 + 127 * 2**-8
    assert ((o_proj.dequantize() - w).abs() <= step * slack + 1e-6).all()


@pytest.mark.parametrize("weights, says", [
    ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 256}, "group_size=256"),
    ({"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}, "symmetric=False"),
    ({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}, "type=float"),
])
def test_an_unsupported_scheme_is_refused_by_name(weights, says):
    q = {"quant_method": "compressed-tensors", "format": "pack-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    with pytest.raises(UnsupportedScheme, match=says):
        parse_quantization_config(q)
    q["config_groups"]["group_0"]["weights"] = {"num_bits": 8, "type": "int", "symmetric": True,
                                                "strategy": "channel"}
    q["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token"}
    with pytest.raises(UnsupportedScheme, match="input_activations"):
        parse_quantization_config(q)


def test_stored_int8_matrices_are_served_from_the_mapped_file_without_a_copy(written):
    """A pre-quantised int8 matrix runs exactly as the file stores it, so the CPU loader serves it from a private
    (copy-on-write) mapping of the file: each expert's gate and up rows, stored one after the other, are one view of
    the file, not a copy; writing to the loaded weights never changes the file."""
    _, out = written
    path = out["int8"]
    model = load_model(path, dtype="float32")
    layer = next(i for i, lay in enumerate(model.model.layers) if hasattr(lay.mlp, "experts"))
    gate_up = model.model.layers[layer].mlp.experts.gate_up_packed[1]
    assert isinstance(gate_up, Int8Weight)
    prefix = f"model.layers.{layer}.mlp.experts.1."
    shard = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][prefix + "gate_proj.weight"] \
        if (path / "model.safetensors.index.json").exists() else "model.safetensors"
    with safe_open(str(path / shard), "pt") as f:
        stored = torch.cat([f.get_tensor(prefix + "gate_proj.weight"), f.get_tensor(prefix + "up_proj.weight")])
    assert torch.equal(gate_up.qweight, stored)
    assert gate_up.qweight.untyped_storage().nbytes() == (path / shard).stat().st_size  # the whole file, mapped
    before = (path / shard).read_bytes()
    gate_up.qweight.zero_()
    assert (path / shard).read_bytes() == before


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_a_written_checkpoint_takes_the_umask_and_keeps_the_token_map(tiny_checkpoint, tmp_path, umask, mode):
    """Every file of the copy has the permissions ``open`` gives under the umask (the weights included), and the
    source's MTP draft vocabulary travels with it, so drafting on the copy keeps it."""
    src, _ = tiny_checkpoint("v3")
    source = tmp_path / "src"
    shutil.copytree(src, source)
    (source / MAP_FILE).write_text("[5, 1, 3]", encoding="utf-8")
    (source / "chat_template.jinja").write_text("{{ messages }}", encoding="utf-8")
    (source / "chat_template.jinja").chmod(0o600)  # a copied file takes the umask too, not its source's mode
    out = tmp_path / "out"
    old = os.umask(umask)
    try:
        assert main(["--model", str(source), "--quantization", "int8", "--out", str(out)]) == 0
    finally:
        os.umask(old)
    written = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert any(name.endswith(".safetensors") for name in written) and "chat_template.jinja" in written
    assert written == dict.fromkeys(written, mode)
    assert (out / MAP_FILE).read_text(encoding="utf-8") == "[5, 1, 3]"
    assert resolve_token_map(None, out, 10)[0] == [1, 3, 5]
