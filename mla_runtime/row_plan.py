"""The memory plan of Hunyuan V4 (``hy_v4``) and dots3-note (``dots3_note``): ``mla-runtime plan --model ...``.

Both keep MLA latent rows per token over states of their own (``models.row_sizes``), in the model's dtype:

    latent rows      d_c + d_r values per token in each layer that keeps every token (dots3-note: not the sliding)
    indexer keys     index_head_dim values per token in each layer with an indexer of its own
    sliding windows  (sliding_window - 1) rows per sliding layer, fixed per sequence (dots3-note)

so a sequence of ``L`` tokens costs ``L x (rows + keys) + windows``: what the workers count (the blocks hold the rows
and keys, a state slot the windows). Against it the report sets the same layers as a plain MLA stack with DSA keeps
them (every layer every token's row, every selecting layer its key), where that differs. dots3-note's prefix caching
sets aside ``max_num_seqs`` copies of the windows for its state snapshots, as serving does by default.

The weights are the model's parameters counted on the meta device, in bfloat16 (``--dtype auto``: the checkpoint's
dtype where it names float32) or float32: these models load float checkpoints only. What serving refuses for them
(``check_v4_settings``) the plan refuses by name: quantization, a cache dtype, the prefix-cache tiers, a rank count
that does not split the model. The plan itself is V4's (``v4_plan.OwnModelPlan``, ``plan_own_model``): on ``ranks``
devices a rank's weights are its shard (``models/v4_shards.py``, counted on rank 0's model: the vocabulary's padded
rows), and every rank holds every sequence's rows, as serving's ranks do.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from mla_runtime.models.dots3_note import Dots3Config, Dots3NoteForCausalLM
from mla_runtime.models.hy_v4 import HyV4Config, HyV4ForCausalLM
from mla_runtime.models.row_sizes import RowCacheKinds, dots3_kinds, dots3_model_config, hy_v4_kinds, hy_v4_model_config
from mla_runtime.models.v4_sizes import meta_weights
from mla_runtime.parallel import SINGLE_RANK, ParallelContext
from mla_runtime.plan import gib
from mla_runtime.v4_plan import (
    DOC,
    OwnModelPlan,
    format_budget,
    format_verdict,
    plan_dtype,
    plan_own_model,
    refusal,
    report_row,
)

ROW_MODELS = ("hy_v4", "dots3_note", "dots3_note_text")
RowMemoryPlan = OwnModelPlan[RowCacheKinds]


def check_row_settings(family: str, *, quantization: str | None = None, cache_dtype: str = "auto",
                       kv_cache_host_bytes: int | None = None, kv_cache_disk_bytes: int | None = None) -> None:
    """Refuse, by serving's names and words (``refusal``), the settings ``family`` is not served with."""
    refused = {"quantization": (quantization, quantization not in (None, "none")),
               "kv_cache_dtype": (cache_dtype, cache_dtype != "auto"),
               "kv_cache_host_bytes": (kv_cache_host_bytes, kv_cache_host_bytes is not None),
               "kv_cache_dir": (kv_cache_disk_bytes, kv_cache_disk_bytes is not None)}
    for name, (value, bad) in refused.items():
        if bad:
            raise ValueError(refusal(name, value, family))


def _checkpoint_dtype(dtype: str, stated: object) -> str:
    """``auto``: the checkpoint's dtype where it names float32, else bfloat16."""
    return "float32" if dtype == "auto" and str(stated) == "float32" else dtype


def plan_rows(raw: dict[str, Any], *, dtype: str = "auto", device_memory_bytes: int,
              memory_utilization: float = 0.92, ranks: int = 1, max_seq_len: int | None = None, max_num_seqs: int = 1,
              max_num_batched_tokens: int | None = None) -> RowMemoryPlan:
    """The plan of the ``hy_v4`` or ``dots3_note`` ``config.json`` ``raw`` on ``ranks`` devices of
    ``device_memory_bytes`` each."""
    family = raw.get("model_type")
    if family not in ROW_MODELS:
        raise ValueError(f"model_type {family!r}: the latent-row planner plans {list(ROW_MODELS)}")
    text = raw.get("text_config") or raw
    stated = text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype")
    torch_dtype = plan_dtype(family, _checkpoint_dtype(dtype, stated), ranks, max_num_seqs, memory_utilization)
    b = torch_dtype.itemsize
    if family == "hy_v4":
        hy = HyV4Config.from_raw(raw)
        kinds, mc, streams = hy_v4_kinds(hy, b), hy_v4_model_config(hy), int(hy.hc_mult)

        def build(par: ParallelContext = SINGLE_RANK) -> torch.nn.Module:
            return HyV4ForCausalLM(hy, torch_dtype, par)  # refuses a rank count that does not split it
    else:
        dots = Dots3Config.from_raw(raw)
        kinds, mc, streams = dots3_kinds(dots, b), dots3_model_config(dots), 0

        def build(par: ParallelContext = SINGLE_RANK) -> torch.nn.Module:
            return Dots3NoteForCausalLM(dots, torch_dtype, par)
    shard = meta_weights(lambda: build(ParallelContext(0, ranks)))[0]  # rank 0's: the vocabulary's padded rows too
    plan = plan_own_model(kinds, kinds.layers, build, mc, torch_dtype, streams,
                          device_memory_bytes=device_memory_bytes, memory_utilization=memory_utilization, ranks=ranks,
                          max_seq_len=max_seq_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          reserved_bytes=max_num_seqs * kinds.window_bytes)
    return replace(plan, rank_weight_bytes=shard)


def format_row_kinds(k: RowCacheKinds) -> list[str]:
    """Report lines: the bytes per token of each kind, and the per-sequence windows where there are any."""
    b = k.dtype_bytes
    lines = [
        report_row("latent rows (every token)", f"{k.latent_bytes:,} B/token",
                   f"= {k.latent_values:,} values x {b} B over {k.latent_layers} layers"),
        report_row("indexer keys (every token)", f"{k.index_key_bytes:,} B/token",
                   f"= {k.index_values:,} values x {b} B over {k.index_layers} layers with their own indexer"),
        report_row("cache per token", f"{k.bytes_per_token:,} B/token"),
    ]
    if k.sliding_layers:
        lines.append(report_row("sliding windows per sequence", f"{k.window_bytes:,} B",
                                f"{gib(k.window_bytes)}  (= {k.window_values:,} values x {b} B over "
                                f"{k.sliding_layers} sliding layers)"))
    return lines


def format_row_report(plan: RowMemoryPlan, model: str, family: str) -> str:
    """The operator's account of a Hunyuan V4 or dots3-note plan (what ``mla-runtime plan`` prints for one)."""
    k, n = plan.kinds, plan.max_seq_len
    plain = k.plain_bytes_per_token * n
    lines = [
        f"Memory plan for {model} ({family}: {k.layers} layers, {k.latent_layers} keeping every token's latent row, "
        f"{k.index_layers} with their own indexer, {k.sliding_layers} sliding; {plan.parameter_count:,} parameters)",
        *format_budget(plan, "state snapshots (prefix caching)" if plan.reserved_bytes else ""),
        "",
        *format_row_kinds(k),
        "",
        report_row(f"KV per sequence at {n:,} tokens", f"{plan.sequence_bytes:,} B", gib(plan.sequence_bytes)),
    ]
    if plain != plan.sequence_bytes:
        lines.append(report_row("  a plain MLA stack of the same layers", f"{plain:,} B",
                                f"{gib(plain)}  ({k.plain_values:,} values x {k.dtype_bytes} B per token: every "
                                f"layer's row, every selecting layer's key; {plain / plan.sequence_bytes:.2f}x)"))
    return "\n".join([*lines, report_row(f"sequences of {n:,} tokens that fit", f"{plan.max_sequences:,}"), "",
                      format_verdict(plan), f"  unquantized, every rank holding every sequence's rows: serving "
                      f"refuses quantization, a cache dtype and the prefix-cache tiers for {family} ({DOC})"])


__all__ = ["ROW_MODELS", "RowMemoryPlan", "check_row_settings", "format_row_kinds", "format_row_report", "plan_rows"]
