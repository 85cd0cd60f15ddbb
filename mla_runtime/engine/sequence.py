"""A sequence: one sample of one request, and everything the scheduler tracks about it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mla_runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mla_runtime.engine.structured import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    index: int  # sample index within its request (0 .. n-1)
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full, computed blocks
    num_computed_tokens: int = 0  # tokens whose latent is in the cache
    state_slot: int | None = None  # a hybrid model's state slot while running (cache/state_cache.py)
    # a hybrid's prefix hit: the pinned state snapshot copied into its slot before its first step
    state_restore: int | None = None
    # a hybrid's snapshots to write, in position order: (a block boundary, the snapshot, the hash of the block ending
    # there)
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0  # tokens served by the prefix cache at (re)admission
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    share_prefix_with: Sequence | None = None  # sample 1 of the same request (n > 1)
    grammar: GrammarState | None = None  # structured outputs: the output's position in its grammar
    # a grammar that starts after the constraint's after_token (the thinking before it is free); then it is grammar
    pending_grammar: GrammarState | None = None
    # the MTP layer's drafts for the next step (engine/proposer.py: written after every step that samples it)
    mtp_draft_ids: list[int] = field(default_factory=list)
    stop_text_from: int = 0  # stop strings count from here in the output text (set when min_tokens is reached)

    token_ids: list[int] = field(init=False)  # prompt then output: kept whole, so a step reads it in O(1)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids) + self.output_token_ids

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.token_ids.append(token)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens
