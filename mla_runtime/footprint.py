"""What one rank's weights hold once loaded, counted over the model the loader builds.

The model (``models.deepseek.DeepseekForCausalLM``: this rank's shard, with its MTP layers) is built on the meta
device, where it takes no memory, and each of its parameters is counted in the form a load gives it. The loader's own
rules decide which: ``layers.quantization.quantized_parameter_names`` names the products (quantised with
``quantization``), ``loader.checkpoint_layout`` the checkpoint tensors behind each parameter and this rank's part of
each, and ``loader._weight_kinds`` the products an FP8 checkpoint keeps in its blocks; each format's ``stored_bytes``
gives a matrix's bytes in it. What a CPU's product paths keep beside the weights comes from its probed layouts
(``kernel_plan.CpuLayouts``), and the absorbed factors' copies from the attention layers' dimensions.

A rank's model, summed up parameter by parameter (``inventory``), is kept for each configuration, rank count and
number of MTP layers, so that the planner, which asks for many formats and rank counts, builds each model once.
"""

from __future__ import annotations

import functools
import gc
import math
from dataclasses import dataclass

import torch

from mla_runtime.config import MODELOPT_FP8_BLOCK, Int4Layout, ModelConfig, modelopt_excluded
from mla_runtime.dtypes import dtype_name, resolve_model_dtype
from mla_runtime.kernel_plan import CpuLayouts
from mla_runtime.layers.fp8 import Fp8Weight
from mla_runtime.layers.int4 import Int4Weight, layout_bytes
from mla_runtime.layers.linear import Linear
from mla_runtime.layers.mla import MLAttention
from mla_runtime.layers.mlp import GatedMLP
from mla_runtime.layers.moe import Experts
from mla_runtime.layers.quantization import WEIGHT_FORMATS, quantized_parameter_names
from mla_runtime.layers.qweight import QuantizedWeight
from mla_runtime.loader import STORED_FP8, Slot, _weight_kinds, checkpoint_layout
from mla_runtime.models.deepseek import DeepseekForCausalLM
from mla_runtime.models.hybrid import causal_lm
from mla_runtime.options import WEIGHT_QUANTIZATIONS
from mla_runtime.parallel import ParallelContext
from mla_runtime.resolved_config import ResolvedConfig

COMPONENTS = ("embedding", "attention", "dense_mlp", "moe", "norms", "lm_head")  # parameter_breakdown's keys


def check_tp(config: ModelConfig, tensor_parallel_size: int) -> None:
    """A ``ValueError`` unless ``tensor_parallel_size`` is at least 1 and divides the attention heads."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if config.num_attention_heads % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size ({tensor_parallel_size}) must divide num_attention_heads "
                         f"({config.num_attention_heads})")


def check_weight_quantization(quantization: str | None) -> str | None:
    """``None``/``"none"`` → None; ``int8``/``int4``/``fp8`` as they are; anything else a ``ValueError`` naming it."""
    if quantization in (None, "none"):
        return None
    if quantization not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"quantization: none, {', '.join(WEIGHT_QUANTIZATIONS)}, got {quantization!r}")
    return quantization


# -- one rank's model, parameter by parameter ----------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """One parameter of a rank's model, as the planner counts it."""

    name: str
    shape: tuple[int, ...]
    component: str  # parameter_breakdown's part it belongs to ("mtp": an MTP layer's)
    float32: bool  # kept in float32 whatever the model dtype (the routers, LeRoPE's alpha)
    product: bool  # a product matrix, quantised with ``quantization``
    pack: str  # on a CPU, a float matrix's second layout: "linear" its own, "fused" stacked with its partner; "" none
    parts: tuple[int, ...]  # rows of the checkpoint tensors stacked in each matrix (each keeps its own FP8 blocks)
    piece: int  # elements of the largest checkpoint tensor behind it: this rank's part of it ...
    whole: int  # ... and the whole tensor
    kept: bool  # a product an FP8 checkpoint keeps in its blocks
    unquantized: bool = False  # a product a ModelOpt checkpoint stores unquantised (exclude_modules): model dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def matrices(self) -> int:
        """Matrices it holds: one per expert of an ``[E, N, K]`` stack."""
        return self.shape[0] if len(self.shape) == 3 else 1


@dataclass(frozen=True)
class Inventory:
    """One rank's model summed up (``inventory``)."""

    params: tuple[Param, ...]
    embedding: tuple[int, int]  # this rank's embedding rows (the vocabulary, padded) and hidden size
    tied: bool  # the lm_head is the embedding
    stacked_bias: int  # elements of the stacked input projections' bias (q_a_proj's and kv_a_proj_with_mqa's)
    w_uk: int  # elements of every attention layer's absorbed factor W_UK ...
    w_uv: int  # ... and W_UV
    single_head: bool  # a rank has one head: W_UK is then a view of kv_b_proj where it keeps its dtype
    largest_read: int  # elements of the largest checkpoint tensor a load converts (this rank's part; whole if FP8)
    largest_read_unkept: int  # ... leaving out the products an FP8 checkpoint keeps in its blocks


class _Key:
    """A ``ModelConfig`` as a cache key (a config may hold lists: hashed by its text, compared by its fields)."""

    def __init__(self, config: ModelConfig) -> None:
        self.config, self.text = config, repr(config)

    def __hash__(self) -> int:
        return hash(self.text)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self.config == other.config


def inventory(config: ModelConfig, tensor_parallel_size: int = 1, num_mtp_layers: int = 0) -> Inventory:
    """One rank's model (rank 0 of ``tensor_parallel_size``; every rank holds as many bytes), counted parameter by
    parameter: built once per configuration on the meta device."""
    check_tp(config, tensor_parallel_size)
    return _inventory(_Key(config), tensor_parallel_size, num_mtp_layers)


@functools.lru_cache(maxsize=128)
def _inventory(key: _Key, tp: int, num_mtp_layers: int) -> Inventory:
    # the checkpoint's name table holds an entry for every expert's tensors (tens of thousands): the garbage
    # collector, which would walk the whole heap over and over while they are made, waits until it is done with
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _count(key.config, tp, num_mtp_layers)
    finally:
        if collecting:
            gc.enable()


def _count(cfg: ModelConfig, tp: int, num_mtp_layers: int) -> Inventory:
    """``inventory``: the model built on the meta device and its parameters summed up."""
    # bfloat16: the parameters a model keeps in float32 whatever its dtype stand out
    rc = ResolvedConfig(cfg, torch.bfloat16, torch.device("cpu"), ParallelContext(0, tp), num_mtp_layers=num_mtp_layers)
    with torch.device("meta"):
        model = causal_lm(rc)
    table = checkpoint_layout(cfg, model.par, frozenset(), num_mtp_layers)
    products = quantized_parameter_names(model)
    kept, wide = _kept(model, table, products), _excluded(cfg, table, products)
    packs, sources = _packs(model, bool(cfg.stored_bits)), _sources(table)
    params = tuple(
        Param(name, tuple(p.shape), _component(cfg, name), p.dtype == torch.float32, name in products,
              packs.get(name, ""), *_layout(p, sources.get(name)), name in kept, name in wide)
        for name, p in model.named_parameters())
    attention = model.attention_layers()
    w_uk = sum(a.n_h * a.d_n * a.d_c for a in attention)
    w_uv = sum(a.n_h * a.d_v * a.d_c for a in attention)
    stacked = sum(a.q_a_proj.bias.numel() + a.kv_a_proj_with_mqa.bias.numel() for a in attention
                  if a.q_proj is None and a.q_a_proj.bias is not None and a.kv_a_proj_with_mqa.bias is not None)
    # an FP8 checkpoint's products and kv_b_proj load dequantised whole, then sliced
    dequantised = {n for n in (*products, *(f"{n}.kv_b_proj.weight" for n, m in model.named_modules()
                                            if isinstance(m, MLAttention))) if n != "lm_head"}
    fp8 = cfg.fp8_block_size is not None
    reads = [(p.whole if fp8 and p.name in dequantised else p.piece, p.kept) for p in params]
    read_all, read_unkept = max(r for r, _ in reads), max(r for r, k in reads if not k)
    embedding = model.model.embed_tokens.weight
    return Inventory(params, (embedding.shape[0], embedding.shape[1]), model.lm_head is None, stacked, w_uk, w_uv,
                     attention[0].n_h == 1, read_all, read_unkept)


def _component(cfg: ModelConfig, name: str) -> str:
    """The part of the model ``parameter_breakdown`` counts the parameter ``name`` in."""
    if name.startswith("mtp."):
        return "mtp"
    if name in ("model.embed_tokens.weight", "lm_head"):
        return "lm_head" if name == "lm_head" else "embedding"
    if name == "model.norm.weight" or "layernorm" in name:  # the decoder's norms (and A.X-K2's gates), the latents'
        return "norms"
    if ".self_attn." in name or name == "model.rotary_emb.alpha":
        return "attention"
    moe = ".mlp." in name and cfg.is_moe_layer(int(name.split(".")[2]))  # a LongCat layer's dense MLPs: mlps.{b}
    return "moe" if moe else "dense_mlp"


def _kept(model: DeepseekForCausalLM, table: dict[str, Slot | None], products: list[str]) -> frozenset[str]:
    """The products an FP8 checkpoint keeps in its blocks on this rank (``loader._weight_kinds``): it stores every
    product but the lm_head with a ``weight_scale_inv``."""
    if model.config.fp8_block_size is None:
        return frozenset()
    stored = set(products) - {"lm_head"}
    scales = {name[: -len("weight")] + "weight_scale_inv" for name, slot in table.items()
              if slot is not None and slot.param in stored and name.endswith(".weight")}
    kinds = _weight_kinds(model.config, table, dict(model.named_parameters()), None, scales, products)
    return frozenset(n for n, kind in kinds.items() if kind == STORED_FP8)


def _excluded(cfg: ModelConfig, table: dict[str, Slot | None], products: list[str]) -> frozenset[str]:
    """The products a ModelOpt checkpoint stores unquantised, which load in the model dtype (``loader.load_weights``):
    those whose every checkpoint tensor is a module its ``exclude_modules`` names."""
    if cfg.stored_exclude is None:
        return frozenset()
    patterns, wanted = cfg.stored_exclude, set(products)
    quantized = {slot.param for name, slot in table.items() if slot is not None and slot.param in wanted
                 and name.endswith(".weight") and not modelopt_excluded(name[: -len(".weight")], patterns)}
    return frozenset(wanted - quantized)


def _packs(model: DeepseekForCausalLM, gguf: bool) -> dict[str, str]:
    """The matrices a CPU's products keep a second layout of (``cpu_gemm.PackedWeight``): every linear layer's (those
    stacked with a partner: the stacked copy's), the MLPs' and experts', an untied lm_head; not a GGUF model's
    ``kv_b_proj`` (``Linear.one_layout``)."""
    packs = {"lm_head": "linear"} if model.lm_head is not None else {}
    for prefix, module in model.named_modules():
        if gguf and prefix.endswith(".kv_b_proj"):
            continue
        if isinstance(module, Linear):
            packs[f"{prefix}.weight"] = "fused" if module.fused else "linear"
        elif isinstance(module, GatedMLP | Experts):
            packs[f"{prefix}.gate_up_proj"] = packs[f"{prefix}.down_proj"] = "linear"
    return packs


def _sources(table: dict[str, Slot | None]) -> dict[str, tuple[dict[int, int], tuple[int, int]]]:
    """For each parameter, the checkpoint tensors behind it: the row blocks several of them fill in one matrix
    (first row → rows: gate and up), and the ratio of a whole tensor to this rank's part of it (its shard's)."""
    found: dict[str, tuple[dict[int, int], tuple[int, int]]] = {}
    for slot in table.values():
        if slot is None:
            continue
        parts, ratio = found.setdefault(slot.param, ({}, (1, 1)))
        last = slot.index[-1] if slot.index else None
        if isinstance(last, slice):
            parts[last.start or 0] = last.stop - (last.start or 0)
        if slot.shard is not None:
            _, start, stop, full = slot.shard
            found[slot.param] = parts, (full, stop - start)
    return found


def _layout(param: torch.Tensor, source: tuple[dict[int, int], tuple[int, int]] | None
            ) -> tuple[tuple[int, ...], int, int]:
    """The rows of each checkpoint tensor in one matrix of ``param``, in order (the whole matrix where they do not
    fill it: a padded vocabulary; () for a vector), and the elements of the largest of those tensors: this rank's
    part, and the whole tensor."""
    parts, (whole, part) = source or ({}, (1, 1))
    if param.dim() < 2:
        return (), param.numel(), param.numel() * whole // part
    rows, k = param.shape[-2], param.shape[-1]
    found = tuple(parts[start] for start in sorted(parts))
    found = found if found and sum(found) == rows else (rows,)
    largest = max(found) * k
    return found, largest, largest * whole // part


# -- bytes ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightFootprint:
    """The bytes one rank's weights hold once loaded, by part (``weight_footprint``)."""

    dtype: torch.dtype  # the model dtype
    format: str  # the products' format: the model dtype's name, int8, int4, fp8, or "fp8 (checkpoint blocks)"
    float_bytes: int  # weights in the model dtype: embedding, norms, kv_b_proj, matrices left unquantised; router fp32
    quantized_bytes: int  # quantised matrices with their scales
    absorbed_bytes: int  # the attention's copies of its absorbed factors (w_uk, w_uv_t)
    packed_bytes: int  # CPU only: float matrices' second layout, the stacked q_a+kv_a copy, int8 float32 row scales
    largest_read_elements: int  # the largest tensor a load converts to a float one (this rank's part)

    @property
    def total(self) -> int:
        return self.float_bytes + self.quantized_bytes + self.absorbed_bytes + self.packed_bytes


def _stored_bits(config: ModelConfig, tp: int, repacked: bool) -> dict[str, float]:
    """A GGUF file's parameters kept as stored, by parameter (``repacked``: as the compiled kernels hold them): its
    embedding only on one rank (``loader``)."""
    bits = dict(config.repacked_bits if repacked and config.repacked_bits else config.stored_bits)
    if tp > 1:
        bits.pop("model.embed_tokens.weight", None)
    return bits


@dataclass(frozen=True)
class _Formats:
    """How a load stores a rank's parameters (``weight_footprint``)."""

    scheme: str | None  # the products' quantisation (a pre-quantised checkpoint's own)
    keeps_fp8: bool  # an FP8 checkpoint's products stay in its blocks where this rank's part is whole blocks
    fp8_block: tuple[int, int] | None  # ... of this size
    element: int  # bytes of a model-dtype value
    extra: int  # a CPU's second layout of a float matrix, bytes a value
    row_scales: bool  # int8 matrices keep a float32 copy of their scales for the compiled row kernels
    bf16_blocked: bool  # bf16 matrices keep oneDNN's blocked copy
    stored_bits: dict[str, float]  # a GGUF file's products kept as stored: bits per weight, by parameter
    layout: Int4Layout | None = None  # a pre-quantised int4 checkpoint's groups (None: the runtime's own)
    float_head: bool = False  # a pre-quantised checkpoint's lm_head, stored unquantised, loads so
    stored: bool = False  # the products load as a pre-quantised checkpoint stores them (Param.unquantized: wide)
    stored_block: tuple[int, int] | None = None  # a pre-quantised FP8 checkpoint's blocks (ModelOpt's)

    def of(self, param: Param) -> tuple[type[QuantizedWeight] | None, tuple[int, int] | None]:
        """The format ``param`` is held in (None: a float tensor) and its FP8 blocks."""
        if self.keeps_fp8 and param.kept:
            return Fp8Weight, self.fp8_block
        if self.scheme is not None and param.product and not (self.float_head and param.name == "lm_head") \
                and not (self.stored and param.unquantized):
            return WEIGHT_FORMATS[self.scheme], self.stored_block
        return None, None

    def matrix_bytes(self, fmt: type[QuantizedWeight], rows: int, k: int, block: tuple[int, int] | None) -> int:
        """A ``[rows, k]`` product's bytes in ``fmt`` (a stored int4 checkpoint's: its groups and zero points)."""
        if fmt is Int4Weight and self.layout is not None:
            return layout_bytes(rows, k, self.layout.group, not self.layout.symmetric)
        return fmt.stored_bytes(rows, k, block)


def _parameter_bytes(inv: Inventory, f: _Formats) -> tuple[int, int, int]:
    """One rank's parameters (and a tied head's quantised copy): bytes in float, bytes quantised, bytes of second
    layouts."""
    float_bytes = quantized = packed = 0
    for p in inv.params:
        if p.name in f.stored_bits:  # a GGUF file's blocks: its bytes, this rank's part of them
            quantized += math.ceil(p.numel * f.stored_bits[p.name] / 8)
            continue
        fmt, block = f.of(p)
        if fmt is None:
            float_bytes += p.numel * (4 if p.float32 else f.element)
            if f.extra and p.pack:
                packed += p.numel * (f.extra + (f.element if p.pack == "fused" else 0))
            continue
        size = p.matrices * sum(f.matrix_bytes(fmt, rows, p.shape[-1], block) for rows in p.parts)
        quantized += size * (2 if f.bf16_blocked else 1)
        packed += 4 * p.matrices * p.shape[-2] if f.row_scales else 0
    rows, hidden = inv.embedding
    if inv.tied and f.scheme is not None:  # the quantised copy of the embedding
        quantized += WEIGHT_FORMATS[f.scheme].stored_bytes(rows, hidden) * (2 if f.bf16_blocked else 1)
        packed += 4 * rows if f.row_scales else 0
    elif inv.tied and f.extra:  # the embedding is the head: packed for its products
        packed += rows * hidden * f.extra
    if f.extra or f.scheme is not None or f.keeps_fp8:  # the stacked input projection's bias
        float_bytes += inv.stacked_bias * f.element
    return float_bytes, quantized, packed


def weight_footprint(config: ModelConfig, dtype: str | torch.dtype = "auto", tensor_parallel_size: int = 1,
                     quantization: str | None = None, *, cpu: CpuLayouts | None = None,
                     num_mtp_layers: int = 0, latent_cache_layout: str = "replicated") -> WeightFootprint:
    """What one rank's weights hold once loaded (``loader.load_model``, then ``finish_quantization``), by part.

    - Products (``layers.quantization.quantized_parameter_names``): in the model dtype, or in ``quantization``'s
      format (its ``stored_bytes``: ``int8``, ``int4``, ``fp8``, ``bf16``...). An FP8 checkpoint
      (``config.fp8_block_size``) without ``quantization`` (or with ``fp8``) keeps its products as stored where this
      rank's part of them is whole blocks (``loader._weight_kinds``), each checkpoint tensor with its own blocks; the
      rest load dequantised. A tied
      lm_head gets a quantised copy (the embedding stays). A pre-quantised checkpoint (``config.stored_quantization``)
      counts in its format (an int4 one with its groups and zero points, ``config.stored_layout``, and an lm_head
      it stores unquantised in the model dtype; not counted: an act-order matrix's input order, 8 bytes an input,
      and the runtime's own int4 of products such a checkpoint leaves unquantised, counted in its layout).
    - Every other parameter as the model holds it: ``kv_b_proj``, the embedding, norms and biases in the model dtype,
      the MoE routers in float32; and per attention layer its absorbed factors' copies ``w_uk``/``w_uv_t``: bfloat16
      with ``quantization`` where the compiled CPU decode kernel runs (a float32 model on a CPU that builds it,
      replicated cache), else the model dtype (``w_uk`` is a view of ``kv_b_proj`` where a rank has one head and it
      keeps that dtype); a GGUF file's factors as runs (``config.factor_runs``, a float32 model on one rank and a
      CPU): 1.25 bytes a value, no copies.
    - ``cpu`` (a CPU's probed layouts, ``KernelPlan.layouts``) only: each float matrix's second layout,
      ``extra_bytes_per_element`` (0 on the ``plain`` path), and where ``q_a_proj`` and ``kv_a_proj_with_mqa`` run
      stacked, their stacked copy; where the compiled one-row kernels run, int8 matrices' float32 copy of their scales
      (4 bytes a row); a ``bf16`` matrix's blocked copy where oneDNN has bfloat16 products (2 more bytes a weight).
      Without ``cpu`` (a GPU, or no particular machine), none of these.
    - ``num_mtp_layers``: the MTP layers (their decoder blocks, ``eh_proj`` and norms; the embedding and head are
      shared).

    Not counted: RoPE tables and the MTP drafts' head rows (small), and the 1-element stand-ins of released weights.
    """
    tp = tensor_parallel_size
    scheme = check_weight_quantization(quantization) or config.stored_quantization  # a pre-quantised checkpoint's
    model_dtype = resolve_model_dtype(dtype, config)
    if cpu is not None and cpu.dtype != model_dtype:
        raise ValueError(f"cpu: layouts probed for {cpu.dtype} weights, not {model_dtype}")
    extra, row_kernels = (cpu.extra_bytes_per_element, cpu.row_kernels) if cpu is not None else (0, False)
    keeps = config.fp8_block_size is not None and scheme in (None, "fp8")
    stored = config.stored_quantization is not None and scheme == config.stored_quantization
    formats = _Formats(scheme, keeps, config.fp8_block_size, model_dtype.itemsize, extra,
                       row_kernels and scheme == "int8",  # Int8Weight.row_scales: float32 scales for the row kernels
                       cpu is not None and cpu.bf16_blocked and scheme == "bf16",  # Bf16Weight.native: a second copy
                       _stored_bits(config, tp, cpu is not None and cpu.ggml_repack),
                       config.stored_layout if stored else None,
                       stored and config.stored_float_head, stored,
                       MODELOPT_FP8_BLOCK if stored and scheme == "fp8" else None)
    inv = inventory(config, tp, num_mtp_layers)
    float_bytes, quantized, packed = _parameter_bytes(inv, formats)
    decode_kernel = row_kernels and model_dtype == torch.float32 and not (latent_cache_layout == "sharded" and tp > 1)
    absorbed_element: float = 2 if scheme is not None and decode_kernel else model_dtype.itemsize
    w_uk = 0 if inv.single_head and absorbed_element == model_dtype.itemsize else inv.w_uk
    if config.factor_runs and cpu is not None and tp == 1 and model_dtype == torch.float32:
        absorbed_element, w_uk = 1.25, inv.w_uk  # int8 values and a float32 scale and offset a run of 32: no copies
    name = scheme or ("fp8 (checkpoint blocks)" if keeps else "gguf (file blocks)" if config.stored_bits else
                      dtype_name(model_dtype))
    return WeightFootprint(model_dtype, name, float_bytes, quantized, int((w_uk + inv.w_uv) * absorbed_element), packed,
                           inv.largest_read_unkept if keeps else inv.largest_read)


def weight_bytes(config: ModelConfig, dtype: str | torch.dtype = "auto", tensor_parallel_size: int = 1,
                 quantization: str | None = None, *, cpu: CpuLayouts | None = None,
                 num_mtp_layers: int = 0, latent_cache_layout: str = "replicated") -> int:
    """Bytes one rank's weights hold once loaded: ``weight_footprint(...).total`` (its docstring says what counts;
    ``cpu`` adds the float matrices' second layout as probed on this machine)."""
    return weight_footprint(config, dtype, tensor_parallel_size, quantization, cpu=cpu,
                            num_mtp_layers=num_mtp_layers, latent_cache_layout=latent_cache_layout).total


# -- parameters ---------------------------------------------------------------------------------------
def parameter_breakdown(config: ModelConfig, tensor_parallel_size: int = 1) -> dict[str, int]:
    """Parameters per rank by component (the MTP layers are not counted): embedding, attention (with the sparse
    attention's indexer and LeRoPE's frequencies), dense_mlp, moe (routers with their correction bias, routed and
    shared experts), norms (every RMSNorm, the low-rank gates of A.X-K2's gated norms), lm_head (0 when tied). The
    router's ``e_score_correction_bias`` counts, as the checkpoint stores it."""
    counts = dict.fromkeys(COMPONENTS, 0)
    for p in inventory(config, tensor_parallel_size).params:
        if p.component in counts:
            counts[p.component] += p.numel
    return counts


def parameter_count(config: ModelConfig, tensor_parallel_size: int = 1) -> int:
    """Parameters of the main model (no MTP layer), per rank when ``tensor_parallel_size > 1``."""
    return sum(parameter_breakdown(config, tensor_parallel_size).values())


def quantized_parameters(config: ModelConfig, tensor_parallel_size: int = 1) -> tuple[int, tuple[int, int]]:
    """The matrices ``quantization`` stores quantised, per rank: (elements, (output rows, lm_head rows)).

    The products (``layers.quantization.quantized_parameter_names``: every attention projection except ``kv_b_proj``,
    the dense MLPs, the routed and shared experts) and the lm_head, tied or not."""
    inv = inventory(config, tensor_parallel_size)
    products = [p for p in inv.params if p.product and p.name != "lm_head"]
    vocab_rows, hidden = inv.embedding
    elements = sum(p.numel for p in products) + vocab_rows * hidden
    rows = sum(p.matrices * p.shape[-2] for p in products) + vocab_rows
    return elements, (rows, vocab_rows)
