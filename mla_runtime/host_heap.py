"""Keep a CPU engine's freed activations mapped, so that a step does not fault its memory in again.

A CPU step allocates its activations afresh: a prefill of 8 × 128 tokens in float32 makes hundreds of tensors of 1 to
13 MB. glibc's allocator serves a request of more than 128 KiB by ``mmap`` until frees have raised that threshold, and
gives the free memory at the top of its heap back to the kernel (trimming). Either way the next step's tensors fault
every page in again and the kernel zeroes each one first: on a 2-core Xeon VM (``python bench/profile_prefill.py``
under ``torch.profiler``) a float32 prefill spent half its time in ``aten::cat``, ``copy_`` and ``fill_`` of fresh
tensors, at about 1 GB/s.

``retain(reserve_bytes)`` sets two of glibc's ``mallopt`` parameters once the engine has loaded (the load's large
transient buffers are gone by then):

- ``M_MMAP_THRESHOLD`` to 32 MiB, glibc's largest: requests below it come from the heap, whose freed blocks the next
  step reuses;
- ``M_TRIM_THRESHOLD`` to the activation reserve (at least 64 MiB): up to that much free memory stays at the top of
  the heap. The memory planner already counts the reserve as in use (``plan.activation_reserve_bytes``), so the
  resident memory does not grow past what was planned.

Requests of 32 MiB and more are still mapped and unmapped each time. The parameters are the process's: an engine
embedded in a larger program sets them for all of it (``cpu_heap="system"`` leaves glibc's defaults). Another C
library, or a platform without ``mallopt``, keeps its own behaviour, and the reason is reported.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform

from mla_runtime.options import CPU_HEAP_MODES

logger = logging.getLogger("mla_runtime")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc refuses a larger one (HEAP_MAX_SIZE / 2 on 64-bit)
MIN_TRIM_BYTES = 64 << 20


@functools.cache
def _mallopt() -> tuple[object | None, str]:
    """glibc's ``mallopt``, or None and why it is not there."""
    libc, version = platform.libc_ver()
    if platform.system() != "Linux" or libc != "glibc":
        return None, f"the C library is not glibc ({platform.system()}, {libc or 'unknown'})"
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError) as e:
        return None, f"glibc {version}'s mallopt is not reachable: {e}"
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn, version


def retain(reserve_bytes: int, mode: str = "retain") -> str:
    """Apply ``mode`` (``options.CPU_HEAP_MODES``) to this process's heap; returns what now holds, for logs and
    ``EngineInfo``."""
    if mode not in CPU_HEAP_MODES:
        raise ValueError(f"cpu_heap must be one of {', '.join(CPU_HEAP_MODES)}, got {mode!r}")
    if mode == "system":
        return "system: the C library's defaults"
    fn, why = _mallopt()
    if fn is None:
        return f"system: {why}"
    trim = min(max(int(reserve_bytes), MIN_TRIM_BYTES), (1 << 31) - 1)  # mallopt takes an int
    if not (fn(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and fn(M_TRIM_THRESHOLD, trim)):  # type: ignore[operator]
        return f"system: glibc {why} refused the thresholds"
    described = (f"retain: blocks under {MMAP_THRESHOLD >> 20} MiB reused, up to {trim >> 20} MiB kept free "
                 f"(glibc {why})")
    logger.info("host heap: %s", described)
    return described
