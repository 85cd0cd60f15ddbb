"""Sampler: presence/frequency penalties, temperature, top-k, top-p, min-p, greedy; per-sequence generators
for seeded requests.

Penalties (OpenAI's definition) lower the logit of each token already *generated* by the sequence:
``logit -= frequency_penalty · count + presence_penalty · [count > 0]``, before temperature and filtering;
greedy rows take the argmax of the penalised logits. Returned log-probabilities are those of the model's
own logits (unpenalised, untempered), as vLLM returns by default.

A seeded sequence draws from its own ``torch.Generator``, so its tokens do not depend on what else is
in the batch. Draws use the exponential-race form of categorical sampling
(``argmax(p / E)``, ``E ~ Exp(1)``), which needs one random number per vocabulary entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_runtime.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p / min-p exclude. ``logits [B, V]`` already temperature-scaled."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    drop = rank >= top_k.unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop |= before >= top_p.unsqueeze(1)
    drop |= probs < min_p.unsqueeze(1) * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _penalise(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]] | None) -> torch.Tensor:
    rows = [i for i, p in enumerate(params) if p.penalised and outputs is not None and outputs[i]]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        counts = torch.bincount(torch.tensor(outputs[i], device=logits.device), minlength=logits.shape[1])
        counts = counts[: logits.shape[1]].to(logits.dtype)
        logits[i] -= params[i].frequency_penalty * counts + params[i].presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator, outputs: list[list[int]] | None = None) -> SampleResult:
    """``logits [B, V]`` fp32, one row per sequence to sample; ``outputs``: each row's generated tokens so far
    (needed by presence/frequency penalties)."""
    num_rows, vocab = logits.shape
    raw = logits
    logits = _penalise(logits, params, outputs)
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        temp = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
        top_k = torch.tensor([params[i].top_k if params[i].top_k > 0 else vocab for i in random_rows],
                             device=logits.device)
        top_p = torch.tensor([params[i].top_p for i in random_rows], device=logits.device)
        min_p = torch.tensor([params[i].min_p for i in random_rows], device=logits.device)
        scaled = _filter(logits[idx] / temp.unsqueeze(1), top_k, top_p, min_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for row, i in enumerate(random_rows):
            noise[row].exponential_(generator=generators[i] or default_generator)
        tokens[idx] = (probs / noise).argmax(dim=-1)

    logprobs: list[dict[int, float] | None] = [None] * num_rows
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        lp = raw[want].log_softmax(dim=-1)
        for row, i in enumerate(want):
            k = params[i].logprobs or 0
            entry = {int(tokens[i]): float(lp[row, tokens[i]])}
            if k:
                top = lp[row].topk(min(k, vocab))
                entry.update({int(t): float(v) for t, v in zip(top.indices, top.values)})
            logprobs[i] = entry
    return SampleResult(tokens.tolist(), logprobs)
