"""Connection hygiene for uvicorn's h11 protocol: header/body timeout, a cap on open connections, and an
abort of connections whose client stops reading.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) and answers 503 beyond
``limit_concurrency``, but it never times out a request that is still arriving: a client that sends one
header byte per second (slowloris) holds its connection for ever. ``GuardedH11Protocol`` adds three
timers per connection, all on the event loop (no thread, no polling):

- the request timer runs from the first byte of a request (or from the connection's opening) until the
  request, headers and body, has fully arrived; when it fires first, the connection is aborted;
- the stall timer runs while the transport's write buffer is above its high-water mark (asyncio calls
  ``pause_writing``: the client does not read); when it fires (``stall_timeout`` + ``STALL_MARGIN``: the
  app's own bounded send ends the stream first and records why), the connection is aborted, so neither the
  slot nor the socket outlives a client that stopped reading;
- a connection opened while ``max_connections`` are open is aborted at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("mla_runtime.serving")

STALL_MARGIN = 2.0  # s: the app's own send timeout fires first and records the outcome; this is the backstop
_ARRIVED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)  # the client's side of the request is complete


class GuardedH11Protocol(H11Protocol):
    header_timeout: float = 10.0
    stall_timeout: float = 30.0
    max_connections: int = 1000

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._request_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None

    @classmethod
    def configured(cls, header_timeout: float, stall_timeout: float, max_connections: int) -> type[GuardedH11Protocol]:
        """A subclass with these limits (uvicorn builds one protocol object per connection from a class)."""
        return type(cls.__name__, (cls,), {"header_timeout": header_timeout, "stall_timeout": stall_timeout,
                                           "max_connections": max_connections})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            logger.warning("refused a connection: %d open (max_connections %d)", len(self.connections) - 1,
                           self.max_connections)
            transport.abort()
            return
        self._arm_request_timer()

    def data_received(self, data: bytes) -> None:
        if self._request_timer is None and self.conn.their_state not in _ARRIVED:
            self._arm_request_timer()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state in _ARRIVED:
            self._cancel("_request_timer")

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state not in _ARRIVED:  # the next request is idle: uvicorn's keep-alive timer runs
            self._cancel("_request_timer")

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel("_request_timer")
        self._cancel("_stall_timer")
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.stall_timeout + STALL_MARGIN, self._abort, "stopped reading")

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel("_stall_timer")

    def _arm_request_timer(self) -> None:
        self._cancel("_request_timer")
        self._request_timer = self.loop.call_later(self.header_timeout, self._abort, "sent an incomplete request")

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _abort(self, why: str) -> None:
        limit = self.header_timeout if why.startswith("sent") else self.stall_timeout + STALL_MARGIN
        prefix = f"{self.client[0]}:{self.client[1]} " if self.client else ""
        logger.info("%sconnection aborted: the client %s for %g s", prefix, why, limit)
        self.transport.abort()
