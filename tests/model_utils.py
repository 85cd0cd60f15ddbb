"""Run a model over prompts through a freshly allocated paged latent cache (shuffled block ids)."""

from __future__ import annotations

import random

import torch

from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.cache.state_cache import StateCache
from mla_runtime.dtypes import index_cache_dtype
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.models.deepseek import DeepseekForCausalLM


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


class PagedRunner:
    """Holds a cache and per-sequence block tables; feeds chunks of each prompt through the model."""

    def __init__(self, model: DeepseekForCausalLM, num_seqs: int, max_len: int, block_size: int = 16,
                 cache_dtype: torch.dtype | None = None, seed: int = 0) -> None:
        cfg = model.config
        per_seq = -(-max_len // block_size)
        num_blocks = per_seq * num_seqs + 3
        self.model = model
        self.block_size = block_size
        self.cache = LatentCache(model.num_cache_layers, num_blocks, block_size, cfg.latent_dim,
                                 cache_dtype or model.dtype, index_dim=cfg.index_dim,
                                 index_dtype=index_cache_dtype(cache_dtype or model.dtype, model.dtype))
        for layer in self.cache.layers:  # poison: any read of an unwritten slot shows up as NaN
            for t in (layer.kv, layer.index):
                if t is not None and t.is_floating_point():
                    t.fill_(float("nan"))
        if cfg.linear_attention is not None:  # a hybrid: sequence i keeps its linear layers' states in slot i
            self.cache.states = StateCache(cfg.linear_attention, num_seqs)
            for state in self.cache.states.layers:  # poison: a first step must not read its slot
                state.recurrent.fill_(float("nan"))
                state.conv.fill_(float("nan"))
        ids = list(range(num_blocks))
        random.Random(seed).shuffle(ids)
        self.tables = [ids[i * per_seq:(i + 1) * per_seq] for i in range(num_seqs)]
        self.lens = [0] * num_seqs

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run new tokens for some sequences; returns the logits of every new token, per sequence."""
        seqs = sorted(chunks)
        batch = ForwardBatch.build([chunks[s] for s in seqs], [self.lens[s] for s in seqs],
                                   [self.tables[s] for s in seqs], self.block_size,
                                   state_slots=seqs if self.cache.states is not None else None)
        logits = self.model.compute_logits(self.model(batch, self.cache))
        out = {}
        start = 0
        for s in seqs:
            n = len(chunks[s])
            out[s] = logits[start:start + n]
            start += n
            self.lens[s] += n
        return out

    def prefill(self, prompts: list[list[int]], chunk: int | None = None) -> list[torch.Tensor]:
        """All prompts together, in chunks of ``chunk`` tokens (whole prompts when None)."""
        results: list[list[torch.Tensor]] = [[] for _ in prompts]
        done = [0] * len(prompts)
        while any(d < len(p) for d, p in zip(done, prompts)):
            step = {}
            for i, p in enumerate(prompts):
                if done[i] < len(p):
                    n = len(p) - done[i] if chunk is None else min(chunk, len(p) - done[i])
                    step[i] = p[done[i]:done[i] + n]
                    done[i] += n
            for i, lg in self.step(step).items():
                results[i].append(lg)
        return [torch.cat(r) for r in results]
