"""FP4 E2M1 weights (``layers.fp4``): MXFP4 and NVFP4 as compressed-tensors publishes them. The stored values against
the library's own unpacking and scale decoding; the compiled kernel's variants (natively and in a process capped at
AVX2) and the Triton GEMM (through the interpreter on a CPU) against the widened fallback; checkpoints written by the
library's model API and by its compressors loaded as stored; greedy tokens against transformers on the dequantised
model; tensor-parallel shards that cut a scale group refused."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mla_kernels import cpu_kernels, cpu_ops, cpu_tables
from mla_kernels.fp4_format import dequantize_fp4, group_scales, pack_nibbles, round_to_e2m1
from mla_runtime import LLM, SamplingParams
from mla_runtime.compressed import main as quantize_main
from mla_runtime.compressed import read_fp4
from mla_runtime.config import ModelConfig, parse_quantization_config
from mla_runtime.footprint import weight_footprint
from mla_runtime.kernel_plan import kernel_plan
from mla_runtime.layers.fp4 import Fp4Weight, Mxfp4Weight, Nvfp4Weight
from mla_runtime.layers.quantization import finish_quantization, quantized_weights
from mla_runtime.loader import _Reader, checkpoint_files, load_model
from tests.checkpoints import build_hf_model, save_checkpoint
from tests.layer_kernel import decode_in_layer_kernel
from tests.test_w8a8 import open_gates

FORMATS = {"mxfp4": Mxfp4Weight, "nvfp4": Nvfp4Weight}
VARIANT = "v3_noq_halfsplit"  # every product's K a multiple of 32
PROMPTS = [[5, 9, 2, 7, 11], list(range(3, 40))]
NEW_TOKENS = 8
needs_kernel = pytest.mark.skipif(cpu_kernels.failure("fp4") is not None,
                                  reason=f"the FP4 kernel does not run here: {cpu_kernels.failure('fp4')}")


def library_dequantized(variant: str, packed: torch.Tensor, scales: torch.Tensor,
                        global_scale: torch.Tensor | None) -> torch.Tensor:
    """The published dequantisation, through compressed-tensors' own helpers: its nibble table, its MX exponent
    decoding, NVFP4's scale divided by the global scale."""
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    n, k = packed.shape[0], 2 * packed.shape[1]
    values = unpack_fp4_from_uint8(packed, n, k, dtype=torch.float32)
    if variant == "mxfp4":
        scale = decompress_mx_scale(scales).float()
    else:
        scale = scales.float() / global_scale.float().reshape(-1, 1)
    group = k // scales.shape[1]
    return (values.view(n, -1, group) * scale.unsqueeze(-1)).view(n, k)


def random_weight(variant: str, n: int, k: int, g: torch.Generator) -> Fp4Weight:
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    group = 32 if variant == "mxfp4" else 16
    if variant == "mxfp4":
        return Mxfp4Weight(packed, torch.randint(118, 128, (n, k // group), generator=g, dtype=torch.uint8), None,
                           torch.float32)
    scales = (torch.rand(n, k // group, generator=g) * 400 + 1).to(torch.float8_e4m3fn)
    return Nvfp4Weight(packed, scales, torch.full((n,), 2000.0) + torch.arange(n), torch.float32)


@pytest.mark.parametrize("variant", FORMATS)
def test_the_stored_values_are_the_published_dequantisation(variant):
    g = torch.Generator().manual_seed(0)
    w = random_weight(variant, 9, 128, g)
    assert torch.equal(w.dequantize(), library_dequantized(variant, w.packed, w.scales, w.global_scales))
    assert w.nbytes == type(w).stored_bytes(9, 128) == 9 * 64 + 9 * 128 // (32 if variant == "mxfp4" else 16) + \
        (4 * 9 if variant == "nvfp4" else 0)


def test_rounding_to_e2m1_takes_the_nearest_value_ties_to_even():
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, -0.0, -2.9, 100.0])
    codes = round_to_e2m1(x)
    values = dequantize_fp4("mxfp4", pack_nibbles(torch.cat([codes, codes[:3]]).reshape(1, 16).repeat(1, 2)),
                            torch.full((1, 1), 127, dtype=torch.uint8))[0, :13]
    assert values.tolist() == [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -3.0, 6.0]


@pytest.mark.parametrize("variant", FORMATS)
def test_quantising_a_float_matrix_rounds_each_value_to_its_nearest_step(variant):
    """Each value within half of E2M1's widest step (2 units of its group's scale) of the float one, or clipped at 6
    units; MXFP4's scale is the OCP rule's power of two, NVFP4's the group's largest magnitude / 6 in E4M3."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(20, 64, generator=g) * 0.05
    q = FORMATS[variant].quantize(w)
    group = 32 if variant == "mxfp4" else 16
    amax = w.view(20, -1, group).abs().amax(-1)
    scale = group_scales(variant, q.scales, q.global_scales)
    if variant == "mxfp4":
        assert torch.equal(scale, torch.exp2(torch.floor(torch.log2(amax)) - 2))
    else:
        assert ((scale * 6 - amax).abs() <= amax * 2**-4).all()  # E4M3: 3 mantissa bits
    bound = torch.maximum(scale, amax - 6 * scale).unsqueeze(-1).expand(-1, -1, group).reshape(20, 64)
    assert ((q.dequantize() - w).abs() <= bound * (1 + 1e-6)).all()
    # a K that is not a whole number of groups: the last group padded with zeros, which every product skips
    odd = torch.randn(4, group + 8, generator=g)
    q = FORMATS[variant].quantize(odd)
    assert q.shape == (4, group + 8) and q.packed.shape == (4, group)
    if variant == "mxfp4":  # MX groups are independent (NVFP4's global scale comes from the whole row)
        assert torch.equal(q.dequantize()[:, :group], FORMATS[variant].quantize(odd[:, :group]).dequantize())
    x = torch.randn(3, group + 8, generator=g)
    want = x.double() @ q.dequantize().double().T
    torch.testing.assert_close(q.matmul(x, None).double(), want, rtol=1e-5, atol=1e-5)
    q.bind(kernel_plan("plain"))
    torch.testing.assert_close(q.matmul(x, None).double(), want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("variant", FORMATS)
def test_every_kernel_variant_agrees_with_the_widened_fallback(variant):
    g = torch.Generator().manual_seed(2)
    w = random_weight(variant, 70, 256, g)
    wide = w.dequantize().double()
    for rows in (1, 3, 9, 70):
        x = torch.randn(rows, 256, generator=g)
        want = x.double() @ wide.T
        for isa in cpu_kernels.variants("float"):
            got = cpu_kernels.ops().fp4_linear(x, w.packed, w.scales, w.global_scales, isa)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
            alone = cpu_kernels.ops().fp4_linear(x[-1:], w.packed, w.scales, w.global_scales, isa)
            assert torch.equal(alone, got[-1:])  # a row's result is the same bits whatever shares its call
    x, bias = torch.randn(2, 5, 256, generator=g), torch.randn(70, generator=g)
    fast = w.matmul(x, bias)
    w.bind(kernel_plan("plain"))
    assert not w.kernel
    torch.testing.assert_close(fast, w.matmul(x, bias), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_the_operator_refuses_what_its_tensors_do_not_hold():
    g = torch.Generator().manual_seed(3)
    w = random_weight("nvfp4", 4, 64, g)
    ops = cpu_kernels.ops()
    with pytest.raises(ValueError, match="come with global scales"):
        ops.fp4_linear(torch.ones(1, 64), w.packed, w.scales, None)
    with pytest.raises(ValueError, match="the packed weight must be a contiguous CPU Byte tensor \\[4, 24\\]"):
        ops.fp4_linear(torch.ones(1, 40), w.packed, w.scales, w.global_scales)
    with pytest.raises(ValueError, match="scales are uint8 \\(MXFP4\\) or float8_e4m3fn"):
        ops.fp4_linear(torch.ones(1, 64), w.packed, w.scales.float(), w.global_scales)


def _silu_mlp(gate_up: Fp4Weight, down: Fp4Weight, x: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.matmul(x, None).chunk(2, dim=-1)
    return down.matmul(gate / (1 + torch.exp(-gate)) * up, None)


@needs_kernel
@pytest.mark.parametrize("variant", FORMATS)
def test_the_one_row_mlp_kernel_reads_fp4_matrices(variant):
    """A MoE layer's FP4 experts (NVFP4: each row its own global scale) go into the compiled one-row MLP kernel's
    table as stored (the nibbles and a table of their scales) and give what their products give one by one (float32
    rows, as fp4_linear reads them): an expert alone the same bits. A K padded to whole groups, or a plan without the
    FP4 kernel, leaves a matrix without an operand."""
    g = torch.Generator().manual_seed(5)
    d, inter = 256, 96
    gate_ups = [open_gates(inter, d, g) for _ in range(3)]
    mlps = [(FORMATS[variant].quantize(w), random_weight(variant, d, inter, g)) for w, _ in gate_ups]
    table = cpu_tables.GatedMLPTable([(a.row_operand(), b.row_operand()) for a, b in mlps])
    assert table.table.kinds() == ["fp4"] * 6
    x = gate_ups[2][1]
    assert torch.equal(table(x, [2], [1.0]), _silu_mlp(*mlps[2], x))
    torch.testing.assert_close(table(x, [0, 2], [0.3, 0.7]),
                               _silu_mlp(*mlps[0], x) * 0.3 + _silu_mlp(*mlps[2], x) * 0.7, rtol=1e-5, atol=1e-4)
    gate_up, down = mlps[0]
    with pytest.raises(ValueError, match="the FP4 table is not one of a matrix \\[256, 96\\]"):
        cpu_tables.GatedMLPTable([(gate_up.row_operand(), (down.packed, mlps[1][0].row_operand()[1]))])
    assert FORMATS[variant].quantize(torch.randn(4, 40, generator=g)).row_operand() is None  # K padded to 64
    gate_up.bind(dataclasses.replace(kernel_plan("auto"), fp4_failure="left out"))
    assert gate_up.row_operand() is None


@needs_kernel
def test_the_fp4_table_refuses_what_its_tensors_do_not_hold():
    w = random_weight("nvfp4", 4, 64, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="come with global scales"):
        cpu_kernels.fp4_table(w.packed, w.scales)
    with pytest.raises(ValueError, match="the group scales must be a contiguous CPU Float8_e4m3fn tensor \\[4, 4\\]"):
        cpu_kernels.fp4_table(w.packed, w.scales[:, :2].contiguous(), w.global_scales)


_TRITON = """
import sys, torch
from mla_kernels.fp4_gemm import fp4_gemm
w = torch.load(sys.argv[1])
torch.save({v: fp4_gemm(w["x"], *w[v], v) for v in ("mxfp4", "nvfp4")}, sys.argv[2])
"""


def test_the_triton_kernel_agrees_with_the_widened_fallback(tmp_path):
    """The Triton GEMM through its interpreter (a process of its own, ``TRITON_INTERPRET=1`` set before Triton loads):
    a K that is not a whole number of its 64-value steps, and rows and columns past its tiles."""
    g = torch.Generator().manual_seed(4)
    weights = {v: random_weight(v, 70, 96, g) for v in FORMATS}
    x = torch.randn(19, 96, generator=g)
    torch.save({"x": x, **{v: (w.packed, w.scales, w.global_scales) for v, w in weights.items()}}, tmp_path / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", _TRITON, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    for v, w in weights.items():
        torch.testing.assert_close(got[v].double(), x.double() @ w.dequantize().double().T, rtol=1e-5, atol=1e-4)


# -- checkpoints --------------------------------------------------------------------------------------------------

def library_checkpoint(path: Path, variant: str) -> Path:
    """A checkpoint written through compressed-tensors' model API (as llm-compressor saves one): its NVFP4A16 or
    MXFP4A16 preset applied to a transformers model, scales set from each group's largest magnitude, compressed and
    saved."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme

    model = build_hf_model(VARIANT)
    scheme = preset_name_to_scheme(variant.upper() + "A16", ["Linear"])
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=["lm_head", "re:.*kv_b_proj$", "re:.*mlp\\.gate$"]))
    group = scheme.weights.group_size
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.detach().float()
            amax = w.view(w.shape[0], -1, group).abs().amax(-1)
            if variant == "nvfp4":
                glob = 448 * 6 / w.abs().amax()
                module.weight_global_scale.data.copy_(glob.reshape(module.weight_global_scale.shape))
                module.weight_scale.data.copy_((amax / 6 * glob).to(torch.float8_e4m3fn).float())
            else:
                _, exp = torch.frexp(amax)
                module.weight_scale.data.copy_(torch.ldexp(torch.ones_like(amax), exp - 3))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=f"{variant}-pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


@pytest.mark.parametrize("variant", FORMATS)
def test_a_checkpoint_written_through_the_librarys_model_api_loads_as_stored(tmp_path, variant):
    path = library_checkpoint(tmp_path / variant, variant)
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    assert parse_quantization_config(raw).quantization == variant
    assert ModelConfig.from_pretrained(path).stored_quantization == variant
    model = load_model(path, dtype="float32")
    prefix = "model.layers.1.self_attn.o_proj."
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = [f.get_tensor(prefix + n) for n in ("weight_packed", "weight_scale")]
        glob = f.get_tensor(prefix + "weight_global_scale") if variant == "nvfp4" else None
    o_proj = model.model.layers[1].self_attn.o_proj.packed
    assert isinstance(o_proj, FORMATS[variant])
    assert torch.equal(o_proj.packed, stored[0]) and torch.equal(o_proj.scales.view(torch.uint8),
                                                                 stored[1].view(torch.uint8))
    assert torch.equal(o_proj.dequantize(), library_dequantized(variant, *stored, glob))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A tiny V3 checkpoint and its MXFP4 / NVFP4 copies written through compressed-tensors' compressors."""
    src = save_checkpoint(build_hf_model(VARIANT), tmp_path_factory.mktemp("fp4_src"))
    out = {}
    for variant in FORMATS:
        out[variant] = tmp_path_factory.mktemp(f"fp4_{variant}")
        assert quantize_main(["--model", str(src), "--quantization", variant, "--out", str(out[variant])]) == 0
    return src, out


def reference_tokens(path: Path, variant: str) -> list[list[int]]:
    """transformers' greedy tokens with every matrix stored in FP4 set to the published dequantisation of its stored
    tensors, and ``kv_b_proj`` rounded to bfloat16 as the runtime holds it."""
    hf = build_hf_model(VARIANT)
    params = dict(hf.named_parameters())
    set_count = 0
    with torch.no_grad(), safe_open(str(next(path.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
        for name in sorted(n for n in names if n.endswith(".weight_packed")):
            base = name[: -len("weight_packed")]
            glob = f.get_tensor(base + "weight_global_scale") if variant == "nvfp4" else None
            w = library_dequantized(variant, f.get_tensor(name), f.get_tensor(base + "weight_scale"), glob)
            parts = base.rstrip(".").split(".")
            if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
                i = parts.index("experts")
                e, proj = int(parts[i + 1]), parts[i + 2]
                fused = params[".".join(parts[: i + 1]) + (".down_proj" if proj == "down_proj" else ".gate_up_proj")]
                inter = fused.shape[1] // 2
                {"down_proj": fused[e], "gate_proj": fused[e, :inter], "up_proj": fused[e, inter:]}[proj].copy_(w)
            else:
                params[base + "weight"].copy_(w)
            set_count += 1
        for module_name, module in hf.named_modules():
            if module_name.endswith("kv_b_proj"):
                module.weight.copy_(module.weight.to(torch.bfloat16).float())
        if hf.config.tie_word_embeddings:  # the runtime's head: its own quantisation of the embedding (tested above)
            head = FORMATS[variant].quantize(hf.model.embed_tokens.weight).dequantize()
            hf.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    assert set_count > 20
    out = []
    for prompt in PROMPTS:
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False)
        out.append(ids[0, len(prompt):].tolist())
    return out


def runtime_tokens(path: Path, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB", **kwargs)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


@pytest.mark.parametrize("variant", FORMATS)
def test_greedy_tokens_equal_transformers_on_the_dequantised_model(written, variant):
    src, out = written
    want = reference_tokens(out[variant], variant)
    assert runtime_tokens(out[variant]) == want
    assert runtime_tokens(out[variant], cpu_gemm="plain") == want


_CAPPED = """
import json, sys
from mla_kernels import cpu_kernels
from tests.test_fp4 import runtime_tokens
from pathlib import Path
print(json.dumps({"variants": cpu_kernels.variants("float"), "failure": cpu_kernels.failure("fp4"),
                  "tokens": runtime_tokens(Path(sys.argv[1]))}))
"""


@needs_kernel
def test_a_process_capped_at_avx2_gives_the_same_tokens(written):
    src, out = written
    env = {**os.environ, cpu_ops.ISA_ENV: "avx2", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", _CAPPED, str(out["nvfp4"])], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["variants"] == ["avx2"] and said["failure"] is None
    assert said["tokens"] == reference_tokens(out["nvfp4"], "nvfp4")


@needs_kernel
def test_decode_steps_run_the_whole_layer_kernel_on_fp4_matrices(written, monkeypatch):
    """Every layer of an MXFP4 model decodes in the compiled whole-layer kernel (one call a layer, its matrices read as
    FP4), and a batch's tokens are each prompt's tokens alone."""
    assert decode_in_layer_kernel(written[1]["mxfp4"], monkeypatch) == {"fp4"}


@pytest.mark.parametrize("variant", FORMATS)
def test_a_rank_reads_whole_scale_groups_and_refuses_a_cut_one(written, variant):
    src, out = written
    files = checkpoint_files(out[variant])
    name = "model.layers.0.mlp.down_proj.weight"
    reader = _Reader(files)
    whole = read_fp4(reader, name, variant, None, torch.float32, torch.device("cpu"))
    k = whole.shape[1]
    part = read_fp4(reader, name, variant, (1, 64, k, k), torch.float32, torch.device("cpu"))
    assert torch.equal(part.dequantize(), whole.dequantize()[:, 64:])
    rows = read_fp4(reader, name, variant, (0, 8, 24, whole.shape[0]), torch.float32, torch.device("cpu"))
    assert torch.equal(rows.dequantize(), whole.dequantize()[8:24])
    with pytest.raises(ValueError, match="do not start and end on the .* scale groups"):
        read_fp4(reader, name, variant, (1, 8, k, k), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("variant", FORMATS)
def test_the_planner_counts_the_bytes_an_fp4_model_holds(written, variant):
    src, out = written
    model = load_model(out[variant], dtype="float32")
    finish_quantization(model, variant)
    weights = quantized_weights(model)
    assert {w.scheme for w in weights} == {variant}
    planned = weight_footprint(ModelConfig.from_pretrained(out[variant]), "float32")
    assert planned.format == variant and planned.quantized_bytes == sum(w.nbytes for w in weights)
