"""CPU kernels as typed torch operators (``torch.ops.mla_kernels.*``), built once per machine.

The sources register their operators with ``TORCH_LIBRARY``: ``csrc/ops/indexer.cpp`` (the sparse-attention
indexer's scores, every architecture), ``csrc/ops/delta_rule.cpp`` (the linear-attention layers' decode step: the gated
delta rule's update over the state slots and the short convolution, every architecture: ``csrc/delta_rule.h`` over the
vector vocabulary per x86 level, and over ``csrc/vec_scalar.h``'s one lane anywhere) and, on x86-64,
``csrc/ops/cpu_kernels.cpp`` over the C decode kernels of ``csrc/*.c`` (products, absorbed attention, norms, MoE rows,
the whole decoder layer; entry points and table layouts declared once in ``csrc/mla_cpu.h``), compiled as C++ into
the same library. Each operator has a schema and a CPU implementation, so it shows under its own name in the profiler
and is checked by the dispatcher, and those that take tensors have a shape function (``_register_fakes``), so they
trace.

The first process that needs them builds them with ``torch.utils.cpp_extension`` into a folder of ``cache_dir()``
named by a digest of the sources, headers, flags, compiler and torch's version; every later process, and every
tensor-parallel rank, loads that build (one process builds at a time, under an OS lock that dies with it: a killed
build never blocks a later start, and a wait for a live one has a deadline). Hot kernels are written once over a
vector vocabulary (``csrc/vec_avx2.h``, ``csrc/vec_avx512.h``) and compiled once per x86 level (AVX2 + FMA, AVX-512,
with VNNI or BF16 dot products where a kernel uses them), chosen at run time by one probe of the CPU
(``csrc/cpu_features.c``) under the ``MLA_CPU_ISA`` cap.

``failure()`` is None when the operators are loaded on this machine, else why not (no C++ compiler, a build error,
an x86-64 CPU without AVX2, FMA and F16C, another architecture than x86-64 and aarch64): callers keep their torch paths,
and the reason is logged once (``summary()`` says which are loaded, for the start-up log and ``/metrics``).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger("mla_runtime")

CSRC = Path(__file__).resolve().parent / "csrc"
# every architecture: the indexer; x86-64 adds the AVX2 kernels of csrc/*.c (mla_cpu.h), compiled as C++ into the
# same library and registered by ops/cpu_kernels.cpp
PORTABLE_SOURCES = (CSRC / "ops" / "indexer.cpp", CSRC / "ops" / "isa.cpp", CSRC / "ops" / "delta_rule.cpp",
                    CSRC / "cpu_features.c")
X86_SOURCES = (CSRC / "gemv_f32.c", CSRC / "mla_decode_f32.c", CSRC / "mla_layer_f32.c", CSRC / "gemv_fp8.c",
               CSRC / "gemv_int4.c", CSRC / "gemv_ggml.c", CSRC / "gemm_w8a8.c", CSRC / "gemm_fp4.c",
               CSRC / "amx_bf16.c", CSRC / "amx_int8.c", CSRC / "ops" / "cpu_kernels.cpp")
HEADERS = (CSRC / "mla_cpu.h", CSRC / "simd.h", CSRC / "isa_cap.h", CSRC / "amx_emulate.h", CSRC / "amx_tiles.h",
           CSRC / "vec_avx2.h", CSRC / "vec_avx512.h", CSRC / "vec_end.h", CSRC / "decode_attention.h",
           CSRC / "few_rows.h", CSRC / "int4_rows.h", CSRC / "ggml_rows.h", CSRC / "w8a8_rows.h", CSRC / "fp4_rows.h",
           CSRC / "vec_scalar.h", CSRC / "delta_rule.h", CSRC / "vec_exp.h")
CFLAGS = ("-O3", "-std=c++17", "-fopenmp")  # OpenMP: the kernels' threads are torch's pool
# the x86 baseline (every AVX2 CPU has FMA and F16C): wider instruction sets are chosen per function at run time
X86_CFLAGS = ("-mavx2", "-mfma", "-mf16c")
NAME = "mla_kernels_ops"
# The widest instruction set the kernels may choose in this process (csrc/isa_cap.h), narrowest first: set by
# $MLA_CPU_ISA before the process starts, as torch's own ATEN_CPU_CAPABILITY and oneDNN's ONEDNN_MAX_CPU_ISA are.
# "auto" (or unset) takes every level the CPU has. A capped process computes the bits a CPU of that level computes.
ISA_ENV = "MLA_CPU_ISA"
ISA_LEVELS = ("avx2", "avx512", "amx")
# The extension builder holds a lock file ("lock") in the build folder while it builds, and every other process waits
# for it to go, with no deadline; a builder that was killed leaves it behind. So every process first takes an OS lock
# of its own on "build.lock" (flock: it dies with its holder), and the one holding it removes any "lock" it finds:
# under that lock no live process of ours is building. A process waits for the OS lock at most
# $MLA_KERNEL_BUILD_WAIT_S seconds (BUILD_WAIT_S by default; two cores build in 17 to 30 s), logging what it waits
# for every WAIT_LOG_S, and then runs the torch paths, with the reason in the log, EngineInfo and /metrics.
BUILD_LOCK = "build.lock"
TORCH_LOCK = "lock"
BUILD_WAIT_ENV = "MLA_KERNEL_BUILD_WAIT_S"
BUILD_WAIT_S = 300.0
WAIT_LOG_S = 10.0


# /proc/cpuinfo's names of capabilities that torch.cpu.get_capabilities() names otherwise (x86's "avx512bw" is its
# "avx512_bw": see capabilities_from_cpuinfo)
_CPUINFO_NAMES = {"fma": "fma3", "asimd": "neon", "asimdhp": "fp16_arith", "svebf16": "sve_bf16"}


def capabilities_from_cpuinfo(text: str) -> dict[str, bool]:
    """The capabilities a ``/proc/cpuinfo`` lists (x86's ``flags``, aarch64's ``Features``), under the names of
    ``torch.cpu.get_capabilities()``."""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags = value.split()
            break
    else:
        return {}
    caps = {}
    for flag in flags:
        if flag.startswith("avx512") and not flag.startswith("avx512_"):  # avx512bw -> avx512_bw
            flag = "avx512_" + flag.removeprefix("avx512")
        caps[_CPUINFO_NAMES.get(flag, flag)] = True
    return caps


@functools.cache
def cpu_capabilities() -> dict[str, bool]:
    """This CPU's capabilities as ``torch.cpu.get_capabilities()`` names them (``avx2``, ``fma3``, ``avx512_bf16``,
    ``amx_bf16``; aarch64's ``bf16``...). torch before 2.11 has no such call (and aarch64's CPU-only wheels on PyPI end
    at 2.10): then Linux's ``/proc/cpuinfo``, else none."""
    if hasattr(torch.cpu, "get_capabilities"):
        return {k: bool(v) for k, v in torch.cpu.get_capabilities().items() if isinstance(v, bool)}
    try:
        return capabilities_from_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return {}


def x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def sources() -> tuple[Path, ...]:
    return PORTABLE_SOURCES + (X86_SOURCES if x86() else ())


# For tests on CPUs without AMX: 1 builds the AMX kernel over tiles emulated in software (csrc/amx_emulate.h), taken
# wherever the CPU has AVX512-BF16; a build of its own (the flag is part of the build's key). Never for serving.
EMULATE_AMX_ENV = "MLA_CPU_EMULATE_AMX"


def emulated_amx() -> bool:
    return x86() and os.environ.get(EMULATE_AMX_ENV) == "1"


def cflags() -> list[str]:
    return [*CFLAGS, *(X86_CFLAGS if x86() else ()), *(["-DMLA_AMX_EMULATE"] if emulated_amx() else [])]


def cache_dir() -> Path:
    """Where built kernel libraries are kept, one per source, flags and compiler: ``$MLA_KERNEL_CACHE``, else
    ``$XDG_CACHE_HOME/mla-runtime/kernels`` (``~/.cache`` without it)."""
    if os.environ.get("MLA_KERNEL_CACHE"):
        return Path(os.environ["MLA_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mla-runtime" / "kernels"


def _torch_openmp() -> list[str]:
    """Linker flags that bind the library to the OpenMP runtime PyTorch loaded (its bundled libgomp), if any."""
    lib = Path(torch.__file__).resolve().parent / "lib"
    if any(lib.glob("libgomp*.so*")):
        return ["-L", str(lib), f"-Wl,-rpath,{lib}"]
    return []


def _put_ninja_on_path() -> None:
    """The extension builder runs ``ninja`` from ``$PATH``. The ``ninja`` package (a dependency) installs it beside
    the interpreter's scripts, which are not on ``$PATH`` when a program runs from a virtual environment that was not
    activated (``.venv/bin/mla-runtime serve``, a service unit): put its folder there, once, if no ninja is found."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _ldflags() -> list[str]:
    return ["-fopenmp", *_torch_openmp()]


def build_key(cxx: str) -> str:
    """A digest of what the built library depends on: the sources, the flags, the compiler and torch."""
    h = hashlib.sha256()
    for source in (*sources(), *HEADERS):
        h.update(source.read_bytes())
    h.update("\0".join((*cflags(), *_ldflags())).encode())
    h.update(torch.__version__.encode())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    h.update(version.stdout.encode())
    return h.hexdigest()[:16]


def build_wait_s() -> float:
    """How long a process waits for another's kernel build (``$MLA_KERNEL_BUILD_WAIT_S``, else ``BUILD_WAIT_S``)."""
    raw = os.environ.get(BUILD_WAIT_ENV, "").strip()
    if not raw:
        return BUILD_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${BUILD_WAIT_ENV}={raw!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"${BUILD_WAIT_ENV} must be >= 0 seconds, got {raw}")
    return value


class BuildWaitTimeout(RuntimeError):
    """Another process held the build lock past the deadline."""


def _holder(fd: int) -> str:
    """What the lock file says of its holder ("pid N since TIME"), or "another process"."""
    try:
        said = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        said = ""
    return said or "another process"


@contextlib.contextmanager
def build_lock(folder: Path, wait_s: float | None = None) -> Iterator[None]:
    """Hold the build folder's OS lock (``BUILD_LOCK``) for a block: wait for it at most ``wait_s`` seconds
    (``build_wait_s()``), logging what is awaited and since when every ``WAIT_LOG_S``; raise ``BuildWaitTimeout``
    after. Once held, a ``TORCH_LOCK`` left in the folder is a dead build's (every live builder holds this lock while
    it builds), and is removed with a log line naming it."""
    wait_s = build_wait_s() if wait_s is None else wait_s
    path = folder / BUILD_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        logged = start
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - start >= wait_s:
                    raise BuildWaitTimeout(f"waited {now - start:.0f} s for {path}, held by {_holder(fd)}: another "
                                           f"process is still building the kernels (${BUILD_WAIT_ENV} sets the "
                                           f"wait)") from None
                if now - logged >= WAIT_LOG_S or logged == start:
                    logger.warning("waiting %.0f s so far (at most %.0f) for %s, held by %s: another process is "
                                   "building the kernels", now - start, wait_s, path, _holder(fd))
                    logged = now
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
        left = folder / TORCH_LOCK
        if left.exists():
            logger.warning("removing %s, left by a kernel build that did not finish (no process holds %s)", left, path)
            left.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def _build_folder(key: str) -> tuple[Path, bool]:
    """The cache folder of this build, or a private one for this process where the cache cannot be written
    (True: private, removed once the library is loaded)."""
    folder = cache_dir() / f"ops-{key}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return folder, False
    except OSError:
        return Path(tempfile.mkdtemp(prefix="mla_kernels_")), True


@contextlib.contextmanager
def build_logged(folder: Path, name: str) -> Iterator[None]:
    """Log at INFO, around a block that builds or loads the library ``name`` in ``folder``, that the operators are
    being built and where, then how long the build took; nothing where the folder already holds the library (a load).
    """
    if (folder / f"{name}.so").exists():
        yield
        return
    logger.info("building the typed CPU operators in %s: once per cache folder for these sources, flags, compiler "
                "and torch installation (17-30 s on two cores)", folder)
    start = time.monotonic()
    yield
    logger.info("built the typed CPU operators in %s in %.1f s", folder, time.monotonic() - start)


@functools.cache
def failure() -> str | None:
    """None where the operators are built (or found built) and loaded, else why not."""
    if not x86() and platform.machine().lower() not in ("aarch64", "arm64"):
        return f"the typed CPU operators are built for x86-64 and aarch64 (this CPU: {platform.machine()})"
    if x86():
        caps = cpu_capabilities()
        missing = [c for c in ("avx2", "fma3", "f16c") if not caps.get(c)]
        if missing:
            return f"the CPU lacks {', '.join(missing)}"
    cap = isa_cap()  # a wrong $MLA_CPU_ISA fails before the build
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler found ($CXX, c++, g++, clang++)"
    private = False
    try:
        from torch.utils import cpp_extension

        key = build_key(cxx)
        folder, private = _build_folder(key)
        os.environ["CXX"] = cxx  # the compiler the extension builder runs
        _put_ninja_on_path()
        with contextlib.nullcontext() if private else build_lock(folder), build_logged(folder, f"{NAME}_{key}"):
            # named by its key: a process that loads a build again (the same file) never registers the operators
            # twice
            cpp_extension.load(name=f"{NAME}_{key}", sources=[str(s) for s in sources()], extra_cflags=cflags(),
                               extra_ldflags=_ldflags(), build_directory=str(folder), is_python_module=False,
                               verbose=False)
    except BuildWaitTimeout as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a failed build leaves the torch paths, with the reason
        lines = str(e).strip().splitlines()
        # the compiler's own diagnostic ("file:line:col: error: ...") where there is one, not the builder's summary
        said = [line for line in lines if ": error:" in line] or [line for line in lines if "error" in line.lower()] \
            or lines
        return f"building the typed CPU operators with {cxx} failed: {said[0][:300] if said else type(e).__name__}"
    finally:
        if private:  # the mapping stays valid after the files are removed
            shutil.rmtree(folder, ignore_errors=True)
    torch.ops.mla_kernels.set_max_isa(cap)  # before any kernel runs
    _register_fakes()
    return None


@functools.cache
def isa_cap() -> str:
    """The instruction-set cap of this process (``ISA_LEVELS``; "amx" when ``$MLA_CPU_ISA`` is unset or "auto")."""
    raw = os.environ.get(ISA_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return ISA_LEVELS[-1]
    if raw not in ISA_LEVELS:
        raise ValueError(f"${ISA_ENV}={raw!r} is not an instruction set the kernels know: use auto or one of "
                         f"{', '.join(ISA_LEVELS)}")
    return raw


def summary() -> str:
    """One line for logs and metrics: the operators loaded (with the indexer's variant that runs), or why not."""
    why = failure()
    if why is not None:
        return f"unavailable: {why}"
    runs = [v.split(":", 1)[0] for v in torch.ops.mla_kernels.cpu_variants() if v.endswith(":runs")]
    kernels = ("the decode kernels, the prefill attention, the indexer and the linear-attention decode step" if x86()
               else "the indexer and the linear-attention decode step")
    capped = f"; capped at {isa_cap()} by ${ISA_ENV}" if isa_cap() != ISA_LEVELS[-1] else ""
    emulated = f"; AMX tiles emulated in software by ${EMULATE_AMX_ENV}" if emulated_amx() else ""
    return f"torch.ops.mla_kernels ({kernels}; indexer variant {runs[0] if runs else 'none'}{capped}{emulated})"


def available() -> bool:
    """The operators are loaded (logs why not, once)."""
    why = failure()
    if why is not None:
        _log_once(why)
    return why is None


@functools.cache
def _log_once(why: str) -> None:
    logger.info("typed CPU operators unavailable, the torch paths run instead: %s", why)


_FAKES: list[str] = []  # the operators given a shape function (once per process)


def _register_fakes() -> None:
    """Shape functions, so the operators that take and give tensors trace (``torch.compile``, ``torch.export``)
    without running. The operators over the custom-class tables (``gated_mlps``, ``moe_row``, ``decoder_layer``) run
    eagerly only: the tables hold raw addresses, which tracing cannot stand in for."""
    if _FAKES:
        return
    lib = torch.library

    @lib.register_fake("mla_kernels::indexer_scores")
    def _(q, weights, cache, scales, block_tables, req_indices, key_lens, max_len, variant="auto"):  # type: ignore[no-untyped-def]
        return q.new_empty((q.shape[0], max_len), dtype=torch.float32)

    @lib.register_fake("mla_kernels::delta_rule_step")
    def _(q, k, v, g, beta, state, slots, variant="auto"):  # type: ignore[no-untyped-def]
        return q.new_empty((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float32)

    @lib.register_fake("mla_kernels::delta_rule_prefill")
    def _(q, k, v, g, beta, state, slots, cu, variant="auto", block=16):  # type: ignore[no-untyped-def]
        return q.new_empty((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float32)

    @lib.register_fake("mla_kernels::short_conv_step")
    def _(x, conv, weight, slots):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape, dtype=torch.float32)

    _FAKES.extend(["indexer_scores", "delta_rule_step", "delta_rule_prefill", "short_conv_step"])
    if not x86():
        return

    @lib.register_fake("mla_kernels::linear")
    def _(x, w, scales=None, block=(), variant="auto"):  # type: ignore[no-untyped-def]
        return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)

    @lib.register_fake("mla_kernels::w8a8_linear")
    def _(x, w, scales, variant="auto", row_amax=None):  # type: ignore[no-untyped-def]
        return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)

    @lib.register_fake("mla_kernels::fp4_linear")
    def _(x, w, scales, global_scales=None, variant="auto"):  # type: ignore[no-untyped-def]
        return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)

    @lib.register_fake("mla_kernels::dense_linear")
    def _(x, plain, operand, tiles, bias, rows, onednn):  # type: ignore[no-untyped-def]
        return x.new_empty((*x.shape[:-1], plain.shape[0]))

    @lib.register_fake("mla_kernels::prefill_attention")
    def _(q_n, q_r, k_n, k_r, v, cu_q, cu_k, scale, variant="auto"):  # type: ignore[no-untyped-def]
        rows, heads = q_n.shape[:2]
        return (q_n.new_empty((rows, heads, v.shape[2]), dtype=torch.float32),
                q_n.new_empty((rows, heads), dtype=torch.float32))

    @lib.register_fake("mla_kernels::int4_from_stored")
    def _(stored):  # type: ignore[no-untyped-def]
        return torch.empty_like(stored)

    @lib.register_fake("mla_kernels::linear_int4")
    def _(x, w, scales, zeros=None, group=32, variant="auto"):  # type: ignore[no-untyped-def]
        return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)

    @lib.register_fake("mla_kernels::ggml_linear")
    def _(x, w, type, variant="auto"):  # type: ignore[no-untyped-def]
        return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)

    @lib.register_fake("mla_kernels::int4_table")
    def _(w, scales, zeros, group, k):  # type: ignore[no-untyped-def]
        return w.new_empty((6,), dtype=torch.int64)

    @lib.register_fake("mla_kernels::ggml_parts")
    def _(parts, types, k):  # type: ignore[no-untyped-def]
        return parts[0].new_empty((3 + 4 * len(parts),), dtype=torch.int64)

    @lib.register_fake("mla_kernels::ggml_repack")
    def _(w, k):  # type: ignore[no-untyped-def]
        return w.new_empty((w.shape[0], k // 256 * 148), dtype=torch.uint8)

    @lib.register_fake("mla_kernels::fp4_table")
    def _(w, scales, global_scales=None):  # type: ignore[no-untyped-def]
        return w.new_empty((5,), dtype=torch.int64)

    @lib.register_fake("mla_kernels::amx_pack")
    def _(w):  # type: ignore[no-untyped-def]
        return w.new_empty((w.shape[0] // 16, w.shape[1] // 32, 16, 32))

    @lib.register_fake("mla_kernels::amx_linear")
    def _(x, packed):  # type: ignore[no-untyped-def]
        return x.new_empty((*x.shape[:-1], packed.shape[0] * 16), dtype=torch.float32)

    @lib.register_fake("mla_kernels::rms_norm")
    def _(x, weight, eps):  # type: ignore[no-untyped-def]
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @lib.register_fake("mla_kernels::absorbed_decode")
    def _(q_n, q_r, w_uk, w_uv_t, cache, slots, lens, scale, variant="auto", scales=None):  # type: ignore[no-untyped-def]
        return q_n.new_empty((q_n.shape[0], q_n.shape[1], w_uv_t.shape[2]), dtype=torch.float32)

    lib.register_fake("mla_kernels::rope_store", lambda *args, **kwargs: None)
    _FAKES.extend(["linear", "dense_linear", "amx_pack", "amx_linear", "int4_from_stored", "linear_int4", "ggml_linear",
                   "ggml_parts", "ggml_repack", "int4_table", "fp4_table", "rms_norm",
                   "absorbed_decode", "rope_store"])
