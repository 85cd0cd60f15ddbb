"""4-bit checkpoints with zero points and groups of 32/64/128 (AWQ, GPTQ, compressed-tensors W4A16) load as stored
and run in the int4 path: the kernel's asymmetric and wider groups, the loaded weights against each writer's
reference, greedy tokens against transformers, the planner's bytes, tensor-parallel slices and what is refused; and
the runtime's own W4A16 (asymmetric groups of 128), quantised while loading or written by ``mla-runtime quantize``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mla_kernels import cpu_kernels, cpu_ops, cpu_tables, int4_format
from mla_runtime import LLM, SamplingParams, stored_int4
from mla_runtime.compressed import main as quantize_main
from mla_runtime.config import Int4Layout, ModelConfig, UnsupportedScheme, parse_awq_gptq_config
from mla_runtime.footprint import weight_footprint
from mla_runtime.layers.int4 import Int4Weight, W4A16Weight, layout_bytes, quantize_w4a16
from mla_runtime.layers.quantization import finish_quantization, quantized_weights
from mla_runtime.loader import CheckpointError, _Reader, checkpoint_files, load_model
from mla_runtime.parallel import ParallelContext
from mla_runtime.stored_int4 import read_int4
from tests.int4_checkpoints import (
    _library_dequantized,
    float_source,
    write_awq,
    write_compressed_tensors,
    write_gptq,
)
from tests.layer_kernel import decode_in_layer_kernel


def _variants() -> list[str]:
    return ["avx2", "avx512_vnni"]


def _variant_or_skip(variant: str) -> None:
    why = cpu_kernels.failure("int4")
    if why is not None:
        pytest.skip(f"the int4 kernel is unavailable here: {why}")
    if variant not in cpu_kernels.variants("int4"):
        pytest.skip(f"this CPU does not execute the int4 kernel's {variant} variant")


def _random_weight(n: int, k: int, group: int, asymmetric: bool, seed: int, top: int = 15) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.05 + 1e-3).half()
    zeros = torch.randint(0, top + 1, (n, k // group), generator=g) if asymmetric else None
    return Int4Weight.from_unsigned(q, scales, zeros, group, torch.float32)


def _rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """The kernel's input rows: rounded to int8 per group of 32 (``quantize_q8_groups``), in float64."""
    q, scale = int4_format.quantize_q8_groups(x)
    return (q.double().unflatten(-1, (-1, 32)) * scale.double().unsqueeze(-1)).flatten(-2)[:, :x.shape[-1]]


def _tolerance(dq: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The int4 tests' rule: the rounding of each group of 32 inputs to int8 (at most the group's largest magnitude /
    254 a value) and float32 sums."""
    wa, xa = dq.double().abs(), x.double().abs()
    groups = torch.nn.functional.pad(xa, (0, -x.shape[-1] % 32)).unflatten(-1, (-1, 32))
    step = (groups.amax(-1, keepdim=True) / 254).expand(groups.shape).flatten(-2)[..., :x.shape[-1]]
    return step @ wa.T + 1e-5 * (xa @ wa.T) + 1e-30


# -- the format and its kernel --------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", _variants())
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_kernel_is_its_rounded_rows_times_the_weight(variant, group, asymmetric, rows):
    """Each variant computes the exact product of the Q8_0-rounded rows with ``scale * (q - zero)`` per group, to
    float32 summation (zero points up to 16: GPTQ's original format), every variant the same bits."""
    _variant_or_skip(variant)
    n, k = 37, 640
    w = _random_weight(n, k, group, asymmetric, seed=group + rows, top=16)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, k)[torch.randperm(k, generator=g)]
    dq = w.dequantize().double()
    got = cpu_kernels.linear_int4(x, w.packed, w.scales, w.zeros, group, variant=variant)
    xr = _rounded_rows(x)
    assert ((got.double() - xr @ dq.T).abs() <= 2e-6 * (xr.abs() @ dq.abs().T) + 1e-30).all()
    assert torch.equal(got, cpu_kernels.linear_int4(x, w.packed, w.scales, w.zeros, group))  # the fastest variant
    assert torch.equal(got, w.matmul(x, None))


def test_symmetric_groups_of_32_are_q4_0_bit_for_bit():
    """Zero points of 8 are the symmetric format: the same bits as the Q4_0 product and the Q4_0 form kept."""
    _variant_or_skip("avx2")
    w = Int4Weight.quantize(torch.randn(50, 320))
    x = torch.randn(7, 320)
    eights = torch.full_like(w.scales, 8, dtype=torch.uint8)
    assert torch.equal(cpu_kernels.linear(x, w.packed, w.scales),
                       cpu_kernels.linear_int4(x, w.packed, w.scales, eights, 32))
    assert w.q4_0 and w.row_operand() is not None


@pytest.mark.parametrize("group", [64, 128])
def test_widened_path_is_the_dequantised_product(gemm_mode, plan, group, monkeypatch):
    """``cpu_gemm=plain`` (the dequantised weight and ``F.linear``) and the kernel agree within the kernel's
    rounding of its input rows; the widened product is the float product of the dequantised weight."""
    w = _random_weight(24, 256, group, True, seed=3).bind(plan)
    x = torch.randn(6, 256)
    dq = w.dequantize()
    got = w.matmul(x, None)
    if w.kernel:
        assert ((got.double() - x.double() @ dq.double().T).abs() <= _tolerance(dq, x)).all()
    else:
        torch.testing.assert_close(got, x @ dq.T, rtol=1e-5, atol=1e-6)
    assert (w.row_operand() is not None) == w.kernel  # the fused kernels read it where its product is compiled


@pytest.mark.skipif(cpu_kernels.failure("int4") is not None, reason="the compiled int4 kernels do not run here")
def test_the_one_row_mlp_kernel_reads_grouped_and_asymmetric_int4():
    """Experts in groups of 64 and 128, with zero points or without (AWQ, GPTQ, W4A16), go into the compiled one-row
    MLP kernel's table as their nibbles and an int4 table, with the bits of their products one by one; a matrix that
    reads its inputs reordered (act-order) stays out."""
    d, inter = 256, 128
    kinds = [(128, True), (64, False), (32, True)]
    mlps = [(_random_weight(2 * inter, d, g, asym, seed=2 * e), _random_weight(d, inter, g, asym, seed=2 * e + 1))
            for e, (g, asym) in enumerate(kinds)]
    table = cpu_tables.GatedMLPTable([(g.row_operand(), w.row_operand()) for g, w in mlps])
    assert table.table.kinds() == ["int4 groups"] * 6
    x = torch.randn(1, d)

    def one(gate_up: Int4Weight, down: Int4Weight) -> torch.Tensor:
        gate, up = gate_up.matmul(x, None).chunk(2, dim=-1)
        return down.matmul(gate / (1 + torch.exp(-gate)) * up, None)
    for e in range(3):  # one expert at weight 1: the products' bits (the activation's exp aside: float32 rounding)
        torch.testing.assert_close(table(x, [e], [1.0]), one(*mlps[e]), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="int4_table: groups of 32, 64 or 128"):
        cpu_kernels.int4_table(mlps[0][0].packed, mlps[0][0].scales, mlps[0][0].zeros, 96, d)
    reordered = _random_weight(8, 64, 32, False, seed=9)
    reordered.orders = [(8, torch.randperm(64))]
    assert reordered.row_operand() is None


@pytest.mark.skipif(cpu_kernels.failure("int4") is not None, reason="the compiled int4 kernels do not run here")
def test_an_awq_model_decodes_in_the_whole_layer_kernel(written, monkeypatch):
    """Every layer of a stored AWQ checkpoint decodes in the compiled whole-layer kernel, and a batch's tokens are
    each prompt's tokens alone."""
    assert "int4 groups" in decode_in_layer_kernel(written("awq", "v3")[0], monkeypatch)


def test_an_input_order_is_applied_to_the_rows():
    """A matrix whose inputs are reordered (act-order) multiplies ``x[..., order]``; stacked with another order (the
    rows of ``gate`` and ``up``) each row block keeps its own, and its dequantised columns are in input order."""
    g = torch.Generator().manual_seed(5)
    k, group = 256, 64
    parts = []
    for _ in range(2):
        q = torch.randint(0, 16, (16, k), generator=g)
        s = (torch.rand(16, k // group, generator=g) * 0.05).half()
        z = torch.randint(0, 16, (16, k // group), generator=g)
        order = torch.randperm(k, generator=g)
        parts.append(Int4Weight.from_unsigned(q, s, z, group, torch.float32, order))
        unordered = (q.float() - z.float().repeat_interleave(group, 1)) * s.float().repeat_interleave(group, 1)
        want = torch.empty_like(unordered)
        want[:, order] = unordered  # stored column j multiplies input order[j]
        assert torch.equal(parts[-1].dequantize(), want)
    both = Int4Weight.cat(parts)
    assert len(both.orders or ()) == 2
    assert torch.equal(both.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(3, k, generator=g)
    dq = both.dequantize()
    if both.kernel:
        assert ((both.matmul(x, None).double() - x.double() @ dq.double().T).abs() <= _tolerance(dq, x)).all()
    assert torch.equal(parts[0].select_rows(torch.tensor([3, 1])).dequantize(), parts[0].dequantize()[[3, 1]])
    with pytest.raises(ValueError, match="reorder their inputs differently"):
        both.select_rows(torch.tensor([0]))
    with pytest.raises(ValueError, match="symmetric groups of 32"):
        both.to_int()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda():
    """Off the CPU the matrix is widened a block of rows at a time: asymmetric groups of 128 and an input order."""
    w = _random_weight(40, 256, 128, True, seed=9)
    order = torch.randperm(256, generator=torch.Generator().manual_seed(9))
    cpu = Int4Weight(w.packed, w.scales, 256, torch.float32, group=128, zeros=w.zeros, orders=((40, order),))
    cuda = Int4Weight(w.packed.cuda(), w.scales.cuda(), 256, torch.float32, group=128, zeros=w.zeros.cuda(),
                      orders=((40, order.cuda()),))
    x = torch.randn(3, 256)
    assert not cuda.kernel and torch.equal(cuda.dequantize().cpu(), cpu.dequantize())
    torch.testing.assert_close(cuda.matmul(x.cuda(), None).cpu(), x @ cpu.dequantize().T, rtol=1e-4, atol=1e-5)


def test_bad_layouts_are_refused_by_name():
    q = torch.randint(0, 16, (4, 128))
    s = torch.ones(4, 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="zero points must lie in \\[0, 16\\]"):
        Int4Weight.from_unsigned(q, s, torch.full((4, 1), 17), 128, torch.float32)
    with pytest.raises(ValueError, match="groups of 32, 64, 128"):
        Int4Weight.from_unsigned(q, torch.ones(4, 2, dtype=torch.float16), None, 96, torch.float32)
    if cpu_kernels.failure("int4") is None:
        w = _random_weight(4, 128, 128, True, seed=1)
        with pytest.raises(ValueError, match="groups of 32, 64 or 128"):
            cpu_kernels.linear_int4(torch.randn(1, 128), w.packed, w.scales, w.zeros, 16)
        with pytest.raises(ValueError, match="the int4 zero points must be a contiguous CPU Byte tensor"):
            cpu_kernels.linear_int4(torch.randn(1, 128), w.packed, w.scales, w.zeros.int(), 128)


_CAPPED = """
import sys, torch
from mla_kernels import cpu_kernels
from tests.test_stored_int4 import _random_weight
out = {}
for group in (64, 128):
    w = _random_weight(29, 512, group, True, seed=group)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(group))
    out[group] = cpu_kernels.linear_int4(x, w.packed, w.scales, w.zeros, group)
torch.save(out, sys.argv[1])
print(",".join(cpu_kernels.variants("int4")))
"""


def test_a_process_capped_at_avx2_computes_the_avx2_bits(tmp_path):
    """``MLA_CPU_ISA=avx2``: a process runs the AVX2 variant, whose bits every variant gives."""
    _variant_or_skip("avx2")
    out = tmp_path / "capped.pt"
    env = {**os.environ, cpu_ops.ISA_ENV: "avx2", "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", _CAPPED, str(out)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "avx2"
    got = torch.load(out)
    for group in (64, 128):
        w = _random_weight(29, 512, group, True, seed=group)
        x = torch.randn(9, 512, generator=torch.Generator().manual_seed(group))
        for variant in cpu_kernels.variants("int4"):
            assert torch.equal(got[group], cpu_kernels.linear_int4(x, w.packed, w.scales, w.zeros, group,
                                                                   variant=variant))


# -- checkpoints ----------------------------------------------------------------------------------------------------
LAYOUTS = {
    "awq": lambda src, dst, family: write_awq(src, dst),
    "gptq": lambda src, dst, family: write_gptq(src, dst),
    "gptq_act_order": lambda src, dst, family: write_gptq(src, dst, group=32, desc_act=True),
    "gptq_v2_sym_g64": lambda src, dst, family: write_gptq(src, dst, group=64, sym=True,
                                                           checkpoint_format="gptq_v2"),
    "ct_sym_g128": lambda src, dst, family: write_compressed_tensors(dst, family, 128, True),
    "ct_asym_g128": lambda src, dst, family: write_compressed_tensors(dst, family, 128, False),
    "ct_asym_g64": lambda src, dst, family: write_compressed_tensors(dst, family, 64, False),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``written(layout, family)`` -> (checkpoint dir, the writer's reference weights by name)."""
    made: dict[tuple[str, str], tuple[Path, dict[str, torch.Tensor]]] = {}
    sources: dict[str, Path] = {}

    def get(layout: str, family: str = "v3"):
        if (layout, family) not in made:
            if family not in sources:
                sources[family] = float_source(tmp_path_factory.mktemp(f"float_{family}"), family)
            dst = tmp_path_factory.mktemp(f"{layout}_{family}")
            made[(layout, family)] = dst, LAYOUTS[layout](sources[family], dst, family)
        return made[(layout, family)]

    return get


def _expected(ref: dict[str, torch.Tensor], prefix: str, *names: str) -> torch.Tensor:
    return torch.cat([ref[f"{prefix}.{n}.weight"] for n in names])


def _assert_loaded_as_written(model, ref: dict[str, torch.Tensor], float_head: bool = True) -> int:
    """Every product (and kv_b_proj, lm_head: stored float, or quantised) of ``model`` equals the reference; the count
    of int4 matrices."""
    count = 0

    def same(weight, want: torch.Tensor, what: str) -> None:
        nonlocal count
        got = weight.dequantize() if isinstance(weight, Int4Weight) else weight.detach().float()
        count += isinstance(weight, Int4Weight)
        assert torch.equal(got, want), what

    for i, layer in enumerate(model.model.layers):
        p, attn = f"model.layers.{i}", layer.self_attn
        a = f"{p}.self_attn"
        if attn.qkv_a is not None:
            same(attn.qkv_a, _expected(ref, a, "q_a_proj", "kv_a_proj_with_mqa"), f"{a}.qkv_a")
        inputs = ["q_proj"] if attn.q_proj is not None else ["q_a_proj", "q_b_proj"]
        for n in [*inputs, "kv_a_proj_with_mqa", "o_proj"]:
            lin = getattr(attn, n)
            if lin.packed is not None or n in ("q_proj", "q_b_proj", "o_proj"):
                same(lin.packed if lin.packed is not None else lin.weight, ref[f"{a}.{n}.weight"], f"{a}.{n}")
        same(attn.kv_b_proj.weight, ref[f"{a}.kv_b_proj.weight"], f"{a}.kv_b_proj")
        mlp = layer.mlp
        for owner, m in [(f"{p}.mlp", mlp), (f"{p}.mlp.shared_experts", getattr(mlp, "shared_experts", None))]:
            if m is not None and hasattr(m, "gate_up_packed") and not isinstance(m.gate_up_packed, list):
                gate_up = m.gate_up_packed if m.gate_up_packed is not None else m.gate_up_proj
                same(gate_up, _expected(ref, owner, "gate_proj", "up_proj"), owner)
                same(m.down_packed if m.down_packed is not None else m.down_proj, ref[f"{owner}.down_proj.weight"],
                     owner)
        experts = getattr(mlp, "experts", None)
        fused = f"{p}.mlp.experts.gate_up_proj" in ref  # the reference's experts in transformers' stacked form
        for e, (gate_up, down) in enumerate(zip(experts.gate_up_packed, experts.down_packed) if experts else ()):
            x = f"{p}.mlp.experts.{e}"
            same(gate_up, ref[f"{p}.mlp.experts.gate_up_proj"][e] if fused else _expected(ref, x, "gate_proj",
                                                                                           "up_proj"), x)
            same(down, ref[f"{p}.mlp.experts.down_proj"][e] if fused else ref[f"{x}.down_proj.weight"], x)
    if float_head:
        assert torch.equal(model.lm_head.detach().float(), ref["lm_head.weight"])  # stored float, loaded as it is
    else:
        same(model.lm_head_packed, ref["lm_head.weight"], "lm_head")
    return count


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_loaded_weights_are_the_writers_dequantised_weights(written, layout):
    path, ref = written(layout)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.stored_quantization == "int4" and cfg.stored_layout is not None and cfg.stored_float_head
    model = load_model(path, dtype="float32")
    assert _assert_loaded_as_written(model, ref) > 0
    finish_quantization(model, "int4")
    assert not model.lm_head_packed.quantized if model.lm_head_packed is not None else True
    int4 = [w for w in quantized_weights(model) if isinstance(w, Int4Weight)]
    want_group = {"gptq_act_order": 32, "gptq_v2_sym_g64": 64, "ct_asym_g64": 64}.get(layout, 128)
    assert want_group in {w.group for w in int4}
    assert any(w.orders is not None for w in int4) == (layout == "gptq_act_order")
    stored = [w for w in int4 if w.group == want_group]
    assert all(w.zeros is None for w in stored) == layout.startswith(("ct_sym", "gptq_v2_sym"))
    if layout in ("awq", "gptq", "gptq_v2_sym_g64"):  # every product stored quantised: the planner's bytes are exact
        assert {w.group for w in int4} == {want_group}
        assert weight_footprint(cfg, "float32").quantized_bytes == sum(w.nbytes for w in int4)


@pytest.mark.parametrize("layout", ["awq", "gptq_act_order", "ct_asym_g64"])
def test_a_matrix_read_in_blocks_of_rows_is_the_same(written, layout, monkeypatch):
    """Large matrices are converted a block of output rows at a time: blocks of 16 give the writer's weights too."""
    monkeypatch.setattr(stored_int4, "STORED_CHUNK_ROWS", 16)
    path, ref = written(layout)
    assert _assert_loaded_as_written(load_model(path, dtype="float32"), ref) > 0


def test_groups_of_32_may_end_in_a_partial_group(tmp_path):
    """compressed-tensors' groups of 32 over inputs that are not a multiple of 32: the last group is partial (and
    padded in the int4 format), its values and scale kept."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(-8, 8, (6, 40), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    scales = torch.rand(6, 2, generator=torch.Generator().manual_seed(3)).half()
    tensors = {"m.weight_packed": pack_to_int32(q, 4), "m.weight_scale": scales,
               "m.weight_shape": torch.tensor([6, 40])}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = _Reader(dict.fromkeys(tensors, tmp_path / "model.safetensors"))
    [(_, w)] = read_int4(reader, "m.weight", Int4Layout("compressed-tensors", 32, True), None, torch.float32,
                         torch.device("cpu"))
    assert w.q4_0 and torch.equal(w.dequantize(), q.float() * scales.float().repeat_interleave(32, 1)[:, :40])


def _reference(ref: dict[str, torch.Tensor], path: Path, out: Path):
    """transformers' model on the reference weights (``kv_b_proj`` rounded to bfloat16, as the runtime keeps it beside
    int4 products), loaded from a float checkpoint of them."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    quantization_tensors = ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape", "weight_packed")
    state = {n: (t.to(torch.bfloat16).float() if n.endswith("kv_b_proj.weight") else t).contiguous()
             for n, t in ref.items() if not n.endswith(quantization_tensors)}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.mark.parametrize("layout, family", [("awq", "v3"), ("gptq_act_order", "v2"), ("ct_asym_g128", "v3"),
                                            ("gptq_v2_sym_g64", "v2")])
@pytest.mark.parametrize("cpu_gemm", ["plain", "auto"])
def test_greedy_tokens_follow_transformers_on_the_dequantised_weights(written, layout, family, cpu_gemm, tmp_path):
    """The stored checkpoint through ``LLM`` decodes as transformers does on the weights it stands for: with the
    widened products (``cpu_gemm=plain``: float32 activations) the same greedy tokens; with the int4 kernels
    (``auto``, which round their input rows to int8 per group of 32) every token transformers' best but for that
    rounding (its logit within 0.25 of the best, teacher-forced on the tokens decoded; about 0.1 moves a logit here).
    The kernels' run routes every token to every expert: a top-k choice near a tie flips with any rounding, and one
    flipped expert moves a logit by whole units, whatever computes the products."""
    if cpu_gemm == "auto":
        family += "_all"
    path, ref = written(layout, family)
    prompt = [5, 9, 2, 7, 11, 3, 40, 17]
    llm = LLM(str(path), dtype="float32", cpu_gemm=cpu_gemm, kv_cache_memory="8MiB")
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0.0,
                                                                      ignore_eos=True))[0].outputs[0].token_ids
    with torch.no_grad():
        logits = _reference(ref, path, tmp_path / "reference")(torch.tensor([prompt + list(got)])).logits[0]
    steps = logits[len(prompt) - 1: -1]
    if cpu_gemm == "plain":
        assert list(got) == steps.argmax(-1).tolist()
    else:
        chosen = steps.gather(-1, torch.tensor(got).unsqueeze(-1)).squeeze(-1)
        assert ((steps.amax(-1) - chosen) <= 0.25).all(), (steps.amax(-1) - chosen)


# -- slices and refusals --------------------------------------------------------------------------------------------
def test_a_ranks_slice_cuts_at_group_boundaries(written):
    """A row-parallel rank's columns are whole groups of the matrix (the reference's columns); a slice that would
    split a group, or cut an act-order matrix's columns, is refused by name."""
    path, ref = written("awq")
    layout = ModelConfig.from_pretrained(path).stored_layout
    reader = _Reader(checkpoint_files(path))
    name = "model.layers.0.mlp.down_proj.weight"  # the dense MLP: 256 inputs, two groups
    k = ref[name].shape[1]
    [(_, part)] = read_int4(reader, name, layout, (1, 0, k // 2, k), torch.float32, torch.device("cpu"))
    assert torch.equal(part.dequantize(), ref[name][:, :k // 2])
    [(_, rows)] = read_int4(reader, name, layout, (0, 8, 24, ref[name].shape[0]), torch.float32, torch.device("cpu"))
    assert torch.equal(rows.dequantize(), ref[name][8:24])
    with pytest.raises(ValueError, match="split groups of 128"):
        list(read_int4(reader, name, layout, (1, 0, 64, k), torch.float32, torch.device("cpu")))
    act, _ = written("gptq_act_order")
    act_layout = ModelConfig.from_pretrained(act).stored_layout
    with pytest.raises(ValueError, match="act-order"):
        list(read_int4(_Reader(checkpoint_files(act)), "model.layers.1.self_attn.o_proj.weight", act_layout,
                       (1, 0, 64, 128), torch.float32, torch.device("cpu")))


def test_tensor_parallel_ranks_take_whole_groups(written):
    """A rank loads its part of each stored matrix (a row-parallel ``o_proj``: its columns, whole groups of 64) as
    stored; a ``tensor_parallel_size`` whose slices would split groups of 128 is refused, naming the matrices, before
    any weight is read."""
    path, ref = written("gptq_v2_sym_g64", "v2")
    model = load_model(path, dtype="float32", par=ParallelContext(1, 2, "replicated"))
    o_proj = model.model.layers[0].self_attn.o_proj.packed
    assert isinstance(o_proj, Int4Weight) and o_proj.group == 64
    assert torch.equal(o_proj.dequantize(), ref["model.layers.0.self_attn.o_proj.weight"][:, 64:])
    awq, _ = written("awq")
    with pytest.raises(CheckpointError, match="o_proj.weight: this rank's columns \\[64, 128\\) of 128 split "
                                              "groups of 128"):
        load_model(awq, dtype="float32", par=ParallelContext(1, 2, "replicated"))


@pytest.mark.parametrize("config, says", [
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, "bits=8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 256, "version": "gemm"}, "group_size=256"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point=false"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size=-1"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format='marlin'"),
])
def test_an_unsupported_awq_or_gptq_config_is_refused_by_name(config, says, tmp_path):
    with pytest.raises(UnsupportedScheme, match=says):
        parse_awq_gptq_config(config)
    raw = json.loads((float_source(tmp_path / "src", "v2") / "config.json").read_text())
    raw["quantization_config"] = config
    (tmp_path / "src" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedScheme, match=says):  # at the config, before any weight is read
        ModelConfig.from_pretrained(tmp_path / "src")


def test_groups_a_g_idx_cannot_make_contiguous_are_refused(written, tmp_path):
    path, _ = written("gptq_act_order")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.g_idx"
    g_idx = tensors[name].clone()
    g_idx[0] = g_idx[1] if g_idx[1] != g_idx[0] else g_idx[2]  # one group one input short, another one over
    tensors[name] = g_idx
    (tmp_path / "bad").mkdir()
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "bad" / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises((ValueError, CheckpointError), match="o_proj.g_idx: its groups do not each hold 32 inputs"):
        load_model(tmp_path / "bad", dtype="float32")


# -- the runtime's own W4A16 ----------------------------------------------------------------------------------------
def test_w4a16_takes_the_librarys_scales_and_zero_points():
    """The W4A16 rule's zero points are compressed-tensors' own (``calculate_qparams`` on the groups' min and max) and
    its scales are the library's rounded to float16; the values it gives lie within half a step of the weights. A
    matrix whose K is not a multiple of 128 takes Q4_0's groups of 32."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams

    g = torch.Generator().manual_seed(4)
    w = torch.randn(24, 384, generator=g) * torch.rand(24, 1, generator=g)
    w[0, :128] = 0.0  # a group of zeros
    w[1, 128:256] = w[1, 128:256].abs() + 0.5  # a group above 0: its range widened to hold 0
    q, scales, zeros = quantize_w4a16(w)
    groups = w.view(24, 3, 128)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=128)
    lib_scales, lib_zeros = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    assert torch.equal(zeros[1:].long() - 8, lib_zeros[1:].long()) and torch.equal(scales[1:], lib_scales[1:].half())
    weight = W4A16Weight.quantize(w)
    assert weight.scheme == "w4a16" and weight.group == 128 and weight.zeros is not None
    deq = weight.dequantize()
    assert torch.equal(deq, (q.float() - zeros.float().repeat_interleave(128, 1)) * scales.float().repeat_interleave(
        128, 1))
    assert not deq[0, :128].any()
    assert ((deq - w).abs() <= scales.float().repeat_interleave(128, 1) * 0.5 + 1e-6).all()
    assert weight.nbytes == W4A16Weight.stored_bytes(24, 384) == layout_bytes(24, 384, 128, True)
    odd = torch.randn(5, 96, generator=g)
    assert W4A16Weight.quantize(odd).q4_0 and torch.equal(W4A16Weight.quantize(odd).dequantize(),
                                                          Int4Weight.quantize(odd).dequantize())


@pytest.fixture(scope="module")
def w4a16_written(tmp_path_factory):
    """A float checkpoint and its W4A16 copy written by ``mla-runtime quantize --quantization w4a16``."""
    src = float_source(tmp_path_factory.mktemp("w4a16_src"), "v3")
    out = tmp_path_factory.mktemp("w4a16") / "copy"
    assert quantize_main(["--model", str(src), "--quantization", "w4a16", "--out", str(out)]) == 0
    return src, out


def _written_reference(out: Path) -> dict[str, torch.Tensor]:
    """The copy's tensors, each stored matrix unpacked by the library's own helpers (``scale * (q - zero)``)."""
    stored: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        stored.update(load_file(str(f)))
    ref = {n: t.float() for n, t in stored.items()}
    for name in [n for n in stored if n.endswith(".weight_packed")]:
        ref[name[: -len("_packed")]] = _library_dequantized(stored, name[: -len("weight_packed")], 128)
    return ref


def test_a_written_w4a16_copy_loads_as_stored_with_the_weights_of_quantising_while_loading(w4a16_written):
    src, out = w4a16_written
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = q["config_groups"]["group_0"]["weights"]
    assert q["format"] == "pack-quantized" and (weights["symmetric"], weights["group_size"]) == (False, 128)
    cfg = ModelConfig.from_pretrained(out)
    assert cfg.stored_quantization == "int4" and cfg.stored_layout == Int4Layout("compressed-tensors", 128, False)
    stored = load_model(out, dtype="float32")
    # the library's own unpacking of the copy gives what the loader holds
    assert _assert_loaded_as_written(stored, _written_reference(out), float_head=False) > 10
    at_load = load_model(src, dtype="float32", quantization="w4a16")
    finish_quantization(stored, "int4")
    finish_quantization(at_load, "w4a16")
    a, b = quantized_weights(stored), quantized_weights(at_load)
    assert len(a) == len(b) > 10 and {(w.group, w.zeros is not None) for w in a} == {(128, True)}
    assert all(torch.equal(x.dequantize(), y.dequantize()) for x, y in zip(a, b))
    assert weight_footprint(ModelConfig.from_pretrained(src), "float32", 1, "w4a16").quantized_bytes == \
        sum(w.nbytes for w in b)


def test_a_written_w4a16_copy_gives_transformers_tokens_on_its_weights(w4a16_written, tmp_path):
    """With the widened products (float32 rows) the copy's greedy tokens are transformers' on the weights it stores."""
    _, out = w4a16_written
    prompt = [5, 9, 2, 7, 11, 3, 40, 17]
    llm = LLM(str(out), dtype="float32", cpu_gemm="plain", kv_cache_memory="8MiB")
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0.0,
                                                                      ignore_eos=True))[0].outputs[0].token_ids
    reference = _reference(_written_reference(out), out, tmp_path / "reference")
    want = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert list(got) == want[0, len(prompt):].tolist()
