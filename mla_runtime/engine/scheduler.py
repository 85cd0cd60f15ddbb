"""Scheduler: continuous batching under a token budget, chunked prefill, prefix caching, preemption.

Each step it fills a budget of ``max_num_batched_tokens`` new tokens:
1. running sequences first — decodes (one token each), then unfinished prefills (the rest of the
   prompt, chunked to what the budget has left), so long prompts never stall running decodes;
2. if a running sequence needs a block and none is free, the most recently admitted running sequence
   is preempted: its blocks go back to the pool (full ones stay prefix-cached) and it re-queues at the
   front, to be recomputed later — cheap, since its prefix is usually still cached;
3. then waiting sequences, in arrival order, while the budget, ``max_num_seqs`` and the pool allow;
   each first takes the longest cached prefix of its tokens (continued in the pool's lower tier, the disk,
   when it has one: those blocks are loaded before the sequence's first step, and prefetched while it queues).

Between steps ``relieve_cache_pressure`` frees idle cached prefix blocks above the pool's watermark (LRU
first), so admissions take plain free blocks instead of evicting inside a step; running sequences keep
their blocks, so running work still fills the cache to 100 %.

A running decode may bring extra tokens after its last one (``schedule(extra)``: tokens to verify, chosen
before the step by someone else): they take budget and cache slots like any token, cut to what the budget
has left and dropped when their blocks are not free (they never cost another sequence its blocks);
``on_step_done`` counts only the ones the step accepted as computed — the latents written for the others lie
past the sequence's end and are overwritten by the tokens that really come there. ``trailing_slots``: blocks
for that many slots past the end of each sequence that reaches its end in a step, taken only while free, for
what runs after the step and writes there.

A hybrid model's linear-attention layers keep a state per running sequence in a slot of the state cache
(``states``): a sequence takes a slot when it is admitted (it waits while none is free) and gives it back wherever
its blocks go back — finish, abort, preemption (a preempted sequence recomputes its state from its first token).
With prefix caching, a hybrid's admitted sequence reserves state snapshots (``snapshots``) at the last full block
boundary of its tokens and where its tokens leave the cached blocks (a shared prefix, say a system prompt, that
another sequence left without a snapshot at its end), each written by the step that computes that position and
committed with that block's hash (``reserve(end)``: a snapshot of a state that grows, DeepSeek-V4's, is sized by
its position); a prefix hit ends only at a block whose hash has one (the pool's lookup), pins it and copies it into
the sequence's slot before its first step. Pending and pinned snapshots go back wherever the slot goes back. A model
whose restored state is the sequence's own copy of the prefix's rows (``own_prefix_copies``) holds fresh blocks for
them in place of the cached ones, so that the pool counts each running sequence's rows once.

Fixed chunks (``fixed_chunks``, for a model whose rows must not depend on the batch: the engine asks for them for a
``rows_invariant`` model): a prefill's chunks end at multiples of ``chunk_size`` of its own positions, or at its end,
and each runs whole in one step or waits for the next. A prompt is then cut at the same places alone or in any batch,
so each of its tokens takes the same attention path over the same chunks; without it, the cut falls where another
sequence's tokens leave the budget. While a running prefill waits for its chunk, no new sequence is admitted (the
decodes, which take the budget first, drain, and the chunk fits).

The scheduler deals only in sequences, token counts, block ids and slot ids, and hands the step on as a
``StepPlan``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from mla_runtime.cache.state_cache import StateSlots, StateSnapshots
from mla_runtime.engine.block_pool import BlockPool, block_hash
from mla_runtime.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger("mla_runtime")


@dataclass(frozen=True)
class StepPlan:
    """One step's work, in the order the model runs it — the only place that order is decided.

    Order: fewest new tokens first, stable among equals (so in the order the scheduler took them): one-token
    decodes, then decodes with extra tokens to verify, then prefill chunks. Why: on CPU the absorbed-attention
    decode kernels plan their gather once for the leading run of short rows and take the longer chunks after it
    as a batch of their own (the attention metadata's CPU decode plan), so the decodes must lead. Every stage after
    the scheduler keeps this order: the step's token rows, logit rows, sampler rows and grammar masks, the work
    after the step and the sampled results all follow it.
    """

    seqs: tuple[Sequence, ...] = ()
    num_new_tokens: tuple[int, ...] = ()  # tokens each sequence computes in the step, its extra tokens included
    extra_token_ids: tuple[tuple[int, ...], ...] = ()  # each one's tokens after its last, to verify (default: none)

    def __post_init__(self) -> None:
        if not self.extra_token_ids:
            object.__setattr__(self, "extra_token_ids", ((),) * len(self.seqs))
        n = self.num_new_tokens
        if not len(self.seqs) == len(n) == len(self.extra_token_ids) or any(a > b for a, b in zip(n, n[1:])):
            raise ValueError("a StepPlan holds one count and one extra-token tuple per sequence, fewest tokens first")

    @classmethod
    def ordered(cls, seqs: list[Sequence], num_new_tokens: list[int], extra: list[tuple[int, ...]]) -> StepPlan:
        """The plan of ``seqs`` (as the scheduler took them) in the step's order (see the class docstring)."""
        order = sorted(range(len(seqs)), key=num_new_tokens.__getitem__)
        return cls(tuple(seqs[i] for i in order), tuple(num_new_tokens[i] for i in order),
                   tuple(extra[i] for i in order))

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 trailing_slots: int = 0, states: StateSlots | None = None,
                 snapshots: StateSnapshots | None = None, own_prefix_copies: bool = False,
                 fixed_chunks: bool = False) -> None:
        self.pool = pool
        self.states = states  # a hybrid model's state slots (None: no linear-attention layers)
        self.snapshots = snapshots  # a hybrid's state snapshots of cached prefixes (None: no prefix caching)
        # a model whose restored state is a copy of the prefix's rows of its own (the models over state slots: V4,
        # GLM-5-Next, Hunyuan V4, dots3-note): a prefix hit holds fresh blocks for them, not the cached ones
        # (``_own_prefix``)
        self.own_prefix_copies = own_prefix_copies
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.trailing_slots = trailing_slots
        # None: a prefill takes what the budget leaves; with fixed_chunks, the fixed chunk (module docstring)
        self.chunk_size = self.fixed_chunk_size(max_num_batched_tokens, pool.block_size) if fixed_chunks else None
        if self.chunk_size is not None:
            logger.info("prefill chunks fixed at %d tokens (a model whose rows must not depend on the batch)",
                        self.chunk_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_computed_tokens_total = 0  # tokens run through the model (prefix hits excluded)
        self.seconds_above_watermark = 0.0  # while the occupied blocks stayed above the watermark after relief
        self._pressure_checked: tuple[float, bool] | None = None  # (when, above) at the last relief

    @staticmethod
    def fixed_chunk_size(max_num_batched_tokens: int, block_size: int) -> int:
        """The fixed chunk for a budget: half of it in whole cache blocks (a block at least, the budget at most), so a
        chunk fits beside decodes of half the budget (more decodes hold it back until some finish). It depends on
        the budget alone, not on how many sequences may run, so ``max_num_seqs=1`` cuts a prompt where a batch
        does."""
        half = max_num_batched_tokens // 2
        return min(max_num_batched_tokens, max(block_size, half - half % block_size))

    # -- queue ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if self.pool.lower is not None:  # a lower cache tier reads the prefix ahead while the sequence queues
            self.pool.prefetch(self._prefix_hashes(seq))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish ``seq`` wherever it is (waiting, running) and return its blocks."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # -- blocks --------------------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _release(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            assert self.states is not None
            self.states.give_back(seq.state_slot)
            seq.state_slot = None
        self._release_snapshots(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release_snapshots(self, seq: Sequence) -> None:
        """Unpin the snapshot ``seq`` was to be restored from; give back the one it was to write."""
        if self.snapshots is None:
            return
        if seq.state_restore is not None:
            self.snapshots.release(seq.state_restore)
            seq.state_restore = None
        for _, snapshot, _ in seq.state_snapshots:
            self.snapshots.discard(snapshot)
        seq.state_snapshots = []

    def _plan_snapshots(self, seq: Sequence, hashes: list[int]) -> None:
        """An admitted hybrid sequence (``hashes``: its prefix hashes): pending snapshots where its tokens leave the
        cached blocks and at their last full block boundary, each unless its hash has one (or every snapshot is
        pinned or pending)."""
        assert self.snapshots is not None
        for k in sorted({self.pool.num_indexed(hashes), len(hashes)}):
            end = k * self.block_size
            if end <= seq.num_computed_tokens or self.snapshots.has(hashes[k - 1]):
                continue
            snapshot = self.snapshots.reserve(end)
            if snapshot is not None:
                seq.state_snapshots.append((end, snapshot, hashes[k - 1]))

    def _prefix_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the full blocks a new sequence may take from the cache (at least one token is
        always left to compute, so the step has logits to sample from)."""
        tokens = seq.token_ids
        hashes: list[int] = []
        parent = None
        for k in range((len(tokens) - 1) // self.block_size):
            parent = block_hash(parent, tokens[k * self.block_size:(k + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def _admit_prefix(self, seq: Sequence) -> list[int]:
        """Take the cached prefix of ``seq`` (a hybrid's with its states' snapshot, pinned); its prefix hashes."""
        hashes = self._prefix_hashes(seq)
        hit = self.pool.lookup(hashes, seq.num_tokens)
        seq.block_table = hit
        seq.block_hashes = hashes[: len(hit)]
        seq.num_computed_tokens = len(hit) * self.block_size
        seq.num_cached_prompt_tokens = seq.num_computed_tokens
        if hit and self.snapshots is not None:
            seq.state_restore = self.snapshots.acquire(hashes[len(hit) - 1])
        return hashes

    def _waits_for_sibling(self, seq: Sequence) -> bool:
        """Samples 2..n of a request wait until sample 1 has cached the prompt, then share its blocks."""
        first = seq.share_prefix_with
        if first is None or not self.pool.enable_prefix_caching or first.is_finished:
            return False
        full_prompt_blocks = (len(seq.prompt_token_ids) - 1) // self.block_size
        return len(first.block_hashes) < full_prompt_blocks

    def relieve_cache_pressure(self) -> int:
        """Free idle cached prefix blocks above the watermark (between steps); count the time spent above it."""
        freed = self.pool.relieve_pressure()
        now = time.monotonic()
        if self._pressure_checked is not None and self._pressure_checked[1]:
            self.seconds_above_watermark += now - self._pressure_checked[0]
        self._pressure_checked = (now, self.pool.occupancy() > self.pool.watermark)
        return freed

    # -- one step ------------------------------------------------------------------------------
    def schedule(self, extra: Mapping[int, list[int]] | None = None) -> StepPlan:
        """The next step; ``extra``: tokens a running one-token decode brings after its last one, by seq_id."""
        seqs: list[Sequence] = []
        counts: list[int] = []
        extras: list[tuple[int, ...]] = []
        budget = self.max_num_batched_tokens
        preempted = False
        # decodes first, then unfinished prefills: a long prompt never stalls running decodes
        order = [s for s in self.running if s.num_uncomputed == 1] + \
            [s for s in self.running if s.num_uncomputed > 1]
        scheduled: set[int] = set()
        chunk_waits = False  # a running prefill waits for budget for its whole fixed chunk
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            more = self._extra_for(seq, budget, extra) if extra else ()
            n = self._chunk(seq, budget) + len(more)
            if not n:
                chunk_waits = True
                continue
            need = self._blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
            while need > self.pool.num_free_blocks:
                victims = [v for v in self.running if v.seq_id not in scheduled]
                victim = victims[-1]  # the most recently admitted one not already in this step
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.block_table += self.pool.allocate(need)
            scheduled.add(seq.seq_id)
            seqs.append(seq)
            counts.append(n)
            extras.append(more)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted \
                and not chunk_waits:
            n = self._admit(budget)
            if not n:
                break
            seqs.append(self.running[-1])
            counts.append(n)
            extras.append(())
            budget -= n
        if self.trailing_slots:
            self._reserve_trailing(seqs, counts)
        return StepPlan.ordered(seqs, counts, extras)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The tokens of ``seq`` the step takes with ``budget`` left: all it has left that fit, or with fixed chunks
        its next chunk whole, or none (it waits)."""
        n = min(seq.num_uncomputed, budget)
        if self.chunk_size is None or seq.num_uncomputed == 1:
            return n
        start = seq.num_computed_tokens
        whole = min(seq.num_tokens, (start // self.chunk_size + 1) * self.chunk_size) - start
        return whole if whole <= budget else 0

    def _extra_for(self, seq: Sequence, budget: int, extra: Mapping[int, list[int]]) -> tuple[int, ...]:
        """A one-token decode's extra tokens, cut to the budget its own token leaves; none when their blocks are
        not free."""
        if seq.num_uncomputed != 1:
            return ()
        more = tuple(extra.get(seq.seq_id, ())[:budget - 1])
        if more and self._blocks_for(seq.num_computed_tokens + 1 + len(more)) - len(seq.block_table) \
                > self.pool.num_free_blocks:
            return ()
        return more

    def _admit(self, budget: int) -> int:
        """Admit the first waiting sequence with up to ``budget`` of its tokens; the count (0: it must wait)."""
        seq = self.waiting[0]
        if self._waits_for_sibling(seq):
            return 0
        hashes = self._admit_prefix(seq) if not seq.block_table else []
        n = self._chunk(seq, budget)
        if not n:
            self._release(seq)  # give the prefix hits back; its chunk fits a later step
            return 0
        need = self._blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
        copies = len(seq.block_table) if self.own_prefix_copies else 0
        if need + copies > self.pool.num_free_blocks or (self.states is not None and not self.states.num_free):
            self._release(seq)  # give the prefix hits back; retry next step
            return 0
        if copies:
            self._own_prefix(seq)
        if self.states is not None:
            seq.state_slot = self.states.take()
        if self.snapshots is not None and hashes:
            self._plan_snapshots(seq, hashes)
        seq.block_table += self.pool.allocate(need)
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return n

    def _own_prefix(self, seq: Sequence) -> None:
        """A prefix hit of a model whose sequences keep every token's rows in a state of their own: the copy of the
        prefix's rows restored into its slot is its own, so it holds fresh blocks for them and gives the cached ones
        back to the cache (still indexed; their rows are counted by the snapshot it was restored from)."""
        hit = seq.block_table
        seq.block_table = self.pool.allocate(len(hit))  # taken while the hit is held: never evicts its blocks
        self.pool.free(hit)

    def _reserve_trailing(self, seqs: list[Sequence], counts: list[int]) -> None:
        """Blocks for ``trailing_slots`` slots past the end of each sequence that reaches its end, in the order
        the sequences were taken, while free: no sequence is preempted for them."""
        for seq, n in zip(seqs, counts):
            if seq.num_computed_tokens + n < seq.num_tokens:
                continue  # a prefill chunk before the prompt's end: nothing runs past it
            need = self._blocks_for(seq.num_computed_tokens + n + self.trailing_slots) - len(seq.block_table)
            if 0 < need <= self.pool.num_free_blocks:
                seq.block_table += self.pool.allocate(need)

    def on_step_done(self, plan: StepPlan, accepted: Mapping[int, int] | None = None) -> None:
        """Advance computed counts and index newly completed full blocks in the prefix cache; ``accepted``: how
        many of a sequence's extra tokens the step confirmed, by seq_id (only those count as computed)."""
        for seq, n, more in zip(plan.seqs, plan.num_new_tokens, plan.extra_token_ids):
            tokens = seq.token_ids
            if more:
                a = (accepted or {}).get(seq.seq_id, 0)
                n -= len(more) - a
                tokens = tokens + list(more[:a])  # the engine appends them after this
            seq.num_computed_tokens += n
            self.num_computed_tokens_total += n
            while len(seq.block_hashes) < seq.num_computed_tokens // self.block_size:
                k = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                h = block_hash(parent, tokens[k * self.block_size:(k + 1) * self.block_size])
                seq.block_hashes.append(h)
                self.pool.register(seq.block_table[k], h)
            if self.snapshots is not None:
                self._snapshots_done(seq)

    def _snapshots_done(self, seq: Sequence) -> None:
        """After a step of ``seq``: its restore is done; a snapshot its step wrote is committed to its hash."""
        assert self.snapshots is not None
        if seq.state_restore is not None:
            self.snapshots.release(seq.state_restore)
            seq.state_restore = None
        while seq.state_snapshots and seq.num_computed_tokens >= seq.state_snapshots[0][0]:
            _, snapshot, h = seq.state_snapshots.pop(0)
            self.snapshots.commit(snapshot, h)
