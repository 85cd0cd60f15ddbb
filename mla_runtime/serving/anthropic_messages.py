"""``POST /v1/messages``: Anthropic's Messages API, answered by the chat path (``translate.py``).

The request becomes a ``ChatRequest``: ``system`` (text or text blocks) the system message; each message's text
blocks its content, an assistant's ``tool_use`` blocks its ``tool_calls`` (``input`` as the JSON arguments), a user's
``tool_result`` blocks ``tool`` messages naming the call (before the message's own text); ``thinking`` blocks of
earlier turns are dropped (chat templates drop earlier thinking too). ``stop_sequences`` are stop strings, ``tools``
(``name``, ``description``, ``input_schema``) function tools, ``tool_choice`` ``auto`` / ``any`` / ``tool`` /
``none`` chat's ``auto`` / ``required`` / a named function / ``none`` (``disable_parallel_tool_use``: one call),
``thinking: {"type": "enabled"}`` the chat template variable ``thinking``.

The answer's ``content`` is a ``thinking`` block (the reasoning parser's part), a ``text`` block and a ``tool_use``
block per call (``input`` ``{}`` for arguments cut short by ``max_tokens``); ``stop_reason`` is ``tool_use``,
``max_tokens``, ``stop_sequence`` (with ``stop_sequence``) or ``end_turn``. Streamed: ``message_start``, ``ping``,
then per block ``content_block_start`` / ``content_block_delta`` (``thinking_delta``, ``text_delta``,
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop reason, usage) and ``message_stop``. Errors
are Anthropic's ``{"type": "error", "error": {"type", "message"}}``, the message naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mla_runtime.outputs import CompletionOutput, RequestOutput
from mla_runtime.serving.jobs import JobBuilder
from mla_runtime.serving.protocol import ApiError, ChatRequest
from mla_runtime.serving.responses import Job, chat_message
from mla_runtime.serving.streaming import ApiShape
from mla_runtime.serving.translate import (
    PartStream,
    chat_job,
    chat_request,
    named_event,
    parse_arguments,
    stop_sequence,
)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}
NAMES = {"stop": "stop_sequences", "chat_template_kwargs": "thinking"}  # chat fields → this API's
TOOL_NAME = r"^[A-Za-z0-9_.-]+$"


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]] = Field(description="Text, or blocks: text, tool_use, tool_result, thinking")


class AnthropicTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str = Field(min_length=1, max_length=64, pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="The JSON schema of the tool's input")
    type: Literal["custom"] | None = Field(default=None, description="Client tools only (server tools are refused)")


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, description="With type \"tool\": the tool to call")
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1, description="Accepted; the output limit is max_tokens")


class MessagesRequest(BaseModel):
    """``POST /v1/messages``: Anthropic's Messages API."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, json_schema_extra={"examples": [
        {"model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "def fibonacci(n):"}]}]})

    model: str = Field(description="The served model's name")
    max_tokens: int = Field(ge=1, description="Most tokens to generate; prompt + max_tokens must fit max_model_len")
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = Field(default=None, description="Text, or text blocks")
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, description="-1: disabled")
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = Field(default=None, description=(
        "{\"type\": \"enabled\"}: the chat template's thinking variable is set (a thinking model thinks first)"))
    metadata: dict[str, Any] | None = None


def error_body(e: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def stream_error(e: ApiError) -> list[bytes]:
    return [named_event("error", error_body(e))]


def _text(blocks: str | list[dict[str, Any]], param: str) -> str:
    """The text of a string or of text blocks (a 400 naming ``param`` for any other block)."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for i, block in enumerate(blocks):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ApiError(400, f"{param}.{i}: expected a text block ({{\"type\": \"text\", \"text\": ...}})",
                           param=f"{param}.{i}")
        parts.append(block["text"])
    return "".join(parts)


def _tool_use(block: dict[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or \
            not isinstance(block.get("input"), dict):
        raise ApiError(400, f"{param}: a tool_use block needs id, name (strings) and input (an object)", param=param)
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _tool_result(block: dict[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise ApiError(400, f"{param}.tool_use_id: required (the id of the tool_use block it answers)",
                       param=f"{param}.tool_use_id")
    content = block.get("content", "")
    if not isinstance(content, str | list):
        raise ApiError(400, f"{param}.content: must be a string or text blocks", param=f"{param}.content")
    text = _text(content, f"{param}.content")
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _turn(i: int, m: AnthropicMessage) -> list[dict[str, Any]]:
    """One message as chat messages: tool results first (a user's), then the text, with its tool calls."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    results, texts, calls = [], [], []
    for j, block in enumerate(m.content):
        param, kind = f"messages.{i}.content.{j}", block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and m.role == "assistant":
            calls.append(_tool_use(block, param))
        elif kind == "tool_result" and m.role == "user":
            results.append(_tool_result(block, param))
        elif kind not in ("thinking", "redacted_thinking") or m.role != "assistant":
            raise ApiError(400, f"{param}: unsupported block {kind!r} in a {m.role} message (this server takes text, "
                                "tool_use from the assistant, tool_result from the user, and earlier thinking)",
                           param=param)
    out = results
    if texts or calls or not results:
        message: dict[str, Any] = {"role": m.role, "content": "".join(texts) if texts or not calls else None}
        if calls:
            message["tool_calls"] = calls
        out = out + [message]
    return out


def _tool_choice(req: MessagesRequest) -> tuple[Any, bool]:
    """Chat's ``tool_choice`` and ``parallel_tool_calls``."""
    choice = req.tool_choice
    if choice is None:
        return None, True
    if choice.type == "tool":
        if choice.name not in {t.name for t in req.tools or []}:
            raise ApiError(400, "tool_choice.name: must name one of tools", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}, not choice.disable_parallel_tool_use
    chat = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return chat, not choice.disable_parallel_tool_use


def to_chat(req: MessagesRequest) -> ChatRequest:
    messages = [] if req.system is None else [{"role": "system", "content": _text(req.system, "system")}]
    for i, m in enumerate(req.messages):
        messages += _turn(i, m)
    tool_choice, parallel = _tool_choice(req)
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "top_k": req.top_k, "stop": req.stop_sequences, "stream": req.stream,
        "parallel_tool_calls": parallel}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"thinking": req.thinking.type == "enabled"}
    return chat_request(ChatRequest, body)


def messages_job(jobs: JobBuilder, req: MessagesRequest) -> Job:
    return chat_job(jobs, to_chat(req), Job, "messages", "msg", NAMES)


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {"input_tokens": len(out.prompt_token_ids), "output_tokens": sum(len(c.token_ids) for c in out.outputs),
            "cache_read_input_tokens": out.num_cached_tokens, "cache_creation_input_tokens": 0}


def _stop(job: Job, c: CompletionOutput, reason: str | None) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a chat choice that ended with ``reason``."""
    if reason in STOP_REASONS:
        return STOP_REASONS[reason], None
    found = stop_sequence(job, c)
    return ("stop_sequence", found) if found is not None else ("end_turn", None)


def _tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": _tool_id(call), "name": call["function"]["name"],
            "input": parse_arguments(call["function"]["arguments"])}


def _tool_id(call: dict[str, Any]) -> str:
    return "toolu_" + str(call["id"]).removeprefix("call_")


def message_body(job: Job, out: RequestOutput) -> dict[str, Any]:
    """The non-streamed answer."""
    c = out.outputs[0]
    message, reason = chat_message(job, c)
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message["content"]:
        content.append({"type": "text", "text": message["content"]})
    content += [_tool_use_block(call) for call in message.get("tool_calls", [])]
    stop_reason, stop_seq = _stop(job, c, reason)
    return {"id": job.request_id, "type": "message", "role": "assistant", "model": job.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_seq, "usage": _usage(out)}


class MessagesStream(PartStream):
    """Anthropic's stream events of a job."""

    BLOCKS = {"reasoning": ("thinking", "thinking_delta", "thinking"), "text": ("text", "text_delta", "text"),
              "call": ("tool_use", "input_json_delta", "partial_json")}

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self.index = -1  # the content block open now

    def opening(self, out: RequestOutput) -> list[bytes]:
        usage = {**_usage(out), "output_tokens": 0}
        message: dict[str, Any] = {"id": self.job.request_id, "type": "message", "role": "assistant",
                                   "model": self.job.model, "content": [], "stop_reason": None, "stop_sequence": None,
                                   "usage": usage}
        return [named_event("message_start", {"type": "message_start", "message": message}),
                named_event("ping", {"type": "ping"})]

    def open_part(self, kind: str, call: dict[str, Any] | None) -> list[bytes]:
        self.index += 1
        block_type, _, field = self.BLOCKS[kind]
        block: dict[str, Any] = {"type": block_type, field: ""} if call is None else \
            {"type": "tool_use", "id": _tool_id(call), "name": call["function"]["name"], "input": {}}
        if kind == "reasoning":
            block["signature"] = ""
        return [named_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": block})]

    def part_delta(self, kind: str, text: str) -> list[bytes]:
        _, delta_type, field = self.BLOCKS[kind]
        return [named_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                    "delta": {"type": delta_type, field: text}})]

    def close_part(self, kind: str) -> list[bytes]:
        return [named_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def closing(self, out: RequestOutput) -> list[bytes]:
        stop_reason, stop_seq = _stop(self.job, out.outputs[0], self.finish)
        usage = _usage(out)
        return [named_event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": stop_reason, "stop_sequence": stop_seq},
                                              "usage": {"output_tokens": usage["output_tokens"]}}),
                named_event("message_stop", {"type": "message_stop"})]


MESSAGES = ApiShape(body=message_body, stream=MessagesStream, error=error_body, stream_error=stream_error)
