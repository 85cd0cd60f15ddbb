"""The HTTP server process: resolve the configuration, build the app, run uvicorn, exit with a status.

Endpoints: POST /generate, /v1/completions, /v1/chat/completions (SSE with "stream": true);
GET /v1/models, /health, /ready, /metrics, /openapi.json, /docs (docs/serving.md).

SIGTERM or Ctrl-C starts a drain: ``/ready`` answers 503 and new generation requests get 503 while the
listener stays open and in-flight requests finish, for up to ``--shutdown-timeout`` seconds; then the
listener closes, the rest are aborted, the engine stops and the process exits 0 (a second signal ends the
drain at once). A fault after start-up (the engine thread died, a step outlived ``--step-timeout``, e.g. a
hung tensor-parallel rank) drains the same way and exits 1, so that systemd, Kubernetes or torchrun
restarts the server. A start-up failure (bad configuration, weights that do not load, a failed probe
generation) exits 1 with the reason.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.tp_workers import is_torchrun_worker, run_torchrun_worker
from mla_runtime.serving.app import build_app
from mla_runtime.serving.config import ReplicaConfig, ServerConfig, resolve_all
from mla_runtime.serving.http import GuardedH11Protocol
from mla_runtime.serving.request_log import configure_logging

logger = logging.getLogger("mla_runtime.serving")


def uvicorn_config(app: Any, config: ServerConfig, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's configuration for ``app``: the h11 protocol with the header/body timeout, the stream stall
    abort and the connection cap (``serving/http.py``), idle keep-alive connections closed after 5 s."""
    protocol = GuardedH11Protocol.configured(config.header_timeout, config.stream_stall_timeout,
                                             config.max_connections)
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, http=protocol,
                          timeout_keep_alive=5, log_config=None if config.log_format == "json" else LOGGING_CONFIG,
                          timeout_graceful_shutdown=config.shutdown_timeout,  # type: ignore[arg-type]  # float s
                          access_log=False)


class Server(uvicorn.Server):
    """uvicorn's server with a drain before its shutdown: the first SIGTERM/SIGINT (or ``begin_drain``)
    tells the app to refuse new requests, and the listener stays open until no sequence is in flight or
    the drain's time is up; then uvicorn shuts down as usual. The handled signal is not re-raised after the
    graceful shutdown (uvicorn re-raises it, which would end the process with -15 instead of 0)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None], in_flight: Callable[[], int]) -> None:
        super().__init__(config)
        self.on_exit = on_exit
        self.in_flight = in_flight
        self.drain_why: str | None = None
        self.drain_until: float | None = None

    def begin_drain(self, why: str) -> None:
        """Refuse new requests from now on. This only sets flags (``on_exit`` must too), since a signal handler
        calls it between two bytecodes of whatever the main thread was doing: a log write, a metric update under
        its lock. The drain's log line and deadline come at the next tick, on the event loop."""
        if self.drain_why is not None or self.should_exit:
            return
        self.on_exit()
        self.drain_why = why

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_why is None and not self.should_exit:
            self.begin_drain(f"received {signal.Signals(sig).name}")
            return
        super().handle_exit(sig, frame)  # a second signal ends the drain

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.drain_why is None:
            return False
        if self.drain_until is None:
            grace = float(self.config.timeout_graceful_shutdown or 0)
            logger.info("%s: finishing in-flight requests (up to %s s), refusing new ones", self.drain_why, grace)
            self.drain_until = time.monotonic() + grace
        left = self.drain_until - time.monotonic()
        if self.in_flight() > 0 and left > 0:
            return False
        self.config.timeout_graceful_shutdown = max(left, 1.0)  # type: ignore[assignment]  # uvicorn's wait, ≥ 1 s
        return True

    def capture_signals(self):  # type: ignore[override]
        @contextlib.contextmanager
        def handlers():
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        return handlers()


def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (bound as uvicorn binds it), or None when it can."""
    if port == 0:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as e:
        return e.strerror or str(e)
    return None


def serve_replicas(engine_config: EngineConfig, config: ServerConfig, replicas: ReplicaConfig, prog: str) -> int:
    """``--replicas N``: the same endpoints through Ray Serve (``serving/ray_replicas.py``, imported only here)."""
    if why := port_taken(config.host, config.port):
        print(f"{prog}: error: cannot listen on {config.host}:{config.port}: {why} (pick another --port)",
              file=sys.stderr)
        return 1
    try:
        from mla_runtime.serving import ray_replicas
    except ImportError as e:
        print(f"{prog}: error: --replicas needs Ray Serve ({e}); install it with: pip install 'mla-runtime[ray]'",
              file=sys.stderr)
        return 2
    return ray_replicas.main(engine_config, config, replicas, prog)


def main(argv: Sequence[str] | None = None, prog: str = "server.py") -> int:
    try:
        engine_config, config, replicas = resolve_all(argv, prog=prog)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    configure_logging(config.log_format)
    # `kill -USR1 <pid>` writes every thread's stack to stderr: what a server that does not stop is doing (where
    # stderr is a file: not under an embedding program's or a test's capture)
    with contextlib.suppress(AttributeError, ValueError, OSError):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if replicas.enabled:
        return serve_replicas(engine_config, config, replicas, prog)
    if is_torchrun_worker(engine_config):
        run_torchrun_worker(engine_config)  # a worker rank under torchrun: serves rank 0's steps until it stops
        return 0
    if why := port_taken(config.host, config.port):  # before the model loads
        print(f"{prog}: error: cannot listen on {config.host}:{config.port}: {why} (pick another --port)",
              file=sys.stderr)
        return 1
    failures: list[BaseException] = []
    server: Server | None = None

    def on_fatal(e: BaseException) -> None:
        failures.append(e)
        if server is not None and rt.fault is not None:
            server.begin_drain("fault")
        elif server is not None:
            server.should_exit = True

    app = build_app(engine_config, config, on_fatal=on_fatal)
    rt = app.state.runtime
    server = Server(uvicorn_config(app, config), on_exit=rt.begin_shutdown, in_flight=lambda: rt.in_flight)
    server.run()
    if failures:
        print(f"{prog}: {'stopped after a fault' if rt.fault else 'start-up failed'}: {failures[0]}",
              file=sys.stderr)
        return 1
    return 0

