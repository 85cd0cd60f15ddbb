"""Waiting on the engine for one HTTP request, and streaming its answer as server-sent events.

``guarded`` races an await against the client's disconnect and the request's deadline.
``generate_job_outputs`` runs a job's prompts as engine requests and merges their outputs. ``job_events``
turns a job's outputs into SSE chunks and always ends the stream with a last word: ``data: [DONE]`` after
the final output, or an error event (504 past the deadline, 503 when the engine died, 500 for any other
exception, whose traceback goes to the log and never to the client). ``SSEResponse`` sends those chunks,
each send bounded by ``--stream-stall-timeout`` and by the request's deadline, and reports why a stream
ended early (``client_disconnect`` only for a real disconnect, ``stalled``, ``timeout``, ``aborted`` at
shutdown, ``error``) to the ``on_close`` callback, which runs however the response ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from mla_runtime.engine.async_llm import AsyncLLM, EngineDeadError
from mla_runtime.outputs import RequestOutput
from mla_runtime.serving.protocol import ApiError
from mla_runtime.serving.responses import Job, StreamState, full_body, merge_outputs, sse

logger = logging.getLogger("mla_runtime.serving")

LARGE_DELTA_TOKENS = 256  # SSE chunks for more new tokens than this are built in a worker thread


class EventState(Protocol):
    """A job's stream in progress: ``chunks`` turns each engine output into the SSE bytes it adds."""

    job: Job

    @property
    def sent_tokens(self) -> list[int]: ...

    def chunks(self, out: RequestOutput) -> list[bytes]: ...


def openai_stream_error(e: ApiError) -> list[bytes]:
    """The last events of a stream that failed after it started, in OpenAI's shape (a 500 is followed by [DONE])."""
    return [sse(e.body())] + ([sse("[DONE]")] if e.status == 500 else [])


@dataclass(frozen=True)
class ApiShape:
    """How one API answers a job: its body, its stream's events, its error body and its stream's error events.
    The default is OpenAI's (``/generate`` and the ``/v1/*completions`` routes)."""

    body: Callable[[Job, RequestOutput], dict[str, Any]] = full_body
    stream: Callable[[Job], EventState] = StreamState
    error: Callable[[ApiError], dict[str, Any]] = ApiError.body
    stream_error: Callable[[ApiError], list[bytes]] = openai_stream_error


OPENAI = ApiShape()


class ClientDisconnected(Exception):
    pass


class RequestTimedOut(Exception):
    pass


class StreamStalled(Exception):
    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome  # "stalled" (the client stopped reading) or "timeout" (past the deadline)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def guarded(request: Request, awaitable: Awaitable[Any], deadline: float) -> Any:
    """Await ``awaitable`` unless the client disconnects or the deadline (loop time) passes first;
    then cancel it (which aborts the engine request it waits on) and raise."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        done, _ = await asyncio.wait({task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await task
    if task in done:
        return task.result()
    raise ClientDisconnected() if watcher in done else RequestTimedOut()


async def generate_job_outputs(llm: AsyncLLM, job: Job) -> AsyncGenerator[RequestOutput, None]:
    """The job's outputs as the engine produces them; for a batch of prompts, one engine request each, run
    concurrently and merged (``merge_outputs``) each time one advances, once every prompt has started.
    The first failure (e.g. the engine refusing a prompt) is raised; closing this generator aborts them all."""
    if len(job.prompts) == 1:
        async for out in llm.generate(job.prompts[0], job.params, job.request_id):
            yield out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, prompt: Any, request_id: str) -> None:
        try:
            async for out in llm.generate(prompt, job.params, request_id):
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, prompt, rid))
             for i, (prompt, rid) in enumerate(zip(job.prompts, job.engine_request_ids))]
    latest: list[RequestOutput | None] = [None] * len(tasks)
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                running -= 1
                continue
            latest[i] = item
            if all(x is not None for x in latest):
                yield merge_outputs(job, latest)  # type: ignore[arg-type]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def last_output(gen: AsyncIterator[RequestOutput], first: RequestOutput) -> RequestOutput:
    out = first
    while not out.finished:
        out = await anext(gen)
    return out


async def render(state: EventState, out: RequestOutput) -> list[bytes]:
    """``state.chunks(out)``; in a worker thread when it decodes many tokens (log-probabilities, a long delta)."""
    new_tokens = sum(len(c.token_ids) for c in out.outputs) - sum(state.sent_tokens)
    if state.job.logprobs is not None or new_tokens > LARGE_DELTA_TOKENS:
        return await asyncio.to_thread(state.chunks, out)
    return state.chunks(out)


@dataclass
class StreamEnd:
    """How a stream's event generator ended: its outcome (None while running or when cut from outside)
    and the last engine output it saw."""

    last: RequestOutput
    outcome: str | None = None


def timeout_error(seconds: float) -> ApiError:
    return ApiError(504, f"request exceeded request_timeout ({seconds:g} s) and was aborted")


async def job_events(job: Job, gen: AsyncIterator[RequestOutput], end: StreamEnd, deadline: float,
                     request_timeout: float, fault_after: int | None = None,
                     shape: ApiShape = OPENAI) -> AsyncGenerator[bytes, None]:
    """SSE chunks of ``job`` from its first output (``end.last``) to the end, in the API's ``shape``;
    ``fault_after``: raise after that many engine outputs (fault injection, see ``MLA_FAULT_INJECTION``)."""
    state = shape.stream(job)
    seen = 1
    try:
        for chunk in await render(state, end.last):
            yield chunk
        while not end.last.finished:
            if fault_after is not None and seen >= fault_after:
                raise RuntimeError("injected stream fault (MLA_FAULT_INJECTION)")
            async with asyncio.timeout_at(deadline):
                end.last = await anext(gen)
            seen += 1
            for chunk in await render(state, end.last):
                yield chunk
        end.outcome = "success"
    except TimeoutError:
        end.outcome = "timeout"
        for chunk in shape.stream_error(timeout_error(request_timeout)):
            yield chunk
    except EngineDeadError:
        end.outcome = "error"
        for chunk in shape.stream_error(ApiError(503, "the engine failed; see the server log")):
            yield chunk
    except Exception:  # noqa: BLE001 - a server-side fault: logged with its traceback, told to the client
        logger.exception("%s %s: the stream failed", job.endpoint, job.request_id)
        end.outcome = "error"
        for chunk in shape.stream_error(ApiError(500, "internal error: the stream failed; see the server log")):
            yield chunk


class SSEResponse(StreamingResponse):
    """A ``StreamingResponse`` whose sends are bounded in time, that runs ``on_close(reason)`` however the
    response ends, and that ends with an error event when the server cancels it at shutdown."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[str], Awaitable[None]],
                 shutting_down: Callable[[], bool], deadline: float, stall_timeout: float,
                 stream_error: Callable[[ApiError], list[bytes]] = openai_stream_error, **kwargs: Any) -> None:
        super().__init__(content, media_type="text/event-stream", **kwargs)
        self.stream_error = stream_error
        self.on_close = on_close
        self.shutting_down = shutting_down
        self.deadline = deadline
        self.stall_timeout = stall_timeout

    async def stream_response(self, send: Any) -> None:
        async def timed_send(message: Any) -> None:
            remaining = self.deadline - asyncio.get_running_loop().time()
            try:  # past the deadline, the closing event still gets 1 s
                async with asyncio.timeout(min(self.stall_timeout, max(remaining, 1.0))):
                    await send(message)
            except TimeoutError:
                raise StreamStalled("timeout" if remaining < self.stall_timeout else "stalled") from None

        await super().stream_response(timed_send)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        reason = "client_disconnect"  # the response ended before the body: Starlette saw http.disconnect
        try:
            await super().__call__(scope, receive, send)
        except StreamStalled as e:
            reason = e.outcome
        except asyncio.CancelledError:
            reason = "aborted"
            if not self.shutting_down():
                raise
            end = b"".join(self.stream_error(ApiError(503, "aborted: the server shut down before the request "
                                                              "finished")))
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": end, "more_body": False})
        except Exception:  # noqa: BLE001 - e.g. a transport error: logged, counted as an error
            logger.exception("sending a stream failed")
            reason = "error"
        finally:
            await self.on_close(reason)
