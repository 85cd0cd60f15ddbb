"""Model runner: turns a ``ScheduledBatch`` into a ``ForwardBatch``, runs the model, samples."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.engine.sampler import sample
from mla_runtime.engine.scheduler import ScheduledBatch
from mla_runtime.engine.sequence import Sequence
from mla_runtime.engine.thread_tuner import ThreadTuner
from mla_runtime.engine.tp_workers import RankDiedError, TensorParallelGroup
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.models.deepseek import DeepseekForCausalLM
from mla_runtime.sampling_params import SamplingParams


@dataclass
class Sampled:
    """What one step gives a sequence: its new tokens, in order, and their log-probability entries."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class ModelRunner:
    def __init__(self, model: DeepseekForCausalLM, cache: LatentCache, device: torch.device, seed: int,
                 block_size: int, tp_group: TensorParallelGroup | None = None,
                 thread_tuner: ThreadTuner | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.block_size = block_size  # logical block size (the sharded cache keeps block_size / N per rank)
        self.tp_group = tp_group
        self.thread_tuner = thread_tuner
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def build_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        chunks, contexts, tables = [], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            chunks.append(seq.token_ids[start:start + n - len(seq.draft_token_ids)] + seq.draft_token_ids)
            contexts.append(start)
            tables.append(seq.block_table)
        return ForwardBatch.build(chunks, contexts, tables, self.block_size, self.device)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sampled], dict[int, int]]:
        """Run one step. Returns, for each sequence that reached its last token, the tokens it gains (one, or
        for a speculative decode its accepted drafts and the model's next token) with their log-probabilities;
        and the number of accepted drafts by seq_id."""
        fwd = self.build_batch(batch)
        # logit rows: the last token of each sequence that completes, every token of a speculative decode
        seqs: list[Sequence] = []
        token_rows: list[int] = []
        for seq, n, end in zip(batch.seqs, batch.num_new_tokens, fwd.query_start_loc[1:].tolist()):
            if seq.num_computed_tokens + n - len(seq.draft_token_ids) == seq.num_tokens:
                seqs.append(seq)
                token_rows.extend(range(end - 1 - len(seq.draft_token_ids), end))
        if self.tp_group is None:
            with self.thread_tuner.step(fwd.num_tokens, fwd.is_decode) if self.thread_tuner else nullcontext():
                logits = self._forward(fwd, token_rows)
        else:
            self.tp_group.broadcast_step(fwd, token_rows)
            try:
                logits = self._forward(fwd, token_rows)
            except RuntimeError as e:  # a collective failed: a peer rank is gone
                self.tp_group.check_alive()
                raise RankDiedError(f"tensor-parallel step failed: {e}") from e
        if logits is None:
            return [], {}
        # one sampler row per logit row; row j of a speculative decode sees its first j drafts as generated
        params, gens, outputs, prompts, suppress, drafts = [], [], [], [], [], []
        for seq in seqs:
            k = len(seq.draft_token_ids)
            for j in range(k + 1):
                out = seq.output_token_ids + seq.draft_token_ids[:j] if j else seq.output_token_ids  # no copy
                params.append(seq.params)
                gens.append(seq.generator)
                outputs.append(out)
                prompts.append(seq.prompt_token_ids)
                suppress.append(self._stop_tokens(seq.params, len(out)))
                drafts.append(seq.draft_token_ids[j] if j < k else None)
        result = sample(logits, params, gens, self.generator, outputs, prompts, suppress, drafts)
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

    def _stop_tokens(self, params: SamplingParams, num_generated: int) -> list[int]:
        """The tokens that would end a sequence with ``num_generated`` tokens but may not yet (min_tokens)."""
        if num_generated >= params.min_tokens:
            return []
        cfg = self.model.config
        eos = [] if params.ignore_eos else [t for t in cfg.eos_token_ids if t < cfg.vocab_size]
        return eos + list(params.stop_token_ids or [])

    def _forward(self, fwd: ForwardBatch, token_rows: list[int]) -> torch.Tensor | None:
        hidden = self.model(fwd, self.cache)
        return self.model.compute_logits(hidden[token_rows]) if token_rows else None
