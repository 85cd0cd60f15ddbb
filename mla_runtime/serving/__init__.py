"""The HTTP server around ``AsyncLLM``: configuration, schemas, metrics and the FastAPI app.

Modules: ``config`` (flags + serve.yaml → ``EngineConfig`` / ``ServerConfig``), ``protocol`` (request
schemas, the JSON error shape), ``responses`` (bodies and SSE chunks), ``metrics`` (Prometheus, one
registry per app), ``runtime`` (engine start-up, admission, per-request accounting), ``app`` (routes).

The public names are imported on first use, so that ``serving.config`` (and ``--help``) loads without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mla_runtime.serving.app import build_app
    from mla_runtime.serving.config import ServerConfig, resolve

__all__ = ["build_app", "ServerConfig", "resolve"]
_HOMES = {"build_app": "mla_runtime.serving.app", "ServerConfig": "mla_runtime.serving.config",
          "resolve": "mla_runtime.serving.config"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'mla_runtime.serving' has no attribute {name!r}")
