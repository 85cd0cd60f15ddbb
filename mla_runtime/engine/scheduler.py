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

With speculative decoding on, a decode also carries its draft tokens (``engine/speculative.py``, or the ones
the MTP layer proposed in the sequence's previous step, ``engine/mtp.py``):
they take budget and cache slots like any token, and ``on_step_done`` counts only the ones the model
accepted as computed — the latents written for rejected drafts lie past the sequence's end and are
overwritten by the tokens that really come there.

The scheduler deals only in sequences, token counts and block ids.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from mla_runtime.engine.block_pool import BlockPool, block_hash
from mla_runtime.engine.sequence import Sequence, SequenceStatus
from mla_runtime.engine.speculative import propose


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int = 0,
                 num_speculative_tokens: int = 0, prompt_lookup: tuple[int, int] = (3, 1),
                 speculative_method: str = "prompt_lookup") -> None:
        self.pool = pool
        self.speculative_method = speculative_method
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup = prompt_lookup  # (longest, shortest) suffix to look up
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_computed_tokens_total = 0  # tokens run through the model (prefix hits excluded)
        self.seconds_above_watermark = 0.0  # while the occupied blocks stayed above the watermark after relief
        self._pressure_checked: tuple[float, bool] | None = None  # (when, above) at the last relief

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
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.mtp_draft_ids = []

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

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

    def _admit_prefix(self, seq: Sequence) -> None:
        hashes = self._prefix_hashes(seq)
        hit = self.pool.lookup(hashes, seq.num_tokens)
        seq.block_table = hit
        seq.block_hashes = hashes[: len(hit)]
        seq.num_computed_tokens = len(hit) * self.block_size
        seq.num_cached_prompt_tokens = seq.num_computed_tokens

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
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        # decodes first, then unfinished prefills: a long prompt never stalls running decodes
        order = [s for s in self.running if s.num_uncomputed == 1] + \
            [s for s in self.running if s.num_uncomputed > 1]
        scheduled: set[int] = set()
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget)
            seq.draft_token_ids = self._drafts(seq, budget - 1) if n == seq.num_uncomputed == 1 else []
            if seq.draft_token_ids and (self._blocks_for(seq.num_computed_tokens + n + len(seq.draft_token_ids))
                                        - len(seq.block_table) > self.pool.num_free_blocks):
                seq.draft_token_ids = []  # drafts never cost another sequence its blocks
            n += len(seq.draft_token_ids)
            need = self._blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
            while need > self.pool.num_free_blocks:
                victims = [v for v in self.running if v.seq_id not in scheduled]
                victim = victims[-1]  # the most recently admitted one not already in this batch
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.block_table += self.pool.allocate(need)
            scheduled.add(seq.seq_id)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if self._waits_for_sibling(seq):
                break
            if not seq.block_table:
                self._admit_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            need = self._blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
            if need > self.pool.num_free_blocks:
                self._release(seq)  # give the prefix hits back; retry next step
                break
            seq.block_table += self.pool.allocate(need)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        if self.speculative_method == "mtp" and self.num_speculative_tokens > 1:
            self._lookahead(batch)
        return batch

    def _lookahead(self, batch: ScheduledBatch) -> None:
        """Blocks for the slots the MTP layer's chained drafts write after a sampled step (``engine/mtp.py``),
        taken only while free: a chain that finds none is shorter, no sequence is preempted for it."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens + n < seq.num_tokens:
                continue  # a prefill chunk before the prompt's end: nothing is sampled, no chain
            need = self._blocks_for(seq.num_computed_tokens + n + self.num_speculative_tokens - 1) \
                - len(seq.block_table)
            if 0 < need <= self.pool.num_free_blocks:
                seq.block_table += self.pool.allocate(need)

    def _drafts(self, seq: Sequence, room: int) -> list[int]:
        """Draft tokens for a decode: at most ``room``, never past max_tokens or max_model_len."""
        p = seq.params
        k = min(self.num_speculative_tokens, room, p.max_tokens - len(seq.output_token_ids) - 1,
                self.max_model_len - seq.num_tokens - 1 if self.max_model_len else room)
        if k < 1:
            return []
        if self.speculative_method == "mtp":
            return seq.mtp_draft_ids[:k]
        longest, shortest = self.prompt_lookup
        drafts = propose(seq.token_ids, k, longest, shortest)
        return seq.grammar.valid_prefix(drafts) if seq.grammar is not None else drafts  # never verify a violation

    def on_step_done(self, batch: ScheduledBatch, accepted: dict[int, int] | None = None) -> None:
        """Advance computed counts and index newly completed full blocks in the prefix cache; ``accepted``:
        how many draft tokens the model confirmed, by seq_id (only those count as computed)."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            tokens = seq.token_ids
            if seq.draft_token_ids:
                a = (accepted or {}).get(seq.seq_id, 0)
                n -= len(seq.draft_token_ids) - a
                tokens = tokens + seq.draft_token_ids[:a]  # the engine appends them after this
                seq.draft_token_ids = []
            seq.num_computed_tokens += n
            self.num_computed_tokens_total += n
            while len(seq.block_hashes) < seq.num_computed_tokens // self.block_size:
                k = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                h = block_hash(parent, tokens[k * self.block_size:(k + 1) * self.block_size])
                seq.block_hashes.append(h)
                self.pool.register(seq.block_table[k], h)
