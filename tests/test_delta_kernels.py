"""The linear-attention layers' kernels against the float32 torch reference (``layers/delta_rule.py``,
``layers/kda.py``): the compiled CPU operators (``delta_rule_step``, the chunked ``delta_rule_prefill``,
``short_conv_step``) in every variant this CPU runs and under ``MLA_CPU_ISA=avx2``, the Triton kernels (the step and
the chunked prefill) through the interpreter, their refusals of bad input, and a hybrid model's decode logits against
transformers with the kernels chosen at prepare time."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # kernels: interpret Triton on CPU (must precede the first triton import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mla_kernels import cpu_kernels, linear_attention  # noqa: E402
from mla_runtime.layers import delta_rule  # noqa: E402
from mla_runtime.layers.kda import LinearKernels  # noqa: E402
from mla_runtime.loader import load_model  # noqa: E402
from tests.model_utils import PagedRunner, hf_logits  # noqa: E402
from tests.test_families_hybrid import checkpoint, prompts  # noqa: E402, F401 - the module's fixture

needs_ops = pytest.mark.skipif(cpu_kernels.failure("delta") is not None,
                               reason=f"the delta-rule operators do not run here: {cpu_kernels.failure('delta')}")


def step_inputs(rows: int = 3, heads: int = 2, dk: int = 16, dv: int = 21, slots: int = 5, seed: int = 0):
    """One token of ``rows`` sequences (``dv`` with a tail past every vector width) and a state of ``slots`` slots."""
    g = torch.Generator().manual_seed(seed)
    q, k = delta_rule.prepared(torch.randn(rows, heads, dk, generator=g), torch.randn(rows, heads, dk, generator=g))
    v = torch.randn(rows, heads, dv, generator=g)
    gate = -2.0 * torch.rand(rows, heads, dk, generator=g)
    beta = torch.rand(rows, heads, generator=g)
    return q, k, v, gate, beta, torch.randn(slots, heads, dk, dv, generator=g)


def check_step(step, variant_args=()) -> None:
    """``step(q, k, v, g, beta, state, slots, *variant_args)`` updates the named slots as the reference does and
    leaves the others as they were."""
    q, k, v, gate, beta, state = step_inputs()
    slots = torch.tensor([4, 0, 2])
    want, want_state = delta_rule.recurrent_step(q, k, v, gate, beta, state[slots])
    got_state = state.clone()
    got = step(q, k, v, gate, beta, got_state, slots, *variant_args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_state[slots], want_state, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_state[[1, 3]], state[[1, 3]])


@needs_ops
def test_compiled_delta_rule_step_equals_the_reference_in_every_variant():
    variants = cpu_kernels.delta_variants()
    assert "generic" in variants
    for variant in variants:
        check_step(torch.ops.mla_kernels.delta_rule_step, (variant,))


LENS = (1, 5, 33, 0, 100)  # tokens of each sequence of a prefill call: none a multiple of the 32-token block


@functools.cache
def prefill_case(heads: int) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, torch.Tensor] | None]]:
    """The inputs of a prefill call over the sequences of ``LENS`` (each from its own nonzero slot) and each
    sequence's outputs and state by ``delta_rule.chunked`` (None for the empty one)."""
    q, k, v, gate, beta, state = step_inputs(rows=sum(LENS), heads=heads, slots=6, seed=2)
    cu, slots = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()]), torch.tensor([2, 0, 5, 3, 1])
    wants: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for s in range(len(LENS)):
        a, b = int(cu[s]), int(cu[s + 1])
        wants.append(delta_rule.chunked(q[a:b], k[a:b], v[a:b], gate[a:b], beta[a:b], state[slots[s]]) if b > a
                     else None)
    return (q, k, v, gate, beta, state, slots, cu), wants


def check_prefill(prefill, heads: int = 3) -> None:
    """``prefill(q, k, v, g, beta, state, slots, cu)`` (the state updated in place) runs each sequence of ``LENS``
    from its own nonzero slot as ``delta_rule.chunked`` does, and leaves the empty sequence's and the unused slot
    as they were."""
    (q, k, v, gate, beta, state, slots, cu), wants = prefill_case(heads)
    got_state = state.clone()
    got = prefill(q, k, v, gate, beta, got_state, slots, cu)
    for s, want in enumerate(wants):
        if want is None:
            assert torch.equal(got_state[slots[s]], state[slots[s]])
            continue
        a, b = int(cu[s]), int(cu[s + 1])
        torch.testing.assert_close(got[a:b], want[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_state[slots[s]], want[1], rtol=1e-4, atol=1e-5)
    assert torch.equal(got_state[4], state[4])


@needs_ops
def test_compiled_prefill_equals_the_chunked_form_for_each_sequence_in_every_variant():
    """The WY blocks of 16 tokens (the default), of 32, of 7 (a block's padding in every part), and the token loop."""
    for variant in cpu_kernels.delta_variants():
        for block in (16, 32, 7, 0):
            check_prefill(functools.partial(cpu_kernels.delta_rule_prefill, variant=variant, block=block))
    q, k, v, gate, beta, state = step_inputs(rows=78, heads=3, slots=4, seed=2)
    slots = torch.tensor([2, 0, 3, 1])
    for cu, block, message in ((torch.tensor([0, 5, 45, 40, 78]), 32, "must not decrease"),
                               (torch.tensor([0, 5, 45, 45, 77]), 32, "from 0 to the 78 tokens"),
                               (torch.tensor([0, 5, 45, 45, 78]), 65, "block must be 0")):
        with pytest.raises(ValueError, match=message):
            cpu_kernels.delta_rule_prefill(q, k, v, gate, beta, state, slots, cu, block=block)


@needs_ops
def test_compiled_short_conv_step_equals_the_reference():
    g = torch.Generator().manual_seed(3)
    x, conv, taps = torch.randn(3, 37, generator=g), torch.randn(4, 37, 3, generator=g), torch.randn(37, 4, generator=g)
    slots = torch.tensor([3, 1, 0])
    window = torch.cat([conv[slots], x.unsqueeze(-1)], dim=-1)
    got_conv = conv.clone()
    got = cpu_kernels.short_conv_step(x, got_conv, taps, slots)
    torch.testing.assert_close(got, F.silu((window * taps).sum(-1)), rtol=1e-5, atol=1e-6)
    assert torch.equal(got_conv[slots], window[..., 1:]) and torch.equal(got_conv[2], conv[2])


@needs_ops
@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "slots": torch.tensor([1, 1, 0])}, "appears twice"),
    (lambda a: {**a, "slots": torch.tensor([1, 5, 0])}, "outside the state"),
    (lambda a: {**a, "slots": torch.tensor([1, 0], dtype=torch.long)}, "slots must be"),
    (lambda a: {**a, "state": a["state"].double()}, "state must be float32"),
    (lambda a: {**a, "beta": a["beta"][:, :1]}, "beta must be"),
    (lambda a: {**a, "variant": "sse9"}, "unknown variant"),
])
def test_the_operators_refuse_bad_input_by_name(change, message):
    q, k, v, gate, beta, state = step_inputs()
    args = dict(q=q, k=k, v=v, g=gate, beta=beta, state=state, slots=torch.tensor([1, 0, 2]), variant="auto")
    args = change(args)
    with pytest.raises(ValueError, match=message):
        torch.ops.mla_kernels.delta_rule_step(*args.values())
    with pytest.raises(ValueError, match="slot 1 appears twice"):
        cpu_kernels.short_conv_step(torch.randn(2, 6), torch.randn(3, 6, 3), torch.randn(6, 4), torch.tensor([1, 1]))


@needs_ops
@pytest.mark.skipif(not cpu_kernels.cpu_ops.x86(), reason="the AVX2 cap is an x86-64 level")
def test_under_an_avx2_cap_the_operators_run_the_avx2_variant_and_equal_the_reference():
    """The cap ``MLA_CPU_ISA=avx2`` sets when the library loads (``set_max_isa``), set here for the test's length."""
    ops = torch.ops.mla_kernels
    before = ops.max_isa()
    ops.set_max_isa("avx2")
    try:
        assert cpu_kernels.delta_variants() == ("avx2", "generic")
        q, k, v, gate, beta, state = step_inputs()
        with pytest.raises(ValueError, match="cannot run the avx512 variant"):  # above the cap, or not on this CPU
            ops.delta_rule_step(q, k, v, gate, beta, state, torch.tensor([0, 1, 2]), "avx512")
        check_step(cpu_kernels.delta_rule_step)
        check_prefill(cpu_kernels.delta_rule_prefill)
    finally:
        ops.set_max_isa(before)


def test_triton_delta_rule_kernels_equal_the_reference():
    if linear_attention.recurrent_failure("cpu") is not None and not torch.cuda.is_available():
        pytest.skip(linear_attention.recurrent_failure("cpu"))
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def on_device(q, k, v, gate, beta, state, slots):
        moved = [t.to(device) for t in (q, k, v, gate, beta, state, slots)]
        out = linear_attention.recurrent_step(*moved)
        state.copy_(moved[5].cpu())
        return out.cpu()

    check_step(on_device)

    def chunked(*args):
        moved = [t.to(device) for t in args]
        out = linear_attention.chunked(*moved)
        args[5].copy_(moved[5].cpu())
        return out.cpu()

    check_prefill(chunked, heads=2)
    q, k, v, gate, beta, state = step_inputs()
    with pytest.raises(ValueError, match="state must be contiguous float32"):
        linear_attention.recurrent_step(q, k, v, gate, beta, state.double(), torch.tensor([0, 1, 2]))


def test_hybrid_decode_logits_match_transformers_with_the_chosen_kernels(checkpoint):  # noqa: F811
    """Two sequences prefilled, then three decode steps of both at once: each step's logits are transformers'
    for the sequence so far, with the kernels the layers chose at prepare time (compiled where the plan has them),
    and again with the torch reference in their place."""
    path, hf = checkpoint
    model = load_model(path, dtype="float32")
    chosen = {layer.kernels.decode for layer in model.linear_layers()}
    assert chosen == {"compiled" if model.plan.delta_failure is None else "torch"}
    seqs = prompts((6, 11), seed=7)
    nxt = [[(5 * i + 3 * j) % 50 + 2 for j in range(3)] for i in range(2)]
    refs = [hf_logits(hf, seqs[i] + nxt[i])[len(seqs[i]):] for i in range(2)]  # causal: each position's logits
    interpreted = {"triton"} if linear_attention.recurrent_failure("cpu") is None else set()
    for kernels in sorted(chosen | {"torch"} | interpreted):
        for layer in model.linear_layers():
            # interpreted Triton for the decode rows only (its prefill kernel: test_triton_delta_rule_kernels_...)
            layer.kernels = LinearKernels(kernels, "the test's choice", prefill=kernels.replace("triton", "torch"))
        runner = PagedRunner(model, 2, 32)
        runner.step({i: p for i, p in enumerate(seqs)})
        for j in range(3):
            out = runner.step({i: [nxt[i][j]] for i in range(2)})
            for i in range(2):
                ref = refs[i][j]
                assert float((out[i][-1] - ref).abs().max() / ref.abs().max()) <= 1e-4, (kernels, i, j)
