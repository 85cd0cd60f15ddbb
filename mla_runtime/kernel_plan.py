"""The kernel plan: what computes a CPU model's products on this machine, resolved once into one frozen value.

A CPU can take a matrix product several ways: oneDNN on a weight reordered once into its blocked layout, ATen's
``F.linear``, the compiled few-row kernels of ``mla_kernels.cpu_kernels`` (float32, bfloat16/float16 read at two
bytes, int8, int4, block FP8), AMX tiles. Which of them run depends on the CPU, the torch build and the engine's
``cpu_gemm`` setting (``auto``: every path whose probe passes; ``onednn``: oneDNN without the compiled kernels;
``plain``: the torch fallbacks only). ``kernel_plan(mode)`` runs each probe once per process and returns a
``KernelPlan``; the Worker resolves it from its settings, hands it to the loader inside ``ResolvedConfig`` and to the
planner as ``CpuLayouts``, and every weight is prepared against it (``layers.cpu_gemm.PackedWeight``, each quantised
format's ``bind``). Nothing reads a mode while a model runs: the choices are frozen into the prepared weights.

The probes are rules, never timings, so the path (and the low bits of a result) never depends on the machine's load:

- oneDNN per dtype (float32, bfloat16, float16): a small integer weight packed and multiplied must equal the exact
  product bit for bit (``fast_path_failure``). Where it fails, float32 takes ``F.linear`` (``plain``) and a half dtype
  takes ``F.linear`` in that dtype where the CPU computes in it natively, else a float32 copy (``upcast``).
- the compiled kernels: ``mla_kernels.cpu_kernels.failure(kind)`` (they build here and pass their own checks),
  the linear-attention layers' decode operators among them (``delta_failure``).
- ATen's int8 products: exact on small integers (``int8_aten_failure``).
- native half-precision arithmetic: ``torch.cpu.get_capabilities()`` under ``$MLA_CPU_ISA``'s cap.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mla_kernels import cpu_kernels, cpu_ops
from mla_runtime.dtypes import HALF_WEIGHT_SCHEMES, dtype_name
from mla_runtime.options import CPU_GEMM_MODES

logger = logging.getLogger("mla_runtime")

PACK_BATCH_HINT = 16  # oneDNN chooses the blocked layout for about this many rows
PROBED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HALF_KINDS = {torch.bfloat16: "bf16", torch.float16: "f16"}  # cpu_kernels' kinds of the half-precision products
# bfloat16 products of more rows than the few-row kernels take, up to this many, run on AMX tiles where the CPU has
# them (``mla_kernels.cpu_kernels.amx_linear``): on a 2-core Xeon with AMX, 2 threads, weights streamed, they take
# 0.55x oneDNN's time at 8 to 32 rows and 0.62x at 128, even at 512 and 1.2x at 1,024
AMX_MAX_ROWS = 128
# torch.cpu.get_capabilities() keys meaning native arithmetic in a dtype (x86, AMX, aarch64 NEON/SVE)
NATIVE_CAPABILITIES: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16", "fp16_arith"),
}
# the instruction-set level (mla_kernels.cpu_ops.ISA_LEVELS) of the x86 ones: $MLA_CPU_ISA below it leaves them out
CAPABILITY_ISA = {"avx512_bf16": "avx512", "avx512_fp16": "avx512", "amx_bf16": "amx", "amx_fp16": "amx"}


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` in oneDNN's blocked layout for products of about ``PACK_BATCH_HINT`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x · Wᵀ (+ bias)`` through oneDNN, ``weight`` plain or blocked (``reorder``)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


@dataclass(frozen=True)
class GemmChoice:
    """The product path for weights of one dtype, and why it was chosen."""

    dtype: torch.dtype  # the weights' dtype
    path: str  # "onednn" | "plain" | "upcast" (module docstring)
    compute_dtype: torch.dtype
    reason: str

    @property
    def extra_bytes_per_element(self) -> int:
        """RAM beyond the weight itself, per weight element: the blocked copy, or the float32 copy."""
        return {"onednn": self.dtype.itemsize, "upcast": 4}.get(self.path, 0)


@dataclass(frozen=True)
class CpuLayouts:
    """What a plan's product paths hold beside a model's ``dtype`` weights (``KernelPlan.layouts``): the facts about
    the machine that the memory planner's arithmetic counts."""

    dtype: torch.dtype  # the model dtype these facts are for
    extra_bytes_per_element: int  # each float matrix's second layout (oneDNN's blocked copy, or a float32 copy)
    row_kernels: bool  # the compiled few-row kernels run (they read float32 copies of int8 scales)
    bf16_blocked: bool = False  # bf16 weights keep oneDNN's blocked bfloat16 copy for many-row products (layers.bf16)
    one_layout: bool = False  # each matrix in one layout (``KernelPlan.one_layout``)
    ggml_repack: bool = False  # the ggml kernels run: a GGUF file's Q4_K matrices are held repacked (GgufWeight.repack)

    def with_one_layout(self) -> CpuLayouts | None:
        """These facts with the second layouts of the ``onednn`` path left out (an ``upcast`` path's float32 copy, which
        the products need, stays), or None where that leaves nothing out: the one place that says whether a load can
        shed them (the engine's load check and the planner ask it)."""
        onednn = self.extra_bytes_per_element == self.dtype.itemsize
        if self.one_layout or not (onednn or self.bf16_blocked):
            return None
        return dataclasses.replace(self, extra_bytes_per_element=0 if onednn else self.extra_bytes_per_element,
                                   bf16_blocked=False, one_layout=True)


NOT_CPU = "not a CPU model"


@dataclass(frozen=True)
class KernelPlan:
    """Every product path a CPU model takes on this machine under one ``cpu_gemm`` mode. A ``*_failure`` field is None
    where that path runs, else why not (a probe's finding, or the mode leaving it out)."""

    mode: str
    gemm: tuple[GemmChoice, ...]  # one per PROBED_DTYPES, in that order
    float_failure: str | None  # the compiled float32 few-row kernels (and the norms, the whole-layer call)
    half_failures: tuple[str | None, str | None]  # the compiled kernels reading bfloat16 / float16 at two bytes
    amx_failure: str | None  # bfloat16 products of up to AMX_MAX_ROWS rows on AMX tiles
    int8_aten_failure: str | None  # ATen's int8 products with bfloat16 rows
    int4_failure: str | None  # the compiled int4 kernel (else: dequantised per product)
    fp8_failure: str | None  # the compiled block-FP8 kernel (else: dequantised per product)
    ggml_failure: str | None  # the compiled kernels of GGUF block types (else: dequantised per product)
    native_bf16: tuple[str, ...]  # the capabilities giving native bfloat16 arithmetic (empty: none)
    # the compiled operators (a float weight's products chosen by rows inside ``dense_linear``); else each format's
    # one torch fallback
    ops_failure: str | None = None
    # the compiled W8A8 kernel (int8 weights against rows rounded to int8 per token; else torch's int8 products)
    w8a8_failure: str | None = NOT_CPU
    # the compiled FP4 kernel (MXFP4, NVFP4; else the weight widened a block of rows at a time)
    fp4_failure: str | None = NOT_CPU
    # each matrix in one layout: oneDNN's blocked copies and AMX's tiles left out, where the load would not fit the
    # machine with them (the Worker's memory check); products of many rows run oneDNN on the plain weight
    one_layout: bool = False
    # the compiled decode step of the linear-attention layers (the gated delta rule's update over the state slots,
    # the short convolution; ``layers.kda``): else their torch paths
    delta_failure: str | None = NOT_CPU

    def choice(self, dtype: torch.dtype) -> GemmChoice:
        if dtype not in PROBED_DTYPES:
            raise ValueError(f"dtype: CPU products are probed for {', '.join(map(dtype_name, PROBED_DTYPES))}, "
                             f"got {dtype}")
        return self.gemm[PROBED_DTYPES.index(dtype)]

    @property
    def row_kernels(self) -> bool:
        """Whether float32 products of a few rows (and the norms, the decode step's layers) take the compiled
        kernels."""
        return self.float_failure is None

    def integer_kernels(self, scheme: str) -> bool:
        """Whether ``scheme``'s (``int8``, ``int4``) products take the compiled integer kernels: a row's result is then
        the same bits whatever rows share its product."""
        return {"int8": self.row_kernels, "int4": self.int4_failure is None, "w4a16": self.int4_failure is None,
                "w8a8": self.w8a8_failure is None}.get(scheme, False)

    def rows_independent(self, scheme: str) -> bool:
        """Whether every product of ``scheme``'s weights gives a row the same bits whatever rows share it: the integer
        kernels, or for int8 ATen's int8 kernel (``layers.quantization``)."""
        return self.integer_kernels(scheme) or (scheme == "int8" and self.int8_aten_failure is None)

    def half_kernel(self, dtype: torch.dtype) -> bool:
        """Whether few-row products with ``dtype`` (bfloat16 or float16) weights take the compiled kernel that reads
        them at two bytes."""
        return dtype in HALF_KINDS and self.half_failures[list(HALF_KINDS).index(dtype)] is None

    @property
    def tiles(self) -> bool:
        """Whether bfloat16 weights on the oneDNN path keep AMX tiles in place of the blocked copy."""
        return self.amx_failure is None and not self.one_layout

    @property
    def bf16_products(self) -> bool:
        """Whether oneDNN's bfloat16 products run natively here (not emulated), so a float32 model's products of many
        rows over bfloat16 values (``layers.bf16``'s weights, the absorbed factors beside a non-integer format) take
        them."""
        return self.mode != "plain" and self.choice(torch.bfloat16).path == "onednn" and bool(self.native_bf16)

    def layouts(self, dtype: torch.dtype) -> CpuLayouts:
        """The planner's facts about this plan for a model of ``dtype``: what the products hold beside its weights."""
        extra = self.choice(dtype).extra_bytes_per_element if dtype in PROBED_DTYPES else 0
        full = CpuLayouts(dtype, extra, self.row_kernels, self.choice(torch.bfloat16).path == "onednn",
                          ggml_repack=self.ggml_failure is None)
        if not self.one_layout:
            return full
        return full.with_one_layout() or dataclasses.replace(full, one_layout=True)

    def with_one_layout(self) -> KernelPlan:
        return dataclasses.replace(self, one_layout=True)

    def info(self, dtype: torch.dtype) -> dict[str, str]:
        """What runs for ``dtype`` weights, as string labels for logs, ``EngineInfo`` and ``/metrics``."""
        choice = self.choice(dtype)
        reason = choice.reason
        if dtype == torch.float32 and choice.path == "onednn":
            reason += "; few-row products: " + ("the compiled kernels (mla_kernels.cpu_kernels)"
                                                 if self.row_kernels else f"oneDNN ({self.float_failure})")
        labels = {"dtype": dtype_name(dtype), "mode": self.mode, "path": choice.path,
                  "compute_dtype": dtype_name(choice.compute_dtype),
                  "extra_bytes_per_weight": str(self.layouts(dtype).extra_bytes_per_element), "reason": reason,
                  "operators": cpu_ops.summary()}
        if dtype == torch.bfloat16:
            why = self.amx_failure if self.choice(torch.bfloat16).path == "onednn" else \
                "oneDNN's bfloat16 products do not run"
            labels["amx_tiles"] = f"bfloat16 products of up to {AMX_MAX_ROWS} rows" if why is None else f"none: {why}"
        if self.one_layout:
            labels["layouts"] = "one per weight: oneDNN's blocked copies and AMX tiles left out to fit"
        return labels


# the plan of a model on another device: no CPU path is prepared (its weights are not CPU tensors), no probe runs
OFF_CPU = KernelPlan(mode="plain", gemm=tuple(GemmChoice(d, "plain", d, NOT_CPU) for d in PROBED_DTYPES),
                     float_failure=NOT_CPU, half_failures=(NOT_CPU, NOT_CPU), amx_failure=NOT_CPU,
                     int8_aten_failure=NOT_CPU, int4_failure=NOT_CPU, fp8_failure=NOT_CPU, ggml_failure=NOT_CPU,
                     native_bf16=(),
                     ops_failure=NOT_CPU)


def kernel_plan(mode: str = "auto") -> KernelPlan:
    """The plan for ``mode`` (a ``cpu_gemm`` value) on this CPU: its probes run once per process."""
    if mode not in CPU_GEMM_MODES:
        raise ValueError(f"cpu_gemm: unknown value {mode!r} (use one of {', '.join(CPU_GEMM_MODES)})")
    return _resolve(mode)


@functools.cache
def _resolve(mode: str) -> KernelPlan:
    t0 = time.perf_counter()
    compiled = None if mode == "auto" else f"cpu_gemm={mode} leaves them out"
    plan = KernelPlan(
        mode=mode, gemm=tuple(_choice(dtype, mode) for dtype in PROBED_DTYPES),
        float_failure=compiled or cpu_kernels.failure(),
        half_failures=(compiled or cpu_kernels.failure("bf16"), compiled or cpu_kernels.failure("f16")),
        amx_failure=compiled or cpu_kernels.failure("amx"),
        int8_aten_failure="cpu_gemm=plain forces the fallback" if mode == "plain" else int8_aten_failure(),
        int4_failure="cpu_gemm=plain forces the fallback" if mode == "plain" else cpu_kernels.failure("int4"),
        fp8_failure=compiled or cpu_kernels.failure("fp8"),
        ggml_failure="cpu_gemm=plain forces the fallback" if mode == "plain" else cpu_kernels.failure("ggml"),
        w8a8_failure="cpu_gemm=plain forces the fallback" if mode == "plain" else cpu_kernels.failure("w8a8"),
        fp4_failure="cpu_gemm=plain forces the fallback" if mode == "plain" else cpu_kernels.failure("fp4"),
        native_bf16=tuple(native_arithmetic(torch.bfloat16)),
        ops_failure="cpu_gemm=plain forces the fallbacks" if mode == "plain" else cpu_kernels.failure("ops"),
        delta_failure="cpu_gemm=plain forces the fallbacks" if mode == "plain" else cpu_kernels.failure("delta"))
    for dtype in PROBED_DTYPES:
        choice = plan.choice(dtype)
        logger.debug("CPU products of %s weights under cpu_gemm=%s: %s, computing in %s: %s", dtype_name(dtype), mode,
                     choice.path, dtype_name(choice.compute_dtype), choice.reason)
    logger.info("CPU kernel plan (cpu_gemm=%s) in %.0f ms: float32 %s, bfloat16 %s, float16 %s; compiled few-row "
                "kernels: %s; CPU operators: %s", mode, 1e3 * (time.perf_counter() - t0),
                *(plan.choice(d).path for d in PROBED_DTYPES), "yes" if plan.row_kernels else plan.float_failure,
                cpu_ops.summary())
    return plan


def _choice(dtype: torch.dtype, mode: str) -> GemmChoice:
    failure = fast_path_failure(dtype) if mode != "plain" else "cpu_gemm=plain forces the fallbacks"
    if failure is None:
        return GemmChoice(dtype, "onednn", dtype, "oneDNN pre-packed weights passed the probe")
    if dtype == torch.float32:
        return GemmChoice(dtype, "plain", dtype, f"F.linear; {failure}")
    native = native_arithmetic(dtype)
    if native:
        return GemmChoice(dtype, "plain", dtype, f"{failure}; native {dtype_name(dtype)} ({', '.join(native)})")
    return GemmChoice(dtype, "upcast", torch.float32, f"{failure}; no native {dtype_name(dtype)} arithmetic")


def fast_path_failure(dtype: torch.dtype) -> str | None:
    """None where oneDNN packs a ``dtype`` weight and its products are exact, else why not.

    Inputs, weights and bias are small integers, so every product and sum (|y| <= 68) is exact in float32, bfloat16
    and float16: the packed product must equal the float64 one bit for bit, for one row (on the plain weight and on
    the blocked one) and for five (the blocked one).
    """
    name = dtype_name(dtype)
    if not onednn_available():
        return "oneDNN is not available in this torch build"
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-1, 2, (48, 64), generator=g).to(dtype)  # [N, K]
    b = torch.randint(-4, 5, (48,), generator=g).to(dtype)
    try:
        blocked = reorder(w)
        for rows, weight in ((1, w), (1, blocked), (5, blocked)):
            x = torch.randint(-1, 2, (rows, 64), generator=g).to(dtype)
            got = onednn_linear(x, weight, b)
            if got.dtype != dtype or not torch.equal(got.double(), F.linear(x.double(), w.double(), b.double())):
                return f"oneDNN {name} products differ from the exact result on this CPU"
    except Exception as e:  # whatever the fast path raises on this CPU, a fallback takes over
        return f"oneDNN {name} packing unsupported on this CPU: {(str(e).strip() or repr(e)).splitlines()[0][:200]}"
    return None


def int8_aten_failure() -> str | None:
    """None where ``_weight_int8pack_mm`` with bfloat16 rows is exact on this CPU, else why the widening fallback
    runs. Small integers make every product and sum exact in bfloat16."""
    g = torch.Generator().manual_seed(0)
    try:
        for n, k, rows in ((48, 64, 1), (48, 128, 5)):
            q = torch.randint(-2, 3, (n, k), generator=g, dtype=torch.int8)
            scales = torch.randint(1, 3, (n,), generator=g).to(torch.bfloat16)
            x = torch.randint(-1, 2, (rows, k), generator=g).to(torch.bfloat16)
            got = torch.ops.aten._weight_int8pack_mm(x, q, scales)
            if not torch.equal(got.double(), (x.double() @ q.double().T) * scales.double()):
                return "int8 products with bfloat16 rows differ from the exact result on this CPU"
    except Exception as e:  # whatever the kernel raises on this CPU or build, the fallback takes over
        return f"the int8 kernel is unsupported here: {(str(e).strip() or repr(e)).splitlines()[0][:200]}"
    return None


def native_arithmetic(dtype: torch.dtype, capabilities: Mapping[str, Any] | None = None) -> list[str]:
    """The capabilities (``torch.cpu.get_capabilities()`` keys) that give a CPU with ``capabilities`` (default: this
    one, under ``$MLA_CPU_ISA``'s cap) native ``dtype`` arithmetic."""
    allowed = len(cpu_ops.ISA_LEVELS)
    if capabilities is None:  # this CPU's: a process capped below AVX-512 (AMX) acts as a CPU of that level
        capabilities = cpu_ops.cpu_capabilities()
        allowed = cpu_ops.ISA_LEVELS.index(cpu_ops.isa_cap())
    return [k for k in NATIVE_CAPABILITIES.get(dtype, ()) if capabilities.get(k)
            and cpu_ops.ISA_LEVELS.index(CAPABILITY_ISA.get(k, "avx2")) <= allowed]


def cpu_auto_dtype(checkpoint: torch.dtype, plan: KernelPlan, capabilities: Mapping[str, Any] | None = None
                   ) -> tuple[torch.dtype, str]:
    """The dtype ``dtype="auto"`` loads a ``checkpoint``-dtype model at on this CPU under ``plan``, and why.

    Half precision is kept only where the CPU has native arithmetic for it (``capabilities``, from
    ``torch.cpu.get_capabilities()``) and its oneDNN path passed the probe; elsewhere float32.
    """
    if checkpoint == torch.float32:
        return checkpoint, "the checkpoint's torch_dtype"
    name = dtype_name(checkpoint)
    keys = NATIVE_CAPABILITIES.get(checkpoint, ())
    native = native_arithmetic(checkpoint, capabilities)
    if not native:
        return torch.float32, f"the CPU has no native {name} arithmetic (none of {', '.join(keys)})"
    choice = plan.choice(checkpoint)
    if choice.path != "onednn":
        return torch.float32, f"the {name} fast path is not taken: {choice.reason}"
    return checkpoint, f"native {name} ({', '.join(native)}) and the {name} fast path passed its probe"


def resolve_cpu_format(requested: str | torch.dtype, checkpoint: torch.dtype, quantization: str | None,
                       plan: KernelPlan) -> tuple[torch.dtype, str | None]:
    """The model dtype and the products' weight format on this CPU under ``plan``. ``requested`` "auto" with a
    bfloat16 or float16 ``checkpoint`` whose products are not otherwise quantised keeps them in that dtype in a float32
    model where the compiled kernels read such weights (``quantization="bf16"`` / ``"fp16"``: the float32 decode path
    at half the bytes, the checkpoint's own values); otherwise "auto" keeps a half-precision dtype only where
    ``cpu_auto_dtype`` finds it fast, and an explicit dtype stays as it is."""
    if requested != "auto":
        return checkpoint, quantization
    if quantization is None and plan.half_kernel(checkpoint):
        logger.info('dtype "auto" on this CPU: float32 with %s weights (checkpoint torch_dtype %s): the compiled '
                    "kernels read them at two bytes", dtype_name(checkpoint), dtype_name(checkpoint))
        return torch.float32, HALF_WEIGHT_SCHEMES[checkpoint]
    chosen, why = cpu_auto_dtype(checkpoint, plan)
    logger.info('dtype "auto" on this CPU: %s (checkpoint torch_dtype %s): %s', dtype_name(chosen),
                dtype_name(checkpoint), why)
    return chosen, quantization
