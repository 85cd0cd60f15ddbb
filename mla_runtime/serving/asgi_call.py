"""One HTTP request through an ASGI app in this process, its response as a stream of parts.

A replica behind Ray Serve receives each request as a plain, picklable ``HttpRequest`` (method, path, query,
headers, body) from the ingress, runs it through the very FastAPI app of the single-process server
(``serving/app.py``) and streams the answer back: first ``ResponseStart`` (status and headers), then the body's
chunks as they are sent (an SSE stream stays a stream). When the consumer goes away (the client disconnected,
the ingress cancelled the call) the app sees ``http.disconnect``, as under uvicorn, and is cancelled if it does
not end within a second, so a request's engine work is aborted and its cache blocks freed on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from mla_runtime.serving.protocol import ApiError

logger = logging.getLogger("mla_runtime.serving")

QUEUE_PARTS = 64  # response messages buffered before the app's send() waits (back-pressure)
DISCONNECT_GRACE_S = 1.0  # after a disconnect, how long the app may take to end before it is cancelled


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None
    route: Any = None  # the routing key, read by the request router (never by the app)
    pin: str | None = None  # a replica id this request must go to (metrics scrapes)
    avoid: frozenset[str] = field(default_factory=frozenset)  # replica ids not to route to (retries)

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[str, str], ...]


def scope_of(req: HttpRequest) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode("utf-8"),
            "root_path": "", "query_string": req.query, "client": req.client, "server": None,
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in req.headers], "state": {}}


async def call_asgi(app: Any, req: HttpRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``req`` through ``app``; yield its ``ResponseStart``, then each non-empty body chunk."""
    parts: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(QUEUE_PARTS)
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set():
            raise OSError("the client went away")
        await parts.put(message)

    async def run() -> None:
        try:
            await app(scope_of(req), receive, send)
        finally:
            if not gone.is_set():
                await parts.put(None)  # the end, after every part the app sent

    task = asyncio.create_task(run())
    try:
        async for part in _parts(parts, task):
            yield part
    finally:
        gone.set()
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: an error the app answered with a 500 was logged by the app
        if not task.done():
            while not parts.empty():  # unblock a send() waiting on a full queue
                parts.get_nowait()
            done, _ = await asyncio.wait([task], timeout=DISCONNECT_GRACE_S)
            if not done:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


async def _parts(parts: asyncio.Queue[dict[str, Any] | None], task: asyncio.Task[None]
                 ) -> AsyncIterator[ResponseStart | bytes]:
    """The app's messages as parts. An app that fails after answering (Starlette re-raises a handled error after
    its 500) is logged, as uvicorn would; one that fails before answering gets a 500 here."""
    started = False
    while True:
        message = await parts.get()
        if message is None:
            break
        if message["type"] == "http.response.start":
            started = True
            yield ResponseStart(int(message["status"]), tuple(
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", ())))
        elif message["type"] == "http.response.body":
            if message.get("body"):
                yield bytes(message["body"])
            if not message.get("more_body", False):
                break
    if message is None and task.done() and not task.cancelled() and task.exception() is not None:
        logger.error("exception in the ASGI application", exc_info=task.exception())
        if not started:
            yield ResponseStart(500, (("content-type", "application/json"),))
            yield json.dumps(ApiError(500, "internal error; see the server log").body()).encode()
