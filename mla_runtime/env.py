"""Every environment variable the runtime reads, read here and nowhere else in ``mla_runtime``.

Variable             Default         Read by                What it does
-------------------  --------------  ---------------------  -------------------------------------------------------
MLA_API_KEY          unset: no key   serving/config.py      the API key the server requires (--api-key and
                                                            serving.api_key override it)
HF_HUB_CACHE         the hub's       hub.py                 hub cache directory for repo ids
HF_HOME              the hub's       hub.py                 hub cache at $HF_HOME/hub when HF_HUB_CACHE is unset
HF_HUB_OFFLINE       off             hub.py                 1/on/yes/true: repo ids only from the local cache
TORCHELASTIC_RUN_ID  unset           engine/tp_workers.py   set by torchrun: this process is one of its ranks
WORLD_SIZE           1               engine/tp_workers.py   set by torchrun: the number of ranks
RANK                 0               engine/tp_workers.py   set by torchrun: this process's rank
LOCAL_RANK           the rank        engine/worker.py       set by torchrun: this process's rank on its machine
                                                            (its GPU, cuda:LOCAL_RANK)
MLA_TP_WAIT_S        900             engine/tp_workers.py   how long rank 0 waits for the tensor-parallel ranks to
                                                            join, and then to load their shards and allocate their
                                                            caches (logged every 10 s); past it the start fails
MLA_FAULT_INJECTION  unset: none     serving/runtime.py     test hook: stream:K, step:K or slow_step:K faults;
                     engine/tp_workers.py                   slow_load:K, a worker rank's load K s longer

Read by others (documented in docs/configuration.md, not read here): ``mla_kernels.cpu_ops`` reads ``CXX``,
``MLA_KERNEL_CACHE``, ``XDG_CACHE_HOME``, ``MLA_KERNEL_BUILD_WAIT_S``, ``MLA_CPU_ISA`` and ``MLA_CPU_EMULATE_AMX``
(a test hook) itself (the kernels
package never imports ``mla_runtime``);
huggingface_hub reads ``HF_TOKEN``; the tests read ``MLA_REQUIRE_PROMTOOL``, ``MLA_CONFORMANCE_SEED``,
``MLA_CONFORMANCE_DRAWS`` and ``CI`` and set
``TRITON_INTERPRET``.

Every function reads the environment when called (a value set after import takes effect); ``environ`` replaces
``os.environ`` for a caller that resolves a configuration from a given environment.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

API_KEY = "MLA_API_KEY"
FAULT_INJECTION = "MLA_FAULT_INJECTION"
TP_WAIT = "MLA_TP_WAIT_S"
TP_WAIT_DEFAULT_S = 900.0
HF_HUB_CACHE = "HF_HUB_CACHE"
HF_HOME = "HF_HOME"
HF_HUB_OFFLINE = "HF_HUB_OFFLINE"
TRUE = {"1", "on", "yes", "true"}


def _get(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value; None when unset or empty."""
    return (os.environ if environ is None else environ).get(name) or None


def api_key(environ: Mapping[str, str] | None = None) -> str | None:
    return _get(API_KEY, environ)


@contextmanager
def overriding(name: str, value: str) -> Iterator[None]:
    """Set a variable for a block and put the previous value back after. The environment, not a module global,
    so that processes started meanwhile (tensor-parallel ranks) see it too."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def hf_hub_cache() -> str | None:
    """The hub cache directory (None: huggingface_hub's default)."""
    if cache := _get(HF_HUB_CACHE):
        return cache
    home = _get(HF_HOME)
    return os.path.join(home, "hub") if home else None


def hf_hub_offline() -> bool:
    return (_get(HF_HUB_OFFLINE) or "").strip().lower() in TRUE


def torchrun_world_size() -> int | None:
    """The ranks torchrun started, when this process is one of them; else None."""
    if os.environ.get("TORCHELASTIC_RUN_ID") is None:  # torchrun sets it; present at all is what counts
        return None
    return int(_get("WORLD_SIZE") or "1")


def torchrun_rank() -> int:
    return int(_get("RANK") or "0")


def torchrun_local_rank() -> int | None:
    """This process's rank on its machine when torchrun started it (it picks the GPU); else None."""
    if os.environ.get("TORCHELASTIC_RUN_ID") is None:
        return None
    return int(_get("LOCAL_RANK") or "0")


def tp_wait_s() -> float:
    """``MLA_TP_WAIT_S``: seconds rank 0 waits for the other tensor-parallel ranks at start-up (a positive number)."""
    raw = _get(TP_WAIT)
    if raw is None:
        return TP_WAIT_DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{TP_WAIT}={raw!r}: a positive number of seconds")
    return value


def fault_injection() -> str | None:
    """Test hook, never set in production: ``MLA_FAULT_INJECTION`` as set (``injected_fault`` parses it); None
    when unset."""
    return _get(FAULT_INJECTION)


def injected_fault(kind: str) -> int | None:
    """``K`` where ``MLA_FAULT_INJECTION`` is ``kind:K`` (a positive integer); None when unset or of another kind.
    The kinds: ``stream``, ``step`` and ``slow_step`` (``serving/runtime.fault_injection``), ``slow_load``
    (``engine/tp_workers.py``)."""
    name, _, count = (fault_injection() or "").partition(":")
    return int(count) if name == kind and count.isdigit() and int(count) > 0 else None
