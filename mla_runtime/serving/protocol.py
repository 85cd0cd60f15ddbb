"""HTTP request schemas, the JSON error shape, and request → ``SamplingParams``.

Types are strict (``"5"`` is not an integer, ``true`` is not a number) so a wrongly typed field is a 400
naming it (``param``) instead of a silent coercion, as OpenAI answers validation errors. Our own ``/generate``
rejects unknown fields (a misspelt limit must not be ignored); the OpenAI routes ignore fields
they do not use, as OpenAI clients send extras (``store``, ``metadata``, ``service_tier`` ...), but reject
with 400 the ones whose meaning they cannot honour (``UNSUPPORTED``; log-probabilities of the prompt, i.e.
``logprobs`` with ``echo``). Log-probabilities of generated tokens are returned in OpenAI's shapes:
``logprobs: k`` on completions, ``logprobs: true`` (+ ``top_logprobs: k``) on chat, ``k <= MAX_LOGPROBS``.

Structured outputs (``engine/structured.py``): OpenAI's ``response_format`` (``json_object``, ``json_schema``)
on the OpenAI routes, and vLLM's ``structured_outputs: {json | regex | choice | grammar}`` or
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` on every route; a request gives at
most one constraint. Tool calls (``tools``, ``tool_choice``) are in ``tools.py``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mla_runtime.errors import InvalidParam
from mla_runtime.sampling_params import SamplingParams, StructuredOutputs
from mla_runtime.serving.tools import ToolMode, required_schema, string_parameters

MAX_LOGPROBS = 20  # most alternatives per generated token a request may ask for
# a top_k this large keeps every token (no vocabulary is larger), as -1 does; the sampler holds top_k in an int64
TOP_K_ALL = 2**31

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}
# OpenAI's ``error.code`` is a string or null: a short machine-readable reason per status
ERROR_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
               413: "request_too_large", 429: "rate_limit_exceeded", 500: "internal_error",
               503: "service_unavailable", 504: "timeout"}


class ApiError(Exception):
    """An HTTP error answered as ``{"error": {"message", "type", "code", "param"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.code = code or ERROR_CODES.get(status)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "code": self.code, "param": self.param}}


UNION_MESSAGES = {"prompt": "must be a string or a list of token ids (integers)",
                  "stop": "must be a string or a list of strings",
                  "content": "must be a string or a list of text parts"}
_TYPE_TAG = re.compile(r"str|int|float|bool|none|(list|dict|function-\w+|constrained-\w+)\[.*\]")


def validation_error(e: ValidationError) -> ApiError:
    """pydantic's first error → a 400 whose message starts with the field's dotted path (its ``param``)."""
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
    elif err["type"] == "finite_number":
        msg = f"must be a finite number, got {err['input']!r}"
    return ApiError(400, f"{loc}: {msg}", param=loc)


Prompt = str | list[int]
Stop = str | list[str] | None


class SamplingFields(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False)  # NaN and infinities: "not a finite number"

    max_tokens: int | None = Field(default=None, ge=1, description=(
        "Most tokens to generate; prompt + max_tokens must fit max_model_len (else 400)"))
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0: greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, description="-1: disabled; 0 is refused")
    seed: int | None = Field(default=None, description="Seeds sample i with seed + i (64 bits)")
    stop: Stop = Field(default=None, description="Strings that end the output (cut from it)")
    n: int = Field(default=1, ge=1, le=16, description="Samples per prompt")
    ignore_eos: bool = False
    stream: bool = Field(default=False, description="Answer as server-sent events (text/event-stream)")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0, description="vLLM's: prompt and output tokens")
    logit_bias: dict[str, float] | None = Field(default=None, description=(
        "Token ids (as strings) -> bias in [-100, 100]"))
    min_tokens: int = Field(default=0, ge=0, description="EOS and stop strings are ignored before this many tokens")
    structured_outputs: dict[str, Any] | None = Field(default=None, description=(
        "vLLM's constraint: one of json, regex, choice, grammar (docs/structured-outputs.md)"))
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The output limit the request sets itself (None: it leaves the default) and the field that set it."""
        return (self.max_tokens if "max_tokens" in self.model_fields_set else None), "max_tokens"

    def logprobs_count(self) -> int | None:
        """Alternatives per generated token to return (None: no log-probabilities)."""
        return None

    def constraints(self) -> list[StructuredOutputs]:
        """Every structured-output constraint the request gives (a valid request gives at most one)."""
        found = []
        if self.structured_outputs is not None:
            spec = dict(self.structured_outputs)
            unknown = sorted(set(spec) - {"json", "regex", "choice", "grammar", "json_object"})
            if unknown:
                raise ApiError(400, f"structured_outputs: unsupported key {unknown[0]!r} (use one of json, regex, "
                                    "choice, grammar)", param="structured_outputs")
            found.append(_spec("structured_outputs", **spec))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append(_spec(f"guided_{kind}", **{kind: value}))
        return found

    def structured(self) -> StructuredOutputs | None:
        found = self.constraints()
        if len(found) > 1:
            raise ApiError(400, f"{found[1].param}: only one output constraint per request (already given: "
                                f"{found[0].param})", param=found[1].param)
        return found[0] if found else None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters; ``max_tokens``: the output limit the job builder settled on."""
        if self.top_k == 0:
            raise ApiError(400, "top_k: must be -1 (disabled) or an integer >= 1", param="top_k")
        bias = None
        if self.logit_bias:
            try:
                bias = {int(t): b for t, b in self.logit_bias.items()}
            except ValueError:
                raise ApiError(400, "logit_bias: keys must be token ids (integers written as strings)",
                               param="logit_bias") from None
        try:
            return SamplingParams(n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k if self.top_k < TOP_K_ALL else -1, seed=self.seed,
                                  stop=self.stop, ignore_eos=self.ignore_eos, logprobs=self.logprobs_count(),
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  repetition_penalty=self.repetition_penalty, logit_bias=bias,
                                  min_tokens=self.min_tokens, structured_outputs=self.structured())
        except InvalidParam as e:  # SamplingParams names the field
            raise ApiError(400, str(e), param=e.param) from e


class GenerateRequest(SamplingFields):
    """``POST /generate``: our own minimal API."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"examples": [
        {"prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0},
        {"prompt": "解释KV Cache的作用：", "max_length": 100, "temperature": 0.7}]})

    prompt: Prompt = Field(description="Text, or token ids")
    max_tokens: int = Field(default=16, ge=1, description=(
        "Most tokens to generate (default 16, or none with max_length); prompt + max_tokens must fit max_model_len"))
    max_length: int | None = Field(default=None, ge=1, description=(
        "Prompt tokens + generated tokens, as transformers' generate counts them; must exceed the prompt's length "
        "and fit max_model_len. With max_tokens too, the tighter limit applies"))


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict", "description"}

    def constraint(self) -> StructuredOutputs | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return _spec("response_format", json_object=True)
        schema = (self.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format: json_schema.schema must be a JSON schema object",
                           param="response_format")
        return _spec("response_format", json=schema)


# fields of OpenAI's API this server does not implement: present (and not their neutral value), they are a 400
UNSUPPORTED = ("suffix", "audio", "prediction", "functions", "function_call", "web_search_options")


class OpenAIFields(SamplingFields):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    suffix: Any = None
    audio: Any = None
    prediction: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None
    modalities: list[str] | None = None
    best_of: int | None = Field(default=None, ge=1)

    def check_unsupported(self) -> None:
        """Refuse fields whose meaning this server cannot honour (400 naming the field)."""
        for name in UNSUPPORTED:
            if getattr(self, name) not in (None, ""):
                raise ApiError(400, f"{name}: not supported by this server", param=name)
        if self.modalities is not None and self.modalities != ["text"]:
            raise ApiError(400, "modalities: only [\"text\"] is supported", param="modalities")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, f"best_of: only best_of == n ({self.n}) is supported (no ranking of samples)",
                           param="best_of")

    def constraints(self) -> list[StructuredOutputs]:
        found = super().constraints()
        spec = self.response_format.constraint() if self.response_format is not None else None
        return ([spec] if spec is not None else []) + found


class CompletionRequest(OpenAIFields):
    prompt: Prompt | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1, description=(
        "Most tokens to generate per choice (default 16); prompt + max_tokens must fit max_model_len"))
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
    content: str | list[dict[str, Any]] | None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer names the call
    reasoning_content: str | None = None  # an assistant's earlier thinking, for a format that shows it again

    def text(self, index: int) -> str:
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return ""
            raise ApiError(400, f"messages.{index}.content: required (null only for an assistant's tool calls)",
                           param=f"messages.{index}.content")
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages.{index}.content: only text parts are supported",
                               param=f"messages.{index}.content")
            parts.append(part["text"])
        return "".join(parts)


class ToolFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: ToolFunction


class ChatRequest(OpenAIFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, description=(
        "OpenAI's newer name of max_tokens (wins over it); default: what max_model_len leaves after the prompt"))
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description=(
        "Variables for the chat template besides the messages, e.g. {\"thinking\": true}"))
    reasoning_effort: str | None = Field(default=None, description=(
        "OpenAI's reasoning effort (none, minimal, low, medium, high, xhigh; and max): read by DeepSeek-V4's built-in "
        "chat format (none: no thinking; max: its maximum effort; the others: its default), ignored by chat templates"))

    def plain_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            msg: dict[str, Any] = {"role": m.role, "content": m.text(i)}
            if m.tool_calls:
                msg["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None and m.role == "assistant":
                msg["reasoning_content"] = m.reasoning_content
            out.append(msg)
        return out

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def tool_mode(self, auto_syntax: str | None) -> ToolMode | None:
        """How the answer carries tool calls (None: it does not); ``auto_syntax``: the model's tool-call syntax
        (``tool_parsers.py``), None when the server parses none or the chat template does not show the tools."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if not self.tools:
            if choice != "none":
                raise ApiError(400, "tool_choice: requires tools", param="tool_choice")
            return None
        if choice == "none":
            return None
        if choice == "auto":
            if auto_syntax is None:
                raise ApiError(400, "tool_choice: \"auto\" needs a chat template that shows the model the tools and "
                                    "a tool-call syntax this server parses (--tool-call-parser); this model has none: "
                                    "use \"required\", a named function or \"none\"", param="tool_choice")
            return ToolMode("auto", syntax=auto_syntax, strings=string_parameters(self.tool_dicts()))
        if choice == "required":
            return ToolMode("required")
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if choice.get("type") != "function" or name not in {t.function.name for t in self.tools}:
            raise ApiError(400, "tool_choice: must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                "\"function\": {\"name\": <one of tools>}}", param="tool_choice")
        return ToolMode("named", name=name)

    def constraints(self) -> list[StructuredOutputs]:
        found = super().constraints()
        if self.tools and self.tool_choice not in (None, "none", "auto"):  # a forced call: its schema
            tools = {t.function.name: t.function.parameters or {"type": "object"} for t in self.tools}
            if self.tool_choice == "required":
                schema = required_schema([{"name": k, "parameters": v} for k, v in tools.items()],
                                         self.parallel_tool_calls)
            else:
                schema = tools.get(self.tool_choice.get("function", {}).get("name"),  # type: ignore[union-attr]
                                   {"type": "object"})
            found = [_spec("tools", json=schema)] + found
        return found

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _spec(param: str, **fields: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(param=param, **fields)
    except InvalidParam as e:
        raise ApiError(400, str(e), param=e.param) from e
    except TypeError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from e
