"""Incremental detokenisation, chat templates, logprobs and the asyncio engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mla_runtime import SamplingParams
from mla_runtime.engine.async_llm import AsyncLLM
from mla_runtime.engine.config import EngineConfig
from mla_runtime.tokenizer import DecodeWindow, IncrementalDetokenizer, apply_chat_template
from tests.test_engine import assert_clean, make_prompts, new_llm

TEXT = "naïve café — 東京 🚀🎉 Ünïcödé ∑ x² ≤ ∞\n\tdef f(): return '✓'"


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE trained on a few lines: multi-byte characters end up split across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "def f(): return 1", "plain ascii text only"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    return fast


def test_incremental_detokenizer_never_emits_half_a_character(byte_tokenizer):
    ids = byte_tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT)  # the emoji and CJK characters really span several byte tokens
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    deltas = [detok.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == detok.text


def test_chat_template_is_applied(byte_tokenizer):
    ids = apply_chat_template(byte_tokenizer, [{"role": "user", "content": "hi ✓"}])
    assert byte_tokenizer.decode(ids) == "<user>hi ✓<assistant>"


def test_logprobs_are_log_softmax_of_the_logits(tiny_checkpoint):
    path, hf = tiny_checkpoint("v3")
    llm = new_llm(path)
    prompt = make_prompts(1, seed=50)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == 3
    ids = prompt["prompt_token_ids"] + out.token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt["prompt_token_ids"]) - 1 + i]
        assert tok in entry and len(entry) <= 3
        assert entry[tok] == pytest.approx(float(row[tok]), abs=1e-4)
        assert max(entry.values()) == pytest.approx(float(row.max()), abs=1e-4)
    assert_clean(llm)


def test_async_streams_and_abort(tiny_checkpoint):
    path, _ = tiny_checkpoint("v3")
    engine = AsyncLLM(EngineConfig(model=str(path), dtype="float32", max_model_len=256, block_size=16,
                                   kv_cache_memory="8MiB"))
    prompts = make_prompts(3, seed=51)

    async def stream(i: int, n: int) -> list[int]:
        seen = []
        async for out in engine.generate(prompts[i], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                         f"req-{i}"):
            seen.append(len(out.outputs[0].token_ids))
            final = out
        assert seen == sorted(seen) and seen[-1] == n and final.finished
        return final.outputs[0].token_ids

    async def aborted() -> str:
        async for out in engine.generate(prompts[2], SamplingParams(max_tokens=200), "req-abort"):
            if len(out.outputs[0].token_ids) >= 3:
                engine.abort("req-abort")
                return "aborted"
        return "finished"

    async def main():
        return await asyncio.gather(stream(0, 8), stream(1, 5), aborted())

    try:
        a, b, c = asyncio.run(main())
        assert len(a) == 8 and len(b) == 5 and c == "aborted"
        llm_engine = engine.engine
        llm_engine.pool.check_whole()
        assert not llm_engine.requests
    finally:
        engine.shutdown()


def test_async_calls_never_wait_for_a_step(tiny_checkpoint):
    """While the engine thread is inside a long step, submitting, aborting and reading stats return at once
    (the asyncio loop is never blocked); the queued operations then take effect in order, bad input still
    raises in the caller, and the pool ends whole."""
    import threading
    import time

    path, _ = tiny_checkpoint("v3")
    engine = AsyncLLM(EngineConfig(model=str(path), dtype="float32", max_model_len=256, block_size=16,
                                   kv_cache_memory="8MiB"))
    in_step, release = threading.Event(), threading.Event()

    def slow_step(llm_engine, outputs) -> None:  # a step hook runs inside the step, under the engine lock
        in_step.set()
        release.wait(10)

    engine.step_hooks.append(slow_step)
    prompts = make_prompts(3, seed=52)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def main():
        first = asyncio.create_task(_collect(engine.generate(prompts[0], params, "held")))
        assert await asyncio.to_thread(in_step.wait, 10)  # the engine thread is now inside a step
        t0 = time.monotonic()
        queue = engine.add_request("second", prompts[1], params)
        engine.add_request("dropped", prompts[2], params)
        engine.abort("dropped")
        stats = engine.stats()
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("second", prompts[1], params)
        with pytest.raises(ValueError, match="empty"):
            engine.add_request("bad", {"prompt_token_ids": []}, params)
        elapsed = time.monotonic() - t0
        engine.step_hooks.remove(slow_step)
        release.set()
        second = []
        while not second or not second[-1].finished:
            second.append(await queue.get())
        return elapsed, stats, await first, second[-1]

    try:
        elapsed, stats, first, second = asyncio.run(main())
        assert elapsed < 1.0  # the step it overlapped lasts until `release` (10 s at most)
        assert stats.num_blocks > 0  # the snapshot of the last step, not a wait for the current one
        assert len(first.outputs[0].token_ids) == 4 and len(second.outputs[0].token_ids) == 4
        deadline = time.monotonic() + 10
        while engine.engine.requests and time.monotonic() < deadline:  # the abort is applied by the engine thread
            time.sleep(0.01)
        with engine._lock:
            assert not engine.engine.requests
            engine.engine.pool.check_whole()
        # every queued submission was applied, the aborted one included (its prompt was counted, no output)
        assert engine.stats().num_prompt_tokens == sum(len(p["prompt_token_ids"]) for p in prompts)
    finally:
        release.set()
        engine.shutdown()


async def _collect(stream):
    last = None
    async for out in stream:
        last = out
    return last


def test_a_stream_holds_only_the_latest_output(tiny_checkpoint):
    """A consumer that does not read while the request runs to the end finds one output waiting, the final
    cumulative one, not a queue of one copy per step."""
    import time

    path, _ = tiny_checkpoint("v3")
    engine = AsyncLLM(EngineConfig(model=str(path), dtype="float32", max_model_len=256, block_size=16,
                                   kv_cache_memory="8MiB"))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=5)

    async def main():
        stream = engine.add_request("idle-reader", make_prompts(1, seed=53)[0], params)
        deadline = time.monotonic() + 30
        while stream.latest is None or not stream.latest.finished:  # the engine runs the request to the end
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        out = await stream.get()
        return out, stream.latest

    try:
        out, left = asyncio.run(main())
        assert out.finished and len(out.outputs[0].token_ids) == 30 and len(out.outputs[0].logprobs) == 30
        assert left is None  # nothing else was kept
    finally:
        engine.shutdown()


def test_a_decode_window_releases_whole_characters_and_decodes_each_token_a_few_times(byte_tokenizer):
    """The window releases a character only once all its bytes arrived, the pieces add up to the text, and each token
    is decoded a bounded number of times however long the text grows."""
    tok = byte_tokenizer
    text = TEXT * 20
    ids = tok.encode(text, add_special_tokens=False)
    decoded = [0]

    def decode(window: list[int]) -> str:
        decoded[0] += len(window)
        return tok.decode(window)

    stream = DecodeWindow(decode)
    pieces = [stream.update(ids[:k]) for k in range(1, len(ids) + 1)]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces)  # a character's first bytes wait for the rest
    assert decoded[0] <= 8 * len(ids)
