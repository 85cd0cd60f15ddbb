"""The CPU fast paths equal the plain ones: the planned decode equals the fp32 reference on poisoned,
shuffled caches; the CPU GEMM paths (probed fast path and forced fallbacks) equal ``F.linear`` and the
probe's decisions match what works here; the fused RoPE, the host-side expert grouping and
a prepared model equal their plain counterparts; the engine's greedy tokens do not depend on them."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():  # kernels: interpret Triton on CPU (must precede the first triton import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mla_kernels import (  # noqa: E402
    cpu_kernels,
    cpu_ops,
    cpu_tables,
    mla_decode_planned,
    plan_decode,
    plan_decode_lists,
    write_latent,
)
from mla_kernels.common import dequantize_rows, quantize_per_token  # noqa: E402
from mla_kernels.reference import ref_mla_decode  # noqa: E402
from mla_kernels.w8a8_format import w8a8_product  # noqa: E402
from mla_runtime import LLM, SamplingParams  # noqa: E402
from mla_runtime import kernel_plan as kernel_plan_module  # noqa: E402
from mla_runtime.attention.paged import PagedBackend  # noqa: E402
from mla_runtime.config import MoEConfig, RopeConfig  # noqa: E402
from mla_runtime.forward_batch import ForwardBatch  # noqa: E402
from mla_runtime.kernel_plan import (  # noqa: E402
    HALF_KINDS,
    NATIVE_CAPABILITIES,
    GemmChoice,
    KernelPlan,
    cpu_auto_dtype,
    fast_path_failure,
    kernel_plan,
    native_arithmetic,
    onednn_linear,
    resolve_cpu_format,
)
from mla_runtime.layers import cpu_gemm  # noqa: E402
from mla_runtime.layers import moe as moe_module  # noqa: E402
from mla_runtime.layers import norm as norm_module  # noqa: E402
from mla_runtime.layers import rotary as rotary_module  # noqa: E402
from mla_runtime.layers.cpu_gemm import PackedWeight, linear  # noqa: E402
from mla_runtime.layers.norm import RMSNorm  # noqa: E402
from mla_runtime.layers.rotary import RotaryEmbedding  # noqa: E402
from mla_runtime.loader import load_model  # noqa: E402
from tests.kernel_utils import assert_close_dtype, make_paged_case  # noqa: E402
from tests.model_utils import PagedRunner  # noqa: E402
from tests.test_model_parity import prompts, rel_err  # noqa: E402


class _OpSpy:
    """``torch.ops.mla_kernels`` with the named operators' calls recorded (``calls[name]``: each call's arguments)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.calls: dict[str, list[tuple]] = {name: [] for name in names}

    def __getattr__(self, name: str):
        op = getattr(torch.ops.mla_kernels, name)
        if name not in self.calls:
            return op
        return lambda *a, **k: self.calls[name].append(a) or op(*a, **k)


def spy_ops(monkeypatch, *names: str) -> dict[str, list[tuple]]:
    """Record the calls of these compiled operators (through ``cpu_kernels.ops()``, as every caller reaches them)."""
    spy = _OpSpy(names)
    monkeypatch.setattr(cpu_kernels, "ops", lambda: spy)
    return spy.calls


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: float rounding of 64-600-long dot products and a softmax (outputs are O(1)); bf16: as the kernels."""
    if dtype == torch.float32:
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert_close_dtype(out, ref, dtype)


# -- planned decode ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens", [(1,), (64,), (65, 1, 130, 17), (5, 200, 64, 63, 128, 2)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_planned_decode_matches_reference(dtype, seq_lens, block_size):
    d_c, d_r, heads = 48, 16, 5
    case = make_paged_case(list(seq_lens), d_c, d_r, block_size=block_size, dtype=dtype, seed=len(seq_lens))
    q = torch.randn(len(seq_lens), heads, d_c + d_r, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = (d_c + d_r) ** -0.5  # scores of a realistic size: bf16 rounds each one by <= 2^-8 relative
    plan = plan_decode(case.block_tables, case.seq_lens, block_size)
    hinted = plan_decode(case.block_tables, case.seq_lens, block_size, len_range=(min(seq_lens), max(seq_lens)))
    assert hinted.max_len == plan.max_len and torch.equal(hinted.slots, plan.slots)
    assert torch.equal(hinted.mask, plan.mask) and plan.mask.dtype == torch.float32
    out = mla_decode_planned(q, case.cache, plan, scale, d_c)
    ref, _ = ref_mla_decode(q.float(), case.cache, None, case.block_tables, case.seq_lens, scale, d_c)
    assert out.dtype == dtype and out.shape == (len(seq_lens), heads, d_c)
    assert_close(out, ref, dtype)


def test_planned_decode_in_row_groups_equals_one_group(monkeypatch):
    """A batch whose gathered keys exceed PLANNED_KV_BYTES is processed in row groups, with the same result."""
    import mla_kernels.decode_cpu as decode_cpu

    d_c, d_r = 48, 16
    case = make_paged_case([5, 200, 64, 63, 128], d_c, d_r, block_size=16, seed=4)
    q = torch.randn(5, 3, d_c + d_r, generator=torch.Generator().manual_seed(2))
    plan = plan_decode(case.block_tables, case.seq_lens, 16)
    whole = mla_decode_planned(q, case.cache, plan, 0.2, d_c)
    monkeypatch.setattr(decode_cpu, "PLANNED_KV_BYTES", 2 * plan.max_len * (d_c + d_r) * 4)  # two rows a group
    grouped = mla_decode_planned(q, case.cache, plan, 0.2, d_c)
    assert torch.equal(grouped, whole)


def test_planned_decode_rows_sharing_a_table_row():
    """Several query rows on one block-table row (a chunk), each seeing its own causal prefix."""
    d_c, d_r = 32, 16
    case = make_paged_case([40, 90], d_c, d_r, block_size=16, seed=3)
    req = torch.tensor([0, 1, 1, 1], dtype=torch.int32)
    lens = torch.tensor([40, 88, 89, 90], dtype=torch.int32)
    q = torch.randn(4, 3, d_c + d_r)
    out = mla_decode_planned(q, case.cache, plan_decode(case.block_tables, lens, 16, req), 0.2, d_c)
    ref, _ = ref_mla_decode(q, case.cache, None, case.block_tables, lens, 0.2, d_c, req_indices=req)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("block_size", [16, 64])
def test_the_host_built_plan_equals_the_tensor_built_one(block_size):
    """plan_decode_lists (block-table lists, one per query row) makes plan_decode's plan, chunk rows included."""
    case = make_paged_case([40, 90, 1, 129], 32, 16, block_size=block_size, seed=5)
    req = torch.tensor([0, 1, 1, 1, 2, 3], dtype=torch.int32)
    lens = torch.tensor([40, 88, 89, 90, 1, 129], dtype=torch.int32)
    tables = [row[:-(-int(n) // block_size)] for row, n in zip(case.block_tables.tolist(), case.seq_lens.tolist())]
    host = plan_decode_lists([tables[r] for r in req.tolist()], lens.tolist(), block_size)
    plan = plan_decode(case.block_tables, lens, block_size, req)
    assert host.max_len == plan.max_len and torch.equal(host.slots, plan.slots) and torch.equal(host.mask, plan.mask)
    with pytest.raises(ValueError, match="block table"):
        plan_decode_lists([tables[0]], [41 + 64], block_size)


def test_plan_decode_rejects_rows_without_keys():
    case = make_paged_case([4, 9], 32, 16, block_size=16)
    with pytest.raises(ValueError, match="at least one key"):
        plan_decode(case.block_tables, torch.tensor([4, 0], dtype=torch.int32), 16)


def test_planned_decode_rejects_quantised_caches():
    case = make_paged_case([4], 32, 16, block_size=16, dtype=torch.int8)
    plan = plan_decode(case.block_tables, case.seq_lens, 16)
    with pytest.raises(ValueError, match="float caches"):
        mla_decode_planned(torch.randn(1, 2, 48), case.cache, plan, 0.2, 32)


# -- CPU GEMM paths ----------------------------------------------------------------------------------------
GEMM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def with_path(plan: KernelPlan, dtype: torch.dtype, path: str, reason: str = "set by the test") -> KernelPlan:
    """``plan`` with ``dtype`` weights on ``path`` (a CPU whose probes found otherwise)."""
    compute = torch.float32 if path == "upcast" else dtype
    gemm = tuple(GemmChoice(dtype, path, compute, reason) if c.dtype == dtype else c for c in plan.gemm)
    return dataclasses.replace(plan, gemm=gemm)


def gemm_tol(dtype: torch.dtype) -> dict[str, float]:
    """fp32: rounding of 96-long dot products; half precision: one rounding of the output (8 / 11 bits)."""
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=2**-6),
            torch.float16: dict(rtol=2**-10, atol=2**-8)}[dtype]


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
@pytest.mark.parametrize("shape", [(0, 96), (1, 96), (3, 96), (8, 96), (33, 96), (2, 5, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(gemm_mode, plan, dtype, shape, bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(130, 96, generator=g).to(dtype)
    b = torch.randn(130, generator=g).to(dtype) if bias else None
    x = torch.randn(*shape, generator=g).to(dtype)
    choice = plan.choice(dtype)
    packed = PackedWeight.make(w, plan)
    assert plan.mode == gemm_mode and (packed is None) == (choice.path == "plain")
    assert packed is None or packed.upcast == (choice.path == "upcast")
    got, want = linear(x, w, b, packed), F.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **gemm_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_path_matches_f_linear(plan, dtype):
    """The float32 path of a half-precision weight (whichever float32 path this mode takes) equals F.linear."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(130, 96, generator=g).to(dtype), torch.randn(130, generator=g).to(dtype)
    packed = PackedWeight(w, with_path(plan, dtype, "upcast"))
    assert packed.upcast and (packed.blocked is None) == (plan.choice(torch.float32).path == "plain")
    for rows in (1, 7):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        got = linear(x, w, b, packed)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), **gemm_tol(dtype))


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
def test_probe_decision_matches_what_works(dtype):
    """The fast path is chosen exactly where oneDNN packs this dtype here and its products equal F.linear."""
    plan = kernel_plan()
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(130, 96, generator=g).to(dtype), torch.randn(5, 96, generator=g).to(dtype)
    try:
        got = linear(x, w, None, PackedWeight(w, with_path(plan, dtype, "onednn")))
        works = bool(torch.allclose(got.float(), F.linear(x, w).float(), **gemm_tol(dtype)))
    except Exception:  # anything the fast path raises here means it does not work
        works = False
    choice = plan.choice(dtype)
    assert (choice.path == "onednn") == works == (fast_path_failure(dtype) is None)
    assert choice.compute_dtype == (dtype if choice.path != "upcast" else torch.float32)
    assert choice.reason and plan.info(dtype)["path"] == choice.path
    if dtype == torch.float32:  # float32 has no float32 fallback to time: F.linear where oneDNN fails
        assert choice.path in ("onednn", "plain")


def test_forced_plain_takes_no_fast_path():
    plan = kernel_plan("plain")
    for dtype in GEMM_DTYPES:
        choice = plan.choice(dtype)
        assert plan.mode == "plain" and choice.path in ("plain", "upcast") and "cpu_gemm=plain" in choice.reason
    assert PackedWeight.make(torch.randn(8, 4), plan) is None  # float32: F.linear
    info = plan.info(torch.bfloat16)
    assert info["mode"] == "plain" and info["extra_bytes_per_weight"] == ("4" if info["path"] == "upcast" else "0")
    assert not (plan.row_kernels or plan.half_kernel(torch.bfloat16) or plan.tiles)


def test_the_kernel_plan_is_one_frozen_value_per_mode():
    """A plan is resolved once per mode and cannot change afterwards; an unknown mode is refused by name."""
    with pytest.raises(ValueError, match="cpu_gemm: unknown value 'avx512'"):
        kernel_plan("avx512")
    plan = kernel_plan()
    assert plan is kernel_plan("auto") and plan.mode == "auto" and kernel_plan("onednn").choice(torch.float32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.mode = "plain"  # type: ignore[misc]
    assert not kernel_plan("onednn").row_kernels  # onednn leaves the compiled kernels out
    lean = plan.with_one_layout()
    assert lean.one_layout and not lean.tiles and lean.layouts(torch.float32).one_layout


def test_packed_linear_matrix_vector_layouts(plan):
    """float32 on oneDNN takes the plain layout for one row, the blocked one for more; both equal F.linear."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2048, 1024, generator=g)
    packed = PackedWeight.make(w, plan)
    if plan.choice(torch.float32).path == "onednn":
        assert packed is not None and packed.plain_gemv
    else:
        assert packed is None
    for rows in (1, 2):
        x = torch.randn(rows, 1024, generator=g)
        torch.testing.assert_close(linear(x, w, None, packed), F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", ["auto", "onednn", "plain"])
@pytest.mark.parametrize("aten_rows", [0, 1, 8])
@pytest.mark.parametrize("compiled", [True, False])
def test_small_products_take_the_chosen_path(mode, aten_rows, compiled, monkeypatch):
    """The route of each product, chosen inside ``dense_linear`` by the count of rows, gives exactly the bits of that
    route called alone: one to ``KERNEL_MAX_ROWS`` rows the compiled kernels wherever they run, up to
    ``aten_max_rows`` F.linear as the size rule chose, more oneDNN (one float32 row on the plain weight). Where the
    operators do not load (``compiled`` False), the torch fallback: F.linear throughout for a weight the size rule
    gives ATen, else oneDNN."""
    plan = kernel_plan(mode)
    if not compiled:
        out = "the test leaves the operators out"
        plan = dataclasses.replace(plan, ops_failure=out, float_failure=plan.float_failure or out)
    elif plan.ops_failure is not None and mode != "plain":  # plain: float32 weights take F.linear, checked below
        pytest.skip(f"the compiled operators do not load here: {plan.ops_failure}")
    monkeypatch.setattr(cpu_gemm, "aten_max_rows", lambda *shape: aten_rows)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g)
    packed = PackedWeight.make(w, plan)
    if plan.choice(torch.float32).path != "onednn":
        assert packed is None
        return
    assert packed is not None and packed.compiled == compiled
    assert packed.aten_max_rows == (0 if packed.row_kernel else aten_rows)
    for rows in (1, 4, 8, 16):
        x = torch.randn(rows, 64, generator=g)
        got = linear(x, w, None, packed)
        if compiled and packed.row_kernel and rows <= cpu_gemm.KERNEL_MAX_ROWS:
            want = cpu_kernels.linear(x, w)
        elif rows <= packed.aten_max_rows or (not compiled and packed.aten_max_rows):
            want = F.linear(x, w)
        else:
            want = onednn_linear(x, w if packed.blocked is None or rows == 1 else packed.blocked)
        assert torch.equal(got, want), rows
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_small_weights_take_aten_by_a_size_rule_never_a_timing():
    """Which products take F.linear is a rule of the weight's size and dtype: the same on every start, whatever the
    machine's load (a timing there would change the low bits of the results from run to run)."""
    limit, rows = cpu_gemm.ATEN_ROWS[torch.float32]
    assert rows == cpu_gemm.FEW_ROWS and cpu_gemm.aten_max_rows(64, limit // 64, torch.float32) == rows
    assert cpu_gemm.aten_max_rows(64, limit // 64 + 1, torch.float32) == 0
    assert cpu_gemm.aten_max_rows(4, 1024, torch.bfloat16) == 1
    assert cpu_gemm.aten_max_rows(16, 1024, torch.bfloat16) == 0
    assert cpu_gemm.aten_max_rows(4, 4, torch.int8) == 0  # not a probed float dtype


def test_packed_weight_only_where_onednn_applies():
    assert PackedWeight.make(torch.randn(4, 4, dtype=torch.float64), kernel_plan()) is None
    assert PackedWeight.make(torch.randn(2, 4, 4), kernel_plan()) is None


BF16_CPU = {"x86 AVX-512 BF16": {"avx512_f": True, "avx512_bf16": True}, "x86 AMX": {"amx_bf16": True},
            "aarch64": {"neon": True, "bf16": True}}
NO_BF16_CPU = {"x86 AVX2": {"avx2": True, "fma3": True}, "x86 AVX-512 without BF16": {"avx512_f": True},
               "aarch64 without bf16": {"neon": True}}


def test_auto_dtype_on_cpu_decision():
    """``dtype="auto"`` keeps bf16 only with native bf16 and a passing probe; the reason says which failed."""
    plan = kernel_plan()
    fast = with_path(plan, torch.bfloat16, "onednn")
    slow = with_path(plan, torch.bfloat16, "upcast", "packing unsupported: X")
    for caps in BF16_CPU.values():
        assert cpu_auto_dtype(torch.bfloat16, fast, caps)[0] == torch.bfloat16
        dtype, why = cpu_auto_dtype(torch.bfloat16, slow, caps)
        assert dtype == torch.float32 and "packing unsupported: X" in why
    for caps in NO_BF16_CPU.values():
        dtype, why = cpu_auto_dtype(torch.bfloat16, fast, caps)
        assert dtype == torch.float32 and "no native bfloat16" in why
    assert cpu_auto_dtype(torch.float32, slow, {})[0] == torch.float32
    assert cpu_auto_dtype(torch.float16, with_path(plan, torch.float16, "upcast"), {"avx512_fp16": True})[0] \
        == torch.float32


def test_auto_dtype_on_this_cpu(tiny_checkpoint, caplog, monkeypatch):
    """On this machine: the engine's resolution equals the decision for its own capabilities and probe;
    a bf16 checkpoint stays bf16 for the planner (no machine) and on a GPU, and an explicit dtype is honoured."""
    from mla_runtime.config import ModelConfig
    from mla_runtime.plan import resolve_model_dtype

    plan = kernel_plan()
    cfg = ModelConfig.from_pretrained(tiny_checkpoint("v3")[0]).with_overrides(torch_dtype="bfloat16")
    caps = cpu_ops.cpu_capabilities()
    # a process capped at AVX2 ($MLA_CPU_ISA) decides as a CPU without AVX512-BF16 or AMX
    native = cpu_ops.isa_cap() != "avx2" and any(caps.get(k) for k in NATIVE_CAPABILITIES[torch.bfloat16])
    probe_ok = plan.choice(torch.bfloat16).path == "onednn"
    with caplog.at_level("INFO", logger="mla_runtime"):  # int8 products: the model dtype alone is decided
        got, _ = resolve_cpu_format("auto", resolve_model_dtype("auto", cfg), "int8", plan)
    assert got == (torch.bfloat16 if native and probe_ok else torch.float32)
    assert f'dtype "auto" on this CPU: {str(got).removeprefix("torch.")}' in caplog.text
    assert resolve_model_dtype("auto", cfg) == torch.bfloat16
    assert resolve_cpu_format("bfloat16", torch.bfloat16, None, plan) == (torch.bfloat16, None)  # explicit: honoured
    # no fast path: float32
    assert resolve_cpu_format("auto", torch.bfloat16, "int8", kernel_plan("plain")) == (torch.float32, "int8")


# -- layers ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("tokens", [4, rotary_module.ROPE_MATRIX_MAX_TOKENS + 1])  # rotation matrices; complex/plain
def test_rotary_with_shared_cos_sin_equals_separate_rotations(interleave, dtype, tokens):
    rope = RotaryEmbedding(RopeConfig(interleave=interleave), 8)
    pos = torch.randint(0, 4096, (tokens,))
    q, k = torch.randn(tokens, 2, 8).to(dtype), torch.randn(tokens, 8).to(dtype)
    cos, sin = rope.cos_sin(pos, dtype)
    tables = rope.tables(pos, dtype)
    assert (tables.matrix is not None) == (tokens <= rotary_module.ROPE_MATRIX_MAX_TOKENS)
    q_rot, k_rot = rope(pos, q, k, tables)
    assert q_rot.dtype == k_rot.dtype == dtype
    # bf16: the fused rotation rounds once, the plain one after every product: one bf16 step apart at most
    tol = {} if dtype == torch.float32 else dict(rtol=0, atol=2 ** -6 * 4)
    torch.testing.assert_close(q_rot, rope.rotate(q, cos, sin), **tol)
    torch.testing.assert_close(k_rot, rope.rotate(k, cos, sin), **tol)
    torch.testing.assert_close(tables.tail(1).cos, tables.cos[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_equal_the_formula_and_the_table_grows(dtype):
    rope = RotaryEmbedding(RopeConfig(interleave=True, theta=10000.0), 8)

    def direct(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos.float()[:, None] * rope.inv_freq[None, :]
        return (freqs.cos() * rope.scale).to(dtype), (freqs.sin() * rope.scale).to(dtype)

    for pos in (torch.tensor([0, 5, 4095, 7]), torch.tensor([9000, 3]), torch.tensor([], dtype=torch.long)):
        cos, sin = rope.cos_sin(pos, dtype)
        want_cos, want_sin = direct(pos)
        assert cos.shape == (len(pos), 4) and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert rope.cos_sin(torch.tensor([3]), dtype, max_position=3)[0].shape == (1, 4)
    assert 9000 < len(rope._tables[dtype]) <= 2 * 9001  # grown once, by doubling the largest position seen


def test_host_grouped_experts_equal_sorted(monkeypatch):
    cfg = MoEConfig(n_routed_experts=6, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                    scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)
    moe = moe_module.MoE(cfg, 24, torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    moe.experts.prepare_inference(kernel_plan())
    x = torch.randn(9, 24, generator=g)
    host = moe(x)
    one_by_one = torch.cat([moe(x[i:i + 1]) for i in range(9)])  # the single-token path
    monkeypatch.setattr(moe_module, "HOST_GROUPING_MAX_PAIRS", 0)
    torch.testing.assert_close(moe(x), host, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(one_by_one, host, rtol=1e-5, atol=1e-6)


# -- the model and the engine -----------------------------------------------------------------------------
def _unprepared(ckpt):
    """The same weights without any inference layout (no packed GEMMs, no absorbed-weight copies)."""
    model = load_model(ckpt, dtype="float32")
    for m in model.modules():
        for name in ("packed", "gate_up_packed", "down_packed", "w_uk", "w_uv_t", "lm_head_packed"):
            if hasattr(m, name):
                setattr(m, name, [] if isinstance(getattr(m, name), list) else None)
    return model


def test_prepared_model_decode_equals_unprepared(tiny_checkpoint, gemm_mode):
    ckpt, _ = tiny_checkpoint("v3")
    ps = prompts([30, 12, 7], seed=11)
    logits = []
    for model in (load_model(ckpt, dtype="float32"), _unprepared(ckpt)):
        runner = PagedRunner(model, len(ps), 48)
        runner.step({i: p[:-3] for i, p in enumerate(ps)})
        steps = [runner.step({i: [p[-t]] for i, p in enumerate(ps)}) for t in (3, 2, 1)]
        logits.append(torch.cat([torch.cat([s[i] for i in range(len(ps))]) for s in steps]))
    assert rel_err(logits[0], logits[1]) <= 1e-5


def test_forward_batch_tail_equals_a_batch_of_the_tail():
    chunks, ctx, tables = [[5], [6], [7, 8, 9], [10, 11]], [3, 17, 0, 16], [[2, 9], [4, 1], [7], [3, 0, 5]]
    full = ForwardBatch.build(chunks, ctx, tables, 16)
    assert full.leading_short(1) == (2, 2) and full.leading_short(3) == (4, 7) and full.leading_short(0) == (0, 0)
    # a chunk also counts the keys its rows read beyond one row's: (3 - 1) * 3 = 6, then (2 - 1) * 18 = 18
    assert full.leading_short(3, 6) == (3, 5) and full.leading_short(3, 5) == (2, 2)
    for first in (2, 3):
        tail, direct = full.tail(first), ForwardBatch.build(chunks[first:], ctx[first:], tables[first:], 16)
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "seq_start_loc",
                     "context_lens", "token_seq_lens", "token_req_idx", "logits_indices"):
            assert torch.equal(getattr(tail, name), getattr(direct, name)), name
        assert torch.equal(tail.block_tables[:, :direct.block_tables.shape[1]], direct.block_tables)  # padded
        assert (tail.query_lens, tail.context_lens_list) == (direct.query_lens, direct.context_lens_list)
    with pytest.raises(ValueError, match="tail"):
        full.tail(5)


def _spy_planned_rows(monkeypatch) -> list[int]:
    """The row count of every planned decode call, through torch (``mla_decode_planned``), the compiled kernel or the
    compiled layer."""
    from mla_runtime.attention import cpu as mla_module

    rows: list[int] = []
    real, real_layer = mla_module.mla_decode_planned, cpu_tables.decoder_layer
    monkeypatch.setattr(mla_module, "mla_decode_planned", lambda q, *a: rows.append(q.shape[0]) or real(q, *a))
    real_ops = cpu_kernels.ops

    class Ops:
        def __getattr__(self, name: str):
            op = getattr(real_ops(), name)
            return (lambda q_n, *a, **k: rows.append(q_n.shape[0]) or op(q_n, *a, **k)) if name == "absorbed_decode" \
                else op

    monkeypatch.setattr(cpu_kernels, "ops", Ops)
    monkeypatch.setattr(cpu_tables, "decoder_layer", lambda t, s, *a: rows.append(s.rows) or real_layer(t, s, *a))
    return rows


@pytest.mark.parametrize("extra_key_bytes", [None, 64])
def test_short_chunks_join_the_decode_plan(tiny_checkpoint, monkeypatch, extra_key_bytes):
    """Speculative verifications (a few tokens over a cached context) join the decodes' gather plan while the
    keys they read stay under the bound, with the logits of the per-sequence path."""
    from mla_runtime.attention import cpu as cpu_attention

    ckpt, _ = tiny_checkpoint("v3")
    ps = prompts([20, 13, 30], seed=22)
    planned_rows = _spy_planned_rows(monkeypatch)
    if extra_key_bytes is not None:  # too small for the 3-token chunk over 13 keys
        monkeypatch.setattr(cpu_attention, "PLANNED_EXTRA_KEY_BYTES", extra_key_bytes)
    results = []
    for max_query_len in (cpu_attention.PLANNED_MAX_QUERY_LEN, 1):
        monkeypatch.setattr(cpu_attention, "PLANNED_MAX_QUERY_LEN", max_query_len)
        model = load_model(ckpt, dtype="float32")
        runner = PagedRunner(model, len(ps), 48)
        runner.step({0: ps[0][:-1], 1: ps[1][:-3], 2: ps[2][:20]})
        planned_rows.clear()
        out = runner.step({0: ps[0][-1:], 1: ps[1][-3:], 2: ps[2][20:]})  # a decode, a verification, a chunk
        chunk_planned = max_query_len > 1 and extra_key_bytes is None
        assert planned_rows == [4 if chunk_planned else 1] * model.config.num_hidden_layers
        results.append(torch.cat([out[i] for i in range(len(ps))]))
    assert rel_err(results[0], results[1]) <= 1e-5


@pytest.mark.parametrize("path", ["auto", "naive"])
def test_mixed_step_decodes_planned_prefill_apart(tiny_checkpoint, monkeypatch, path):
    """A step of decodes followed by prefill chunks: the decodes take the planned path (unless the naive path
    is forced), the chunks their own, and the logits equal those of running them as two separate steps."""
    ckpt, _ = tiny_checkpoint("v3")
    ps = prompts([20, 13, 30, 9], seed=21)
    planned_rows = _spy_planned_rows(monkeypatch)
    results = []
    for mixed in (True, False):
        model = load_model(ckpt, dtype="float32", attention_path=path)
        runner = PagedRunner(model, len(ps), 48)
        runner.step({0: ps[0][:-1], 1: ps[1][:-1], 3: ps[3][:4]})  # 0, 1 then decode; 3 continues its prompt
        decodes, chunks = {0: ps[0][-1:], 1: ps[1][-1:]}, {2: ps[2][:17], 3: ps[3][4:]}
        planned_rows.clear()
        out = runner.step({**decodes, **chunks}) if mixed else {**runner.step(decodes), **runner.step(chunks)}
        # only the decodes were planned; a forced up-projected path plans nothing
        assert planned_rows == ([2] * model.config.num_hidden_layers if path == "auto" else [])
        results.append(torch.cat([out[i] for i in range(len(ps))]))
    assert not torch.isnan(results[0]).any()
    assert rel_err(results[0], results[1]) <= 1e-5


def test_engine_greedy_tokens_batched_equal_single(tiny_checkpoint, gemm_mode):
    ckpt, _ = tiny_checkpoint("v3")
    ps = [{"prompt_token_ids": p} for p in prompts([9, 31, 4, 17], seed=12)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(str(ckpt), dtype="float32", max_model_len=64, kv_cache_memory="4MiB", block_size=16)
    batched = [o.outputs[0].token_ids for o in llm.generate(ps, sp)]
    single = [llm.generate([p], sp)[0].outputs[0].token_ids for p in ps]
    assert batched == single


def test_thread_tuner_probes_then_keeps_the_faster_count(monkeypatch):
    from mla_runtime.engine import thread_tuner as tt

    clock = [0.0]
    monkeypatch.setattr(tt.time, "perf_counter", lambda: clock[0])
    cost = {2: 1.0, 1: 0.25}  # seconds per step with that many threads: here 1 thread wins
    before = torch.get_num_threads()
    tuner = tt.ThreadTuner(2, period=10, probe_steps=2)
    used = []
    try:
        for _ in range(14):
            with tuner.step(8) as threads:
                used.append(threads)
                clock[0] += cost[threads]
    finally:
        torch.set_num_threads(before)
    assert used[:4] == [2, 2, 1, 1]  # the probe: each candidate in turn
    assert used[4:14] == [1] * 10  # then the faster one; a clear verdict (4x) doubles the period to 20
    with tuner.step(300, decode=False) as threads:  # a prefill chunk: the latest verdict, no probe
        assert threads == 1
    for _ in range(6):
        with tuner.step(8) as threads:
            used.append(threads)
            clock[0] += 1.0  # now equally fast: a close call
    assert used[14:20] == [1] * 6
    with tuner.step(8) as threads:  # step 20 of the key: the next probe
        assert threads == 2
    torch.set_num_threads(before)
    assert tt.ThreadTuner.key(1) == 1 and tt.ThreadTuner.key(5) == tt.ThreadTuner.key(8) == 8


def test_num_threads_validation():
    from mla_runtime.engine.config import EngineConfig

    for bad in (0, -1, "many", 1.5):
        with pytest.raises(ValueError, match="num_threads"):
            EngineConfig(model="x", num_threads=bad)
    assert EngineConfig(model="x", num_threads="auto").num_threads == "auto"


# -- the one-row AVX2 kernel ----------------------------------------------------------------------------------
needs_row_kernel = pytest.mark.skipif(cpu_kernels.failure() is not None,
                                      reason=f"the one-row kernel does not build here: {cpu_kernels.failure()}")


@needs_row_kernel
@pytest.mark.parametrize("n, k", [(1, 8), (5, 13), (37, 77), (256, 1024), (1030, 512)])
def test_row_kernel_matches_f_linear(n, k):
    g = torch.Generator().manual_seed(n)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(1, 1, k, generator=g), torch.randn(n, generator=g)
    out = cpu_kernels.linear(x, w, bias=b)
    assert out.shape == (1, 1, n)
    assert_float32_sums(out, x, w, b)


def assert_float32_sums(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> None:
    """``out`` is ``x · Wᵀ (+ b)`` to float32 rounding: within 1e-6 of the sum of the terms' magnitudes, the scale a
    float32 sum's rounding grows with. (Not against F.linear at a fixed tolerance: its own error depends on the
    BLAS's order of summation, which differs by CPU; an output near zero of 1,024 terms of one kernel and of Intel's
    AVX2 BLAS differed by 1.05e-5.)"""
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    err = (out.double() - ref).abs()
    assert (err <= 1e-6 * scale + 1e-7).all(), f"largest error {err.max().item():.3g}"


@needs_row_kernel
@pytest.mark.parametrize("rows", range(1, 9))
def test_few_row_kernels_match_f_linear(rows):
    """Every row count up to the kernels' eight has its own compiled instance; a column tail (77 = 9 * 8 + 5)
    included. More rows are refused, by name."""
    assert cpu_kernels.max_rows(torch.float32) == 8 and cpu_kernels.max_rows(torch.int8) == 64
    g = torch.Generator().manual_seed(rows)
    w, x, b = torch.randn(37, 77, generator=g), torch.randn(rows, 77, generator=g), torch.randn(37, generator=g)
    torch.testing.assert_close(cpu_kernels.linear(x, w, bias=b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    q, scales = torch.randint(-127, 128, (37, 77), generator=g, dtype=torch.int8), torch.rand(37, generator=g)
    want = F.linear(x, q.float() * scales[:, None])  # the rows rounded to int16: within 2^-14 of their largest value
    torch.testing.assert_close(cpu_kernels.linear(x, q, scales), want, rtol=3e-4, atol=3e-4 * want.abs().max())
    with pytest.raises(ValueError, match="1 to 8 rows with a Float weight"):
        cpu_kernels.linear(torch.randn(9, 77), w)
    many = torch.randn(130, 77, generator=g)  # quantised weights: any rows, 64 a pass, each row as alone
    assert torch.equal(cpu_kernels.linear(many, q, scales)[64:66], cpu_kernels.linear(many[64:66], q, scales))
    with pytest.raises(ValueError, match="the row scales must be a contiguous CPU Float tensor"):
        cpu_kernels.linear(x, q, scales[:-1])


@needs_row_kernel
def test_int8_products_of_many_rows_equal_their_rows_one_at_a_time():
    """int8 products go eight rows at a time (64 a pass), and each row's result is the one it gets alone through the
    one-row kernel (a speculative verification's rows equal the same tokens decoded one by one), also past the int32
    chunk of 4096 values (DeepSeek-V3's hidden size is 7168)."""
    g = torch.Generator().manual_seed(3)
    for n, k in ((37, 77), (11, 7168), (2, 4117)):
        q, scales = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g)
        x = torch.randn(70, k, generator=g)
        for rows in (9, 23, 70):
            together = cpu_kernels.linear(x[:rows], q, scales)
            assert torch.equal(together, torch.cat([cpu_kernels.linear(x[i:i + 1], q, scales) for i in range(rows)]))


@needs_row_kernel
@pytest.mark.parametrize("variant", ["avx2", "avx512_vnni"])
def test_an_int8_product_of_a_row_holding_infinity_or_nan_is_nan(variant):
    """A row holding infinity or NaN has no int16 form: its products come out NaN (as int4's groups do), one row or
    many, and the rows beside it keep their values."""
    if variant not in cpu_kernels.variants("int8"):
        pytest.skip(f"this CPU does not execute the int8 product's {variant} variant")
    g = torch.Generator().manual_seed(5)
    q, scales = torch.randint(-127, 128, (24, 100), generator=g, dtype=torch.int8), torch.rand(24, generator=g)
    for rows in (1, 3, 12):
        x = torch.randn(rows, 100, generator=g)
        clean = cpu_kernels.linear(x, q, scales, variant=variant)
        for bad in (float("inf"), float("-inf"), float("nan")):
            y = x.clone()
            y[rows // 2, 97] = bad  # in the scalar tail past the vectors
            y[0, 3] = bad
            out = cpu_kernels.linear(y, q, scales, variant=variant)
            hit = {0, rows // 2}
            for r in range(rows):
                if r in hit:
                    assert out[r].isnan().all()
                else:
                    assert torch.equal(out[r], clean[r])


@needs_row_kernel
def test_row_kernel_rejects_what_it_cannot_compute():
    w = torch.randn(8, 16)
    cases = ((torch.randn(1, 15), w, "rows of 15 values do not fit"), (torch.randn(1, 8), w.t(), "contiguous CPU"),
             (torch.randn(1, 16), w.double(), "weights are float32, bfloat16, float16"),
             (torch.ones(1, 16, dtype=torch.int64), w, "floating-point CPU rows"),
             (torch.randn(1, 16), w.view(2, 4, 16), "contiguous CPU matrix"),
             (torch.randn(0, 16), w, "1 to 8 rows"))
    for x, weight, said in cases:
        with pytest.raises(ValueError, match=said):
            cpu_kernels.linear(x, weight)
    for scales, block, said in ((None, [], "come with scales"), (torch.ones(8), [4, 4], "FP8 weights"),
                                (torch.ones(8), [], "the others without")):
        with pytest.raises(ValueError, match=said):
            cpu_kernels.linear(torch.randn(1, 16), w.to(torch.int8) if block or scales is None else w, scales,
                               block=tuple(block))


def test_one_row_products_with_and_without_the_kernel(monkeypatch):
    """Where the kernel builds, float32 products of one to ``KERNEL_MAX_ROWS`` rows take it under auto and oneDNN
    under onednn (the state of a CPU without it); both equal F.linear."""
    w = torch.randn(96, 64)
    x = torch.randn(1, 64)
    for mode in ("auto", "onednn"):
        plan = kernel_plan(mode)
        packed = PackedWeight.make(w, plan)
        if packed is None:  # oneDNN cannot pack float32 on this CPU: F.linear, and no kernel either
            assert plan.choice(torch.float32).path == "plain"
            torch.testing.assert_close(linear(x, w, None, packed), F.linear(x, w))
            continue
        assert packed.row_kernel == (mode == "auto" and cpu_kernels.failure() is None)
        assert plan.row_kernels == packed.row_kernel
        torch.testing.assert_close(linear(x, w, None, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(x.repeat(3, 1), w, None, packed), F.linear(x.repeat(3, 1), w))


def _clear_kernel_caches() -> None:
    cpu_ops.failure.cache_clear()
    cpu_kernels.failure.cache_clear()
    kernel_plan_module._resolve.cache_clear()  # the plans resolved from them


def test_the_row_kernel_is_left_out_with_a_reason_where_it_cannot_build(monkeypatch, tmp_path):
    """No C++ compiler, or one that fails: the kernels are unavailable, say why, and weights keep oneDNN."""
    builds_here = cpu_kernels.failure() is None  # else it stops earlier (architecture, instruction set)
    monkeypatch.setenv("MLA_KERNEL_CACHE", str(tmp_path / "kernels"))  # a fresh cache: nothing built there yet
    monkeypatch.setenv("CXX", os.environ.get("CXX", "c++"))  # restored afterwards
    try:
        for compiler, said in ((None, "no C++ compiler found"), ("false", "building the typed CPU operators with "
                                                                           "false failed")):
            monkeypatch.setattr(cpu_ops, "_compiler", lambda c=compiler: c)
            _clear_kernel_caches()
            why = cpu_kernels.failure()
            assert why is not None and (said in why or not builds_here), why
            plan = kernel_plan()
            assert not plan.row_kernels and why in plan.info(torch.float32)["reason"] + plan.float_failure
            packed = PackedWeight.make(torch.randn(16, 32), plan)
            assert packed is None or not packed.row_kernel
    finally:
        _clear_kernel_caches()


def test_a_failed_build_names_the_compilers_error(tmp_path):
    """Where the compiler rejects a source, the reason given is its own diagnostic line, not the builder's summary.
    (In a process of its own: this one has the operators loaded.)"""
    if cpu_kernels.failure() is not None:
        pytest.skip(f"the kernels do not build here: {cpu_kernels.failure()}")
    real = cpu_ops._compiler()
    fake = tmp_path / "cxx"  # answers the builder's questions as the real one, and rejects every source
    said = "gemv_f32.c:1:1: error: no such intrinsic"
    fake.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo "{said}" >&2; exit 1;; esac\nexec {real} "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "MLA_KERNEL_CACHE": str(tmp_path / "kernels"), "CXX": str(fake)}
    out = subprocess.run([sys.executable, "-c", "from mla_kernels import cpu_ops; print(cpu_ops.failure())"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"building the typed CPU operators with {fake} failed: {said}" in out.stdout, out.stdout


def test_the_build_finds_ninja_from_its_package_off_path(tmp_path):
    """A program run from a virtual environment that was not activated has no ninja on ``$PATH``: the build takes the
    one the ``ninja`` package installed. (A child process with an empty ``$PATH``, a fresh cache and the compiler that
    rejects every source of the test above: the compiler's own error shows that ninja ran it.)"""
    if cpu_kernels.failure() is not None:
        pytest.skip(f"the kernels do not build here: {cpu_kernels.failure()}")
    real = shutil.which(cpu_ops._compiler() or "c++")
    fake = tmp_path / "cxx"
    said = "gemv_f32.c:1:1: error: no such intrinsic"
    fake.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo "{said}" >&2; exit 1;; esac\nexec {real} "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "MLA_KERNEL_CACHE": str(tmp_path / "kernels"), "CXX": str(fake), "PATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", "from mla_kernels import cpu_ops; print(cpu_ops.failure())"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"building the typed CPU operators with {fake} failed: {said}" in out.stdout, out.stdout


def test_the_kernel_library_is_built_once_per_machine(tmp_path, monkeypatch):
    """The library lives in the cache folder under a digest of what it is built from (sources, headers, flags,
    compiler, torch): every process with the same inputs loads that build, and a change of any makes another."""
    if cpu_kernels.failure() is not None:
        pytest.skip(f"the kernels do not build here: {cpu_kernels.failure()}")
    cxx = cpu_ops._compiler()
    assert cxx is not None
    key = cpu_ops.build_key(cxx)
    assert cpu_ops.build_key(cxx) == key
    built = cpu_ops.cache_dir() / f"ops-{key}"
    assert list(built.glob(f"{cpu_ops.NAME}*.so")), f"the library this process loaded is kept in {built}"
    monkeypatch.setattr(cpu_ops, "CFLAGS", (*cpu_ops.CFLAGS, "-DMLA_OTHER_BUILD"))
    assert cpu_ops.build_key(cxx) != key
    monkeypatch.undo()
    monkeypatch.setattr(cpu_ops, "HEADERS", (*cpu_ops.HEADERS, Path(cpu_ops.__file__)))
    assert cpu_ops.build_key(cxx) != key


def test_an_unwritable_kernel_cache_builds_for_the_process(tmp_path, monkeypatch):
    """A cache folder that cannot be made (here: under a regular file) gives a private build folder for the process
    (removed once the library is loaded), and the regular file is left as it was."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MLA_KERNEL_CACHE", str(blocker / "kernels"))
    folder, private = cpu_ops._build_folder("somekey")
    try:
        assert private and folder.is_dir() and not str(folder).startswith(str(blocker))
        assert blocker.read_text() == "not a folder"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    monkeypatch.setenv("MLA_KERNEL_CACHE", str(tmp_path / "ok"))
    assert cpu_ops._build_folder("somekey") == (tmp_path / "ok" / "ops-somekey", False)


def test_with_the_row_kernels_no_product_takes_aten():
    """The kernels take every product of up to ``KERNEL_MAX_ROWS`` (>= ``FEW_ROWS``) rows, so a weight they serve
    never takes F.linear; without them (``onednn``) a small one's few-row products do."""
    assert cpu_gemm.KERNEL_MAX_ROWS >= cpu_gemm.FEW_ROWS
    for mode in ("auto", "onednn"):
        packed = PackedWeight.make(torch.randn(96, 64), kernel_plan(mode))
        if packed is None:  # oneDNN cannot pack float32 on this CPU
            continue
        assert packed.aten_max_rows == (0 if packed.row_kernel else cpu_gemm.FEW_ROWS)


def test_capabilities_without_torchs_call_come_from_cpuinfo(monkeypatch):
    """torch before 2.11 has no ``torch.cpu.get_capabilities`` (aarch64's CPU-only wheels on PyPI end at 2.10): the
    capabilities then come from ``/proc/cpuinfo`` under torch's names, so that the compiled kernels and the native
    bfloat16 path are still found."""
    x86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 amx_bf16\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd asimdhp sve bf16 svebf16\nCPU implementer\t: 0x41\n"
    assert cpu_ops.capabilities_from_cpuinfo(x86) == dict.fromkeys(
        ["fpu", "sse2", "avx2", "fma3", "f16c", "avx512_f", "avx512_bw", "avx512_vl", "avx512_bf16", "amx_bf16"], True)
    assert cpu_ops.capabilities_from_cpuinfo(arm) == dict.fromkeys(
        ["fp", "neon", "fp16_arith", "sve", "bf16", "sve_bf16"], True)
    assert native_arithmetic(torch.bfloat16, cpu_ops.capabilities_from_cpuinfo(arm)) == ["bf16", "sve_bf16"]
    if Path("/proc/cpuinfo").exists() and hasattr(torch.cpu, "get_capabilities"):  # this CPU: both agree
        ours = cpu_ops.capabilities_from_cpuinfo(Path("/proc/cpuinfo").read_text())
        theirs = torch.cpu.get_capabilities()
        for key in ("avx2", "fma3", "f16c", "avx512_f", "avx512_bw", "avx512_vl", "avx512_bf16", "amx_bf16",
                    "avx512_vnni", "neon", "bf16", "sve"):
            assert bool(ours.get(key)) == bool(theirs.get(key)), key
    cpu_ops.cpu_capabilities.cache_clear()
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    try:
        assert cpu_ops.cpu_capabilities() == (cpu_ops.capabilities_from_cpuinfo(Path("/proc/cpuinfo").read_text())
                                              if Path("/proc/cpuinfo").exists() else {})
    finally:
        cpu_ops.cpu_capabilities.cache_clear()


def test_a_failed_half_precision_fast_path_falls_back_by_a_rule(monkeypatch):
    """Without oneDNN's half-precision path: F.linear in that dtype where the CPU computes in it natively, a float32
    copy where it does not; decided from the CPU's capabilities, never by a timing."""
    monkeypatch.setattr(cpu_ops, "isa_cap", lambda: "amx")  # what the CPU has decides, under no $MLA_CPU_ISA
    for caps, path in (({"avx512_bf16": True}, "plain"), ({}, "upcast")):
        monkeypatch.setattr(cpu_ops, "cpu_capabilities", lambda caps=caps: caps)
        choice = kernel_plan_module._choice(torch.bfloat16, "plain")  # plain: the probe's failure
        assert choice.path == path and choice.compute_dtype == (torch.bfloat16 if path == "plain" else torch.float32)


# -- the compiled absorbed decode and RMSNorm --------------------------------------------------------------------
@needs_row_kernel
@pytest.mark.parametrize("rows, heads, dims, threads", [
    (1, 16, (64, 64, 512, 64), 2),   # the benchmark checkpoint's layer, one decode
    (8, 16, (64, 64, 512, 64), 2),   # batch 8
    (3, 5, (16, 8, 72, 24), 2),      # an odd head count (groups of 3 and 2) and column tails
    (2, 6, (8, 8, 40, 8), 4),        # more threads than a group needs; d_c not a multiple of 32
    (5, 3, (16, 16, 64, 16), 1),
    (2, 4, (16, 16, 96, 40), 2),     # a column block and a tail of 32 with 16 lanes
])
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["avx2", "avx512"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8,
                                         torch.float8_e4m3fn])
def test_absorbed_decode_kernel_matches_the_planned_torch_path(rows, heads, dims, threads, weights, variant,
                                                               cache_dtype):
    """One call equals absorption + ``mla_decode_planned`` + up-projection (the torch path it replaces) for rows of
    different lengths, with a cache whose unused rows hold NaN (never read); with bfloat16 absorbed factors (int8
    models), it equals the torch path over the same bfloat16 values; over a bfloat16, float16, int8 or float8_e4m3fn
    cache (the last two with their per-token scales), it gives the float32 cache's bits for the same (dequantised)
    values. Each variant (AVX2, AVX-512: one source compiled for each); a variant
    this CPU cannot execute is skipped by name."""
    if variant not in cpu_kernels.variants("float"):
        pytest.skip(f"this CPU does not execute the attention's {variant} variant (it runs "
                    f"{list(cpu_kernels.variants('float'))})")
    d_n, d_r, d_c, d_v = dims
    g = torch.Generator().manual_seed(rows * heads)
    block, blocks = 4, 24
    cache = torch.full((blocks, block, d_c + d_r), float("nan"))
    lens = [1 + (7 * i + 3) % 37 for i in range(rows)]
    tables = [torch.randperm(blocks, generator=g)[: -(-n // block)].tolist() for n in lens]
    plan = plan_decode_lists(tables, lens, block)
    flat = cache.view(-1, d_c + d_r)
    flat[plan.slots.unique()] = torch.randn(plan.slots.unique().numel(), d_c + d_r, generator=g)
    q = torch.randn(rows, heads, d_n + d_r, generator=g)
    q_n, q_r = q.split([d_n, d_r], dim=-1)
    w_uk, w_uv_t = torch.randn(heads, d_n, d_c, generator=g), torch.randn(heads, d_c, d_v, generator=g) / d_c ** 0.5
    stored = w_uk.to(weights), w_uv_t.to(weights)
    w_uk, w_uv_t = (w.float() for w in stored)  # the values the kernel reads
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_kernels.ops().absorbed_decode(q_n, q_r, *stored, flat, plan.slots, plan.lens, 0.1, variant)
    finally:
        torch.set_num_threads(before)
    q_abs = torch.bmm(q_n.transpose(0, 1), w_uk).transpose(0, 1)
    o_lat = mla_decode_planned(torch.cat([q_abs, q_r], dim=-1), cache, plan, 0.1, d_c)
    want = torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)
    assert got.shape == (rows, heads, d_v) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if cache_dtype != torch.float32:
        scales = None
        if cache_dtype in (torch.int8, torch.float8_e4m3fn):  # each part with its scale, as the latent store keeps it
            (qc, sc), (qr, sr) = (quantize_per_token(part, cache_dtype) for part in flat.split([d_c, d_r], dim=-1))
            compact, scales = torch.cat([qc, qr], dim=-1), torch.stack([sc, sr], dim=-1)
            values = dequantize_rows(compact, scales, d_c)
        else:
            compact = flat.to(cache_dtype)
            values = compact.float()
        torch.set_num_threads(threads)
        try:
            got = cpu_kernels.ops().absorbed_decode(q_n, q_r, *stored, compact, plan.slots, plan.lens, 0.1, variant,
                                                    scales)
            same = cpu_kernels.ops().absorbed_decode(q_n, q_r, *stored, values, plan.slots, plan.lens, 0.1, variant)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(got, same)
        o_lat = mla_decode_planned(torch.cat([q_abs, q_r], dim=-1), values.view_as(cache), plan, 0.1, d_c)
        want = torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_row_kernel
@pytest.mark.parametrize("heads, dims", [(16, (64, 64, 512, 64)), (6, (16, 16, 32, 24)), (3, (16, 8, 72, 24)),
                                         (2, (8, 8, 40, 20))])
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["avx2", "avx512"])
def test_absorbed_decode_gives_a_row_the_same_bits_whatever_rows_share_the_call(heads, dims, weights, variant):
    """A decode's attention does not depend on the batch it is in: each row of a call of 12 equals the same row
    computed alone and among 2, 3 and 5 (the absorption and up-projection of one row sum in the order of many, and
    the threads' split by rows or by heads computes each head the same way). Over int8-rounding formats a last-bit
    difference here parts a batch from the prompts alone."""
    if variant not in cpu_kernels.variants("float"):
        pytest.skip(f"this CPU does not execute the attention's {variant} variant (it runs "
                    f"{list(cpu_kernels.variants('float'))})")
    d_n, d_r, d_c, d_v = dims
    g = torch.Generator().manual_seed(heads)
    rows, keys = 12, 300
    q_n, q_r = torch.randn(rows, heads, d_n, generator=g), torch.randn(rows, heads, d_r, generator=g)
    w_uk = (torch.randn(heads, d_n, d_c, generator=g) / d_n ** 0.5).to(weights)
    w_uv_t = (torch.randn(heads, d_c, d_v, generator=g) / d_c ** 0.5).to(weights)
    cache = torch.randn(keys, d_c + d_r, generator=g)
    lens = torch.randint(1, 90, (rows,), generator=g)
    slots = torch.stack([torch.randperm(keys, generator=g)[:90] for _ in range(rows)])
    call = cpu_kernels.ops().absorbed_decode
    together = call(q_n, q_r, w_uk, w_uv_t, cache, slots, lens, 0.1, variant)
    for m in (1, 2, 3, 5):
        for t in range(0, rows - m + 1, 4):
            part = call(q_n[t:t + m].clone(), q_r[t:t + m].clone(), w_uk, w_uv_t, cache, slots[t:t + m].clone(),
                        lens[t:t + m].clone(), 0.1, variant)
            assert torch.equal(part, together[t:t + m]), (m, t)


@needs_row_kernel
def test_absorbed_decode_kernel_rejects_what_it_cannot_compute():
    q = torch.randn(1, 2, 16)
    slots, lens = torch.zeros(1, 4, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    w_uk, w_uv_t, cache = torch.randn(2, 8, 16), torch.randn(2, 16, 8), torch.randn(4, 24)
    for bad, said in ((dict(cache=cache.double()), "cache must be a float32, bfloat16, float16, int8 or "
                                                   "float8_e4m3fn tensor, got Double"),
                      (dict(cache=cache.t().contiguous().t()), "cache must be a contiguous CPU Float tensor"),
                      (dict(cache=cache.to(torch.int8)), "an int8 or float8_e4m3fn cache comes with its scales"),
                      (dict(scales=torch.ones(4, 2)), "a float cache has no scales"),
                      (dict(cache=cache.to(torch.int8), scales=torch.ones(4, 3)), "scales must be a contiguous CPU "
                                                                                  r"Float tensor \[4, 2\]"),
                      (dict(lens=lens.int()), "lens must be a contiguous CPU Long tensor"),
                      (dict(w_uk=torch.randn(2, 8, 15)), "w_uv_t must be"), (dict(cache=torch.randn(4, 20)), "cache"),
                      (dict(slots=torch.full((1, 4), 4)), "reads cache slot 4, the cache holds 4"),
                      (dict(slots=torch.full((1, 4), -1)), "reads cache slot -1"),
                      (dict(lens=torch.tensor([5])), "row 0 reads 5 keys of 4 slots"),
                      (dict(lens=torch.tensor([0])), "row 0 reads 0 keys")):
        args = dict(q_n=q[..., :8], q_r=q[..., 8:], w_uk=w_uk, w_uv_t=w_uv_t, cache=cache, slots=slots, lens=lens)
        args.update(bad)
        with pytest.raises(ValueError, match=said):
            cpu_kernels.ops().absorbed_decode(scale=1.0, **args)


# -- the compiled prefill attention -------------------------------------------------------------------------------
def _prefill_case(q_lens: list[int], k_lens: list[int], heads: int, dims: tuple[int, int, int], seed: int):
    """Queries, keys and values laid out as the model makes them: q_n / q_r views of one projection, k_n / v views of
    the up-projection, k_r a view of the gathered latent rows."""
    d_n, d_r, d_v = dims
    g = torch.Generator().manual_seed(seed)
    q_n, q_r = torch.randn(sum(q_lens), heads, d_n + d_r, generator=g).split([d_n, d_r], dim=-1)
    k_n, v = torch.randn(sum(k_lens), heads, d_n + d_v, generator=g).split([d_n, d_v], dim=-1)
    k_r = torch.randn(sum(k_lens), 40 + d_r, generator=g)[:, 40:]
    cu_q, cu_k = [0], [0]
    for q_len, k_len in zip(q_lens, k_lens):
        cu_q.append(cu_q[-1] + q_len)
        cu_k.append(cu_k[-1] + k_len)
    return (q_n, q_r, k_n, k_r, v), cu_q, cu_k


@needs_row_kernel
@pytest.mark.parametrize("q_lens, k_lens, heads, dims", [
    ([128], [128], 16, (64, 64, 64)),                    # the benchmark checkpoint's layer, a 128-token prompt
    ([37, 5, 1, 64], [37, 20, 9, 100], 3, (16, 8, 24)),  # chunks after cached context, a one-row chunk, tails of 4 rows
    ([7, 33], [7, 90], 5, (12, 6, 10)),                  # widths no vector divides: the scalar values
    ([0, 3, 40], [4, 3, 40], 2, (128, 64, 128)),         # an empty chunk; DeepSeek-V3's head widths
])
@pytest.mark.parametrize("variant", ["avx2", "avx512"])
@pytest.mark.parametrize("threads, dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16),
                                            (2, torch.float16)])
def test_prefill_attention_kernel_matches_the_reference(q_lens, k_lens, heads, dims, variant, threads, dtype):
    """The compiled prefill attention equals the reference causal attention (bottom-right aligned, float64) and its
    log-sum-exp, for each variant (AVX2, AVX-512: one source compiled for each); a variant this CPU cannot execute is
    skipped by name. Half-precision inputs are widened exactly: the float32 sums over their values."""
    if variant not in cpu_kernels.variants("float"):
        pytest.skip(f"this CPU does not execute the attention's {variant} variant (it runs "
                    f"{list(cpu_kernels.variants('float'))})")
    tensors, cu_q, cu_k = _prefill_case(q_lens, k_lens, heads, dims, sum(q_lens))
    q_n, q_r, k_n, k_r, v = (t.to(dtype) for t in tensors)
    scale = (dims[0] + dims[1]) ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = cpu_kernels.ops().prefill_attention(q_n, q_r, k_n, k_r, v, cu_q, cu_k, scale, variant)
    finally:
        torch.set_num_threads(before)
    want_out, want_lse = [], []
    for b, (q_len, k_len) in enumerate(zip(q_lens, k_lens)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        s = (torch.einsum("thd,shd->hts", q_n[rows].double(), k_n[keys].double())
             + torch.einsum("thd,sd->hts", q_r[rows].double(), k_r[keys].double())) * scale
        s = s.masked_fill(torch.ones(q_len, k_len, dtype=torch.bool).triu(k_len - q_len + 1), float("-inf"))
        want_lse.append(torch.logsumexp(s, -1).transpose(0, 1))
        want_out.append(torch.einsum("hts,shd->thd", torch.softmax(s, -1), v[keys].double()))
    assert out.shape == (sum(q_lens), heads, dims[2]) and lse.shape == (sum(q_lens), heads)
    torch.testing.assert_close(out.double(), torch.cat(want_out), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), torch.cat(want_lse), rtol=1e-5, atol=1e-5)


@needs_row_kernel
def test_prefill_attention_kernel_takes_keys_and_values_of_any_strides():
    """Keys and values whose elements are not contiguous (a transposed view) give the bits of their contiguous
    copies: the operator copies each head's into its own layout, whatever the input's."""
    (q_n, q_r, k_n, k_r, v), cu_q, cu_k = _prefill_case([21, 9], [40, 9], 3, (16, 8, 24), 0)
    k_t = k_n.permute(0, 2, 1).contiguous().permute(0, 2, 1)  # [S, H, d_n] with the heads innermost
    v_t = v.permute(0, 2, 1).contiguous().permute(0, 2, 1)
    assert k_t.stride(2) != 1 and v_t.stride(2) != 1
    want = cpu_kernels.ops().prefill_attention(q_n, q_r, k_n.contiguous(), k_r.contiguous(), v.contiguous(), cu_q,
                                               cu_k, 0.3)
    got = cpu_kernels.ops().prefill_attention(q_n, q_r, k_t, k_r, v_t, cu_q, cu_k, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_row_kernel
def test_prefill_attention_kernel_rejects_what_it_cannot_compute():
    (q_n, q_r, k_n, k_r, v), cu_q, cu_k = _prefill_case([3], [5], 2, (8, 4, 6), 0)
    for bad, said in ((dict(q_n=q_n.double()), "are all float32, bfloat16 or float16, got Double"),
                      (dict(v=v.bfloat16()), "are all float32, bfloat16 or float16, got Float, Float, Float, Float "
                                             "and BFloat16"),
                      (dict(k_r=k_r[:4]), r"k_n, k_r and v must be \[S, 2, 8\], \[S, 4\] and \[S, 2, \*\] .*got "
                                          r"\[5, 2, 8\], \[4, 4\] and \[5, 2, 6\]"),
                      (dict(v=v.transpose(0, 2)), r"got \[5, 2, 8\], \[5, 4\] and \[6, 2, 5\]"),
                      (dict(cu_q=[0, 4], cu_k=[0, 5]), "cu_q and cu_k are"),
                      (dict(cu_q=[0, 3, 3], cu_k=[0, 2, 5]), "sequence 0 has 3 rows and 2 keys")):
        args = dict(q_n=q_n, q_r=q_r, k_n=k_n, k_r=k_r, v=v, cu_q=cu_q, cu_k=cu_k)
        args.update(bad)
        with pytest.raises(ValueError, match=said):
            cpu_kernels.ops().prefill_attention(scale=1.0, **args)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefills_take_the_compiled_attention_with_the_torch_logits(tiny_checkpoint, monkeypatch, dtype):
    """Where the kernels build, each layer of a prefill (a whole prompt, then a chunk after cached context: the
    up-projected path forced, which short chunks would otherwise leave for the decode plan) attends by the compiled
    prefill attention: a float32 model's with the logits of torch's flash kernel (the kernel left out). A bfloat16
    model's logits are not compared: on this random tiny model, 0.2 % of noise on one attention output moves them by
    40 %, so both kernels land 10-40 % from the float32 model's, and which is nearer varies with the prompts (the
    kernel's own test checks its half-precision inputs)."""
    from mla_runtime.attention import CpuBackend

    ckpt, _ = tiny_checkpoint("v3")
    ps = prompts([30, 12, 7], seed=5)
    calls = spy_ops(monkeypatch, "prefill_attention")["prefill_attention"]
    logits = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(CpuBackend, "up_projected", PagedBackend.up_projected)
        model = load_model(ckpt, dtype=dtype, attention_path="naive")
        runner = PagedRunner(model, len(ps), 48)
        calls.clear()
        steps = [runner.step({i: p[:-4] for i, p in enumerate(ps)}), runner.step({i: p[-4:] for i, p in enumerate(ps)})]
        expected = 2 * model.config.num_hidden_layers if compiled and kernel_plan().row_kernels else 0
        assert len(calls) == expected
        logits.append(torch.cat([torch.cat([s[i] for i in range(len(ps))]) for s in steps]).float())
    assert all(torch.isfinite(x).all() for x in logits)
    if dtype == "float32":
        assert rel_err(logits[0], logits[1]) <= 1e-5


@needs_row_kernel
@pytest.mark.parametrize("shape", [(1, 1024), (3, 77), (2, 4, 40)])
def test_rms_norm_kernel_matches_torch(shape):
    g = torch.Generator().manual_seed(len(shape))
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-6), F.rms_norm(x, (shape[-1],), w, 1e-6))
    wide = torch.randn(shape[0], 2 * shape[-1], generator=g)  # rows with a stride: a split's first part
    part = wide[:, : shape[-1]]
    torch.testing.assert_close(cpu_kernels.rms_norm(part, w, 1e-6), F.rms_norm(part, (shape[-1],), w, 1e-6))


def test_rms_norm_module_with_and_without_the_kernel(monkeypatch):
    """Prepared float32 norms take the kernel under auto where it builds (a few rows only), F.rms_norm otherwise."""
    x = torch.randn(5, 64)
    for mode in ("auto", "onednn"):
        norm = RMSNorm(64, 1e-6)
        norm.weight.data.normal_()
        norm.prepare_inference(kernel_plan(mode))
        assert norm.kernel == (mode == "auto" and cpu_kernels.failure() is None)
        for rows in (x, torch.randn(norm_module.KERNEL_MAX_ROWS + 1, 64)):
            torch.testing.assert_close(norm(rows), F.rms_norm(rows, (64,), norm.weight, 1e-6))


def test_decode_plans_carry_each_rows_length():
    tables, lens = [[3, 1], [0], [2, 4, 5]], [5, 2, 9]
    host = plan_decode_lists(tables, lens, 4)
    padded = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32)
    device = plan_decode(padded, torch.tensor(lens, dtype=torch.int32), 4)
    assert host.lens.tolist() == device.lens.tolist() == lens and host.lens.dtype == device.lens.dtype == torch.int64


@needs_row_kernel
def test_gated_mlp_table_matches_torch_for_float32_and_int8_weights():
    """The one-row kernel sums weighted gated MLPs of either weight kind, in the order given."""
    g = torch.Generator().manual_seed(5)
    d, inters = 40, (16, 24, 8)
    mlps = [(torch.randn(2 * i, d, generator=g), torch.randn(d, i, generator=g)) for i in inters]
    q = [torch.randint(-127, 128, (2 * inters[2], d), generator=g, dtype=torch.int8),
         torch.randint(-127, 128, (d, inters[2]), generator=g, dtype=torch.int8)]
    scales = [torch.rand(2 * inters[2], generator=g) / 64, torch.rand(d, generator=g) / 64]
    table = cpu_tables.GatedMLPTable([mlps[0], mlps[1], ((q[0], scales[0]), (q[1], scales[1]))])
    dense = [mlps[0], mlps[1], (q[0].float() * scales[0][:, None], q[1].float() * scales[1][:, None])]

    def mlp(x, gate_up, down):
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down)

    x = torch.randn(1, d, generator=g)
    for ids, weights in (([0], [1.0]), ([2, 0, 1], [0.5, -1.5, 2.0]), ([1, 1], [1.0, 1.0])):
        want = sum(w * mlp(x, *dense[i]) for i, w in zip(ids, weights))
        torch.testing.assert_close(table(x, ids, weights), want, rtol=1e-4, atol=1e-4)
    for ids, weights, bad in (([3], [1.0], torch.randn(1, d)), ([0], [], torch.randn(1, d)),
                              ([0], [1.0], torch.randn(2, d)), ([0], [1.0], torch.randn(1, d).double())):
        with pytest.raises(ValueError, match="gated_mlps: (MLP 3 of 3|one weight per MLP|one float32 CPU row of 40)"):
            table(bad, ids, weights)
    with pytest.raises(ValueError, match="MlpTable: gate_up: the weight must be a contiguous CPU Float tensor"):
        cpu_tables.GatedMLPTable([(mlps[0][0].t().contiguous(), mlps[0][1])])
    with pytest.raises(ValueError, match="MlpTable: down: the row scales must be"):
        cpu_tables.GatedMLPTable([((q[0], scales[0]), (q[1], scales[0]))])
    assert table.table.kinds() == ["float32", "float32", "float32", "float32", "int8", "int8"]


@pytest.mark.parametrize("scheme", ["int8", "int4", "w4a16", "w8a8", "mxfp4", "nvfp4"])
def test_one_rows_mlps_in_one_region_have_the_bits_of_several_rows_products(scheme):
    """``mlps_rows``, the whole-layer kernel's MLPs of a step's rows (each MLP's outputs apart, unweighted): for one
    row every MLP's products run in one parallel region (``mla_mlps_row``), for several expert by expert as whole
    products; a row's output through each MLP has the same bits both ways, in the quantised formats (those whose bits
    a row must keep in any batch: ``DeepseekForCausalLM.rows_invariant``; float32 weights' one-row and few-row
    kernels sum in different orders, and such a model's float products take oneDNN instead)."""
    if cpu_kernels.failure() is not None:
        pytest.skip(f"the kernels do not build here: {cpu_kernels.failure()}")
    from mla_runtime.kernel_plan import kernel_plan
    from mla_runtime.layers.fp4 import Mxfp4Weight, Nvfp4Weight
    from mla_runtime.layers.int4 import Int4Weight, W4A16Weight
    from mla_runtime.layers.w8a8 import W8A8Weight

    g = torch.Generator().manual_seed(11)
    d, inters, keep = 256, (128, 256), []

    def operand(w: torch.Tensor):  # type: ignore[no-untyped-def]
        if scheme == "int8":
            scale = w.abs().amax(dim=1) / 127
            return (w / scale[:, None]).round().to(torch.int8), scale
        kind = {"int4": Int4Weight, "w4a16": W4A16Weight, "w8a8": W8A8Weight, "mxfp4": Mxfp4Weight,
                "nvfp4": Nvfp4Weight}[scheme]
        keep.append(kind.quantize(w).bind(kernel_plan()))  # the table points into its scales
        found = keep[-1].row_operand()
        if found is None:
            pytest.skip(f"{scheme}'s kernel does not run here")
        return found

    table = cpu_tables.GatedMLPTable([(operand(torch.randn(2 * i, d, generator=g) / 16),
                                       operand(torch.randn(d, i, generator=g) / 16)) for i in inters])
    x = torch.randn(5, d, generator=g)
    ids, rows = [0, 1, 0], [[0, 3], [1, 4, 0], [2]]
    many = table.mlps_rows(x, ids, rows)
    assert many.shape == (6, d) and bool((many != 0).any())
    at = 0
    for i, group in zip(ids, rows):
        for r in group:
            assert torch.equal(table.mlps_rows(x[r:r + 1], [i], [[0]])[0], many[at])
            at += 1
    both = table.mlps_rows(x[3:4], [1, 0], [[0], [0]])  # two MLPs of one row, one region
    assert torch.equal(both[1], many[1]) and torch.equal(both[0], table.mlps_rows(x[3:4], [1], [[0]])[0])
    with pytest.raises(ValueError, match="mlps_rows: 1 to 8 rows where an MLP is not in ggml block types, got 9"):
        table.mlps_rows(torch.randn(9, d), [0], [[0]])


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_one_token_moe_and_mlp_with_and_without_the_kernel(quantization, monkeypatch):
    """A prepared MoE layer (routed and shared experts) and a dense MLP give one token the same output through the
    compiled kernel (auto) as through the per-product path (onednn), float32 or int8; a quantised layer makes its
    table again from the int8 weights."""
    from mla_runtime.layers.mlp import GatedMLP
    from mla_runtime.layers.quantization import quantize_model

    cfg = MoEConfig(n_routed_experts=6, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64,
                    scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    outs = {}
    for mode in ("auto", "onednn"):
        plan = kernel_plan(mode)
        g = torch.Generator().manual_seed(0)
        layer = nn.ModuleDict({"moe": moe_module.MoE(cfg, 64, torch.float32), "mlp": GatedMLP(64, 128, torch.float32)})
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
        for m in layer.modules():
            if m is not layer and hasattr(m, "prepare_inference"):
                m.prepare_inference(plan)
        first = layer["moe"](x)  # made with the float weights ...
        if quantization:
            layer.lm_head_weight = torch.randn(8, 64)  # what quantize_model expects of a model
            quantize_model(layer, quantization, plan)  # ... and made again from the int8 ones
        outs[mode] = (layer["moe"](x), layer["mlp"](x))
        kernel = mode == "auto" and cpu_kernels.failure() is None
        tables = (layer["moe"].experts.row_table, layer["mlp"].row_table)
        assert all(isinstance(t, cpu_tables.GatedMLPTable) == kernel for t in tables)
        if kernel:
            assert set(tables[0].table.kinds()) == {"int8" if quantization else "float32"}
        assert first.shape == x.shape
    tol = 1e-5 if quantization is None else 3e-2  # int8 on onednn: ATen's kernel rounds the rows to bfloat16
    for a, b in zip(outs["auto"], outs["onednn"]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


@pytest.mark.parametrize("router", [
    dict(scoring_func="softmax", topk_method="greedy", num_experts_per_tok=2),
    dict(scoring_func="softmax", topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=3),
    dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=2, topk_group=1, num_experts_per_tok=2,
         norm_topk_prob=True),
    dict(scoring_func="sigmoid", topk_method="noaux_tc", num_experts_per_tok=1, routed_scaling_factor=2.5),
])
def test_one_token_moe_kernel_routes_as_the_router(router, monkeypatch):
    """The compiled MoE row (router logits, routing, experts, shared experts in one call) equals the Router module and
    the per-expert path for DeepSeek-V2's and V3's routings, over tokens whose routes differ."""
    cfg = MoEConfig(n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32, **router)
    outs = {}
    for mode in ("auto", "onednn"):
        moe = moe_module.MoE(cfg, 48, torch.float32)
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        for m in moe.modules():
            if hasattr(m, "prepare_inference"):
                m.prepare_inference(kernel_plan(mode))
        xs = torch.randn(12, 1, 48, generator=torch.Generator().manual_seed(9))
        outs[mode] = torch.cat([moe(x) for x in xs])
        kernel = mode == "auto" and cpu_kernels.failure() is None
        assert isinstance(moe.experts.row_table, cpu_tables.GatedMLPTable) == kernel
    torch.testing.assert_close(outs["auto"], outs["onednn"], rtol=1e-5, atol=1e-5)
    routes = {tuple(moe.gate(x)[1].sort().values.tolist()[0]) for x in xs}
    assert len(routes) > 1  # the tokens exercise more than one route


@needs_row_kernel
def test_absorbed_decode_kernel_splits_rows_and_heads_it_cannot_hold_at_once():
    """Heads beyond a thread's group (256) take more threads than torch's, and rows beyond the scratch bound (64 MiB
    a call) go in several calls: on one thread, 300 heads of a 512-wide latent run as two groups of 150, and 60 rows
    as calls of 54 and 6. The result is still the torch path's."""
    g = torch.Generator().manual_seed(4)
    rows, heads, d_n, d_r, d_c, d_v = 60, 300, 8, 8, 512, 8
    cache = torch.randn(24, 4, d_c + d_r, generator=g)
    lens = [1 + (5 * i) % 17 for i in range(rows)]
    plan = plan_decode_lists([list(range(i % 19, i % 19 + 5)) for i in range(rows)], lens, 4)
    q_n, q_r = torch.randn(rows, heads, d_n + d_r, generator=g).split([d_n, d_r], dim=-1)
    w_uk, w_uv_t = torch.randn(heads, d_n, d_c, generator=g), torch.randn(heads, d_c, d_v, generator=g) / d_c ** 0.5
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = cpu_kernels.ops().absorbed_decode(q_n, q_r, w_uk, w_uv_t, cache.view(-1, d_c + d_r), plan.slots,
                                                plan.lens, 0.2)
    finally:
        torch.set_num_threads(before)
    q_abs = torch.bmm(q_n.transpose(0, 1), w_uk).transpose(0, 1)
    o_lat = mla_decode_planned(torch.cat([q_abs, q_r], dim=-1), cache, plan, 0.2, d_c)
    torch.testing.assert_close(got, torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1), rtol=1e-4, atol=1e-4)


@needs_row_kernel
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_store_kernel_matches_the_torch_latent_side(interleave, cache_dtype):
    """Norm, RoPE and cache write of the latent and the queries' RoPE in one call equal RMSNorm + RotaryEmbedding +
    write_latent; into a bfloat16 or float16 cache, the float32 rows rounded as torch rounds them."""
    g = torch.Generator().manual_seed(int(interleave))
    rows, heads, d_n, d_r, d_c = 3, 5, 8, 16, 40
    rope = RotaryEmbedding(RopeConfig(theta=10000.0, interleave=interleave), d_r)
    norm = RMSNorm(d_c, 1e-6)
    norm.weight.data.normal_(generator=g)
    positions = torch.tensor([0, 7, 130])
    tables = rope.tables(positions, torch.float32)
    latent = torch.randn(rows, d_c + d_r + 24, generator=g)[:, : d_c + d_r]  # rows with a stride, as a split leaves
    q = torch.randn(rows, heads, d_n + d_r, generator=g)
    slots = torch.tensor([5, 0, 9])
    cache, want_cache = torch.zeros(12, d_c + d_r), torch.zeros(1, 12, d_c + d_r)
    q_r, k_r = rope(positions, q[..., d_n:], latent[:, d_c:], tables)
    write_latent(want_cache, F.rms_norm(latent[:, :d_c], (d_c,), norm.weight, 1e-6), k_r, slots)
    want_q = torch.cat([q[..., :d_n], q_r], dim=-1)
    q_in = q.clone()
    cpu_kernels.ops().rope_store(latent, norm.weight, 1e-6, q, d_n, tables.cos, tables.sin, cache, slots, interleave)
    assert tables.cos.stride(0) != tables.cos.shape[1]  # the table's rows, with a stride
    torch.testing.assert_close(cache, want_cache[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    if cache_dtype != torch.float32:
        compact = torch.zeros(12, d_c + d_r, dtype=cache_dtype)
        cpu_kernels.ops().rope_store(latent, norm.weight, 1e-6, q_in, d_n, tables.cos, tables.sin, compact, slots,
                                     interleave)
        assert torch.equal(compact, cache.to(cache_dtype))  # the kernel's own float32 rows, rounded as torch does
        assert torch.equal(q_in, q)


@needs_row_kernel
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_rope_store_kernel_quantises_like_torch(cache_dtype):
    """Into an int8 or float8_e4m3fn cache, the latent side stores each part of its float32 row quantised as
    ``quantize_per_token`` does (the same bytes, the same scales): on random rows, and on a RoPE key of every value
    on the grid and every midpoint between two (ties round to even), with the identity rotation and a scale of 1."""
    from mla_kernels.common import quantize_per_token

    ops = cpu_kernels.ops()
    g = torch.Generator().manual_seed(9)
    rows, heads, d_n, d_c = 3, 2, 8, 40
    grid = torch.arange(-127, 128).float() if cache_dtype == torch.int8 else \
        torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    values = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])  # the grid, and each tie between neighbours
    d_r = values.numel() + values.numel() % 2
    latent = torch.randn(rows, d_c + d_r, generator=g)
    latent[0, d_c:d_c + values.numel()] = values  # |values| <= 127 / 448, the largest on the grid: scale 1
    norm = torch.randn(d_c, generator=g)
    cos, sin = torch.randn(rows, d_r // 2, generator=g), torch.randn(rows, d_r // 2, generator=g)
    cos[0], sin[0] = 1.0, 0.0  # row 0's rotation is the identity
    slots = torch.tensor([4, 0, 2])
    wide = torch.zeros(6, d_c + d_r)
    ops.rope_store(latent, norm, 1e-6, torch.randn(rows, heads, d_n + d_r), d_n, cos, sin, wide, slots, False)
    assert torch.equal(wide[4, d_c:], latent[0, d_c:])
    cache, scales = torch.zeros(6, d_c + d_r, dtype=cache_dtype), torch.zeros(6, 2)
    ops.rope_store(latent, norm, 1e-6, torch.randn(rows, heads, d_n + d_r), d_n, cos, sin, cache, slots, False,
                   scales)
    for part, cols in enumerate((slice(0, d_c), slice(d_c, d_c + d_r))):
        want, want_scales = quantize_per_token(wide[slots, cols], cache_dtype)
        assert torch.equal(cache[slots, cols].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(scales[slots, part], want_scales)
    assert scales[4, 1] == 1.0
    with pytest.raises(ValueError, match="rope_store: an int8 or float8_e4m3fn cache comes with its scales"):
        ops.rope_store(latent, norm, 1e-6, torch.randn(rows, heads, d_n + d_r), d_n, cos, sin, cache, slots, False)
    with pytest.raises(ValueError, match="rope_store: a float cache has no scales"):
        ops.rope_store(latent, norm, 1e-6, torch.randn(rows, heads, d_n + d_r), d_n, cos, sin, wide, slots, False,
                       scales)


@pytest.mark.parametrize("variant, quantization", [("v3", None), ("v2_greedy_qlora", None), ("v3_noq_halfsplit", None),
                                                   ("v3", "int8"), ("v2_greedy_qlora", "int4")])
def test_a_bfloat16_models_decode_steps_run_compiled_layers_in_float32(tiny_checkpoint, variant, quantization,
                                                                       monkeypatch):
    """Where the kernels build, a bfloat16 model's decode step runs each layer as one compiled call that computes in
    float32 over its bfloat16 weights and cache (the step's hidden state widened, and rounded back to bfloat16 before
    the final norm); where the whole layer cannot (here: left out by hand), its planned rows still attend through the
    compiled attention, the rest call by call. Both give the logits of the torch path to bfloat16 rounding (that path
    rounds every intermediate to bfloat16), and the compiled layers those of the float32 model too; with int8 and int4
    weights as well."""
    from mla_runtime.layers.quantization import quantize_model
    from mla_runtime.models import deepseek

    ckpt, _ = tiny_checkpoint(variant)
    ps = prompts([30, 12, 7], seed=8)
    attention = spy_ops(monkeypatch, "absorbed_decode")["absorbed_decode"]
    layers = _spy_layer_calls(monkeypatch)
    runs = kernel_plan().row_kernels
    whole_layers = deepseek.DeepseekForCausalLM._decode_step
    logits = {}
    for path in ("layers", "attention", "torch", "float32"):
        model = load_model(ckpt, dtype="float32" if path == "float32" else "bfloat16")
        if quantization:
            quantize_model(model, quantization)
        if path != "float32":
            assert all(layer.self_attn.kernels.attention == runs and not layer.self_attn.kernels.decode
                       for layer in model.model.layers)
        for layer in model.model.layers:  # the torch path: the backend's decision for the layer, overruled
            attn = layer.self_attn
            attn.kernels = dataclasses.replace(attn.kernels, attention=attn.kernels.attention and path != "torch")
            model.attention.kernels_of[attn.layer] = attn.kernels
        monkeypatch.setattr(deepseek.DeepseekForCausalLM, "_decode_step",
                            whole_layers if path in ("layers", "float32") else lambda *a: None)
        runner = PagedRunner(model, len(ps), 48)
        runner.step({i: p[:-1] for i, p in enumerate(ps)})
        attention.clear()
        layers.clear()
        out = runner.step({i: p[-1:] for i, p in enumerate(ps)})
        n = model.config.num_hidden_layers
        if path == "layers":
            assert (len(layers), len(attention)) == ((n, 0) if runs else (0, n if runs else 0))
        elif path == "attention":
            assert (len(layers), len(attention)) == (0, n if runs else 0)
            assert all(c[0].dtype == torch.float32 and c[4].dtype == torch.bfloat16 for c in attention)
        elif path == "torch":
            assert (len(layers), len(attention)) == (0, 0)
        logits[path] = torch.cat([out[i] for i in range(len(ps))]).float()
    # measured, layers / attention against torch: 7.3e-3 / 7.6e-3, 1.1e-2 / 1.9e-2 and 1.1e-2 / 1.1e-2 (v3,
    # v2_greedy_qlora, v3_noq_halfsplit), 1.1e-2 / 1.0e-2 (int8), 2.5e-2 / 2.7e-2 (int4, whose rows the torch path
    # rounds to bfloat16 first): bfloat16 rounding. From the float32 model the compiled layers are 1.1e-2 / 1.4e-2 /
    # 1.6e-2 / 2.1e-2, the torch path 1.2e-2 / 1.7e-2 / 1.5e-2 / 2.6e-2; int4 weights quantised from bfloat16 and from
    # float32 values differ (1.0e-1 for both paths), so not compared.
    bound = 5e-2 if quantization == "int4" else 3e-2
    assert rel_err(logits["layers"], logits["torch"]) <= bound
    assert rel_err(logits["attention"], logits["torch"]) <= bound
    if quantization != "int4":
        assert rel_err(logits["layers"], logits["float32"]) <= 3e-2


@pytest.mark.parametrize("cache_dtype", [None, torch.bfloat16, torch.int8])
def test_a_float32_prompt_writes_its_latents_through_the_compiled_norm_and_rope(tiny_checkpoint, monkeypatch,
                                                                               cache_dtype):
    """Where the kernels build, a float32 model's prompt rows (chunks of prompts, not decodes) take the compiled
    norm, RoPE and cache write (``rope_store``, one call a layer) too: the latents it caches and the logits equal the
    torch path's to float rounding, in a float32, bfloat16 or int8 cache."""
    from mla_runtime.attention import CpuBackend

    ckpt, _ = tiny_checkpoint("v3")
    ps = prompts([30, 12, 7], seed=13)
    calls = spy_ops(monkeypatch, "rope_store")["rope_store"]
    runs = kernel_plan().row_kernels
    results = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(CpuBackend, "_compiled_norm", lambda *a: None)
        model = load_model(ckpt, dtype="float32")
        runner = PagedRunner(model, len(ps), 48, cache_dtype=cache_dtype)
        calls.clear()
        out = runner.step({i: p for i, p in enumerate(ps)})
        assert len(calls) == (model.config.num_hidden_layers if compiled and runs else 0)
        written = torch.cat([layer.kv.float().flatten() for layer in runner.cache.layers])
        results.append((torch.cat([out[i] for i in range(len(ps))]), written[written.isfinite()]))
    (logits, cached), (want_logits, want_cached) = results
    # a bfloat16 or int8 cache may round a value the other way (seen capped at AVX2: 3.1e-4 for int8's logits)
    exact = cache_dtype is None
    assert rel_err(logits, want_logits) <= (1e-5 if exact else 2e-3)
    assert rel_err(cached, want_cached) <= (1e-5 if exact else 1e-2)


def test_float32_decode_steps_take_the_compiled_attention_and_match_torch(tiny_checkpoint, monkeypatch):
    """Where the kernels build, every layer of a float32 decode step runs the latent side and the attention as
    compiled calls, with the logits of the torch path (the kernels left out). (The whole layer as one call is left
    out here: see the next test.)"""
    from mla_runtime.attention import CpuBackend
    from mla_runtime.models.deepseek import DeepseekForCausalLM

    monkeypatch.setattr(DeepseekForCausalLM, "_decode_step", lambda *a: None)
    ckpt, _ = tiny_checkpoint("v3")
    ps = prompts([30, 12, 7], seed=12)
    calls = spy_ops(monkeypatch, "rope_store")["rope_store"]
    logits = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(CpuBackend, "_compiled_norm", lambda *a: None)
        model = load_model(ckpt, dtype="float32")
        runner = PagedRunner(model, len(ps), 48)
        runner.step({i: p[:-2] for i, p in enumerate(ps)})
        calls.clear()
        steps = [runner.step({i: [p[-t]] for i, p in enumerate(ps)}) for t in (2, 1)]
        expected = 2 * model.config.num_hidden_layers if compiled and kernel_plan().row_kernels else 0
        assert len(calls) == expected
        logits.append(torch.cat([torch.cat([s[i] for i in range(len(ps))]) for s in steps]))
    assert rel_err(logits[0], logits[1]) <= 1e-5


def _spy_layer_calls(monkeypatch) -> list:
    """The table of every compiled decoder-layer call the model makes."""
    from mla_runtime.models import deepseek

    calls: list = []
    real = cpu_tables.decoder_layer
    monkeypatch.setattr(deepseek.cpu_tables, "decoder_layer", lambda *a: calls.append(a[0]) or real(*a))
    return calls


@pytest.mark.parametrize("variant", ["v3", "v3_noq_halfsplit", "v2_group", "v2_greedy_qlora"])
@pytest.mark.parametrize("quantization", [None, "int8", "int4", "bf16", "fp16"])
def test_decode_steps_run_each_layer_as_one_compiled_call_with_the_same_logits(tiny_checkpoint, variant,
                                                                                quantization, monkeypatch):
    """Where the kernels build, a decode step of one to eight rows runs each decoder layer as one compiled call
    (norms, projections, latent side, attention, MLP), with the logits of the layer called op by op (the same kernels
    in the same order; the MLP's float arithmetic may round differently). With and without q_lora_rank, dense and MoE
    layers, V2's and V3's routing, float32, int8, int4 and bfloat16 weights; a quantised model makes its layer tables
    again from the quantised weights."""
    from mla_runtime.layers.quantization import quantize_model
    from mla_runtime.models import deepseek

    ckpt, _ = tiny_checkpoint(variant)
    ps = prompts([30, 12, 7], seed=5)
    calls = _spy_layer_calls(monkeypatch)
    model = load_model(ckpt, dtype="float32")
    if quantization:
        runner = PagedRunner(model, 1, 48)
        runner.step({0: ps[0][:3]})
        runner.step({0: [ps[0][3]]})  # tables made from the float32 weights ...
        quantize_model(model, quantization)  # ... are made again from the int8 ones
        calls.clear()
    logits = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(deepseek.DeepseekForCausalLM, "_decode_step", lambda *a: None)
        runner = PagedRunner(model, len(ps), 48)
        runner.step({i: p[:-2] for i, p in enumerate(ps)})
        steps = [runner.step({i: [p[-2]] for i, p in enumerate(ps)}), runner.step({0: [ps[0][-1]]})]
        logits.append(torch.cat([torch.cat(list(s.values())) for s in steps]))
    layers = model.config.num_hidden_layers
    assert len(calls) == (2 * layers if kernel_plan().row_kernels else 0)
    # int8: each product rounds its input row to int16 (2^-14 of the row's largest value), so a last-bit difference
    # from the MLP can come out of the next product 2^-14 larger
    assert rel_err(logits[0], logits[1]) <= (1e-5 if quantization is None else 5e-4)
    if calls and quantization:
        stored = {"int8": "int8", "int4": "int4", "bf16": "bfloat16", "fp16": "float16"}[quantization]
        assert stored in calls[0].table.kinds()


@pytest.mark.parametrize("variant", ["v3", "v2_greedy_qlora"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn])
def test_compact_latent_caches_take_the_compiled_decode_with_the_torch_logits(tiny_checkpoint, variant, cache_dtype,
                                                                              monkeypatch):
    """A float32 model over a bfloat16, float16, int8 or float8_e4m3fn latent cache (``kv_cache_dtype``) decodes
    through the compiled decoder layer, as over a float32 one, with the logits of the torch path over the same cache
    dtype (its rows rounded or quantised alike from the torch path's own float32 rows)."""
    from mla_runtime.attention import CpuBackend
    from mla_runtime.models import deepseek

    ckpt, _ = tiny_checkpoint(variant)
    ps = prompts([30, 12, 7], seed=5)
    calls = _spy_layer_calls(monkeypatch)
    model = load_model(ckpt, dtype="float32")
    logits = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(deepseek.DeepseekForCausalLM, "_decode_step", lambda *a: None)
            monkeypatch.setattr(CpuBackend, "_compiled_norm", lambda *a: None)
        runner = PagedRunner(model, len(ps), 48, cache_dtype=cache_dtype)
        runner.step({i: p[:-2] for i, p in enumerate(ps)})
        steps = [runner.step({i: [p[-2]] for i, p in enumerate(ps)}), runner.step({0: [ps[0][-1]]})]
        logits.append(torch.cat([torch.cat(list(s.values())) for s in steps]))
        assert runner.cache.layers[0].kv.dtype == cache_dtype
    assert len(calls) == (2 * model.config.num_hidden_layers if kernel_plan().row_kernels else 0)
    assert torch.isfinite(logits[0]).all()
    # a value on a rounding boundary may round the other way: a half step of bfloat16 / float16, or a whole quantum of
    # an int8 / fp8 part (a larger change, hence the looser bound; measured: under 6e-7 for every dtype here)
    assert rel_err(logits[0], logits[1]) <= (1e-4 if cache_dtype in (torch.bfloat16, torch.float16) else 1e-3)


@needs_row_kernel
def test_decoder_layer_tables_and_steps_reject_what_they_cannot_compute(tiny_checkpoint, monkeypatch):
    """A layer table checks every weight's dtype and shape when it is made, naming the one that does not fit; a step
    takes one to eight rows; a call checks the hidden rows and the cache."""
    from mla_runtime.layers.decoder_kernel import layer_weights

    ckpt, _ = tiny_checkpoint("v3")
    model = load_model(ckpt, dtype="float32")  # cpu_gemm=auto: the kernels themselves
    layer = model.model.layers[1]
    weights = layer_weights((layer.input_layernorm, layer.post_attention_layernorm), layer.self_attn, layer.mlp)
    assert weights is not None
    table = cpu_tables.DecoderLayerTable(weights)
    bad = dataclasses.replace(weights, w_uk=weights.w_uk.transpose(1, 2))
    with pytest.raises(ValueError, match="LayerTable: w_uk must be a contiguous CPU Float tensor"):
        cpu_tables.DecoderLayerTable(bad)
    with pytest.raises(ValueError, match=r"LayerTable: o: int8 weights \(only\) come with row scales"):
        cpu_tables.DecoderLayerTable(dataclasses.replace(weights, o=(weights.o, weights.o[:, 0])))
    with pytest.raises(ValueError, match="LayerTable: kv_norm must be a contiguous CPU Float tensor"):
        cpu_tables.DecoderLayerTable(dataclasses.replace(weights, norms=(*weights.norms[:3], weights.norms[0])))
    d_r = weights.dims["d_r"]
    rope = torch.zeros(9, d_r // 2)
    keys, lens = torch.zeros(9, 4, dtype=torch.long), torch.ones(9, dtype=torch.long)
    with pytest.raises(ValueError, match="DecodeStep: 1 to 8 rows, got 9"):
        cpu_tables.DecodeStep(rope, rope, torch.zeros(9, dtype=torch.long), keys, lens, table.heads, table.d_c)
    with pytest.raises(ValueError, match="DecodeStep: row 1 reads 5 keys of 4 slots"):
        cpu_tables.DecodeStep(rope[:2], rope[:2], torch.zeros(2, dtype=torch.long), keys[:2], torch.tensor([1, 5]),
                              table.heads, table.d_c)
    step = cpu_tables.DecodeStep(rope[:2], rope[:2], torch.tensor([0, 7]), keys[:2], lens[:2], table.heads, table.d_c)
    cache = torch.zeros(8, table.d_c + d_r)
    x = torch.randn(2, table.hidden)
    for other in model.model.layers:  # dense and MoE layers need different scratch: the step's grows to each
        assert (other.kernel_table().heads, other.kernel_table().d_c) == (step.heads, step.d_c)
        out = x.clone()
        hidden = cpu_tables.decoder_layer(other.kernel_table(), step, out, cache)
        assert hidden is None and torch.isfinite(out).all() and not torch.equal(out, x)
    with pytest.raises(ValueError, match=r"decoder_layer: x must be a contiguous CPU Float tensor \[2, "):
        cpu_tables.decoder_layer(table, step, torch.zeros(3, table.hidden), cache)
    with pytest.raises(ValueError, match="decoder_layer: cache must be a float32, bfloat16, float16, int8 or "):
        cpu_tables.decoder_layer(table, step, torch.zeros(2, table.hidden), cache.double())
    with pytest.raises(ValueError, match=r"decoder_layer: cache must be a contiguous CPU BFloat16 tensor \[8, "):
        cpu_tables.decoder_layer(table, step, torch.zeros(2, table.hidden), cache.bfloat16()[:, :-1])
    with pytest.raises(ValueError, match="the step reads cache slot 7, the cache holds 4"):
        cpu_tables.decoder_layer(table, step, torch.zeros(2, table.hidden), cache[:4])


def test_compiled_layers_follow_weights_replaced_before_prepare_inference(tiny_checkpoint, monkeypatch):
    """Replacing a weight (here a norm's parameter, which no packed copy tracks) and preparing the model again makes
    the compiled layers read the new weight: their decode logits equal the op-by-op path's on the changed model."""
    from mla_runtime.models import deepseek

    ckpt, _ = tiny_checkpoint("v3")
    ps = prompts([20, 9], seed=8)
    model = load_model(ckpt, dtype="float32")
    PagedRunner(model, 1, 48).step({0: ps[0][:4]})  # a prefill: no tables yet
    runner = PagedRunner(model, len(ps), 48)
    runner.step({i: p[:-1] for i, p in enumerate(ps)})
    runner.step({i: [p[-1]] for i, p in enumerate(ps)})  # a decode step: the tables are made
    layer = model.model.layers[1]
    layer.input_layernorm.weight = nn.Parameter(layer.input_layernorm.weight * 1.5, requires_grad=False)
    model.prepare_inference()
    logits = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(deepseek.DeepseekForCausalLM, "_decode_step", lambda *a: None)
        runner = PagedRunner(model, len(ps), 48)
        runner.step({i: p[:-1] for i, p in enumerate(ps)})
        logits.append(torch.cat(list(runner.step({i: [p[-1]] for i, p in enumerate(ps)}).values())))
    assert rel_err(logits[0], logits[1]) <= 1e-5


@pytest.mark.parametrize("variant", ["avx2", "avx512_vnni"])
def test_each_int8_variant_gives_the_same_bits(variant):
    """The few-row int8 product's variants compute the same integer sums and round them alike: every variant equals
    the exact product on integers and gives the default's bits on random rows (tails of 16 and of 1 to 15 values,
    the int32 chunks' boundary at 4096, fewer weight rows than the threads' streams and more input rows than one
    pass takes included; past eight rows the products run by blocks of weight rows, and a last chunk of one 16-value
    step). A variant this CPU cannot execute is skipped by name, and
    asking for it is refused."""
    if cpu_kernels.failure() is not None:
        pytest.skip(f"the kernels do not build here: {cpu_kernels.failure()}")
    assert cpu_kernels.variants("int8", runs_only=False) == ("avx2", "avx512_vnni")
    if variant not in cpu_kernels.variants("int8"):
        with pytest.raises(ValueError, match=f"cannot run the {variant} variant"):
            cpu_kernels.linear(torch.randn(2, 8), torch.ones(4, 8, dtype=torch.int8), torch.ones(4), variant=variant)
        pytest.skip(f"this CPU does not execute the int8 product's {variant} variant (it runs "
                    f"{list(cpu_kernels.variants('int8'))})")
    g = torch.Generator().manual_seed(7)
    for n, k, rows in ((37, 77, 3), (16, 48, 8), (9, 4200, 5), (40, 2048, 13), (5, 130, 70), (7, 4117, 21), (3, 8, 9)):
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, generator=g)
        ints = torch.randint(-2, 3, (rows, k), generator=g).float()
        x = torch.randn(rows, k, generator=g)
        default = cpu_kernels.linear(x, w, scale)
        unit = torch.ones(n)
        exact = ints.double() @ w.double().T
        assert torch.equal(cpu_kernels.linear(ints, w, unit, variant=variant).double(), exact)
        assert torch.equal(cpu_kernels.linear(x, w, scale, variant=variant), default)


@pytest.mark.parametrize("variant", ["avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_few_row_float_variant_is_the_product(variant, dtype):
    """Each variant of the few-row float products (float32, bfloat16 and float16 weights) is exact on small integers
    and within float rounding of the float64 product on random rows (column tails of 1 to 15 values included); within
    a variant a row's result does not depend on the rows beside it. A variant this CPU cannot execute is skipped by
    name, and asking for it is refused."""
    if cpu_kernels.failure() is not None:
        pytest.skip(f"the kernels do not build here: {cpu_kernels.failure()}")
    assert cpu_kernels.variants("float", runs_only=False) == ("avx2", "avx512")
    if variant not in cpu_kernels.variants("float"):
        with pytest.raises(ValueError, match=f"cannot run the {variant} variant"):
            cpu_kernels.linear(torch.randn(2, 8), torch.ones(4, 8), variant=variant)
        pytest.skip(f"this CPU does not execute the float products' {variant} variant (it runs "
                    f"{list(cpu_kernels.variants('float'))})")
    g = torch.Generator().manual_seed(11)
    for n, k, rows in ((37, 77, 3), (16, 48, 8), (9, 1030, 5), (1, 16, 2), (40, 2048, 8)):
        w = torch.randn(n, k, generator=g).to(dtype)
        ints, x = torch.randint(-3, 4, (rows, k), generator=g).float(), torch.randn(rows, k, generator=g)
        exact = cpu_kernels.linear(ints, torch.randint(-3, 4, (n, k), generator=g).to(dtype), variant=variant)
        assert exact.dtype == torch.float32 and torch.equal(exact, exact.round())
        got = cpu_kernels.linear(x, w, variant=variant)
        torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5 * k ** 0.5)
        alone = torch.cat([cpu_kernels.linear(x[i:i + 2], w, variant=variant)[:1] for i in range(rows)])
        assert torch.equal(got, alone)


# What the capped process computes: the products of each weight format, the absorbed attention and the indexer's
# scores on seeded inputs, with its variant lists and what it says of AMX and of native bfloat16 arithmetic.
_CAPPED = """
import json, sys, torch
from mla_kernels import cpu_kernels, cpu_ops
from mla_runtime import kernel_plan
g = torch.Generator().manual_seed(3)
x, w = torch.randn(5, 300, generator=g), torch.randn(70, 300, generator=g)
w8, s8 = torch.randint(-127, 128, (70, 300), generator=g, dtype=torch.int8), torch.rand(70, generator=g)
q, wi, keys = torch.randn(2, 4, 64, generator=g), torch.rand(2, 4, generator=g), torch.randn(3, 16, 64, generator=g)
table = torch.tensor([[0, 2], [1, 0]], dtype=torch.int32)
a = [torch.randn(3, 16, 64, generator=g), torch.randn(3, 16, 32, generator=g), torch.randn(16, 64, 256, generator=g),
     torch.randn(16, 256, 64, generator=g) / 16, torch.randn(64, 288, generator=g), torch.tensor([[0, 5, 9], [3, 7, 1],
     [60, 2, 4]]), torch.tensor([3, 2, 1])]
ops = cpu_kernels.ops()
torch.save({"f32": ops.linear(x, w), "bf16": ops.linear(x[:3], w.bfloat16()), "int8": ops.linear(x, w8, s8),
            "attention": ops.absorbed_decode(*a, 0.125), "indexer": ops.indexer_scores(
                q, wi, keys, None, table, torch.tensor([0, 1]),
                torch.tensor([20, 9]), 20)}, sys.argv[1])
print(json.dumps({"products": list(ops.product_variants()), "indexer": list(ops.cpu_variants()),
                  "cap": ops.max_isa(), "summary": cpu_ops.summary(), "amx": cpu_kernels.failure("amx"),
                  "native_bf16": kernel_plan.native_arithmetic(torch.bfloat16)}))
"""


@needs_row_kernel
def test_a_process_capped_at_avx2_computes_the_avx2_variants_bits(tmp_path):
    """``MLA_CPU_ISA=avx2`` makes a process on any x86 CPU take the variants an AVX2 machine takes: its products
    (float32, bfloat16, int8 weights), absorbed attention and indexer scores equal, bit for bit, the AVX2 variants
    asked for by name here; it lists the wider variants as above the cap, names the cap in its summary and in why it
    has no AMX tiles, and counts no AVX-512 bfloat16 arithmetic. A value it does not know is refused by name."""
    import json
    import subprocess
    import sys

    out = tmp_path / "capped.pt"
    env = {**os.environ, cpu_ops.ISA_ENV: "avx2"}
    done = subprocess.run([sys.executable, "-c", _CAPPED, str(out)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    got = torch.load(out)
    assert said["cap"] == "avx2" and "capped at avx2 by $MLA_CPU_ISA" in said["summary"]
    assert [v for v in said["products"] if v.endswith(":runs")] == ["float.avx2:runs", "int8.avx2:runs",
                                                                    "int4.avx2:runs", "ggml.avx2:runs",
                                                                    "w8a8.avx2:runs"]
    assert [v for v in said["indexer"] if v.endswith(":runs")] == ["avx2:runs", "generic:runs"]
    assert said["amx"] == "$MLA_CPU_ISA caps this process at avx2, below the AMX tiles" and said["native_bf16"] == []
    if "avx512" in cpu_kernels.variants("float"):  # what it left out, this CPU runs
        assert "float.avx512:above the ISA cap" in said["products"]
    g = torch.Generator().manual_seed(3)  # the script's inputs, drawn in its order
    x, w = torch.randn(5, 300, generator=g), torch.randn(70, 300, generator=g)
    w8, s8 = torch.randint(-127, 128, (70, 300), generator=g, dtype=torch.int8), torch.rand(70, generator=g)
    q, wi, keys = torch.randn(2, 4, 64, generator=g), torch.rand(2, 4, generator=g), torch.randn(3, 16, 64, generator=g)
    table = torch.tensor([[0, 2], [1, 0]], dtype=torch.int32)
    a = [torch.randn(3, 16, 64, generator=g), torch.randn(3, 16, 32, generator=g),
         torch.randn(16, 64, 256, generator=g), torch.randn(16, 256, 64, generator=g) / 16,
         torch.randn(64, 288, generator=g), torch.tensor([[0, 5, 9], [3, 7, 1], [60, 2, 4]]), torch.tensor([3, 2, 1])]
    ops = cpu_kernels.ops()
    assert torch.equal(got["f32"], ops.linear(x, w, variant="avx2"))
    assert torch.equal(got["bf16"], ops.linear(x[:3], w.bfloat16(), variant="avx2"))
    assert torch.equal(got["int8"], ops.linear(x, w8, s8, variant="avx2"))
    assert torch.equal(got["attention"], ops.absorbed_decode(*a, 0.125, "avx2"))
    assert torch.equal(got["indexer"], ops.indexer_scores(q, wi, keys, None, table, torch.tensor([0, 1]),
                                                          torch.tensor([20, 9]), 20, "avx2"))
    bad = subprocess.run([sys.executable, "-c", "from mla_kernels import cpu_ops; cpu_ops.failure()"],
                         env={**os.environ, cpu_ops.ISA_ENV: "avx1024"}, capture_output=True, text=True, timeout=120,
                         check=False)
    assert bad.returncode != 0 and "$MLA_CPU_ISA='avx1024' is not an instruction set" in bad.stderr


def emulated_tiles_unrunnable() -> str | None:
    """Why this machine cannot run the AMX kernel over emulated tiles (``csrc/amx_emulate.h``), or None: they need
    x86-64 Linux, a C++ compiler and AVX512-BF16, whose rounding of float32 rows runs beside the emulated tiles."""
    if not cpu_ops.x86() or sys.platform != "linux":
        return "the AMX kernel is x86-64 Linux code"
    if cpu_ops._compiler() is None:
        return "no C++ compiler on this machine"
    caps = cpu_ops.cpu_capabilities()
    if not all(caps.get(k) for k in ("avx512_bf16", "avx512_bw", "avx512_vl")):
        return ("this CPU does not execute the kernel's AVX512-BF16 rounding of float32 rows (no avx512_bf16, "
                "avx512bw and avx512vl), which runs beside the emulated tiles")
    return None


def amx_skip(why: str, what: str = "bfloat16") -> str:
    """Why an AMX test skips here, and where it runs instead when the CPU merely has no tiles."""
    elsewhere = "" if cpu_ops.isa_cap() != "amx" else (
        " (test_the_amx_route_runs_on_emulated_tiles_where_the_cpu_has_none runs it over tiles emulated in software, "
        "on CPUs with AVX512-BF16)")
    return f"this CPU does not execute the AMX {what} products: {why}{elsewhere}"


def test_amx_products_are_the_bfloat16_product_where_the_cpu_has_tiles():
    """Where the CPU has AMX bfloat16 tiles, a bfloat16 weight's products of more rows than the few-row kernels take,
    up to ``AMX_MAX_ROWS``, run on them: the product of the rows rounded to bfloat16, within float32 summation of the
    float64 one (partial row tiles, an odd count of column blocks, a bias, float32 and bfloat16 rows), and a row's
    result does not depend on the rows beside it. Elsewhere the operators refuse, naming why, and the weight keeps
    oneDNN's layout; the test is then skipped by name."""
    if cpu_kernels.failure() is not None:
        pytest.skip(f"the kernels do not build here: {cpu_kernels.failure()}")
    why = cpu_kernels.failure("amx")
    w = torch.randn(80, 96, generator=torch.Generator().manual_seed(5)).bfloat16()
    if why is not None:
        assert "AMX" in why
        with pytest.raises(ValueError, match="amx_pack: this CPU .* runs no AMX"):
            cpu_kernels.amx_pack(w)
        assert kernel_plan().amx_failure == why
        assert PackedWeight(w, with_path(kernel_plan(), torch.bfloat16, "onednn")).amx is None
        pytest.skip(amx_skip(why))
    g = torch.Generator().manual_seed(6)
    packed = cpu_kernels.amx_pack(w)
    assert packed.shape == (5, 3, 16, 32)
    for rows in (9, 16, 17, 33, 70):
        x = torch.randn(rows, 96, generator=g)
        want = x.bfloat16().double() @ w.double().T
        for operand in (x, x.bfloat16()):
            got = cpu_kernels.amx_linear(operand, packed)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * 96 ** 0.5)
        alone = torch.cat([cpu_kernels.amx_linear(x[i:i + 1], packed) for i in range(rows)])
        assert torch.equal(cpu_kernels.amx_linear(x, packed), alone)
    made = PackedWeight(w, with_path(kernel_plan(), torch.bfloat16, "onednn"))
    assert made.amx is not None and made.blocked is None
    b = torch.randn(80, generator=g).bfloat16()
    x = torch.randn(2, 20, 96, generator=g).bfloat16()  # 40 rows: past the few-row kernels, within the tiles
    torch.testing.assert_close(linear(x, w, b, made).double(), (x.double() @ w.double().T + b.double()),
                               rtol=2e-2, atol=2e-2)
    onednn = kernel_plan("onednn")
    assert onednn.amx_failure == "cpu_gemm=onednn leaves them out"
    assert PackedWeight(w, with_path(onednn, torch.bfloat16, "onednn")).amx is None


def test_a_prefill_takes_the_amx_tiles_as_near_the_float32_logits_as_onednn(tiny_checkpoint, monkeypatch):
    """Where the CPU runs AMX bfloat16 products (or the operators are built over emulated tiles, as the test after
    next does), a float32 model with bfloat16 weights prefills its chunks of more rows than the few-row kernels take
    through the tiles (``dense_linear``'s ``amx_linear`` route). Its logits are within bfloat16 rounding of the
    float32 model's (the rows are rounded to bfloat16, as oneDNN's bfloat16 products round them), and no farther from
    them than those of oneDNN's products (``cpu_gemm=onednn``, which leaves the tiles out and computes the attention
    between them in bfloat16)."""
    why = cpu_kernels.failure("amx")
    if why is not None:
        pytest.skip(amx_skip(why))
    ckpt, _ = tiny_checkpoint("v3")
    ps = prompts([30, 12, 20], seed=5)
    want = torch.cat(PagedRunner(load_model(ckpt, dtype="float32"), len(ps), 32).prefill(ps))
    calls: list[int] = []
    dense = cpu_kernels.dense_linear

    def spy(x, plain, operand, tiles, bias, rows, onednn):  # the products dense_linear runs on the tiles
        if tiles is not None and rows[0] < x.numel() // x.shape[-1] <= rows[2]:
            calls.append(x.numel() // x.shape[-1])
        return dense(x, plain, operand, tiles, bias, rows, onednn)

    monkeypatch.setattr(cpu_kernels, "dense_linear", spy)
    err = {}
    for mode in ("auto", "onednn"):
        model = load_model(ckpt, dtype="float32", quantization="bf16", cpu_gemm=mode)
        calls.clear()
        got = torch.cat(PagedRunner(model, len(ps), 32).prefill(ps))
        assert bool(calls) == (mode == "auto"), f"cpu_gemm={mode}: {len(calls)} AMX products"
        err[mode] = rel_err(got, want)
    assert err["auto"] <= 2e-2 and err["auto"] <= 1.5 * err["onednn"], err


def test_w8a8_products_of_several_rows_run_on_the_amx_int8_tiles_where_the_cpu_has_them():
    """Where the CPU has AMX int8 tiles, W8A8's products of 8 rows or more run on them (its "amx" variant, the one
    "auto" takes there): the exact integer sums of ``w8a8_format.w8a8_product`` bit for bit, which are the AVX-512
    VNNI variant's bits, for partial tiles of weight rows and of input rows, K past its last 64 values and a chunk of
    64 rows; a row's result is the same bits alone (fewer rows take the VNNI products). Elsewhere asking for the
    variant is refused by name, and the test is skipped."""
    if cpu_kernels.failure("w8a8") is not None:
        pytest.skip(f"the W8A8 kernels do not run here: {cpu_kernels.failure('w8a8')}")
    assert cpu_kernels.variants("w8a8", runs_only=False) == ("avx2", "avx512_vnni", "amx")
    ops = cpu_kernels.ops()
    if "amx" not in cpu_kernels.variants("w8a8"):
        assert not dict(ops.limits())["amx_int8"] or cpu_ops.isa_cap() != "amx"
        with pytest.raises(ValueError, match="cannot run the amx variant"):
            ops.w8a8_linear(torch.randn(8, 64), torch.ones(16, 64, dtype=torch.int8), torch.ones(16), "amx")
        why = (f"${cpu_ops.ISA_ENV} caps this process at {cpu_ops.isa_cap()}" if cpu_ops.isa_cap() != "amx" else
               "no AMX int8 tiles (amx-tile, amx-int8 beside AVX-512 VNNI), or the kernel does not let a process use "
               "them")
        pytest.skip(amx_skip(why, "int8"))
    assert dict(ops.limits())["amx_int8"] == 1
    g = torch.Generator().manual_seed(8)
    for m, n, k in ((8, 16, 64), (64, 2816 // 11, 2048), (23, 45, 777), (9, 100, 1408)):
        x = torch.randn(m, k, generator=g) * 3
        x[0] = 0.0
        w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        sw = torch.rand(n, generator=g) + 0.25
        got = ops.w8a8_linear(x, w, sw, "amx")
        assert torch.equal(got, w8a8_product(x, w, sw)), (m, n, k)
        assert torch.equal(ops.w8a8_linear(x, w, sw, "avx512_vnni"), got)
        assert torch.equal(ops.w8a8_linear(x, w, sw, "auto"), got)
        for i in (1, m - 1):
            assert torch.equal(ops.w8a8_linear(x[i:i + 1], w, sw, "amx"), got[i:i + 1])


def test_the_amx_route_runs_on_emulated_tiles_where_the_cpu_has_none():
    """On a CPU with AVX512-BF16 and no AMX, a process whose operators are built over tiles emulated in software
    (``$MLA_CPU_EMULATE_AMX=1``: a build of its own) takes the whole AMX route, and the AMX tests pass in it: the
    operators' packing and products, a weight's layout and dispatch (``PackedWeight``, ``linear``), and a model's
    prefill as near the float32 logits as oneDNN's. Where the CPU has AMX the tests ran natively."""
    if cpu_kernels.failure() is not None:
        pytest.skip(f"the kernels do not build here: {cpu_kernels.failure()}")
    if cpu_kernels.failure("amx") is None and not cpu_ops.emulated_amx():
        pytest.skip("this CPU runs the AMX tiles themselves: the AMX tests ran on them")
    if cpu_ops.isa_cap() != "amx":
        pytest.skip(f"${cpu_ops.ISA_ENV} caps this process at {cpu_ops.isa_cap()}, below the AMX tiles: it computes "
                    "as a CPU without them")
    if (why := emulated_tiles_unrunnable()) is not None:
        pytest.skip(why)
    env = {**os.environ, cpu_ops.EMULATE_AMX_ENV: "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", __file__, "-k",
                          "amx_products_are_the_bfloat16_product or prefill_takes_the_amx_tiles or "
                          "run_on_the_amx_int8_tiles"],
                         env=env, cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                         timeout=900, check=False)
    assert run.returncode == 0 and "3 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_the_amx_products_compute_the_bfloat16_product_on_emulated_tiles(tmp_path):
    """The AMX kernel's own source (``csrc/amx_bf16.c``: weight packing, tile configurations, partial row tiles, a
    second pass past 32 rows, an odd count of column blocks, float32 rows rounded into its buffer, bfloat16 rows read
    in place or gathered) computes the float64 product of the bfloat16 values within float32 summation, one row's
    result the same bits alone as among others, with the tile instructions emulated in software
    (``csrc/amx_emulate.h``, which also faults where the hardware would: shapes that do not match, a tile used
    unconfigured). This runs the kernel's logic on CPUs without AMX; the tiles themselves only run where the CPU has
    them (the test above)."""
    if (why := emulated_tiles_unrunnable()) is not None:
        pytest.skip(why)
    csrc = Path(cpu_ops.CSRC)
    exe = tmp_path / "amx_emulated"
    subprocess.run([str(cpu_ops._compiler()), "-O2", "-std=c++17", "-fopenmp", "-I", str(csrc), "-include",
                    str(csrc / "amx_emulate.h"), str(csrc / "amx_bf16.c"), str(csrc / "cpu_features.c"),
                    str(Path(__file__).resolve().parent / "csrc" / "amx_emulated.cpp"), "-o", str(exe)],
                   check=True, capture_output=True, timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, check=False)
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok m=") == 8 and "m=128 n=96 k=256" in run.stdout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["onednn", "upcast"])
def test_half_weights_take_the_two_byte_kernel_for_few_rows(path, dtype, monkeypatch):
    """A bfloat16 or float16 weight's products of up to ``BF16_KERNEL_ROWS[path]`` rows run the kernel that reads it
    at two bytes (float32 arithmetic on the exactly widened weight); more rows, or ``cpu_gemm=onednn``, take the
    weight's path."""
    kind = HALF_KINDS[dtype]
    if cpu_kernels.failure(kind) is not None:
        pytest.skip(f"the {dtype}-weight kernel does not run here: {cpu_kernels.failure(kind)}")
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(70, 96, generator=g).to(dtype), torch.randn(70, generator=g).to(dtype)
    if path == "onednn" and fast_path_failure(dtype) is not None:
        # no oneDNN path for the dtype on this CPU: its weights take the fallback the capability rule picks
        path = kernel_plan().choice(dtype).path
        made = PackedWeight.make(w, kernel_plan())
        assert path in ("upcast", "plain") and (made is None) == (path == "plain")
        if path == "plain":  # F.linear in the dtype, no packed weight and no kernel
            return
    limit = cpu_gemm.BF16_KERNEL_ROWS[path]
    for mode, expect in (("auto", limit), ("onednn", 0)):
        packed = PackedWeight(w, with_path(kernel_plan(mode), dtype, path))
        assert packed.bf16_rows == expect and packed.rows[0] == expect
        for rows in (1, limit, limit + 1):
            x = torch.randn(rows, 96, generator=g).to(dtype)
            got = linear(x, w, b, packed)
            assert got.dtype == dtype
            if rows <= expect:  # the kernel's float32 sum, rounded once (more rows: bfloat16 sums may round alike)
                assert torch.equal(got, cpu_kernels.linear(x, w, bias=b).to(dtype))
            want = (x.float() @ w.float().T + b.float())
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=5e-2)


def test_auto_keeps_a_float16_checkpoints_products_float16_and_gives_transformers_tokens(tiny_checkpoint, tmp_path):
    """A float16 checkpoint under ``dtype="auto"``, where the compiled kernels read float16 weights: a float32 model
    with float16 products (``quantization="fp16"``), whose greedy tokens are transformers' on the same float16
    values computed in float32."""
    import copy

    from mla_runtime import LLM
    from mla_runtime.layers.bf16 import F16Weight
    from tests.checkpoints import save_checkpoint

    if not kernel_plan().half_kernel(torch.float16):  # no kernel on this CPU
        assert resolve_cpu_format("auto", torch.float16, None, kernel_plan())[1] is None  # float16 stays as it is
        return
    _, hf = tiny_checkpoint("v3")
    half = copy.deepcopy(hf).half()
    path = save_checkpoint(half, tmp_path / "fp16")
    reference = half.float().eval()
    llm = LLM(str(path), kv_cache_memory="8MiB", max_model_len=96)
    worker = llm.engine.worker
    try:
        assert worker.dtype == torch.float32 and worker.quantization == "fp16"
        assert isinstance(worker.model.lm_head_packed, F16Weight)
        for ids in prompts([9, 23], seed=4):
            got = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=6, temperature=0))
            with torch.no_grad():
                want = reference.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=0)
            assert list(got[0].outputs[0].token_ids) == want[0, len(ids):].tolist()
    finally:
        llm.shutdown()


def test_auto_keeps_a_bf16_checkpoints_products_bf16_in_a_float32_model(tiny_checkpoint):
    """``dtype="auto"`` on a CPU where the compiled kernels read bfloat16 weights: a bfloat16 checkpoint runs as a
    float32 model with bfloat16 products (``quantization="bf16"``); an explicit dtype, another format, or another
    checkpoint dtype is left alone. The engine reports what it chose."""
    from mla_runtime import LLM
    from mla_runtime.layers.bf16 import Bf16Weight

    for half, scheme in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        for plan in (kernel_plan(), kernel_plan("onednn")):
            runs = cpu_kernels.failure(HALF_KINDS[half]) is None and plan.mode == "auto"
            auto = resolve_cpu_format("auto", half, None, plan)
            assert auto == ((torch.float32, scheme) if runs else (cpu_auto_dtype(half, plan)[0], None))
    plan = kernel_plan()
    runs = cpu_kernels.failure("bf16") is None
    assert resolve_cpu_format("bfloat16", torch.bfloat16, None, plan) == (torch.bfloat16, None)
    assert resolve_cpu_format("auto", torch.bfloat16, "int8", plan)[1] == "int8"
    assert resolve_cpu_format("auto", torch.float32, None, plan) == (torch.float32, None)
    if not runs:
        return
    from mla_runtime.serving.config import DEMO_MODEL

    llm = LLM(str(DEMO_MODEL), kv_cache_memory="8MiB", max_model_len=128)  # a bfloat16 checkpoint
    worker = llm.engine.worker
    assert worker.dtype == torch.float32 and worker.quantization == "bf16"
    assert isinstance(worker.model.lm_head_packed, Bf16Weight)
    # its latent cache keeps the checkpoint's precision too (the compiled decode reads it), at half the bytes
    assert worker.cache_dtype.dtype == torch.bfloat16 and worker.cache.layers[0].kv.dtype == torch.bfloat16
    cfg = worker.model_config
    assert worker.bytes_per_token == cfg.latent_dim * 2 * cfg.num_hidden_layers
    ids = llm.generate(["def f(x):"], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].token_ids
    llm.shutdown()
    for kw, cache in ((dict(dtype="float32", quantization="bf16"), torch.float32),  # asked for: the model's dtype
                      (dict(kv_cache_dtype="float32"), torch.float32)):
        llm = LLM(str(DEMO_MODEL), kv_cache_memory="8MiB", max_model_len=128, **kw)
        assert llm.engine.worker.cache_dtype.dtype == cache
        if "kv_cache_dtype" in kw:  # the demo model's greedy text does not move with the cache's rounding
            assert llm.generate(["def f(x):"], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].token_ids \
                == ids
        llm.shutdown()


def test_dense_linear_refuses_what_its_tensors_do_not_hold():
    """A float weight's operator names what is wrong: rows of the wrong width, a row-limit list of another length, a
    weight that is not a matrix; an empty batch gives an empty result of the weight's output width."""
    if cpu_kernels.failure("ops") is not None:
        pytest.skip(f"the operators do not load here: {cpu_kernels.failure('ops')}")
    w = torch.randn(6, 8)
    ops = torch.ops.mla_kernels
    with pytest.raises(ValueError, match=r"dense_linear: rows \[\.\.\., 8\] for a weight \[6, 8\]"):
        ops.dense_linear(torch.randn(2, 7), w, None, None, None, [0, 0, 0], False)
    with pytest.raises(ValueError, match="dense_linear: rows are \\[kernel, aten, tiles\\]"):
        ops.dense_linear(torch.randn(2, 8), w, None, None, None, [0, 0], False)
    with pytest.raises(ValueError, match="dense_linear: rows"):
        ops.dense_linear(torch.randn(2, 8), torch.randn(48), None, None, None, [0, 0, 0], False)
    empty = ops.dense_linear(torch.randn(0, 8), w, None, None, None, [8, 0, 0], True)
    assert empty.shape == (0, 6) and empty.dtype == torch.float32
    x = torch.randn(3, 8).bfloat16()  # rows of another dtype than the weight, no operand: computed in x's dtype
    got = ops.dense_linear(x, w, None, None, None, [0, 0, 0], False)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, F.linear(x, w.bfloat16()), rtol=0, atol=0)


def test_the_latent_and_norm_operators_refuse_what_their_tensors_do_not_hold():
    """Called directly (``torch.ops.mla_kernels``), the latent side refuses a slot past its cache and tensors of the
    wrong shape, and the norm rows of the wrong width, with a ValueError that names the operator and the tensor;
    nothing is written past a tensor."""
    if cpu_kernels.failure() is not None:
        pytest.skip(f"the kernels do not build here: {cpu_kernels.failure()}")
    ops = torch.ops.mla_kernels
    rows, heads, d_n, d_r, d_c = 2, 3, 8, 8, 16
    latent, q = torch.randn(rows, d_c + d_r), torch.randn(rows, heads, d_n + d_r)
    norm, cos, sin = torch.ones(d_c), torch.ones(rows, d_r // 2), torch.zeros(rows, d_r // 2)
    cache = torch.zeros(6, d_c + d_r)
    ops.rope_store(latent, norm, 1e-6, q, d_n, cos, sin, cache, torch.tensor([5, 0]), False)
    assert cache[[0, 5]].abs().sum(-1).gt(0).all() and cache[1:5].eq(0).all()
    for args, said in (((cache, torch.tensor([6, 0])), "rope_store: slot 6 of a cache of 6"),
                       ((cache, torch.tensor([-1, 0])), "rope_store: slot -1"),
                       ((cache, torch.tensor([0])), "slots must be a contiguous CPU Long tensor \\[2\\]"),
                       ((cache[:, :-1], torch.tensor([0, 1])), "rope_store: cache must be"),
                       ((cache.double(), torch.tensor([0, 1])), "rope_store: cache must be")):
        with pytest.raises(ValueError, match=said):
            ops.rope_store(latent, norm, 1e-6, q, d_n, cos, sin, *args, False)
    with pytest.raises(ValueError, match="rope_store: norm must be"):
        ops.rope_store(latent, torch.ones(d_c + 1), 1e-6, q, d_n, cos, sin, cache, torch.tensor([0, 1]), False)
    with pytest.raises(ValueError, match="rms_norm: x must be rows of 8 values"):
        ops.rms_norm(torch.randn(2, 7), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="rms_norm: x must be float32 CPU rows"):
        ops.rms_norm(torch.randn(2, 8).double(), torch.ones(8), 1e-6)


def test_every_cpu_operator_has_a_shape_function():
    """Each operator of torch.ops.mla_kernels that takes and gives tensors runs under fake tensors (what
    torch.compile and torch.export trace with) and gives the shape it computes."""
    if cpu_kernels.failure() is not None:
        pytest.skip(f"the kernels do not build here: {cpu_kernels.failure()}")
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = torch.ops.mla_kernels
    names = {str(s.name).removeprefix("mla_kernels::") for s in torch._C._jit_get_all_schemas()
             if str(s.name).startswith("mla_kernels::")}
    assert {"indexer_scores", "linear", "absorbed_decode", "layer_table", "decoder_layer"} <= names
    # no tensors, or the custom-class tables (raw addresses, which tracing cannot stand in for): eager only, as the
    # decode step that calls them
    untraced = {"cpu_variants", "product_variants", "limits", "set_max_isa", "max_isa", "mlp_table", "layer_table",
                "decode_step", "gated_mlps", "mlps_rows", "moe_row", "decoder_layer", "decoder_layer_hidden",
                "delta_rule_variants"}
    for name in names - untraced:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"mla_kernels::{name}", "Meta"), name
    with FakeTensorMode():
        assert ops.linear(torch.empty(3, 5, 8), torch.empty(4, 8), None, [], "auto").shape == (3, 5, 4)
        assert ops.rms_norm(torch.empty(2, 8), torch.empty(8), 1e-6).shape == (2, 8)
        for cache in (torch.empty(9, 18), torch.empty(9, 18, dtype=torch.bfloat16)):
            out = ops.absorbed_decode(torch.empty(2, 3, 4), torch.empty(2, 3, 2), torch.empty(3, 4, 16),
                                      torch.empty(3, 16, 5), cache, torch.empty(2, 4, dtype=torch.long),
                                      torch.empty(2, dtype=torch.long), 1.0)
            assert out.shape == (2, 3, 5) and out.dtype == torch.float32
        out, lse = ops.prefill_attention(torch.empty(5, 3, 4), torch.empty(5, 3, 2), torch.empty(7, 3, 4),
                                         torch.empty(7, 2), torch.empty(7, 3, 6), [0, 5], [0, 7], 1.0)
        assert out.shape == (5, 3, 6) and lse.shape == (5, 3)
        assert ops.int4_from_stored(torch.empty(4, 16, dtype=torch.uint8)).shape == (4, 16)
        out = ops.ggml_linear(torch.empty(2, 3, 256), torch.empty(4, 144, dtype=torch.uint8), 12)
        assert out.shape == (2, 3, 4) and out.dtype == torch.float32
        assert ops.ggml_repack(torch.empty(16, 288, dtype=torch.uint8), 512).shape == (16, 296)
        out = ops.dense_linear(torch.empty(2, 3, 8, dtype=torch.bfloat16), torch.empty(4, 8), None, None, None,
                               [8, 0, 0], True)
        assert out.shape == (2, 3, 4) and out.dtype == torch.bfloat16
        out = ops.delta_rule_step(torch.empty(2, 3, 4), torch.empty(2, 3, 4), torch.empty(2, 3, 5),
                                  torch.empty(2, 3, 4), torch.empty(2, 3), torch.empty(6, 3, 4, 5),
                                  torch.empty(2, dtype=torch.long))
        assert out.shape == (2, 3, 5) and out.dtype == torch.float32
        out = ops.delta_rule_prefill(torch.empty(7, 3, 4), torch.empty(7, 3, 4), torch.empty(7, 3, 5),
                                     torch.empty(7, 3, 4), torch.empty(7, 3), torch.empty(6, 3, 4, 5),
                                     torch.empty(2, dtype=torch.long), torch.empty(3, dtype=torch.long))
        assert out.shape == (7, 3, 5) and out.dtype == torch.float32
        assert ops.short_conv_step(torch.empty(2, 7), torch.empty(6, 7, 3), torch.empty(7, 4),
                                   torch.empty(2, dtype=torch.long)).shape == (2, 7)
