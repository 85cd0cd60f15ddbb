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
from mla_runtime.cache.snapshot_tier import Snapshot, SnapshotDisk, SnapshotTier
from mla_runtime.cache.state_cache import SizedSnapshots
from mla_runtime.engine.block_pool import block_hash
from mla_runtime.models.deepseek_v4 import state_bytes
from mla_runtime.models.v4_sizes import cache_kinds
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
        model: tuple[Path, Any], cold: dict[tuple[int, ...], list[int]]) -> None:  # noqa: F811
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


def snapshot_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.snap"))


def test_a_hit_from_the_disk_tier_after_a_restart(model: tuple[Path, Any],  # noqa: F811
                                                  cold: dict[tuple[int, ...], list[int]],  # noqa: F811
                                                  tmp_path: Path) -> None:
    """The first engine's snapshots are written at shutdown; a fresh engine on the same directory resumes from
    them (no host RAM tier: every hit comes from a file)."""
    path, hf = model
    first = engine(path, max_num_batched_tokens=24, kv_cache_dir=str(tmp_path), kv_cache_host_bytes=0)
    try:
        run(first, [HITS[0]])
    finally:
        first.shutdown()
    assert snapshot_files(tmp_path)
    llm = engine(path, max_num_batched_tokens=24, max_num_seqs=4, kv_cache_dir=str(tmp_path), kv_cache_host_bytes=0)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in BATCH], GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outs] == [cold[tuple(p)] for p in BATCH]
        assert [o.num_cached_tokens for o in outs] == [32, 0, 32, 0]
        assert tier_of(llm).stats().disk_hits == 1 and tier_of(llm).stats().corrupt_files == 0
        assert list(outs[2].outputs[0].token_ids) == hf_greedy(hf, HITS[3])
        check_whole(llm)
    finally:
        llm.shutdown()


def test_evicted_snapshots_reach_the_disk_through_host_ram(model: tuple[Path, Any],  # noqa: F811
                                                           cold: dict[tuple[int, ...], list[int]],  # noqa: F811
                                                           tmp_path: Path) -> None:
    """Host RAM of one snapshot over the disk tier: snapshots evicted from memory pass through host RAM to files,
    within both budgets, and a restarted engine finds every one of them."""
    path = model[0]
    llm = engine(path, max_num_batched_tokens=24, kv_cache_dir=str(tmp_path), kv_cache_host_bytes=SNAP,
                 state_snapshot_memory=state_bytes(CFG, 32, 4))
    try:
        for p in [HITS[0], *MISSES]:
            run(llm, [p])
            stats = tier_of(llm).stats()
            assert stats.host_usage_bytes <= SNAP and llm.engine.scheduler.snapshots.used_bytes <= SNAP
        assert stats.host_evictions > 0
        assert tier_of(llm).disk is not None and tier_of(llm).disk.flush(30)
        written = snapshot_files(tmp_path)
        assert written
    finally:
        llm.shutdown()
    llm = engine(path, max_num_batched_tokens=24, max_num_seqs=4, kv_cache_dir=str(tmp_path), kv_cache_host_bytes=0)
    try:
        assert run(llm, BATCH) == [cold[tuple(p)] for p in BATCH]
        assert llm.engine.stats().prefix_hit_tokens + llm.engine.pool.lower_hit_tokens >= 32
        check_whole(llm)
    finally:
        llm.shutdown()


def test_a_corrupt_or_foreign_file_is_recomputed_with_a_log_line(model: tuple[Path, Any],  # noqa: F811
                                                                 cold: dict[tuple[int, ...], list[int]],  # noqa: F811
                                                                 tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    path = model[0]
    first = engine(path, max_num_batched_tokens=24, kv_cache_dir=str(tmp_path), kv_cache_host_bytes=0)
    try:
        run(first, [HITS[0]])
    finally:
        first.shutdown()
    files = snapshot_files(tmp_path)
    good = {f: f.read_bytes() for f in files}
    # another dtype is another fingerprint: its engine never looks the float32 snapshots up
    other = LLM(str(path), dtype="bfloat16", max_model_len=128, block_size=BLOCK, kv_cache_memory="1MiB",
                kv_cache_dir=str(tmp_path), kv_cache_host_bytes=0)
    try:
        out = other.generate([{"prompt_token_ids": HITS[1]}], GREEDY)[0]
        assert out.num_cached_tokens == 0 and tier_of(other).stats().corrupt_files == 0
        # a float32 file put under the bfloat16 engine's own name: its header names another fingerprint
        target = tier_of(other).disk.path(tier_of(other).disk.key(prefix_hash(HITS[1], 2)))  # type: ignore[union-attr]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(next(f for f in files if f.read_bytes() == good[f]), target)
        other.engine.pool.watermark = 1e-9
        other.engine.pool.relieve_pressure()  # its own snapshots go (to its disk tier, under other names)
        other.engine.pool.watermark = 1.0
        with caplog.at_level(logging.WARNING, logger="mla_runtime"):
            out = other.generate([{"prompt_token_ids": HITS[2]}], GREEDY)[0]
        assert tier_of(other).stats().corrupt_files >= 1 and "header differs" in caplog.text
    finally:
        other.shutdown()
    for f, data in good.items():  # every float32 file corrupted in its tensors' bytes
        damaged = bytearray(data)
        damaged[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(damaged))
    caplog.clear()
    llm = engine(path, max_num_batched_tokens=24, max_num_seqs=4, kv_cache_dir=str(tmp_path), kv_cache_host_bytes=0)
    try:
        with caplog.at_level(logging.WARNING, logger="mla_runtime"):
            outs = llm.generate([{"prompt_token_ids": p} for p in BATCH], GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outs] == [cold[tuple(p)] for p in BATCH]
        assert [o.num_cached_tokens for o in outs[:1]] == [0]
        assert tier_of(llm).stats().corrupt_files >= 1 and "checksum mismatch" in caplog.text
        assert not any(f.exists() and f.read_bytes() != good[f] for f in good)  # the damaged files are gone
        check_whole(llm)
    finally:
        llm.shutdown()


def test_a_snapshot_that_does_not_fit_the_model_is_dropped(model: tuple[Path, Any],  # noqa: F811
                                                         cold: dict[tuple[int, ...], list[int]],  # noqa: F811
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A snapshot in host RAM whose tensors are not those of the state it claims (a layer's window cut short) is
    checked against the model's config on load, logged, dropped and recomputed."""
    llm = engine(model[0], max_num_batched_tokens=24, kv_cache_host_bytes=64 * SNAP)
    try:
        run(llm, [HITS[0]])
        evict_all(llm)
        tier, h = tier_of(llm), prefix_hash(HITS[0], 2)
        held = tier._lru[h]
        name = next(k for k in held.tensors if k.endswith("window"))
        tier._lru[h] = Snapshot({**held.tensors, name: held.tensors[name][1:]}, held.tokens)
        with caplog.at_level(logging.WARNING, logger="mla_runtime"):
            out = llm.generate([{"prompt_token_ids": HITS[1]}], GREEDY)[0]
        assert out.num_cached_tokens == 0 and list(out.outputs[0].token_ids) == cold[tuple(HITS[1])]
        assert "does not fit the model" in caplog.text and tier.tokens(h) is None
        check_whole(llm)
    finally:
        llm.shutdown()


def test_aborts_leave_nothing_held_and_the_budgets_hold(model: tuple[Path, Any], tmp_path: Path) -> None:  # noqa: F811
    """Requests sharing the prefix, aborted at every stage, under a memory budget of two snapshots over host RAM of
    two and a disk tier of a few: nothing is left held, every budget holds throughout."""
    memory, host = 2 * state_bytes(CFG, 48, 4), 2 * state_bytes(CFG, 48, 4)
    llm = engine(model[0], max_num_batched_tokens=24, max_num_seqs=3, state_snapshot_memory=memory,
                 kv_cache_host_bytes=host, kv_cache_dir=str(tmp_path), kv_cache_disk_bytes=8 * SNAP)
    e, rng = llm.engine, random.Random(5)
    snapshots, tier = e.scheduler.snapshots, tier_of(llm)
    assert isinstance(snapshots, SizedSnapshots)
    try:
        for i in range(10):
            p = rng.choice(HITS) + tokens(rng.randrange(0, 20), 200 + i)
            e.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=rng.randint(2, 6),
                                                                           ignore_eos=True))
            if i % 3 == 2:
                e.pool.watermark = 1e-9  # push the idle snapshots down the tiers now and then
                e.pool.relieve_pressure()
                e.pool.watermark = 1.0
        step = 0
        while e.has_unfinished_requests():
            e.step()
            step += 1
            assert snapshots.used_bytes <= memory and tier.stats().host_usage_bytes <= host
            if step % 3 == 0 and e.requests:
                e.abort(rng.choice(sorted(e.requests)))
        assert e.stats().prefix_hit_tokens > 0 and tier.stats().stored > 0
        check_whole(llm)
        assert tier.disk is not None and tier.disk.flush(30)
        assert tier.disk.usage_bytes <= 8 * SNAP + state_bytes(CFG, 48, 4) + 4096
    finally:
        llm.shutdown()


def test_write_through_writes_a_snapshot_as_it_is_committed(model: tuple[Path, Any], tmp_path: Path) -> None:  # noqa: F811
    llm = engine(model[0], max_num_batched_tokens=24, kv_cache_dir=str(tmp_path), kv_cache_host_bytes=0,
                 kv_cache_write_through=True)
    try:
        run(llm, [HITS[0]])
        disk = tier_of(llm).disk
        assert disk is not None and disk.flush(30)
        assert llm.engine.scheduler.snapshots.num_committed == 1 and len(snapshot_files(tmp_path)) == 1
        assert disk.tokens(prefix_hash(HITS[0], 2)) == 32 and tier_of(llm).stats().host_usage_bytes == 0
    finally:
        llm.shutdown()


def test_the_tiers_keep_snapshots_within_their_bounds_and_read_back_every_dtype(tmp_path: Path) -> None:
    """Host RAM of two snapshots over a disk tier: the least recently used one goes to a file, which reads back
    bit for bit (float32, bfloat16, an empty tensor); a truncated file is a counted miss, deleted."""
    def snap(seed: int) -> Snapshot:
        g = torch.Generator().manual_seed(seed)
        return Snapshot({"0.window": torch.randn(3, 8, generator=g).to(torch.bfloat16),
                         "1.compressor.overlap_gate": torch.randn(2, 4, generator=g),
                         "1.compressor.entries": torch.empty(0, 4)}, tokens=16 * seed)

    one = snap(1).nbytes
    disk = SnapshotDisk(tmp_path, "f" * 64, capacity_bytes=10 * one)
    tier = SnapshotTier(2 * one, disk)
    for h in (1, 2, 3):
        tier.store(h, snap(h))
    assert tier.usage_bytes <= 2 * one and tier.stats().host_evictions == 1 and disk.flush(30)
    assert [tier.tokens(h) for h in (1, 2, 3, 4)] == [16, 32, 48, None]
    got = tier.load(1)  # from its file
    assert got is not None and got.tokens == 16 and tier.stats().disk_hits == 1
    for name, t in snap(1).tensors.items():
        assert got.tensors[name].dtype == t.dtype and torch.equal(got.tensors[name], t)
    path = disk.path(disk.key(1))
    path.write_bytes(path.read_bytes()[:-5])
    assert tier.load(1) is None and not path.exists() and tier.stats().corrupt_files == 1
    for h in range(10, 40):  # the directory stays within its bound
        disk.store(h, snap(h % 3 + 1), wait=True)
    assert disk.flush(30) and sum(f.stat().st_size for f in tmp_path.rglob("*.snap")) <= 10 * one + 1024
    assert tier.close() == 2 and tier.usage_bytes == 0


def test_preemption_with_the_tiers_gives_the_same_tokens(model: tuple[Path, Any],  # noqa: F811
                                                         cold: dict[tuple[int, ...], list[int]],  # noqa: F811
                                                         tmp_path: Path) -> None:
    """A cache of 8 blocks and a memory budget of one snapshot over host RAM and a disk tier: sequences sharing the
    prefix are preempted and resumed from snapshots brought back from the tiers; nothing is left held."""
    per_token = cache_kinds(CFG, 4).block_bytes_per_token
    llm = engine(model[0], max_num_batched_tokens=24, max_num_seqs=4, kv_cache_memory=per_token * BLOCK * 8,
                 state_snapshot_memory=state_bytes(CFG, 48, 4), kv_cache_host_bytes=SNAP, kv_cache_dir=str(tmp_path))
    try:
        run(llm, [HITS[0]])
        evict_all(llm)
        assert run(llm, HITS) == [cold[tuple(p)] for p in HITS]
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.snapshots.num_lower_hits > 0
        check_whole(llm)
    finally:
        llm.shutdown()
