"""A prompt's logits do not depend on the batch it is computed in, where the products round their rows to int8.

The int4, W4A16, W8A8 and GGUF kernels round each input row to int8 (in groups, or per row). A last-bit difference
in the float parts of the model between batch shapes (a norm, the router's or ``kv_b_proj``'s product, the absorbed
attention, a layer's one-row kernel) then moves an element across a rounding step, and the difference grows to
1e-2 in the logits: enough to change a greedy token. Such a model makes every float part give a row the same bits
whatever rows share its call (``DeepseekForCausalLM.rows_invariant``); these tests run prompts together and alone,
prefill and decode, and compare the logits bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from mla_kernels import cpu_kernels
from mla_runtime.layers.quantization import finish_quantization
from mla_runtime.loader import load_model
from tests.conformance import build, prompts
from tests.model_utils import PagedRunner

needs_kernels = pytest.mark.skipif(cpu_kernels.failure("int4") is not None or cpu_kernels.failure("w8a8") is not None,
                                   reason="the compiled integer and float kernels do not build on this machine")


@needs_kernels
# drawn DeepSeek-V2 and -V3 configurations whose batches parted from their prompts alone (V2's at a decode, V3's at its
# sigmoid router), and MiniCPM3's fixed one, whose layers run call by call
@pytest.mark.parametrize("model_type, seed", [("deepseek_v2", 2), ("minicpm3", None), ("deepseek_v3", 1)])
@pytest.mark.parametrize("scheme", ["int4", "w8a8"])
def test_a_prompt_gets_the_same_logits_in_any_batch(tmp_path, monkeypatch, model_type, seed, scheme):
    """Ten prompts prefilled in one step (the short ones planned and computed by the compiled layers, the rest call
    by call) and three decode steps of ten rows (compiled calls of up to eight), against each prompt alone."""
    from mla_kernels import cpu_tables

    compiled_rows: list[int] = []
    real = cpu_tables.decoder_layer
    monkeypatch.setattr(cpu_tables, "decoder_layer",
                        lambda t, s, x, *a: compiled_rows.append(s.rows) or real(t, s, x, *a))
    build(model_type, seed).save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype="float32", quantization=scheme)
    finish_quantization(model, scheme)
    assert model.rows_invariant
    ps = prompts((1, 2, 3, 5, 9, 11, 12, 17, 26, 40), seed=3)  # fewest tokens first, as the engine's steps order them
    together = PagedRunner(model, len(ps), 64)
    first = together.step(dict(enumerate(ps)))
    steps = [together.step({i: [(7 * i + s) % 50 + 1 for _ in range(1)] for i in range(len(ps))}) for s in range(3)]
    if model.model.layers[0].kernel_table() is not None:  # MiniCPM3's layers run call by call throughout
        assert max(compiled_rows) == cpu_kernels.max_rows(torch.float32)  # the decodes: 8 + 2
    for i, p in enumerate(ps):
        alone = PagedRunner(model, 1, 64, seed=i)
        assert torch.equal(alone.step({0: p})[0], first[i]), f"prompt {i}: prefill"
        for s, step in enumerate(steps):
            assert torch.equal(alone.step({0: [(7 * i + s) % 50 + 1]})[0], step[i]), f"prompt {i}: decode step {s}"


def test_a_model_whose_products_keep_their_rows_keeps_its_fast_paths(tiny_checkpoint):
    """bfloat16 and int8 (rows rounded to int16) models keep the one-row kernels and the row-count routes."""
    ckpt, _ = tiny_checkpoint("v3")
    for scheme in (None, "int8"):
        model = load_model(ckpt, dtype="float32", quantization=scheme)
        if scheme:
            finish_quantization(model, scheme)
        assert not model.rows_invariant


@needs_kernels
# the fixed configurations cut into chunks by a small budget; a sparse (DSA), a hybrid and a DeepSeek-V3 configuration
# whose batches parted from their prompts alone at the default budget (the conformance matrix's stored cells); and FP4
# weights, whose
# products keep their rows' float values, batch-invariant when asked (a Mistral Large 4 configuration whose batch
# parted from its prompts alone at indexer near-ties)
@pytest.mark.parametrize("model_type, seed, kind, budget, mode", [
    ("minicpm3", None, "stored-int4", 30, "auto"), ("deepseek_v3", None, "gguf-q4_k_m", 64, "auto"),
    ("glm_moe_dsa", 2, "stored-w4a16", None, "auto"), ("bailing_hybrid", 2, "stored-w4a16", None, "auto"),
    ("deepseek_v3", 3, "gguf-q4_k_m", None, "auto"),
    ("mistral_large4", 2, "stored-nvfp4", None, "on")])
def test_the_engine_gives_a_prompt_the_same_tokens_in_any_batch(tmp_path, model_type, seed, kind, budget, mode):
    """The conformance matrix's twelve prompts, 1 to 200 tokens, batched and alone through the engine, greedy tokens
    equal. Each case failed before its fix:
    - under a small budget, the budget's leftovers cut the prompts: a chunk's rows took other paths in the batch than
      alone (the absorbed one for a chunk of a few, float32 or bfloat16 attention by its size); the engine now cuts
      each prompt into fixed chunks (``Scheduler.chunk_size``);
    - a sparse layer's indexer selected nothing when no row of the step saw more keys than its top-k, so a short
      prompt attended densely alone and over its selection beside a long one; and prefill chunks took masked dense
      attention or the gathered one by the whole step's cost (the backend's ``rows_invariant``);
    - a prefill chunk took the absorbed or the up-projected attention by the whole step's cost (``choose_path``);
    - a linear-attention layer's gates (sigmoid, softplus) rounded an element by where it fell in the step's flat
      loop (``elementwise.wide``);
    - FP4 models are not batch-invariant by default (their products keep the rows' float values): with
      ``batch_invariant="on"`` they are.
    No prefix is taken from the cache: a hit starts the prompt's computation at its block, not at a chunk's start."""
    from mla_runtime import LLM, SamplingParams
    from tests.conformance import PROMPT_LENS, Family

    path = Family(model_type, seed, tmp_path).checkpoint(kind)
    llm = LLM(str(path), dtype="float32", max_model_len=256, block_size=16, enable_prefix_caching=False,
              batch_invariant=mode, **({"max_num_batched_tokens": budget} if budget else {}))
    try:
        assert llm.engine.worker.model.rows_invariant
        assert llm.engine.scheduler.chunk_size == (budget // 2 // 16 * 16 or 16 if budget else 1024)
        greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        reqs = [{"prompt_token_ids": p} for p in prompts(PROMPT_LENS)]
        together = [o.outputs[0].token_ids for o in llm.generate(reqs, greedy)]
        alone = [llm.generate([r], greedy)[0].outputs[0].token_ids for r in reqs]
    finally:
        llm.shutdown()
    assert [n for n, a, b in zip(PROMPT_LENS, together, alone) if a != b] == []


@pytest.mark.parametrize("threads", [2, 7])
def test_the_routers_sigmoid_gives_a_row_the_same_bits_at_any_row_and_thread_count(threads):
    """``sigmoid_rows`` (and the linear-attention gates through ``elementwise.wide``): a row's scores alone equal its
    scores among up to 1499 rows, under 2 and 7 threads (in float32, ATen's flat loop takes the scalar formula at the
    end of each thread's share, and with 7 threads a row of 1500 such rows got other bits than alone)."""
    from mla_runtime.layers.moe import sigmoid_rows

    x = torch.randn(1500, 72, generator=torch.Generator().manual_seed(0)) * 4
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = sigmoid_rows(x)
        for n in (1, 5, 517, 999, 1499):
            assert torch.equal(sigmoid_rows(x[:n]), full[:n]), n
    finally:
        torch.set_num_threads(before)
    assert torch.allclose(full, x.sigmoid(), rtol=1e-6, atol=0)


def test_batch_invariance_can_be_turned_off_and_a_bad_mode_is_refused(tmp_path):
    """``batch_invariant="off"``: a stored int4 model keeps its fast paths and the budget's chunks; an unknown mode is
    refused by name."""
    from mla_runtime import LLM
    from mla_runtime.engine.config import EngineConfig
    from mla_runtime.errors import InvalidParam
    from tests.conformance import Family

    path = Family("deepseek_v2", None, tmp_path).checkpoint("stored-int4")
    llm = LLM(str(path), dtype="float32", max_model_len=256, batch_invariant="off")
    try:
        assert not llm.engine.worker.model.rows_invariant and llm.engine.scheduler.chunk_size is None
    finally:
        llm.shutdown()
    with pytest.raises(InvalidParam, match="batch_invariant must be one of auto, on, off"):
        EngineConfig(model=str(path), batch_invariant="always")


def test_a_rows_invariant_step_takes_the_up_projected_path_for_its_prompts_whatever_their_count():
    """``choose_path`` picks the cheaper attention for a whole step by its totals, so a prompt alone and the same prompt
    beside others could take different paths; a rows-invariant backend's prompts take the up-projected one always,
    its decode steps the absorbed one."""
    from mla_runtime.attention.metadata import AttentionDims, choose_path
    from mla_runtime.forward_batch import ForwardBatch

    dims = AttentionDims(d_c=512, d_r=64, d_n=128, d_v=128)
    alone = ForwardBatch.build([[1] * 20], [4000], [list(range(252))], 16)  # a short chunk over a long context
    together = ForwardBatch.build([[1] * 20, [2] * 2000], [4000, 0], [list(range(252)), list(range(300, 425))], 16)
    assert (choose_path(alone, dims, "auto"), choose_path(together, dims, "auto")) == ("absorbed", "naive")
    assert choose_path(alone, dims, "auto", True) == choose_path(together, dims, "auto", True) == "naive"
    decode = ForwardBatch.build([[1], [2]], [30, 40], [[0, 1], [2, 3, 4]], 16)
    assert choose_path(decode, dims, "auto", True) == "absorbed"
    assert choose_path(alone, dims, "absorbed", True) == "absorbed"  # a path the settings force stays


@needs_kernels
def test_a_short_chunk_is_planned_whatever_short_chunks_come_before_it(tmp_path, monkeypatch):
    """A step's planned rows are its leading short chunks; one that reads many keys (``PLANNED_EXTRA_KEY_BYTES``,
    shrunk here to the tiny model's scale) ended the run, and a short prompt after it took the up-projected path in
    the batch and the absorbed one alone. A rows-invariant backend plans by the chunks' lengths alone."""
    from mla_runtime.attention import cpu

    monkeypatch.setattr(cpu, "PLANNED_EXTRA_KEY_BYTES", 20 << 10)
    build("deepseek_v2", 2).save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype="float32", quantization="int4")
    finish_quantization(model, "int4")
    long, more, short = prompts((200, 5, 7), seed=4)
    together = PagedRunner(model, 2, 256)
    together.step({0: long})
    both = together.step({0: more, 1: short})  # 5 new tokens over 200 keys, then a 7-token prompt
    assert torch.equal(both[1], PagedRunner(model, 1, 256).step({0: short})[0])
