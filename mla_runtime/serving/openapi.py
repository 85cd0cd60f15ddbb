"""The OpenAPI document (``GET /openapi.json``) and its Swagger UI page (``GET /docs``).

The routes parse their bodies by hand (size limit, JSON off the event loop, tokenisation in a worker thread), so
FastAPI sees no body parameter to describe: the document is built here from the same pydantic models the routes
validate with (``protocol.py``) and from models of the answers, which exist only to be described. Every route of
the app is listed (a test checks it): request bodies, 200 bodies (JSON, or ``text/event-stream`` whose events carry
the JSON of a chunk as ``data``), the error body of every error status, ``X-Request-Id`` on every answer, and the
bearer scheme on the routes that require the API key when one is set.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from mla_runtime.serving.anthropic_messages import ERROR_TYPES as ANTHROPIC_ERROR_TYPES
from mla_runtime.serving.anthropic_messages import MessagesRequest
from mla_runtime.serving.config import ServerConfig
from mla_runtime.serving.openai_responses import ResponsesRequest
from mla_runtime.serving.protocol import ERROR_TYPES, ChatRequest, CompletionRequest, GenerateRequest

REF = "#/components/schemas/{model}"
SSE_NOTE = ("with \"stream\": true, server-sent events: one `data: <JSON>` line per event, then `data: [DONE]`; "
            "a stream that fails after it started ends with `data: <Error>`.")


# -- answers, described (the routes build them as dicts) --------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description=f"One of {sorted(set(ERROR_TYPES.values()) | {'server_error'})}")
    code: str | None = Field(description="A short machine-readable reason, or null")
    param: str | None = Field(description="The request field at fault (a dotted path), or null")


class Error(BaseModel):
    """Every error answer's body."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens read from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


FinishReason = Literal["stop", "length", "tool_calls"] | None


class GenerateOutput(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason


class GenerateResponse(BaseModel):
    """``n`` = 1: ``text``, ``token_ids``, ``finish_reason``; ``n`` > 1: ``outputs``, one per sample."""

    id: str
    text: str | None = None
    token_ids: list[int] | None = None
    finish_reason: FinishReason = None
    outputs: list[GenerateOutput] | None = None
    usage: Usage


class GenerateEvent(BaseModel):
    """One event of a streamed ``/generate``: new text and tokens of sample ``index``."""

    id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage | None = Field(default=None, description="On the events of the final step")


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: FinishReason


class Completion(BaseModel):
    """``/v1/completions``'s answer; streamed, each event has this shape with the new text as ``text`` (and a last
    event with ``usage`` and no choices when ``stream_options.include_usage``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="JSON text; cut short (not parseable) when finish_reason is \"length\"")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = Field(default=None, description="In a call's first entry")
    arguments: str = Field(description="A piece of the JSON text (\"\" in a call's first entry)")


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = Field(default=None, description="In a call's first entry, with type and function.name")
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: None
    reasoning_content: str | None = Field(default=None, description=(
        "The thinking part (<think>...</think>), under a reasoning parser; then always present, null without one"))
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(default=None, description="A piece of the thinking part")
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None
    finish_reason: FinishReason


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """``/v1/responses``'s answer (``docs/serving.md``); its request fields are repeated as OpenAI repeats them."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    error: None
    incomplete_details: dict[str, str] | None
    model: str
    output: list[dict[str, Any]] = Field(description="reasoning, message and function_call items")
    usage: ResponsesUsage | None


class ResponseDeleted(BaseModel):
    """``DELETE /v1/responses/{response_id}``'s answer."""

    id: str
    object: Literal["response"]
    deleted: Literal[True]


class ResponseEvent(BaseModel):
    """One event of a streamed ``/v1/responses`` (``event: <type>``); ``error`` events carry code, message, param."""

    type: str
    sequence_number: int


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class AnthropicMessageObject(BaseModel):
    """``/v1/messages``'s answer."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]] = Field(description="thinking, text and tool_use blocks")
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicEvent(BaseModel):
    """One event of a streamed ``/v1/messages`` (``event: <type>``)."""

    type: str


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description=f"One of {sorted(set(ANTHROPIC_ERROR_TYPES.values()) | {'api_error'})}")
    message: str = Field(description="Starts with the request field at fault, where one is")


class AnthropicError(BaseModel):
    """Every error answer's body on ``/v1/messages``."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    status: Literal["ready"]
    model: str


MODELS: list[type[BaseModel]] = [GenerateRequest, CompletionRequest, ChatRequest, Error, GenerateResponse,
                                 GenerateEvent, Completion, ChatCompletion, ChatCompletionChunk, ModelList, Health,
                                 Ready, ResponsesRequest, ResponseObject, ResponseDeleted, ResponseEvent,
                                 MessagesRequest, AnthropicMessageObject, AnthropicEvent, AnthropicError]
ERRORS = {400: "Invalid request: the message and param name the field", 401: "Missing or wrong API key",
          404: "Unknown model (or, on /v1/responses, previous_response_id)", 413: "Body above max_body_bytes",
          429: "At capacity (max_num_seqs + max_queue sequences in flight); see Retry-After",
          500: "Server fault (details in the server log only)",
          503: "Not ready, draining, or after a fault", 504: "Exceeded request_timeout; aborted"}
GENERATION_ERRORS = (400, 401, 413, 429, 500, 503, 504)


def _json(model: str) -> dict[str, Any]:
    return {"schema": {"$ref": REF.format(model=model)}}


def _errors(codes: tuple[int, ...], error: str = "Error") -> dict[str, Any]:
    out = {}
    for code in codes:
        response: dict[str, Any] = {"description": ERRORS[code], "content": {"application/json": _json(error)}}
        if code in (429, 503):
            response["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "Seconds"}}
        out[str(code)] = response
    return out


def _operation(summary: str, ok: dict[str, Any], errors: tuple[int, ...], secured: bool,
               body: str | None = None, error: str = "Error") -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "operationId": summary.lower().replace(" ", "_").replace("/", "_"),
                          "responses": {"200": ok, **_errors(tuple(c for c in errors if c != 401 or secured), error)}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": _json(body)}}
    if secured:
        op["security"] = [{"bearer": []}, {"api_key": []}] if error == "AnthropicError" else [{"bearer": []}]
    return op


def _event(event: str, error: str = "Error", named: bool = False) -> dict[str, Any]:
    """One server-sent event (the schema of ``text/event-stream`` describes each event before OpenAPI 3.2): its
    ``data`` is the JSON of ``event``, or of an error, or ``[DONE]`` (the last, where events are not ``named``:
    ``event: <type>`` lines name them, and the last is the API's own closing event)."""
    last = "its `event:` line names the event's type" if named else "the last event's data is [DONE]"
    data = {"type": "string", "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_json(event)["schema"], _json(error)["schema"]]},
            "description": f"JSON: a {event}, or an {error}; {last}"}
    return {"schema": {"type": "object", "required": ["data"], "properties": {"data": data}}}


def _generation(summary: str, body: str, answer: str, event: str, secured: bool, model_errors: bool,
                error: str = "Error", named: bool = False) -> dict[str, Any]:
    note = SSE_NOTE if not named else "with \"stream\": true, server-sent events, each named by an `event:` line"
    ok = {"description": f"The answer; {note}",
          "content": {"application/json": _json(answer), "text/event-stream": _event(event, error, named)}}
    errors = GENERATION_ERRORS + ((404,) if model_errors else ())
    return {"post": _operation(summary, ok, tuple(sorted(errors)), secured, body, error)}


def _get(summary: str, ok: dict[str, Any], errors: tuple[int, ...], secured: bool) -> dict[str, Any]:
    return {"get": _operation(summary, ok, errors, secured)}


def _json_ok(model: str, what: str) -> dict[str, Any]:
    return {"description": what, "content": {"application/json": _json(model)}}


def _kept_response(secured: bool) -> dict[str, Any]:
    """``GET`` and ``DELETE /v1/responses/{response_id}``: a response kept by the server (``store``)."""
    path = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"},
             "description": "The id of a response made with store: true"}]
    item = {"get": _operation("Retrieve response", _json_ok("ResponseObject", "The kept response, as it was answered"),
                              (400, 401), secured),
            "delete": _operation("Delete response", _json_ok("ResponseDeleted", "The response is forgotten"),
                                 (401,), secured)}
    for op in item.values():
        op["parameters"] = path
        op["responses"]["404"] = {"description": "No response kept with this id",
                                  "content": {"application/json": _json("Error")}}
    item["get"]["parameters"] = path + [{"name": "stream", "in": "query", "required": False,
                                         "schema": {"type": "boolean", "const": False},
                                         "description": "Only false: a kept response is not streamed again"}]
    return item


def _paths(config: ServerConfig) -> dict[str, Any]:
    keyed = config.api_key is not None
    return {
        "/generate": _generation("Generate", "GenerateRequest", "GenerateResponse", "GenerateEvent", keyed, False),
        "/v1/completions": _generation("Completions", "CompletionRequest", "Completion", "Completion", keyed, True),
        "/v1/chat/completions": _generation("Chat completions", "ChatRequest", "ChatCompletion",
                                            "ChatCompletionChunk", keyed, True),
        "/v1/responses": _generation("Responses", "ResponsesRequest", "ResponseObject", "ResponseEvent", keyed, True,
                                     named=True),
        "/v1/responses/{response_id}": _kept_response(keyed),
        "/v1/messages": _generation("Messages", "MessagesRequest", "AnthropicMessageObject", "AnthropicEvent", keyed,
                                    True, "AnthropicError", named=True),
        "/v1/models": _get("Models", _json_ok("ModelList", "The served model"), (401,), keyed),
        "/health": _get("Health", _json_ok("Health", "Liveness: the engine thread is alive and no step hangs"),
                        (503,), False),
        "/ready": _get("Ready", _json_ok("Ready", "Readiness: loaded, probed, not draining"), (503,), False),
        "/metrics": _get("Metrics", {"description": "Prometheus text format",
                                     "content": {"text/plain": {"schema": {"type": "string"}}}},
                         (401,), keyed and config.metrics_auth),
        "/openapi.json": _get("OpenAPI", {"description": "This document",
                                          "content": {"application/json": {"schema": {"type": "object"}}}},
                              (401,), keyed),
        "/docs": _get("Docs", {"description": "Swagger UI over this document",
                               "content": {"text/html": {"schema": {"type": "string"}}}}, (401,), keyed),
        "/docs/{name}": _get("Docs assets", {"description": "Swagger UI's script or stylesheet (swagger-ui-bundle.js, "
                                                           "swagger-ui.css), public: library code, no data",
                                             "content": {"text/javascript": {"schema": {"type": "string"}},
                                                         "text/css": {"schema": {"type": "string"}}}},
                             (404,), False),
    }


def _with_request_id(paths: dict[str, Any]) -> dict[str, Any]:
    header = {"X-Request-Id": {"schema": {"type": "string"},
                               "description": "The client's own X-Request-Id when usable, else a new id"}}
    for item in paths.values():
        for op in item.values():
            for response in op["responses"].values():
                response["headers"] = {**header, **response.get("headers", {})}
    return paths


def openapi_schema(config: ServerConfig) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the app serving ``config``."""
    _, top = models_json_schema([(m, "validation") for m in MODELS], ref_template=REF)
    components: dict[str, Any] = {"schemas": top["$defs"]}
    if config.api_key is not None:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                    "description": "The server's --api-key"},
                                         "api_key": {"type": "apiKey", "in": "header", "name": "x-api-key",
                                                     "description": "The server's --api-key, as Anthropic's clients "
                                                                    "send it"}}
    return {"openapi": "3.1.0",
            "info": {"title": "mla-runtime", "version": _version(),
                     "description": "Inference for multi-head latent attention models: our /generate, "
                                    "OpenAI-compatible routes (completions, chat, responses) and Anthropic's "
                                    "/v1/messages. Every error is {\"error\": {message, type, code, param}}, but "
                                    "on /v1/messages Anthropic's {\"type\": \"error\", \"error\": {type, "
                                    "message}}."},
            "paths": _with_request_id(_paths(config)), "components": components}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mla-runtime")
    except PackageNotFoundError:
        return "0"


# Swagger UI's files, served by /docs/{name} from the installed fastapi-swagger package: /docs needs no network
DOCS_ASSETS = {"swagger-ui-bundle.js": "text/javascript; charset=utf-8", "swagger-ui.css": "text/css; charset=utf-8"}


def docs_asset(name: str) -> bytes:
    """One of Swagger UI's files (``DOCS_ASSETS``) as the installed package holds it."""
    if name not in DOCS_ASSETS:
        raise KeyError(name)
    return (resources.files("fastapi_swagger") / "resources" / name).read_bytes()


def docs_page(schema: dict[str, Any]) -> str:
    """Swagger UI with the document inline: a browser cannot send the API key when the page fetches
    ``/openapi.json`` itself, so ``/docs`` needs no second request. Its script and stylesheet come from this server
    (``docs_asset``), so the page works where no network reaches a CDN."""
    spec = json.dumps(schema).replace("</", "<\\/")  # never ends the <script> element
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>mla-runtime API</title>'
            f'<link rel="stylesheet" href="/docs/swagger-ui.css"></head><body><div id="swagger-ui"></div>'
            f'<script src="/docs/swagger-ui-bundle.js"></script>'
            f'<script>SwaggerUIBundle({{spec: {spec}, dom_id: "#swagger-ui"}})</script></body></html>')
