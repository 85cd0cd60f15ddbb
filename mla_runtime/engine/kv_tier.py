"""``LowerTierDriver``: rank 0's side of the lower tiers of the prefix cache — the ``LowerTier`` the block pool
calls, in block ids and hashes, carried out on every rank that keeps them. The tier it drives is the top of the
rank's stack: the host-RAM tier (``cache/host_tier.py``, over the disk tier when there is one) or the disk tier
alone (``cache/disk_tier.py``); both take the same calls.

- One rank, or the replicated tensor-parallel layout: rank 0's tiers alone store and load; a load is then
  broadcast from rank 0's cache to the other ranks (``kv_broadcast``), which hold the same latents.
- The sharded layout: each rank keeps the shards of its own tokens under the same block key. Rank 0 sends
  ``kv_store`` and ``kv_load`` to the other ranks; a load counts only the blocks every rank found (the smallest
  count, agreed by an all-reduce). Prefetching is rank 0's alone, so it is off under this layout.

A graceful shutdown (``close``) first stores every full block the pool still holds that is not on disk yet, then
waits for the writers up to the timeout (with a host tier alone, nothing outlives the process: it only closes).

DeepSeek-V4's blocks hold no rows: its prefix hits are state snapshots, whose own tiers (``cache/snapshot_tier.py``)
``attach_snapshot_tier`` puts under the pool instead, and ``SnapshotTierDriver`` closes at shutdown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from mla_runtime.cache.disk_tier import DiskTier, agree_min, broadcast_blocks
from mla_runtime.cache.host_tier import HostTier
from mla_runtime.cache.state_cache import SizedSnapshots, SnapshotBlocks, StateSnapshots
from mla_runtime.engine.block_pool import BlockPool
from mla_runtime.engine.tp_workers import TensorParallelGroup
from mla_runtime.engine.v4_worker import SnapshotStore
from mla_runtime.engine.worker import Worker

logger = logging.getLogger("mla_runtime")


def attach_lower_tier(worker: Worker, pool: BlockPool, tp_group: TensorParallelGroup | None,
                      write_through: bool) -> LowerTierDriver | None:
    """Put the worker's lower tiers (if it opened any) under ``pool``, and log their capacity."""
    tier = worker.lower_tier
    if tier is None:
        return None
    driver = LowerTierDriver(worker, tier, tp_group)
    pool.attach_lower_tier(driver, write_through)
    host, disk = worker.host_tier, worker.disk_tier
    if host is not None:
        logger.info("host tier: capacity %s B = %d tokens (%d B per block of %d tokens, %s memory), %s",
                    f"{host.capacity_bytes:,}", host.capacity_tokens(), host.payload_bytes, pool.block_size,
                    "pinned" if host.pinned else "pageable",
                    "over the disk tier" if disk is not None else "host RAM only: nothing survives a restart")
    if disk is not None:
        logger.info("disk tier: %s, capacity %s B = %d tokens (%d B per block of %d tokens), %s B in use, %s",
                    disk.folder, f"{disk.capacity_bytes:,}", disk.capacity_tokens(), disk.file_bytes(),
                    pool.block_size, f"{disk.stats().usage_bytes:,}",
                    "write-through" if write_through else "written on eviction")
    return driver


class LowerTierDriver:
    def __init__(self, worker: Worker, tier: HostTier | DiskTier, tp_group: TensorParallelGroup | None = None) -> None:
        self.worker = worker
        self.tier = tier
        self.tp = tp_group
        self.sharded = worker.par.sharded_cache

    def store(self, block_hash: int, block: int) -> None:
        self.tier.store(block_hash, block)
        if self.tp is not None and self.sharded:
            self.tp.send("kv_store", ([(block_hash, block)], False))

    def lookup(self, hashes: Sequence[int]) -> int:
        return self.tier.lookup(hashes)

    def load(self, hashes: Sequence[int], blocks: Sequence[int]) -> int:
        if self.tp is None:
            return self.tier.load(hashes, blocks)
        if self.sharded:
            self.tp.send("kv_load", (list(hashes), list(blocks)))
            return agree_min(self.tier.load(hashes, blocks), self.worker.par)
        n = self.tier.load(hashes, blocks)
        if n:
            assert self.worker.cache is not None
            self.tp.send("kv_broadcast", list(blocks[:n]))
            broadcast_blocks(self.worker.cache, blocks[:n], self.worker.par)
        return n

    def prefetch(self, hashes: Sequence[int]) -> None:
        if not self.sharded:
            self.tier.prefetch(hashes)

    def close(self, resident: Sequence[tuple[int, int]], timeout: float) -> int:
        """Store the ``(hash, block)`` pairs not on disk yet (waiting for queue room), then write everything queued
        within ``timeout`` seconds, on every rank; returns how many blocks were stored for it. Without a disk tier
        nothing outlives the process: the tiers only close."""
        deadline = time.monotonic() + timeout
        resident = resident if self.tier.persistent else []
        queued = 0
        for h, b in resident:
            if time.monotonic() > deadline:
                break
            queued += int(self.tier.store(h, b, wait=True))
        if self.tp is not None and self.sharded:
            self.tp.send("kv_store", (list(resident), True))
            self.tp.send("kv_close", max(0.0, deadline - time.monotonic()))
        self.tier.close(max(0.0, deadline - time.monotonic()))
        return queued

    def shutdown(self, pool: BlockPool, timeout: float) -> None:
        """``close`` with the pool's resident blocks, logged; a failed flush still lets rank 0's queued writes
        finish."""
        t0 = time.monotonic()
        try:
            n = self.close(pool.cached_blocks(), timeout)
            if self.tier.persistent:
                logger.info("disk tier: %d resident blocks stored for it at shutdown (%.2f s)", n,
                            time.monotonic() - t0)
        except RuntimeError as e:  # a tensor-parallel rank is gone
            logger.error("disk tier: flush at shutdown failed: %s", e)
            self.tier.close(timeout)


def attach_snapshot_tier(worker: Worker, pool: BlockPool, snapshots: StateSnapshots) -> SnapshotTierDriver | None:
    """Put DeepSeek-V4's state snapshot tiers (if its worker opened any) under ``pool``: a prefix continues wherever
    a tier holds the snapshot at its end (``SnapshotBlocks``); log their capacity."""
    store = getattr(worker, "snapshot_store", None)
    if not isinstance(store, SnapshotStore) or not isinstance(snapshots, SizedSnapshots):
        return None
    pool.attach_lower_tier(SnapshotBlocks(snapshots))
    tier = store.tier
    disk = tier.disk
    logger.info("state snapshot tiers: %s B of host RAM, %s", f"{tier.capacity_bytes:,}",
                f"disk tier {disk.folder} ({disk.usage_bytes:,} B of snapshots in use)" if disk is not None
                else "no disk tier: nothing survives a restart")
    return SnapshotTierDriver(store, snapshots)


class SnapshotTierDriver:
    """Closes the state snapshot tiers at shutdown: the committed snapshots still in memory, and host RAM's, are
    written to the disk tier (when there is one) within the timeout."""

    def __init__(self, store: SnapshotStore, snapshots: SizedSnapshots) -> None:
        self.store, self.snapshots = store, snapshots

    def shutdown(self, pool: BlockPool, timeout: float) -> None:
        t0 = time.monotonic()
        resident = [(h, held) for h, s in self.snapshots.committed()
                    if (held := self.store.snapshot(s)) is not None]
        n = self.store.tier.close(resident, timeout)
        if self.store.tier.disk is not None:
            logger.info("state snapshot tier: %d snapshots handed to the disk tier at shutdown (%.2f s)", n,
                        time.monotonic() - t0)


TierDriver = LowerTierDriver | SnapshotTierDriver  # what an engine closes at shutdown
