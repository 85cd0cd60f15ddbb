"""The HTTP server process: resolve the configuration, build the app, run uvicorn, exit with a status.

Endpoints: POST /generate, /v1/completions, /v1/chat/completions (SSE with "stream": true);
GET /v1/models, /health, /ready, /metrics.

SIGTERM or Ctrl-C stops accepting connections, lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, aborts the rest, stops the engine and exits 0. A start-up failure
(bad configuration, weights that do not load, a failed probe generation) exits 1 with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from types import FrameType

import uvicorn

from mla_runtime.engine.llm_engine import LLMEngine
from mla_runtime.engine.tp_workers import launched_by_torchrun, torchrun_rank
from mla_runtime.serving.app import build_app
from mla_runtime.serving.config import resolve

logger = logging.getLogger("mla_runtime.serving")


class Server(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM/SIGINT also tells the app to stop admitting
    requests, and that the handled signal is not re-raised after the graceful shutdown (uvicorn
    re-raises it, which would end the process with -15 instead of 0)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.info("received %s: finishing in-flight requests (up to %s s), refusing new ones",
                        signal.Signals(sig).name, self.config.timeout_graceful_shutdown)
            self.on_exit()
        super().handle_exit(sig, frame)

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


def main(argv: Sequence[str] | None = None, prog: str = "server.py") -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine_config, config = resolve(argv, prog=prog)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if engine_config.tensor_parallel_size > 1 and launched_by_torchrun() and torchrun_rank() != 0:
        LLMEngine(engine_config)  # a worker rank under torchrun: serves rank 0's steps, then exits
        return 0
    if why := port_taken(config.host, config.port):  # before the model loads
        print(f"{prog}: error: cannot listen on {config.host}:{config.port}: {why} (pick another --port)",
              file=sys.stderr)
        return 1
    failures: list[BaseException] = []
    server: Server | None = None

    def on_fatal(e: BaseException) -> None:
        failures.append(e)
        if server is not None:
            server.should_exit = True

    app = build_app(engine_config, config, on_fatal=on_fatal)
    server = Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                   timeout_graceful_shutdown=config.shutdown_timeout, access_log=False),
                    on_exit=app.state.runtime.begin_shutdown)
    server.run()
    if failures:
        print(f"{prog}: start-up failed: {failures[0]}", file=sys.stderr)
        return 1
    return 0

