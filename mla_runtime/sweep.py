"""Rank × cache-precision × weight-precision sweep: what shrinking the cached latent (or the weights) costs in
quality and buys in memory.

The low-rank dimension should not be changed without validation; this is the instrument
that validates it. For every point (weights, projection method, latent rank ``r``, cache dtype) it reports:

- ``method``: ``full`` (the untruncated model), ``svd`` (basis from ``kv_b_proj``) or ``pca`` (from latents
  collected on calibration text);
- ``rank``: latent values cached per token per layer (``d_c`` for ``full``);
- ``cache_dtype``: element type of the latent cache (``fp32``, ``bf16``, ``fp16``, ``fp8``, ``int8``);
- ``weights``: weight precision: ``none`` (the model dtype) or ``int8`` (weight-only, ``quantization="int8"``,
  quantised at load after any truncation);
- ``bytes_per_token``: bytes the allocated cache holds per token, all layers:
  ``(r + d_r) × layers × bytes(dtype)``, plus 8 bytes of scales per layer for fp8/int8;
- ``bytes_vs_full``: ``bytes_per_token`` over that of the full model with a model-dtype cache;
- ``max_concurrent_tokens``: tokens that fit ``--memory-budget`` bytes of cache, in whole blocks (the engine's
  rule);
- ``perplexity``: ``exp`` of the mean next-token NLL on the eval tokens;
- ``kl_div``: mean ``KL(p_full ‖ p_point)`` per token (nats), the reference being the full model with a
  model-dtype cache;
- ``top1_agreement``: fraction of eval positions whose argmax equals the reference's;
- ``decode_tokens_per_s``: greedy decode throughput on a fixed batch (below); empty when ``--decode-steps 0``.

How each number is made:

- Truncation: a freshly loaded model goes through ``latent_rank.truncate_latent_rank`` (``svd`` or ``pca``), so
  the up-projection is folded and the cache really holds ``r + d_r`` values per token; ``bytes_per_token``
  is read from the allocated ``LatentCache``, not computed. At ``r = d_c`` the basis is a rotation, so the
  model is reproduced to rounding.
- Quality: the eval tokens are cut into non-overlapping windows of ``window + 1`` tokens; each window runs
  through a fresh paged cache of the point's dtype in prefill chunks of ``chunk`` tokens, so later chunks
  read earlier tokens back from the (quantised, truncated) cache as serving does.
- Decode tokens/s: the model and a cache directly, not the engine: ``decode_batch`` sequences of
  ``decode_context`` prompt tokens are prefilled, then ``decode_steps`` greedy steps are timed (each: batch
  build, forward on the absorbed path, logits, argmax) after one untimed warm-up step; tokens/s is
  ``decode_batch / median step time``. No scheduling or sampling overhead; on a shared CPU treat it as
  indicative.

CLI::

    mla-runtime sweep --model PATH --eval-text held_out.py        # svd at every rank, bf16/fp8/int8 caches
    mla-runtime sweep --model PATH --ranks 512,256,128,64,32 --cache-dtypes bf16,fp8,int8 \\
        --eval-text held_out.py --calibration-text other.py --memory-budget 1GiB   # svd and pca
    mla-runtime sweep --model PATH --weights none,int8 --ranks 512 --cache-dtypes fp32 --eval-text held_out.py

``--methods`` defaults to ``svd``, plus ``pca`` when calibration text or tokens are given. Ranks above
the model's ``d_c`` are capped to it. Token ids can replace text (``--eval-tokens``,
``--calibration-tokens``: a JSON list of ints or of lists, or whitespace-separated ints). Writes
``sweep.csv``, ``sweep.md`` and ``sweep.png`` (quality against bytes per token) to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from mla_runtime.config import ModelConfig
from mla_runtime.dtypes import resolve_cache_dtype
from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.worker import StepInput, Worker
from mla_runtime.help_format import DefaultsHelpFormatter
from mla_runtime.hub import resolve_model
from mla_runtime.latent_rank import CALIBRATION_TOKENS, METHODS, calibration_chunks
from mla_runtime.layers.quantization import check_quantization
from mla_runtime.options import parse_bytes
from mla_runtime.plan import cache_capacity_tokens

COLUMNS = ("method", "rank", "cache_dtype", "weights", "bytes_per_token", "bytes_vs_full", "max_concurrent_tokens",
           "perplexity", "kl_div", "top1_agreement", "decode_tokens_per_s")
SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
               torch.float8_e4m3fn: "fp8", torch.int8: "int8"}
OUTPUT_FILES = ("sweep.csv", "sweep.md", "sweep.png")
KL_PLOT_FLOOR = 1e-6  # KL of the exact points (0, or rounding) is drawn here on the log axis


@dataclass(frozen=True)
class SweepConfig:
    ranks: tuple[int, ...] = (512, 256, 128, 64, 32)
    cache_dtypes: tuple[str, ...] = ("bf16", "fp8", "int8")
    methods: tuple[str, ...] = ("svd", "pca")
    weights: tuple[str, ...] = ("none",)  # weight precisions: none (the model dtype) and/or int8
    memory_budget: int | str = "1GiB"
    dtype: str = "auto"  # model weights / compute
    block_size: int = 64
    window: int = 512
    chunk: int = 256
    windows_per_batch: int = 4
    max_eval_tokens: int = 4096
    max_calibration_tokens: int = CALIBRATION_TOKENS
    decode_batch: int = 8
    decode_context: int = 128
    decode_steps: int = 16  # 0: skip the timing
    device: str = "cpu"
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        if not self.ranks or min(self.ranks) < 1:
            raise ValueError(f"ranks must be positive integers, got {list(self.ranks)}")
        if not self.cache_dtypes:
            raise ValueError("cache_dtypes must name at least one dtype")
        for name in self.cache_dtypes:
            resolve_cache_dtype(name, torch.float32)  # raises a ValueError naming the dtype
        if not self.weights:
            raise ValueError("weights must name at least one weight precision (none, int8)")
        for name in self.weights:
            check_quantization(name)  # raises a ValueError naming quantization
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(f"methods must be a non-empty subset of {METHODS}, got {list(self.methods)}")
        for name in ("block_size", "window", "chunk", "windows_per_batch", "max_eval_tokens",
                     "max_calibration_tokens", "decode_batch", "decode_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.decode_steps < 0:
            raise ValueError(f"decode_steps must be >= 0, got {self.decode_steps}")


@dataclass
class SweepRow:
    method: str
    rank: int
    cache_dtype: str
    weights: str
    bytes_per_token: int
    bytes_vs_full: float
    max_concurrent_tokens: int
    perplexity: float
    kl_div: float
    top1_agreement: float
    decode_tokens_per_s: float | None


@dataclass
class SweepResult:
    model: str
    d_c: int
    d_r: int
    num_layers: int
    model_dtype: str
    eval_tokens: int  # scored positions
    calibration_tokens: int
    memory_budget: int
    rows: list[SweepRow] = field(default_factory=list)


def capped_ranks(ranks: Sequence[int], d_c: int) -> list[int]:
    """Ranks capped at ``d_c``, deduplicated, largest first."""
    return sorted({min(r, d_c) for r in ranks}, reverse=True)


def eval_windows(docs: Sequence[Sequence[int]], window: int, max_tokens: int) -> list[list[int]]:
    """Non-overlapping windows of ``window + 1`` tokens (the last may be shorter, at least 2) scoring at most
    ``max_tokens`` positions in all."""
    out: list[list[int]] = []
    budget = max_tokens
    for doc in docs:
        for start in range(0, len(doc) - 1, window):
            n = min(window, len(doc) - 1 - start, budget)
            if n < 1:
                break
            out.append(list(doc[start:start + n + 1]))
            budget -= n
        if budget <= 0:
            break
    if not out:
        raise ValueError("eval tokens: need at least one document of 2 or more tokens")
    return out


# -- running the model through a paged cache ------------------------------------------------------
def load_worker(model_path: str | Path, cfg: SweepConfig, weights: str = "none") -> Worker:
    """A loaded single-rank ``Worker`` of the full (untruncated) model; ``weights="int8"`` quantises it when its
    first cache is allocated (after any truncation)."""
    worker = Worker(EngineConfig(model=str(model_path), dtype=cfg.dtype, block_size=cfg.block_size,
                                 device=cfg.device, attention_backend=cfg.attention_backend, quantization=weights))
    worker.load()
    return worker


@torch.inference_mode()
def window_log_probs(worker: Worker, windows: Sequence[Sequence[int]], cache_dtype: torch.dtype,
                     cfg: SweepConfig) -> tuple[torch.Tensor, int]:
    """Log-probabilities ``[sum(len(w) - 1), V]`` fp32 of every window's inputs, in window order, and the
    bytes per token of the cache they ran through. All windows run as one batch of sequences, in chunks."""
    per_seq = -(-max(len(w) for w in windows) // cfg.block_size)
    cache = worker.allocate(per_seq * len(windows), cache_dtype)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(windows))]
    inputs = [list(w[:-1]) for w in windows]
    done = [0] * len(windows)
    parts: list[list[torch.Tensor]] = [[] for _ in windows]
    while any(d < len(x) for d, x in zip(done, inputs)):
        live = [i for i, x in enumerate(inputs) if done[i] < len(x)]
        chunks = [inputs[i][done[i]:done[i] + cfg.chunk] for i in live]
        rows = list(range(sum(map(len, chunks))))
        logits = worker.execute(StepInput(chunks, [done[i] for i in live], [tables[i] for i in live], rows))
        assert logits is not None
        logp = torch.log_softmax(logits, dim=-1).cpu()
        start = 0
        for i, c in zip(live, chunks):
            parts[i].append(logp[start:start + len(c)])
            start += len(c)
            done[i] += len(c)
    return torch.cat([p for ps in parts for p in ps]), cache.bytes_per_token()


@torch.inference_mode()
def decode_tokens_per_s(worker: Worker, prompts: Sequence[Sequence[int]], steps: int,
                        cache_dtype: torch.dtype, cfg: SweepConfig) -> float:
    """Greedy decode tokens/s of a fixed batch: prefill ``prompts``, one warm-up step, then ``steps`` timed
    steps; the median step time is used, so a shared CPU's stalls do not dominate."""
    per_seq = -(-(max(len(p) for p in prompts) + steps + 1) // cfg.block_size)
    worker.allocate(per_seq * len(prompts), cache_dtype)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    lens = [len(p) for p in prompts]
    last_rows = list(itertools.accumulate(lens, initial=-1))[1:]
    logits = worker.execute(StepInput([list(p) for p in prompts], [0] * len(prompts), tables, last_rows))
    assert logits is not None
    nxt = logits.argmax(-1).tolist()
    sync = torch.cuda.synchronize if cfg.device.startswith("cuda") else (lambda: None)
    seconds = []
    for _ in range(steps + 1):  # the first step is a warm-up
        sync()
        start = time.perf_counter()
        logits = worker.execute(StepInput([[t] for t in nxt], lens, tables, list(range(len(nxt)))))
        assert logits is not None
        nxt = logits.argmax(-1).tolist()
        seconds.append(time.perf_counter() - start)
        lens = [n + 1 for n in lens]
    return len(prompts) / statistics.median(seconds[1:])


# -- the sweep ------------------------------------------------------------------------------------
@dataclass
class _Inputs:
    """What every point of a sweep runs on: the scored windows (in groups), their targets, the calibration
    chunks for PCA and the decode-timing prompts."""

    groups: list[list[list[int]]]
    targets: list[torch.Tensor]
    calibration: list[list[int]]
    decode_prompts: list[list[int]]


def _inputs(eval_docs: Sequence[Sequence[int]], calibration_docs: Sequence[Sequence[int]] | None,
            mcfg: ModelConfig, cfg: SweepConfig) -> _Inputs:
    windows = eval_windows(eval_docs, min(cfg.window, mcfg.max_position_embeddings - 1), cfg.max_eval_tokens)
    calib = calibration_chunks(calibration_docs or [], cfg.max_calibration_tokens) if "pca" in cfg.methods else []
    context = max(1, min(cfg.decode_context, mcfg.max_position_embeddings - cfg.decode_steps - 1))
    decode_prompts = [(list(windows[i % len(windows)]) * context)[:context] for i in range(cfg.decode_batch)]
    groups = [windows[i:i + cfg.windows_per_batch] for i in range(0, len(windows), cfg.windows_per_batch)]
    targets = [torch.tensor([t for w in group for t in w[1:]]) for group in groups]
    return _Inputs(groups, targets, calib, decode_prompts)


def _score(worker: Worker, dtype: torch.dtype, data: _Inputs, reference: list[torch.Tensor], cfg: SweepConfig
           ) -> tuple[float, float, float, int]:
    """Summed NLL, KL to the reference and top-1 agreements over every window group, and the cache's bytes per
    token. The first point scored becomes the reference."""
    nll = kl = agree = 0.0
    bytes_per_token = 0
    for g, (group, tgt) in enumerate(zip(data.groups, data.targets)):
        logp, bytes_per_token = window_log_probs(worker, group, dtype, cfg)
        if len(reference) == g:  # the first point is the reference itself
            reference.append(logp)
        ref = reference[g]
        nll -= float(logp.gather(1, tgt[:, None]).sum())
        kl += float(torch.nn.functional.kl_div(logp, ref, log_target=True, reduction="sum"))
        agree += float((logp.argmax(-1) == ref.argmax(-1)).sum())
    return nll, kl, agree, bytes_per_token


def run_sweep(model_path: str | Path, eval_docs: Sequence[Sequence[int]],
              calibration_docs: Sequence[Sequence[int]] | None = None, config: SweepConfig | None = None,
              progress: bool = False) -> SweepResult:
    """Evaluate the full model and every (method, rank, cache dtype) point on ``eval_docs`` (token-id lists)."""
    cfg = config or SweepConfig()
    if "pca" in cfg.methods and not calibration_docs:
        raise ValueError("method 'pca' needs calibration tokens (--calibration-text or --calibration-tokens)")
    worker = load_worker(model_path, cfg)  # the full model first; each (method, rank) then loads its own
    assert worker.model is not None
    mcfg, ref_dtype = worker.model_config, worker.model.dtype
    cache_dtypes = [resolve_cache_dtype(n, ref_dtype).dtype for n in cfg.cache_dtypes]
    data = _inputs(eval_docs, calibration_docs, mcfg, cfg)
    result = SweepResult(model=str(model_path), d_c=mcfg.kv_lora_rank, d_r=mcfg.qk_rope_head_dim,
                         num_layers=mcfg.num_hidden_layers, model_dtype=SHORT_NAMES[ref_dtype],
                         eval_tokens=sum(len(t) for t in data.targets),
                         calibration_tokens=sum(map(len, data.calibration)), memory_budget=int(cfg.memory_budget))
    full = [("full", mcfg.kv_lora_rank, d) for d in dict.fromkeys([ref_dtype, *cache_dtypes])]
    cut = [(m, r, d) for m in cfg.methods for r in capped_ranks(cfg.ranks, mcfg.kv_lora_rank) for d in cache_dtypes]
    points = [("none", *full[0])]  # the reference first: the full model in its own dtype, cache included
    points += [(w, *p) for w in cfg.weights for p in full + cut if (w, *p) != points[0]]
    bar = tqdm(total=len(points), desc="sweep", unit="point", file=sys.stderr, disable=not progress)
    reference: list[torch.Tensor] = []  # per window group: the full model's log-probs (model-dtype cache)
    loaded, full_bytes = ("none", "full", mcfg.kv_lora_rank), 0
    for weights, method, rank, dtype in points:
        bar.set_postfix_str(f"{weights} {method} r={rank} {SHORT_NAMES[dtype]}")
        if (weights, method, rank) != loaded:
            del worker  # one model in memory at a time; a fresh load (not a copy: weights may be packed)
            worker = load_worker(model_path, cfg, weights)
            if method != "full":
                worker.truncate_latent(data.calibration or None, rank, method)
            loaded = (weights, method, rank)
        nll, kl, agree, bytes_per_token = _score(worker, dtype, data, reference, cfg)
        n, full_bytes = result.eval_tokens, full_bytes or bytes_per_token
        tps = decode_tokens_per_s(worker, data.decode_prompts, cfg.decode_steps, dtype, cfg) if cfg.decode_steps \
            else None
        result.rows.append(SweepRow(
            weights=weights, method=method, rank=rank, cache_dtype=SHORT_NAMES[dtype], bytes_per_token=bytes_per_token,
            bytes_vs_full=bytes_per_token / full_bytes,
            max_concurrent_tokens=cache_capacity_tokens(int(cfg.memory_budget), bytes_per_token, cfg.block_size),
            perplexity=math.exp(nll / n), kl_div=max(kl / n, 0.0), top1_agreement=agree / n, decode_tokens_per_s=tps))
        bar.update(1)
    bar.close()
    return result


def write_csv(result: SweepResult, path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in result.rows:
            writer.writerow({k: ("" if v is None else v) for k, v in asdict(row).items()})


def _fmt(column: str, value: Any) -> str:
    if value is None:
        return "–"
    if column == "perplexity":
        return f"{value:.3f}"
    if column == "kl_div":
        return f"{value:.2e}" if 0 < float(value) < 1e-3 else f"{value:.4f}"
    if column == "top1_agreement":
        return f"{100 * float(value):.2f}%"
    if column == "bytes_vs_full":
        return f"{value:.3f}"
    if column == "decode_tokens_per_s":
        return f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}" if column != "rank" else str(value)
    return str(value)


def markdown_table(result: SweepResult) -> str:
    lines = [
        f"Model `{result.model}`: d_c={result.d_c}, d_r={result.d_r}, {result.num_layers} layers, "
        f"weights {result.model_dtype}; {result.eval_tokens:,} eval tokens, {result.calibration_tokens:,} "
        f"calibration tokens (pca); memory budget {result.memory_budget:,} B. KL and top-1 are against "
        f"the full model with a {result.model_dtype} cache.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" if c in ("weights", "method", "cache_dtype") else "---:" for c in COLUMNS) + "|",
    ]
    for row in result.rows:
        lines.append("| " + " | ".join(_fmt(c, getattr(row, c)) for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def plot(result: SweepResult, path: Path) -> bool:
    """Perplexity, KL, top-1 agreement, the tokens that fit the memory budget and decode tokens/s against bytes per
    token, one line per (method, cache dtype). Returns False (and writes nothing) when matplotlib is missing
    (``pip install mla-runtime[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 5, figsize=(27, 4.8))
    panels = (("perplexity", "perplexity (lower is better; dotted: full model)"),
              ("kl_div", f"KL(full ‖ point), nats/token (floor {KL_PLOT_FLOOR:g})"),
              ("top1_agreement", "top-1 agreement with full"),
              ("max_concurrent_tokens", f"tokens that fit the {result.memory_budget:,} B cache budget"),
              ("decode_tokens_per_s", "decode tokens/s (where measured)"))
    colours = {"svd": "tab:blue", "pca": "tab:orange", "full": "black"}
    markers = {"fp32": "D", "bf16": "o", "fp16": "v", "fp8": "s", "int8": "^"}
    styles = {"fp32": "-", "bf16": "-", "fp16": "-", "fp8": "--", "int8": ":"}
    series: dict[tuple[str, str], list[SweepRow]] = {}
    for row in result.rows:  # int8 weights: their own series, labelled "w8 <method> <dtype>"
        prefix = "" if row.weights == "none" else f"w{row.weights.removeprefix('int')} "
        series.setdefault((prefix + row.method, row.cache_dtype), []).append(row)
    labelled = next((r.cache_dtype for r in result.rows if r.method != "full"), None)  # ranks written once
    for ax, (column, title) in zip(axes, panels):
        for (method, dtype), rows in series.items():
            rows = sorted(rows, key=lambda r: r.bytes_per_token)
            xs = [r.bytes_per_token for r in rows]
            ys = [_plotted(r, column) for r in rows]
            full = method.endswith("full")  # the untruncated model: one point per cache dtype
            colour = colours.get(method, "tab:green" if full else "gray")
            ax.plot(xs, ys, linestyle="none" if full else styles.get(dtype, "-"), marker=markers.get(dtype, "o"),
                    markersize=8 if full else 5, color=colour, label=f"{method} {dtype}")
            if column == "perplexity" and not full and dtype == labelled:
                for r in rows:
                    ax.annotate(str(r.rank), (r.bytes_per_token, r.perplexity), fontsize=7,
                                textcoords="offset points", xytext=(3, 3), color=colour)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache bytes per token (all layers)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    ppl = [r.perplexity for r in result.rows]
    axes[0].axhline(result.rows[0].perplexity, color="black", linestyle=":", linewidth=0.8)
    if max(ppl) > 3 * min(ppl):  # a collapse: only a log axis keeps the good points readable
        axes[0].set_yscale("log")
        axes[0].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axes[1].set_yscale("log")
    axes[1].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.suptitle(f"{Path(result.model).name}: latent rank × cache dtype (d_c={result.d_c}, d_r={result.d_r}; "
                 f"labels = rank)")
    fig.tight_layout(rect=(0, 0, 0.91, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plotted(row: SweepRow, column: str) -> float:
    """A row's value in a panel: KL floored at ``KL_PLOT_FLOOR`` (a log axis), an unmeasured speed left out (NaN)."""
    value = getattr(row, column)
    if value is None:
        return math.nan
    return max(value, KL_PLOT_FLOOR) if column == "kl_div" else float(value)


def write_reports(result: SweepResult, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path, png_path = (out / name for name in OUTPUT_FILES)
    write_csv(result, csv_path)
    md_path.write_text(markdown_table(result))
    written = [csv_path, md_path]
    if plot(result, png_path):
        written.append(png_path)
    else:
        print("sweep: matplotlib is not installed, no plot written (pip install 'mla-runtime[bench]')",
              file=sys.stderr)
    return written


# -- CLI ------------------------------------------------------------------------------------------
def read_token_file(path: str | Path) -> list[list[int]]:
    """Token ids from a JSON list of ints (one document) or of lists, or from whitespace-separated ints."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            return [[int(t) for t in text.split()]]
        except ValueError as e:
            raise ValueError(f"{path}: expected JSON or whitespace-separated token ids ({e})") from e
    if isinstance(data, list) and all(isinstance(t, int) for t in data):
        return [data]
    if isinstance(data, list) and all(isinstance(d, list) and all(isinstance(t, int) for t in d) for d in data):
        return data
    raise ValueError(f"{path}: expected a JSON list of token ids or a list of such lists")


def _docs(texts: list[str] | None, token_files: list[str] | None, tokenizer_path: str, what: str
          ) -> list[list[int]] | None:
    if texts and token_files:
        raise ValueError(f"--{what}-text and --{what}-tokens are exclusive")
    if token_files:
        return [doc for f in token_files for doc in read_token_file(f)]
    if not texts:
        return None
    from mla_runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    if tok is None:
        raise ValueError(f"--{what}-text: no tokenizer files in {tokenizer_path}; pass --tokenizer or "
                         f"--{what}-tokens")
    return [list(tok.encode(Path(f).read_text(encoding="utf-8"), verbose=False)) for f in texts]


def _ints(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from e


def _names(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def build_parser(prog: str = "python -m mla_runtime.sweep") -> argparse.ArgumentParser:
    d = SweepConfig()
    ap = argparse.ArgumentParser(prog=prog, formatter_class=DefaultsHelpFormatter,
                                 description="Sweep latent rank × cache dtype: quality, bytes per token, "
                                             "capacity and decode speed.")
    ap.add_argument("--model", required=True, help="checkpoint directory or hub repo id org/name")
    ap.add_argument("--revision", help="hub branch, tag or commit of a repo id (default: main)")
    ap.add_argument("--ranks", type=_ints, default=",".join(map(str, d.ranks)),
                    help="comma-separated; capped at the model's d_c")
    ap.add_argument("--cache-dtypes", type=_names, default=",".join(d.cache_dtypes), help="e.g. bf16,fp8,int8")
    ap.add_argument("--weights", type=_names, default=",".join(d.weights),
                    help="weight precisions: none (the model dtype) and/or int8 (weight-only, quantised at load)")
    ap.add_argument("--methods", type=_names, default=None,
                    help="svd,pca (default: svd, and pca when calibration text or tokens are given)")
    ap.add_argument("--eval-text", nargs="+", help="held-out text file(s) for perplexity / KL / top-1")
    ap.add_argument("--eval-tokens", nargs="+", help="token-id file(s) instead of --eval-text")
    ap.add_argument("--calibration-text", nargs="+", help="text file(s) for the PCA (not the eval text)")
    ap.add_argument("--calibration-tokens", nargs="+", help="token-id file(s) instead of --calibration-text")
    ap.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    ap.add_argument("--memory-budget", default="1GiB", help="latent-cache bytes, e.g. 1GiB, 80GB")
    ap.add_argument("--dtype", default=d.dtype, help="weights/compute dtype (auto = the checkpoint's)")
    ap.add_argument("--block-size", type=int, default=d.block_size, help="tokens per cache block")
    ap.add_argument("--window", type=int, default=d.window, help="tokens of context per eval window")
    ap.add_argument("--chunk", type=int, default=d.chunk, help="prefill chunk (tokens)")
    ap.add_argument("--max-eval-tokens", type=int, default=d.max_eval_tokens, help="eval tokens scored at most")
    ap.add_argument("--max-calibration-tokens", type=int, default=d.max_calibration_tokens,
                    help="calibration tokens the PCA reads at most")
    ap.add_argument("--decode-batch", type=int, default=d.decode_batch, help="sequences of the timed decode")
    ap.add_argument("--decode-context", type=int, default=d.decode_context,
                    help="prompt tokens per timed decode sequence")
    ap.add_argument("--decode-steps", type=int, default=d.decode_steps, help="timed decode steps (0: skip)")
    ap.add_argument("--device", default=d.device, help="torch device")
    ap.add_argument("--attention-backend", choices=("triton", "torch"), default=None,
                    help="attention kernels (default: by device)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's); 1 is steadiest on a busy host")
    ap.add_argument("--out-dir", default="bench/out/sweep", help="where sweep.csv, sweep.md, sweep.png go")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv: Sequence[str] | None = None, prog: str = "python -m mla_runtime.sweep") -> int:
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    try:
        model = resolve_model(args.model, args.revision)
        calibrated = bool(args.calibration_text or args.calibration_tokens)
        methods = args.methods or (("svd", "pca") if calibrated else ("svd",))
        cfg = SweepConfig(
            ranks=args.ranks, cache_dtypes=args.cache_dtypes, methods=methods, weights=args.weights,
            memory_budget=args.memory_budget, dtype=args.dtype, block_size=args.block_size, window=args.window,
            chunk=args.chunk, max_eval_tokens=args.max_eval_tokens,
            max_calibration_tokens=args.max_calibration_tokens, decode_batch=args.decode_batch,
            decode_context=args.decode_context, decode_steps=args.decode_steps, device=args.device,
            attention_backend=args.attention_backend)
        tokenizer = args.tokenizer or model
        eval_docs = _docs(args.eval_text, args.eval_tokens, tokenizer, "eval")
        if eval_docs is None:
            raise ValueError("give --eval-text or --eval-tokens")
        calib = _docs(args.calibration_text, args.calibration_tokens, tokenizer, "calibration")
        if args.eval_text and args.calibration_text and set(args.eval_text) & set(args.calibration_text):
            print("sweep: warning: calibration text overlaps the eval text; PCA will look better than it is",
                  file=sys.stderr)
        result = run_sweep(model, eval_docs, calib, cfg, progress=not args.no_progress)
    except ValueError as e:
        ap.error(str(e))
    written = write_reports(result, args.out_dir)
    print(markdown_table(result))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
