"""DeepSeek-V4's state snapshots in the prefix-cache tiers (``cache/snapshot_tier.py``), on the tiny ``deepseek_v4``
checkpoint of ``tests/test_v4_prefix_cache.py``: a snapshot that leaves ``state_snapshot_memory`` goes to host RAM
(``kv_cache_host_bytes``) and to the disk tier (``kv_cache_dir``); a later request, or a fresh engine on the same
directory, resumes from it and gives the greedy tokens of a cold engine and of transformers, in a batch with misses.
A corrupt file, or one of another model or setting, is logged and recomputed; the tiers' budgets hold; aborts leave
nothing held."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.cache.snapshot_tier import Snapshot, SnapshotTier
from mla_runtime.cache.state_cache import SizedSnapshots
from mla_runtime.engine.block_pool import block_hash
from mla_runtime.models.deepseek_v4 import state_bytes
from tests.test_v4_prefix_cache import (  # noqa: F401  (fixtures)
    BLOCK,
    CFG,
    GREEDY,
    HITS,
    MISSES,
    check_whole,
    cold,
    engine,
    hf_greedy,
    model,
    run,
    tokens,
)

SNAP = state_bytes(CFG, 32, 4)  # the snapshot every hit resumes from (after 32 tokens of the shared prefix)
BATCH = [HITS[1], MISSES[0], HITS[3], MISSES[1]]


def prefix_hash(prompt: list[int], blocks: int) -> int:
    """The block hash after the first ``blocks`` blocks of ``prompt`` (the key of the snapshot there)."""
    h = None
    for k in range(blocks):
        h = block_hash(h, prompt[k * BLOCK:(k + 1) * BLOCK])
    assert h is not None
    return h


def tier_of(llm: LLM) -> SnapshotTier:
    tier = llm.engine.worker.snapshot_tier
    assert tier is not None
    return tier


def evict_all(llm: LLM) -> None:
    """Every idle cached block leaves the pool, and the snapshots with them (to the tiers)."""
    pool, watermark = llm.engine.pool, llm.engine.pool.watermark
    pool.watermark = 1e-9
    pool.relieve_pressure()
    pool.watermark = watermark
    assert llm.engine.scheduler.snapshots.num_committed == 0


def test_a_hit_from_host_ram_gives_the_tokens_of_a_cold_engine_and_of_transformers(
        model: tuple[Path, Any], cold: dict[tuple[int, ...], list[int]]) -> None:
    path, hf = model
    llm = engine(path, max_num_batched_tokens=24, max_num_seqs=4, kv_cache_host_bytes=64 * SNAP)
    try:
        run(llm, [HITS[0]])
        evict_all(llm)  # the snapshot after the prefix is in host RAM alone now
        assert tier_of(llm).tokens(prefix_hash(HITS[1], 2)) == 32
        outs = llm.generate([{"prompt_token_ids": p} for p in BATCH], GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outs] == [cold[tuple(p)] for p in BATCH]
        assert [o.num_cached_tokens for o in outs] == [32, 0, 32, 0]
        assert tier_of(llm).stats().host_hits == 1  # brought back once, then shared from memory
        assert list(outs[0].outputs[0].token_ids) == hf_greedy(hf, HITS[1])
        check_whole(llm)
    finally:
        llm.shutdown()
