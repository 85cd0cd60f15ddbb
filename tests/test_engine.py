"""Engine: batching never changes tokens; prefix hits and preemption change speed only; no block leaks."""

from __future__ import annotations

import random

import pytest
import torch

from mla_runtime import LLM, SamplingParams
from tests.checkpoints import VOCAB

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def make_prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 90) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(2, VOCAB) for _ in range(rng.randint(lo, hi))]} for _ in range(n)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_clean(llm: LLM) -> None:
    llm.engine.pool.check_whole()
    assert not llm.engine.requests
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@pytest.fixture(scope="module")
def v3(tiny_checkpoint):
    return tiny_checkpoint("v3")


def new_llm(path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "8MiB")
    kw.setdefault("block_size", 16)
    return LLM(str(path), dtype="float32", max_model_len=256, **kw)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_batched_greedy_equals_one_by_one_and_transformers(v3):
    path, hf = v3
    llm = new_llm(path, max_num_batched_tokens=256)
    prompts = make_prompts(32)
    together = tokens(llm.generate(prompts, GREEDY))
    assert_clean(llm)
    alone = [tokens(llm.generate([p], GREEDY))[0] for p in prompts]
    assert together == alone
    for p, got in list(zip(prompts, together))[:8]:
        assert got == hf_greedy(hf, p["prompt_token_ids"], GREEDY.max_tokens)
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["auto", "onednn", "plain"])
def test_each_cpu_gemm_setting_is_applied_at_load_and_keeps_the_tokens(v3, mode):
    """The engine setting cpu_gemm resolves the kernel plan the weights are prepared for (and is reported), and every
    setting gives transformers' greedy tokens."""
    from mla_kernels import cpu_ops
    from mla_runtime.kernel_plan import kernel_plan

    path, hf = v3
    llm = new_llm(path, cpu_gemm=mode)
    assert llm.engine.worker.plan == kernel_plan(mode) and llm.engine.worker.model.plan == kernel_plan(mode)
    info = llm.engine.info()
    assert info.cpu_gemm["mode"] == mode and info.attention_backend == "cpu"
    assert info.cpu_gemm["operators"] == cpu_ops.summary()  # the typed operators, or why they are not there
    assert info.cpu_gemm["operators"].startswith("torch.ops.mla_kernels") == (cpu_ops.failure() is None)
    compiled = {attn.kernels.decode for attn in llm.engine.worker.model.attention_layers()}
    assert compiled == {mode == "auto" and kernel_plan().row_kernels}  # the compiled decode
    prompts = make_prompts(3, seed=4)
    for p, got in zip(prompts, tokens(llm.generate(prompts, GREEDY))):
        assert got == hf_greedy(hf, p["prompt_token_ids"], GREEDY.max_tokens)
    assert_clean(llm)


def test_preemption_keeps_tokens(v3):
    path, _ = v3
    prompts = make_prompts(12, seed=1, lo=30, hi=60)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = tokens(new_llm(path).generate(prompts, params))
    small = new_llm(path, kv_cache_memory=20 * 16 * (32 + 16) * 3 * 4)  # 20 blocks of 16 tokens, fp32
    assert small.engine.pool.num_blocks == 20
    tight = tokens(small.generate(prompts, params))
    assert small.engine.scheduler.num_preemptions > 0
    assert tight == roomy
    assert_clean(small)


def test_prefix_hit_computes_only_new_tokens(v3):
    path, _ = v3
    llm = new_llm(path)
    rng = random.Random(3)
    shared = [rng.randrange(2, VOCAB) for _ in range(48)]  # 3 blocks of 16
    first = {"prompt_token_ids": shared + [5, 6, 7]}
    second = {"prompt_token_ids": shared + [9, 10]}
    llm.generate([first], GREEDY)
    before = llm.engine.stats()
    out = llm.generate([second], GREEDY)[0]
    after = llm.engine.stats()
    assert out.num_cached_tokens == 48
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 48
    # prompt tail (2 tokens) + 11 decode steps (the 12th token needs no forward pass)
    assert after.num_computed_tokens - before.num_computed_tokens == 2 + GREEDY.max_tokens - 1
    fresh = new_llm(path, enable_prefix_caching=False)
    assert tokens(fresh.generate([second], GREEDY)) == [out.outputs[0].token_ids]
    assert_clean(llm)


def test_seeded_sampling_is_reproducible_and_batch_independent(v3):
    path, _ = v3
    llm = new_llm(path)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    target = make_prompts(1, seed=7)[0]
    alone = tokens(llm.generate([target], params))[0]
    again = tokens(llm.generate([target], params))[0]
    others = make_prompts(6, seed=8)
    mixed = llm.generate(others[:3] + [target] + others[3:], [SamplingParams(max_tokens=16, temperature=1.0)] * 3
                         + [params] + [SamplingParams(max_tokens=16, temperature=1.0)] * 3)
    assert alone == again == mixed[3].outputs[0].token_ids
    other_seed = tokens(llm.generate([target], SamplingParams(max_tokens=16, temperature=0.9, seed=99)))[0]
    assert other_seed != alone
    assert_clean(llm)


def test_n_samples_share_prompt_blocks(v3):
    path, _ = v3
    llm = new_llm(path)
    prompt = make_prompts(1, seed=11, lo=64, hi=64)[0]  # 4 full blocks, the last recomputed
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=5)
    peak = []
    llm.engine.scheduler_hook = None
    engine = llm.engine
    engine.add_request("r", prompt, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
        peak.append(engine.pool.num_used_blocks)
        done = outs
    (out,) = done
    assert len(out.outputs) == 4 and all(len(o.token_ids) == 8 for o in out.outputs)
    # unshared: 4 samples × 5 blocks = 20; shared: 3 prompt blocks + 4 × 2 private blocks = 11
    assert max(peak) <= 11
    assert engine.pool.hit_tokens >= 3 * 48
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert_clean(llm)


def test_abort_at_every_stage_frees_blocks(v3):
    path, _ = v3
    llm = new_llm(path, max_num_batched_tokens=32)
    engine = llm.engine
    long_prompt = make_prompts(1, seed=12, lo=120, hi=120)[0]
    engine.add_request("queued", long_prompt, GREEDY)
    engine.abort("queued")
    assert_clean(llm)
    engine.add_request("prefilling", long_prompt, GREEDY)
    engine.step()  # 32 of 120 prompt tokens
    assert engine.scheduler.running and engine.pool.num_used_blocks > 0
    engine.abort("prefilling")
    assert_clean(llm)
    engine.add_request("decoding", make_prompts(1, seed=13, lo=10, hi=10)[0], SamplingParams(max_tokens=50))
    for _ in range(4):
        engine.step()
    assert engine.requests["decoding"].seqs[0].output_token_ids
    out = engine.abort("decoding")
    assert out.outputs[0].finish_reason == "abort"
    assert_clean(llm)


def test_stop_conditions(v3):
    path, _ = v3
    llm = new_llm(path)
    prompt = make_prompts(1, seed=14)[0]
    free_run = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    toks = free_run.outputs[0].token_ids
    assert free_run.outputs[0].finish_reason == "length" and len(toks) == 10
    stopped = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                    stop_token_ids=[toks[3]]))[0]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].token_ids == toks[: toks.index(toks[3]) + 1]
    assert_clean(llm)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"top_k": 0}, "top_k"), ({"n": 0}, "n"), ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"logit_bias": {3: 101}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_sampling_param_that_is_not_a_finite_number_is_refused_as_such(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be a finite number, got {value!r}$"):
        SamplingParams(**{field: value})


def test_a_top_k_beyond_any_vocabulary_keeps_every_token(v3):
    """A top_k too large for the kernels' indices (>= 2**31) means what -1 means, and the engine keeps running."""
    path, _ = v3
    llm = new_llm(path)
    target = make_prompts(1, seed=7)[0]
    runs = [tokens(llm.generate([target], SamplingParams(max_tokens=8, temperature=0.9, top_k=k, seed=5)))[0]
            for k in (2**63, -1)]
    assert SamplingParams(top_k=2**63).top_k == -1 and runs[0] == runs[1]
    assert_clean(llm)


def test_penalties_lower_generated_tokens_by_their_counts():
    from mla_runtime.engine.sampler import sample

    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0], [2.0, 1.9, 0.0, -1.0], [2.0, 1.9, 0.0, -1.0]])
    params = [SamplingParams(temperature=0, frequency_penalty=0.1, logprobs=0),
              SamplingParams(temperature=0, presence_penalty=0.05),
              SamplingParams(temperature=0, presence_penalty=2.0)]
    outputs = [[0, 0, 3], [0, 0, 3], []]  # token 0 twice, token 3 once; the last row has generated nothing
    gen = torch.Generator().manual_seed(0)
    result = sample(logits, params, [None] * 3, gen, outputs)
    # row 0: 2.0 - 2 × 0.1 = 1.8 < 1.9 -> token 1; row 1: 2.0 - 0.05 = 1.95 > 1.9 -> still 0; row 2: nothing to penalise
    assert result.token_ids == [1, 0, 0]
    # log-probabilities stay those of the model's own logits
    assert result.logprobs[0][1] == pytest.approx(float(logits[0].log_softmax(-1)[1]))
    assert torch.equal(logits[0], torch.tensor([2.0, 1.9, 0.0, -1.0]))  # the caller's logits are untouched


def test_repetition_penalty_logit_bias_and_min_tokens_in_the_sampler():
    from mla_runtime.engine.sampler import sample

    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0], [-1.0, -1.5, -3.0, -4.0], [2.0, 1.9, 0.0, -1.0],
                           [2.0, 1.9, 0.0, -1.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=1.1, logprobs=0),  # token 0 in the prompt
              SamplingParams(temperature=0, repetition_penalty=2.0),  # token 0 generated: -1 -> -2
              SamplingParams(temperature=0, logit_bias={2: 2.5}),
              SamplingParams(temperature=0, min_tokens=3)]
    prompts = [[0, 2], [3], [], []]
    outputs = [[], [0], [], []]
    suppress = [[], [], [], [0, 1]]  # row 3 may not stop yet: its stop tokens are 0 and 1
    result = sample(logits, params, [None] * 4, torch.Generator().manual_seed(0), outputs, prompts, suppress)
    # row 0: 2.0 / 1.1 = 1.82 < 1.9 -> 1; row 1: -1.0 × 2 = -2.0 < -1.5 -> 1; row 2: 0.0 + 2.5 > 2.0 -> 2;
    # row 3: 0 and 1 barred -> 2
    assert result.token_ids == [1, 1, 2, 2]
    assert result.logprobs[0][1] == pytest.approx(float(logits[0].log_softmax(-1)[1]))  # the model's own


def _reference_filter(logits, top_k, top_p, min_p):
    """Top-k / top-p / min-p by their definitions over each whole row, sorted: what the sampler must keep, and the
    tokens whose fate rests on rounding (their mass before within 1e-6 of top_p, or their probability within 1e-6
    of min_p times the largest): the sampler sums in another order and may keep or drop those either way."""
    out, close = logits.clone(), torch.zeros_like(logits, dtype=torch.bool)
    for r in range(logits.shape[0]):
        values, order = logits[r].sort(descending=True)
        probs = values.double().softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        keep = torch.arange(len(values)) < top_k[r]
        if top_p[r] < 1:
            keep &= before < top_p[r]
            close[r, order[(before - top_p[r]).abs() < 1e-6]] = True
        keep &= probs >= min_p[r] * probs[0]
        if min_p[r] > 0:
            close[r, order[(probs - min_p[r] * probs[0]).abs() < 1e-6 * probs[0]]] = True
        keep[0] = True
        out[r, order[~keep]] = float("-inf")
    return out, close


def test_top_k_top_p_and_min_p_keep_what_their_definitions_keep_at_a_large_vocabulary():
    """At DeepSeek's vocabulary size the sampler looks for each row's cut among its largest logits first and sorts
    the whole row only where the cut may lie beyond them; every way a row keeps exactly the tokens the definitions
    keep, and a row that filters nothing is left as it is."""
    from mla_runtime.engine.sampler import FILTER_CANDIDATES, _filter

    vocab = 102_400
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(vocab, generator=g) * 4.0  # a model's: most of the mass in a few hundred tokens
    flat = torch.randn(vocab, generator=g) * 0.1  # a random model's: top-p's cut far past the candidates
    middle = torch.randn(vocab, generator=g) * 1.5  # top_p 0.5's cut among 16 times as many candidates
    rows = [  # (logits, top_k, top_p, min_p)
        (peaked, vocab, 1.0, 0.0),  # nothing filtered
        (peaked, 40, 1.0, 0.0),
        (peaked, vocab, 0.9, 0.0),  # the cut among the candidates
        (flat, vocab, 0.9, 0.0),  # the cut beyond them: the whole row sorted
        (flat, 3 * FILTER_CANDIDATES, 1.0, 0.0),  # a top_k beyond the candidates
        (peaked, vocab, 1.0, 0.05),
        (flat, vocab, 1.0, 0.5),  # min_p's cut beyond the candidates
        (peaked, 200, 0.95, 0.01),
        (middle, vocab, 0.5, 0.0),
        (flat, 3 * vocab, 0.9, 0.0),  # a top_k beyond the vocabulary: the top-p cut, over the whole row
    ]
    logits = torch.stack([r[0] for r in rows])
    top_k = torch.tensor([r[1] for r in rows])
    top_p = torch.tensor([r[2] for r in rows])
    min_p = torch.tensor([r[3] for r in rows])
    got = _filter(logits, top_k, top_p, min_p)
    want, close = _reference_filter(logits, top_k, top_p, min_p)
    kept = got.isfinite()
    assert torch.equal(kept | close, want.isfinite() | close)
    assert int(close.sum()) <= 2  # a boundary at the edge of rounding is rare
    assert torch.equal(got[kept], logits[kept])  # the kept logits themselves are untouched
    counts = kept.sum(dim=-1).tolist()
    assert counts[0] == vocab and counts[1] == 40 and counts[4] == 3 * FILTER_CANDIDATES
    # each way of finding the cut was taken: among the candidates, among 16 times as many, over the whole row
    assert 1 < counts[2] < FILTER_CANDIDATES < counts[8] < 16 * FILTER_CANDIDATES < counts[3]
    assert torch.equal(_filter(logits[:1], top_k[:1], top_p[:1], min_p[:1]), logits[:1])


def test_random_draws_follow_the_filtered_distribution():
    """Each random row draws from its own distribution after temperature and filtering: 20,000 rows at once, the
    frequencies within 0.015 of the probabilities, and a token top-k removes never drawn."""
    from mla_runtime.engine.sampler import sample

    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    rows = 20_000
    for params, probs in (
        (SamplingParams(temperature=1.0), logits.softmax(-1)),
        (SamplingParams(temperature=0.5), (logits / 0.5).softmax(-1)),
        (SamplingParams(temperature=1.0, top_k=2), torch.cat([logits[:2].softmax(-1), torch.zeros(4)])),
    ):
        result = sample(logits.expand(rows, -1).contiguous(), [params] * rows, [None] * rows,
                        torch.Generator().manual_seed(1))
        freq = torch.bincount(torch.tensor(result.token_ids), minlength=6).double() / rows
        assert torch.allclose(freq, probs.double(), atol=0.015), (params, freq, probs)
        assert all(freq[i] == 0 for i in range(6) if probs[i] == 0)
    # a row that is no distribution (a NaN or infinite logit from a broken checkpoint) still gives a token in range
    broken = torch.randn(2, 1000)
    broken[0, 5], broken[1, 7] = float("nan"), float("inf")
    for params in (SamplingParams(), SamplingParams(top_p=0.9), SamplingParams(top_k=5)):
        drawn = sample(broken, [params] * 2, [None] * 2, torch.Generator().manual_seed(0)).token_ids
        assert all(0 <= t < 1000 for t in drawn)


def test_min_tokens_and_logit_bias_in_a_run(v3):
    path, _ = v3
    llm = new_llm(path)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    toks = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    # a stop token that the greedy run emits at position 2 cannot end the sequence before min_tokens
    stop = toks[1]
    early = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[stop]))[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == toks.index(stop) + 1
    late = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                 stop_token_ids=[stop], min_tokens=6))[0].outputs[0]
    assert stop not in late.token_ids[:6]
    assert late.finish_reason == "length" or (len(late.token_ids) > 6 and late.token_ids[-1] == stop)
    # a large bias makes a token the greedy choice at every step
    biased = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                   logit_bias={42: 100.0}))[0].outputs[0].token_ids
    assert biased == [42] * 5
    with pytest.raises(ValueError, match="logit_bias names token"):
        llm.generate([prompt], SamplingParams(max_tokens=5, logit_bias={VOCAB: 1.0}))
    assert_clean(llm)


def test_frequency_penalty_changes_a_repetitive_greedy_run(v3):
    path, _ = v3
    llm = new_llm(path)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    plain = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    toks = plain.outputs[0].token_ids
    assert len(set(toks)) < len(toks)  # the tiny random model repeats itself
    penalised = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                      frequency_penalty=2.0))[0].outputs[0].token_ids
    assert penalised != toks and len(set(penalised)) > len(set(toks))
    assert_clean(llm)


def test_bad_prompts_name_the_problem(v3):
    path, _ = v3
    llm = new_llm(path)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [3] * 300}], GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [VOCAB + 5]}], GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], GREEDY)
    assert_clean(llm)


def test_a_request_id_in_use_is_refused_before_its_prompt_is_read(v3, monkeypatch):
    """A caller that steps the engine itself is refused an id in use, by name, before the prompt is tokenized or
    checked (the one id check of that path); the request holding the id runs on untouched."""
    path, _ = v3
    llm = new_llm(path)
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    prepared = []
    monkeypatch.setattr(engine, "prepare_request", lambda *a, **k: prepared.append(a))
    with pytest.raises(ValueError, match="request_id 'r' is already in use"):
        engine.add_request("r", {"prompt_token_ids": [9]}, GREEDY)
    assert not prepared and engine.requests["r"].prompt_token_ids == [5, 6, 7]
    monkeypatch.undo()
    while engine.requests:
        engine.step()
    assert_clean(llm)


def test_cache_too_small_for_one_sequence(v3):
    path, _ = v3
    with pytest.raises(ValueError, match="kv_cache_memory"):
        new_llm(path, kv_cache_memory="10KiB")


def test_long_prefill_does_not_stall_running_decodes(v3):
    path, _ = v3
    llm = new_llm(path, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("short", make_prompts(1, seed=60, lo=5, hi=5)[0], SamplingParams(max_tokens=20))
    engine.step()  # the short prompt is prefilled and decoding
    engine.add_request("long", make_prompts(1, seed=61, lo=200, hi=200)[0], SamplingParams(max_tokens=2))
    short = engine.requests["short"].seqs[0]
    for _ in range(5):  # the long prompt needs 13 chunks of 16 tokens; the decode advances every step
        before = len(short.output_token_ids)
        engine.step()
        assert len(short.output_token_ids) == before + 1
    long_seq = engine.requests["long"].seqs[0]
    assert 0 < long_seq.num_computed_tokens < 200  # chunked: it shares each step's budget
    for rid in list(engine.requests):
        engine.abort(rid)
    assert_clean(llm)


def test_the_step_plan_puts_decodes_first_and_budgets_extra_tokens():
    """The scheduler's ``StepPlan``: fewest new tokens first; a decode's extra tokens are cut to the budget its
    own token leaves, and only the accepted ones count as computed."""
    from mla_runtime.engine.block_pool import BlockPool
    from mla_runtime.engine.scheduler import Scheduler, StepPlan
    from mla_runtime.engine.sequence import Sequence

    scheduler = Scheduler(BlockPool(16, 16), max_num_seqs=8, max_num_batched_tokens=40)
    a, b, c = (Sequence(i, str(i), 0, list(range(2 + 50 * i, 2 + 50 * i + n)), GREEDY)
               for i, n in enumerate((10, 30, 20)))
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()
    assert first.seqs == (a, b) and first.num_new_tokens == (10, 30)
    scheduler.on_step_done(first)
    a.append_token(5)
    b.append_token(6)
    scheduler.add(c)
    plan = scheduler.schedule({a.seq_id: [7, 8, 9]})
    assert plan.seqs == (b, a, c) and plan.num_new_tokens == (1, 4, 20)
    assert plan.extra_token_ids == ((), (7, 8, 9), ())
    scheduler.on_step_done(plan, {a.seq_id: 1})
    assert (a.num_computed_tokens, b.num_computed_tokens) == (12, 31)
    a.append_token(7)
    a.append_token(4)
    b.append_token(3)
    cut = scheduler.schedule({a.seq_id: [1] * 60})  # a, the first running decode, takes the whole budget
    assert cut.seqs == (a,) and cut.num_new_tokens == (40,) and cut.extra_token_ids == ((1,) * 39,)
    with pytest.raises(ValueError):
        StepPlan((a, b), (3, 1))


def test_fixed_chunks_cut_a_prompt_at_the_same_places_in_any_batch():
    """With fixed chunks (``chunk_size``, half the budget in whole blocks) a prefill's chunks end at multiples of it
    (or at the prompt's end) whatever the budget has left: a chunk that does not fit waits whole, and no new sequence
    is admitted past it."""
    from mla_runtime.engine.block_pool import BlockPool
    from mla_runtime.engine.scheduler import Scheduler
    from mla_runtime.engine.sequence import Sequence

    assert Scheduler.fixed_chunk_size(40, 16) == 16 and Scheduler.fixed_chunk_size(8192, 16) == 4096
    assert Scheduler.fixed_chunk_size(24, 16) == 16 and Scheduler.fixed_chunk_size(10, 16) == 10
    scheduler = Scheduler(BlockPool(32, 16), max_num_seqs=8, max_num_batched_tokens=40, fixed_chunks=True)
    assert scheduler.chunk_size == 16
    a, b, c, d = (Sequence(i, str(i), 0, list(range(2 + 60 * i, 2 + 60 * i + n)), GREEDY)
                  for i, n in enumerate((5, 30, 40, 3)))
    for seq in (a, b, c):
        scheduler.add(seq)
    first = scheduler.schedule()  # a whole, and the first chunks of b and c (3 of the budget left)
    assert first.seqs == (a, b, c) and first.num_new_tokens == (5, 16, 16)
    scheduler.on_step_done(first)
    a.append_token(5)
    scheduler.add(d)
    second = scheduler.schedule()  # a's decode, b's last 14, c's second chunk of 16; 9 left: d's 3 tokens fit
    assert second.seqs == (a, d, b, c) and second.num_new_tokens == (1, 3, 14, 16)
    scheduler.on_step_done(second)
    for seq in (a, b, d):
        seq.append_token(7)
    e = Sequence(9, "9", 0, list(range(200, 230)), GREEDY)
    scheduler.add(e)
    third = scheduler.schedule()  # three decodes; c's last 8 (its end); e's first chunk of 16 fits in the 29 left
    assert third.seqs == (a, b, d, c, e) and third.num_new_tokens == (1, 1, 1, 8, 16)
    # a prefill whose chunk does not fit waits whole and holds admissions back
    tight = Scheduler(BlockPool(32, 16), max_num_seqs=8, max_num_batched_tokens=20, fixed_chunks=True)
    assert tight.chunk_size == 16
    decodes = [Sequence(20 + i, f"d{i}", 0, [3], GREEDY) for i in range(6)]
    for seq in decodes:
        tight.add(seq)
    tight.on_step_done(tight.schedule())
    for seq in decodes:
        seq.append_token(4)
    long_seq, late = Sequence(30, "long", 0, list(range(40)), GREEDY), Sequence(31, "late", 0, [5, 6], GREEDY)
    tight.add(long_seq)
    tight.add(late)
    plan = tight.schedule()  # 6 decodes leave 14 < 16: the long prompt waits, and so does the short one behind it
    assert plan.seqs == tuple(decodes) and long_seq.num_computed_tokens == 0 and not long_seq.block_table
    for seq in decodes[:3]:
        tight.finish(seq, "length")
    tight.on_step_done(plan)
    for seq in decodes[3:]:
        seq.append_token(4)
    plan = tight.schedule()  # 3 decodes leave 17: its first chunk of 16 runs; the one token left is too few for late
    assert plan.seqs == (*decodes[3:], long_seq) and plan.num_new_tokens == (1, 1, 1, 16)


def test_prompt_ids_are_range_checked_once(v3, monkeypatch):
    """Token ids a caller has checked (the server's ``Tokenized`` prompt, checked against this vocabulary) are not
    checked again by the engine; any other prompt's are, and an id outside the vocabulary is refused by name."""
    from mla_runtime.engine import requests
    from mla_runtime.engine.requests import Tokenized
    from mla_runtime.errors import InvalidParam

    path, _ = v3
    llm = new_llm(path)
    vocab = llm.engine.model_config.vocab_size
    checks: list[int] = []
    original = requests.check_token_ids
    monkeypatch.setattr(requests, "check_token_ids", lambda ids, v: checks.append(len(ids)) or original(ids, v))
    ids = [3, 4, 5]
    llm.engine.prepare_request("checked", Tokenized(None, ids, vocab), GREEDY)
    assert checks == []
    llm.engine.prepare_request("plain", {"prompt_token_ids": ids}, GREEDY)
    llm.engine.prepare_request("other-vocabulary", Tokenized(None, ids, vocab + 1), GREEDY)
    assert checks == [3, 3]
    with pytest.raises(InvalidParam, match=rf"\[0, {vocab}\)") as e:
        llm.engine.prepare_request("bad", [3, vocab], GREEDY)
    assert e.value.param == "prompt_token_ids"
    llm.shutdown()
