"""``AsyncLLM``: the engine for asyncio programs (the HTTP server), with one stream per request.

The engine steps in one background thread, which alone touches the scheduler. Callers never wait for a
step: ``add_request`` validates and tokenizes the request in the caller's thread (bad input raises
ValueError there) and queues it, ``abort`` queues the abort, and the engine thread applies both, in order,
before its next step; ``stats`` reads the snapshot the engine thread publishes after every step. So a long
prefill step never stalls the asyncio loop (streams, health checks, new requests). Each step's outputs
are handed to the asyncio loop of the request that owns them. ``generate`` is an async iterator of
cumulative ``RequestOutput``s; leaving it early (a client that disconnects, a timeout) aborts the
request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator

from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.llm_engine import LLMEngine, PromptType, RequestState
from mla_runtime.outputs import RequestOutput
from mla_runtime.sampling_params import SamplingParams

logger = logging.getLogger("mla_runtime")


class EngineDeadError(RuntimeError):
    pass


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None, **kwargs) -> None:
        self.engine = engine or LLMEngine(config or EngineConfig(**kwargs))
        self._lock = threading.Lock()  # held by the engine thread while it steps or applies queued operations
        self._ops: deque[tuple[str, RequestState | str]] = deque()  # ("add", state) | ("abort", request_id)
        self._stats = self.engine.stats()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.error: BaseException | None = None
        self.step_hooks: list = []  # called after each step with (engine, outputs), in the engine thread
        self._thread = threading.Thread(target=self._loop, name="mla-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped:
            try:
                with self._lock:
                    self._apply_ops()
                    busy = self.engine.has_unfinished_requests()
                    if busy:
                        outputs = self.engine.step()
                        for hook in self.step_hooks:
                            hook(self.engine, outputs)
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
                try:
                    self.engine.submit(arg)
                except ValueError as e:
                    self._deliver(arg.request_id, e)
            else:
                assert isinstance(arg, str)
                self.engine.abort(arg)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, queue = stream
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            self._streams.pop(request_id, None)

    def _fail_all(self, e: BaseException) -> None:
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError(f"engine failed: {e}"))

    # -- public API ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> asyncio.Queue:
        if self.error is not None:
            raise EngineDeadError(f"engine failed earlier: {self.error}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        state = self.engine.prepare_request(request_id, prompt, params)  # bad input raises here
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._ops.append(("add", state))
        self._wake.set()
        return queue

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        queue = self.add_request(request_id, prompt, params)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._ops.append(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict[str, float]:
        """The engine's counters as of its last step (published by the engine thread; never waits for a step)."""
        return dict(self._stats)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout)
