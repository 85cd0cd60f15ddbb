"""The host-RAM tier of the latent prefix cache, between the device pool and the disk tier.

On a GPU the device pool is small and host RAM is large: full blocks the pool evicts are copied into preallocated
host slots, and a prefix the pool misses is copied back from there — a PCIe copy instead of a file read or a
recomputation. A block this tier evicts in turn (least recently used) goes to the disk tier under it when there is
one (``cache/disk_tier.py``); without one it is dropped, and nothing survives a restart. On a CPU the device pool
*is* host RAM, so the tier is off there unless asked for.

Slots: one uint8 tensor ``[n_slots, payload_bytes]``, page-locked (pinned) when the cache is on CUDA, where a
payload is a block's bytes in every layer, latents then scales (``LatentCache.read_block``: the disk tier's file
payload too), and an LRU of block hash → slot. A block loaded back to the device stays here (a copy, not a move).

Ordering on CUDA, with no host synchronisation on a step's path:
- ``store`` issues the device→host copy with ``non_blocking=True`` on the current stream and records the slot's
  CUDA event after it. Copies are stream-ordered: a later kernel that overwrites the device block (the pool may hand
  it out as soon as ``store`` returns) is queued after the copy on the same stream, so it runs after the copy has
  read the block.
- ``load`` copies a slot host→device with ``non_blocking=True`` from pinned memory: it is queued after the copy that
  filled the slot and before the kernels of the step that reads the block. A slot is overwritten only by a later
  ``store``'s copy, queued after every earlier copy out of it.
- A host-side read of a slot (handing it to the disk tier, on eviction or at ``close``) first synchronises the
  slot's event, so it sees the finished copy; it reads a private copy of the slot, which may then be reused.
The engine calls a tier from its one stepping thread, on the default stream. On a CPU the copies are synchronous.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mla_runtime.cache.disk_tier import DiskTier
from mla_runtime.cache.latent_cache import LatentCache

logger = logging.getLogger("mla_runtime")


@dataclass(frozen=True)
class HostTierStats:
    hits_blocks: int  # blocks loaded back to the device from host RAM
    bytes_stored: int  # device → host bytes copied
    bytes_loaded: int  # host → device bytes copied
    evictions: int  # slots freed for newer blocks (least recently used first)
    spills: int  # blocks handed to the disk tier (evicted, or at close)
    usage_bytes: int  # bytes of the resident blocks
    capacity_bytes: int  # bytes of all slots
    blocks: int  # resident blocks


class HostTier:
    """Latent-cache blocks in host RAM over an optional ``lower`` disk tier (see the module docstring). ``block_size``:
    tokens per block; ``write_through``: every ``store`` also goes to the lower tier at once."""

    def __init__(self, cache: LatentCache, capacity_bytes: int, block_size: int, lower: DiskTier | None = None,
                 write_through: bool = False) -> None:
        self.cache = cache
        self.block_size = block_size
        self.lower = lower
        self.write_through = write_through and lower is not None
        self.persistent = lower is not None  # a shutdown stores the resident blocks (they reach the disk tier)
        self.payload_bytes = cache.block_bytes()
        self.num_slots = capacity_bytes // self.payload_bytes
        if self.num_slots < 1:
            raise ValueError(f"a host tier of {capacity_bytes:,} B holds no block of {self.payload_bytes:,} B")
        self.device = cache.layers[0].kv.device
        self.on_cuda = self.device.type == "cuda"
        self.slots = torch.empty(self.num_slots, self.payload_bytes, dtype=torch.uint8)
        self.pinned = self.on_cuda and _pin(self.slots)
        self._events: list[torch.cuda.Event | None] = [None] * self.num_slots  # the last copy into each slot
        self._lru: OrderedDict[int, int] = OrderedDict()  # block hash → slot, least recently used first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._on_lower: set[int] = set()  # resident hashes the lower tier holds (or has queued)
        self._counts = dict.fromkeys(("hits_blocks", "bytes_stored", "bytes_loaded", "evictions", "spills"), 0)
        self.closed = False

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.payload_bytes

    def capacity_tokens(self) -> int:
        return self.num_slots * self.block_size

    # -- the pool's side -------------------------------------------------------------------------
    def store(self, block_hash: int, block: int, wait: bool = False) -> bool:
        """Copy ``block`` into a slot (a touch when it is here already), evicting the least recently used slot to
        the lower tier when all are taken; with write-through the lower tier stores it too. ``wait``: a full disk
        write queue is waited for rather than dropping a block. True when the block is held."""
        if self.closed:
            return False
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
        else:
            slot = self._free.pop() if self._free else self._evict(wait)
            self._copy_out(block, slot)
            self._lru[block_hash] = slot
        if self.write_through and block_hash not in self._on_lower:
            assert self.lower is not None
            if self.lower.store(block_hash, block, wait):
                self._on_lower.add(block_hash)
        return True

    def lookup(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` this tier or the one under it holds (each from either)."""
        n = 0
        for h in hashes:
            if h not in self._lru and (self.lower is None or not self.lower.lookup([h])):
                break
            n += 1
        return n

    def load(self, hashes: Sequence[int], blocks: Sequence[int]) -> int:
        """Fill ``blocks`` in order, each from a host slot or else from the lower tier; stops at the first block
        neither has (or the lower tier cannot read). Returns how many were loaded."""
        from_host: list[int] = []
        n = 0
        for h, b in zip(hashes, blocks):
            slot = self._lru.get(h)
            if slot is not None:
                self._copy_in(slot, b)
                from_host.append(h)
            elif self.lower is None or not self.lower.load([h], [b]):
                break
            n += 1
        for h in reversed(from_host):  # the head of a prefix, shared most widely, stays longest
            self._lru.move_to_end(h)
        self._counts["hits_blocks"] += len(from_host)
        return n

    def prefetch(self, hashes: Sequence[int]) -> None:
        """Let the lower tier read ahead the blocks of ``hashes`` that are not here."""
        if self.lower is not None:
            missing = [h for h in hashes if h not in self._lru]
            if missing:
                self.lower.prefetch(missing)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the lower tier's queued writes (True when done, or when there is no lower tier)."""
        return self.lower.flush(timeout) if self.lower is not None else True

    def close(self, timeout: float | None = None) -> None:
        """Hand every resident block the lower tier does not hold to it (most recently used first, up to
        ``timeout`` s), close the lower tier within what is left of the timeout, and release the slots."""
        if self.closed:
            return
        self.closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.lower is not None:
            left = list(reversed(self._lru.items()))
            for i, (h, slot) in enumerate(left):
                if deadline is not None and time.monotonic() > deadline:
                    logger.warning("host tier: %d blocks were not handed to the disk tier within the shutdown "
                                   "timeout", len(left) - i)
                    break
                self._spill(h, slot, wait=True)
            self.lower.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._lru.clear()
        self._on_lower.clear()
        if self.pinned:
            torch.cuda.synchronize(self.device)  # no copy may still read or write the slots
            torch.cuda.cudart().cudaHostUnregister(self.slots.data_ptr())
            self.pinned = False
        self.slots = torch.empty(0, self.payload_bytes, dtype=torch.uint8)
        self._events = []

    def stats(self) -> HostTierStats:
        n = len(self._lru)
        return HostTierStats(usage_bytes=n * self.payload_bytes, capacity_bytes=self.capacity_bytes, blocks=n,
                             **self._counts)

    # -- slots -----------------------------------------------------------------------------------
    def _evict(self, wait: bool) -> int:
        """Free the least recently used slot, its block handed to the lower tier first (when it has none)."""
        h, slot = self._lru.popitem(last=False)
        self._spill(h, slot, wait)
        self._on_lower.discard(h)
        self._counts["evictions"] += 1
        return slot

    def _spill(self, block_hash: int, slot: int, wait: bool) -> None:
        if self.lower is None or block_hash in self._on_lower:
            return
        if self.lower.store_payload(block_hash, functools.partial(self._read_slot, slot), wait):
            self._on_lower.add(block_hash)
            self._counts["spills"] += 1

    def _read_slot(self, slot: int) -> torch.Tensor:
        """A private host copy of ``slot``, once the copy into it has finished."""
        event = self._events[slot]
        if event is not None:
            event.synchronize()
        return self.slots[slot].clone()

    def _copy_out(self, block: int, slot: int) -> None:
        """Device block → host slot (asynchronous on CUDA: see the module docstring)."""
        if self.on_cuda:
            self.slots[slot].copy_(self.cache.read_block(block), non_blocking=True)
            event = self._events[slot]
            if event is None:
                event = self._events[slot] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        else:
            self.cache.read_block(block, out=self.slots[slot])
        self._counts["bytes_stored"] += self.payload_bytes

    def _copy_in(self, slot: int, block: int) -> None:
        """Host slot → device block (asynchronous from pinned memory on CUDA)."""
        self.cache.write_block(block, self.slots[slot].to(self.device, non_blocking=True))
        self._counts["bytes_loaded"] += self.payload_bytes


def _pin(slots: torch.Tensor) -> bool:
    """Page-lock ``slots`` in place for asynchronous copies (``cudaHostRegister``: ``pin_memory=True`` would round the
    allocation up to a power of two); False, with a warning, when the driver refuses (copies are then synchronous)."""
    t0 = time.monotonic()
    err = int(torch.cuda.cudart().cudaHostRegister(slots.data_ptr(), slots.numel(), 1))  # 1: portable
    if err:
        logger.warning("host tier: cannot pin %s B of host memory (cudaError %d): its copies will be synchronous; "
                       "a smaller kv_cache_host_bytes may pin", f"{slots.numel():,}", err)
        return False
    logger.info("host tier: pinned %s B of host memory in %.1f s", f"{slots.numel():,}", time.monotonic() - t0)
    return True
