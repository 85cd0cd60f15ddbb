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

The pool deals only in integer ids; it knows nothing of tensors.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    return hash((parent, tuple(token_ids)))


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
            del self._index[h]
        self.block_hashes[b] = None
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
        for b in hit:
            if self.ref_counts[b] == 0:
                self._evictable.pop(b, None)
            self.ref_counts[b] += 1
        self.hit_tokens += len(hit) * self.block_size
        return hit

    def register(self, block: int, h: int) -> None:
        """Index a full, computed block under its chained hash (first writer wins)."""
        if not self.enable_prefix_caching:
            return
        if h not in self._index:
            self._index[h] = block
            self.block_hashes[block] = h

    def check_whole(self) -> None:
        """Raise unless every block is free (no references held)."""
        held = [b for b, r in enumerate(self.ref_counts) if r]
        if held or self.num_free_blocks != self.num_blocks:
            raise AssertionError(f"block pool not whole: {len(held)} blocks still referenced ({held[:8]}...)")
