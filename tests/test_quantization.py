"""Weight-only int8 (``quantization="int8"``): the kernel, the model against float32, the flag, the planner."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mla_kernels import cpu_kernels
from mla_runtime import LLM, SamplingParams
from mla_runtime.config import ModelConfig
from mla_runtime.engine.config import EngineConfig
from mla_runtime.errors import InvalidParam
from mla_runtime.kernel_plan import kernel_plan
from mla_runtime.layers.bf16 import Bf16Weight
from mla_runtime.layers.mla import attention_layer
from mla_runtime.layers.quantization import WEIGHT_FORMATS, Int8Weight, quantize_model, quantized_weights
from mla_runtime.layers.qweight import stack_rows
from mla_runtime.loader import load_model
from mla_runtime.plan import parameter_count, quantized_parameters, weight_bytes
from mla_runtime.serving.config import resolve
from mla_runtime.sweep import SweepConfig, run_sweep
from tests.model_utils import PagedRunner

# |log p_int8 - log p_fp32| over every token of the vocabulary at every position of the tiny checkpoints, measured:
# median 0.009-0.010, largest 0.28-0.71 (a near-tie of the router picks another expert: MoE is discontinuous);
# top-1 agreement 93-96 %. A wrong scale, a transposed weight or a layer reading a released weight is off by
# 1 or more nearly everywhere.
MEDIAN_LOGPROB_ERROR = 0.03
MAX_LOGPROB_ERROR = 1.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 64), (7, 100)])
def test_int8_product_equals_its_dequantised_matrix(gemm_mode, plan, dtype, shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g)
    w[3, 5] = 40.0  # an outlier: only its own row's scale grows
    q = Int8Weight.quantize(w.to(dtype)).bind(plan)
    # the kernel mishandles inner dimensions that are not a multiple of 8 (wrong values or a crash on AVX2)
    assert q.kernel == (gemm_mode == "auto" and shape[1] % 64 == 0 and kernel_plan().int8_aten_failure is None)
    dq = q.dequantize()
    step = q.scales.unsqueeze(1)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() <= 127
    assert q.scales.dtype == torch.bfloat16  # exact: the scales are rounded up to bfloat16 values
    assert ((dq - w.to(dtype).float()).abs() <= step / 2 + 1e-6).all()  # nearest of the row's grid
    assert q.plain.shape == w.shape and q.plain.untyped_storage().nbytes() <= 4  # the float weight is released
    bias = torch.randn(shape[0], generator=g).to(dtype)
    for rows in ((1,), (3,), (2, 3), (0,)):
        x = torch.randn(*rows, shape[1], generator=g).to(dtype)
        got = q.matmul(x, bias)
        ref = torch.nn.functional.linear(x.float(), dq, bias.float())
        assert got.dtype == dtype and got.shape == (*rows, shape[0])
        compiled = q.row_scales is not None and x.numel() > 0  # the compiled kernels: float32 rows
        tol = 2e-2 if (q.kernel and not compiled) or dtype != torch.float32 else 3e-4  # ATen's: bfloat16 rows
        # (the compiled kernels: int16 rows, within 2^-14 of each row's largest value)
        scale = ref.abs().max().item() if ref.numel() else 1.0
        torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("mode", ["auto", "onednn"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 130])
def test_int8_products_with_and_without_the_row_kernels(mode, rows):
    """Where the compiled kernels build, auto runs every int8 product through them, 64 rows a pass (each row rounded
    to int16 with a power-of-two scale); onednn (and a CPU without the kernels) keep ATen's kernel (bfloat16 rows)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=g)
    q = Int8Weight.quantize(w).bind(kernel_plan(mode))
    assert (q.row_scales is not None) == (mode == "auto" and cpu_kernels.failure() is None)
    x, bias = torch.randn(rows, 128, generator=g), torch.randn(96, generator=g)
    ref = torch.nn.functional.linear(x, q.dequantize(), bias)
    kernels = q.row_scales is not None
    tol = 3e-4 if kernels else 2e-2  # the kernels: rows rounded to int16; ATen's kernel: to bfloat16
    torch.testing.assert_close(q.matmul(x, bias), ref, rtol=tol, atol=tol * ref.abs().max().item())
    if kernels and q.row_scales is not None:
        want = x @ q.dequantize().T
        torch.testing.assert_close(cpu_kernels.linear(x, q.qweight, q.row_scales), want, rtol=tol,
                                   atol=tol * want.abs().max().item())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_rows_product_is_the_same_bits_whatever_rows_share_it(scheme, gemm_mode, plan):
    """Batch invariance of the quantised products: each format takes one route whatever the rows, so where that is
    the compiled kernels (their integer sums) or, for int8, ATen's int8 kernel, a row's result alone, in a decode batch
    of a few rows or in a long prefill (more rows than any threshold) is the same bits. The widened fallback (a
    float32 product, ``cpu_gemm=plain``) agrees to float rounding."""
    g = torch.Generator().manual_seed(3)
    w = WEIGHT_FORMATS[scheme].quantize(torch.randn(80, 128, generator=g)).bind(plan)
    x = torch.randn(200, 128, generator=g)
    many = w.matmul(x, None)
    exact = w.kernel or getattr(w, "row_scales", None) is not None
    assert exact == (gemm_mode != "plain" and (plan.integer_kernels(scheme) or scheme == "int8"))
    for rows in (slice(7, 8), slice(3, 9), slice(0, 130)):
        got = w.matmul(x[rows].clone(), None)
        if exact:
            assert torch.equal(got, many[rows])
        else:
            torch.testing.assert_close(got, many[rows], rtol=1e-5, atol=1e-5 * many.abs().max().item())


def test_int8_kernel_probe_in_both_states(gemm_mode, plan):
    failure = plan.int8_aten_failure
    if gemm_mode == "plain":
        assert failure == "cpu_gemm=plain forces the fallback"
    assert Int8Weight.quantize(torch.randn(8, 128)).bind(plan).kernel == (failure is None)  # falls back cleanly


def _logprobs(model, prompts: list[list[int]], decodes: int) -> torch.Tensor:
    """Log-probs of every position: the prompts as one prefill step, then ``decodes`` decode steps each."""
    runner = PagedRunner(model, len(prompts), max(map(len, prompts)) + decodes + 1)
    out = [torch.cat(runner.prefill(prompts))]
    for k in range(decodes):
        step = runner.step({i: [(7 * k + 3 * i) % 200 + 2] for i in range(len(prompts))})
        out.append(torch.cat([step[i] for i in range(len(prompts))]))
    return torch.cat(out).float().log_softmax(-1)


@pytest.mark.parametrize("variant", ["v3", "v3_noq_halfsplit", "v2_group"])
def test_int8_model_close_to_float32(tiny_checkpoint, variant):
    """Teacher-forced log-probabilities through the real paths (prefill, then absorbed decodes): every
    quantised layer kind (stacked q_a/kv_a or q_proj, experts, dense MLP, shared experts, tied and untied
    lm_head; the compiled decode kernel's bfloat16 absorbed factors) within the bound, and the int8 weights are what
    the planner counts."""
    path, _ = tiny_checkpoint(variant)
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (21, 40, 9)]
    ref = _logprobs(load_model(path, dtype="float32"), prompts, decodes=4)
    model = load_model(path, dtype="float32")
    held = quantize_model(model, "int8")
    got = _logprobs(model, prompts, decodes=4)
    err = (got - ref).abs()
    assert 0 < err.median().item() <= MEDIAN_LOGPROB_ERROR  # quantised (not exact), and close
    assert err.max().item() <= MAX_LOGPROB_ERROR
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85
    bf16_factors = kernel_plan().row_kernels  # the compiled decode kernel reads bfloat16 copies
    for attn in model.attention_layers():
        assert attn.w_uk.dtype == attn.w_uv_t.dtype == (torch.bfloat16 if bf16_factors else torch.float32)
        # the prefill's up-projection: the float32 factors' own products, whatever the CPU
        assert not isinstance(attn.kv_b_proj.packed, Bf16Weight)
        assert attn.kv_b_proj.weight.dtype == torch.float32  # the prefill's up-projection stays exact
    cfg = ModelConfig.from_pretrained(path)
    weights = quantized_weights(model)
    elements, (rows, _) = quantized_parameters(cfg)
    assert sum(w.qweight.numel() for w in weights) == elements
    assert sum(w.scales.numel() for w in weights) == rows
    assert held == elements + 2 * rows  # a bfloat16 scale per output row
    # no device: the float weights, the quantised ones and the absorbed factors' copies counted in float32
    absorbed = sum(a.w_uk.numel() + a.w_uv_t.numel() for a in model.attention_layers())
    assert weight_bytes(cfg, "float32", 1, "int8") == (parameter_count(cfg) - elements + absorbed) * 4 + held + (
        rows_tied := (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)) * 4
    assert weight_bytes(cfg, "float32", 1, "int8") < weight_bytes(cfg, "float32") / 2 + rows_tied * 4


@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_a_long_prefill_chunk_attends_in_bfloat16_where_the_key_rebuild_does(tiny_checkpoint, scheme, monkeypatch):
    """A float32 model with bfloat16 weights (what ``dtype="auto"`` runs a bfloat16 checkpoint as) rebuilds its keys
    and values with oneDNN's bfloat16 products where the CPU has them, the rows rounded to bfloat16; a prefill chunk of
    more rows than the few-row kernels take then attends in bfloat16 (``attention.cpu.half_prefill``) and a shorter one
    in float32. An int8 model's factors stay float32, and its chunks attend in float32. The log-probabilities stay
    within the quantisation bounds of the float32 model's."""
    from mla_runtime.attention import cpu

    path, _ = tiny_checkpoint("v3")
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (21, 40)]
    ref = _logprobs(load_model(path, dtype="float32"), prompts, decodes=2)
    model = load_model(path, dtype="float32")
    quantize_model(model, scheme)
    attn = model.attention_layers()[0]
    native = scheme == "bf16" and kernel_plan().bf16_products
    assert (isinstance(attn.kv_b_proj.packed, Bf16Weight) and attn.kv_b_proj.packed.native is not None) == native
    few = cpu_kernels.max_rows(torch.bfloat16) or 8
    for rows, half in ((few + 1, native), (few, False)):
        assert cpu.half_prefill(attention_layer(attn, model.plan), torch.zeros(rows, attn.n_h, attn.d_n)) == (
            torch.bfloat16 if half else None)
    seen: list[torch.dtype] = []
    original = cpu.CpuBackend.up_projected
    monkeypatch.setattr(cpu.CpuBackend, "up_projected",
                        lambda self, q_n, *a: seen.append(q_n.dtype) or original(self, q_n, *a))
    got = _logprobs(model, prompts, decodes=2)
    assert seen and set(seen) == {torch.bfloat16 if native else torch.float32}  # every layer's prefill attention
    err = (got - ref).abs()
    assert 0 < err.median().item() <= MEDIAN_LOGPROB_ERROR and err.max().item() <= MAX_LOGPROB_ERROR
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85


def test_a_bf16_weight_mlp_computes_many_rows_in_bfloat16_where_its_products_round_them(monkeypatch):
    """A float32 gated MLP with bfloat16 weights: where its products round a prefill's rows to bfloat16 (oneDNN's
    native bfloat16 products), the activation and the down product take the bfloat16 output as it is, and the MLP
    gives float32; a few rows (the compiled kernels' float32 products) stay float32 throughout."""
    from mla_runtime.layers.bf16 import half_mlp
    from mla_runtime.layers.mlp import GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(64, 96, torch.float32)
    mlp.gate_up_proj.data.normal_(0, 0.1)
    mlp.down_proj.data.normal_(0, 0.1)
    mlp.gate_up_packed, mlp.down_packed = Bf16Weight.quantize(mlp.gate_up_proj), Bf16Weight.quantize(mlp.down_proj)
    native = kernel_plan().choice(torch.bfloat16).path == "onednn"
    # the rows the compiled kernels take (none where the cpu_gemm plan leaves them out)
    few = cpu_kernels.max_rows(torch.bfloat16) if kernel_plan().half_kernel(torch.bfloat16) else 0
    seen: list[torch.dtype] = []
    original = Bf16Weight.matmul
    monkeypatch.setattr(Bf16Weight, "matmul", lambda self, x, b: seen.append(x.dtype) or original(self, x, b))
    x = torch.randn(few + 5, 64)
    assert half_mlp(mlp.gate_up_packed, x) == native
    out = mlp(x)
    assert out.dtype == torch.float32 and seen == [torch.bfloat16 if native else torch.float32] * 2
    # the reference rounds like the path taken: bfloat16 rows through bfloat16 products, else float32 rows over the
    # bfloat16 weights' values (a cpu_gemm plan without native bfloat16 products, or a CPU without them)
    compute = torch.bfloat16 if native else torch.float32
    w_gu, w_d = (w.bfloat16().to(compute) for w in (mlp.gate_up_proj, mlp.down_proj))
    gate, up = torch.nn.functional.linear(x.to(compute), w_gu).chunk(2, dim=-1)
    ref = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_d).float()
    assert torch.allclose(out, ref, rtol=2e-2, atol=2e-3)
    if few:  # the few-row products: the compiled kernels, in float32
        seen.clear()
        assert not half_mlp(mlp.gate_up_packed, x[:few]) and mlp(x[:few]).dtype == torch.float32
        assert seen == [torch.float32] * 2


def _generate(path, quantization: str | None, tensor_parallel_size: int = 1) -> list:
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [random.Random(i).randrange(2, 256) for _ in range(12 + 5 * i)]}
               for i in range(3)]
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory="2MiB", block_size=32,
              quantization=quantization, tensor_parallel_size=tensor_parallel_size)
    try:
        outs = llm.generate(prompts, sp)
        llm.engine.pool.check_whole()
        assert llm.engine.worker.quantized == (quantization == "int8")
        return outs
    finally:
        llm.shutdown()


def _assert_close_to_float32(reference: list, quantized: list) -> None:
    diffs = []
    for ref, got in zip(reference, quantized):
        r, g = ref.outputs[0], got.outputs[0]
        assert g.token_ids[0] == r.token_ids[0]  # greedy: the first token at least agrees
        for k, (a, b) in enumerate(zip(r.token_ids, g.token_ids)):
            if a != b:
                break
            diffs.append(abs(r.logprobs[k][a] - g.logprobs[k][b]))
    assert 0 < max(diffs) <= MAX_LOGPROB_ERROR and sorted(diffs)[len(diffs) // 2] <= MEDIAN_LOGPROB_ERROR


def test_llm_int8_generates_and_releases_every_block(tiny_checkpoint, gemm_mode):
    path, _ = tiny_checkpoint("v3")
    _assert_close_to_float32(_generate(path, None), _generate(path, "int8"))


def test_int8_under_two_ranks(tiny_checkpoint):
    """Each rank quantises its own shard (row-parallel shards: scales over their share of K)."""
    path, _ = tiny_checkpoint("v3")
    _assert_close_to_float32(_generate(path, None), _generate(path, "int8", tensor_parallel_size=2))


@pytest.mark.parametrize("value", ["int2", "INT8", 8, ""])
def test_quantization_flag_rejects_bad_values(value):
    with pytest.raises(InvalidParam) as e:
        EngineConfig(model="m", quantization=value)
    assert e.value.param == "quantization" and "quantization" in str(e.value)


def test_quantization_flag_and_yaml_reach_the_engine(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("v3")
    assert EngineConfig(model="m", quantization="none").quantization is None
    engine, _ = resolve(["--model", str(path), "--quantization", "int8"], env={})
    assert engine.quantization == "int8"
    yaml = tmp_path / "serve.yaml"
    yaml.write_text(f"model:\n  path: {path}\n  quantization: int8\n")
    assert resolve(["--config", str(yaml)], env={})[0].quantization == "int8"
    with pytest.raises(ValueError, match="quantization"):
        resolve(["--model", str(path), "--quantization", "fp4"], env={})


def test_sweep_has_a_weight_precision_axis(tiny_checkpoint):
    path, _ = tiny_checkpoint("v3")
    rng = random.Random(3)
    doc = [rng.randrange(2, 256) for _ in range(70)]
    cfg = SweepConfig(ranks=(32,), cache_dtypes=("fp32",), methods=("svd",), weights=("none", "int8", "int4"),
                      dtype="float32", block_size=16, window=32, chunk=16, decode_steps=0)
    rows = {(r.weights, r.method): r for r in run_sweep(path, [doc], None, cfg).rows}
    assert sorted(rows) == [("int4", "full"), ("int4", "svd"), ("int8", "full"), ("int8", "svd"), ("none", "full"),
                            ("none", "svd")]
    assert rows["none", "full"].kl_div == 0 and rows["int8", "full"].kl_div > 0  # the reference is unquantised
    assert rows["int8", "full"].perplexity == pytest.approx(rows["none", "full"].perplexity, rel=0.05)
    assert rows["int4", "full"].kl_div > rows["int8", "full"].kl_div  # 4 bits are coarser than 8
    with pytest.raises(InvalidParam, match="quantization"):
        SweepConfig(weights=("int2",))


@pytest.mark.skipif(cpu_kernels.failure() is not None,
                    reason=f"the compiled kernels do not build here: {cpu_kernels.failure()}")
def test_one_row_int8_kernel_rounds_the_row_to_int16():
    """One row is rounded to int16 with a power-of-two step (the largest value maps to at most 16383): each product
    is off by at most half a step per weight, and rows of small integers lose nothing but float rounding."""
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (64, 4096 + 24), generator=g, dtype=torch.int8)  # past one int32 chunk, with a tail
    scales = torch.rand(64, generator=g) + 0.5
    x = torch.randn(1, q.shape[1], generator=g) * 7
    step = 2.0 ** math.ceil(math.log2(x.abs().max().item() / 16383))
    exact = (x.double() @ q.double().T) * scales.double()
    bound = 0.5 * step * (q.double().abs().sum(1) * scales.double()) + 1e-5 * exact.abs().max()
    assert ((cpu_kernels.linear(x, q, scales).double() - exact).abs() <= bound).all()
    ints = torch.randint(-300, 301, (1, q.shape[1]), generator=g).float()  # exact in int16: only float rounding
    torch.testing.assert_close(cpu_kernels.linear(ints, q, scales).double(), ints.double() @ q.double().T
                               * scales.double(), rtol=1e-6, atol=0)


def test_stack_rows_joins_back_to_back_blocks_as_a_view_and_copies_others():
    whole = torch.arange(60, dtype=torch.int8).reshape(10, 6)
    joined = stack_rows([whole[:3], whole[3:7], whole[7:]])
    assert torch.equal(joined, whole) and joined.data_ptr() == whole.data_ptr()  # a view: no copy
    apart = stack_rows([whole[:3], whole[5:]])  # a gap: copied, in order
    assert torch.equal(apart, torch.cat([whole[:3], whole[5:]])) and apart.data_ptr() != whole.data_ptr()
    swapped = stack_rows([whole[5:], whole[:5]])
    assert torch.equal(swapped, torch.cat([whole[5:], whole[:5]]))
    other = torch.zeros(4, 6, dtype=torch.int8)
    assert torch.equal(stack_rows([whole[:2], other]), torch.cat([whole[:2], other]))


def test_an_int8_matrix_at_any_address_runs_the_many_row_product():
    """A pre-quantised matrix served from its mapped checkpoint lies wherever the file put it; ATen's int8 kernel
    crashes on a weight 8 bytes off a 16-byte boundary, so such a matrix runs from an aligned copy: same values."""
    g = torch.Generator().manual_seed(0)
    n, k = 96, 256
    buf = torch.randint(-127, 128, (n * k + 64,), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) + 0.5).to(torch.bfloat16)
    x = torch.randn(80, k, generator=g)  # more rows than the few-row kernels take
    want = Int8Weight(buf[: n * k].view(n, k), scales, torch.float32).matmul(x, None)
    for offset in (8, 24, 40):
        w = Int8Weight(buf[offset: offset + n * k].view(n, k), scales, torch.float32)
        assert w.qweight.data_ptr() % 16 == 8
        aligned = Int8Weight(w.qweight.clone(), scales, torch.float32)
        assert torch.equal(w.matmul(x, None), aligned.matmul(x, None))
    assert want.shape == (80, n)
