"""HTTP request schemas, the JSON error shape, and request → ``SamplingParams``.

Types are strict (``"5"`` is not an integer, ``true`` is not a number) so a wrongly typed field is a 422
naming it instead of a silent coercion. Our own ``/generate`` rejects unknown fields (a typo such as
``max_length`` must not be ignored); the OpenAI routes ignore fields they do not use, as OpenAI clients
send extras, but reject the ones whose meaning they cannot honour (log-probabilities of the prompt, i.e.
``logprobs`` with ``echo``). Log-probabilities of generated tokens are returned in
OpenAI's shapes: ``logprobs: k`` on completions, ``logprobs: true`` (+ ``top_logprobs: k``) on chat,
``k <= MAX_LOGPROBS``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mla_runtime.errors import InvalidParam
from mla_runtime.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # most alternatives per generated token a request may ask for

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}


class ApiError(Exception):
    """An HTTP error answered as ``{"error": {"message", "type", "code", "param"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "code": self.status, "param": self.param}}


UNION_MESSAGES = {"prompt": "must be a string or a list of token ids (integers)",
                  "stop": "must be a string or a list of strings",
                  "content": "must be a string or a list of text parts"}
_TYPE_TAG = re.compile(r"str|int|float|bool|none|(list|dict|function-\w+|constrained-\w+)\[.*\]")


def validation_error(e: ValidationError) -> ApiError:
    """pydantic's first error → a 422 whose message starts with the field's dotted path."""
    err = e.errors()[0]
    parts = [str(p) for p in err["loc"]]
    names = [p for p in parts if not _TYPE_TAG.fullmatch(p)]  # drop the union member tags
    loc = ".".join(names) or "body"
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    elif len(names) < len(parts) and names and names[-1] in UNION_MESSAGES:
        msg = UNION_MESSAGES[names[-1]]
    elif err["type"] == "model_type" and not names:
        msg = "the request body must be a JSON object"
    return ApiError(422, f"{loc}: {msg}", param=loc)


Prompt = str | list[int]
Stop = str | list[str] | None


class SamplingFields(BaseModel):
    model_config = ConfigDict(strict=True)

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = None
    stop: Stop = None
    n: int = Field(default=1, ge=1, le=16)
    ignore_eos: bool = False
    stream: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # OpenAI's shape: token ids as strings
    min_tokens: int = Field(default=0, ge=0)

    def logprobs_count(self) -> int | None:
        """Alternatives per generated token to return (None: no log-probabilities)."""
        return None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_k == 0:
            raise ApiError(422, "top_k: must be -1 (disabled) or an integer >= 1", param="top_k")
        bias = None
        if self.logit_bias:
            try:
                bias = {int(t): b for t, b in self.logit_bias.items()}
            except ValueError:
                raise ApiError(400, "logit_bias: keys must be token ids (integers written as strings)",
                               param="logit_bias") from None
        try:
            return SamplingParams(n=self.n, max_tokens=self.max_tokens or default_max_tokens,
                                  temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                                  stop=self.stop, ignore_eos=self.ignore_eos, logprobs=self.logprobs_count(),
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  repetition_penalty=self.repetition_penalty, logit_bias=bias,
                                  min_tokens=self.min_tokens)
        except InvalidParam as e:  # SamplingParams names the field
            raise ApiError(400, str(e), param=e.param) from e


class GenerateRequest(SamplingFields):
    """``POST /generate``: our own minimal API."""

    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: Prompt
    max_tokens: int = Field(default=16, ge=1)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class OpenAIFields(SamplingFields):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None

    def check_unsupported(self) -> None:
        """Refuse fields whose meaning this server cannot honour (400 naming the field)."""


class CompletionRequest(OpenAIFields):
    prompt: Prompt | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def prompt_list(self) -> list[str | list[int]]:
        """The request's prompts: one, or OpenAI's batch form (a list of strings or of token-id lists)."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs is not None and self.echo:
            raise ApiError(400, "logprobs: log-probabilities of the prompt (logprobs with echo) are not supported",
                           param="logprobs")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]

    def text(self, index: int) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages.{index}.content: only text parts are supported",
                               param=f"messages.{index}.content")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(OpenAIFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
