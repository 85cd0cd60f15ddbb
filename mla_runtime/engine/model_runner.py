"""``ModelRunner``: rank 0's side of a step — order the scheduled sequences for the kernels, run the step on
every rank, sample.

The step runs its sequences shortest first (one-token decodes, then speculative verifications, then prefill
chunks; stable among equals): on CPU the leading short ones share one gather plan of the absorbed attention
(``attention_metadata``), so this is where the batch is put in the order the kernels want; the scheduler does
not need to know.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from mla_runtime.engine.mtp import draft_input
from mla_runtime.engine.sampler import Penalties, TokenMasks, sample
from mla_runtime.engine.scheduler import ScheduledBatch
from mla_runtime.engine.sequence import Sequence
from mla_runtime.engine.structured import MaskBuilder
from mla_runtime.engine.thread_tuner import ThreadTuner
from mla_runtime.engine.tp_workers import RankDiedError, TensorParallelGroup
from mla_runtime.engine.worker import StepInput, Worker
from mla_runtime.sampling_params import SamplingParams


@dataclass
class Sampled:
    """What one step gives a sequence: its new tokens, in order, and their log-probability entries."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


@dataclass
class _TokenCounts:
    """One penalised sequence's tokens, kept on the device: ``counts [V]`` of its generated tokens and ``seen [V]``
    (in the prompt or generated); ``catch_up`` adds the tokens generated since the last step."""

    seq: Sequence
    counts: torch.Tensor
    seen: torch.Tensor
    num_counted: int = 0

    @classmethod
    def new(cls, seq: Sequence, vocab: int, device: torch.device) -> _TokenCounts:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor(seq.prompt_token_ids, dtype=torch.long, device=device)] = True
        return cls(seq, torch.zeros(vocab, device=device), seen)

    def catch_up(self) -> None:
        new = self.seq.output_token_ids[self.num_counted:]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=self.counts.device)
            self.counts.index_put_((ids,), torch.ones(len(new), device=self.counts.device), accumulate=True)
            self.seen[ids] = True
            self.num_counted += len(new)


class ModelRunner:
    def __init__(self, worker: Worker, seed: int, tp_group: TensorParallelGroup | None = None,
                 thread_tuner: ThreadTuner | None = None) -> None:
        self.worker = worker
        self.tp_group = tp_group
        self.thread_tuner = thread_tuner
        cfg = worker.model_config
        self.eos_token_ids = [t for t in cfg.eos_token_ids if t < cfg.vocab_size]
        self.generator = torch.Generator(device=worker.device).manual_seed(seed)
        self.counts: dict[int, _TokenCounts] = {}  # penalised sequences' token counts, by seq_id
        self.masks = MaskBuilder(cfg.vocab_size)  # structured outputs' masks, computed during the forward pass
        spec = worker.config
        self.mtp_drafts = spec.num_speculative_tokens if spec.speculative_method == "mtp" else 0

    @staticmethod
    def order(batch: ScheduledBatch) -> list[int]:
        """The step's sequence order: fewest new tokens first (decodes, then verifications, then prefill chunks),
        stable among equals."""
        return sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i])

    @staticmethod
    def prepare(batch: ScheduledBatch) -> tuple[StepInput, list[Sequence]]:
        """The step's message, one-token decodes first, and the sequences that get logits: each one whose last
        token runs in this step (all its positions for a speculative decode: its drafts are verified)."""
        order = ModelRunner.order(batch)
        chunks: list[list[int]] = []
        contexts: list[int] = []
        tables: list[list[int]] = []
        rows: list[int] = []
        seqs: list[Sequence] = []
        end = 0
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start, k = seq.num_computed_tokens, len(seq.draft_token_ids)
            chunks.append(seq.token_ids[start:start + n - k] + seq.draft_token_ids)
            contexts.append(start)
            tables.append(seq.block_table)
            end += n
            if start + n - k == seq.num_tokens:
                seqs.append(seq)
                rows.extend(range(end - 1 - k, end))
        return StepInput(chunks, contexts, tables, rows), seqs

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sampled], dict[int, int]]:
        """Run one step. Returns, for each sequence that reached its last token, the tokens it gains (one, or
        for a speculative decode its accepted drafts and the model's next token) with their log-probabilities;
        and the number of accepted drafts by seq_id."""
        step, seqs = self.prepare(batch)
        pending = self.masks.start(seqs)
        if self.tp_group is None:
            num_tokens = sum(map(len, step.token_chunks))
            is_decode = max(map(len, step.token_chunks), default=0) == 1
            with self.thread_tuner.step(num_tokens, is_decode) if self.thread_tuner else nullcontext():
                logits = self.worker.execute(step)
        else:
            self.tp_group.broadcast_step(step)
            try:
                logits = self.worker.execute(step)
            except RuntimeError as e:  # a collective failed: a peer rank is gone
                self.tp_group.check_alive()
                raise RankDiedError(f"tensor-parallel step failed: {e}") from e
        masks = self.masks.finish(pending)
        sampled, accepted = ([], {}) if logits is None else self._sample(logits, seqs, masks)
        if self.mtp_drafts:  # also after a step of prefill chunks only: their MTP latents
            self._draft(batch, sampled)
        return sampled, accepted

    def _draft(self, batch: ScheduledBatch, sampled: list[Sampled]) -> None:
        """The MTP layer's pass over the step (``engine/mtp.py``): its latents, and the next step's drafts."""
        gained = {s.seq.seq_id: s.token_ids for s in sampled}
        d, seqs = draft_input(batch, self.order(batch), gained, self.mtp_drafts, self.worker.config.block_size)
        if self.tp_group is not None:
            self.tp_group.send("draft", d)
        for seq, drafts in zip(seqs, self.worker.draft(d)):
            seq.mtp_draft_ids = drafts

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], masks: TokenMasks | None = None
                ) -> tuple[list[Sampled], dict[int, int]]:
        # one sampler row per logit row; row j of a speculative decode sees its first j drafts as generated
        params, gens, suppress, drafts = [], [], [], []
        for seq in seqs:
            k = len(seq.draft_token_ids)
            for j in range(k + 1):
                params.append(seq.params)
                gens.append(seq.generator)
                # a grammar decides alone when its output may end: min_tokens would contradict it
                suppress.append([] if seq.grammar else self._stop_tokens(seq.params, len(seq.output_token_ids) + j))
                drafts.append(seq.draft_token_ids[j] if j < k else None)
        result = sample(logits, params, gens, self.generator, suppress=suppress, drafts=drafts,
                        penalties=self._penalties(seqs, logits.shape[1]), masks=masks)
        sampled, accepted, first_row = [], {}, 0
        for seq in seqs:
            k = len(seq.draft_token_ids)
            tokens, lps = result.token_ids[first_row:first_row + k + 1], result.logprobs[first_row:first_row + k + 1]
            first_row += k + 1
            a = 0
            while a < k and seq.draft_token_ids[a] == tokens[a]:  # the sampler returned the draft: accepted
                a += 1
            if k:
                accepted[seq.seq_id] = a
            sampled.append(Sampled(seq, tokens[:a + 1], lps[:a + 1]))
        return sampled, accepted

    def _penalties(self, seqs: list[Sequence], vocab: int) -> Penalties | None:
        """The token counts of the step's penalised rows, from counts kept on the device per sequence (each
        generated token is added once); row j of a speculative decode also counts its first j drafts."""
        for seq_id in [i for i, c in self.counts.items() if c.seq.is_finished]:
            del self.counts[seq_id]
        rows: list[tuple[int, _TokenCounts]] = []
        drafted_rows: list[int] = []
        drafted_ids: list[int] = []
        row = 0
        for seq in seqs:
            k = len(seq.draft_token_ids)
            if seq.params.penalised:
                kept = self.counts.get(seq.seq_id) or self.counts.setdefault(
                    seq.seq_id, _TokenCounts.new(seq, vocab, self.worker.device))
                kept.catch_up()
                for j in range(k + 1):
                    drafted_rows += [len(rows)] * j
                    drafted_ids += seq.draft_token_ids[:j]
                    rows.append((row + j, kept))
            row += k + 1
        if not rows:
            return None
        dev = self.worker.device
        counts = torch.stack([c.counts for _, c in rows])  # [R, V]
        if drafted_ids:
            counts.index_put_((torch.tensor(drafted_rows, device=dev), torch.tensor(drafted_ids, device=dev)),
                              torch.ones(len(drafted_ids), device=dev), accumulate=True)
        seen = torch.stack([c.seen for _, c in rows]) | (counts > 0)
        return Penalties(torch.tensor([r for r, _ in rows], device=dev), counts, seen)

    def _stop_tokens(self, params: SamplingParams, num_generated: int) -> list[int]:
        """The tokens that would end a sequence with ``num_generated`` tokens but may not yet (min_tokens)."""
        if num_generated >= params.min_tokens:
            return []
        return ([] if params.ignore_eos else self.eos_token_ids) + list(params.stop_token_ids or [])
