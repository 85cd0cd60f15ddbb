"""The compiled CPU kernels checked on this machine, once per process, before any layer takes them: products of small
integers (exact in float32) with row and column tails against float64, the widening of every FP8 byte and every
float16 scale, the norm and the absorbed attention against torch. A kind that fails is not used (``failure(kind)``
says why) and its callers keep their torch paths; a wrong result never reaches a model."""

from __future__ import annotations

import functools

import torch

from . import (
    cpu_kernels,  # its variants(); it imports this module, which reads it only inside calls
    cpu_ops,
)
from .common import dequantize_rows, quantize_per_token
from .fp4_format import dequantize_fp4
from .int4_format import INT4_GROUP, pack_int4
from .w8a8_format import w8a8_product


def _ops():  # type: ignore[no-untyped-def]
    return torch.ops.mla_kernels


def _exact(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.double(), want)


@functools.cache
def failure(kind: str) -> str | None:
    """None where the kernels of ``kind`` ("core", "bf16", "f16", "fp8", "int4", "ggml", "w8a8", "fp4", "amx",
    "delta") are exact here (the delta rule's: equal to torch's float32 to rounding), else why not. Only where the
    operators are loaded (``cpu_ops.failure()`` is None)."""
    g = torch.Generator().manual_seed(0)
    checks = {"core": _core, "bf16": _half, "f16": _half, "fp8": _fp8, "int4": _int4, "ggml": _ggml, "w8a8": _w8a8,
              "fp4": _fp4, "amx": _amx, "delta": _delta}
    return checks[kind](g, kind)


def _core(g: torch.Generator, kind: str) -> str | None:
    ops = _ops()
    for n, k in ((37, 77), (8, 64), (1, 3)):  # row and column tails included
        w = torch.randint(-2, 3, (n, k), generator=g).float()
        for rows in (1, 3):
            x = torch.randint(-2, 3, (rows, k), generator=g).float()
            exact = x.double() @ w.double().T
            if not _exact(ops.linear(x, w), exact):
                return f"the float32 products of {rows} rows differ from the exact result on this CPU"
            if not _exact(ops.linear(x, w.to(torch.int8), torch.full((n,), 0.5)), exact * 0.5):
                return f"the int8 products of {rows} rows differ from the exact result on this CPU"
    xs, weight = torch.randn(3, 40, generator=g), torch.randn(40, generator=g)
    if not torch.allclose(ops.rms_norm(xs, weight, 1e-6), torch.nn.functional.rms_norm(xs, (40,), weight, 1e-6),
                          rtol=1e-5, atol=1e-6):
        return "the RMSNorm kernel differs from torch's on this CPU"
    return _decode(g)


def _decode(g: torch.Generator) -> str | None:
    """The absorbed decode kernel, each variant the CPU runs, against the same attention in torch (float64) on a small
    random layer; over a bfloat16, float16, int8 or float8_e4m3fn cache, equal to the float32 cache of the same
    (dequantised) values."""
    rows, heads, d_n, d_r, d_c, d_v, blocks = 3, 5, 16, 8, 72, 24, 40
    q_n, q_r = torch.randn(rows, heads, d_n + d_r, generator=g).split([d_n, d_r], dim=-1)
    w_uk, w_uv_t = torch.randn(heads, d_n, d_c, generator=g), torch.randn(heads, d_c, d_v, generator=g)
    cache = torch.randn(blocks, d_c + d_r, generator=g)
    lens = torch.tensor([1, 7, 33])
    slots = torch.randperm(blocks, generator=g)[:33].repeat(rows, 1)
    runs = cpu_kernels.variants("float")  # the attention's variants are the float products' (AVX2, AVX-512)
    for variant, weights in ((v, w) for v in runs for w in ((w_uk, w_uv_t), (w_uk.bfloat16(), w_uv_t.bfloat16()))):
        got = _ops().absorbed_decode(q_n, q_r, *weights, cache, slots, lens, 0.3, variant)
        uk, uv_t = (w.double() for w in weights)
        for t in range(rows):
            keys = cache[slots[t, :lens[t]]].double()
            q_abs = torch.einsum("hn,hnc->hc", q_n[t].double(), uk)
            p = torch.softmax(0.3 * (torch.cat([q_abs, q_r[t].double()], -1) @ keys.T), dim=-1)
            want = torch.einsum("hc,hcv->hv", p @ keys[:, :d_c], uv_t)
            if not torch.allclose(got[t].double(), want, rtol=1e-4, atol=1e-4):
                return (f"the absorbed decode kernel ({variant}, {weights[0].dtype} weights) differs from torch's "
                        "attention here")
    for variant, dtype in ((v, d) for v in runs for d in (torch.bfloat16, torch.float16, torch.int8,
                                                          torch.float8_e4m3fn)):
        scales = None  # read as the float32 cache of the same (dequantised) values, bit for bit
        if dtype in (torch.bfloat16, torch.float16):
            compact = cache.to(dtype)
            values = compact.float()
        else:
            (qc, sc), (qr, sr) = (quantize_per_token(part, dtype) for part in cache.split([d_c, d_r], dim=-1))
            compact, scales = torch.cat([qc, qr], dim=-1), torch.stack([sc, sr], dim=-1)
            values = dequantize_rows(compact, scales, d_c)
        got = _ops().absorbed_decode(q_n, q_r, w_uk, w_uv_t, compact, slots, lens, 0.3, variant, scales)
        if not torch.equal(got, _ops().absorbed_decode(q_n, q_r, w_uk, w_uv_t, values, slots, lens, 0.3, variant)):
            return f"the absorbed decode kernel ({variant}) reads a {dtype} cache unlike its float32 values here"
    return None


def _half(g: torch.Generator, kind: str) -> str | None:
    dtype = torch.bfloat16 if kind == "bf16" else torch.float16
    for n, k, rows in ((37, 77, 1), (8, 64, 5), (3, 5, 8)):
        w = torch.randint(-3, 4, (n, k), generator=g).to(dtype)
        w[0, -1] = 0.375  # a fraction: the widening keeps the mantissa
        x = torch.randint(-3, 4, (rows, k), generator=g).float()
        if not _exact(_ops().linear(x, w), x.double() @ w.double().T):
            return f"the {dtype}-weight products differ from the exact result on this CPU"
    return None


def _amx(g: torch.Generator, kind: str) -> str | None:
    """The AMX bfloat16 products: small integers and a fraction (exact in bfloat16 and in their float32 sums), with
    an odd count of column blocks, a partial row tile and rows past 32; float32 rows rounded as torch rounds them."""
    if cpu_ops.isa_cap() != "amx":
        return f"${cpu_ops.ISA_ENV} caps this process at {cpu_ops.isa_cap()}, below the AMX tiles"
    if not dict(_ops().limits()).get("amx_bf16"):
        return "the CPU has no AMX bfloat16 tiles (amx-tile, amx-bf16 with AVX512-BF16), or its kernel does not let " \
               "a process use them"
    for n, k, rows in ((48, 64, 1), (16, 96, 17), (32, 32, 40)):
        w = torch.randint(-3, 4, (n, k), generator=g).to(torch.bfloat16)
        w[0, -1] = 0.375
        x = torch.randint(-3, 4, (rows, k), generator=g).float()
        x[-1, 0] = 1.0 + 2.0 ** -9  # rounds to 1 in bfloat16 (to nearest even)
        got = _ops().amx_linear(x, _ops().amx_pack(w))
        if not _exact(got, x.bfloat16().double() @ w.double().T):
            return f"the AMX bfloat16 products of {rows} rows differ from the exact result on this CPU"
    return None


def _fp8(g: torch.Generator, kind: str) -> str | None:
    ops = _ops()
    every = torch.zeros(512, 17, dtype=torch.uint8)
    every[:256, 5] = every[256:, 16] = torch.arange(256, dtype=torch.uint8)  # each byte, in a vector and in the tail
    weight = every.view(torch.float8_e4m3fn)
    want = weight[:, 5].float().add(weight[:, 16].float()) * 0.5
    for rows in (1, 5):  # straight from the bytes, and through a widened row
        x = torch.zeros(rows, 17)
        x[:, 5] = x[:, 16] = 1.0
        got = ops.linear(x, weight, torch.full((4, 2), 0.5), [128, 16])
        if not torch.equal(torch.isnan(got), torch.isnan(want).expand(rows, -1)) or not torch.equal(
                torch.nan_to_num(got), torch.nan_to_num(want).expand(rows, -1)):
            return "the FP8 kernel widens e4m3 bytes wrongly on this CPU"
    for n, k, block, rows in ((37, 77, (16, 32), 1), (37, 77, (16, 32), 9), (8, 64, (128, 128), 3), (3, 5, (1, 2), 2)):
        weight = torch.randint(-2, 3, (n, k), generator=g).float().to(torch.float8_e4m3fn)
        shape = (-(-n // block[0]), -(-k // block[1]))
        scale = torch.tensor([0.25, 0.5, 2.0])[torch.randint(0, 3, shape, generator=g)]
        x = torch.randint(-2, 3, (rows, k), generator=g).float()
        wide = weight.double() * scale.double().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        if not _exact(ops.linear(x, weight, scale, list(block)), x.double() @ wide.T):
            return "the FP8 kernel's products differ from the exact result on this CPU"
    return None


def _int4(g: torch.Generator, kind: str) -> str | None:
    """Every variant the CPU executes: the widening of every finite float16 scale, then products with row and group
    tails whose activations round to themselves (each group's largest magnitude 127: scale 1) and whose sums are
    exact in float32."""
    runs = cpu_kernels.variants("int4")
    if not runs:
        return "no int4 variant runs on this CPU"
    for variant in runs:
        why = _int4_variant(g, variant)
        if why is not None:
            return why
    return None


def _int4_variant(g: torch.Generator, variant: str) -> str | None:
    ops = _ops()
    # every finite float16 bit pattern as a scale: row j of x picks group j of each weight row, times 127
    bits = torch.arange(1 << 16, dtype=torch.int32)
    finite = bits[(bits & 0x7C00) != 0x7C00].to(torch.int16).view(torch.float16)
    groups = 32
    n = finite.numel() // groups
    scales = finite[:n * groups].reshape(n, groups)
    q = torch.zeros(n, groups * INT4_GROUP, dtype=torch.int8)
    q[:, ::INT4_GROUP] = 1
    x = torch.zeros(groups, groups * INT4_GROUP)
    x[torch.arange(groups), torch.arange(groups) * INT4_GROUP] = 127.0
    if not torch.equal(ops.linear(x, pack_int4(q), scales, variant=variant), scales.float().T * 127):
        return f"the int4 kernel ({variant}) widens float16 scales wrongly on this CPU"
    for n, k, rows in ((37, 64, 1), (37, 96, 3), (9, 40, 9), (70, 512, 13), (5, 32, 64), (6, 200, 5)):
        kp = -(-k // INT4_GROUP) * INT4_GROUP
        q = torch.randint(-8, 8, (n, kp), generator=g, dtype=torch.int8)
        q[:, k:] = 0
        x = torch.randint(-3, 4, (rows, k), generator=g).float()
        x[:, ::INT4_GROUP] = 127.0 * (torch.randint(0, 2, x[:, ::INT4_GROUP].shape, generator=g) * 2 - 1)
        one = torch.randint(-(1 << 15), 1 << 15, (n, 1), generator=g, dtype=torch.int32)  # one scale a row: any value
        one = torch.where((one & 0x7C00) == 0x7C00, one & ~0x4000, one).to(torch.int16).view(torch.float16)
        one = torch.where(one.float().abs() > 1e3, one / 256, one)  # sums of products stay exact in float32
        per_group = torch.tensor([0.25, 0.5, 1.0, 2.0])[torch.randint(0, 4, (n, kp // INT4_GROUP), generator=g)]
        for scales in (one.expand(n, kp // INT4_GROUP).contiguous(), per_group.half()):
            wide = (q.double().view(n, -1, INT4_GROUP) * scales.double().unsqueeze(2)).view(n, kp)[:, :k]
            if not _exact(ops.linear(x, pack_int4(q), scales, variant=variant), x.double() @ wide.T):
                return f"the int4 kernel's ({variant}) products differ from the exact result on this CPU"
    return None


# ggml block types the compiled kernels read as stored (ggml_linear), each with the byte offsets of its float16
# fields (scales and minimums), which the check sets to powers of two
GGML_TYPES = {"Q8_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _ggml(g: torch.Generator, kind: str) -> str | None:
    """Every variant the CPU executes, every type: random blocks with power-of-two float16 fields (sums of products
    exact in float32) against the ``gguf`` package's dequantised rows, times activations that round to themselves
    (integers, each group of 32 holding a magnitude 127: scale 1); a row of an odd count of 32-value blocks
    included; Q4_K also repacked eight rows at a time (``ggml_repack``)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    runs = cpu_kernels.variants("ggml")
    if not runs:
        return "no ggml-type variant runs on this CPU"
    for type_name, fields in GGML_TYPES.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        repacked = ((8, 2 * block, 5),) if type_name == "Q4_K" else ()
        for n, k, rows in ((5, 2 * block, 1), (3, 3 * block, 9)) + repacked:
            w = torch.randint(0, 256, (n, k // block, size), generator=g, dtype=torch.uint8)
            for offset, value in zip(fields, (0.5, 0.25)):
                w[..., offset:offset + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8)
            w = w.reshape(n, -1)
            wide = torch.from_numpy(dequantize(w.numpy(), GGMLQuantizationType[type_name])).double().reshape(n, k)
            x = torch.randint(-3, 4, (rows, k), generator=g).float()
            x[:, ::32] = 127.0 * (torch.randint(0, 2, x[:, ::32].shape, generator=g) * 2 - 1)
            for variant in runs:
                got = _ops().ggml_linear(x, w, int(GGMLQuantizationType[type_name]), variant)
                if not _exact(got, x.double() @ wide.T):
                    return f"the {type_name} kernel's ({variant}) products differ from the exact result on this CPU"
                if n % 8 == 0 and type_name == "Q4_K":
                    got = _ops().ggml_linear(x, _ops().ggml_repack(w, k), cpu_kernels.Q4_K_R8, variant)
                    if not _exact(got, x.double() @ wide.T):
                        return f"the repacked Q4_K kernel's ({variant}) products differ from the exact result"
    return None


def _w8a8(g: torch.Generator, kind: str) -> str | None:
    """Every W8A8 variant the CPU executes (AMX int8 tiles included) against ``w8a8_format.w8a8_product`` (its exact
    int32 sums), bit for bit: row and column tails, rows that round to themselves (largest magnitude 127), random float
    rows, a zero row, and sums past float32's exact integers (2^24)."""
    ops = _ops()
    cases = []
    for n, k, rows in ((37, 77, 1), (9, 64, 5), (70, 512, 13), (5, 33, 70), (40, 200, 20)):
        w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        sw = torch.rand(n, generator=g) + 0.5
        x = torch.randn(rows, k, generator=g) * 3
        x[0] = 0.0
        cases.append((x, w, sw))
    ints = torch.randint(-127, 128, (3, 96), generator=g).float()
    ints[:, 0] = 127.0
    cases.append((ints, torch.randint(-128, 128, (7, 96), generator=g, dtype=torch.int8), torch.full((7,), 0.5)))
    cases.append((torch.full((2, 2048), 1.5), torch.full((3, 2048), 127, dtype=torch.int8), torch.ones(3)))
    for variant in cpu_kernels.variants("w8a8"):
        for x, w, sw in cases:
            if not torch.equal(ops.w8a8_linear(x, w, sw, variant), w8a8_product(x, w, sw)):
                return f"the W8A8 kernel ({variant}) differs from its exact integer products on this CPU"
    return None


def _fp4_cases(g: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """FP4 weights whose scales take the stored values: UE8M0 exponents up to 252 (a larger one overflows 6 * 2^e - 127
    to infinity, and the identity's zeros make it NaN) for MXFP4, every finite
    E4M3 byte over global scales of 1 and 3 (NVFP4); random nibbles."""
    mx = torch.arange(253, dtype=torch.uint8)[torch.randperm(253, generator=g)][:252].reshape(6, 42)  # 6 * 2^125 finite
    e4m3 = torch.arange(256, dtype=torch.uint8)
    finite = e4m3[(e4m3 & 0x7F) != 0x7F]
    nv = finite[torch.randperm(finite.numel(), generator=g)][:252].reshape(6, 42).view(torch.float8_e4m3fn)
    out = []
    for variant, scales, group, glob in (("mxfp4", mx, 32, None), ("nvfp4", nv, 16, torch.tensor([1.0, 3.0] * 3))):
        packed = torch.randint(0, 256, (6, scales.shape[1] * group // 2), generator=g, dtype=torch.uint8)
        out.append((variant, packed, scales, glob))
    return out


def _fp4(g: torch.Generator, kind: str) -> str | None:
    """Each float variant the CPU executes: the rows of the identity give each weight's value alone (every scale and
    nibble widened exactly, as ``fp4_format.dequantize_fp4``); products of small integers with unit scales (exact
    sums) against float64, with 1 to 9 rows."""
    ops = _ops()
    for variant in cpu_kernels.variants("float"):
        for fmt, packed, scales, glob in _fp4_cases(g):
            k = packed.shape[1] * 2
            if not torch.equal(ops.fp4_linear(torch.eye(k), packed, scales, glob, variant),
                               dequantize_fp4(fmt, packed, scales, glob).T):
                return f"the {fmt} kernel ({variant}) widens its weights wrongly on this CPU"
            ones = torch.full_like(scales, 127) if fmt == "mxfp4" else torch.ones(scales.shape).to(scales.dtype)
            one = None if glob is None else torch.ones_like(glob)
            for rows in (1, 4, 9):
                x = torch.randint(-2, 3, (rows, k), generator=g).float()
                want = x.double() @ dequantize_fp4(fmt, packed, ones, one).double().T
                if not _exact(ops.fp4_linear(x, packed, ones, one, variant), want):
                    return f"the {fmt} kernel's ({variant}) products differ from the exact result on this CPU"
    return None


def _delta(g: torch.Generator, kind: str) -> str | None:
    """The linear-attention decode operators against the same step in torch on a small random batch: each variant of
    the delta rule this process runs (a tail of state columns included), and the short convolution."""
    ops = _ops()
    rows, heads, dk, dv, slots = 3, 2, 8, 12, torch.tensor([2, 0, 3])
    q, k = (torch.nn.functional.normalize(torch.randn(rows, heads, dk, generator=g), dim=-1) for _ in range(2))
    v, beta = torch.randn(rows, heads, dv, generator=g), torch.rand(rows, heads, generator=g)
    gate = -torch.rand(rows, heads, dk, generator=g)
    state = torch.randn(4, heads, dk, dv, generator=g)
    s = state[slots] * gate.exp().unsqueeze(-1)
    s = s + k.unsqueeze(-1) * ((v - torch.einsum("bhkv,bhk->bhv", s, k)) * beta.unsqueeze(-1)).unsqueeze(-2)
    want = torch.einsum("bhkv,bhk->bhv", s, q)
    for variant in cpu_kernels.delta_variants():
        got_state = state.clone()
        got = ops.delta_rule_step(q, k, v, gate, beta, got_state, slots, variant)
        if not (torch.allclose(got, want, rtol=1e-5, atol=1e-5) and torch.allclose(got_state[slots], s, rtol=1e-5,
                                                                                    atol=1e-5)):
            return f"the delta rule's {variant} kernel differs from torch's on this CPU"
        # the same three tokens as one sequence each through the prefill operator (its chunked form: a block each)
        got_state = state.clone()
        got = ops.delta_rule_prefill(q, k, v, gate, beta, got_state, slots, torch.tensor([0, 1, 2, 3]), variant)
        if not (torch.allclose(got, want, rtol=1e-5, atol=1e-5) and torch.allclose(got_state[slots], s, rtol=1e-5,
                                                                                    atol=1e-5)):
            return f"the delta rule's {variant} prefill kernel differs from torch's on this CPU"
    x, conv = torch.randn(rows, 10, generator=g), torch.randn(4, 10, 3, generator=g)
    taps = torch.randn(10, 4, generator=g)
    window = torch.cat([conv[slots], x.unsqueeze(-1)], dim=-1)
    got_conv = conv.clone()
    got = ops.short_conv_step(x, got_conv, taps, slots)
    if not (torch.allclose(got, torch.nn.functional.silu((window * taps).sum(-1)), rtol=1e-5, atol=1e-6)
            and torch.equal(got_conv[slots], window[..., 1:])):
        return "the short convolution kernel differs from torch's on this CPU"
    return None
