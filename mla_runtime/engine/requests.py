"""Requests in and out of the engine: validating and tokenising a prompt (input), and turning sampled tokens
into text, stop decisions and ``RequestOutput``s (output).

Both sides are plain functions over a ``RequestState``; the engine calls them, the scheduler never sees them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mla_runtime.config import ModelConfig
from mla_runtime.engine.sequence import Sequence
from mla_runtime.engine.structured import GrammarCompiler
from mla_runtime.errors import InvalidParam
from mla_runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mla_runtime.sampling_params import SamplingParams
from mla_runtime.tokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class Tokenized:
    """A prompt its caller (the server) tokenized already: its text (None: given as token ids) and its ids. ``vocab``:
    the vocabulary size the ids were checked against (``check_token_ids``; 0: not checked), so that the engine does
    not check them a second time."""

    text: str | None
    ids: list[int]
    vocab: int = 0


PromptType = str | dict[str, Any] | list[int] | Tokenized


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    texts: list[str]
    metrics: RequestMetrics
    finished: bool = False


# -- input ---------------------------------------------------------------------------------------
def tokenize(tokenizer: Any, prompt: PromptType) -> tuple[str | None, list[int]]:
    """``(text, token ids)`` of a prompt given as text, token ids, ``{"prompt" | "prompt_token_ids": ...}`` or
    ``Tokenized``."""
    if isinstance(prompt, Tokenized):
        return prompt.text, prompt.ids
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" not in prompt:
            raise InvalidParam("prompt", "prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        prompt = prompt["prompt"]
    if isinstance(prompt, list):
        return None, list(prompt)
    if not isinstance(prompt, str):
        raise InvalidParam("prompt", f"prompt must be a string, a token-id list or a dict, got {type(prompt).__name__}")
    if tokenizer is None:
        raise InvalidParam("prompt", "prompt: this checkpoint has no tokenizer files; pass {'prompt_token_ids': [...]}")
    return prompt, tokenizer.encode(prompt)


def check_token_ids(ids: list[int], vocab: int, field: str = "prompt_token_ids") -> None:
    """Token ids outside the vocabulary ``[0, vocab)`` are refused, naming ``field``, the field that carried them."""
    if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
        raise InvalidParam(field, f"{field}: token ids must be integers in [0, {vocab})")


def check_request(ids: list[int], params: SamplingParams, vocab: int, max_model_len: int,
                  ids_checked: bool = False) -> None:
    """Reject what the model cannot run: an empty or too long prompt, token ids outside the vocabulary (unless the
    caller checked them: ``ids_checked``)."""
    if not ids:
        raise InvalidParam("prompt", "prompt is empty")
    if not ids_checked:
        check_token_ids(ids, vocab)
    bad_bias = [t for t in params.logit_bias or {} if t >= vocab]
    if bad_bias:
        raise InvalidParam("logit_bias", f"logit_bias names token {bad_bias[0]}, outside the vocabulary [0, {vocab})")
    if any(t >= vocab for t in params.stop_token_ids or []):
        raise InvalidParam("stop_token_ids", f"stop_token_ids must be token ids in [0, {vocab})")
    if len(ids) >= max_model_len:
        raise InvalidParam("prompt", f"prompt has {len(ids)} tokens, but max_model_len is {max_model_len}: the prompt "
                                     f"must be shorter to leave room for output")


def new_request(request_id: str, text: str | None, ids: list[int], params: SamplingParams, tokenizer: Any,
                seq_ids: Iterator[int], device: torch.device, arrival_time: float | None,
                compiler: GrammarCompiler | None = None) -> RequestState:
    """The state of a checked request: one ``Sequence`` per sample (samples 2..n share sample 1's prefix);
    ``compiler`` gives each sample its grammar state when the request has a structured-outputs constraint (held
    back until its ``after_token`` where it has one)."""
    now = arrival_time if arrival_time is not None else time.monotonic()
    spec = params.structured_outputs
    grammars = [compiler.new_state(spec) for _ in range(params.n)] if spec is not None and compiler else None
    later = spec is not None and spec.after_token is not None
    seqs = []
    for i in range(params.n):
        gen = None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed + i)
        grammar = grammars[i] if grammars else None
        seqs.append(Sequence(seq_id=next(seq_ids), request_id=request_id, index=i, prompt_token_ids=ids,
                             params=params, arrival_time=now, generator=gen, grammar=None if later else grammar,
                             pending_grammar=grammar if later else None))
    for s in seqs[1:]:
        s.share_prefix_with = seqs[0]
    return RequestState(request_id, text, ids, params, seqs, [IncrementalDetokenizer(tokenizer, ids) for _ in seqs],
                        ["" for _ in seqs], RequestMetrics(arrival_time=now))


# -- output --------------------------------------------------------------------------------------
def append_token(state: RequestState, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float,
                 cfg: ModelConfig, max_model_len: int, finish: Callable[[Sequence, str], None]) -> None:
    """Append one sampled token: timing, incremental text, then EOS / stop ids / stop strings / ``max_tokens`` /
    ``max_model_len`` (``finish(seq, reason)`` ends the sequence)."""
    params = seq.params
    seq.append_token(token)
    if seq.grammar is not None:
        seq.grammar.accept(token)
    elif seq.pending_grammar is not None and params.structured_outputs is not None and \
            token == params.structured_outputs.after_token:  # the constraint holds from the next token
        seq.grammar, seq.pending_grammar = seq.pending_grammar, None
    if logprobs is not None:
        seq.output_logprobs.append(logprobs)
    seq.token_times.append(now)
    if seq.first_token_time is None:
        seq.first_token_time = now
    if state.metrics.first_token_time is None:
        state.metrics.first_token_time = now
    if seq.index == 0:
        state.metrics.token_times.append(now)
    if len(seq.output_token_ids) == params.min_tokens:  # the first token that may stop the sequence
        seq.stop_text_from = len(state.texts[seq.index])
    detok = state.detoks[seq.index]
    detok.add(token)
    text, reason = _stop(seq, detok.text, token, cfg)
    state.texts[seq.index] = text
    if reason is None and seq.grammar is not None and seq.grammar.finished:
        reason = "stop"  # the constrained output is complete: only EOS could follow
    if reason is None and (len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= max_model_len):
        reason = "length"
    if reason is not None:
        finish(seq, reason)


def _stop(seq: Sequence, text: str, token: int, cfg: ModelConfig) -> tuple[str, str | None]:
    """The text after a stop string is cut, and ``"stop"`` when the token or a stop string ends the sequence."""
    params = seq.params
    if len(seq.output_token_ids) < params.min_tokens:
        return text, None  # stop tokens cannot be sampled yet (the sampler suppresses them); stop strings wait
    if (not params.ignore_eos and token in cfg.eos_token_ids) or token in (params.stop_token_ids or ()):
        return text, "stop"
    if params.stop_strings:  # a stop string must end after the first min_tokens - 1 tokens
        found = (text.find(s, max(0, seq.stop_text_from - len(s) + 1)) for s in params.stop_strings)
        cut = min((i for i in found if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut], "stop"
    return text, None


def record_sampled(requests: dict[str, RequestState], sampled: Iterable[Any], cfg: ModelConfig, max_model_len: int,
                   finish: Callable[[Sequence, str], None], counts: Any) -> list[RequestState]:
    """A step's sampled tokens (each with its sequence, tokens and log-probs) appended to their requests; a request
    whose every sequence finished is done and leaves ``requests``. The requests the step touched, in order."""
    now = time.monotonic()
    touched: dict[str, RequestState] = {}
    for new in sampled:
        state = requests.get(new.seq.request_id)
        if state is None:  # aborted meanwhile
            continue
        for token, lp in zip(new.token_ids, new.logprobs):
            if new.seq.is_finished:  # a stop among a speculative step's tokens drops the rest
                break
            append_token(state, new.seq, token, lp, now, cfg, max_model_len, finish)
            counts.generation += 1
            touched[state.request_id] = state
    for state in touched.values():
        if all(s.is_finished for s in state.seqs):
            state.finished = True
            state.metrics.finished_time = now
            del requests[state.request_id]
    return list(touched.values())


def make_output(state: RequestState) -> RequestOutput:
    """A ``RequestOutput`` of everything the request has so far (texts and tokens are cumulative)."""
    outs = [CompletionOutput(index=s.index, text=state.texts[s.index], token_ids=list(s.output_token_ids),
                             finish_reason=s.finish_reason,
                             logprobs=list(s.output_logprobs) if s.params.logprobs is not None else None)
            for s in state.seqs]
    cached = state.seqs[0].num_cached_prompt_tokens if state.seqs else 0
    return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs, state.finished,
                         state.metrics, cached)
