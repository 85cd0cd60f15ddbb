"""Model runner: turns a ``ScheduledBatch`` into a ``ForwardBatch``, runs the model, samples."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.engine.sampler import SampleResult, sample
from mla_runtime.engine.scheduler import ScheduledBatch
from mla_runtime.engine.sequence import Sequence
from mla_runtime.engine.thread_tuner import ThreadTuner
from mla_runtime.engine.tp_workers import RankDiedError, TensorParallelGroup
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.models.deepseek import DeepseekForCausalLM


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
            chunks.append(seq.token_ids[start:start + n])
            contexts.append(start)
            tables.append(seq.block_table)
        return ForwardBatch.build(chunks, contexts, tables, self.block_size, self.device)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SampleResult]:
        """Run one step; returns the sequences that reached their last token and their samples."""
        fwd = self.build_batch(batch)
        rows = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                if seq.num_computed_tokens + n == seq.num_tokens]
        if self.tp_group is None:
            with self.thread_tuner.step(fwd.num_tokens, fwd.is_decode) if self.thread_tuner else nullcontext():
                logits = self._forward(fwd, rows)
        else:
            self.tp_group.broadcast_step(fwd, rows)
            try:
                logits = self._forward(fwd, rows)
            except RuntimeError as e:  # a collective failed: a peer rank is gone
                self.tp_group.check_alive()
                raise RankDiedError(f"tensor-parallel step failed: {e}") from e
        if logits is None:
            return [], SampleResult([], [])
        seqs = [batch.seqs[i] for i in rows]
        return seqs, sample(logits, [s.params for s in seqs], [s.generator for s in seqs], self.generator,
                            [s.output_token_ids for s in seqs], [s.prompt_token_ids for s in seqs],
                            [self._stop_tokens(s) for s in seqs])

    def _stop_tokens(self, seq: Sequence) -> list[int]:
        """The tokens that would end ``seq`` now but may not yet (fewer than ``min_tokens`` generated)."""
        p = seq.params
        if len(seq.output_token_ids) >= p.min_tokens:
            return []
        eos = [] if p.ignore_eos else [t for t in self.model.config.eos_token_ids if t < self.model.config.vocab_size]
        return eos + list(p.stop_token_ids or [])

    def _forward(self, fwd: ForwardBatch, rows: list[int]) -> torch.Tensor | None:
        hidden = self.model(fwd, self.cache)
        return self.model.compute_logits(hidden[fwd.logits_indices[rows]]) if rows else None
