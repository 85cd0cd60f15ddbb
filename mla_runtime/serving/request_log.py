"""Request ids and the per-request log line (``--log-format text|json``, ``--log-prompts``).

``RequestIdMiddleware`` wraps the whole app: every response carries ``X-Request-Id`` (the client's own when it
sent a usable one, else a fresh id), and each generation request, however it ended, is logged once when its
response (a stream included) is over. The line carries the request id, endpoint, arrival time, queue time, time
to first token, total duration, prompt / cached / generated tokens, the finish reason or the error type, the
HTTP status, and a snapshot of the latent-cache blocks in use and of the process's resident memory. The
prompt's text is only logged with ``--log-prompts``.

In the JSON format every log record of the process is one JSON object per line (``JsonFormatter``); a request
line adds its fields to the record's ``ts`` / ``level`` / ``logger`` / ``message``.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import resource
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from mla_runtime.engine.requests import Tokenized
from mla_runtime.outputs import RequestOutput
from mla_runtime.serving.responses import Job

LOG_FORMATS = ("text", "json")
REQUEST_ID_HEADER = b"x-request-id"
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses",
                              "/v1/messages"})
_USABLE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")  # a client's id is echoed back only when it looks like one

logger = logging.getLogger("mla_runtime.requests")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


def resident_bytes() -> int:
    """The process's resident set size (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-Id`` when it is 1-128 id-like characters, else a new random id."""
    for name, value in headers:
        if name.lower() == REQUEST_ID_HEADER:
            text = value.decode("latin-1").strip()
            if _USABLE_ID.fullmatch(text):
                return text
    return uuid.uuid4().hex


def iso_time(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class RequestRecord:
    """What the HTTP layer learns about one request; the routes fill ``job`` / ``outcome`` as it goes."""

    request_id: str
    endpoint: str
    arrival: float = field(default_factory=time.time)  # wall clock, for the log
    started: float = field(default_factory=time.monotonic)
    status: int = 0
    outcome: str | None = None  # set by the route when the request was refused before admission
    job: Job | None = None

    def fields(self, log_prompts: bool, cache_blocks: tuple[int, int] | None) -> dict[str, Any]:
        job = self.job
        out: RequestOutput | None = job.last_output if job is not None else None
        outcome = (job.outcome if job is not None else None) or self.outcome or ("success" if self.status < 400
                                                                                 else "error")
        rec: dict[str, Any] = {
            "request_id": self.request_id, "endpoint": self.endpoint, "arrival": iso_time(self.arrival),
            "status": self.status, "outcome": outcome,
            "duration_s": round(time.monotonic() - self.started, 6)}
        if outcome != "success":
            rec["error_type"] = outcome
        if job is not None:
            rec["response_id"] = job.request_id
        if out is not None:
            reasons = [c.finish_reason for c in out.outputs]
            rec.update(finish_reason=reasons[0] if len(reasons) == 1 else reasons,
                       queue_time_s=_round(out.metrics.queue_time), ttft_s=_round(out.metrics.ttft),
                       prompt_tokens=len(out.prompt_token_ids), cached_tokens=out.num_cached_tokens,
                       generated_tokens=sum(len(c.token_ids) for c in out.outputs))
        if cache_blocks is not None:
            rec["cache_blocks_used"], rec["cache_blocks_total"] = cache_blocks
        rec["rss_bytes"] = resident_bytes()
        if log_prompts and job is not None:
            texts = [_prompt_text(p) for p in job.prompts]
            rec["prompt"] = texts[0] if len(texts) == 1 else texts
        return rec


def _prompt_text(prompt: Any) -> Any:
    """A prompt as the client gave it: its text when it had one (the engine's form also holds its token ids)."""
    if isinstance(prompt, Tokenized):
        return prompt.text if prompt.text is not None else prompt.ids
    if isinstance(prompt, dict):
        return prompt.get("prompt") if prompt.get("prompt") is not None else prompt.get("prompt_token_ids")
    return prompt


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


class RequestLog:
    """Writes one line per generation request; ``cache_blocks`` reads (used, total) from the engine, or None."""

    def __init__(self, log_prompts: bool, cache_blocks: Callable[[], tuple[int, int] | None]) -> None:
        self.log_prompts = log_prompts
        self.cache_blocks = cache_blocks

    def emit(self, record: RequestRecord) -> None:
        fields = record.fields(self.log_prompts, self.cache_blocks())
        logger.info("%s", text_line(fields), extra={"request": fields})


def text_line(f: dict[str, Any]) -> str:
    """The request's fields for a terminal: ``POST /generate 200 success id=... prompt=12(+0 cached) ...``."""
    parts = [f"{f['endpoint']} {f['status']} {f['outcome']}", f"id={f['request_id']}"]
    if "prompt_tokens" in f:
        parts.append(f"prompt={f['prompt_tokens']}({f['cached_tokens']} cached) generated={f['generated_tokens']} "
                     f"finish={f['finish_reason']}")
    for key in ("queue_time_s", "ttft_s", "duration_s"):
        if f.get(key) is not None:
            parts.append(f"{key[:-2]}={f[key]:.3f}s")
    if "cache_blocks_used" in f:
        parts.append(f"cache={f['cache_blocks_used']}/{f['cache_blocks_total']}")
    parts.append(f"rss={f['rss_bytes'] / 2**20:.0f}MiB")
    if "prompt" in f:
        parts.append(f"prompt_text={json.dumps(f['prompt'], ensure_ascii=False)}")
    return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """Each record as one JSON object: ``ts``, ``level``, ``logger``, ``message`` (+ a request's fields)."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {"ts": iso_time(record.created), "level": record.levelname, "logger": record.name}
        fields = getattr(record, "request", None)
        if isinstance(fields, dict):
            data["message"] = "request"
            data.update(fields)
        else:
            data["message"] = record.getMessage()
        if record.exc_info:
            data["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False, default=str)


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each record to ``sys.stderr`` as it is at that moment, not the stream of start-up (which an
    embedding program or a test harness may have swapped and closed since)."""

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def configure_logging(log_format: str) -> None:
    """Root logging for the server process: a timestamped text line, or one JSON object per line. Replaces
    the plain stderr handlers a previous call (or ``basicConfig``) installed; other handlers stay."""
    handler = StderrHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if type(h) not in (logging.StreamHandler, StderrHandler)]
    root.addHandler(handler)
    root.setLevel(logging.INFO)


class RequestIdMiddleware:
    """ASGI middleware: ``X-Request-Id`` on every response; one log line per generation request at its end."""

    def __init__(self, app: ASGIApp, log: Callable[[], RequestLog | None]) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(request_id(scope.get("headers", [])), scope.get("path", ""))
        scope.setdefault("state", {})["request_record"] = record
        header = (REQUEST_ID_HEADER, record.request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log = self.log()
            if log is not None and record.endpoint in GENERATION_PATHS and scope.get("method") == "POST":
                record.status = record.status or 500
                log.emit(record)
