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

Ranks (``--tensor-parallel-size``: the GPUs of a node) split the weights evenly (the experts, the bulk, shard by
expert); each rank's cache budget is ``usable - weights / ranks - activation reserve``. V4 attends one shared KV
head, so a head split gives a rank no smaller share of a sequence: the node holds a sequence's whole cache on one
rank (data-parallel attention), ``ranks x`` the sequences one rank holds. The report gives that count, and the
smaller one where every rank holds every sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_runtime.config import ModelConfig
from mla_runtime.dtypes import dtype_name
from mla_runtime.models.deepseek_v4 import V4Config
from mla_runtime.models.v4_sizes import V4CacheKinds, cache_kinds, model_config, v4_weights
from mla_runtime.plan import activation_reserve_bytes, default_max_num_batched_tokens, gib

V32_LATENT, V32_INDEX = 512 + 64, 128  # DeepSeek-V3.2's cached values per token per layer: d_c + d_r, indexer key
V4_PLAN_DTYPES = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def v32_style_bytes(layers: int, tokens: int, dtype_bytes: int = 2) -> int:
    """A V3.2-style stack's cache of one sequence: ``layers x (576 + 128) values x tokens``."""
    return layers * (V32_LATENT + V32_INDEX) * dtype_bytes * tokens


@dataclass(frozen=True)
class V4MemoryPlan:
    kinds: V4CacheKinds
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

    @property
    def usable_bytes(self) -> int:
        return int(self.device_memory_bytes * self.memory_utilization)

    @property
    def weight_bytes_per_rank(self) -> int:
        return -(-self.weight_bytes // self.ranks)

    @property
    def cache_budget_bytes(self) -> int:
        """One rank's cache budget (negative: the weights and activations alone do not fit)."""
        return self.usable_bytes - self.weight_bytes_per_rank - self.activation_bytes

    @property
    def sequence_bytes(self) -> int:
        return self.kinds.sequence_bytes(self.max_seq_len)

    @property
    def sequences_per_rank(self) -> int:
        return max(0, self.cache_budget_bytes) // self.sequence_bytes

    @property
    def max_sequences(self) -> int:
        """Sequences of ``max_seq_len`` the ranks hold, each sequence's cache on one rank."""
        return self.ranks * self.sequences_per_rank

    @property
    def weights_fit(self) -> bool:
        return self.cache_budget_bytes > 0

    @property
    def fits(self) -> bool:
        return self.weights_fit and self.max_num_seqs <= self.max_sequences


def plan_v4(raw: dict, *, dtype: str = "auto", device_memory_bytes: int, memory_utilization: float = 0.92,
            ranks: int = 1, max_seq_len: int | None = None, max_num_seqs: int = 1,
            max_num_batched_tokens: int | None = None) -> V4MemoryPlan:
    """The plan of the V4 ``config.json`` ``raw`` on ``ranks`` devices of ``device_memory_bytes`` each."""
    if dtype not in V4_PLAN_DTYPES:
        raise ValueError(f"dtype: deepseek_v4 runs in {sorted(V4_PLAN_DTYPES)}, not {dtype!r}")
    if ranks < 1 or max_num_seqs < 1 or not 0 < memory_utilization <= 1:
        raise ValueError("tensor_parallel_size and max_num_seqs must be >= 1, memory_utilization in (0, 1]")
    cfg = V4Config.from_raw(raw)
    torch_dtype = V4_PLAN_DTYPES[dtype]
    seq_len = max_seq_len or cfg.max_position_embeddings
    mc: ModelConfig = model_config(cfg)
    batched = max_num_batched_tokens or default_max_num_batched_tokens(seq_len, max_num_seqs)
    activations = activation_reserve_bytes(mc, dtype=torch_dtype, max_num_batched_tokens=batched,
                                           max_num_seqs=max_num_seqs) + (
        cfg.hc_mult * cfg.hidden_size * torch_dtype.itemsize * batched)
    weights, params = v4_weights(cfg, torch_dtype)
    return V4MemoryPlan(cache_kinds(cfg, torch_dtype.itemsize), cfg.num_hidden_layers,
                        params, torch_dtype, weights, ranks, device_memory_bytes,
                        memory_utilization, activations, seq_len, max_num_seqs)


def _row(label: str, value: str, note: str = "") -> str:
    return f"  {label:<44}{value:>20}{'  ' + note if note else ''}"


def format_v4_kinds(k: V4CacheKinds, dtype_bytes: int) -> list[str]:
    """Report lines: the bytes per token of each kind of V4 cache, and each per-sequence part."""
    return [
        _row(f"CSA entries (1/{k.csa_rate} tokens)", f"{k.csa_entry_bytes / k.csa_rate:,.2f} B/token",
             f"= {k.csa_entry_bytes // max(1, k.csa_layers * dtype_bytes)} values x {dtype_bytes} B x "
             f"{k.csa_layers} CSA layers / {k.csa_rate}"),
        _row(f"indexer keys (1/{k.csa_rate} tokens)", f"{k.index_key_bytes / k.csa_rate:,.2f} B/token",
             f"= {k.index_key_bytes // max(1, k.csa_layers * dtype_bytes)} values x {dtype_bytes} B x "
             f"{k.csa_layers} CSA layers / {k.csa_rate}"),
        _row(f"HCA entries (1/{k.hca_rate} tokens)", f"{k.hca_entry_bytes / k.hca_rate:,.2f} B/token",
             f"= {k.hca_entry_bytes // max(1, k.hca_layers * dtype_bytes)} values x {dtype_bytes} B x "
             f"{k.hca_layers} HCA layers / {k.hca_rate}"),
        _row("compressed entries per token", f"{k.bytes_per_token:,.2f} B/token"),
        _row("sliding windows per sequence", f"{k.window_bytes:,} B", gib(k.window_bytes)),
        _row("compressor partial state per sequence", f"{k.partial_bytes:,} B", f"{gib(k.partial_bytes)}  (at most)"),
    ]


def format_v4_report(plan: V4MemoryPlan, model: str) -> str:
    """The operator's account of a V4 plan (what ``mla-runtime plan`` prints for a ``deepseek_v4`` model)."""
    k, b, n = plan.kinds, plan.dtype.itemsize, plan.max_seq_len
    v32 = v32_style_bytes(plan.layers, n, b)
    node = f"{plan.ranks} x {gib(plan.device_memory_bytes)}"
    lines = [
        f"Memory plan for {model} (deepseek_v4: {plan.layers} layers, {k.csa_layers} CSA, {k.hca_layers} HCA, "
        f"{k.sliding_layers} sliding; {plan.parameter_count:,} parameters)",
        f"  dtype {dtype_name(plan.dtype)}, {plan.ranks} rank(s): {node}, utilization {plan.memory_utilization}",
        "",
        _row("weights (whole model)", f"{plan.weight_bytes:,} B", gib(plan.weight_bytes)),
        _row("weights per rank", f"{plan.weight_bytes_per_rank:,} B", gib(plan.weight_bytes_per_rank)),
        _row("activation reserve per rank", f"{plan.activation_bytes:,} B", gib(plan.activation_bytes)),
        _row("cache budget per rank", f"{plan.cache_budget_bytes:,} B", gib(max(0, plan.cache_budget_bytes))),
        "",
        *format_v4_kinds(k, b),
        "",
        _row(f"KV per sequence at {n:,} tokens", f"{plan.sequence_bytes:,} B", gib(plan.sequence_bytes)),
        _row("  a V3.2-style stack of as many layers", f"{v32:,} B",
             f"{gib(v32)}  ({plan.layers} x (576 + 128) values x {b} B per token; {v32 / plan.sequence_bytes:.1f}x)"),
        _row(f"sequences of {n:,} tokens per rank", f"{plan.sequences_per_rank:,}"),
        _row(f"sequences of {n:,} tokens on the {plan.ranks} ranks", f"{plan.max_sequences:,}",
             "(each sequence's cache on one rank)"),
        _row("  if every rank held every sequence", f"{plan.sequences_per_rank:,}"),
        "",
    ]
    if not plan.weights_fit:
        lines.append(f"  the weights and activations alone DO NOT FIT {node}")
    else:
        verdict = "FITS" if plan.fits else "DOES NOT FIT"
        lines.append(f"  weights FIT {node}; requested {plan.max_num_seqs:,} x {n:,} tokens: {verdict} "
                     f"({plan.max_sequences:,} fit)")
    return "\n".join(lines)


__all__ = ["V4MemoryPlan", "format_v4_report", "plan_v4", "v32_style_bytes"]
