"""``AsyncLLM``: the engine for asyncio programs (the HTTP server), with one stream per request.

The engine steps in one background thread, which alone touches the scheduler. Callers never wait for a
step: ``prepare`` validates and tokenizes a request in a worker thread (bad input raises ValueError),
``add_request`` queues it, ``abort`` queues the abort, and the engine thread applies both, in order,
before its next step; ``stats`` reads the snapshot the engine thread publishes after every step. So
neither a long prefill step nor the tokenisation of a large prompt stalls the asyncio loop (streams, health
checks, new requests). Each step's outputs are handed to the asyncio loop of the request that owns them.
A stream keeps only the latest output (outputs are cumulative, each supersedes the one before), so a
consumer that falls behind holds one output, not a queue of copies. ``generate`` is an async iterator of
cumulative ``RequestOutput``s (a slow consumer skips intermediate ones); leaving it early (a client that
disconnects, a timeout) aborts the request and frees its blocks.

``step_started`` is the monotonic time at which the current step began (None between steps), for a
watchdog that notices a step that hangs (e.g. a stopped tensor-parallel rank).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator

from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.info import EngineStats
from mla_runtime.engine.llm_engine import LLMEngine, PromptType, RequestState
from mla_runtime.outputs import RequestOutput
from mla_runtime.sampling_params import SamplingParams

logger = logging.getLogger("mla_runtime")


class EngineDeadError(RuntimeError):
    pass


class Stream:
    """One request's outputs as the asyncio side sees them: the latest output, or the error that ended it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the stream's loop: replace the pending output (or record the error) and wake ``get``."""
        if isinstance(item, BaseException):
            self.error = item
        else:
            self.latest = item
        self.ready.set()

    async def get(self) -> RequestOutput:
        """The newest output since the last call (waits for one); raises the error that ended the stream."""
        while self.latest is None and self.error is None:
            self.ready.clear()
            await self.ready.wait()
        if self.latest is None:
            assert self.error is not None
            raise self.error
        out, self.latest = self.latest, None
        return out


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None, **kwargs) -> None:
        self.engine = engine or LLMEngine(config or EngineConfig(**kwargs))
        self._lock = threading.Lock()  # held by the engine thread while it steps or applies queued operations
        self._ops: deque[tuple[str, RequestState | str]] = deque()  # ("add", state) | ("abort", request_id)
        self._stats = self.engine.stats()
        self._wake = threading.Event()
        self._streams: dict[str, Stream] = {}
        self._stopped = False
        self.error: BaseException | None = None
        self.step_started: float | None = None  # monotonic start of the step in progress
        self.step_hooks: list = []  # called after each step with (engine, outputs), in the engine thread
        self._thread = threading.Thread(target=self._loop, name="mla-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def alive(self) -> bool:
        """The engine thread is running (it ends on a failed step or at shutdown)."""
        return self._thread.is_alive()

    # -- engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped:
            try:
                with self._lock:
                    self._apply_ops()
                    busy = self.engine.has_unfinished_requests()
                    if busy:
                        self.step_started = time.monotonic()
                        outputs = self.engine.step()
                        for hook in self.step_hooks:
                            hook(self.engine, outputs)
                        self.step_started = None
                    self._stats = self.engine.stats()
            except BaseException as e:  # the engine is broken: fail every request, loudly
                logger.exception("engine step failed")
                self.error = e
                self._fail_all(e)
                return
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            for out in outputs:
                self._deliver(out.request_id, out)

    def _apply_ops(self) -> None:
        """Queued submissions and aborts, in the order they were made (engine thread, under the lock)."""
        while self._ops:
            op, arg = self._ops.popleft()
            if op == "add":
                assert isinstance(arg, RequestState)
                self.engine.submit(arg)
            else:
                assert isinstance(arg, str)
                self.engine.abort(arg)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.put, item)
        except RuntimeError:  # the caller's loop is closed
            self._streams.pop(request_id, None)

    def _fail_all(self, e: BaseException) -> None:
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError(f"engine failed: {e}"))

    # -- public API ----------------------------------------------------------------------------
    def _reserve(self, request_id: str) -> Stream:
        """The request's stream, registered under its id: the one check that the id is free (the engine applies the
        queued aborts and additions in the order they were made, so an id freed here is free there too)."""
        if self.error is not None:
            raise EngineDeadError(f"engine failed earlier: {self.error}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = self._streams[request_id] = Stream(asyncio.get_running_loop())
        return stream

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> Stream:
        """Validate and tokenize in the caller's thread, then queue; see ``generate`` for the asyncio way."""
        stream = self._reserve(request_id)
        try:
            state = self.engine.prepare_request(request_id, prompt, params)  # bad input raises here
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self._queue(state)
        return stream

    def _queue(self, state: RequestState) -> None:
        self._ops.append(("add", state))
        self._wake.set()

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        stream = self._reserve(request_id)
        try:
            state = await asyncio.to_thread(self.engine.prepare_request, request_id, prompt, params)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self._queue(state)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._ops.append(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step (published by the engine thread; never waits for a step)."""
        return self._stats

    def step_seconds(self) -> float:
        """How long the step in progress has run (0 between steps)."""
        started = self.step_started
        return 0.0 if started is None else time.monotonic() - started

    def shutdown(self, timeout: float = 5.0, flush_timeout: float = 30.0) -> None:
        """Stop the engine thread, then the engine (its disk tier's flush, up to ``flush_timeout`` s, and its
        tensor-parallel ranks). An engine thread that does not stop within ``timeout`` (a hung step) is left behind,
        and so is the engine it holds."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop; leaving it behind")
            return
        self.engine.shutdown(flush_timeout)
