"""``POST /v1/responses``: OpenAI's Responses API, answered by the chat path (``translate.py``).

The request becomes a ``ChatRequest``: ``instructions`` the system message; ``input`` a user message (a string) or
items: messages (roles ``user``, ``system``, ``developer``, ``assistant``; content as text or ``input_text`` /
``output_text`` parts), ``function_call`` items (an assistant's tool calls, consecutive ones in one message) and
``function_call_output`` items (``tool`` messages naming the call); ``reasoning`` items of earlier turns are dropped.
``max_output_tokens`` is the output limit, ``tools`` function tools, ``tool_choice`` chat's, ``text.format`` chat's
``response_format``, and a ``reasoning.effort`` other than ``none`` sets the chat template variable ``thinking``.

``GET /v1/responses/{id}`` returns a kept response's object as it was answered, ``DELETE`` forgets it (``stored``).
``previous_response_id`` continues a conversation: the input and output of the responses kept in memory (the
``ResponseStore``, the ``serving.responses_store`` most recently used, ``store: false`` keeps none) come before the
new input; ``instructions`` are not carried over, as OpenAI does. An unknown id is a 404 naming the field.

The answer's ``output`` is a ``reasoning`` item (the reasoning parser's part), a ``message`` item with one
``output_text`` part, and a ``function_call`` item per call; ``status`` is ``incomplete`` (``incomplete_details``:
``max_output_tokens``) when the output limit cut it. Streamed: ``response.created``, ``response.in_progress``, per
item ``response.output_item.added`` … ``response.output_item.done`` with the text's ``response.content_part.added``,
``response.output_text.delta`` / ``.done``, ``response.content_part.done``, the thinking's
``response.reasoning_text.delta`` / ``.done`` and a call's ``response.function_call_arguments.delta`` / ``.done``, then
``response.completed`` (or ``response.incomplete``). Each event carries ``sequence_number``.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mla_runtime.outputs import RequestOutput
from mla_runtime.serving.jobs import JobBuilder
from mla_runtime.serving.protocol import ApiError, ChatRequest
from mla_runtime.serving.responses import Job, chat_message
from mla_runtime.serving.streaming import ApiShape
from mla_runtime.serving.translate import PartStream, chat_job, chat_request, named_event

NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
         "chat_template_kwargs": "reasoning"}
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponseStore:
    """The latest responses, each with its conversation (for ``previous_response_id``) and its response object (for
    ``GET /v1/responses/{id}``): at most ``size``, the least recently used dropped first. Safe across threads (jobs
    are built in worker threads)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def _find(self, response_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        with self._lock:
            found = self._items.get(response_id)
            if found is not None:
                self._items.move_to_end(response_id)
            return found

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation of a kept response (its input and output, as chat messages)."""
        found = self._find(response_id)
        return None if found is None else list(found[0])

    def response(self, response_id: str) -> dict[str, Any] | None:
        """A kept response's object, as it was answered."""
        found = self._find(response_id)
        return None if found is None else found[1]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def put(self, response_id: str, conversation: list[dict[str, Any]], response: dict[str, Any]) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[response_id] = (conversation, response)
            self._items.move_to_end(response_id)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


class FunctionTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"] = Field(description="Function tools only")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    format: dict[str, Any] | None = Field(default=None, description=(
        "{\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"name\", \"schema\"}"))


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(default=None, description=(
        "Any effort but \"none\" sets the chat template's thinking variable (a thinking model thinks first)"))


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: OpenAI's Responses API."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, json_schema_extra={"examples": [
        {"input": "def fibonacci(n):", "instructions": "Answer in Python.", "max_output_tokens": 64}]})

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(description="Text, or message / function_call / "
                                                          "function_call_output items")
    instructions: str | None = Field(default=None, description="The system message (not carried over)")
    max_output_tokens: int | None = Field(default=None, ge=1, description=(
        "Most tokens to generate; default: what max_model_len leaves after the prompt"))
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = Field(default=None, description="Continue after a response kept in memory")
    store: bool = Field(default=True, description="Keep this response for previous_response_id")
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


@dataclass
class ResponsesJob(Job):
    """A ``/v1/responses`` job: what its answer echoes, and where it is kept when it ends."""

    conversation: list[dict[str, Any]] = field(default_factory=list)  # earlier turns and this input, as chat messages
    echo_fields: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats
    store: ResponseStore | None = None


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{param}: must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{param}.{j}: only text parts (input_text, output_text) are supported",
                           param=f"{param}.{j}")
        texts.append(part["text"])
    return "".join(texts)


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise ApiError(400, f"{param}.{key}: required, a string", param=f"{param}.{key}")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                     "arguments": item["arguments"]}}


def _item(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    """Append one input item to ``messages`` (chat messages)."""
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") not in ROLES:
            raise ApiError(400, f"{param}.role: must be one of {', '.join(ROLES)}", param=f"{param}.role")
        messages.append({"role": item["role"], "content": _content(item.get("content"), f"{param}.content")})
    elif kind == "function_call":
        call = _function_call(item, param)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise ApiError(400, f"{param}.call_id: required, a string", param=f"{param}.call_id")
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _content(item.get("output"), f"{param}.output")})
    elif kind != "reasoning":
        raise ApiError(400, f"{param}.type: unsupported item type {kind!r} (message, function_call, "
                            "function_call_output, reasoning)", param=f"{param}.type")


def _input(req: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        _item(messages, item, f"input.{i}")
    return messages


def _tool_choice(choice: Any) -> Any:
    """Chat's ``tool_choice`` of the Responses API's (``{"type": "function", "name"}`` names a function)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    spec = text.format if text is not None else None
    if spec is None:
        return None
    if spec.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": spec.get("name"), "schema": spec.get("schema")}}
    return {"type": spec.get("type")}


def responses_job(jobs: JobBuilder, store: ResponseStore, req: ResponsesRequest) -> ResponsesJob:
    earlier: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id)
        if found is None:
            raise ApiError(404, f"previous_response_id: no response {req.previous_response_id!r} is kept here (the "
                                f"server keeps the latest {store.size})", param="previous_response_id")
        earlier = found
    conversation = earlier + _input(req)
    system = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    body: dict[str, Any] = {"model": req.model, "messages": system + conversation, "temperature": req.temperature,
                            "top_p": req.top_p, "stream": req.stream, "parallel_tool_calls": req.parallel_tool_calls}
    for key, value in (("max_tokens", req.max_output_tokens), ("tool_choice", _tool_choice(req.tool_choice)),
                       ("response_format", _response_format(req.text))):
        if value is not None:
            body[key] = value
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["chat_template_kwargs"] = {"thinking": req.reasoning.effort != "none"}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "store": req.store,
            "text": {"format": (req.text.format if req.text is not None else None) or {"type": "text"}},
            "metadata": req.metadata or {}, "temperature": req.temperature, "top_p": req.top_p,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None}}
    return chat_job(jobs, chat_request(ChatRequest, body), ResponsesJob, "responses", "resp", NAMES,
                    conversation=conversation, echo_fields=echo, store=store if req.store else None)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant", "content": [text_part(text)]}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _usage(out: RequestOutput) -> dict[str, Any]:
    prompt, generated = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated}


def response_object(job: ResponsesJob, status: str, items: list[dict[str, Any]],
                    usage: dict[str, Any] | None) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": job.request_id, "object": "response", "created_at": job.created, "status": status, "error": None,
            "incomplete_details": incomplete, "model": job.model, "output": items, "usage": usage,
            "truncation": "disabled", **job.echo_fields}


def finished(job: ResponsesJob, out: RequestOutput, items: list[dict[str, Any]], reason: str | None
             ) -> dict[str, Any]:
    """The final response object; kept in the store (with this turn's output) unless ``store`` was false."""
    status = "incomplete" if reason == "length" else "completed"
    response = response_object(job, status, items, _usage(out))
    if job.store is not None:
        text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in items if i["type"] == "function_call"]
        said: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            said["tool_calls"] = calls
        job.store.put(job.request_id, job.conversation + [said], response)
    return response


def response_body(job: Job, out: RequestOutput) -> dict[str, Any]:
    """The non-streamed answer."""
    assert isinstance(job, ResponsesJob)
    message, reason = chat_message(job, out.outputs[0])
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message["content"]:
        items.append(message_item(message["content"]))
    items += [call_item(call) for call in message.get("tool_calls", [])]
    return finished(job, out, items, reason)


class ResponsesStream(PartStream):
    """The Responses API's stream events of a job."""

    DELTAS = {"reasoning": "response.reasoning_text.delta", "text": "response.output_text.delta",
              "call": "response.function_call_arguments.delta"}

    def __init__(self, job: Job) -> None:
        assert isinstance(job, ResponsesJob)
        super().__init__(job)
        self.rjob = job
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.item: dict[str, Any] = {}  # the item open now
        self.text = ""  # its text so far

    def event(self, kind: str, **data: Any) -> bytes:
        self.sequence += 1
        return named_event(kind, {"type": kind, "sequence_number": self.sequence - 1, **data})

    def opening(self, out: RequestOutput) -> list[bytes]:
        response = response_object(self.rjob, "in_progress", [], None)
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": len(self.items)}

    def open_part(self, kind: str, call: dict[str, Any] | None) -> list[bytes]:
        self.text = ""
        if kind == "reasoning":
            self.item = {**reasoning_item("", "in_progress"), "content": []}
        elif kind == "text":
            self.item = {**message_item("", "in_progress"), "content": []}
        else:
            assert call is not None
            self.item = call_item({**call, "function": {**call["function"], "arguments": ""}}, "in_progress")
        events = [self.event("response.output_item.added", output_index=len(self.items), item=self.item)]
        if kind == "text":
            events.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                     part=text_part("")))
        return events

    def part_delta(self, kind: str, text: str) -> list[bytes]:
        self.text += text
        extra: dict[str, Any] = {} if kind == "call" else {"content_index": 0}
        if kind == "text":
            extra["logprobs"] = []
        return [self.event(self.DELTAS[kind], **self._where(), **extra, delta=text)]

    def close_part(self, kind: str) -> list[bytes]:
        where, item = self._where(), self.item
        if kind == "reasoning":
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=self.text)]
            item.update(content=[{"type": "reasoning_text", "text": self.text}])
        elif kind == "text":
            events = [self.event("response.output_text.done", **where, content_index=0, text=self.text, logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0, part=text_part(self.text))]
            item.update(content=[text_part(self.text)])
        else:
            events = [self.event("response.function_call_arguments.done", **where, name=item["name"],
                                 arguments=self.text)]
            item.update(arguments=self.text)
        item["status"] = "incomplete" if self.finish == "length" else "completed"
        events.append(self.event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        return events

    def closing(self, out: RequestOutput) -> list[bytes]:
        response = finished(self.rjob, out, self.items, self.finish)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [self.event(kind, response=response)]


def stored(store: ResponseStore, response_id: str, delete: bool) -> dict[str, Any]:
    """``GET /v1/responses/{id}``: the kept response's object; ``DELETE``: OpenAI's deletion object. An id not kept
    (never, no longer, or with ``store: false``) is a 404 naming ``response_id``."""
    found = ({"id": response_id, "object": "response", "deleted": True} if store.delete(response_id) else None) \
        if delete else store.response(response_id)
    if found is None:
        raise ApiError(404, f"response_id: no response {response_id!r} is kept here (the server keeps the latest "
                            f"{store.size}, and none made with store: false)", param="response_id")
    return found


def stream_error(e: ApiError) -> list[bytes]:
    return [named_event("error", {"type": "error", "code": e.code, "message": e.message, "param": e.param,
                                  "sequence_number": 0})]


RESPONSES = ApiShape(body=response_body, stream=ResponsesStream, stream_error=stream_error)
