"""``ForwardBatch``: the only object that crosses from scheduling into the model.

A step runs ``T`` new tokens belonging to ``B`` sequences. Sequence ``b`` brings ``q_len_b`` new tokens
(a prefill chunk or one decode token) on top of ``context_len_b`` tokens already in the latent cache;
after the step its cache holds ``seq_len_b = context_len_b + q_len_b`` tokens. Tokens of a sequence are
contiguous and in order.

A batch is immutable: how the layers attend over it (RoPE tables, decode plans, this rank's cache view) is
decided once per step in ``attention_metadata.AttentionMetadata``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: cu_seqlens of the new tokens
    seq_lens: torch.Tensor  # [B] int32: cached tokens after this step
    seq_start_loc: torch.Tensor  # [B + 1] int32: cu_seqlens of seq_lens (keys of the naive path)
    context_lens: torch.Tensor  # [B] int32: cached tokens before this step
    block_tables: torch.Tensor  # [B, max_blocks] int32
    token_seq_lens: torch.Tensor  # [T] int32: keys visible to each new token (causal)
    token_req_idx: torch.Tensor  # [T] int32: sequence (block-table row) of each new token
    logits_indices: torch.Tensor  # [B] int64: last new token of each sequence
    query_lens: list[int]
    context_lens_list: list[int]
    block_size: int
    host_block_tables: Sequence[Sequence[int]] | None = None  # the block ids of each sequence, as given to build
    # a hybrid model's state slot of each sequence (``cache/state_cache.py``); None: a model without linear layers
    state_slots: tuple[int, ...] | None = None
    # a hybrid's prefix-cache snapshots: (sequence, tokens, state row): its states after that many of its new tokens
    # are copied to that row of the state cache
    state_snapshots: tuple[tuple[int, int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode(self) -> bool:
        return max(self.query_lens, default=0) == 1

    @functools.cached_property
    def key_lens(self) -> list[int]:
        """The keys each sequence attends over in this step (``context + new`` tokens), on the host: made once per
        batch, read by every layer."""
        return [c + q for q, c in zip(self.query_lens, self.context_lens_list)]

    def leading_short(self, max_query_len: int, max_extra_keys: int | None = None) -> tuple[int, int]:
        """``(sequences, tokens)`` of the leading run of sequences with at most ``max_query_len`` new tokens each
        (``StepPlan`` puts the fewest new tokens first): in a mixed step those tokens are ``[:tokens]`` and the longer
        chunks come after them. ``max_extra_keys`` also bounds, for a sequence of ``q > 1`` new tokens, the keys
        its rows read beyond one row's (``(q - 1) * seq_len``)."""
        seqs = tokens = 0
        for q, c in zip(self.query_lens, self.context_lens_list):
            if q > max_query_len or (q > 1 and max_extra_keys is not None and (q - 1) * (c + q) > max_extra_keys):
                break
            seqs += 1
            tokens += q
        return seqs, tokens

    def tail(self, first: int) -> ForwardBatch:
        """The sub-batch of sequences ``first:`` (whose tokens follow those of the first ``first`` sequences)
        with its own offsets."""
        if not 0 <= first <= self.num_seqs:
            raise ValueError(f"tail({first}) of a batch of {self.num_seqs} sequences")
        t0 = sum(self.query_lens[:first])
        return ForwardBatch(
            input_ids=self.input_ids[t0:], positions=self.positions[t0:], slot_mapping=self.slot_mapping[t0:],
            query_start_loc=self.query_start_loc[first:] - t0, seq_lens=self.seq_lens[first:],
            seq_start_loc=self.seq_start_loc[first:] - self.seq_start_loc[first],
            context_lens=self.context_lens[first:], block_tables=self.block_tables[first:],
            token_seq_lens=self.token_seq_lens[t0:], token_req_idx=self.token_req_idx[t0:] - first,
            logits_indices=self.logits_indices[first:] - t0, query_lens=self.query_lens[first:],
            context_lens_list=self.context_lens_list[first:], block_size=self.block_size,
            host_block_tables=None if self.host_block_tables is None else self.host_block_tables[first:],
            state_slots=None if self.state_slots is None else self.state_slots[first:],
            state_snapshots=tuple((b - first, n, r) for b, n, r in self.state_snapshots if b >= first))

    @classmethod
    def build(cls, token_chunks: Sequence[Sequence[int]], context_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]], block_size: int,
              device: torch.device | str = "cpu", state_slots: Sequence[int] | None = None,
              state_snapshots: Sequence[tuple[int, int, int]] = ()) -> ForwardBatch:
        """Build from plain lists: the new token ids, cached length and block ids of each sequence (and, for a hybrid
        model, its state slot and the step's state snapshots)."""
        if not (len(token_chunks) == len(context_lens) == len(block_tables)):
            raise ValueError("token_chunks, context_lens and block_tables must have one entry per sequence")
        if state_slots is not None and (len(state_slots) != len(token_chunks)
                                        or len(set(state_slots)) != len(state_slots)):
            raise ValueError(f"state_slots {list(state_slots)}: one distinct slot per sequence expected")
        for b, n, _ in state_snapshots:
            if not (0 <= b < len(token_chunks) and 0 < n <= len(token_chunks[b])):
                raise ValueError(f"state snapshot after {n} tokens of sequence {b}: not within its new tokens")
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tok_seq: list[int] = []
        tok_req: list[int] = []
        starts = [0]
        for b, (chunk, ctx, table) in enumerate(zip(token_chunks, context_lens, block_tables)):
            n = len(chunk)
            if n == 0:
                raise ValueError(f"sequence {b} has no new tokens")
            if (ctx + n + block_size - 1) // block_size > len(table):
                raise ValueError(f"sequence {b}: {ctx + n} tokens need more than its {len(table)} blocks")
            ids.extend(chunk)
            for pos in range(ctx, ctx + n):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
                tok_seq.append(pos + 1)
                tok_req.append(b)
            starts.append(starts[-1] + n)
        width = max((len(t) for t in block_tables), default=0) or 1
        table_rows = [list(t) + [0] * (width - len(t)) for t in block_tables]
        qlens = [len(c) for c in token_chunks]
        seq_lens = [c + q for c, q in zip(context_lens, qlens)]
        seq_starts = [0]
        for n in seq_lens:
            seq_starts.append(seq_starts[-1] + n)

        # two host-to-device transfers (one per dtype), split into views, instead of one per field
        num_tokens, num_seqs = len(ids), len(qlens)
        ids64 = torch.tensor(ids + positions + slots + [s - 1 for s in starts[1:]], dtype=torch.int64, device=device)
        input_ids, pos_t, slot_t, logits_t = torch.split(ids64, [num_tokens] * 3 + [num_seqs])
        ints32 = torch.tensor(starts + seq_lens + seq_starts + list(context_lens) + tok_seq + tok_req
                              + [b for row in table_rows for b in row], dtype=torch.int32, device=device)
        qsl, sl, ssl, cl, tsl, tri, tables = torch.split(ints32, [num_seqs + 1, num_seqs, num_seqs + 1, num_seqs,
                                                               num_tokens, num_tokens, num_seqs * width])
        return cls(
            input_ids=input_ids, positions=pos_t, slot_mapping=slot_t, query_start_loc=qsl, seq_lens=sl,
            seq_start_loc=ssl, context_lens=cl, block_tables=tables.view(num_seqs, width), token_seq_lens=tsl,
            token_req_idx=tri, logits_indices=logits_t, query_lens=qlens, context_lens_list=list(context_lens),
            block_size=block_size, host_block_tables=block_tables,
            state_slots=None if state_slots is None else tuple(state_slots), state_snapshots=tuple(state_snapshots))
