"""Speculative decoding by prompt lookup: greedy output is exactly plain decoding's and sampled output keeps
its distribution, in fewer steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from mla_runtime import LLM, SamplingParams
from mla_runtime.engine.speculative import propose
from tests.test_engine import assert_clean, make_prompts, new_llm

DEMO = Path(__file__).resolve().parent.parent / "mla_runtime" / "demo_model"


def test_propose_copies_what_followed_the_latest_earlier_occurrence():
    assert propose([1, 2, 3, 4, 1, 2], k=3, max_n=3, min_n=1) == [3, 4, 1]  # suffix [1, 2] seen at 0
    assert propose([5, 1, 2, 9, 1, 2, 7, 1, 2], k=2, max_n=2, min_n=1) == [7, 1]  # the latest occurrence wins
    assert propose([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], k=2, max_n=3, min_n=1) == [9, 2]  # longest suffix first
    assert propose([1, 2, 3, 4, 5], k=3, max_n=3, min_n=1) == []  # nothing repeats
    assert propose([4, 2, 4], k=3, max_n=3, min_n=2) == []  # only a 1-token match, below min_n
    assert propose([7, 7], k=4, max_n=3, min_n=1) == [7]
    assert propose([1, 2, 1], k=0, max_n=3, min_n=1) == []


def repetitive_prompts() -> list[dict]:
    """Prompts that repeat themselves (so drafts exist) and random ones (so some are rejected)."""
    loop = [11, 12, 13, 14, 15, 16]
    return [{"prompt_token_ids": loop * 6}, {"prompt_token_ids": [40, 41] * 10 + [40]}] + make_prompts(4, seed=5)


def generate(path, params, num_speculative_tokens: int, **kw):
    llm = new_llm(path, num_speculative_tokens=num_speculative_tokens, **kw)
    outs = llm.generate(repetitive_prompts(), params)
    stats = llm.engine.stats()
    assert_clean(llm)
    return outs, stats, llm


@pytest.mark.parametrize("extra", [
    {},
    {"frequency_penalty": 0.1, "repetition_penalty": 1.05},  # penalties see accepted drafts as generated
    {"min_tokens": 20, "stop_token_ids": [12, 41]},  # stop tokens suppressed per position, then honoured
])
def test_speculative_greedy_equals_plain_greedy(tiny_checkpoint, extra):
    path, _ = tiny_checkpoint("v3")
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=1, **extra)
    plain, plain_stats, _ = generate(path, params, 0)
    spec, stats, llm = generate(path, params, 4)
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
        for t, x, y in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert y[t] == pytest.approx(x[t], abs=1e-4)
            assert set(y) == set(x)
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    # every accepted draft saves a step's worth of tokens from being recomputed later: computed tokens match
    assert stats.num_computed_tokens == plain_stats.num_computed_tokens
    assert stats.num_generation_tokens == plain_stats.num_generation_tokens


def test_speculation_under_preemption_and_prefix_hits(tiny_checkpoint):
    path, _ = tiny_checkpoint("v3")
    prompts = [{"prompt_token_ids": p["prompt_token_ids"] * 3} for p in make_prompts(10, seed=8, lo=10, hi=20)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = new_llm(path).generate(prompts, params)
    small = new_llm(path, kv_cache_memory=20 * 16 * (32 + 16) * 3 * 4, num_speculative_tokens=3)
    spec = small.generate(prompts, params) + small.generate(prompts[:2], params)  # the second run hits the cache
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.stats().prefix_hit_tokens > 0 and small.engine.stats().num_accepted_tokens > 0
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain + plain[:2]]
    assert_clean(small)


def test_sampled_requests_speculate_and_stay_seeded(tiny_checkpoint):
    path, _ = tiny_checkpoint("v3")
    params = SamplingParams(max_tokens=30, temperature=0.3, seed=3, ignore_eos=True)
    first, stats, _ = generate(path, params, 4)
    again, _, _ = generate(path, params, 4)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]  # seeded
    assert all(len(o.outputs[0].token_ids) == 30 for o in first)


def test_speculative_sampling_keeps_the_distribution():
    """Random rows with a draft: accept it with probability p(draft), else draw from the rest of p — each
    emitted token is distributed as p, whether the drafts are likely, unlikely or impossible."""
    import math

    import torch

    from mla_runtime.engine.model_runner import ModelRunner
    from mla_runtime.engine.scheduler import StepPlan
    from mla_runtime.engine.sequence import Sequence

    p = [0.5, 0.3, 0.2, 0.0]
    runner = ModelRunner(FixedLogits([math.log(x) if x else -math.inf for x in p]), seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=16)
    trials = 4000
    for drafts in ([0, 0], [2, 1], [3, 3]):
        first, second = torch.zeros(4), torch.zeros(4)
        for t in range(trials):
            seq = Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=[1], params=params,
                           output_token_ids=[1], generator=torch.Generator().manual_seed(t))
            seq.num_computed_tokens, seq.block_table = 1, [0]
            sampled, _ = runner.run(StepPlan((seq,), (3,), (tuple(drafts),)))
            tokens = sampled[0].token_ids
            first[tokens[0]] += 1
            if len(tokens) > 1:  # the first draft was accepted: the next token is again a draw from p
                second[tokens[1]] += 1
        assert torch.allclose(first / trials, torch.tensor(p), atol=0.03), (drafts, first / trials)
        if drafts[0] != 3:
            assert torch.allclose(second / second.sum(), torch.tensor(p), atol=0.04), (drafts, second / second.sum())


def test_stop_string_inside_a_speculative_step_and_fewer_steps(tmp_path):
    """On the demo model (which repeats its argument names) drafts are accepted, a stop string that lands
    among a step's tokens cuts there, and the run takes fewer engine steps."""
    prompt = "def load(path):\n"
    runs = {}
    for k in (0, 4):
        with LLM(str(DEMO), dtype="float32", max_model_len=256, kv_cache_memory="4MiB",
                 num_speculative_tokens=k) as llm:
            steps = 0
            llm.engine.add_request("r", prompt, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
                steps += 1
            free = llm.generate([prompt], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))[0]
            stop = free.outputs[0].text[20:24]
            cut = llm.generate([prompt], SamplingParams(max_tokens=48, temperature=0, stop=stop))[0]
            runs[k] = (steps, free.outputs[0], cut.outputs[0], llm.engine.stats())
            assert_clean(llm)
    (plain_steps, plain_free, plain_cut, _), (spec_steps, spec_free, spec_cut, stats) = runs[0], runs[4]
    assert spec_free.token_ids == plain_free.token_ids and spec_free.text == plain_free.text
    assert spec_cut.text == plain_cut.text and spec_cut.token_ids == plain_cut.token_ids
    assert spec_cut.finish_reason == "stop"
    assert stats.num_accepted_tokens > 0
    assert spec_steps < plain_steps


def test_bad_speculative_settings_name_the_field(tiny_checkpoint):
    path, _ = tiny_checkpoint("v3")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        new_llm(path, num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        new_llm(path, num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2)


class FixedLogits:
    """A stand-in worker whose every position scores the vocabulary the same way."""

    def __init__(self, row: list[float]) -> None:
        import torch

        from mla_runtime.config import ModelConfig
        from mla_runtime.engine.config import EngineConfig

        self.config = EngineConfig(model="unused")
        self.row = torch.tensor(row)
        self.device = torch.device("cpu")
        self.model_config = ModelConfig.from_dict({"model_type": "deepseek_v3", "vocab_size": len(row),
                                                   "eos_token_id": 3, "hidden_size": 8, "num_hidden_layers": 1,
                                                   "num_attention_heads": 1, "kv_lora_rank": 4, "qk_rope_head_dim": 2,
                                                   "qk_nope_head_dim": 2, "v_head_dim": 2, "intermediate_size": 8})

    def execute(self, step):
        return self.row.expand(len(step.logit_rows), -1).clone()

    def take_state_releases(self):
        return [], []  # no state slots: nothing for other ranks to release


@pytest.mark.parametrize("params, drafts, expected", [
    # row j sees drafts[:j] as generated: the accepted first draft (0) is penalised at row 1, which then picks 1
    (SamplingParams(temperature=0, frequency_penalty=0.1), [0, 0], [0, 1]),
    (SamplingParams(temperature=0, repetition_penalty=1.1), [0, 0, 0], [0, 1]),
    # min_tokens counts the drafts before each row: EOS (3) is barred at rows 0-1 and allowed from row 2
    (SamplingParams(temperature=0, min_tokens=3), [0, 0, 0], [0, 0, 3]),
    (SamplingParams(temperature=0), [0, 2, 0], [0, 0]),  # the second draft is rejected: the model says 0
])
def test_each_draft_position_is_sampled_with_the_drafts_before_it(params, drafts, expected):

    from mla_runtime.engine.model_runner import ModelRunner
    from mla_runtime.engine.scheduler import StepPlan
    from mla_runtime.engine.sequence import Sequence

    logits = [2.0, 1.95, 0.0, 2.5 if params.min_tokens else -1.0]
    runner = ModelRunner(FixedLogits(logits), seed=0)
    seq = Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=[2, 2], params=params, output_token_ids=[2])
    seq.num_computed_tokens, seq.block_table = 2, [0]
    sampled, accepted = runner.run(StepPlan((seq,), (1 + len(drafts),), (tuple(drafts),)))
    assert sampled[0].token_ids == expected
    assert accepted == {0: len(expected) - 1}


def test_served_with_speculation_streams_the_same_text():
    """The server with --num-speculative-tokens: several tokens per step stream as the same deltas' text."""
    import json

    import httpx

    from tests.test_server import Live

    prompt = {"prompt": "def load(path):\n", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    texts = {}
    for k in (0, 4):
        live = Live(DEMO, engine={"num_speculative_tokens": k, "max_model_len": 256, "kv_cache_memory": "4MiB",
                                  "dtype": "float32"})
        try:
            whole = httpx.post(live.base + "/generate", json=prompt, timeout=60).json()
            events = []
            with httpx.stream("POST", live.base + "/generate", json={**prompt, "stream": True}, timeout=60) as s:
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
            streamed = "".join(e["text"] for e in events)
            assert streamed == whole["text"] and sum(len(e["token_ids"]) for e in events) == 40
            accepted = live.metrics()[("mla_spec_accepted_tokens_total", ("method", "prompt_lookup"))]
            texts[k] = (whole["text"], len(events), accepted, max(len(e["token_ids"]) for e in events))
        finally:
            live.stop()
    assert texts[4][0] == texts[0][0]
    # accepted drafts: a step's tokens stream as one event (a slow reader may also get several steps' tokens in one
    # event, with or without speculation: how many events there are is the reader's timing, not the engine's)
    assert texts[4][2] > 0 and texts[4][3] > 1
