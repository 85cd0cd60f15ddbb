"""CPU kernels as typed torch operators (``torch.ops.mla_kernels.*``), built once per machine.

The sources in ``csrc/ops/*.cpp`` register their operators with ``TORCH_LIBRARY`` (a schema each, a CPU
implementation), so they show under their own names in the profiler, are checked by the dispatcher, and trace
(``torch.library.register_fake`` below gives each a shape function). The first process that needs them builds them
with ``torch.utils.cpp_extension`` into a folder of ``cache_dir()`` named by a digest of the sources, the flags,
the compiler and torch's version; every later process, and every tensor-parallel rank, loads that build (the
extension builder locks the folder while one process builds). Within the library each kernel's hot function is
compiled for several x86 levels (``target_clones``: AVX-512, AVX2 + FMA, the baseline) and the loader runs the
widest the CPU supports.

Operators:

- ``indexer_scores(q, weights, cache, scales, block_tables, req_indices, key_lens, max_len)``: the lightning
  indexer's scores over the paged indexer-key cache (``mla_kernels.sparse``: the same contract as its torch path).

``failure()`` is None when the operators are loaded on this machine, else why not (no C++ compiler, a build error,
a CPU that is not x86-64 or aarch64 ...): callers keep their torch paths, and the reason is logged once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from .cpu_gemv import _torch_openmp, cache_dir

logger = logging.getLogger("mla_runtime")

CSRC = Path(__file__).resolve().parent / "csrc" / "ops"
SOURCES = (CSRC / "indexer.cpp",)
CFLAGS = ("-O3", "-std=c++17", "-fopenmp")  # OpenMP: at::parallel_for runs on torch's thread pool
NAME = "mla_kernels_ops"
BUILD_TIMEOUT_HINT_S = 120  # a first build takes about 20-40 s on two cores


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _ldflags() -> list[str]:
    """Link the OpenMP runtime torch loaded (its bundled libgomp), so the kernels' threads are torch's pool."""
    return ["-fopenmp", *_torch_openmp()]


def build_key(cxx: str) -> str:
    """A digest of what the built library depends on: the sources, the flags, the compiler and torch."""
    h = hashlib.sha256()
    for source in SOURCES:
        h.update(source.read_bytes())
    h.update("\0".join((*CFLAGS, *_ldflags())).encode())
    h.update(torch.__version__.encode())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    h.update(version.stdout.encode())
    return h.hexdigest()[:16]


@functools.cache
def failure() -> str | None:
    """None where the operators are built (or found built) and loaded, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return f"the typed CPU operators are built for x86-64 and aarch64 (this CPU: {platform.machine()})"
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler found ($CXX, c++, g++, clang++)"
    try:
        from torch.utils import cpp_extension

        folder = cache_dir() / f"ops-{build_key(cxx)}"
        folder.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("CXX", cxx)
        cpp_extension.load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=list(CFLAGS),
                           extra_ldflags=_ldflags(),
                           build_directory=str(folder), is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 - a failed build leaves the torch paths, with the reason
        said = str(e).strip().splitlines()
        return f"building the typed CPU operators failed: {said[-1][:300] if said else type(e).__name__}"
    _register_fakes()
    return None


def available() -> bool:
    """The operators are loaded (logs why not, once)."""
    why = failure()
    if why is not None:
        _log_once(why)
    return why is None


@functools.cache
def _log_once(why: str) -> None:
    logger.info("typed CPU operators unavailable, the torch paths run instead: %s", why)


def _register_fakes() -> None:
    """Shape functions, so the operators trace (``torch.compile``, ``torch.export``) without running."""

    @torch.library.register_fake("mla_kernels::indexer_scores")
    def _(q, weights, cache, scales, block_tables, req_indices, key_lens, max_len):  # type: ignore[no-untyped-def]
        return q.new_empty((q.shape[0], max_len), dtype=torch.float32)
