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
in the batch. A draw inverts the row's cumulative distribution (summed in float64, by blocks of tokens and then
within one) at one uniform number: one random number a row, where drawing one per vocabulary entry (the
exponential race, ``argmax(p / E)``) cost 1.5 ms a row at DeepSeek's 102,400 tokens on a 2-core EPYC.

Top-k, top-p and min-p each keep a row's most likely tokens down to a cut. The cut is looked for among the row's
largest logits: its top_k where it sets one, else the ``FILTER_CANDIDATES`` largest, then 16 times as many where
the cut lies beyond them, and the whole row is sorted only where it lies beyond those too; rows that filter nothing
are not touched. (Sorting 102,400 logits takes 6.6 ms a row there, against 0.4 ms for the 1,024 largest.)

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


FILTER_CANDIDATES = 1024  # the largest logits of a row a cut of top-k / top-p / min-p is looked for among first


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p / min-p exclude. ``logits [B, V]`` already temperature-scaled; ``top_k``
    (``V`` for none), ``top_p`` and ``min_p`` ``[B]``. A row keeps its tokens by decreasing logit while fewer than
    top_k come before, the probability mass before is below top_p, and the probability is at least min_p times the
    largest (the first always); rows that set none of them come back as they are (see the module docstring)."""
    vocab = logits.shape[-1]
    rows = ((top_k < vocab) | (top_p < 1) | (min_p > 0)).nonzero().squeeze(1)
    if not rows.numel():
        return logits
    every = rows.numel() == logits.shape[0]
    x = logits if every else logits[rows]
    top_k, top_p, min_p = top_k[rows], top_p[rows], min_p[rows]
    # probabilities over the whole row, whatever part of it is sorted (top-k alone needs none)
    probs = x.softmax(dim=-1) if bool(((top_p < 1) | (min_p > 0)).any()) else None
    kept = torch.full_like(x, float("-inf"))
    # a row with a top_k needs no more candidates than that; the others FILTER_CANDIDATES, then 16 times as many
    need = torch.where(top_k < vocab, top_k, FILTER_CANDIDATES)
    counts = [min(int(need.max()), vocab)]
    counts += [c for c in (16 * FILTER_CANDIDATES, vocab) if counts[-1] < c <= vocab]
    # a pass cannot find a row's cut where count tokens of at most its largest probability hold less than top_p
    most = None if probs is None else probs.max(dim=-1).values
    left = torch.arange(x.shape[0], device=x.device)
    for count in counts:
        k, p, m = top_k[left], top_p[left], min_p[left]
        partial = count < vocab
        if partial and most is not None:
            hopeless = (k > count) & (m <= 0) & ((p >= 1) | (count * most[left] < p))
            if bool(hopeless.all()):
                continue  # no row left can find its cut here: on to the next
        whole = left.numel() == x.shape[0]
        sub = x if whole else x[left]
        order = sub.topk(count, dim=-1).indices if partial else sub.sort(dim=-1, descending=True).indices
        first = None if probs is None else (probs if whole else probs[left]).gather(1, order)
        # the cut falls among the candidates where a row's top_k, its mass or its min_p is reached there; the whole
        # row holds every cut (a top_k beyond the vocabulary included)
        inside = k <= count if partial else torch.ones_like(k, dtype=torch.bool)
        if first is not None and partial:
            inside |= ((p < 1) & (first.sum(dim=-1) >= p)) | (first[:, -1] < m * first[:, 0])
        done = inside.nonzero().squeeze(1)
        _keep(kept, x, left[done], order[done], None if first is None else first[done], k[done], p[done], m[done])
        left = left[~inside]
        if not left.numel():
            break
    if every:
        return kept
    out = logits.clone()
    out[rows] = kept
    return out


def _keep(kept: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, order: torch.Tensor, probs: torch.Tensor | None,
          top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> None:
    """``_filter``'s cut of ``rows`` from their largest logits (token ids ``order [n, c]``, by decreasing logit, and
    their probabilities over the whole row ``probs``, None where no row has a top_p or a min_p): the logits ``x`` of
    the tokens kept, copied into ``kept``."""
    rank = torch.arange(order.shape[-1], device=order.device).unsqueeze(0)
    drop = rank >= top_k.unsqueeze(1)
    if probs is not None:
        before = probs.double().cumsum(dim=-1) - probs  # the mass before each token, summed in float64
        drop |= (before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        drop |= probs < min_p.unsqueeze(1) * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    keep = ~drop
    r, t = rows.unsqueeze(1).expand_as(order)[keep], order[keep]
    kept[r, t] = x[r, t]


DRAW_BLOCK = 256  # a draw finds its block of tokens by the blocks' summed mass, then its token within the block


def _inverse_cdf(probs: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The token of each row of ``probs [R, V]`` (non-negative, any total) where its cumulative mass passes ``at
    [R, 1]`` (float64 in [0, 1)) times the total -> ``[R]``; never a token of probability 0. In two levels: the
    blocks of ``DRAW_BLOCK`` tokens by their sums, then the tokens of the one block, each cumulative sum in float64
    (a whole row's cumulative sum costs 40x more at 8 rows of 102,400)."""
    rows, vocab = probs.shape
    pad = (-vocab) % DRAW_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(rows, -1, DRAW_BLOCK)
    mass = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [R, blocks]
    zero = torch.zeros_like(at)
    # a target below the total, so the first block (then token) whose cumulative sum passes it adds mass
    target = torch.minimum(at * mass[:, -1:], torch.nextafter(mass[:, -1:], zero))
    # (the clamps only act on a row that is not a distribution: a NaN or infinite logit gives some token, no error)
    block = torch.searchsorted(mass, target, right=True).clamp_(max=mass.shape[1] - 1)
    before = torch.where(block > 0, mass.gather(1, (block - 1).clamp(min=0)), zero)
    inner = blocks[torch.arange(rows, device=probs.device), block.squeeze(1)].double().cumsum(dim=-1)
    within = torch.minimum(target - before, torch.nextafter(inner[:, -1:], zero))
    token = block * DRAW_BLOCK + torch.searchsorted(inner, within, right=True).clamp_(max=DRAW_BLOCK - 1)
    return token.squeeze(1).clamp_(max=vocab - 1)


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
    rows = logits if len(random_rows) == logits.shape[0] else logits[idx]
    scaled = _filter(rows / _column(params, random_rows, "temperature", dev), top_k,
                     _column(params, random_rows, "top_p", dev)[:, 0], _column(params, random_rows, "min_p", dev)[:, 0])
    probs = scaled.softmax(dim=-1)
    draft_rows = [r for r, i in enumerate(random_rows) if drafts is not None and drafts[i] is not None]
    uniform = torch.empty(len(draft_rows), device=dev)
    for k, r in enumerate(draft_rows):  # one draw per row, from the row's own generator (seeded requests)
        uniform[k:k + 1].uniform_(generator=generators[random_rows[r]] or default_generator)
    if draft_rows:
        assert drafts is not None
        rows_t = torch.tensor(draft_rows, device=dev)
        draft_t = torch.tensor([drafts[random_rows[r]] for r in draft_rows], device=dev)
        accept = uniform < probs[rows_t, draft_t]  # accept the draft x with probability p(x)
        probs[rows_t, draft_t] = 0.0  # rejected: a draw from the rest of p, renormalised
    at = torch.empty(len(random_rows), 1, dtype=torch.float64, device=dev)
    for r, i in enumerate(random_rows):
        at[r].uniform_(generator=generators[i] or default_generator)
    tokens[idx] = _inverse_cdf(probs, at)
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
