"""What ``/v1/responses`` (``openai_responses.py``) and ``/v1/messages`` (``anthropic_messages.py``) share: both
translate their request into a ``ChatRequest`` and build the job as ``/v1/chat/completions`` does (chat template,
tool modes, reasoning parser, output limits), and read the chat path's answer back in their own shapes.

- ``chat_job``: the chat request → the job of ``endpoint`` (its metrics label), with a fresh id of the API's form; an
  error about a chat field is renamed to the field of the API the client used (``messages`` → ``input``).
- ``PartStream``: a chat stream (``responses.StreamState``) read back as parts, in order: the thinking, the text, each
  tool call; an API's stream says how a part opens, grows and closes, and how the answer begins and ends.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import fields, replace
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from mla_runtime.outputs import CompletionOutput, RequestOutput
from mla_runtime.serving.jobs import JobBuilder
from mla_runtime.serving.protocol import ApiError, ChatRequest, validation_error
from mla_runtime.serving.responses import Job, StreamState

J = TypeVar("J", bound=Job)


def chat_request(schema: type[ChatRequest], body: dict[str, Any]) -> ChatRequest:
    """The chat request an API's request translates to (its values were checked already: a failure here is a 400)."""
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


def renamed(e: ApiError, names: dict[str, str]) -> ApiError:
    """``e`` with a chat field's name (its ``param`` and the start of its message) replaced by the API's name."""
    if e.param is None:
        return e
    head, dot, rest = e.param.partition(".")
    if head not in names:
        return e
    param = names[head] + dot + rest
    message = param + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
    return ApiError(e.status, message, param=param, headers=e.headers, code=e.code)


def chat_job(jobs: JobBuilder, req: ChatRequest, kind: type[J], endpoint: str, prefix: str,
             names: dict[str, str], **extra: Any) -> J:
    """The job of ``req`` built as the chat route builds it, as a ``kind`` (a ``Job`` with the API's fields in
    ``extra``) counted under ``endpoint``, with an id ``<prefix>_<hex>``."""
    try:
        job = jobs.chat(req)
    except ApiError as e:
        raise renamed(e, names) from None
    base = {f.name: getattr(job, f.name) for f in fields(Job)}
    return kind(**{**base, "endpoint": endpoint, "request_id": f"{prefix}_{uuid.uuid4().hex}", **extra})


def parse_arguments(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as an object; ``{}`` for text that does not parse (a call cut by the output limit)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_sequence(job: Job, c: CompletionOutput) -> str | None:
    """The stop string that ended ``c`` (it is cut from the text, not from the tokens), or None."""
    if c.finish_reason != "stop" or not job.params.stop_strings:
        return None
    raw = job.raw_text(c.token_ids)
    return next((s for s in job.params.stop_strings if raw.startswith(c.text + s)), None)


def check_extra(model: BaseModel, refused: tuple[str, ...]) -> None:
    """A 400 naming the first field of ``refused`` that the request gives (not null)."""
    for name in refused:
        if getattr(model, name, None) is not None:
            raise ApiError(400, f"{name}: not supported by this server", param=name)


class PartStream(ABC):
    """A chat job's stream, as an API other than chat streams it: ``chunks`` has ``StreamState``'s interface (what
    ``streaming.job_events`` calls). Subclasses give the events: ``opening``, ``open_part``, ``part_delta``,
    ``close_part`` (a part is ``reasoning``, ``text`` or ``call``), ``closing``."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.chat = StreamState(replace(job, endpoint="chat", include_usage=False))
        self.part: str | None = None  # the part open now
        self.finish: str | None = None  # the chat's finish_reason, once the answer ended
        self.started = False

    @property
    def sent_tokens(self) -> list[int]:
        return self.chat.sent_tokens

    def chunks(self, out: RequestOutput) -> list[bytes]:
        events: list[bytes] = []
        if not self.started:
            self.started = True
            events += self.opening(out)
        for payload in self.chat.payloads(out):
            if isinstance(payload, str):
                continue  # [DONE]: the API's own closing events end the stream
            choice = payload["choices"][0]
            delta = choice["delta"]
            for kind, key in (("reasoning", "reasoning_content"), ("text", "content")):
                if delta.get(key):
                    if self.part != kind:
                        events += self._close()
                        self.part = kind
                        events += self.open_part(kind, None)
                    events += self.part_delta(kind, delta[key])
            for call in delta.get("tool_calls") or []:
                events += self._close()
                self.part = "call"
                events += self.open_part("call", call)
                events += self.part_delta("call", call["function"]["arguments"])
            self.finish = choice["finish_reason"] or self.finish
        if out.finished:
            events += self._close()
            events += self.closing(out)
        return events

    def _close(self) -> list[bytes]:
        if self.part is None:
            return []
        kind, self.part = self.part, None
        return self.close_part(kind)

    @abstractmethod
    def opening(self, out: RequestOutput) -> list[bytes]:
        """See the class docstring."""

    @abstractmethod
    def open_part(self, kind: str, call: dict[str, Any] | None) -> list[bytes]:
        """See the class docstring."""

    @abstractmethod
    def part_delta(self, kind: str, text: str) -> list[bytes]:
        """See the class docstring."""

    @abstractmethod
    def close_part(self, kind: str) -> list[bytes]:
        """See the class docstring."""

    @abstractmethod
    def closing(self, out: RequestOutput) -> list[bytes]:
        """See the class docstring."""


def named_event(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with an ``event:`` name, as Anthropic's and the Responses API's streams send them."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
