"""Sampler: logit processing (penalties, logit bias, min_tokens), then temperature, top-k, top-p, min-p or
greedy; per-sequence generators for seeded requests.

Logit processing, in vLLM's order, before temperature and filtering (greedy rows take the argmax of the
processed logits):

- ``repetition_penalty`` r (tokens of the prompt *or* the output): a positive logit is divided by r, a
  negative one multiplied by it;
- presence / frequency penalties (OpenAI's definition, generated tokens only):
  ``logit -= frequency_penalty · count + presence_penalty · [count > 0]``;
- ``logit_bias``: added to the named tokens' logits;
- ``min_tokens``: until a row has generated that many tokens, its stop tokens (EOS unless ``ignore_eos``, and
  ``stop_token_ids``) get −inf — the caller passes them as ``suppress``.

Returned log-probabilities are those of the model's own logits (unprocessed, untempered), as vLLM returns
by default.

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


def _process(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]] | None,
             prompts: list[list[int]] | None, suppress: list[list[int]] | None) -> torch.Tensor:
    """The logits after penalties, logit bias and min_tokens suppression (see the module docstring); the
    input itself when no row asks for any of them."""
    vocab = logits.shape[1]
    rows = [i for i, p in enumerate(params) if p.penalised or p.logit_bias or (suppress and suppress[i])]
    if not rows:
        return logits
    logits = logits.clone()
    device = logits.device
    for i in rows:
        p, out = params[i], (outputs[i] if outputs is not None else [])
        row = logits[i]
        if p.repetition_penalty != 1:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            for ids in (prompts[i] if prompts is not None else [], out):
                if ids:
                    seen[torch.tensor(ids, device=device)] = True
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, scaled, row))
        if (p.presence_penalty or p.frequency_penalty) and out:
            counts = torch.bincount(torch.tensor(out, device=device), minlength=vocab)[:vocab].to(logits.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=device)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=device))
        if suppress and suppress[i]:
            row[torch.tensor(suppress[i], device=device)] = float("-inf")
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator, outputs: list[list[int]] | None = None,
           prompts: list[list[int]] | None = None, suppress: list[list[int]] | None = None,
           drafts: list[int | None] | None = None) -> SampleResult:
    """``logits [B, V]`` fp32, one row per sequence to sample; ``outputs`` / ``prompts``: each row's generated
    and prompt tokens (needed by the penalties); ``suppress``: token ids each row may not sample now;
    ``drafts``: a speculative draft token proposed at the row, or None.

    A row with a draft returns the draft when it is accepted and another token otherwise. Greedy rows accept
    it when it is the argmax. Random rows follow speculative sampling for a deterministic proposal: accept
    the draft ``x`` with probability ``p(x)`` (``p`` the row's distribution after temperature and
    filtering), else draw from ``p`` with ``x`` removed — so every emitted token is distributed as ``p``."""
    num_rows, vocab = logits.shape
    raw = logits
    logits = _process(logits, params, outputs, prompts, suppress)
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
        noise = torch.ones_like(probs)
        accepted: list[tuple[int, int]] = []
        for row, i in enumerate(random_rows):
            gen = generators[i] or default_generator
            draft = drafts[i] if drafts is not None else None
            if draft is not None:
                if float(torch.rand((), generator=gen, device=probs.device)) < float(probs[row, draft]):
                    accepted.append((i, draft))
                    continue
                probs[row, draft] = 0.0  # rejected: the rest of p, renormalised by the race below
            noise[row].exponential_(generator=gen)
        tokens[idx] = (probs / noise).argmax(dim=-1)
        for i, draft in accepted:
            tokens[i] = draft

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
