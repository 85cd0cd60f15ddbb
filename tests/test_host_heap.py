"""A CPU engine's heap between steps (host_heap.py): freed activations stay mapped where glibc is the C
library."""

from __future__ import annotations

import ctypes
import platform

import pytest

from mla_runtime import host_heap
from mla_runtime.engine.config import EngineConfig
from mla_runtime.errors import InvalidParam

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (2.33 and later)
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def test_system_keeps_the_c_library_defaults_and_a_bad_mode_is_named():
    assert host_heap.retain(1 << 30, "system") == "system: the C library's defaults"
    with pytest.raises(ValueError, match="cpu_heap must be one of retain, system"):
        host_heap.retain(0, "keep")
    with pytest.raises(InvalidParam, match="cpu_heap"):
        EngineConfig(model="m", cpu_heap="keep")


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's mallopt parameters; other C libraries keep theirs")
def test_retain_serves_step_sized_blocks_from_the_heap_and_keeps_them_after_free():
    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip(f"glibc {platform.libc_ver()[1]} has no mallinfo2 to read the heap with (2.33 and later)")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    described = host_heap.retain(256 << 20)
    assert described.startswith("retain: blocks under 32 MiB reused, up to 256 MiB kept free")
    size = 8 << 20  # a prefill's activation: glibc's default would map it (and fault it in) afresh
    mapped = libc.mallinfo2().hblks
    block = libc.malloc(size)
    assert block and libc.mallinfo2().hblks == mapped  # from the heap, not a fresh mapping
    libc.free(block)
    assert libc.mallinfo2().fordblks >= size  # freed, and still mapped for the next step
    again = libc.malloc(size)
    assert again == block  # the next step's tensor reuses those pages
    libc.free(again)
    # past the threshold, and larger than the free top of the heap may be (trimmed past 256 MiB): mapped and
    # unmapped as before (a smaller one may come out of that free top, left by earlier work in the process)
    big = libc.malloc(512 << 20)
    assert libc.mallinfo2().hblks == mapped + 1
    libc.free(big)


def test_a_cpu_engine_sets_its_heap_once_loaded_and_reports_it(tiny_checkpoint):
    from mla_runtime import LLM

    path = str(tiny_checkpoint("v3")[0])
    engine = LLM(path, dtype="float32", kv_cache_memory="8MiB").engine
    reserve = max(engine.worker.activation_bytes, host_heap.MIN_TRIM_BYTES) >> 20
    assert engine.info().cpu_heap.startswith(f"retain: blocks under 32 MiB reused, up to {reserve} MiB kept free"
                                             if GLIBC else "system: ")
    system = LLM(path, dtype="float32", kv_cache_memory="8MiB", cpu_heap="system").engine
    assert system.info().cpu_heap == "system: the C library's defaults"
