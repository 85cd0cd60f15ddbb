"""A replica's start-up wait says what it waits for and ends at ``startup_timeout``; the probe generation ends at
``step_timeout``."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from mla_runtime.serving.config import ServerConfig
from mla_runtime.serving.runtime import ServingRuntime as Runtime


def runtime(status: str, ready: bool = False) -> SimpleNamespace:
    return SimpleNamespace(ready=ready, status=status)


def test_the_wait_logs_the_stage_and_ends_at_its_deadline(caplog):
    rt = runtime("running the probe generation")
    with caplog.at_level(logging.INFO, logger="mla_runtime"), \
            pytest.raises(RuntimeError, match=r"replica r1: not ready after 0 s \(startup_timeout 0.4 s\), still "
                                              r"running the probe generation"):
        asyncio.run(Runtime.wait_ready(rt, 0.4, "replica r1", log_every_s=0.1))  # type: ignore[arg-type]
    assert any("replica r1 still starting" in r.getMessage() and "probe generation" in r.getMessage()
               for r in caplog.records)


def test_the_wait_ends_on_a_failed_start_and_returns_when_ready():
    with pytest.raises(RuntimeError, match="replica r2: start-up failed: no weights"):
        asyncio.run(Runtime.wait_ready(runtime("start-up failed: no weights"), 60, "replica r2"))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="replica r3: loading weights"):
        asyncio.run(Runtime.wait_ready(runtime("loading weights"), 60, "replica r3", [ValueError("x")]))  # type: ignore[arg-type]
    asyncio.run(Runtime.wait_ready(runtime("ready", ready=True), 0.0, "replica r4"))  # type: ignore[arg-type]


def test_startup_timeout_is_a_setting():
    assert ServerConfig().startup_timeout == 1800.0
    with pytest.raises(ValueError, match="startup_timeout"):
        ServerConfig(startup_timeout=0)
