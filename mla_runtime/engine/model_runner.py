"""``ModelRunner``: rank 0's side of a step, prepare → execute → sample.

1. ``prepare(plan)``: the ``StepInput`` of a ``StepPlan``, in the plan's order, the sequences that get logits and
   their drafts, and the grammar masks begun on a worker thread (``structured.MaskBuilder``);
2. ``execute(prepared)``: the step on every rank — broadcast to the tensor-parallel ranks, or under the thread
   count tuned for its size (``thread_tuner``) — and the logits of the rows that need them;
3. ``sample(prepared, logits)``: the masks, then the ``Sampler`` (``engine/sampler.py``, which keeps the penalty
   state between steps).

``run(plan)`` is the three in a row. At start-up (the cache allocated), it plugs the decode CUDA graphs into its
worker where they are on (``engine/cuda_graphs.py``).
"""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from typing import cast

import torch

from mla_runtime.engine.cuda_graphs import DecodeGraphs, start_decode_graphs
from mla_runtime.engine.sampler import Sampled, Sampler, TokenMasks
from mla_runtime.engine.scheduler import StepPlan
from mla_runtime.engine.sequence import Sequence
from mla_runtime.engine.structured import MaskBuilder
from mla_runtime.engine.thread_tuner import ThreadTuner
from mla_runtime.engine.tp_workers import RankDiedError, TensorParallelGroup
from mla_runtime.engine.worker import StepInput, Worker


@dataclass(frozen=True)
class PreparedStep:
    """A plan made ready to run: the step's message, the sequences that get logits (in row order) with their drafts,
    and their grammar masks, computed while the model runs (None: no constrained sequence)."""

    step: StepInput
    seqs: list[Sequence]
    drafts: list[tuple[int, ...]]
    masks: Future[TokenMasks] | None


def state_copies(plan: StepPlan) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """A hybrid's state copies of a step: ``(snapshot, slot)`` restored before it (prefix hits), and ``(sequence,
    tokens, snapshot)``: the states after that many of the sequence's new tokens written to the snapshot."""
    restores: list[tuple[int, int]] = []
    snapshots: list[tuple[int, int, int]] = []
    for b, (seq, n) in enumerate(zip(plan.seqs, plan.num_new_tokens)):
        if seq.state_restore is not None:
            restores.append((seq.state_restore, cast(int, seq.state_slot)))
        start = seq.num_computed_tokens
        snapshots += [(b, end - start, s) for end, s, _ in seq.state_snapshots if start < end <= start + n]
    return restores, snapshots


class ModelRunner:
    def __init__(self, worker: Worker, seed: int, tp_group: TensorParallelGroup | None = None,
                 thread_tuner: ThreadTuner | None = None) -> None:
        self.worker = worker
        self.tp_group = tp_group
        self.thread_tuner = thread_tuner
        cfg = worker.model_config
        self.sampler = Sampler([t for t in cfg.eos_token_ids if t < cfg.vocab_size], worker.device, seed)
        self.masks = MaskBuilder(cfg.vocab_size)  # structured outputs' masks, computed during the forward pass
        # decode steps under CUDA graphs (or their stand-in); None: every step eager
        self.graphs: DecodeGraphs | None = start_decode_graphs(worker) if tp_group is None else None

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[list[Sampled], dict[int, int]]:
        """One step. Returns, for each sequence that reached its last token, the tokens it gains (one, or for a
        speculative decode its accepted drafts and the model's next token) with their log-probabilities; and the
        number of accepted drafts by seq_id."""
        prepared = self.prepare(plan)
        return self.sample(prepared, self.execute(prepared))

    def prepare(self, plan: StepPlan) -> PreparedStep:
        """The step's message in the plan's order, and the sequences that get logits: each one whose last token
        runs in this step (all its positions for a speculative decode: its drafts are verified)."""
        chunks: list[list[int]] = []
        contexts: list[int] = []
        tables: list[list[int]] = []
        rows: list[int] = []
        seqs: list[Sequence] = []
        drafts: list[tuple[int, ...]] = []
        end = 0
        for seq, n, more in zip(plan.seqs, plan.num_new_tokens, plan.extra_token_ids):
            start, k = seq.num_computed_tokens, len(more)
            chunks.append(seq.token_ids[start:start + n - k] + list(more))
            contexts.append(start)
            tables.append(seq.block_table)
            end += n
            if start + n - k == seq.num_tokens:
                seqs.append(seq)
                drafts.append(more)
                rows.extend(range(end - 1 - k, end))
        slots = [cast(int, s.state_slot) for s in plan.seqs] if plan.seqs and plan.seqs[0].state_slot is not None \
            else None
        restores, snapshots = state_copies(plan)
        step = StepInput(chunks, contexts, tables, rows, slots, restores, snapshots, *self.worker.take_state_releases())
        return PreparedStep(step, seqs, drafts, self.masks.start(seqs, drafts))

    def execute(self, prepared: PreparedStep) -> torch.Tensor | None:
        """Run the step on every rank; the logits of its rows (None: no row needs any)."""
        step = prepared.step
        if self.tp_group is None:
            num_tokens = sum(map(len, step.token_chunks))
            is_decode = max(map(len, step.token_chunks), default=0) == 1
            with self.thread_tuner.step(num_tokens, is_decode) if self.thread_tuner else nullcontext():
                return self.worker.execute(step)
        self.tp_group.broadcast_step(step)
        try:
            return self.worker.execute(step)
        except RuntimeError as e:  # a collective failed: a peer rank is gone
            self.tp_group.check_alive()
            raise RankDiedError(f"tensor-parallel step failed: {e}") from e

    def sample(self, prepared: PreparedStep, logits: torch.Tensor | None) -> tuple[list[Sampled], dict[int, int]]:
        masks = self.masks.finish(prepared.masks)
        if logits is None:
            return [], {}
        return self.sampler.sample_step(logits, prepared.seqs, prepared.drafts, masks)
