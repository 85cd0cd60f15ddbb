"""Sampler: logit processing (penalties, logit bias, min_tokens), then temperature, top-k, top-p, min-p or
greedy; per-sequence generators for seeded requests.

Logit processing, in vLLM's order, before temperature and filtering (greedy rows take the argmax of the
processed logits):

- structured outputs: the grammar's mask (``TokenMasks``, ``engine/structured.py``) sends every token the
  row's grammar forbids to −inf;

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

``Sampler`` is a step's sampling on rank 0: one row per logit row (a speculative decode with k drafts has k + 1,
row j sampled as if its first j drafts were already generated), and the state sampling keeps between steps: the
penalised sequences' token counts, on the device (``PenaltyCounts``), and the default generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_runtime.engine.sequence import Sequence
from mla_runtime.sampling_params import SamplingParams


@dataclass
class TokenMasks:
    """The tokens constrained rows may sample: ``rows`` (logit rows) and ``bits [len(rows), ceil(V / 32)]`` int32,
    bit ``t % 32`` of word ``t // 32`` set when token t is allowed (llguidance's layout)."""

    rows: list[int]
    bits: torch.Tensor

    def allowed(self, vocab: int, device: torch.device) -> torch.Tensor:
        """``[len(rows), vocab]`` bool."""
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        bits = self.bits.to(device)
        return ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]


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


@dataclass
class Penalties:
    """The token counts the penalties read, for the rows that have penalties: ``rows [R]`` (logit rows),
    ``counts [R, V]`` float32 (generated-token counts) and ``seen [R, V]`` bool (in the prompt or generated)."""

    rows: torch.Tensor
    counts: torch.Tensor
    seen: torch.Tensor

    @classmethod
    def from_lists(cls, rows: list[int], outputs: list[list[int]], prompts: list[list[int]], vocab: int,
                   device: torch.device) -> Penalties:
        """Count the listed rows' tokens: one upload of all of them, one scatter each for counts and seen."""
        row_of_out = [r for r, out in enumerate(outputs) for _ in out]
        row_of_prompt = [r for r, ids in enumerate(prompts) for _ in ids]
        out_ids = torch.tensor([t for out in outputs for t in out], dtype=torch.long, device=device)
        prompt_ids = torch.tensor([t for ids in prompts for t in ids], dtype=torch.long, device=device)
        counts = torch.zeros(len(rows), vocab, device=device)
        counts.index_put_((torch.tensor(row_of_out, dtype=torch.long, device=device), out_ids),
                          torch.ones(len(out_ids), device=device), accumulate=True)
        seen = counts > 0
        seen[torch.tensor(row_of_prompt, dtype=torch.long, device=device), prompt_ids] = True
        return cls(torch.tensor(rows, dtype=torch.long, device=device), counts, seen)


def _column(params: list[SamplingParams], rows: list[int], name: str, device: torch.device) -> torch.Tensor:
    return torch.tensor([getattr(params[i], name) for i in rows], dtype=torch.float32, device=device)[:, None]


def _process(logits: torch.Tensor, params: list[SamplingParams], penalties: Penalties | None,
             suppress: list[list[int]] | None, masks: TokenMasks | None = None) -> torch.Tensor:
    """The logits after grammar masks, penalties, logit bias and min_tokens suppression (see the module
    docstring), each applied to all its rows at once; the input itself when no row asks for any of them."""
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    barred = [i for i in range(len(params)) if suppress and suppress[i]]
    if penalties is None and not biased and not barred and (masks is None or not masks.rows):
        return logits
    logits = logits.clone()
    dev = logits.device
    if masks is not None and masks.rows:
        rows_t = torch.tensor(masks.rows, dtype=torch.long, device=dev)
        logits[rows_t] = logits[rows_t].masked_fill(~masks.allowed(logits.shape[1], dev), float("-inf"))
    if penalties is not None:
        rows = penalties.rows.tolist()
        x = logits[penalties.rows]  # [R, V]
        rep = _column(params, rows, "repetition_penalty", dev)
        x = torch.where(penalties.seen, torch.where(x > 0, x / rep, x * rep), x)
        x -= _column(params, rows, "frequency_penalty", dev) * penalties.counts
        x -= _column(params, rows, "presence_penalty", dev) * (penalties.counts > 0).float()
        logits[penalties.rows] = x
    if biased:
        pairs = [(i, t, v) for i in biased for t, v in params[i].logit_bias.items()]  # type: ignore[union-attr]
        index = torch.tensor([(i, t) for i, t, _ in pairs], dtype=torch.long, device=dev).T
        logits.index_put_((index[0], index[1]), torch.tensor([v for *_, v in pairs], device=dev), accumulate=True)
    if barred:
        assert suppress is not None
        index = torch.tensor([(i, t) for i in barred for t in suppress[i]], dtype=torch.long, device=dev).T
        logits[index[0], index[1]] = float("-inf")
    return logits


def _draw(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
          default_generator: torch.Generator, drafts: list[int | None] | None, tokens: torch.Tensor) -> None:
    """Sample the random rows into ``tokens`` (in place); see ``sample``."""
    vocab = logits.shape[1]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return
    dev = logits.device
    idx = torch.tensor(random_rows, device=dev)
    top_k = torch.tensor([params[i].top_k if params[i].top_k > 0 else vocab for i in random_rows], device=dev)
    scaled = _filter(logits[idx] / _column(params, random_rows, "temperature", dev), top_k,
                     _column(params, random_rows, "top_p", dev)[:, 0], _column(params, random_rows, "min_p", dev)[:, 0])
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    draft_rows = [r for r, i in enumerate(random_rows) if drafts is not None and drafts[i] is not None]
    uniform = torch.empty(len(draft_rows), device=dev)
    for k, r in enumerate(draft_rows):  # one draw per row, from the row's own generator (seeded requests)
        uniform[k:k + 1].uniform_(generator=generators[random_rows[r]] or default_generator)
    for r, i in enumerate(random_rows):
        noise[r].exponential_(generator=generators[i] or default_generator)
    if draft_rows:
        assert drafts is not None
        rows_t = torch.tensor(draft_rows, device=dev)
        draft_t = torch.tensor([drafts[random_rows[r]] for r in draft_rows], device=dev)
        accept = uniform < probs[rows_t, draft_t]  # accept the draft x with probability p(x)
        probs[rows_t, draft_t] = 0.0  # rejected: a draw from the rest of p (the race renormalises)
    tokens[idx] = (probs / noise).argmax(dim=-1)
    if draft_rows:
        tokens[idx[rows_t]] = torch.where(accept, draft_t, tokens[idx[rows_t]])


def _logprobs(raw: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor
              ) -> list[dict[int, float] | None]:
    """Each asking row's sampled token and its top-k, with the model's own (unprocessed) log-probabilities."""
    out: list[dict[int, float] | None] = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return out
    lp = raw[want].log_softmax(dim=-1)
    chosen = lp.gather(1, tokens[want][:, None])[:, 0].tolist()
    k_max = min(max(params[i].logprobs or 0 for i in want), raw.shape[1])
    top = lp.topk(k_max) if k_max else None
    top_ids = top.indices.tolist() if top is not None else []
    top_vals = top.values.tolist() if top is not None else []
    picked = tokens[want].tolist()
    for row, i in enumerate(want):
        entry = {picked[row]: chosen[row]}
        k = params[i].logprobs or 0
        if k:
            entry.update(zip(top_ids[row][:k], top_vals[row][:k]))
        out[i] = entry
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator, outputs: list[list[int]] | None = None,
           prompts: list[list[int]] | None = None, suppress: list[list[int]] | None = None,
           drafts: list[int | None] | None = None, penalties: Penalties | None = None,
           masks: TokenMasks | None = None) -> SampleResult:
    """``logits [B, V]`` fp32, one row per sequence to sample; ``penalties``: the token counts of the rows with
    penalties (else counted here from ``outputs`` / ``prompts``, each row's generated and prompt tokens);
    ``suppress``: token ids each row may not sample now; ``drafts``: a speculative draft token proposed at the
    row, or None; ``masks``: the tokens the constrained rows' grammars allow.

    A row with a draft returns the draft when it is accepted and another token otherwise. Greedy rows accept
    it when it is the argmax. Random rows follow speculative sampling for a deterministic proposal: accept
    the draft ``x`` with probability ``p(x)`` (``p`` the row's distribution after temperature and
    filtering), else draw from ``p`` with ``x`` removed — so every emitted token is distributed as ``p``."""
    penalised = [i for i, p in enumerate(params) if p.penalised]
    if penalties is None and penalised:
        penalties = Penalties.from_lists(penalised, [(outputs or [[]] * len(params))[i] for i in penalised],
                                         [(prompts or [[]] * len(params))[i] for i in penalised],
                                         logits.shape[1], logits.device)
    processed = _process(logits, params, penalties if penalised else None, suppress, masks)
    # the first largest entry, as argmax gives it; torch's CPU max along a row is about 3x faster (32 rows of 32,000)
    tokens = processed.max(dim=-1).indices
    _draw(processed, params, generators, default_generator, drafts, tokens)
    return SampleResult(tokens.tolist(), _logprobs(logits, params, tokens))


@dataclass(frozen=True)
class Sampled:
    """What one step gives a sequence: its new tokens, in order, and their log-probability entries."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


@dataclass
class PenaltyCounts:
    """One penalised sequence's tokens, kept on the device: ``counts [V]`` of its generated tokens and ``seen [V]``
    (in the prompt or generated); ``catch_up`` adds the tokens generated since the last step."""

    seq: Sequence
    counts: torch.Tensor
    seen: torch.Tensor
    num_counted: int = 0

    @classmethod
    def new(cls, seq: Sequence, vocab: int, device: torch.device) -> PenaltyCounts:
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


class Sampler:
    """A step's sampling (see the module docstring); the penalised sequences' counts are kept by seq_id and
    dropped once their sequence has finished."""

    def __init__(self, eos_token_ids: list[int], device: torch.device, seed: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.counts: dict[int, PenaltyCounts] = {}

    def sample_step(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[tuple[int, ...]],
                    masks: TokenMasks | None = None) -> tuple[list[Sampled], dict[int, int]]:
        """``logits``: the rows of ``seqs``, k + 1 for a sequence with k ``drafts`` to verify. Returns what each
        sequence gains — its drafts while the sampler returns them (accepted), then the sampler's token after them
        — and the number of accepted drafts by seq_id, for the sequences that had any."""
        params, gens, suppress, row_drafts = [], [], [], []
        for seq, more in zip(seqs, drafts):
            for j in range(len(more) + 1):
                params.append(seq.params)
                gens.append(seq.generator)
                # a grammar decides alone when its output may end: min_tokens would contradict it
                suppress.append([] if seq.grammar else self._stop_tokens(seq.params, len(seq.output_token_ids) + j))
                row_drafts.append(more[j] if j < len(more) else None)
        result = sample(logits, params, gens, self.generator, suppress=suppress, drafts=row_drafts,
                        penalties=self._penalties(seqs, drafts, logits.shape[1]), masks=masks)
        sampled, accepted, first_row = [], {}, 0
        for seq, more in zip(seqs, drafts):
            k = len(more)
            tokens, lps = result.token_ids[first_row:first_row + k + 1], result.logprobs[first_row:first_row + k + 1]
            first_row += k + 1
            a = 0
            while a < k and more[a] == tokens[a]:  # the sampler returned the draft: accepted
                a += 1
            if k:
                accepted[seq.seq_id] = a
            sampled.append(Sampled(seq, tokens[:a + 1], lps[:a + 1]))
        return sampled, accepted

    def _penalties(self, seqs: list[Sequence], drafts: list[tuple[int, ...]], vocab: int) -> Penalties | None:
        """The token counts of the step's penalised rows, from the counts kept per sequence (each generated token is
        added once); row j of a speculative decode also counts its first j drafts."""
        for seq_id in [i for i, c in self.counts.items() if c.seq.is_finished]:
            del self.counts[seq_id]
        rows: list[tuple[int, PenaltyCounts]] = []
        drafted_rows: list[int] = []
        drafted_ids: list[int] = []
        row = 0
        for seq, more in zip(seqs, drafts):
            if seq.params.penalised:
                kept = self.counts.get(seq.seq_id) or self.counts.setdefault(
                    seq.seq_id, PenaltyCounts.new(seq, vocab, self.device))
                kept.catch_up()
                for j in range(len(more) + 1):
                    drafted_rows += [len(rows)] * j
                    drafted_ids += more[:j]
                    rows.append((row + j, kept))
            row += len(more) + 1
        if not rows:
            return None
        dev = self.device
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
