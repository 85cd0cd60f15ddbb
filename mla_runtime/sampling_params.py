"""``SamplingParams``: how to pick each next token, validated when built (vLLM's names and defaults)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from mla_runtime.errors import InvalidParam

MAX_REPETITION_PENALTY = 2.0


TOP_K_ALL = 2**31 - 1  # a top_k above it keeps every token, as -1 does


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output, vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a JSON schema, as a
    dict or its text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings) or
    ``grammar`` (Lark, or llama.cpp's GBNF). ``param`` names the request field it came from, for errors.
    ``after_token``: the constraint holds from the token after this one (a reasoning model's end-of-thinking token:
    the thinking before it is free); None: from the first token."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    param: str = field(default="structured_outputs", compare=False)
    after_token: int | None = None

    def __post_init__(self) -> None:
        if self.after_token is not None and (not isinstance(self.after_token, int) or self.after_token < 0):
            raise InvalidParam(self.param, f"{self.param}: after_token must be a token id, got {self.after_token!r}")
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidParam(self.param, f"{self.param}: give exactly one of json, json_object, regex, choice or "
                                           f"grammar, got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidParam(self.param, f"{self.param}: json must be a JSON schema (an object or its text)")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) for c in self.choice)):
            raise InvalidParam(self.param, f"{self.param}: choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParam(self.param, f"{self.param}: {name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A hash of the constraint (its kind and canonical text): the compiled-grammar cache key."""
        value = getattr(self, self.kind)
        text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
        return hashlib.sha256(f"{self.kind}\0{text}".encode()).hexdigest()


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of a token already generated
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and generated tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # tokens generated before EOS, stop_token_ids or stop strings can end the sequence
    structured_outputs: StructuredOutputs | None = None  # constrained decoding (engine/structured.py)
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidParam:
            return InvalidParam(name, f"{name} {why}, got {getattr(self, name)!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if isinstance(getattr(self, name), float) and not math.isfinite(getattr(self, name)):
                raise bad(name, "must be a finite number")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "must be -1 (disabled) or an integer >= 1")
        if self.top_k > TOP_K_ALL:  # more than any vocabulary: every token (the kernels index with int32/int64)
            object.__setattr__(self, "top_k", -1)
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "must be an integer or None")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:  # torch seeds are 64-bit
            raise bad("seed", "must be a 64-bit signed integer, in [-2**63, 2**63)")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be None or an integer >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not -2 <= value <= 2:
                raise bad(name, "must be a number in [-2, 2]")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 < r <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"must be a number in (0, {MAX_REPETITION_PENALTY:g}]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict of token id -> bias")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise InvalidParam("logit_bias", f"logit_bias keys must be non-negative token ids, got {t!r}")
                if not isinstance(b, (int, float)) or isinstance(b, bool) or not -100 <= b <= 100:
                    raise InvalidParam("logit_bias",
                                       f"logit_bias of token {t} must be a number in [-100, 100], got {b!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise bad("structured_outputs", "must be a StructuredOutputs")
        object.__setattr__(self, "stop_strings", tuple(stops))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
