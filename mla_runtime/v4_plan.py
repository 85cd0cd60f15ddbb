"""The memory plan of a DeepSeek-V4 model (``deepseek_v4``): ``mla-runtime plan --model deepseek-v4-flash ...``.

V4 keeps no latent row per token per layer. Per sequence it keeps (``models.v4_sizes``), in the model's dtype:

    CSA entries      head_dim        values per CSA layer, one every rate_csa (4) tokens
    indexer keys     index_head_dim  values per CSA layer, one every rate_csa tokens
    HCA entries      head_dim        values per HCA layer, one every rate_hca (128) tokens
    sliding windows  (sliding_window - 1) x head_dim values per layer, fixed
    partial state    every compressor's incomplete window (and CSA's overlapping half), fixed, at most

so a sequence of ``L`` tokens costs ``floor(L / 4) x (CSA + index bytes) + floor(L / 128) x HCA bytes + windows +
partial state``. Against it the report sets the same layer count as a V3.2-style stack (every layer caching the
``d_c + d_r`` latent and an indexer key per token: DeepSeek-V3.2's 512 + 64 + 128 values).

Ranks (``--tensor-parallel-size``: the GPUs of a node) split the weights as serving does (``models/v4_shards.py``: the
query heads and their output groups, the routed experts, the shared expert, the vocabulary; the KV head, compressors,
indexer, router, norms and hyper-connections whole): a rank's weights are counted on its own model, built on the meta
device. Each rank's cache budget is ``usable - a rank's weights - activation reserve - state snapshots`` (prefix
caching's default snapshot budget, ``max_num_seqs`` of them, on every rank). V4 attends one shared KV
head, so a head split gives a rank no smaller share of a sequence: every rank holds every sequence's whole state, and
the node holds as many sequences as one rank does.

The plan itself (``OwnModelPlan``, ``plan_own_model``: weights on the meta device, the activation reserve with the
residual streams, a cache budget, sequences of ``kinds.sequence_bytes``), its report's budget and verdict lines, and
the refusal of what serving refuses (``refusal``) are shared with Hunyuan V4's and dots3-note's plan
(``row_plan``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch

from mla_runtime.config import ModelConfig
from mla_runtime.dtypes import dtype_name
from mla_runtime.models.deepseek_v4 import DeepseekV4ForCausalLM, V4Config
from mla_runtime.models.v4_shards import V4_SPLITS, check_v4_parallel
from mla_runtime.models.v4_sizes import (
    V4CacheKinds,
    cache_kinds,
    default_snapshot_bytes,
    meta_weights,
    model_config,
    v4_weights,
)
from mla_runtime.models.v4_stored import stored_weight_bytes, v4_quantization
from mla_runtime.parallel import ParallelContext
from mla_runtime.plan import activation_reserve_bytes, default_max_num_batched_tokens, gib

DOC = "docs/deepseek-v4.md"
V32_LATENT, V32_INDEX = 512 + 64, 128  # DeepSeek-V3.2's cached values per token per layer: d_c + d_r, indexer key
V4_PLAN_DTYPES = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32}


# the models of their own that run under tensor parallelism (``models/v4_shards.py``), every rank holding every state
SPLIT_FAMILIES = ("deepseek_v4", "hy_v4", "dots3_note", "dots3_note_text")


def refusal(name: str, value: object, family: str, doc: str = DOC) -> str:
    """The message that refuses the setting ``name`` (``value``) for a model of its own: serving's
    ``check_v4_settings`` and the planner say the same (DeepSeek-V4, Hunyuan V4 and dots3-note run on any number of
    ranks that splits them, GLM-5-Next on one; DeepSeek-V4 alone keeps its prefixes in the tiers, on one rank)."""
    ranks = ("every rank holding every sequence's state (latent_cache_layout 'replicated'), "
             if family in SPLIT_FAMILIES else "tensor_parallel_size 1, ")
    tiers = "the prefix-cache tiers (kv_cache_dir, kv_cache_host_bytes) on one rank only" \
        if family == "deepseek_v4" else "no prefix-cache tiers (kv_cache_dir, kv_cache_host_bytes)"
    return (f"{name}={value!r}: {family} runs with {ranks}no speculative decoding, its full latent rank, {tiers}, "
            f"no quantization, kv_cache_dtype 'auto' and dtype one of {sorted(V4_PLAN_DTYPES)} ({doc})")


def v32_style_bytes(layers: int, tokens: int, dtype_bytes: int = 2) -> int:
    """A V3.2-style stack's cache of one sequence: ``layers x (576 + 128) values x tokens``."""
    return layers * (V32_LATENT + V32_INDEX) * dtype_bytes * tokens


class SequenceKinds(Protocol):
    """A model's cache kinds, as far as a plan reads them: the bytes of one sequence."""

    def sequence_bytes(self, tokens: int) -> int: ...


K = TypeVar("K", bound=SequenceKinds)


@dataclass(frozen=True)
class OwnModelPlan(Generic[K]):
    """The plan of a model of its own (V4, Hunyuan V4, dots3-note): its weights and activations, and sequences of
    ``kinds.sequence_bytes`` in what is left."""

    kinds: K
    layers: int
    parameter_count: int
    dtype: torch.dtype
    weight_bytes: int  # the whole model
    ranks: int
    device_memory_bytes: int  # one rank
    memory_utilization: float
    activation_bytes: int  # one rank
    max_seq_len: int
    max_num_seqs: int
    reserved_bytes: int = 0  # one rank, set aside beside the weights and activations (state snapshots)
    rank_weight_bytes: int | None = None  # one rank's shard (None: the whole model split evenly)

    @property
    def usable_bytes(self) -> int:
        return int(self.device_memory_bytes * self.memory_utilization)

    @property
    def weight_bytes_per_rank(self) -> int:
        if self.rank_weight_bytes is not None:
            return self.rank_weight_bytes
        return -(-self.weight_bytes // self.ranks)

    @property
    def cache_budget_bytes(self) -> int:
        """One rank's cache budget (negative: the weights and activations alone do not fit)."""
        return self.usable_bytes - self.weight_bytes_per_rank - self.activation_bytes - self.reserved_bytes

    @property
    def sequence_bytes(self) -> int:
        return self.kinds.sequence_bytes(self.max_seq_len)

    @property
    def sequences_per_rank(self) -> int:
        return max(0, self.cache_budget_bytes) // self.sequence_bytes

    @property
    def max_sequences(self) -> int:
        """Sequences of ``max_seq_len`` the ranks hold: one rank's count, as every rank holds every sequence's cache
        (a model of its own attends one shared KV head, which every rank computes)."""
        return self.sequences_per_rank

    @property
    def weights_fit(self) -> bool:
        return self.cache_budget_bytes > 0

    @property
    def fits(self) -> bool:
        return self.weights_fit and self.max_num_seqs <= self.max_sequences


V4MemoryPlan = OwnModelPlan[V4CacheKinds]


def plan_dtype(family: str, dtype: str, ranks: int = 1, max_num_seqs: int = 1,
               memory_utilization: float = 0.92) -> torch.dtype:
    """The weights' dtype of a plan (``auto``: bfloat16), after checking the plan's numbers; a ``ValueError`` naming
    what is wrong."""
    if dtype not in V4_PLAN_DTYPES:
        raise ValueError(f"dtype: {family} runs in {sorted(V4_PLAN_DTYPES)}, not {dtype!r}")
    if ranks < 1 or max_num_seqs < 1 or not 0 < memory_utilization <= 1:
        raise ValueError("tensor_parallel_size and max_num_seqs must be >= 1, memory_utilization in (0, 1]")
    return V4_PLAN_DTYPES[dtype]


def plan_own_model(kinds: K, layers: int, build: Callable[[], torch.nn.Module], mc: ModelConfig, dtype: torch.dtype,
                   streams: int, *, device_memory_bytes: int, memory_utilization: float = 0.92, ranks: int = 1,
                   max_seq_len: int | None = None, max_num_seqs: int = 1, max_num_batched_tokens: int | None = None,
                   reserved_bytes: int = 0) -> OwnModelPlan[K]:
    """The plan of a model of its own: the weights of the model ``build`` makes (on the meta device), the MLA
    planner's activation reserve of ``mc`` with ``streams`` residual streams, and ``kinds`` per sequence."""
    seq_len = max_seq_len or mc.max_position_embeddings
    batched = max_num_batched_tokens or default_max_num_batched_tokens(seq_len, max_num_seqs)
    activations = activation_reserve_bytes(mc, dtype=dtype, max_num_batched_tokens=batched,
                                           max_num_seqs=max_num_seqs, residual_streams=streams)
    weights, params = meta_weights(build)
    return OwnModelPlan(kinds, layers, params, dtype, weights, ranks, device_memory_bytes, memory_utilization,
                        activations, seq_len, max_num_seqs, reserved_bytes)


def plan_v4(raw: dict, *, dtype: str = "auto", device_memory_bytes: int, memory_utilization: float = 0.92,
            ranks: int = 1, max_seq_len: int | None = None, max_num_seqs: int = 1,
            max_num_batched_tokens: int | None = None, checkpoint: Path | None = None) -> V4MemoryPlan:
    """The plan of the V4 ``config.json`` ``raw`` on ``ranks`` devices of ``device_memory_bytes`` each (a local
    ``checkpoint`` in the released FP8 / MXFP4 scheme: its weights as stored)."""
    torch_dtype = plan_dtype("deepseek_v4", dtype, ranks, max_num_seqs, memory_utilization)
    cfg = V4Config.from_raw(raw)
    check_v4_parallel(cfg, ranks)
    mc = model_config(cfg)
    # prefix caching's state snapshots, as serving sets them aside by default: one per sequence slot, on every rank
    # (every rank holds every sequence's state, and so every snapshot)
    snapshots = default_snapshot_bytes(cfg, max_num_seqs, max_seq_len or mc.max_position_embeddings,
                                       torch_dtype.itemsize)
    plan = plan_own_model(cache_kinds(cfg, torch_dtype.itemsize), cfg.num_hidden_layers,
                          lambda: DeepseekV4ForCausalLM(cfg, torch_dtype), mc, torch_dtype,
                          cfg.hc_mult, device_memory_bytes=device_memory_bytes,
                          memory_utilization=memory_utilization, ranks=ranks, max_seq_len=max_seq_len,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          reserved_bytes=snapshots)
    shard = v4_weights(cfg, torch_dtype, ParallelContext(0, ranks))[0]  # rank 0's: the vocabulary's padded rows too
    return counted_as_stored(replace(plan, rank_weight_bytes=shard), raw, "deepseek_v4", checkpoint, cfg=cfg)


def counted_as_stored(plan: OwnModelPlan[K], raw: dict, family: str, checkpoint: Path | None, cfg: Any = None,
                      rename: Callable[[str], str | None] | None = None,
                      splits: dict[str, tuple[str, int]] = V4_SPLITS) -> OwnModelPlan[K]:
    """``plan`` with the weights of a local ``checkpoint`` folder in V4's stored scheme (FP8 blocks, MXFP4 experts)
    counted as serving holds them (``v4_stored.stored_weight_bytes``, from the files' headers; ``rename``: a stored
    name -> the model's, None for a tensor it does not read, default V4's; a rank's shard by ``cfg`` and the model's
    ``splits``); a float checkpoint's, or a preset's, plan as it is."""
    if checkpoint is None or v4_quantization(raw, family) is None or not any(checkpoint.glob("*.safetensors")):
        return plan
    keep = None if rename is None else (lambda name: rename(name) is not None)
    whole = stored_weight_bytes(checkpoint, plan.dtype, keep=keep)
    par = ParallelContext(0, plan.ranks)
    rank = whole if plan.ranks == 1 else stored_weight_bytes(checkpoint, plan.dtype, cfg, par, keep, rename, splits)
    return replace(plan, weight_bytes=whole, rank_weight_bytes=rank)


def report_row(label: str, value: str, note: str = "") -> str:
    return f"  {label:<44}{value:>20}{'  ' + note if note else ''}"


def format_budget(plan: OwnModelPlan, reserved: str = "") -> list[str]:
    """Report lines: the header's settings line, then the weights, the activation reserve, what is ``reserved``
    (its label) and the cache budget."""
    node = f"{plan.ranks} x {gib(plan.device_memory_bytes)}"
    return [
        f"  dtype {dtype_name(plan.dtype)}, {plan.ranks} rank(s): {node}, utilization {plan.memory_utilization}",
        "",
        report_row("weights (whole model)", f"{plan.weight_bytes:,} B", gib(plan.weight_bytes)),
        report_row("weights per rank", f"{plan.weight_bytes_per_rank:,} B", gib(plan.weight_bytes_per_rank)),
        report_row("activation reserve per rank", f"{plan.activation_bytes:,} B", gib(plan.activation_bytes)),
        *([report_row(reserved, f"{plan.reserved_bytes:,} B", gib(plan.reserved_bytes))] if reserved else []),
        report_row("cache budget per rank", f"{plan.cache_budget_bytes:,} B", gib(max(0, plan.cache_budget_bytes))),
    ]


def format_verdict(plan: OwnModelPlan) -> str:
    """The report's last line: whether the weights fit, then whether the requested sequences do."""
    node = f"{plan.ranks} x {gib(plan.device_memory_bytes)}"
    if not plan.weights_fit:
        return f"  the weights and activations alone DO NOT FIT {node}"
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    return (f"  weights FIT {node}; requested {plan.max_num_seqs:,} x {plan.max_seq_len:,} tokens: {verdict} "
            f"({plan.max_sequences:,} fit)")


def format_v4_kinds(k: V4CacheKinds, dtype_bytes: int) -> list[str]:
    """Report lines: the bytes per token of each kind of V4 cache, and each per-sequence part."""
    return [
        report_row(f"CSA entries (1/{k.csa_rate} tokens)", f"{k.csa_entry_bytes / k.csa_rate:,.2f} B/token",
                   f"= {k.csa_entry_bytes // max(1, k.csa_layers * dtype_bytes)} values x {dtype_bytes} B x "
                   f"{k.csa_layers} CSA layers / {k.csa_rate}"),
        report_row(f"indexer keys (1/{k.csa_rate} tokens)", f"{k.index_key_bytes / k.csa_rate:,.2f} B/token",
                   f"= {k.index_key_bytes // max(1, k.csa_layers * dtype_bytes)} values x {dtype_bytes} B x "
                   f"{k.csa_layers} CSA layers / {k.csa_rate}"),
        report_row(f"HCA entries (1/{k.hca_rate} tokens)", f"{k.hca_entry_bytes / k.hca_rate:,.2f} B/token",
                   f"= {k.hca_entry_bytes // max(1, k.hca_layers * dtype_bytes)} values x {dtype_bytes} B x "
                   f"{k.hca_layers} HCA layers / {k.hca_rate}"),
        report_row("compressed entries per token", f"{k.bytes_per_token:,.2f} B/token"),
        report_row("sliding windows per sequence", f"{k.window_bytes:,} B", gib(k.window_bytes)),
        report_row("compressor partial state per sequence", f"{k.partial_bytes:,} B",
                   f"{gib(k.partial_bytes)}  (at most)"),
    ]


def format_v4_report(plan: V4MemoryPlan, model: str) -> str:
    """The operator's account of a V4 plan (what ``mla-runtime plan`` prints for a ``deepseek_v4`` model)."""
    k, b, n = plan.kinds, plan.dtype.itemsize, plan.max_seq_len
    v32 = v32_style_bytes(plan.layers, n, b)
    return "\n".join([
        f"Memory plan for {model} (deepseek_v4: {plan.layers} layers, {k.csa_layers} CSA, {k.hca_layers} HCA, "
        f"{k.sliding_layers} sliding; {plan.parameter_count:,} parameters)",
        *format_budget(plan, "state snapshots per rank (prefix caching)"),
        "",
        *format_v4_kinds(k, b),
        "",
        report_row(f"KV per sequence at {n:,} tokens", f"{plan.sequence_bytes:,} B", gib(plan.sequence_bytes)),
        report_row("  a V3.2-style stack of as many layers", f"{v32:,} B",
                   f"{gib(v32)}  ({plan.layers} x (576 + 128) values x {b} B per token; "
                   f"{v32 / plan.sequence_bytes:.1f}x)"),
        report_row(f"sequences of {n:,} tokens per rank", f"{plan.sequences_per_rank:,}"),
        report_row(f"sequences of {n:,} tokens on the {plan.ranks} ranks", f"{plan.max_sequences:,}",
                   "(every rank holds every sequence's cache)"),
        "",
        format_verdict(plan),
    ])


__all__ = ["DOC", "OwnModelPlan", "V4MemoryPlan", "format_budget", "format_v4_report", "format_verdict", "plan_dtype",
           "plan_own_model", "plan_v4", "refusal", "report_row", "v32_style_bytes"]
