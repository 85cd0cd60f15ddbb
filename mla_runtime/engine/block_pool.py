"""Block pool: latent-cache block ids, reference counts and the prefix-cache index.

- A block is *free* (ref count 0, no hash), *in use* (ref count > 0) or *cached-free* (ref count 0 but
  holding a full block whose hash is indexed). Cached-free blocks sit in an LRU; allocation takes plain
  free blocks first and evicts the least recently used cached block only when it must.
- A full block's hash chains over the previous block's hash and the block's token ids, so equal hashes
  mean equal prefixes, not merely equal blocks.
- Counters are in tokens: ``query_tokens`` looked up, ``hit_tokens`` served from the cache.
- Cache pressure: ``relieve_pressure`` (called between steps) frees cached-free blocks, least recently used
  first, while the blocks in use or cached exceed ``watermark`` of the pool, so that admissions find plain
  free blocks; blocks in use are never touched. Every eviction goes through ``_evict_lru``.
- Counters are in tokens: ``query_tokens`` looked up, ``hit_tokens`` served from the cache (this pool's own
  blocks); ``lower_query_tokens`` / ``lower_hit_tokens`` the same for the lower tier.
- A block hash is 128 bits of BLAKE2b, the same in every process, so that it can name a block on disk.

A lower tier (``LowerTier``: the host-RAM tier and/or the disk tier, ``cache/host_tier.py`` and
``cache/disk_tier.py``, driven by ``engine/kv_tier.py``) sits under the pool when one is attached:
- a cached block about to be evicted is handed to ``store`` first (write before free: the tier copies the
  block's rows out before ``allocate`` returns it); with ``write_through``, every block as soon as it is
  registered;
- ``lookup`` continues a prefix missing here in the lower tier: the blocks found there are loaded into fresh
  blocks, registered, and returned as hits like this pool's own;
- ``prefetch`` lets the tier read ahead for a queued sequence.

A hybrid model's prefix hits also need its linear layers' states at the prefix's end (``PrefixStates``: the state
snapshots, ``cache/state_cache.StateSnapshots``, attached with ``attach_states``): ``lookup`` then takes the longest
cached prefix that ends at a block whose hash has a snapshot, and a hash the index forgets takes its snapshot along.

The pool deals only in integer ids; it knows nothing of tensors.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=16)
    h.update(b"root" if parent is None else parent.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class LowerTier(Protocol):
    """A slower cache under the pool, in block ids and hashes (see the module docstring)."""

    def store(self, block_hash: int, block: int) -> None: ...

    def lookup(self, hashes: Sequence[int]) -> int: ...

    def load(self, hashes: Sequence[int], blocks: Sequence[int]) -> int: ...

    def prefetch(self, hashes: Sequence[int]) -> None: ...


class PrefixStates(Protocol):
    """What a hybrid's prefix hit needs besides the blocks: a snapshot of the states after a block hash."""

    def has(self, block_hash: int) -> bool: ...

    def forget(self, block_hash: int) -> None: ...


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark: float = 1.0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if not 0.0 < watermark <= 1.0:
            raise ValueError(f"watermark must be in (0, 1], got {watermark!r}")
        self.watermark = watermark
        self.pressure_freed = 0  # cached-free blocks freed by relieve_pressure
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached-free blocks, LRU first
        self._index: dict[int, int] = {}  # hash → block id
        self.query_tokens = 0
        self.hit_tokens = 0
        self.num_evictions = 0  # cached blocks evicted to make room
        self.lower: LowerTier | None = None
        self.write_through = False
        self.lower_query_tokens = 0
        self.lower_hit_tokens = 0
        self.states: PrefixStates | None = None

    def attach_states(self, states: PrefixStates) -> None:
        if not self.enable_prefix_caching:
            raise ValueError("state snapshots need enable_prefix_caching")
        self.states = states

    def attach_lower_tier(self, tier: LowerTier, write_through: bool = False) -> None:
        if not self.enable_prefix_caching:
            raise ValueError("a lower cache tier needs enable_prefix_caching")
        self.lower, self.write_through = tier, write_through

    # -- accounting ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    @property
    def num_idle_cached_blocks(self) -> int:
        """Cached-free blocks: prefix blocks no sequence holds, kept for later hits."""
        return len(self._evictable)

    def occupancy(self) -> float:
        """Blocks in use or holding an idle cached prefix, over all blocks (what the watermark bounds)."""
        return (self.num_blocks - len(self._free)) / self.num_blocks

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self._free.popleft() if self._free else self._evict_lru()
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference of each block (a sequence's table is freed last block first, so the
        tail of a prefix is evicted before its head)."""
        for b in reversed(blocks):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                h = self.block_hashes[b]
                if h is not None and self._index.get(h) == b:
                    self._evictable[b] = None
                else:
                    self.block_hashes[b] = None
                    self._free.append(b)

    def _evict_lru(self) -> int:
        """Drop the least recently used cached-free block from the prefix index and return its id (the only
        place a cached block is forgotten)."""
        b, _ = self._evictable.popitem(last=False)
        h = self.block_hashes[b]
        if h is not None and self._index.get(h) == b:
            if self.lower is not None:
                self.lower.store(h, b)  # write before free (a no-op when already on disk)
            del self._index[h]
            if self.states is not None:
                self.states.forget(h)
        self.block_hashes[b] = None
        self.num_evictions += 1
        return b

    def relieve_pressure(self) -> int:
        """Above the watermark, free cached-free blocks (LRU first) until the occupied blocks are back at the
        watermark or no idle cached block is left; returns how many were freed."""
        limit = int(self.watermark * self.num_blocks)
        freed = 0
        while self._evictable and self.num_blocks - len(self._free) > limit:
            self._free.append(self._evict_lru())
            freed += 1
        self.pressure_freed += freed
        return freed

    # -- prefix cache --------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int], num_query_tokens: int) -> list[int]:
        """Take a reference on the longest cached prefix of ``hashes``; count the query in tokens."""
        self.query_tokens += num_query_tokens
        if not self.enable_prefix_caching:
            return []
        hit = []
        for h in hashes:
            b = self._index.get(h)
            if b is None:
                break
            hit.append(b)
        if self.states is not None:  # a hybrid resumes only where the states after the prefix are kept
            while hit and not self.states.has(hashes[len(hit) - 1]):
                hit.pop()
        for b in hit:
            if self.ref_counts[b] == 0:
                self._evictable.pop(b, None)
            self.ref_counts[b] += 1
        self.hit_tokens += len(hit) * self.block_size
        if self.lower is not None and len(hit) < len(hashes):
            hit += self._load_lower(hashes[len(hit):])
        return hit

    def num_indexed(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` the index holds (no reference taken, no snapshot needed)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._index:
            n += 1
        return n

    def _load_lower(self, hashes: Sequence[int]) -> list[int]:
        """Continue a prefix in the lower tier: load the blocks found there into fresh blocks (as many as are free)
        and register them; they come back referenced, like hits."""
        assert self.lower is not None
        self.lower_query_tokens += len(hashes) * self.block_size
        n = min(self.lower.lookup(hashes), self.num_free_blocks)
        if n == 0:
            return []
        blocks = self.allocate(n)
        loaded = self.lower.load(hashes[:n], blocks)
        self.free(blocks[loaded:])
        for b, h in zip(blocks[:loaded], hashes):
            self.register(b, h, from_lower=True)
        self.lower_hit_tokens += loaded * self.block_size
        return blocks[:loaded]

    def prefetch(self, hashes: Sequence[int]) -> None:
        """Ask the lower tier to read ahead the blocks of ``hashes`` after the prefix cached here."""
        if self.lower is None:
            return
        k = 0
        while k < len(hashes) and hashes[k] in self._index:
            k += 1
        if k < len(hashes):
            self.lower.prefetch(hashes[k:])

    def cached_blocks(self) -> list[tuple[int, int]]:
        """``(hash, block)`` of every full block indexed here (in use or cached-free)."""
        return list(self._index.items())

    def register(self, block: int, h: int, from_lower: bool = False) -> None:
        """Index a full, computed block under its chained hash (first writer wins); with write-through, the lower
        tier stores it now (unless it came from there)."""
        if not self.enable_prefix_caching:
            return
        if h not in self._index:
            self._index[h] = block
            self.block_hashes[block] = h
            if self.write_through and self.lower is not None and not from_lower:
                self.lower.store(h, block)

    def check_whole(self) -> None:
        """Raise unless every block is free (no references held)."""
        held = [b for b, r in enumerate(self.ref_counts) if r]
        if held or self.num_free_blocks != self.num_blocks:
            raise AssertionError(f"block pool not whole: {len(held)} blocks still referenced ({held[:8]}...)")
