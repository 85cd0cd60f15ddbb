"""The state cache of a hybrid model: one slot per running sequence, beside the paged latent cache.

A linear-attention layer keeps no per-token rows. Each running sequence owns one slot, which holds, for every
linear-attention layer ``j``: ``layers[j].recurrent[slot] [H, d_k, d_v]`` (the gated delta rule's state) and
``layers[j].conv[slot] [3 H d_k, conv_kernel - 1]`` (the short convolution's last inputs), both float32. A slot's
size does not grow with the sequence: ``bytes_per_slot`` is the state bytes per sequence (``ModelConfig.
state_bytes_per_sequence``), as the latent cache's bytes per token are per token.

``StateSlots`` hands the slot ids out (the scheduler takes one when it admits a sequence and gives it back on every
path that ends or suspends its run: finish, abort, preemption); the tensors never move. A slot's content is not
cleared when it is given back: the model starts a sequence's first step from zeros, whatever its slot holds.

Prefix caching keeps *snapshots*: the states of every linear layer at the end of a cached prefix (a block boundary),
in ``num_snapshots`` more rows of the same tensors (snapshot ``i`` is row ``num_slots + i``). A step writes one
while it computes the prefix's last token, and a sequence that takes the prefix from the cache starts from a copy of
it in its slot (``copy_row``). ``StateSnapshots`` is the scheduler's side: which snapshot holds the states after
which block hash, pinned while a sequence is restored from it, pending while a step is to write it; a snapshot is
forgotten with its block hash (the block pool's index) or, when the budget is full, least recently used first.
``SizedSnapshots`` is the same for a state that grows with its sequence (DeepSeek-V4's): each snapshot is as large
as the prefix it ends, and the snapshots held stay within a byte budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mla_runtime.config import LinearAttentionConfig


@dataclass
class LayerState:
    recurrent: torch.Tensor  # [slots + snapshots, H, d_k, d_v] float32
    conv: torch.Tensor  # [slots + snapshots, 3 H d_k, conv_kernel - 1] float32

    def copy_row(self, src: int, dst: int) -> None:
        self.recurrent[dst].copy_(self.recurrent[src])
        self.conv[dst].copy_(self.conv[src])


class StateCache:
    def __init__(self, lin: LinearAttentionConfig, num_slots: int, device: torch.device | str = "cpu",
                 num_snapshots: int = 0) -> None:
        if num_slots < 1 or num_snapshots < 0:
            raise ValueError(f"num_slots must be >= 1 and num_snapshots >= 0, got {num_slots}, {num_snapshots}")
        self.lin, self.num_slots, self.num_snapshots = lin, num_slots, num_snapshots
        h, d, rows = lin.num_heads, lin.head_dim, num_slots + num_snapshots
        self.layers = [LayerState(torch.zeros(rows, h, d, d, dtype=torch.float32, device=device),
                                  torch.zeros(rows, lin.conv_channels, lin.conv_kernel - 1,
                                              dtype=torch.float32, device=device))
                       for _ in range(lin.num_layers)]

    def nbytes(self) -> int:
        """Bytes of the sequences' slots (the snapshots apart: ``snapshot_nbytes``)."""
        return self.bytes_per_slot * self.num_slots

    def snapshot_nbytes(self) -> int:
        return self.bytes_per_slot * self.num_snapshots

    @property
    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for s in self.layers for t in (s.recurrent, s.conv))

    def snapshot_row(self, snapshot: int) -> int:
        if not 0 <= snapshot < self.num_snapshots:
            raise ValueError(f"snapshot {snapshot} out of range ({self.num_snapshots} snapshots)")
        return self.num_slots + snapshot

    def copy_row(self, src: int, dst: int) -> None:
        """Every layer's states of row ``src`` into row ``dst`` (a slot or a snapshot's row)."""
        for s in self.layers:
            s.copy_row(src, dst)


class StateSlots:
    """The free slot ids of a ``StateCache`` (plain integers: the scheduler's side)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot: the scheduler admits a sequence only while one is free")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not taken")
        self._free.append(slot)


class StateSnapshots:
    """The snapshot ids of a ``StateCache`` and the block hash each one holds the states after (plain integers: the
    scheduler's side). A snapshot is *free*, *pending* (``reserve``d for a step to write; ``commit`` names its hash,
    ``discard`` gives it back), or *committed* to a hash; a committed one is *pinned* while sequences restore from it
    (``acquire``/``release``). Only committed, unpinned snapshots are evicted: by ``forget`` (their hash left the
    prefix cache) or, when ``reserve`` finds no free one, least recently used first. ``drop``, if given, is called
    with a snapshot's id whenever it is free again (a model whose snapshots hold tensors of their own lets them go at
    once, not when the id is next written)."""

    def __init__(self, num_snapshots: int, drop: Callable[[int], None] | None = None) -> None:
        self.num_snapshots = num_snapshots
        self.drop = drop
        self._free = list(range(num_snapshots - 1, -1, -1))
        self._by_hash: dict[int, int] = {}  # committed: block hash -> snapshot
        self._hash_of: dict[int, int] = {}  # committed: snapshot -> block hash
        self._idle: OrderedDict[int, None] = OrderedDict()  # committed and unpinned, least recently used first
        self._pins: dict[int, int] = {}  # snapshot -> sequences restoring from it
        self._pending: set[int] = set()
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Snapshots a ``reserve`` can take now (free, or committed and unpinned)."""
        return len(self._free) + len(self._idle)

    @property
    def num_committed(self) -> int:
        return len(self._by_hash)

    def has(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def reserve(self, tokens: int = 0) -> int | None:
        """A snapshot for a step to write after ``tokens`` tokens of its sequence (every snapshot here is the same
        size, whatever ``tokens``; None: every one is pending or pinned)."""
        if self._free:
            s = self._free.pop()
        elif self._idle:
            s = next(iter(self._idle))
            self._drop(s)
            self.num_evictions += 1
            self._free.pop()
        else:
            return None
        self._pending.add(s)
        return s

    def commit(self, snapshot: int, block_hash: int) -> bool:
        """The pending ``snapshot`` now holds the states after ``block_hash``; False (and given back) when another
        snapshot holds them already."""
        self._pending.remove(snapshot)
        if block_hash in self._by_hash:
            self._give_back(snapshot)
            return False
        self._by_hash[block_hash], self._hash_of[snapshot] = snapshot, block_hash
        self._idle[snapshot] = None
        return True

    def discard(self, snapshot: int) -> None:
        """Give back a pending snapshot whose step never ran (its sequence ended or was preempted first)."""
        self._pending.remove(snapshot)
        self._give_back(snapshot)

    def acquire(self, block_hash: int) -> int:
        """Pin the snapshot of ``block_hash`` for a sequence that restores from it."""
        s = self._by_hash[block_hash]
        self._idle.pop(s, None)
        self._pins[s] = self._pins.get(s, 0) + 1
        return s

    def release(self, snapshot: int) -> None:
        """Unpin, once the restore is done (or its sequence ended before it)."""
        n = self._pins[snapshot] - 1
        if n:
            self._pins[snapshot] = n
            return
        del self._pins[snapshot]
        if snapshot in self._hash_of:
            self._idle[snapshot] = None  # most recently used
        else:  # its hash was forgotten while pinned
            self._give_back(snapshot)

    def forget(self, block_hash: int) -> None:
        """The prefix cache forgot ``block_hash``: its snapshot goes with it (at its release, if pinned)."""
        s = self._by_hash.get(block_hash)
        if s is None:
            return
        if s in self._pins:
            del self._by_hash[block_hash], self._hash_of[s]
        else:
            self._drop(s)

    def _drop(self, snapshot: int) -> None:
        del self._by_hash[self._hash_of.pop(snapshot)]
        self._idle.pop(snapshot, None)
        self._give_back(snapshot)

    def _give_back(self, snapshot: int) -> None:
        """``snapshot`` is free again (the one place a taken snapshot becomes free)."""
        self._free.append(snapshot)
        if self.drop is not None:
            self.drop(snapshot)

    def check_whole(self) -> None:
        """Raise unless no snapshot is pending or pinned (every one free or idle)."""
        if self._pending or self._pins or self.num_free != self.num_snapshots:
            raise AssertionError(f"state snapshots not whole: {len(self._pending)} pending, {len(self._pins)} pinned, "
                                 f"{self.num_free} of {self.num_snapshots} free or idle")


class SizedSnapshots(StateSnapshots):
    """``StateSnapshots`` of a state that grows with its sequence (DeepSeek-V4's compressed entries): a snapshot taken
    after ``tokens`` tokens holds ``size(tokens)`` bytes, and the snapshots held (pending, committed, pinned) stay
    within ``budget_bytes`` (``state_snapshot_memory``). ``reserve`` evicts committed, unpinned snapshots, least
    recently used first, until the new one fits; ``drop`` is called with a snapshot's id whenever it is free again,
    so that the states it held go at once (the worker's side: nothing outlives its place in the budget)."""

    def __init__(self, num_snapshots: int, budget_bytes: int, size: Callable[[int], int],
                 drop: Callable[[int], None], lower: SnapshotLower | None = None,
                 write_through: bool = False) -> None:
        super().__init__(num_snapshots, drop)
        self.budget_bytes, self.size = budget_bytes, size
        self.lower, self.write_through = lower, write_through and lower is not None
        self._bytes: dict[int, int] = {}  # held snapshot -> its bytes
        self.used_bytes = 0
        self.num_lower_hits = 0  # snapshots brought back from the lower tiers

    def reserve(self, tokens: int = 0) -> int | None:
        """A snapshot for a step to write after ``tokens`` tokens (None: it cannot fit beside the pending and pinned
        ones, or it is larger than the whole budget)."""
        need = self.size(tokens)
        if need > self.budget_bytes:
            return None
        while (self.used_bytes + need > self.budget_bytes or not self._free) and self._idle:
            self._drop(next(iter(self._idle)))
            self.num_evictions += 1
        if self.used_bytes + need > self.budget_bytes or not self._free:
            return None
        s = self._free.pop()
        self._pending.add(s)
        self._bytes[s] = need
        self.used_bytes += need
        return s

    def commit(self, snapshot: int, block_hash: int) -> bool:
        """``StateSnapshots.commit``; with write-through the lower tiers keep it on disk at once too."""
        if not super().commit(snapshot, block_hash):
            return False
        if self.write_through:
            assert self.lower is not None
            self.lower.store(block_hash, snapshot, persist=True)
        return True

    def forget(self, block_hash: int) -> None:
        """``StateSnapshots.forget``; the lower tiers keep the snapshot (a pinned one now: its state is still whole)."""
        s = self._by_hash.get(block_hash)
        if s is not None and s in self._pins and self.lower is not None:
            self.lower.store(block_hash, s)
        super().forget(block_hash)

    def _drop(self, snapshot: int) -> None:
        """A committed, unpinned snapshot leaves the budget: the lower tiers keep it first, when there are any."""
        if self.lower is not None:
            self.lower.store(self._hash_of[snapshot], snapshot)
        super()._drop(snapshot)

    def reachable(self, block_hash: int) -> bool:
        """Whether a snapshot after ``block_hash`` is held here or in a lower tier."""
        return self.has(block_hash) or (self.lower is not None and self.lower.tokens(block_hash) is not None)

    def bring_in(self, block_hash: int) -> bool:
        """Make the snapshot after ``block_hash`` one of the committed snapshots here (loaded from a lower tier when it
        is not here, within the budget); False when no tier has one that loads (then nothing is held for it)."""
        if self.has(block_hash):
            return True
        tokens = None if self.lower is None else self.lower.tokens(block_hash)
        if tokens is None:
            return False
        assert self.lower is not None
        s = self.reserve(tokens)
        if s is None:
            return False
        if not self.lower.load(block_hash, s, tokens):
            self.discard(s)
            return False
        self.commit(s, block_hash)
        self.num_lower_hits += 1
        return True

    def committed(self) -> list[tuple[int, int]]:
        """``(block hash, snapshot)`` of every committed snapshot, most recently used first."""
        idle = [(self._hash_of[s], s) for s in reversed(self._idle)]
        return [(h, s) for h, s in self._by_hash.items() if s in self._pins] + idle

    def _give_back(self, snapshot: int) -> None:
        self.used_bytes -= self._bytes.pop(snapshot)
        super()._give_back(snapshot)

    def check_whole(self) -> None:
        """``StateSnapshots.check_whole``, and the bytes held are those of the committed snapshots."""
        super().check_whole()
        if self.used_bytes != sum(self._bytes.values()) or set(self._bytes) != set(self._hash_of):
            raise AssertionError(f"state snapshots hold {self.used_bytes:,} B for {len(self._bytes)} snapshots; "
                                 f"{self.num_committed} are committed")


class SnapshotLower(Protocol):
    """Where a ``SizedSnapshots``' snapshots go when they leave its budget (the worker's side: it holds the states)."""

    def store(self, block_hash: int, snapshot: int, persist: bool = False) -> None: ...

    def tokens(self, block_hash: int) -> int | None: ...

    def load(self, block_hash: int, snapshot: int, tokens: int) -> bool: ...


class SnapshotBlocks:
    """The block pool's lower tier (``engine/block_pool.LowerTier``) for a model whose blocks hold no rows, only
    count them (DeepSeek-V4: everything a prefix hit needs is its snapshot): a prefix continues past the pool's own
    blocks up to the last of its hashes whose snapshot a lower tier holds. ``load`` brings that snapshot back into
    ``snapshots`` (the pool then registers the fresh, empty blocks it allocated for the prefix); a block evicted from
    the pool needs nothing stored (its snapshot, if any, goes to the lower tiers on its own)."""

    def __init__(self, snapshots: SizedSnapshots) -> None:
        self.snapshots = snapshots

    def store(self, block_hash: int, block: int) -> None:
        return None

    def lookup(self, hashes: Sequence[int]) -> int:
        n = len(hashes)
        while n and not self.snapshots.reachable(hashes[n - 1]):
            n -= 1
        return n

    def load(self, hashes: Sequence[int], blocks: Sequence[int]) -> int:
        return len(hashes) if hashes and self.snapshots.bring_in(hashes[-1]) else 0

    def prefetch(self, hashes: Sequence[int]) -> None:
        return None
