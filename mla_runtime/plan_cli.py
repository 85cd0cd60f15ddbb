"""``mla-runtime plan`` (also ``python -m mla_runtime.plan``): the planner's report and command line.

``format_report`` prints a ``plan.MemoryPlan``: the weights by part, the activation reserve, the latent cache per
token against a per-head cache, the blocks and sequences that fit, and where the requested sequences do not fit, the
settings that do. ``main`` parses the flags (``build_parser``), plans, prints, and exits 0 when the sequences fit, 1
when they do not, 2 on bad input or when the weights alone do not fit.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from mla_runtime.config import PRESET_DIR, ModelConfig, load_config_dict
from mla_runtime.dtypes import (
    CACHE_DTYPES,
    MODEL_DTYPES,
    CacheDtype,
    dtype_name,
    index_bytes_per_token,
    index_cache_dtype,
    resolve_cache_dtype,
    resolve_model_dtype,
)
from mla_runtime.footprint import check_weight_quantization
from mla_runtime.help_format import DefaultsHelpFormatter
from mla_runtime.kernel_plan import CpuLayouts, kernel_plan, resolve_cpu_format
from mla_runtime.options import LATENT_CACHE_LAYOUTS, WEIGHT_QUANTIZATIONS, parse_bytes
from mla_runtime.plan import MemoryPlan, gib, latent_bytes_per_token, mha_bytes_per_token, plan_memory
from mla_runtime.row_plan import ROW_MODELS, check_row_settings, format_row_report, plan_rows
from mla_runtime.v4_plan import format_v4_report, plan_v4


def _row(label: str, value: str, note: str = "") -> str:
    return f"  {label:<36}{value:>20}{'  ' + note if note else ''}"


def format_per_token(config: ModelConfig, cache: CacheDtype, tensor_parallel_size: int = 1,
                     latent_cache_layout: str = "replicated") -> list[str]:
    """Report lines for the cache cost of one token: latent, per rank when sharded, MHA, saving."""
    layers, tp = config.num_attention_layers, tensor_parallel_size  # cache layers: a LongCat layer has two
    latent = latent_bytes_per_token(config, cache.dtype)
    mha = mha_bytes_per_token(config, cache.dtype)
    per_layer = (f"({config.latent_dim} x {cache.element_bytes} B + {cache.scale_bytes} B scales)"
                 if cache.quantized else f"{config.latent_dim} values x {cache.element_bytes} B")
    index = index_bytes_per_token(config.index_dim, index_cache_dtype(cache.dtype, resolve_model_dtype("auto", config)))
    if index:
        per_layer = f"({per_layer} + {index} B indexer key)"
    lines = [_row("latent cache per token", f"{latent:,} B", f"= {per_layer} x {layers} layers")]
    if latent_cache_layout == "sharded" and tp > 1:
        lines.append(_row("latent cache per token per rank", f"{latent / tp:,.1f} B",
                          f"(each token on one of {tp} ranks)"))
    return lines + [
        _row("un-absorbed MHA cache per token", f"{mha:,} B",
             f"= {config.num_attention_heads} heads x {config.qk_head_dim + config.v_head_dim} x {layers} "
             f"layers x {cache.element_bytes} B"),
        _row("absorption saving", f"{mha / latent:,.2f}x", "smaller cache per token than MHA"),
    ]


def _blocks_note(config: ModelConfig) -> str:
    k = config.attention_blocks_per_layer
    return "" if k == 1 else f" of {k} attention blocks"


def format_report(plan: MemoryPlan, config: ModelConfig, model: str = "") -> str:
    """A readable, operator-facing account of the plan (what the CLI prints)."""
    tp = plan.tensor_parallel_size

    def bytes_row(label: str, n: int, note: str = "") -> str:
        return _row(label, f"{n:,} B", f"{gib(n):>13}" + (f"  {note}" if note else ""))

    w = plan.weights
    fmt = w.format if w is not None else dtype_name(plan.dtype)
    parts = [] if w is None else [bytes_row(f"  {label}", n) for label, n in (
        ("quantised matrices + scales", w.quantized_bytes),
        (f"in {dtype_name(w.dtype)} (embedding, kv_b...)", w.float_bytes),
        ("absorbed copies (w_uk, w_uv_t)", w.absorbed_bytes),
        ("CPU-only copies (packed layouts)", w.packed_bytes)) if n]

    lines = [
        f"Memory plan for {model or config.model_type} ({config.model_type}: {config.num_hidden_layers} "
        f"layers{_blocks_note(config)}, {config.num_attention_heads} heads, d_c={config.d_c}, d_r={config.d_r}, "
        f"{plan.parameter_count:,} parameters)",
        f"  model dtype {dtype_name(plan.dtype)}, weights {fmt}, cache dtype {plan.cache_dtype.name}, block size "
        f"{plan.block_size}, tensor parallel {tp} ({plan.latent_cache_layout} latent cache)",
        "",
        bytes_row("device memory per rank", plan.device_memory_bytes),
        bytes_row(f"usable at utilization {plan.memory_utilization}", plan.usable_bytes),
        bytes_row("weights per rank", plan.weight_bytes,
                  f"(total {plan.total_weight_bytes:,} B)" if tp > 1 else ""),
        *parts,
        bytes_row("activation reserve", plan.activation_bytes,
                  f"({plan.max_num_batched_tokens:,} batched tokens, {plan.max_num_seqs:,} seqs)"),
        *([bytes_row("state cache (hybrid)", plan.state_bytes, f"({plan.max_num_seqs:,} seqs x "
                                                                  f"{plan.state_bytes_per_sequence:,} B)")]
          if plan.state_bytes else []),
        *([bytes_row("state snapshots (hybrid)", plan.state_snapshot_bytes,
                     f"({plan.state_snapshots:,} prefix-cache snapshots)")] if plan.state_snapshot_bytes else []),
        bytes_row("latent cache budget", plan.cache_budget_bytes),
        "",
        *format_per_token(config, plan.cache_dtype, tp, plan.latent_cache_layout),
        "",
        _row("blocks per rank", f"{plan.num_blocks:,}",
             f"x {plan.block_size} tokens ({gib(plan.cache_bytes)} allocated)"),
        _row("tokens that fit", f"{plan.max_tokens:,}"),
        _row(f"sequences of {plan.max_seq_len:,} tokens that fit", f"{plan.max_sequences:,}"),
    ]
    if plan.host_bytes is not None:
        lines.append(_row("host tier: tokens that fit", f"{plan.host_capacity_tokens:,}",
                          f"in {plan.host_bytes:,} B ({gib(plan.host_bytes)}) of host RAM per rank"))
    if plan.disk_bytes is not None:
        lines.append(_row("disk tier: tokens that fit", f"{plan.disk_capacity_tokens:,}",
                          f"in {plan.disk_bytes:,} B ({gib(plan.disk_bytes)}), {plan.disk_file_bytes:,} B per "
                          f"block of {plan.block_size} on disk"))
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    needed = plan.max_num_seqs * plan.blocks_per_sequence
    lines += ["", f"  requested {plan.max_num_seqs:,} x {plan.max_seq_len:,} tokens: {verdict} "
              f"(needs {needed:,} blocks of {plan.block_size} tokens, the cache holds "
              f"{plan.max_tokens // plan.block_size:,})"]
    if not plan.fits:
        lines.append(f"  to fit: --max-num-seqs {plan.max_sequences:,} at {plan.max_seq_len:,} tokens, or "
                     f"--max-seq-len {_fitting_len(plan):,} for {plan.max_num_seqs:,} sequences; or more memory "
                     "(--device-memory, --tensor-parallel-size), a smaller --cache-dtype or --quantization")
    return "\n".join(lines)


def _fitting_len(plan: MemoryPlan) -> int:
    """A sequence length (whole blocks) of which ``plan.max_num_seqs`` fit this plan's cache; a shorter length also
    shrinks the activation reserve, so it fits with room to spare."""
    return plan.max_tokens // plan.block_size // plan.max_num_seqs * plan.block_size


def build_parser(prog: str = "python -m mla_runtime.plan") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, formatter_class=DefaultsHelpFormatter,
                                     description="Plan how one rank's memory splits into weights, activations "
                                                 "and latent cache blocks. Exits 1 when the cache cannot hold the "
                                                 "sequences, 2 when the weights alone do not fit (or on bad input).")
    parser.add_argument("--model", required=True, help="checkpoint dir, config.json, or preset name "
                                                       "(" + ", ".join(sorted(p.stem for p in
                                                                             PRESET_DIR.glob("*.json"))) + ")")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="tokens per sequence (default: the model's max_position_embeddings)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences that must fit at once")
    parser.add_argument("--device-memory", type=parse_bytes, required=True,
                        help="memory of one device, e.g. 80GiB, 141GB, 1.5e11")
    parser.add_argument("--memory-utilization", type=float, default=0.92, help="fraction of it the runtime uses")
    parser.add_argument("--dtype", default="auto", choices=["auto", *MODEL_DTYPES], help="weight dtype")
    parser.add_argument("--cache-dtype", default="auto", choices=list(CACHE_DTYPES), help="latent-cache dtype")
    parser.add_argument("--quantization", default="none", choices=["none", *WEIGHT_QUANTIZATIONS],
                        help="weight-only quantisation of the model's matrices (none: the checkpoint's own format, "
                             "an FP8 checkpoint's FP8 blocks)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="cpu: also count the second layout this machine's CPU products keep of the float "
                             "weights, and pick dtype auto as a CPU load does (default: no particular machine)")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per cache block")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one step (default: max-seq-len capped at 8192, at least 2048)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the model is sharded across")
    parser.add_argument("--latent-cache-layout", default="replicated", choices=list(LATENT_CACHE_LAYOUTS),
                        help="sharded: each token's latent on one rank")
    parser.add_argument("--kv-cache-disk-bytes", type=parse_bytes, default=None,
                        help="the disk tier's bound, e.g. 1TB: show how many tokens of prefix it holds")
    parser.add_argument("--kv-cache-host-bytes", type=parse_bytes, default=None,
                        help="the host-RAM tier per rank, e.g. 256GiB: show how many tokens of prefix it holds")
    return parser


def _probed_cpu(dtype: str, config: ModelConfig, quantization: str | None) -> tuple[CpuLayouts, str | None]:
    """``--device cpu``: this CPU's probes and the products' format, as a model loaded here would run them (the
    planner's facts)."""

    stored, plan = quantization or config.stored_quantization, kernel_plan()
    model_dtype, chosen = resolve_cpu_format(dtype, resolve_model_dtype(dtype, config), stored, plan)
    return plan.layouts(model_dtype), quantization if chosen == stored else chosen


def _own_plan(args: argparse.Namespace, raw: dict) -> tuple[str, bool, bool]:
    """The report of a model of its own (``v4_plan``, ``row_plan``) and whether the weights and the sequences fit."""
    kw = dict(dtype=args.dtype, device_memory_bytes=args.device_memory, memory_utilization=args.memory_utilization,
              max_seq_len=args.max_seq_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    if raw["model_type"] == "deepseek_v4":
        v4 = plan_v4(raw, ranks=args.tensor_parallel_size, **kw)
        return format_v4_report(v4, args.model), v4.weights_fit, v4.fits
    check_row_settings(raw["model_type"], quantization=args.quantization, cache_dtype=args.cache_dtype,
                       kv_cache_host_bytes=args.kv_cache_host_bytes, kv_cache_disk_bytes=args.kv_cache_disk_bytes)
    rows = plan_rows(raw, ranks=args.tensor_parallel_size, **kw)
    return format_row_report(rows, args.model, raw["model_type"]), rows.weights_fit, rows.fits


def _own_main(args: argparse.Namespace, prog: str) -> int | None:
    """A model of its own's plan (``deepseek_v4``: ``v4_plan``; ``hy_v4``, ``dots3_note``: ``row_plan``), printed;
    None for any other model."""
    try:
        raw = load_config_dict(args.model)
    except (OSError, ValueError):
        return None  # the MLA planner reports what is wrong with it
    if raw.get("model_type") not in ("deepseek_v4", *ROW_MODELS):
        return None
    try:
        report, weights_fit, fits = _own_plan(args, raw)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(report)
    return 0 if fits else 1 if weights_fit else 2


def main(argv: Sequence[str] | None = None, prog: str = "python -m mla_runtime.plan") -> int:
    """Print the plan; 0 when the requested sequences fit, 1 when they do not, 2 on bad input."""
    args = build_parser(prog).parse_args(argv)
    own = _own_main(args, prog)
    if own is not None:
        return own
    try:
        config = ModelConfig.from_pretrained(args.model)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    note = ""
    try:
        cpu, quantization = _probed_cpu(args.dtype, config, check_weight_quantization(args.quantization)) \
            if args.device is not None and torch.device(args.device).type == "cpu" else (None, args.quantization)

        def planned(layouts: CpuLayouts | None) -> MemoryPlan:
            return plan_memory(
                config, dtype=args.dtype, cache_dtype=args.cache_dtype, device_memory_bytes=args.device_memory,
                memory_utilization=args.memory_utilization,
                max_seq_len=args.max_seq_len or config.max_position_embeddings, max_num_seqs=args.max_num_seqs,
                block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                tensor_parallel_size=args.tensor_parallel_size, latent_cache_layout=args.latent_cache_layout,
                disk_bytes=args.kv_cache_disk_bytes, quantization=quantization, host_bytes=args.kv_cache_host_bytes,
                cpu=layouts)

        try:
            plan = planned(cpu)
        except ValueError:
            # as the engine does: where the weights fit only without their second layouts, it loads them so
            lean = None if cpu is None else cpu.with_one_layout()
            if lean is None:
                raise
            plan = planned(lean)
            note = ("  (each weight in one layout: with oneDNN's blocked copies or AMX tiles the weights do not "
                    "fit, and the engine leaves them out)")
    except ValueError as e:
        try:  # the per-token cost does not depend on memory: still worth showing
            cache = resolve_cache_dtype(args.cache_dtype, resolve_model_dtype(args.dtype, config))
            print(f"Cache cost per token for {args.model} (no plan: see the error below)")
            print("\n".join(format_per_token(config, cache, args.tensor_parallel_size,
                                             args.latent_cache_layout)))
        except ValueError:
            pass
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(format_report(plan, config, args.model) + (f"\n{note}" if note else ""))
    return 0 if plan.fits else 1


