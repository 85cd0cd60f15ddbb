"""The HTTP server around ``AsyncLLM``: configuration, schemas, metrics and the FastAPI app.

Modules: ``config`` (flags + serve.yaml → ``EngineConfig`` / ``ServerConfig``), ``protocol`` (request
schemas, the JSON error shape), ``responses`` (bodies and SSE chunks), ``metrics`` (Prometheus, one
registry per app), ``runtime`` (engine start-up, admission, per-request accounting), ``app`` (routes).
"""

from mla_runtime.serving.app import build_app
from mla_runtime.serving.config import ServerConfig, resolve

__all__ = ["build_app", "ServerConfig", "resolve"]
