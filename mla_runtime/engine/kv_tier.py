"""``DiskTierDriver``: rank 0's side of the disk tier — the ``LowerTier`` the block pool calls, in block ids and
hashes, carried out on every rank that keeps files.

- One rank, or the replicated tensor-parallel layout: rank 0's ``DiskTier`` alone writes and reads; a load is
  then broadcast from rank 0's cache to the other ranks (``kv_broadcast``), which hold the same latents.
- The sharded layout: each rank keeps the shard files of its own tokens under the same block key. Rank 0 sends
  ``kv_store`` and ``kv_load`` to the other ranks; a load counts only the blocks every rank found (the smallest
  count, agreed by an all-reduce). Prefetching is rank 0's alone, so it is off under this layout.

A graceful shutdown (``close``) first stores every full block the pool still holds that is not on disk yet, then
waits for the writers up to the timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from mla_runtime.cache.disk_tier import DiskTier, DiskTierStats, agree_min, broadcast_blocks
from mla_runtime.engine.block_pool import BlockPool
from mla_runtime.engine.tp_workers import TensorParallelGroup
from mla_runtime.engine.worker import Worker

logger = logging.getLogger("mla_runtime")


def attach_disk_tier(worker: Worker, pool: BlockPool, tp_group: TensorParallelGroup | None,
                     write_through: bool) -> DiskTierDriver | None:
    """Put the worker's disk tier (if it opened one) under ``pool``, and log its capacity."""
    tier = worker.disk_tier
    if tier is None:
        return None
    driver = DiskTierDriver(worker, tier, tp_group)
    pool.attach_lower_tier(driver, write_through)
    logger.info("disk tier: %s, capacity %s B = %d tokens (%d B per block of %d tokens), %s B in use, %s",
                tier.folder, f"{tier.capacity_bytes:,}", tier.capacity_tokens(), tier.file_bytes(), pool.block_size,
                f"{tier.stats().usage_bytes:,}", "write-through" if write_through else "written on eviction")
    return driver


class DiskTierDriver:
    def __init__(self, worker: Worker, tier: DiskTier, tp_group: TensorParallelGroup | None = None) -> None:
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

    def stats(self) -> DiskTierStats:
        return self.tier.stats()

    def close(self, resident: Sequence[tuple[int, int]], timeout: float) -> int:
        """Store the ``(hash, block)`` pairs not on disk yet (waiting for queue room), then write everything queued
        within ``timeout`` seconds, on every rank; returns how many blocks were queued for it."""
        deadline = time.monotonic() + timeout
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
            logger.info("disk tier: %d resident blocks on disk at shutdown (%.2f s)", n, time.monotonic() - t0)
        except RuntimeError as e:  # a tensor-parallel rank is gone
            logger.error("disk tier: flush at shutdown failed: %s", e)
            self.tier.close(timeout)
