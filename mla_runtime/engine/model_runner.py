"""Model runner: turns a ``ScheduledBatch`` into a ``ForwardBatch``, runs the model, samples."""

from __future__ import annotations

import torch

from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.engine.sampler import SampleResult, sample
from mla_runtime.engine.scheduler import ScheduledBatch
from mla_runtime.engine.sequence import Sequence
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.models.deepseek import DeepseekForCausalLM


class ModelRunner:
    def __init__(self, model: DeepseekForCausalLM, cache: LatentCache, device: torch.device, seed: int) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def build_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        chunks, contexts, tables = [], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            chunks.append(seq.token_ids[start:start + n])
            contexts.append(start)
            tables.append(seq.block_table)
        return ForwardBatch.build(chunks, contexts, tables, self.cache.block_size, self.device)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SampleResult]:
        """Run one step; returns the sequences that reached their last token and their samples."""
        fwd = self.build_batch(batch)
        hidden = self.model(fwd, self.cache)
        rows = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                if seq.num_computed_tokens + n == seq.num_tokens]
        if not rows:
            return [], SampleResult([], [])
        seqs = [batch.seqs[i] for i in rows]
        logits = self.model.compute_logits(hidden[fwd.logits_indices[rows]])
        return seqs, sample(logits, [s.params for s in seqs], [s.generator for s in seqs], self.generator)
