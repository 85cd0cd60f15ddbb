"""W8A8 int8 (``layers.w8a8``): int8 weights with a float32 scale per output row, the input rows rounded to int8 per
token when each product runs. The compiled kernel against its exact integer reference, in every variant this CPU
runs and in a process capped at AVX2; checkpoints in compressed-tensors' W8A8 layout (written through the library's
compressor, and through its own model API) and in SGLang's ``w8a8_int8`` layout, loaded as stored; greedy tokens
against transformers run on the dequantised weights with its activations rounded per token the same way."""

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
from safetensors.torch import save_file

from mla_kernels import cpu_kernels, cpu_ops, cpu_tables
from mla_kernels.w8a8_format import int_products, quantize_rows_int8, row_amax, w8a8_product
from mla_runtime import LLM, SamplingParams
from mla_runtime.compressed import main as quantize_main
from mla_runtime.config import ModelConfig, UnsupportedScheme, parse_quantization_config
from mla_runtime.footprint import weight_footprint
from mla_runtime.kernel_plan import kernel_plan
from mla_runtime.layers.quantization import finish_quantization, quantized_weights
from mla_runtime.layers.w8a8 import W8A8Weight, quantize_w8a8
from mla_runtime.loader import load_model
from mla_runtime.parallel import ParallelContext
from tests.checkpoints import build_hf_model
from tests.layer_kernel import decode_in_layer_kernel

needs_kernel = pytest.mark.skipif(cpu_kernels.failure("w8a8") is not None,
                                  reason=f"the W8A8 kernel does not run here: {cpu_kernels.failure('w8a8')}")
PROMPTS = [[5, 9, 2, 7, 11], list(range(3, 40)), [17, 4]]
NEW_TOKENS = 8


def exact_reference(x: torch.Tensor, q: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """The product written out: rows rounded per row to int8 (amax / 127, half to even), int64 sums (exact), then
    float32(sum) * sx * sw."""
    rows = x.float()
    sx = rows.abs().amax(1) / 127
    xq = torch.where(sx[:, None] > 0, rows / sx[:, None], torch.zeros(())).round().long()
    sums = xq @ q.long().T
    assert sums.abs().max() < 2**31  # the sums fit int32, where the kernel's are exact
    return sums.to(torch.int32).float() * sx[:, None] * sw[None, :]


def test_the_torch_product_equals_the_exact_integer_reference():
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 7, 3), (5, 33, 130), (70, 9, 1024), (3, 4, 4096)):
        x = torch.randn(m, k, generator=g) * 4
        x[0, : k // 2] = 0.0
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        sw = torch.rand(n, generator=g)
        assert torch.equal(w8a8_product(x, q, sw), exact_reference(x, q, sw))
    # half-way values round to even, as torch.round does: rows scaled to amax 127 hold x.5 values
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5]])
    xq, sx = quantize_rows_int8(x)
    assert sx.tolist() == [1.0] and xq.tolist() == [[127, 0, 2, 2, 0, -2]]
    xq, sx = quantize_rows_int8(torch.zeros(2, 5))  # a zero row: zeros, scale 0, and a product of zeros
    assert not xq.any() and not sx.any()


@needs_kernel
@pytest.mark.parametrize("variant", cpu_kernels.variants("w8a8") if cpu_kernels.failure("w8a8") is None else ())
def test_the_kernel_equals_the_exact_reference_bit_for_bit_in_every_variant(variant):
    """Row and column tails, 1 to 150 rows (past one pass of 64), sums past 2^24, a zero row; and a row's result is
    the same bits alone as beside any other rows. The AMX variant takes its tiles from 8 rows: partial tiles of
    weight rows and of input rows, one weight block or an odd count of them, K past its last 64 values."""
    g = torch.Generator().manual_seed(1)
    for m, n, k in ((1, 37, 77), (4, 64, 64), (9, 70, 513), (150, 11, 96), (2, 5, 3000), (40, 100, 1408),
                    (17, 16, 64), (33, 48, 200)):
        x = torch.randn(m, k, generator=g) * 2
        x[-1] = 0.0
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        sw = torch.rand(n, generator=g) + 0.1
        got = cpu_kernels.ops().w8a8_linear(x, q, sw, variant)
        assert torch.equal(got, exact_reference(x, q, sw)), (m, n, k)
        for i in (0, m // 2):
            assert torch.equal(cpu_kernels.ops().w8a8_linear(x[i:i + 1], q, sw, variant), got[i:i + 1])
    halves = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * 5).repeat(9, 1)  # to even, as torch rounds
    q = torch.randint(-128, 128, (20, 40), generator=g, dtype=torch.int8)
    assert torch.equal(cpu_kernels.ops().w8a8_linear(halves, q, torch.ones(20), variant),
                       exact_reference(halves, q, torch.ones(20)))
    big = torch.full((3, 2048), 127, dtype=torch.int8)  # 2048 * 127 * 127 > 2^24: float32 sums would round
    x = torch.full((2, 2048), 0.75)
    assert torch.equal(cpu_kernels.ops().w8a8_linear(x, big, torch.ones(3), variant),
                       exact_reference(x, big, torch.ones(3)))


def test_slices_rounded_with_the_whole_rows_amax_sum_to_one_ranks_integers():
    """A row-parallel product split over two ranks (each a slice of ``K``): rounded with the rows' shared amax, the
    slices' integers are the whole row's, so their int32 sums add up to one rank's exactly; the kernel takes the
    given amax as the torch product does, bit for bit."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, 256, generator=g) * 3
    x[:, 100] = 40.0  # the largest value of every row lies in the first slice
    x[-1] = 0.0
    q = torch.randint(-128, 128, (21, 256), generator=g, dtype=torch.int8)
    sw = torch.rand(21, generator=g) + 0.1
    whole, sx = quantize_rows_int8(x)
    amax = torch.maximum(row_amax(x[:, :128]), row_amax(x[:, 128:]))  # what the ranks' MAX all-reduce gives
    parts = [quantize_rows_int8(x[:, a:a + 128], amax) for a in (0, 128)]
    assert torch.equal(torch.cat([parts[0][0], parts[1][0]], dim=1), whole)
    assert all(torch.equal(s, sx) for _, s in parts)
    assert not torch.equal(quantize_rows_int8(x[:, 128:])[0], whole[:, 128:])  # its own amax rounds otherwise
    assert torch.equal(int_products(parts[0][0], q[:, :128]) + int_products(parts[1][0], q[:, 128:]),
                       int_products(whole, q))
    if cpu_kernels.failure("w8a8") is None:
        for a in (0, 128):
            part = q[:, a:a + 128].contiguous()
            assert torch.equal(cpu_kernels.w8a8_linear(x[:, a:a + 128], part, sw, row_amax=amax),
                               w8a8_product(x[:, a:a + 128], part, sw, amax))


@needs_kernel
def test_the_operator_refuses_what_its_tensors_do_not_hold():
    ops = cpu_kernels.ops()
    q, sw = torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)
    with pytest.raises(ValueError, match="the weight must be a contiguous CPU Char tensor"):
        ops.w8a8_linear(torch.ones(2, 9), q, sw)
    with pytest.raises(ValueError, match="the row scales"):
        ops.w8a8_linear(torch.ones(2, 8), q, sw.double())
    with pytest.raises(ValueError, match="unknown variant 'sse'"):
        ops.w8a8_linear(torch.ones(2, 8), q, sw, "sse")
    with pytest.raises(ValueError, match="the rows' amax"):
        ops.w8a8_linear(torch.ones(2, 8), q, sw, "auto", torch.ones(3))


def test_the_weight_takes_the_kernel_or_torch_with_the_same_bits():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 200, generator=g)
    weight = W8A8Weight.quantize(w)
    q, s = quantize_w8a8(w)
    assert torch.equal(weight.dequantize(), q.float() * s[:, None])
    assert ((weight.dequantize() - w).abs() <= s[:, None] / 2 + 1e-6).all()
    x, bias = torch.randn(3, 6, 200, generator=g), torch.randn(40, generator=g)
    want = (exact_reference(x.reshape(-1, 200), q, s) + bias).reshape(3, 6, 40)
    for mode in ("auto", "plain"):
        weight.bind(kernel_plan(mode))
        assert weight.kernel == (mode == "auto" and cpu_kernels.failure("w8a8") is None)
        assert torch.equal(weight.matmul(x, bias), want)
    both = W8A8Weight.cat([weight, weight.select_rows(torch.tensor([3, 1]))])
    assert torch.equal(both.dequantize(), torch.cat([weight.dequantize(), weight.dequantize()[[3, 1]]]))
    assert weight.nbytes == W8A8Weight.stored_bytes(40, 200) == 40 * 200 + 4 * 40
    with pytest.raises(ValueError, match="an int8 matrix"):
        W8A8Weight(q.float(), s, torch.float32)
    with pytest.raises(ValueError, match="float scales"):
        W8A8Weight(q, s[:3], torch.float32)


def open_gates(rows: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(a gated MLP's gate_up ``[2 rows, d]``, an input row ``[1, d]``) whose gates come out above 104, where
    ``g / (1 + exp(-g))`` is ``g`` exactly in every exp: the MLP's output is its products' bits alone."""
    gate_up = torch.randn(2 * rows, d, generator=g) * 0.05
    gate_up[:rows, 0] = 5.0
    x = torch.randn(1, d, generator=g) * 30
    x[0, 0] = 100.0
    return gate_up, x


def _silu_mlp(gate_up: W8A8Weight, down: W8A8Weight, x: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.matmul(x, None).chunk(2, dim=-1)
    return down.matmul(gate / (1 + torch.exp(-gate)) * up, None)


@needs_kernel
def test_the_one_row_mlp_kernel_reads_w8a8_matrices_with_their_rounding():
    """A MoE layer's W8A8 experts go into the compiled one-row MLP kernel's table as stored (their row scales as
    ``[N, 1]``: each input row rounded to int8, not int8's int16) and give what their products give one by one: an
    expert alone the same bits. A row-parallel shard (its rows rounded with the ranks' amax), or a matrix where the plan
    leaves the W8A8 kernel out, has no operand."""
    g = torch.Generator().manual_seed(4)
    d, inter = 160, 96  # K not a multiple of the vector width: the tiles' scalar tails
    gate_ups = [open_gates(inter, d, g) for _ in range(3)]
    mlps = [(W8A8Weight.quantize(w), W8A8Weight.quantize(torch.randn(d, inter, generator=g) * 0.05))
            for w, _ in gate_ups]
    table = cpu_tables.GatedMLPTable([(a.row_operand(), b.row_operand()) for a, b in mlps])
    assert table.table.kinds() == ["w8a8"] * 6
    x = gate_ups[1][1]
    assert torch.equal(table(x, [1], [1.0]), _silu_mlp(*mlps[1], x))
    torch.testing.assert_close(table(x, [0, 2], [0.3, 0.7]),
                               _silu_mlp(*mlps[0], x) * 0.3 + _silu_mlp(*mlps[2], x) * 0.7, rtol=1e-5, atol=1e-7)
    gate_up, down = mlps[0]
    as_int8 = cpu_tables.GatedMLPTable([((gate_up.qweight, gate_up.scales), (down.qweight, down.scales))])
    assert as_int8.table.kinds() == ["int8", "int8"]  # the same tensors, scales [N]: int8's rounding
    with pytest.raises(ValueError, match="the W8A8 row scales must be a contiguous CPU Float tensor \\[192, 1\\]"):
        cpu_tables.GatedMLPTable([((gate_up.qweight, gate_up.scales.view(-1, 2)), down.row_operand())])
    down.shared_amax = lambda amax: amax  # a row-parallel shard: its rows rounded with the ranks' amax
    assert down.row_operand() is None
    gate_up.bind(dataclasses.replace(kernel_plan("auto"), w8a8_failure="left out"))
    assert gate_up.row_operand() is None
    gate_up.bind(kernel_plan("plain"))
    assert gate_up.row_operand() is None


# -- configurations ---------------------------------------------------------------------------------------------

def _ct_config(acts):
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    return {"quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


def test_a_w8a8_config_is_recognised_and_other_activation_schemes_are_refused_by_name():
    w8a8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    assert parse_quantization_config(_ct_config(w8a8)).quantization == "w8a8"
    for change, says in (({"dynamic": False}, "'dynamic': False"), ({"strategy": "tensor"}, "'strategy': 'tensor'"),
                         ({"symmetric": False}, "'symmetric': False"), ({"num_bits": 4}, "'num_bits': 4")):
        with pytest.raises(UnsupportedScheme, match=f"input_activations: .*{says}.*dynamic int8 per token"):
            parse_quantization_config(_ct_config({**w8a8, **change}))
    q = _ct_config(w8a8)
    q["config_groups"]["group_0"]["weights"].update(num_bits=4, strategy="group", group_size=32)
    q["format"] = "pack-quantized"
    with pytest.raises(UnsupportedScheme, match="with int4 weights is not supported"):
        parse_quantization_config(q)


# -- checkpoints --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def written(tiny_checkpoint, tmp_path_factory):
    """The tiny V3 checkpoint, its W8A8 copy written through compressed-tensors' compressor (``mla-runtime
    quantize``), and the same tensors in SGLang's ``w8a8_int8`` layout."""
    src, _ = tiny_checkpoint("v3")
    out = tmp_path_factory.mktemp("w8a8_ct")
    assert quantize_main(["--model", str(src), "--quantization", "w8a8", "--out", str(out)]) == 0
    sglang = tmp_path_factory.mktemp("w8a8_sglang")
    for f in out.iterdir():
        if f.suffix == ".safetensors":  # the same tensors, the scales in float32 as SGLang's checkpoints hold them
            with safe_open(str(f), "pt") as r:
                tensors = {k: r.get_tensor(k) for k in r.keys()}
            save_file({k: v.float() if k.endswith("weight_scale") else v for k, v in tensors.items()},
                      str(sglang / f.name), metadata={"format": "pt"})
        else:
            (sglang / f.name).write_bytes(f.read_bytes())
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "w8a8_int8", "activation_scheme": "dynamic"}
    (sglang / "config.json").write_text(json.dumps(raw))
    return src, out, sglang


def _stored_matrices(path: Path) -> dict[str, torch.Tensor]:
    """Every matrix stored as W8A8, dequantised: ``q * scale``, by checkpoint name."""
    found = {}
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as r:
            names = set(r.keys())
            for name in names:
                scale = name[: -len("weight")] + "weight_scale"
                if name.endswith(".weight") and scale in names:
                    found[name] = r.get_tensor(name).float() * r.get_tensor(scale).float()
    return found


def _fake_quantized(x: torch.Tensor) -> torch.Tensor:
    """A product's input as W8A8 sees it: each row rounded to int8 with its own scale, in float again."""
    rows = x.float().reshape(-1, x.shape[-1])
    sx = rows.abs().amax(1, keepdim=True) / 127
    xq = torch.where(sx > 0, rows / sx, torch.zeros(())).round()
    return (xq * sx).reshape(x.shape).to(x.dtype)


def reference_tokens(path: Path, variant: str = "v3") -> list[list[int]]:
    """transformers' greedy tokens with every matrix the checkpoint stores as W8A8 set to its dequantised values, the
    inputs of those products rounded per token (through ``F.linear``, which both its ``nn.Linear`` layers and its
    fused experts call), and ``kv_b_proj`` rounded to bfloat16 as the runtime holds it."""
    hf = build_hf_model(variant)
    hf.set_experts_implementation("eager")  # expert by expert through F.linear (the default: grouped products)
    stored = _stored_matrices(path)
    params = dict(hf.named_parameters())
    quantized: set[int] = set()
    with torch.no_grad():
        for name, w in stored.items():
            parts = name.split(".")
            if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
                i = parts.index("experts")
                e, proj = int(parts[i + 1]), parts[i + 2]
                prefix = ".".join(parts[: i + 1])
                fused = params[f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"]
                inter = fused.shape[1] // 2
                target = fused[e] if proj == "down_proj" else fused[e, :inter] if proj == "gate_proj" \
                    else fused[e, inter:]
                target.copy_(w)
                quantized.add(fused[e].data_ptr())
            else:
                params[name].copy_(w)
                quantized.add(params[name].data_ptr())
        for module_name, module in hf.named_modules():
            if module_name.endswith("kv_b_proj"):
                module.weight.copy_(module.weight.to(torch.bfloat16).float())
    assert len(quantized) > 10
    linear = torch.nn.functional.linear

    def w8a8_linear(x, weight, bias=None):  # type: ignore[no-untyped-def]
        return linear(_fake_quantized(x) if weight.data_ptr() in quantized else x, weight, bias)

    out = []
    torch.nn.functional.linear = w8a8_linear
    try:
        for prompt in PROMPTS:
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              min_new_tokens=NEW_TOKENS)
            out.append(ids[0, len(prompt):].tolist())
    finally:
        torch.nn.functional.linear = linear
    return out


def runtime_tokens(path: Path, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB", **kwargs)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    finally:
        llm.shutdown()


def test_both_layouts_load_as_stored(written):
    src, ct, sglang = written
    assert ModelConfig.from_pretrained(ct).stored_quantization == "w8a8"
    assert ModelConfig.from_pretrained(sglang).stored_quantization == "w8a8"
    stored = _stored_matrices(ct)
    for path in (ct, sglang):
        model = load_model(path, dtype="float32")
        attn = model.model.layers[0].self_attn
        o_proj = attn.o_proj.packed
        assert isinstance(o_proj, W8A8Weight)
        assert torch.equal(o_proj.dequantize(), stored["model.layers.0.self_attn.o_proj.weight"])
        experts = model.model.layers[1].mlp.experts
        assert all(isinstance(w, W8A8Weight) for w in experts.gate_up_packed + experts.down_packed)
        assert torch.equal(experts.down_packed[2].dequantize(), stored["model.layers.1.mlp.experts.2.down_proj.weight"])
    with pytest.raises(ValueError, match="stored quantised to w8a8"):
        LLM(str(ct), dtype="float32", quantization="int8", kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def written_reference(written):
    """transformers' greedy tokens on the written W8A8 copy (``reference_tokens``)."""
    return reference_tokens(written[1])


def test_greedy_tokens_equal_transformers_on_the_dequantised_model_with_rows_rounded_per_token(written,
                                                                                             written_reference):
    src, ct, sglang = written
    want = written_reference
    assert runtime_tokens(ct) == want
    assert runtime_tokens(sglang) == want
    assert runtime_tokens(ct, cpu_gemm="plain") == want  # torch's int8 products: the same bits


def test_two_ranks_give_one_ranks_tokens(written, written_reference):
    """Tensor parallel over two ranks: ``o_proj`` and the dense and shared ``down_proj`` hold half of ``K`` each and
    round their slices with the whole row's amax (the ranks' MAX), so the tokens are one rank's and transformers'."""
    assert runtime_tokens(written[1], tensor_parallel_size=2) == written_reference


def test_a_rank_quantising_its_columns_while_loading_takes_the_whole_rows_scales(written):
    """A float checkpoint quantised to W8A8 while loading under two ranks: each rank's columns of a row-parallel matrix
    (``o_proj``, the dense and shared ``down_proj``) are one rank's columns, their scales the whole rows'; a
    column-parallel one (``q_proj``'s rows) is one rank's rows."""
    src, _, _ = written
    one = load_model(src, dtype="float32", quantization="w8a8")
    for rank in (0, 1):
        part = load_model(src, dtype="float32", quantization="w8a8", par=ParallelContext(rank, 2))
        for i, owner in ((0, "mlp"), (1, "mlp.shared_experts")):
            got, want = part.get_submodule(f"model.layers.{i}.{owner}"), one.get_submodule(f"model.layers.{i}.{owner}")
            k = got.down_packed.shape[1]
            assert torch.equal(got.down_packed.scales, want.down_packed.scales)
            assert torch.equal(got.down_packed.qweight, want.down_packed.qweight[:, rank * k:(rank + 1) * k])
        got, want = part.model.layers[1].self_attn.o_proj.packed, one.model.layers[1].self_attn.o_proj.packed
        k = got.shape[1]
        assert torch.equal(got.dequantize(), want.dequantize()[:, rank * k:(rank + 1) * k])


@needs_kernel
def test_decode_steps_run_the_whole_layer_kernel_on_w8a8_matrices(written, monkeypatch):
    """Every layer of a W8A8 model decodes in the compiled whole-layer kernel (one call a layer, its matrices read as
    W8A8), and a batch's tokens are each prompt's tokens alone."""
    assert decode_in_layer_kernel(written[1], monkeypatch) == {"w8a8"}


def test_a_v2_checkpoint_gives_the_reference_tokens(tiny_checkpoint, tmp_path):
    """DeepSeek-V2 (group-limited routing, a Q-LoRA-less attention) written as W8A8 and served as stored."""
    src, _ = tiny_checkpoint("v2_group")
    assert quantize_main(["--model", str(src), "--quantization", "w8a8", "--out", str(tmp_path / "v2")]) == 0
    assert runtime_tokens(tmp_path / "v2") == reference_tokens(tmp_path / "v2", "v2_group")


_CAPPED = """
import json, sys, torch
from mla_kernels import cpu_kernels
from mla_kernels.w8a8_format import w8a8_product
from tests.test_w8a8 import runtime_tokens
g = torch.Generator().manual_seed(5)
x, q, s = torch.randn(70, 300, generator=g), torch.randint(-128, 128, (33, 300), generator=g, dtype=torch.int8), \\
    torch.rand(33, generator=g)
same = torch.equal(cpu_kernels.w8a8_linear(x, q, s), w8a8_product(x, q, s))
print(json.dumps({"variants": cpu_kernels.variants("int8"), "failure": cpu_kernels.failure("w8a8"), "same": same,
                  "tokens": runtime_tokens(sys.argv[1])}))
"""


@needs_kernel
def test_a_process_capped_at_avx2_gives_the_same_tokens(written):
    src, ct, _ = written
    env = {**os.environ, cpu_ops.ISA_ENV: "avx2", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", _CAPPED, str(ct)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["variants"] == ["avx2"] and said["failure"] is None and said["same"]
    assert said["tokens"] == runtime_tokens(ct)


def test_the_planner_counts_the_bytes_a_w8a8_model_holds(written):
    """``weight_footprint``'s quantised bytes are the loaded matrices' (a byte a value and a float32 scale a row), for a
    stored W8A8 checkpoint and for a float one quantised to W8A8 while loading."""
    src, ct, _ = written
    for path, quantization in ((ct, None), (src, "w8a8")):
        model = load_model(path, dtype="float32", quantization=quantization)
        finish_quantization(model, "w8a8")
        weights = quantized_weights(model)
        assert {w.scheme for w in weights} == {"w8a8"}
        planned = weight_footprint(ModelConfig.from_pretrained(path), "float32", 1, quantization)
        assert planned.format == "w8a8"
        assert planned.quantized_bytes == sum(w.nbytes for w in weights)
        assert planned.quantized_bytes == sum(w.shape.numel() + 4 * w.shape[0] for w in weights)


def test_a_checkpoint_written_through_the_librarys_model_api_loads_as_stored(tmp_path):
    """compressed-tensors' own W8A8 scheme applied to a transformers model (as llm-compressor saves one: per-channel
    absmax scales, the model compressed and saved): its config reads as ``w8a8`` and its matrices are the stored
    integers times the stored scales."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme

    model = build_hf_model("v3")
    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    config = QuantizationConfig(config_groups={"group_0": scheme},
                                ignore=["lm_head", "re:.*kv_b_proj$", "re:.*mlp\\.gate$"])
    apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.detach().float()
            module.weight_scale.data.copy_((w.abs().amax(1, keepdim=True) / 127).to(module.weight_scale.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    model.save_pretrained(tmp_path)
    compressor.update_config(tmp_path)
    acts = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert acts["input_activations"]["dynamic"] is True and acts["input_activations"]["strategy"] == "token"
    assert ModelConfig.from_pretrained(tmp_path).stored_quantization == "w8a8"
    loaded = load_model(tmp_path, dtype="float32")
    stored = _stored_matrices(tmp_path)
    assert len(stored) > 10
    o_proj = loaded.model.layers[1].self_attn.o_proj.packed
    assert isinstance(o_proj, W8A8Weight)
    assert torch.equal(o_proj.dequantize(), stored["model.layers.1.self_attn.o_proj.weight"])
    assert isinstance(loaded.model.layers[1].mlp.experts.down_packed[0], W8A8Weight)  # left float: quantised at load
