"""CPU matrix products: a path chosen per weight dtype by a run-time probe, with weights prepared once at load.

``F.linear`` on a CPU tensor calls MKL's sgemm for float32. On AMD processors MKL does not take its
AVX-512 paths, and for the small ``M`` of decoding (1–32 rows) it runs far below the memory bandwidth
(measured on a 2-core EPYC, ``[8, 1024] × [1024, 32000]`` fp32: MKL 27 ms, oneDNN 9.4 ms; bf16
``[1, 1024] × [1024, 32000]``: 6.7 ms plain, 3.4 ms pre-packed). oneDNN picks its kernels by the
instruction set alone, and a weight reordered once into its blocked layout (``_reorder_linear_weight``)
is streamed without a per-call reorder.

Whether oneDNN can pack a dtype depends on the CPU (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT on x86;
other CPUs have their own rules), so no instruction set is assumed: the first product of each weight dtype
in a process runs ``probe`` on a tiny weight. Paths (``GemmChoice.path``):

- ``onednn``: the probe packed a weight and its products equal the exact result. ``PackedWeight`` keeps the
  plain tensor (what the rest of the code reads) and the blocked copy: one extra copy of the linear
  weights in RAM (``extra_bytes_per_element`` = the dtype's size). A float32 matrix-vector product (one
  row) runs oneDNN on the plain weight — the blocked layout made for a batch streams a weight that is not
  in cache 1.15–1.4× slower at one row — and everything else uses the blocked one.
  oneDNN's set-up costs tens of microseconds per call, so for a weight small enough that this dominates a
  one-row product, ``F.linear`` is faster: measured on a 2-core EPYC with the weights out of cache, as a
  decode step streams them, float32 one-row ``[4, 1024]`` (a 4-expert router) takes 5.8 µs in ``F.linear``
  against 63 µs in oneDNN and ``[128, 64]`` 14 vs 99 µs, while ``[1024, 1024]`` takes 419 vs 344 µs and every
  larger projection is faster in oneDNN. (With the weight kept in cache, ``F.linear`` also wins at
  ``[1024, 1024]``: timing must stream.) So small weights take ``F.linear`` by a size rule (``aten_max_rows``,
  ``ATEN_ROWS``), never by a timing at start-up, which would make the path, and the low bits of the results,
  depend on the machine's load: float32 weights of up to 32 Ki elements for products of up to ``FEW_ROWS`` rows,
  half-precision ones of up to 4 Ki elements for one row. (Measured with the weights streamed, 2 threads: on an
  AMD EPYC with AVX-512 float32 ``F.linear`` won at 8 rows up to ``[64, 512]`` and lost from ``[256, 256]``;
  bfloat16 won at one row for ``[4, 1024]`` only.)
  Where ``mla_kernels.cpu_kernels`` builds on this machine (x86-64 with AVX2, FMA and F16C, a C++ compiler; its
  check passed), float32 products of up to ``KERNEL_MAX_ROWS`` rows (batch-1 decoding, a speculative verification, a
  small batch) run its kernels on the plain weight instead, reading each weight row once for all input rows: they
  stream small and middling weights 1.1–2.6× faster than oneDNN at one to six rows and 1.1–1.6× at eight
  (``bench/bench_gemv.py``). ``cpu_gemm=onednn`` leaves them out.
  A bfloat16 (or float16) weight's products of up to two rows (on the ``onednn`` path) or eight (on the ``upcast``
  path of a CPU without oneDNN's half-precision products) run ``cpu_kernels.linear`` on the plain weight: it reads
  the weight at two bytes, widened to float32 exactly (a shift, or F16C's conversion; AVX2 alone), and computes in
  float32. Measured with the weights
  streamed, 2 threads, on an AMD EPYC with AVX-512 (``bench/bench_gemv.py``): one row of ``[4096, 1024]`` 0.29 ms
  against oneDNN's native bfloat16 0.41 ms and the float32 kernel's 0.57 ms; two rows 0.43 ms against oneDNN's 0.56;
  from three rows oneDNN's native products, which round the rows to bfloat16, win (eight: 0.45 against the kernel's
  0.58 ms), and the kernel is faster than the float32 copy a CPU without them computes with, reading half its bytes.
- ``plain``: ``F.linear`` in the weight's dtype; no extra memory.
- ``upcast``: a float32 copy of the weight (computed through the float32 path: blocked where oneDNN
  packs float32, else plain), the input cast to float32 and the result back. Memory: +4 bytes per
  weight element on top of the weight itself (a bf16 layer's weights take 3× their bf16 size).

Where the fast path fails its probe (or ``cpu_gemm=plain`` forces the fallbacks), a half-precision dtype takes
``plain`` where the CPU has native arithmetic in it (``NATIVE_CAPABILITIES``) and ``upcast`` where it has not (ATen
then widens every element of every product); float32 takes ``plain``. A rule, not a timing: the path, and so the
numbers, never depend on the machine's load at start-up. Results equal ``F.linear``
to float rounding (the same products, another summation order). Anything else — another device or
dtype, an empty input — goes to ``F.linear``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mla_kernels import cpu_kernels, cpu_ops
from mla_runtime.dtypes import HALF_WEIGHT_SCHEMES
from mla_runtime.options import CPU_GEMM_MODES
from mla_runtime.resolved_config import CpuLayouts

logger = logging.getLogger("mla_runtime")

GEMM_MODES = CPU_GEMM_MODES
PACK_BATCH_HINT = 16  # oneDNN chooses the blocked layout for about this many rows
PROBED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FEW_ROWS = 8  # small float32 weights take F.linear for every product of up to this many rows
# bfloat16 weights: products of up to this many rows take the compiled kernel that reads them at two bytes, by the
# weight's path (module docstring): against oneDNN's native bfloat16 products up to two rows; against the float32 copy
# of a CPU without them, every few-row product
BF16_KERNEL_ROWS = {"onednn": 2, "upcast": 8}
# products of up to ROWS rows with a weight of at most ELEMENTS elements take F.linear (module docstring)
ATEN_ROWS: dict[torch.dtype, tuple[int, int]] = {torch.float32: (32 << 10, FEW_ROWS), torch.bfloat16: (4 << 10, 1),
                                                 torch.float16: (4 << 10, 1)}
HALF_KINDS = {torch.bfloat16: "bf16", torch.float16: "f16"}  # cpu_kernels' kinds of the half-precision products
KERNEL_MAX_ROWS = 8  # products of up to this many rows take the AVX2 kernels where they build (bench/RESULTS.md)
# int8 and int4 products of at least this many rows take oneDNN's bfloat16 products where the CPU computes in bfloat16
# natively and the format's own compiled kernel does not run (``quantized_bf16_rows``; ``QuantizedWeight.bf16_product``)
QUANT_BF16_ROWS = 48
# bfloat16 products of more rows than the few-row kernels take, up to this many, run on AMX tiles where the CPU has
# them (``amx_failure``; ``mla_kernels.cpu_kernels.amx_linear``): on a 2-core Xeon with AMX, 2 threads, weights
# streamed, they take 0.55x oneDNN's time at 8 to 32 rows and 0.62x at 128, even at 512 and 1.2x at 1,024
AMX_MAX_ROWS = 128
# torch.cpu.get_capabilities() keys meaning native arithmetic in a dtype (x86, AMX, aarch64 NEON/SVE)
NATIVE_CAPABILITIES: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16", "fp16_arith"),
}
# the instruction-set level (mla_kernels.cpu_ops.ISA_LEVELS) of the x86 ones: $MLA_CPU_ISA below it leaves them out
CAPABILITY_ISA = {"avx512_bf16": "avx512", "avx512_fp16": "avx512", "amx_bf16": "amx", "amx_fp16": "amx"}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@dataclass(frozen=True)
class GemmChoice:
    """The product path for weights of one dtype in this process, and why it was chosen."""

    dtype: torch.dtype  # the weights' dtype
    mode: str  # the cpu_gemm mode it was chosen under (gemm_mode)
    path: str  # "onednn" | "plain" | "upcast" (module docstring)
    compute_dtype: torch.dtype
    reason: str

    @property
    def extra_bytes_per_element(self) -> int:
        """RAM beyond the weight itself, per weight element: the blocked copy, or the float32 copy."""
        return {"onednn": self.dtype.itemsize, "upcast": 4}.get(self.path, 0)

    def info(self) -> dict[str, str]:
        many = quantized_bf16_rows(self.mode, kernel=row_kernel_failure(self.mode) is None)
        return {"dtype": _name(self.dtype), "mode": self.mode, "path": self.path,
                "compute_dtype": _name(self.compute_dtype),
                "extra_bytes_per_weight": str(self.extra_bytes_per_element), "reason": self.reason,
                "operators": cpu_ops.summary(),
                "quantized_many_rows": f"oneDNN bfloat16 from {many} rows" if many else "the format's own path",
                **({"amx_tiles": _amx_label(self.mode)} if self.dtype == torch.bfloat16 else {})}


def _amx_label(mode: str) -> str:
    onednn = _probe(torch.bfloat16, mode).path == "onednn"
    why = amx_failure(mode) if onednn else "oneDNN's bfloat16 products do not run"
    return f"bfloat16 products of up to {AMX_MAX_ROWS} rows" if why is None else f"none: {why}"


_forced: list[str] = []  # the modes of the forced_gemm_mode blocks being run, innermost last


def gemm_mode() -> str:
    """The mode a load takes its products' paths under: the innermost ``forced_gemm_mode`` block's (the engine runs
    its load in one, with its ``cpu_gemm`` setting), else ``auto``. Read while a model is prepared, never per step: the
    paths are frozen into the prepared weights."""
    return _forced[-1] if _forced else "auto"


@contextmanager
def forced_gemm_mode(mode: str | None) -> Iterator[None]:
    """Prepare weights (a model load, a test) under ``mode`` (None: ``gemm_mode()`` as it is); blocks nest."""
    if mode is None:
        yield
        return
    if mode not in GEMM_MODES:
        raise ValueError(f"cpu_gemm: unknown value {mode!r} (use one of {', '.join(GEMM_MODES)})")
    _forced.append(mode)
    try:
        yield
    finally:
        _forced.pop()


_one_layout: list[bool] = []  # the one_layout blocks being run, innermost last


@contextmanager
def one_layout(on: bool = True) -> Iterator[None]:
    """Prepare weights (a model load) with each matrix in one layout where ``on``: the ``onednn`` path keeps no
    blocked copy and no AMX tiles, and its products of many rows run oneDNN on the plain weight (bfloat16: 1.03–1.15x
    the blocked copy's time from 128 rows, 1.4–1.7x at 16, on a Zen 5 EPYC), so the weights take their own bytes
    alone. The engine prepares under it where the load would not fit the machine otherwise; blocks nest."""
    _one_layout.append(on)
    try:
        yield
    finally:
        _one_layout.pop()


def keeps_second_layout() -> bool:
    """Whether weights prepared now may hold a second layout (``one_layout``)."""
    return not (_one_layout and _one_layout[-1])


def gemm_choice(dtype: torch.dtype) -> GemmChoice:
    """The path for ``dtype`` weights under the current mode (``gemm_mode``); probed once per (dtype, mode)."""
    if dtype not in PROBED_DTYPES:
        raise ValueError(f"dtype: CPU products are probed for {', '.join(map(_name, PROBED_DTYPES))}, got {dtype}")
    return _probe(dtype, gemm_mode())


def gemm_info(dtype: torch.dtype | str) -> dict[str, str]:
    """The choice for ``dtype`` (a torch dtype or its name) as string labels, for logs and metrics."""
    resolved: torch.dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    return gemm_choice(resolved).info()


@functools.cache
def _probe(dtype: torch.dtype, mode: str) -> GemmChoice:
    t0 = time.perf_counter()
    failure = fast_path_failure(dtype) if mode != "plain" else "cpu_gemm=plain forces the fallbacks"
    if failure is None:
        reason = "oneDNN pre-packed weights passed the probe"
        if dtype == torch.float32:
            why_not = row_kernel_failure(mode)
            reason += "; one-row products: " + ("the compiled kernel (mla_kernels.cpu_kernels)" if why_not is None else
                                                 f"oneDNN ({why_not})")
        choice = GemmChoice(dtype, mode, "onednn", dtype, reason)
    else:
        choice = _fallback(dtype, mode, failure)
    logger.info("CPU GEMM for %s weights: %s, computing in %s (+%d B per weight element): %s [probe %.0f ms]; CPU "
                "operators: %s", _name(dtype), choice.path, _name(choice.compute_dtype), choice.extra_bytes_per_element,
                choice.reason, 1e3 * (time.perf_counter() - t0), cpu_ops.summary())
    return choice


def fast_path_failure(dtype: torch.dtype) -> str | None:
    """None where oneDNN packs a ``dtype`` weight and its products are exact, else why not.

    Inputs, weights and bias are small integers, so every product and sum (|y| <= 68) is exact in
    float32, bfloat16 and float16: the packed product must equal the float64 one bit for bit.
    """
    name = _name(dtype)
    if not onednn_available():
        return "oneDNN is not available in this torch build"
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-1, 2, (48, 64), generator=g).to(dtype)  # [N, K]
    b = torch.randint(-4, 5, (48,), generator=g).to(dtype)
    try:
        packed = PackedWeight(w, "onednn", tiles=False)
        for rows in (1, 5):  # the matrix-vector and the blocked layouts
            x = torch.randint(-1, 2, (rows, 64), generator=g).to(dtype)
            got = linear(x, w, b, packed)
            if got.dtype != dtype or not torch.equal(got.double(), F.linear(x.double(), w.double(), b.double())):
                return f"oneDNN {name} products differ from the exact result on this CPU"
    except Exception as e:  # whatever the fast path raises on this CPU, a fallback takes over
        return f"oneDNN {name} packing unsupported on this CPU: {(str(e).strip() or repr(e)).splitlines()[0][:200]}"
    return None


def row_kernel_failure(mode: str | None = None) -> str | None:
    """None where float32 one-row products take the compiled kernel (``mla_kernels.cpu_kernels``) under ``mode``
    (default: the current ``gemm_mode()``), else why not."""
    mode = gemm_mode() if mode is None else mode
    if mode != "auto":
        return f"cpu_gemm={mode} leaves it out"
    return cpu_kernels.failure()


def amx_failure(mode: str | None = None) -> str | None:
    """None where bfloat16 products of up to ``AMX_MAX_ROWS`` rows run on AMX tiles under ``mode`` (default: the
    current ``gemm_mode()``), else why not."""
    mode = gemm_mode() if mode is None else mode
    if mode != "auto":
        return f"cpu_gemm={mode} leaves them out"
    return cpu_kernels.failure("amx")


def amx_fits(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a matrix the AMX tiles take: a contiguous bfloat16 CPU ``[N, K]`` with ``N`` a multiple
    of 16 and ``K`` of 32 (every projection of the MLA models; a row-split shard may not be)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0 and weight.numel() > 0)


def quantized_bf16_rows(mode: str | None = None, *, kernel: bool = False) -> int:
    """From how many rows weight-only int8 and int4 products take oneDNN's bfloat16 products (``QUANT_BF16_ROWS``)
    under ``mode`` (default: the current ``gemm_mode()``), or 0 where they never do.

    Never where the format's compiled kernel runs (``kernel``): its products are exact integer sums over rows rounded
    finer than bfloat16, so a row's result is the same bits whatever rows share its product, and a request's answer
    does not depend on the batch it was scheduled in. The bfloat16 products round every row to bfloat16 (2^-9), so a
    threshold on the row count would make a prompt's tokens depend on how many other tokens shared its step (seen:
    5/12 prompts of a DeepSeek-V3.2 model equal batched and alone), for 1.0-1.1x a prefill's speed without AMX. Nor
    where ``cpu_gemm`` is ``plain``, the bfloat16 products failed their probe or the CPU has no native bfloat16
    arithmetic (oneDNN would emulate it, slower than the integer products)."""
    mode = gemm_mode() if mode is None else mode
    if kernel or mode == "plain" or _probe(torch.bfloat16, mode).path != "onednn":
        return 0
    return QUANT_BF16_ROWS if native_arithmetic(torch.bfloat16) else 0


def native_arithmetic(dtype: torch.dtype, capabilities: Mapping[str, Any] | None = None) -> list[str]:
    """The capabilities (``torch.cpu.get_capabilities()`` keys) that give a CPU with ``capabilities`` (default: this
    one, under ``$MLA_CPU_ISA``'s cap) native ``dtype`` arithmetic."""
    allowed = len(cpu_ops.ISA_LEVELS)
    if capabilities is None:  # this CPU's: a process capped below AVX-512 (AMX) acts as a CPU of that level
        capabilities = cpu_ops.cpu_capabilities()
        allowed = cpu_ops.ISA_LEVELS.index(cpu_ops.isa_cap())
    return [k for k in NATIVE_CAPABILITIES.get(dtype, ()) if capabilities.get(k)
            and cpu_ops.ISA_LEVELS.index(CAPABILITY_ISA.get(k, "avx2")) <= allowed]


def _fallback(dtype: torch.dtype, mode: str, why: str) -> GemmChoice:
    """float32: ``F.linear``; half precision: ``F.linear`` in that dtype where the CPU computes in it natively, else
    in float32 (a copy of the weight)."""
    if dtype == torch.float32:
        return GemmChoice(dtype, mode, "plain", dtype, f"F.linear; {why}")
    native = native_arithmetic(dtype)
    if native:
        return GemmChoice(dtype, mode, "plain", dtype, f"{why}; native {_name(dtype)} ({', '.join(native)})")
    return GemmChoice(dtype, mode, "upcast", torch.float32, f"{why}; no native {_name(dtype)} arithmetic")


def cpu_auto_dtype(checkpoint: torch.dtype, capabilities: Mapping[str, Any] | None = None,
                   choice: GemmChoice | None = None) -> tuple[torch.dtype, str]:
    """The dtype ``dtype="auto"`` loads a ``checkpoint``-dtype model at on this CPU, and why.

    Half precision is kept only where the CPU has native arithmetic for it (``capabilities``, from
    ``torch.cpu.get_capabilities()``) and its fast path passed the probe (``choice``); elsewhere float32.
    """
    if checkpoint == torch.float32:
        return checkpoint, "the checkpoint's torch_dtype"
    name = _name(checkpoint)
    keys = NATIVE_CAPABILITIES.get(checkpoint, ())
    native = native_arithmetic(checkpoint, capabilities)
    if not native:
        return torch.float32, f"the CPU has no native {name} arithmetic (none of {', '.join(keys)})"
    choice = gemm_choice(checkpoint) if choice is None else choice
    if choice.path != "onednn":
        return torch.float32, f"the {name} fast path is not taken: {choice.reason}"
    return checkpoint, f"native {name} ({', '.join(native)}) and the {name} fast path passed its probe"


def cpu_layouts(dtype: torch.dtype) -> CpuLayouts:
    """The planner's facts about this CPU for ``dtype`` weights: what the probes chose (``gemm_choice``,
    ``row_kernel_failure``), the same ones the model's ``prepare_inference`` runs."""
    extra = gemm_choice(dtype).extra_bytes_per_element if dtype in PROBED_DTYPES else 0
    return CpuLayouts(dtype, extra, row_kernel_failure() is None, gemm_choice(torch.bfloat16).path == "onednn")


def resolve_cpu_dtype(requested: str | torch.dtype, checkpoint: torch.dtype) -> torch.dtype:
    """The model dtype on this CPU: ``requested`` "auto" keeps a half-precision ``checkpoint`` dtype only where
    ``cpu_auto_dtype`` finds it fast (the choice and its reason logged); an explicit dtype as it is."""
    if requested != "auto":
        return checkpoint
    chosen, why = cpu_auto_dtype(checkpoint)
    logger.info('dtype "auto" on this CPU: %s (checkpoint torch_dtype %s): %s', _name(chosen), _name(checkpoint), why)
    return chosen




def resolve_cpu_format(requested: str | torch.dtype, checkpoint: torch.dtype, quantization: str | None
                       ) -> tuple[torch.dtype, str | None]:
    """The model dtype and the products' weight format on this CPU. ``requested`` "auto" with a bfloat16 or float16
    ``checkpoint`` whose products are not otherwise quantised keeps them in that dtype in a float32 model where the
    compiled kernels read such weights (``quantization="bf16"`` / ``"fp16"``: the float32 decode path at half the
    bytes, the checkpoint's own values); otherwise ``resolve_cpu_dtype``, with ``quantization`` as it is."""
    if requested == "auto" and quantization is None and half_kernel_runs(checkpoint):
        logger.info('dtype "auto" on this CPU: float32 with %s weights (checkpoint torch_dtype %s): the compiled '
                    "kernels read them at two bytes", _name(checkpoint), _name(checkpoint))
        return torch.float32, HALF_WEIGHT_SCHEMES[checkpoint]
    return resolve_cpu_dtype(requested, checkpoint), quantization


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


class PackedWeight:
    """One ``[N, K]`` weight prepared for its ``onednn`` or ``upcast`` path (see the module docstring)."""

    __slots__ = ("plain", "blocked", "wide", "amx", "plain_gemv", "row_kernel", "upcast", "aten_max_rows", "bf16_rows")
    quantized = False  # True: a weight-only quantised matrix (``layers.quantization``) that runs its own ``matmul``

    def __init__(self, weight: torch.Tensor, path: str, *, tiles: bool = True) -> None:
        self.plain = weight.detach()
        self.upcast = path == "upcast"
        self.wide: torch.Tensor | None = None  # the float32 copy, where it is computed with F.linear
        self.blocked: torch.Tensor | None = None
        # a bfloat16 weight in AMX's tile layout, where the CPU has them (``tiles``: the probe of oneDNN leaves them
        # out): it takes the blocked copy's place, and products of more rows run oneDNN on the plain weight
        self.amx: torch.Tensor | None = None
        second = keeps_second_layout()
        if path == "onednn" and second and tiles and amx_fits(self.plain) and amx_failure() is None:
            self.amx = cpu_kernels.amx_pack(self.plain.contiguous())
        elif path == "onednn" and second:
            self.blocked = _reorder(self.plain)
        elif path == "onednn":
            pass  # one layout (``one_layout``): oneDNN on the plain weight
        elif self.upcast and gemm_choice(torch.float32).path == "onednn":
            self.blocked = _reorder(self.plain.float())  # the only float32 layout kept
        elif self.upcast:
            self.wide = self.plain.float()
        else:
            raise ValueError(f"path: a packed weight is 'onednn' or 'upcast', got {path!r}")
        self.plain_gemv = path == "onednn" and weight.dtype == torch.float32  # one row: oneDNN on the plain weight
        self.row_kernel = (self.plain_gemv and self.plain.is_contiguous()  # ... or the AVX2 kernel on it
                           and row_kernel_failure() is None)
        # products of at most this many rows take F.linear (small weights: oneDNN's per-call set-up dominates)
        # (the AVX2 kernels, where they run, take every product F.linear could win: up to FEW_ROWS rows)
        n, k = weight.shape
        self.aten_max_rows = aten_max_rows(n, k, weight.dtype) if path == "onednn" and not self.row_kernel else 0
        self.bf16_rows = bf16_kernel_rows(weight, path)

    @staticmethod
    def make(weight: torch.Tensor) -> PackedWeight | None:
        """The weight prepared for its dtype's chosen path, or None where callers use ``F.linear``."""
        if weight.device.type != "cpu" or weight.dtype not in PROBED_DTYPES or weight.dim() != 2:
            return None
        path = gemm_choice(weight.dtype).path
        return None if path == "plain" else PackedWeight(weight, path)

    def row_operand(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """The weight as the compiled one-row kernels read it (``mla_kernels.cpu_tables.GatedMLPTable``), or None where
        its products do not take them: a float32 weight's few-row products (``row_kernel``), or a half-precision one
        read at two bytes (``bf16_rows``)."""
        return self.plain if self.row_kernel or self.bf16_rows else None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The product of a quantised weight (subclasses); a float weight runs through ``linear``."""
        raise NotImplementedError("a float PackedWeight runs through cpu_gemm.linear")


def half_kernel_runs(dtype: torch.dtype) -> bool:
    """Whether few-row products with ``dtype`` (bfloat16 or float16) weights take the compiled kernel that reads
    them at two bytes per weight here, under the current ``cpu_gemm`` mode."""
    return dtype in HALF_KINDS and gemm_mode() == "auto" and cpu_kernels.failure(HALF_KINDS[dtype]) is None


def half_kernel(weight: torch.Tensor) -> bool:
    """``half_kernel_runs`` for this weight: a contiguous CPU matrix of a half dtype."""
    return weight.device.type == "cpu" and weight.is_contiguous() and half_kernel_runs(weight.dtype)


def bf16_kernel_rows(weight: torch.Tensor, path: str) -> int:
    """Up to how many rows products with a bfloat16 or float16 ``weight`` prepared for ``path`` take the compiled
    kernel (``cpu_kernels.linear``; ``BF16_KERNEL_ROWS``), 0 where they do not."""
    return BF16_KERNEL_ROWS.get(path, 0) if half_kernel(weight) else 0


def aten_max_rows(n: int, k: int, dtype: torch.dtype) -> int:
    """Up to how many rows products with an ``[n, k]`` ``dtype`` weight take ``F.linear`` rather than oneDNN: a size
    rule (``ATEN_ROWS``; see the module docstring)."""
    elements, rows = ATEN_ROWS.get(dtype, (0, 0))
    return rows if n * k <= elements else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on the path ``packed`` (made from ``weight``) was prepared for; a quantised
    ``packed`` computes its own product (``weight`` then only stands for its shape)."""
    if packed is not None and packed.quantized:
        return packed.matmul(x, bias)
    if packed is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    if packed.row_kernel and 0 < x.numel() <= KERNEL_MAX_ROWS * x.shape[-1]:  # the AVX2 kernels (module docstring)
        return cpu_kernels.linear(x, packed.plain, bias=bias)
    if 0 < x.numel() <= packed.bf16_rows * x.shape[-1]:  # half weights read at two bytes (module docstring)
        return cpu_kernels.linear(x, packed.plain, bias=bias).to(x.dtype)
    if x.numel() <= packed.aten_max_rows * x.shape[-1]:
        return F.linear(x, weight, bias)
    if packed.amx is not None and x.numel() <= AMX_MAX_ROWS * x.shape[-1]:
        return amx_product(x, packed.amx, bias).to(x.dtype)
    if packed.upcast:
        wide_bias = None if bias is None else bias.float()
        return _product(x.float(), packed, wide_bias).to(x.dtype)
    return _product(x, packed, bias)


def amx_product(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x · Wᵀ (+ bias)`` in float32 on AMX tiles (``PackedWeight.amx``), ``x``'s rows rounded to bfloat16."""
    y = cpu_kernels.amx_linear(x, tiles)
    return y if bias is None else y.add_(bias)


def _product(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if packed.amx is not None:  # more rows than the tiles take: oneDNN on the plain weight (as fast from 256 rows)
        return F.linear(x, packed.plain, bias)
    if packed.wide is not None:  # the upcast layout's float32 copy
        return F.linear(x, packed.wide, bias)
    # the plain weight: one layout (``one_layout``), or one float32 row (``plain_gemv``)
    plain = packed.blocked is None or (packed.plain_gemv and x.numel() == x.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, packed.plain if plain else packed.blocked, bias, "none", [None], "")
