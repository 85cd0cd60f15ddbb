"""Proposers: the speculative drafts of the running decodes, chosen outside the scheduler (as in vLLM's v1 design,
where the drafter fills each request's speculative tokens between the steps and the scheduler only budgets them).

A step goes propose → schedule → execute → sample → observe → bookkeeping:

1. ``propose(running)``, before the scheduler: the drafts of each running one-token decode, by seq_id — at most
   ``num_speculative_tokens``, never past ``max_tokens`` or ``max_model_len``. The scheduler takes them as the
   decode's extra tokens (``Scheduler.schedule(extra)``), cut to the budget the decode's own token leaves — a
   prefix of a proposal is the proposal for fewer tokens — and dropped when their blocks are not free; the step
   then verifies the ones its ``StepPlan`` carries. They exist before the scheduler runs because they take budget
   and cache slots that the sequences scheduled after them would otherwise get.
2. ``observe(plan, sampled)``, after sampling and before the step's bookkeeping (the sequences still hold the
   state the step started from): where a proposer's own model runs.

- ``Proposer``: no drafts (``num_speculative_tokens`` 0).
- ``PromptLookupProposer``: tokens copied from the sequence's own past (``engine/speculative.py``), cut to the
  prefix the sequence's grammar accepts (structured outputs: a draft the grammar refuses is never verified).
- ``MtpProposer``: the drafts the checkpoint's MTP layer chained after the sequence's last sampled step
  (``engine/mtp.py``); ``observe`` runs that pass on every rank. ``trailing_slots``: the chain's slots past a
  sampled sequence's end, whose blocks the scheduler reserves while free.
"""

from __future__ import annotations

from collections.abc import Iterable

from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.mtp import draft_input
from mla_runtime.engine.sampler import Sampled
from mla_runtime.engine.scheduler import StepPlan
from mla_runtime.engine.sequence import Sequence
from mla_runtime.engine.speculative import propose
from mla_runtime.engine.tp_workers import TensorParallelGroup
from mla_runtime.engine.worker import Worker


class Proposer:
    """The interface, and the proposer that drafts nothing."""

    trailing_slots = 0  # slots past a sampled sequence's end that ``observe`` writes

    def __init__(self, num_tokens: int = 0, max_model_len: int = 0) -> None:
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len

    def propose(self, seqs: Iterable[Sequence]) -> dict[int, list[int]]:
        """The drafts of the one-token decodes among ``seqs`` that have any, by seq_id."""
        found: dict[int, list[int]] = {}
        if not self.num_tokens:
            return found
        for seq in seqs:
            if seq.num_uncomputed != 1:
                continue
            k = min(self.num_tokens, seq.params.max_tokens - len(seq.output_token_ids) - 1)
            if self.max_model_len:
                k = min(k, self.max_model_len - seq.num_tokens - 1)
            drafts = self.drafts(seq, k) if k > 0 else []
            if drafts:
                found[seq.seq_id] = drafts
        return found

    def drafts(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` drafts after ``seq``'s last token."""
        return []

    def observe(self, plan: StepPlan, sampled: list[Sampled]) -> None:
        """See the step that ran ``plan`` and what it sampled, before its bookkeeping."""


class PromptLookupProposer(Proposer):
    def __init__(self, num_tokens: int, max_model_len: int, longest: int, shortest: int) -> None:
        super().__init__(num_tokens, max_model_len)
        self.longest, self.shortest = longest, shortest  # the suffix lengths looked up

    def drafts(self, seq: Sequence, k: int) -> list[int]:
        found = propose(seq.token_ids, k, self.longest, self.shortest)
        return seq.grammar.valid_prefix(found) if seq.grammar is not None else found


class MtpProposer(Proposer):
    def __init__(self, num_tokens: int, max_model_len: int, worker: Worker,
                 tp_group: TensorParallelGroup | None) -> None:
        super().__init__(num_tokens, max_model_len)
        self.worker, self.tp_group = worker, tp_group
        self.trailing_slots = num_tokens - 1  # the first draft's slot is the sampled token's

    def drafts(self, seq: Sequence, k: int) -> list[int]:
        return seq.mtp_draft_ids[:k]

    def observe(self, plan: StepPlan, sampled: list[Sampled]) -> None:
        """The MTP layer's pass over the step: its latents, and the next drafts of each sequence that sampled (also
        after a step of prefill chunks only: their MTP latents)."""
        gained = {s.seq.seq_id: s.token_ids for s in sampled}
        d = draft_input(plan, gained, self.num_tokens, self.worker.config.block_size)
        if self.tp_group is not None:
            self.tp_group.send("draft", d)
        for seq, drafts in zip(plan.seqs, self.worker.draft(d)):
            seq.mtp_draft_ids = drafts


def make_proposer(config: EngineConfig, worker: Worker, tp_group: TensorParallelGroup | None) -> Proposer:
    k, max_len = config.num_speculative_tokens, worker.max_model_len
    if config.speculative_method == "mtp":
        return MtpProposer(k, max_len, worker, tp_group)
    if k:
        return PromptLookupProposer(k, max_len, config.prompt_lookup_max, config.prompt_lookup_min)
    return Proposer()
