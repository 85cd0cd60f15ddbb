"""DeepSeek-V4's prefix caching through the engine, on the tiny ``deepseek_v4`` checkpoint transformers' classes build
(``tests/test_families_v4.py``): a shared prefix of 38 tokens, past the sliding window, past several compressed
entries of every compressor and past CSA's top-k. A request that hits it resumes from a state snapshot (every
window, partial window, compressed entry and indexer key at a block boundary) and gives exactly the greedy tokens
of an engine without prefix caching and of transformers: alone, in a batch of hits and misses, chunked, preempted.
Aborts and finishes leave every slot, block and snapshot free, and the snapshots' bytes within their budget."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.cache.state_cache import SizedSnapshots
from mla_runtime.models.deepseek_v4 import V4Config, state_bytes
from mla_runtime.models.v4_sizes import cache_kinds
from tests.test_families_v4 import CONFIG, TOPK, VOCAB, WINDOW, build

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BLOCK = 16
PREFIX_LEN = 38  # its last full block ends at 32: the snapshot a hit resumes from
# rates that leave both compressors' windows partial at a block boundary (blocks are multiples of 16 tokens)
CSA_RATE, HCA_RATE = 3, 12
RATES = {"compress_rates": {"compressed_sparse_attention": CSA_RATE, "heavily_compressed_attention": HCA_RATE}}
CFG = V4Config.from_raw({**CONFIG, **RATES, "model_type": "deepseek_v4"})


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = tokens(PREFIX_LEN, 1)
HITS = [PREFIX + tokens(n, 10 + n) for n in (5, 9, 3, 22)]
MISSES = [tokens(n, 20 + n) for n in (25, 45)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("deepseek_v4_prefix")
    hf = build(**RATES)
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def cold(model: tuple[Path, Any]) -> dict[tuple[int, ...], list[int]]:
    """Every prompt's greedy tokens from an engine without prefix caching, all in one batch."""
    llm = LLM(str(model[0]), dtype="float32", max_model_len=128, block_size=BLOCK, kv_cache_memory="1MiB",
              enable_prefix_caching=False)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in HITS + MISSES], GREEDY)
        return {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(HITS + MISSES, outs)}
    finally:
        llm.shutdown()


def hf_greedy(hf: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                          min_new_tokens=GREEDY.max_tokens)
    return ids[0, len(prompt):].tolist()


def engine(path: Path, **settings: Any) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=128, block_size=BLOCK,
               **{"kv_cache_memory": "1MiB", **settings})


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def check_whole(llm: LLM) -> None:
    """Every slot, slot state and block free; the snapshots held are the committed ones, with their bytes."""
    e = llm.engine
    snapshots, states = e.scheduler.snapshots, e.worker.states
    assert isinstance(snapshots, SizedSnapshots)
    assert e.scheduler.states is not None and e.scheduler.states.num_free == e.scheduler.states.num_slots
    assert states.nbytes() == 0
    e.pool.check_whole()
    snapshots.check_whole()
    held = [st for st in states.snapshots if st is not None]
    assert len(held) == snapshots.num_committed and snapshots.used_bytes <= snapshots.budget_bytes
    assert states.snapshot_nbytes() == snapshots.used_bytes == sum(state_bytes(CFG, st.length, 4) for st in held)


def test_the_prefix_reaches_every_kind_of_state() -> None:
    snapshot = PREFIX_LEN // BLOCK * BLOCK
    assert snapshot > WINDOW and snapshot // CSA_RATE > 2 * TOPK and snapshot // HCA_RATE >= 2
    assert snapshot % CSA_RATE and snapshot % HCA_RATE  # both compressors' windows partial at the snapshot


def test_a_hit_gives_the_tokens_of_a_cold_engine_and_of_transformers(model: tuple[Path, Any],
                                                                      cold: dict[tuple[int, ...], list[int]]) -> None:
    path, hf = model
    llm = engine(path, max_num_batched_tokens=32)
    try:
        first = llm.generate([{"prompt_token_ids": HITS[0]}], GREEDY)[0]
        assert first.num_cached_tokens == 0 and llm.engine.stats().prefix_hit_tokens == 0
        again = llm.generate([{"prompt_token_ids": HITS[1]}], GREEDY)[0]
        assert again.num_cached_tokens == 32 and llm.engine.stats().prefix_hit_tokens == 32
        for p, out in ((HITS[0], first), (HITS[1], again)):
            assert list(out.outputs[0].token_ids) == cold[tuple(p)] == hf_greedy(hf, p)
        check_whole(llm)
    finally:
        llm.shutdown()


def test_a_batch_of_hits_and_misses(model: tuple[Path, Any], cold: dict[tuple[int, ...], list[int]]) -> None:
    """Hits and misses in one batch, their prefills chunked (a hit resumes before its first chunk)."""
    path, hf = model
    llm = engine(path, max_num_batched_tokens=24, max_num_seqs=4)
    try:
        run(llm, [HITS[0]])
        batch = [HITS[1], MISSES[0], HITS[3], MISSES[1]]
        assert run(llm, batch) == [cold[tuple(p)] for p in batch]
        assert llm.engine.stats().prefix_hit_tokens == 2 * 32
        assert run(llm, [HITS[2]]) == [cold[tuple(HITS[2])]] == [hf_greedy(hf, HITS[2])]
        check_whole(llm)
    finally:
        llm.shutdown()


def test_aborts_and_finishes_release_every_snapshot_and_block(model: tuple[Path, Any]) -> None:
    """Requests sharing the prefix aborted at every stage (queued, prefilling, decoding) under a snapshot budget of
    two snapshots: nothing is left held, the snapshots' bytes stay within the budget throughout, and no block is held
    by two running sequences (each hit holds blocks of its own for its copy of the prefix)."""
    budget = 2 * state_bytes(CFG, 48, 4)
    llm = engine(Path(model[0]), max_num_batched_tokens=24, max_num_seqs=3, state_snapshot_memory=budget)
    e, rng = llm.engine, random.Random(3)
    snapshots = e.scheduler.snapshots
    assert isinstance(snapshots, SizedSnapshots) and snapshots.budget_bytes == budget
    try:
        for i in range(8):
            p = rng.choice(HITS) + tokens(rng.randrange(0, 20), 100 + i)
            e.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=rng.randint(2, 6),
                                                                           ignore_eos=True))
        step = 0
        while e.has_unfinished_requests():
            e.step()
            step += 1
            assert snapshots.used_bytes <= budget and e.worker.states.snapshot_nbytes() <= budget
            # a hit holds fresh blocks for its own copy of the prefix: no block counts two running sequences
            held = [b for s in e.scheduler.running for b in s.block_table]
            assert len(held) == len(set(held))
            if step % 4 == 0 and e.requests:
                e.abort(rng.choice(sorted(e.requests)))
        assert e.stats().prefix_hit_tokens > 0 and snapshots.num_evictions > 0
        check_whole(llm)
        e.pool.watermark = 1e-9
        e.pool.relieve_pressure()  # every idle cached block evicted: their snapshots go with them, states and all
        assert snapshots.num_committed == snapshots.used_bytes == 0
        assert all(st is None for st in e.worker.states.snapshots)
    finally:
        llm.shutdown()


def test_preemption_with_snapshots_gives_the_same_tokens(model: tuple[Path, Any],
                                                         cold: dict[tuple[int, ...], list[int]]) -> None:
    """A cache of 8 blocks for four prompts of 41 to 60 tokens sharing the prefix: sequences are preempted (hits
    among them, holding fresh blocks for their own copy of the prefix) and recomputed from the cache."""
    per_token = cache_kinds(CFG, 4).block_bytes_per_token
    llm = engine(Path(model[0]), max_num_batched_tokens=24, max_num_seqs=4, kv_cache_memory=per_token * BLOCK * 8)
    try:
        run(llm, [HITS[0]])
        assert run(llm, HITS) == [cold[tuple(p)] for p in HITS]
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.stats().prefix_hit_tokens >= 2 * 32
        check_whole(llm)
    finally:
        llm.shutdown()


def test_sized_snapshots_evict_by_bytes_and_drop_what_they_free() -> None:
    dropped: list[int] = []
    snaps = SizedSnapshots(4, 100, lambda tokens: 10 + tokens, dropped.append)
    a, b = snaps.reserve(30), snaps.reserve(40)  # 40 + 50 bytes
    assert a is not None and b is not None and snaps.reserve(1) is None  # 11 more do not fit beside them
    snaps.commit(a, 11)
    snaps.commit(b, 12)
    assert snaps.acquire(12) == b and snaps.reserve(95) is None  # larger than what unpinned snapshots free
    c = snaps.reserve(20)  # evicts the idle snapshot of hash 11
    assert c is not None and dropped == [a] and not snaps.has(11) and snaps.used_bytes == 80
    snaps.forget(12)  # pinned: freed (and dropped) at its release
    assert dropped == [a]
    snaps.release(b)
    assert dropped == [a, b] and snaps.used_bytes == 30
    snaps.discard(c)
    assert dropped == [a, b, c] and snaps.used_bytes == 0 and snaps.reserve(200) is None
    snaps.check_whole()
