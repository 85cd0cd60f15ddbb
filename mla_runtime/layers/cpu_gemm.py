"""CPU matrix products: a path chosen per weight dtype by a run-time probe, with weights prepared once at load.

``F.linear`` on a CPU tensor calls MKL's sgemm for float32. On AMD processors MKL does not take its
AVX-512 paths, and for the small ``M`` of decoding (1–32 rows) it runs far below the memory bandwidth
(measured on a 2-core EPYC, ``[8, 1024] × [1024, 32000]`` fp32: MKL 27 ms, oneDNN 9.4 ms; bf16
``[1, 1024] × [1024, 32000]``: 6.7 ms plain, 3.4 ms pre-packed). oneDNN picks its kernels by the
instruction set alone, and a weight reordered once into its blocked layout (``_reorder_linear_weight``)
is streamed without a per-call reorder.

Whether oneDNN can pack a dtype depends on the CPU (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT on x86;
other CPUs have their own rules), so no instruction set is assumed: the kernel plan (``mla_runtime.kernel_plan``)
probes each dtype once per process, and every weight is prepared against that plan (``PackedWeight``). Paths
(``GemmChoice.path``):

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
``plain`` where the CPU has native arithmetic in it (``kernel_plan.NATIVE_CAPABILITIES``) and ``upcast`` where it has
not (ATen then widens every element of every product); float32 takes ``plain``. A rule, not a timing: the path,
and so the numbers, never depend on the machine's load at start-up. Results equal ``F.linear`` to float rounding
(the same products, another summation order). Anything else — another device or dtype, an empty input — goes to
``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mla_kernels import cpu_kernels
from mla_runtime.kernel_plan import AMX_MAX_ROWS, PROBED_DTYPES, KernelPlan, onednn_linear, reorder

FEW_ROWS = 8  # small float32 weights take F.linear for every product of up to this many rows
# bfloat16 weights: products of up to this many rows take the compiled kernel that reads them at two bytes, by the
# weight's path (module docstring): against oneDNN's native bfloat16 products up to two rows; against the float32 copy
# of a CPU without them, every few-row product
BF16_KERNEL_ROWS = {"onednn": 2, "upcast": 8}
# products of up to ROWS rows with a weight of at most ELEMENTS elements take F.linear (module docstring)
ATEN_ROWS: dict[torch.dtype, tuple[int, int]] = {torch.float32: (32 << 10, FEW_ROWS), torch.bfloat16: (4 << 10, 1),
                                                 torch.float16: (4 << 10, 1)}
KERNEL_MAX_ROWS = 8  # products of up to this many rows take the AVX2 kernels where they build (bench/RESULTS.md)


def amx_fits(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a matrix the AMX tiles take: a contiguous bfloat16 CPU ``[N, K]`` with ``N`` a multiple
    of 16 and ``K`` of 32 (every projection of the MLA models; a row-split shard may not be)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0 and weight.numel() > 0)


class PackedWeight:
    """One ``[N, K]`` weight prepared for its dtype's path under a ``KernelPlan`` (see the module docstring): its
    layouts, and the row limits with which ``dense_linear`` picks each product's route."""

    __slots__ = ("plain", "blocked", "wide", "amx", "plain_gemv", "row_kernel", "upcast", "aten_max_rows", "bf16_rows",
                 "onednn", "compiled", "operand", "rows", "paired")
    quantized = False  # True: a weight-only quantised matrix (``layers.quantization``)
    rounds_to_int8 = False  # True: its products round their input rows to int8 (``rows_invariant``)

    def __init__(self, weight: torch.Tensor, plan: KernelPlan) -> None:
        self.plain = weight.detach()
        path = plan.choice(weight.dtype).path
        self.upcast = path == "upcast"
        self.wide: torch.Tensor | None = None  # the float32 copy, where it is computed with F.linear
        self.blocked: torch.Tensor | None = None
        # a bfloat16 weight in AMX's tile layout, where the CPU has them: it takes the blocked copy's place, and
        # products of more rows run oneDNN on the plain weight
        self.amx: torch.Tensor | None = None
        if path == "onednn" and plan.tiles and amx_fits(self.plain):
            self.amx = cpu_kernels.amx_pack(self.plain.contiguous())
        elif path == "onednn" and not plan.one_layout:
            self.blocked = reorder(self.plain)
        elif path == "onednn":
            pass  # one layout (``KernelPlan.one_layout``): oneDNN on the plain weight
        elif self.upcast and plan.choice(torch.float32).path == "onednn":
            self.blocked = reorder(self.plain.float())  # the only float32 layout kept
        elif self.upcast:
            self.wide = self.plain.float()
        else:
            raise ValueError(f"path: a packed weight is 'onednn' or 'upcast', got {path!r}")
        self.onednn = path == "onednn" or self.blocked is not None  # many rows: oneDNN's products, else ATen's
        self.compiled = plan.ops_failure is None  # the products chosen inside ``dense_linear``
        self.plain_gemv = path == "onednn" and weight.dtype == torch.float32  # one row: oneDNN on the plain weight
        self.row_kernel = self.plain_gemv and self.plain.is_contiguous() and plan.row_kernels  # ... or the kernel on it
        # products of at most this many rows take F.linear (small weights: oneDNN's per-call set-up dominates)
        # (the AVX2 kernels, where they run, take every product F.linear could win: up to FEW_ROWS rows)
        n, k = weight.shape
        self.aten_max_rows = aten_max_rows(n, k, weight.dtype) if path == "onednn" and not self.row_kernel else 0
        if self.aten_max_rows and not self.compiled:  # the torch fallback: a small weight takes F.linear throughout
            self.blocked, self.onednn = None, False
        half = self.plain.is_contiguous() and plan.half_kernel(weight.dtype)
        self.bf16_rows = BF16_KERNEL_ROWS.get(path, 0) if half else 0
        # what every product reads, fixed here: the layout kept for many rows, and dense_linear's row limits (the
        # few-row kernels, ATen's products, AMX tiles)
        self.operand: torch.Tensor | None = self.blocked if self.blocked is not None else self.wide
        self.rows = (KERNEL_MAX_ROWS if self.row_kernel else self.bf16_rows, self.aten_max_rows,
                     AMX_MAX_ROWS if self.amx is not None else 0)
        self.paired = False  # a lone row's product computed as two (rows_invariant)

    @staticmethod
    def make(weight: torch.Tensor, plan: KernelPlan) -> PackedWeight | None:
        """The weight prepared for its dtype's path under ``plan``, or None where callers use ``F.linear``."""
        if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in PROBED_DTYPES:
            return None
        return None if plan.choice(weight.dtype).path == "plain" else PackedWeight(weight, plan)

    def bind(self, plan: KernelPlan) -> PackedWeight:
        """Take ``plan``'s paths (a quantised format: its kernels; a float weight is packed anew by ``prepared``)."""
        return self

    def row_operand(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """The weight as the compiled one-row kernels read it (``mla_kernels.cpu_tables.GatedMLPTable``), or None where
        its products do not take them: a float32 weight's few-row products (``row_kernel``), or a half-precision one
        read at two bytes (``bf16_rows``)."""
        return self.plain if self.row_kernel or self.bf16_rows else None

    def rows_invariant(self) -> None:
        """Give every row of a product the same bits whatever rows share it: oneDNN's product on the blocked layout
        for every count of rows (the few-row kernels, ATen's and AMX's sum in other orders), a lone row computed as
        two (oneDNN's one-row kernel splits a wide product's sums). For a model whose products round their rows,
        where a last-bit difference becomes a step of the rounding (``DeepseekForCausalLM.rows_invariant``). Only
        on the ``onednn`` path of a float32 weight (oneDNN's product on the plain weight gives the blocked one's bits);
        elsewhere the routes stay."""
        if self.onednn and self.plain.dtype == torch.float32 and (self.blocked is not None or self.operand is None):
            self.operand = self.blocked if self.blocked is not None else self.plain  # one layout: the plain weight
            self.rows, self.plain_gemv, self.row_kernel, self.paired = (0, 0, 0), False, False, True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K] · Wᵀ (+ bias)`` in ``x``'s dtype: the compiled ``dense_linear``, which picks the route by the
        count of rows, or where it does not load the torch fallback on the layout kept for many rows."""
        if self.paired and x.numel() == x.shape[-1]:
            two = self.matmul(doubled(x), bias)
            return two[:1].reshape(*x.shape[:-1], two.shape[-1])
        if self.compiled:
            return cpu_kernels.dense_linear(x, self.plain, self.operand, self.amx, bias, self.rows, self.onednn)
        one_row = self.plain_gemv and x.numel() == x.shape[-1]  # oneDNN streams the plain weight faster for one row
        return torch_product(x, self.plain if self.operand is None or one_row else self.operand, bias, self.onednn)


def prepared(weight: torch.Tensor, packed: PackedWeight | None, plan: KernelPlan) -> PackedWeight | None:
    """What ``weight``'s products run on under ``plan``: its quantised matrix (``packed``, bound to the plan), or the
    float weight packed anew."""
    if packed is not None and packed.quantized:
        packed.bind(plan)
        return packed
    return PackedWeight.make(weight, plan)


def aten_max_rows(n: int, k: int, dtype: torch.dtype) -> int:
    """Up to how many rows products with an ``[n, k]`` ``dtype`` weight take ``F.linear`` rather than oneDNN: a size
    rule (``ATEN_ROWS``; see the module docstring)."""
    elements, rows = ATEN_ROWS.get(dtype, (0, 0))
    return rows if n * k <= elements else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by the product ``packed`` (made from ``weight``) was prepared for: its format's
    one operator (or that format's torch fallback), else ATen's (an unprepared weight, another device)."""
    if packed is None:
        return F.linear(x, weight, bias)
    return packed.matmul(x, bias)


def doubled(x: torch.Tensor) -> torch.Tensor:
    """A lone row ``x [..., K]`` as two rows ``[2, K]``: oneDNN's one-row kernel splits a wide product's sums, its
    kernel for two rows sums as for any larger count (``PackedWeight.rows_invariant``)."""
    return x.reshape(1, -1).expand(2, -1).contiguous()


def onednn_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [T, K] · Wᵀ`` for float32 rows and weight by oneDNN's product, a lone row computed as two: a row gets the
    same bits at every ``T`` (``PackedWeight.rows_invariant``)."""
    if x.shape[0] == 1:
        return onednn_linear(doubled(x), weight)[:1]
    return onednn_linear(x.contiguous(), weight)


def torch_product(x: torch.Tensor, operand: torch.Tensor, bias: torch.Tensor | None, onednn: bool) -> torch.Tensor:
    """A prepared float weight's product where the compiled operators do not load: oneDNN's (ATen's where ``onednn``
    is false) on ``operand``, the rows computed in its dtype and the bias added in the wider dtype."""
    product = onednn_linear if onednn else F.linear
    if x.dtype == operand.dtype:
        return product(x, operand, bias)
    y = product(x.to(operand.dtype), operand).to(torch.promote_types(x.dtype, operand.dtype))
    return (y if bias is None else y.add_(bias)).to(x.dtype)
