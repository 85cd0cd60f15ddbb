"""Products of one to a few rows for x86-64 CPUs with AVX2 and FMA, compiled at run time: float32 weights at one
row (``gemv``) and at two to ``FEW_ROWS_MAX`` rows (``gemm_few``), int8 weights with a scale per row at one row
(``gemv_int8``).

A decode step at batch 1 multiplies one row by every weight matrix, streaming each from memory once (a speculative
verification or a small batch, a few rows). oneDNN and MKL reach the memory bandwidth only on large matrices:
measured on a 2-core AMD EPYC (Zen 3, AVX2) with the weights out of cache (``bench/bench_gemv.py``), oneDNN
streams a ``[512, 256]`` weight at 4.2 GB/s, ``[1024, 512]`` at 7.6 and ``[4096, 1024]`` at 15.1 GB/s, where the
machine streams 16–25 GB/s. ``csrc/gemv_f32.c`` does the product the simple way — each thread reads its share of
the weight rows front to back, one sequential stream, each row multiplied into every input row (which stay in
L1) — and reaches 9.4, 12.7 and 19.4 GB/s on the same weights at one row (bench/RESULTS.md has the tables).

It is C, not a PyTorch extension, so that building it takes the system C compiler well under a second and no
PyTorch headers. ``failure()`` (once per process) checks the CPU (``torch.cpu.get_capabilities``: avx2 and
fma3 on x86-64), finds a compiler (``$CC``, ``cc``, ``gcc``), compiles the source with ``-O3 -mavx2 -mfma
-fopenmp`` into a private temporary folder, linking the OpenMP runtime PyTorch ships (so the kernel's threads are
PyTorch's pool, not a second one competing for the cores), loads it with ``ctypes`` and checks products of small
integers against the exact result. Anything that fails makes it unavailable, with the reason, and callers keep
their other path (``mla_runtime.layers.cpu_gemm``). Results equal ``F.linear``'s to float rounding (another
summation order).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "gemv_f32.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _torch_openmp() -> list[str]:
    """Linker flags that bind the kernel to the OpenMP runtime PyTorch loaded (its bundled libgomp), if any."""
    lib = Path(torch.__file__).resolve().parent / "lib"
    if any(lib.glob("libgomp*.so*")):
        return ["-L", str(lib), f"-Wl,-rpath,{lib}"]
    return []


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the kernels are written for x86-64 (this CPU: {platform.machine()})"
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    missing = [c for c in ("avx2", "fma3") if not caps.get(c)]
    if missing:
        return None, f"the CPU lacks {', '.join(missing)}"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found ($CC, cc, gcc, clang)"
    folder = tempfile.mkdtemp(prefix="mla_gemv_")
    try:
        out = os.path.join(folder, "libmla_gemv.so")
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", out, *_torch_openmp()], capture_output=True,
                              text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()
            return None, f"compiling {SOURCE.name} with {cc} failed: {said[-1][:200]}"
        lib = ctypes.CDLL(out)  # the mapping stays valid after the file is removed
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building the kernel failed: {e}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    lib.mla_gemv_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3  # w, x, y, n, k, threads
    lib.mla_gemv_i8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3  # w, scale, x, y, n, k, threads
    lib.mla_gemm_few_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4  # w, x, y, m, n, k, threads
    lib.mla_gemm_few_i8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4  # w, scale, x, y, m, n, k, threads
    for fn in (lib.mla_gemv_f32, lib.mla_gemv_i8, lib.mla_gemm_few_f32, lib.mla_gemm_few_i8):
        fn.restype = None
    return lib, None


@functools.cache
def failure() -> str | None:
    """None where the kernel is built, loaded and exact on this machine, else why not."""
    lib, why = _load()
    if lib is None:
        return why
    g = torch.Generator().manual_seed(0)
    for n, k in ((37, 77), (8, 64), (1, 3)):  # row and column tails included
        w = torch.randint(-2, 3, (n, k), generator=g).float()
        x = torch.randint(-2, 3, (1, k), generator=g).float()
        exact = x.double() @ w.double().T
        if not torch.equal(gemv(x, w).double(), exact):
            return "the one-row kernel's products differ from the exact result on this CPU"
        xs = torch.randint(-2, 3, (3, k), generator=g).float()
        if not torch.equal(gemm_few(xs, w).double(), xs.double() @ w.double().T):
            return "the few-row kernel's products differ from the exact result on this CPU"
        scale = torch.full((n,), 0.5)
        if not torch.equal(gemv_int8(x, w.to(torch.int8), scale).double(), exact * 0.5):
            return "the one-row int8 kernel's products differ from the exact result on this CPU"
        if not torch.equal(gemm_few_int8(xs, w.to(torch.int8), scale).double(), xs.double() @ w.double().T * 0.5):
            return "the few-row int8 kernel's products differ from the exact result on this CPU"
    return None


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one float32 row ``x [..., K]`` (``x.numel() == K``) and a contiguous float32
    CPU ``weight [N, K]``; only where ``failure()`` is None."""
    lib, _ = _load()
    assert lib is not None, "gemv needs the kernel: check failure() first"
    n, k = weight.shape
    if x.numel() != k or x.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"gemv takes one float32 row of {k} values and a contiguous float32 weight, got x "
                         f"{tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}")
    row = x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.mla_gemv_f32(weight.data_ptr(), row.data_ptr(), y.data_ptr(), n, k, torch.get_num_threads())
    return y if bias is None else y.add_(bias)


FEW_ROWS_MAX = 8


def gemm_few(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2 to ``FEW_ROWS_MAX`` float32 rows ``x [..., K]`` and a contiguous float32 CPU
    ``weight [N, K]``: each weight row read once for all the input rows; only where ``failure()`` is None."""
    lib, _ = _load()
    assert lib is not None, "gemm_few needs the kernel: check failure() first"
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    if (x.shape[-1] != k or not 1 <= rows <= FEW_ROWS_MAX or x.dtype != torch.float32
            or weight.dtype != torch.float32 or not weight.is_contiguous()):
        raise ValueError(f"gemm_few takes 1 to {FEW_ROWS_MAX} float32 rows of {k} values and a contiguous float32 "
                         f"weight, got x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}")
    xs = x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.mla_gemm_few_f32(weight.data_ptr(), xs.data_ptr(), y.data_ptr(), rows, n, k, torch.get_num_threads())
    return y if bias is None else y.add_(bias)


def gemv_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x · (qweight · scales[:, None])ᵀ`` in float32 for one row ``x [..., K]`` (any float dtype), a contiguous
    int8 ``qweight [N, K]`` and float32 ``scales [N]``; only where ``failure()`` is None."""
    lib, _ = _load()
    assert lib is not None, "gemv_int8 needs the kernel: check failure() first"
    n, k = qweight.shape
    if (x.numel() != k or qweight.dtype != torch.int8 or not qweight.is_contiguous()
            or scales.dtype != torch.float32 or scales.shape != (n,) or not scales.is_contiguous()):
        raise ValueError(f"gemv_int8 takes one row of {k} values, a contiguous int8 weight and {n} float32 scales, "
                         f"got x {tuple(x.shape)}, weight {qweight.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype}")
    row = x.to(torch.float32).contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.mla_gemv_i8(qweight.data_ptr(), scales.data_ptr(), row.data_ptr(), y.data_ptr(), n, k, torch.get_num_threads())
    return y


def gemm_few_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x · (qweight · scales[:, None])ᵀ`` in float32 for 1 to ``FEW_ROWS_MAX`` rows ``x [..., K]`` (any float dtype),
    a contiguous int8 ``qweight [N, K]`` and float32 ``scales [N]``; only where ``failure()`` is None."""
    lib, _ = _load()
    assert lib is not None, "gemm_few_int8 needs the kernel: check failure() first"
    n, k = qweight.shape
    rows = x.numel() // k if k else 0
    if (x.shape[-1] != k or not 1 <= rows <= FEW_ROWS_MAX or qweight.dtype != torch.int8
            or not qweight.is_contiguous() or scales.dtype != torch.float32 or scales.shape != (n,)
            or not scales.is_contiguous()):
        raise ValueError(f"gemm_few_int8 takes 1 to {FEW_ROWS_MAX} rows of {k} values, a contiguous int8 weight and "
                         f"{n} float32 scales, got x {tuple(x.shape)}, weight {qweight.dtype} and scales "
                         f"{tuple(scales.shape)} {scales.dtype}")
    xs = x.to(torch.float32).contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.mla_gemm_few_i8(qweight.data_ptr(), scales.data_ptr(), xs.data_ptr(), y.data_ptr(), rows, n, k,
                        torch.get_num_threads())
    return y
