"""The decode step's compiled CPU kernels, as typed torch operators (``torch.ops.mla_kernels``, built by ``cpu_ops``;
their sources are ``csrc/*.c`` and ``csrc/ops/cpu_kernels.cpp``):

- ``linear(x, w, scales=None, block=[], variant="auto")``: ``x · Wᵀ`` in float32 for every weight format: float32,
  bfloat16 and float16 (1 to ``max_rows`` rows; half weights read at two bytes and widened exactly); int8 with
  float32 row scales (rows rounded to int16), block-FP8 with its block scales and group-wise int4 (ggml's Q4_0
  numbers: ``mla_kernels.int4_format``; rows rounded to int8 per group of 32), any number of rows, ``max_rows`` a
  pass. Each runs an AVX2 or an AVX-512 variant, chosen at run time (``variants``; int8 and int4 with the same bits);
- ``linear_int4(x, w, scales, zeros=None, group=32, variant="auto")``: the int4 product with a stored checkpoint's
  layout: a float16 scale per group of 32, 64 or 128 values and, for asymmetric groups, a byte zero point per group
  (``csrc/gemv_int4.c``; the same variants, the same bits as ``linear`` for symmetric groups of 32);
- ``ggml_linear(x, w, type, variant="auto")``: ``x · Wᵀ`` in float32 for a weight in a ggml block type as a GGUF file
  stores it (Q8_0, Q4_1, Q5_0, Q5_1, Q2_K to Q6_K: ``csrc/gemv_ggml.c``), read block by block, rows rounded to int8
  per group of 32, any number of rows; AVX2 and AVX-512 VNNI variants with the same bits;
- ``dense_linear(x, plain, operand, tiles, bias, rows, onednn)``: the one product of a float weight prepared once
  (``mla_runtime.layers.cpu_gemm.PackedWeight``), choosing by the count of rows between ``linear``, ATen's, AMX
  tiles and oneDNN's (called through the dispatcher) on the weight's prepared layouts;
- ``amx_pack(w)`` / ``amx_linear(x, packed)``: bfloat16 products of a few dozen rows on AMX tiles (``csrc/amx_bf16.c``;
  ``failure("amx")`` is None only on a CPU with AMX-BF16 whose kernel lets the process use the tiles), the weight
  repacked once into the tiles' layout;
- ``rms_norm``, ``absorbed_decode(..., variant="auto")`` (absorption into the latent, attention over the paged latent
  cache, up-projection; one source compiled for AVX2 and for AVX-512, the "float" variants), ``rope_store`` (the
  latent side of a step: norm, RoPE, cache write); the cache holds float32, bfloat16 or float16 rows (a compact row
  is written rounded as torch rounds and read widened exactly: the float32 cache's sums over the same values), or
  int8 / float8_e4m3fn rows with their per-token ``scales [S, 2]`` (quantised as ``common.quantize_per_token``,
  read as ``common.dequantize_rows``);
- ``mlp_table`` / ``gated_mlps`` / ``moe_row``: gated MLPs of one row, or a MoE layer's router, routing, routed and
  shared experts in one call; ``mlps_rows``: MLPs in ggml block types over rows of a step, all in one parallel
  region; ``layer_table`` / ``decode_step`` / ``decoder_layer``: a whole decoder layer of one to ``max_rows`` rows
  (``mla_kernels.cpu_tables`` builds the tables).

Every operator reads its sizes from its tensors and refuses (``ValueError``) what they do not hold.

Why they exist: a decode step at batch 1 multiplies one row by every weight matrix, streaming each from memory once.
oneDNN and MKL reach the memory bandwidth only on large matrices: on a 2-core AMD EPYC (Zen 3, AVX2) with the
weights out of cache (``bench/bench_gemv.py``) oneDNN streams a ``[512, 256]`` weight at 4.2 GB/s, ``[1024, 512]``
at 7.6 and ``[4096, 1024]`` at 15.1 GB/s, where the machine streams 16–25 GB/s; the kernels read each thread's rows
front to back as two streams with the input rows in L1. A step's small operations cost more in dispatch than in
arithmetic (``F.rms_norm`` of one row: about 35 µs; a MoE router in torch ops: about 120 µs), hence the norm, the
attention, the MoE layer and then the whole decoder layer as single calls (bench/RESULTS.md).

``failure(kind)`` (once per process) is None where the operators loaded and ``cpu_check`` found the kind's kernels
exact on this CPU; else the reason, and callers keep their torch paths (``mla_runtime.layers.cpu_gemm``). Results
equal torch's to float rounding (another summation order), except the int8 and int4 products' rounding of their rows.
"""

from __future__ import annotations

import functools
import platform

import torch

from . import cpu_check, cpu_ops

# the kernels' families, as cpu_check checks them
KINDS = ("core", "bf16", "f16", "fp8", "int4", "ggml", "w8a8", "fp4", "amx", "delta")


@functools.cache
def failure(kind: str = "core") -> str | None:
    """None where the kernels of ``kind`` (``KINDS``; "core": float32 and int8 products, the norm, the attention and
    the tables) are built and exact on this machine, else why not. Every kind needs "core". "ops": the operators are
    built and loaded (``dense_linear`` calls a kernel only where its caller's plan found that kernel exact). "delta":
    the linear-attention operators (``delta_rule_step``, ``delta_rule_prefill``, ``short_conv_step``), built on every
    architecture."""
    if kind == "delta":
        return cpu_ops.failure() or cpu_check.failure("delta")
    if not cpu_ops.x86():
        return f"the kernels are written for x86-64 (this CPU: {platform.machine()})"
    why = cpu_ops.failure()
    if why is not None or kind == "ops":
        return why
    return cpu_check.failure("core") if kind == "core" else failure("core") or cpu_check.failure(kind)


def ops():  # type: ignore[no-untyped-def]
    """``torch.ops.mla_kernels``; only where ``failure()`` is None."""
    assert failure() is None, f"the CPU kernels are not loaded: {failure()}"
    return torch.ops.mla_kernels


@functools.cache
def _limits() -> dict[str, int]:
    return dict(torch.ops.mla_kernels.limits()) if failure() is None else {}


def max_rows(weight: torch.dtype) -> int:
    """How many rows the kernels take in one pass over weights of this dtype (0 where they do not run): a ``linear``
    call takes at most that many with float weights, and any number with quantised ones, in passes of that many."""
    quantized = weight in (torch.int8, torch.uint8, torch.float8_e4m3fn)
    return _limits().get("quant_rows" if quantized else "few_rows", 0)


def max_topk() -> int:
    """The most experts ``moe_row`` routes a row to."""
    return _limits().get("moe_max_topk", 0)


def linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None, *,
           block: tuple[int, ...] = (), variant: str = "auto", bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x · Wᵀ (+ bias)`` in float32 for 1 to ``max_rows(weight.dtype)`` rows ``x [..., K]`` (module docstring)."""
    y = ops().linear(x, weight, scales, list(block), variant)
    return y if bias is None else y.add_(bias)


def linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                group: int = 32, *, variant: str = "auto", bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x · Wᵀ (+ bias)`` in float32 for any number of rows ``x [..., K]`` and a group-wise int4 weight: the nibbles
    of ``int4_format.pack_int4``, a float16 scale per ``group`` (32, 64, 128) values of a row and, for asymmetric
    groups, uint8 ``zeros`` in [0, 16] (``W = scale * (nibble - zero)``; none: 8, the symmetric format)."""
    y = ops().linear_int4(x, packed, scales, zeros, group, variant)
    return y if bias is None else y.add_(bias)


def ggml_linear(x: torch.Tensor, weight: torch.Tensor, type_number: int, *, variant: str = "auto",
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x · Wᵀ (+ bias)`` in float32 for any number of rows ``x [..., K]`` and a weight in a ggml block type as a GGUF
    file stores it (uint8 ``[N, K / B · size]``, ``type_number``: ggml's number; ``cpu_check.GGML_TYPES`` names those
    read); only where ``failure("ggml")`` is None."""
    y = ops().ggml_linear(x, weight, type_number, variant)
    return y if bias is None else y.add_(bias)


def int4_table(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
               k: int) -> torch.Tensor:
    """The scales operand the whole-MLP and whole-layer kernels' tables (``cpu_tables``) read beside a grouped int4
    matrix's nibbles (``linear_int4``'s operands: groups of 32, 64 or 128, zero points or none): an int64 table of
    its scales' and zeros' addresses and its group (``csrc/mla_cpu.h``). It points into them: whoever holds it keeps
    them."""
    return ops().int4_table(packed, scales, zeros, group, k)  # type: ignore[no-any-return]


def ggml_parts(parts: list[torch.Tensor], type_numbers: list[int], k: int) -> torch.Tensor:
    """The operand the whole-MLP and whole-layer kernels' tables (``cpu_tables``) read for a matrix stacked from parts
    in ggml block types (each as ``ggml_linear`` takes its weight, ``type_numbers`` theirs): an int64 table of the
    parts' types, addresses, row strides and rows (``csrc/mla_cpu.h``). It points into the parts: whoever holds it
    keeps them."""
    return ops().ggml_parts(parts, type_numbers, k)  # type: ignore[no-any-return]


Q4_K_R8 = 1012  # the type number of Q4_K rows repacked by ``ggml_repack`` (``csrc/mla_cpu.h``: MLA_GG_Q4_K_R8)


def ggml_repack(weight: torch.Tensor, k: int) -> torch.Tensor:
    """Q4_K rows (uint8 ``[N, K / 256 · 144]``, ``N`` a multiple of 8) repacked for the kernels: uint8
    ``[N, K / 256 · 148]`` of type ``Q4_K_R8``, the same values with eight rows interleaved a super-block at a time
    and their scales unpacked to bytes (``csrc/ggml_rows.h``, ``gg_q4r8_rows``); ``ggml_linear`` and the tables read
    it with the bits of the stored rows' products."""
    return ops().ggml_repack(weight, k)  # type: ignore[no-any-return]


def fp4_table(packed: torch.Tensor, scales: torch.Tensor, global_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The FP4 table of a matrix as ``fp4_linear`` takes it (its ``K`` a whole number of groups): int64 ``{format, N,
    K, scales' address, global scales' address}`` (``csrc/mla_cpu.h``). ``(packed, table)`` is the matrix's operand in
    the whole-MLP and whole-layer kernels' tables (``cpu_tables``). It points into the scales: whoever holds it keeps
    them."""
    return ops().fp4_table(packed, scales, global_scales)  # type: ignore[no-any-return]


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, *, variant: str = "auto",
                bias: torch.Tensor | None = None, row_amax: torch.Tensor | None = None) -> torch.Tensor:
    """``x · Wᵀ (+ bias)`` in float32 for any number of rows ``x [..., K]``, each rounded to int8 on the fly, and an
    int8 weight ``[N, K]`` with float32 row scales ``[N]`` (``mla_kernels.w8a8_format``: the same values); only where
    ``failure("w8a8")`` is None. ``row_amax`` (float32, one a row): the amax each row is rounded with in place of its
    own (a tensor-parallel rank's slice of ``K``)."""
    y = ops().w8a8_linear(x, weight, scales, variant, row_amax)
    return y if bias is None else y.add_(bias)


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scales: torch.Tensor | None = None,
               *, variant: str = "auto", bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x · Wᵀ (+ bias)`` in float32 for any number of rows ``x [..., K]`` and FP4 E2M1 weights (``fp4_format``):
    ``packed [N, K / 2]`` with MXFP4 uint8 scales ``[N, K / 32]``, or NVFP4 float8_e4m3fn scales ``[N, K / 16]`` and
    float32 ``global_scales [N]``; only where ``failure("fp4")`` is None."""
    y = ops().fp4_linear(x, packed, scales, global_scales, variant)
    return y if bias is None else y.add_(bias)


def dense_linear(x: torch.Tensor, plain: torch.Tensor, operand: torch.Tensor | None, tiles: torch.Tensor | None,
                 bias: torch.Tensor | None, rows: tuple[int, int, int], onednn: bool) -> torch.Tensor:
    """``x · Wᵀ (+ bias)`` in ``x``'s dtype for a float weight prepared once (``layers.cpu_gemm.PackedWeight``), the
    product chosen inside the operator by the count of rows: up to ``rows[0]`` the few-row kernels, up to ``rows[1]``
    ATen's, up to ``rows[2]`` AMX ``tiles``, more oneDNN's (ATen's where ``onednn`` is false) on ``operand``."""
    return torch.ops.mla_kernels.dense_linear(x, plain, operand, tiles, bias, rows, onednn)  # type: ignore[no-any-return]


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 ``[N, K]`` weight (``N`` a multiple of 16, ``K`` of 32) repacked for ``amx_linear``; only where
    ``failure("amx")`` is None."""
    return ops().amx_pack(weight)  # type: ignore[no-any-return]


def amx_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x · Wᵀ`` in float32 on AMX tiles for float32 (rounded to bfloat16) or bfloat16 rows ``x [..., K]`` and a
    weight packed by ``amx_pack``."""
    return ops().amx_linear(x, packed)  # type: ignore[no-any-return]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (K,), weight, eps)`` for float32 rows ``x [..., K]``, on one thread."""
    return ops().rms_norm(x, weight, eps)  # type: ignore[no-any-return]


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, slots: torch.Tensor, *, variant: str = "auto") -> torch.Tensor:
    """One token of ``B`` sequences through the gated delta rule (``q, k`` prepared, ``g`` the log forget gate: float32
    ``[B, H, d_k]``; ``v [B, H, d_v]``, ``beta [B, H]``), each sequence's state ``state[slots[b]]`` (float32 ``[N, H,
    d_k, d_v]``, contiguous) updated in place; returns the outputs ``[B, H, d_v]``. Only where ``failure("delta")`` is
    None."""
    return torch.ops.mla_kernels.delta_rule_step(q, k, v, g, beta, state, slots, variant)  # type: ignore[no-any-return]


def delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, slots: torch.Tensor, cu: torch.Tensor, *, variant: str = "auto",
                       block: int = 16) -> torch.Tensor:
    """The tokens ``cu[s] .. cu[s + 1]`` of sequence ``s`` (``[T, H, ...]`` as ``delta_rule_step``'s rows) through the
    rule in its chunked (WY) form, ``block`` tokens a block (1 to 64; 0: token after token, for comparison), from its
    state ``state[slots[s]]``, updated in place (a fresh sequence's slot zeroed by the caller); returns the outputs
    ``[T, H, d_v]``. Only where ``failure("delta")`` is None."""
    return torch.ops.mla_kernels.delta_rule_prefill(  # type: ignore[no-any-return]
        q, k, v, g, beta, state, slots, cu, variant, block)


def short_conv_step(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The causal short convolution of one new input row per sequence (``x [B, C]`` float32) over its window ``[conv
    [slots[b]] ; x[b]]`` (``conv [N, C, K - 1]`` float32, updated in place), taps ``weight [C, K]``, silu applied:
    ``[B, C]`` float32. Only where ``failure("delta")`` is None."""
    return torch.ops.mla_kernels.short_conv_step(x, conv, weight, slots)  # type: ignore[no-any-return]


def delta_variants() -> tuple[str, ...]:
    """The variants of ``delta_rule_step`` this process runs, widest first ("avx512", "avx2", "generic")."""
    if cpu_ops.failure() is not None:
        return ()
    return tuple(v.split(":")[0] for v in torch.ops.mla_kernels.delta_rule_variants() if v.endswith(":runs"))


@functools.cache
def _variants() -> tuple[tuple[str, bool], ...]:
    if cpu_ops.failure() is not None or not cpu_ops.x86():
        return ()
    return tuple((v.split(":")[0], v.endswith(":runs")) for v in torch.ops.mla_kernels.product_variants())


def variants(kind: str, runs_only: bool = True) -> tuple[str, ...]:
    """The variants of the ``kind`` products, slowest first: "float" (float32, bfloat16 and float16 weights, and the
    absorbed attention: "avx2", "avx512"), "int8", "int4" or "ggml" ("avx2", "avx512_vnni"), "w8a8" ("avx2",
    "avx512_vnni", "amx": AMX int8 tiles from a few rows on); those this CPU executes, or all that are built
    (``runs_only=False``). ``linear`` takes the fastest unless told (float: AVX-512 for float32 weights from four rows
    on, for half weights from two). The int8, int4, ggml and w8a8 ones give identical results; the float ones each
    sum in their own order, and within one a row's result does not depend on the rows beside it."""
    return tuple(name.split(".", 1)[1] for name, runs in _variants()
                 if name.startswith(kind + ".") and (runs or not runs_only))
