"""Load generator for the HTTP server: latency percentiles, throughput, errors, and soak drift.

Examples (server started with ``python server.py``):

    python bench/bench_serving.py --num-requests 200 --rate 4            # Poisson arrivals, 4 req/s
    python bench/bench_serving.py --num-requests 200 --concurrency 16    # 16 requests always in flight
    python bench/bench_serving.py --duration 600 --rate 2                # soak: RSS / cache drift over time
    python bench/bench_serving.py --multi-turn 5 --prompt-len 1500       # turn-2 TTFT vs turn-1 (prefix reuse)
    python bench/bench_serving.py --replicas 2 --sessions 16 --turns 4   # Ray Serve replicas: round robin vs affinity

Requests stream from ``POST /generate`` (one SSE event per token, so TTFT and TPOT are exact) or from the
OpenAI ``/v1/completions`` route (``--endpoint completions``, to compare with other servers). Prompts are
seeded: Python-like text from a fixed vocabulary, tokenized by ``--tokenizer`` (default: the demo model's)
and cut to a length drawn uniformly from ``prompt_len × [1 - range, 1 + range]``; output lengths likewise,
with ``ignore_eos`` so each request generates exactly its drawn length. Metrics:

- TTFT: request sent → first token event; TPOT: (end − first token) / (tokens − 1); E2E: sent → last event.
- Soak (``--duration``): every ``--sample-every`` s the server's ``/metrics`` is read (RSS, latent-cache
  usage, blocks used, blocks freed by the cache-pressure policy) and appended to ``PREFIX.csv`` as it goes
  (``--out PREFIX``; the summary goes to ``PREFIX.txt``, the plot to ``PREFIX.png``). Drift = median of the
  last 20% of the samples taken after ``--warmup`` s vs the median of their first 20% (the seeds ask for
  <= 5%); slopes = least-squares RSS growth per 1,000 requests over the first and the last third of those
  samples (growth that levels off has a last-third slope <= 1/3 of the first's). After the load the cache
  must be empty again (``mla_latent_cache_blocks_used == 0``). ``--analyze PREFIX.csv`` recomputes the
  figures and the plot from a series, also from a run stopped early.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

DEMO_MODEL = Path(__file__).resolve().parent.parent / "mla_runtime" / "demo_model"
WORDS = ("def class return import self value items count name path data result index key list dict "
         "for in if else while with open try except raise None True False len range print yield lambda "
         "append update get set sorted os sys json time args kwargs config").split()


# -- workload ---------------------------------------------------------------------------------------
def python_like_text(rng: random.Random, n_lines: int) -> str:
    lines = []
    for i in range(n_lines):
        a, b, c = rng.sample(WORDS, 3)
        lines.append(rng.choice([f"def {a}_{i}({b}, {c}):", f"    {a} = {b}.{c}({i})", f"    return {a} + {b}",
                                 f"class {a.title()}{i}:", f"    if {a} in {b}:", f"        {c}.append({a})",
                                 f"import {a}", f"    for {a} in {b}:"]))
    return "\n".join(lines) + "\n"


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(args: argparse.Namespace, n: int) -> Workload:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    rng = random.Random(args.seed)

    def draw(mean: int) -> int:
        lo, hi = max(1, round(mean * (1 - args.range))), max(1, round(mean * (1 + args.range)))
        return rng.randint(lo, hi)

    prompts, outs = [], []
    for _ in range(n):
        length = draw(args.prompt_len)
        ids: list[int] = []
        while len(ids) < length:
            ids += tok.encode(python_like_text(rng, 8 + length // 6), add_special_tokens=False)
        prompts.append(ids[:length])
        outs.append(draw(args.output_len))
    return Workload(prompts, outs)


# -- one request ------------------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool
    status: int = 0
    error: str = ""
    ttft: float | None = None
    tpot: float | None = None
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


async def stream_request(client: httpx.AsyncClient, args: argparse.Namespace, prompt: Any, max_tokens: int,
                         endpoint: str | None = None, messages: list | None = None) -> tuple[Result, str]:
    """Send one streaming request; return its timings and generated text."""
    endpoint = endpoint or args.endpoint
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True}
    if endpoint == "generate":
        path, body["prompt"] = "/generate", prompt
    elif endpoint == "completions":
        path = "/v1/completions"
        body.update(prompt=prompt, model=args.model, stream_options={"include_usage": True})
    else:
        path = "/v1/chat/completions"
        body.update(messages=messages, model=args.model, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    first = last = None
    tokens, text = 0, []
    res = Result(ok=False)
    try:
        async with client.stream("POST", path, json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode(errors="replace")[:200]
                return res, ""
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = event["error"]["message"]
                    return res, ""
                first = first or now
                last = now
                if endpoint == "generate":
                    tokens += len(event["token_ids"])
                    text.append(event["text"])
                    usage = event.get("usage")
                else:
                    for c in event.get("choices", []):
                        text.append(c.get("text") or c.get("delta", {}).get("content") or "")
                    usage = event.get("usage")
                if usage:
                    res.prompt_tokens = usage["prompt_tokens"]
                    tokens = usage["completion_tokens"]
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res, ""
    res.ok, res.e2e, res.output_tokens = True, time.perf_counter() - t0, tokens
    if first is not None:
        res.ttft = first - t0
        if tokens > 1 and last is not None:
            res.tpot = (last - first) / (tokens - 1)
    return res, "".join(text)


# -- load modes -------------------------------------------------------------------------------------
SERIES = (("rss", "process_resident_memory_bytes"), ("cache", "mla_latent_cache_usage_ratio"),
          ("blocks_used", "mla_latent_cache_blocks_used"),
          ("cached_free_blocks", "mla_prefix_cache_idle_blocks"),
          ("pressure_freed", "mla_cache_pressure_freed_blocks_total"))


@dataclass
class Samples:
    """The soak's time series, one row per /metrics sample; ``requests`` counts requests answered so far."""
    t: list[float] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    columns: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k, _ in SERIES})

    @property
    def rss(self) -> list[float]:
        return self.columns["rss"]

    @property
    def cache(self) -> list[float]:
        return self.columns["cache"]

    def add(self, t: float, requests: int, metrics: dict[str, float]) -> list[float]:
        self.t.append(t)
        self.requests.append(requests)
        row = [t, float(requests)]
        for key, name in SERIES:
            self.columns[key].append(metrics.get(name, float("nan")))
            row.append(self.columns[key][-1])
        return row

    @classmethod
    def read_csv(cls, path: Path) -> Samples:
        samples = cls()
        with open(path, newline="") as f:
            for rec in csv.DictReader(f):
                samples.add(float(rec["t"]), int(float(rec["requests"])),
                            {name: float(rec[key]) for key, name in SERIES if rec.get(key) not in (None, "")})
        return samples


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


async def sampler(client: httpx.AsyncClient, every: float, samples: Samples, stop: asyncio.Event,
                  done: list, csv_path: Path | None) -> None:
    """Sample /metrics every ``every`` s until ``stop``; each row is flushed to ``csv_path`` at once."""
    t0 = time.perf_counter()
    f = open(csv_path, "w", newline="") if csv_path else None
    writer = csv.writer(f) if f else None
    if writer:
        writer.writerow(["t", "requests"] + [k for k, _ in SERIES])
    try:
        while not stop.is_set():
            row = samples.add(time.perf_counter() - t0, len(done), await scrape(client))
            if writer and f:
                writer.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in row])
                f.flush()
            try:
                await asyncio.wait_for(stop.wait(), every)
            except TimeoutError:
                pass
    finally:
        if f:
            f.close()


async def run_load(args: argparse.Namespace) -> int:
    n = args.num_requests or (100_000 if args.duration else 100)
    work = make_workload(args, min(n, args.pool))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    rng = random.Random(args.seed + 1)
    results: list[Result] = []
    samples, stop = Samples(), asyncio.Event()
    sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, headers=headers,
                                 limits=limits) as client:
        await wait_ready(client)
        before = await scrape(client)
        bar = tqdm(total=args.duration or n, unit="s" if args.duration else "req", file=sys.stderr,
                   bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} [{elapsed}<{remaining}]")
        csv_path = Path(f"{args.out}.csv") if args.out else None
        watcher = (asyncio.create_task(sampler(client, args.sample_every, samples, stop, results, csv_path))
                   if args.duration else None)

        async def one(i: int) -> None:
            k = i % len(work.prompts)
            try:
                res, _ = await stream_request(client, args, work.prompts[k], work.output_lens[k])
            finally:
                if sem:
                    sem.release()
            results.append(res)
            if not args.duration:
                bar.update(1)

        t0 = time.perf_counter()
        tasks: list[asyncio.Task] = []
        for i in range(n):
            if args.duration and time.perf_counter() - t0 >= args.duration:
                break
            if sem:
                await sem.acquire()  # fixed concurrency: the next request starts when one finishes
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(rng.expovariate(args.rate) if args.rate != float("inf") else 0)
            if args.duration:
                bar.n = min(args.duration, time.perf_counter() - t0)
                bar.refresh()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
        stop.set()
        if watcher:
            await watcher
        bar.close()
        after = await scrape(client)
    with Tee(Path(f"{args.out}.txt") if args.out else None):
        report(args, results, elapsed, before, after, samples)
    if samples.t and args.out:
        plot(samples, Path(f"{args.out}.png"), soak_warmup(args))
    return 0 if all(r.ok for r in results) else 1


async def wait_ready(client: httpx.AsyncClient, timeout: float = 300.0) -> None:
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        try:
            if (await client.get("/ready")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.5)
    raise SystemExit(f"{client.base_url} is not ready after {timeout:.0f} s")


# -- reporting --------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def drift(times: list[float], values: list[float], warmup: float) -> float:
    """Median of the last 20% of the samples taken after ``warmup`` s vs the median of their first 20%."""
    kept = [v for t, v in zip(times, values) if t >= warmup]
    if len(kept) < 5:
        return float("nan")
    k = max(1, len(kept) // 5)
    first, last = statistics.median(kept[:k]), statistics.median(kept[-k:])
    return (last - first) / first if first else float("nan")


def thirds_slopes(samples: Samples, warmup: float) -> tuple[float, float]:
    """Least-squares RSS slope (MiB per 1,000 requests) over the first and the last third of the samples
    taken after ``warmup`` s."""
    kept = [(float(n), v / 2**20) for t, n, v in zip(samples.t, samples.requests, samples.rss) if t >= warmup]
    k = len(kept) // 3
    if k < 3:
        return float("nan"), float("nan")

    def slope(part: list[tuple[float, float]]) -> float:
        xs, ys = zip(*part)
        if len(set(xs)) < 2:
            return float("nan")
        return statistics.linear_regression(xs, ys).slope * 1000

    return slope(kept[:k]), slope(kept[-k:])


def soak_warmup(args: argparse.Namespace) -> float:
    return args.warmup if args.warmup is not None else 0.1 * (args.duration or 0)


def soak_report(samples: Samples, warmup: float) -> None:
    rss_drift = drift(samples.t, samples.rss, warmup)
    first, last = thirds_slopes(samples, warmup)
    kept = sum(t >= warmup for t in samples.t)
    print(f"{'soak samples':<28}{len(samples.t)} over {samples.t[-1]:.0f} s, {samples.requests[-1]} requests "
          f"({kept} after the {warmup:.0f} s warm-up)")
    print(f"{'RSS first/last (MiB)':<28}{samples.rss[0] / 2**20:.1f} / {samples.rss[-1] / 2**20:.1f}")
    print(f"{'RSS drift':<28}{rss_drift:+.2%}  ({'OK' if abs(rss_drift) <= 0.05 else 'ABOVE'} the 5% bound)")
    if first > 0:
        verdict = f"last/first {last / first:.2f}: " + ("levels off" if last <= first / 3 else "does NOT level off")
    else:
        verdict = "no growth in the first third" + ("" if last <= 0 else ", but growth in the last")
    print(f"{'RSS slope first/last third':<28}{first:+.3f} / {last:+.3f} MiB per 1k requests ({verdict})")
    print(f"{'cache usage mean/max':<28}{statistics.fmean(samples.cache):.1%} / {max(samples.cache):.1%}")
    freed = [v for v in samples.columns["pressure_freed"] if v == v]
    if freed:
        print(f"{'blocks freed by pressure':<28}{freed[-1] - freed[0]:.0f}")


class Tee:
    """Within the block, what is printed also goes to ``path`` (the summary next to the soak's CSV)."""

    def __init__(self, path: Path | None) -> None:
        self.path, self.lines = path, []  # type: ignore[var-annotated]
        self.stdout = sys.stdout

    def write(self, text: str) -> int:
        self.lines.append(text)
        return self.stdout.write(text)

    def flush(self) -> None:
        self.stdout.flush()

    def __enter__(self) -> Tee:
        sys.stdout = self  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stdout = self.stdout
        if self.path:
            self.path.write_text("".join(self.lines))


def plot(samples: Samples, path: Path, warmup: float) -> None:
    """RSS and latent-cache usage against requests answered; the warm-up shaded."""
    try:
        import matplotlib
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(samples.requests, [v / 2**20 for v in samples.rss], lw=1)
    ax1.set_ylabel("RSS (MiB)")
    ax2.plot(samples.requests, [100 * v for v in samples.cache], lw=0.8, label="latent cache used %")
    ax2.set_ylabel("latent cache used (%)")
    ax2.set_xlabel("requests answered")
    warm = [n for t, n in zip(samples.t, samples.requests) if t < warmup]
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if warm:
            ax.axvspan(0, warm[-1], color="0.9", label="warm-up")
    ax1.set_title(f"soak: {samples.requests[-1]} requests over {samples.t[-1] / 60:.0f} min")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")


def report(args: argparse.Namespace, results: list[Result], elapsed: float, before: dict, after: dict,
           samples: Samples) -> None:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = f"{r.status or 'transport'}: {r.error[:80]}"
            errors[key] = errors.get(key, 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    mode = f"rate {args.rate:g}/s (Poisson)" if args.rate != float("inf") else "all at once"
    if args.concurrency:
        mode = f"concurrency {args.concurrency}"
    print(f"\n== bench_serving: {len(results)} requests, {mode}, endpoint {args.endpoint}, "
          f"prompt {args.prompt_len}±{args.range:.0%} tokens, output {args.output_len}±{args.range:.0%} tokens ==")
    print(f"{'succeeded':<28}{len(ok)}")
    print(f"{'errors':<28}{len(results) - len(ok)}" + "".join(f"\n  {k}: {v}" for k, v in errors.items()))
    print(f"{'duration (s)':<28}{elapsed:.2f}")
    print(f"{'request throughput (req/s)':<28}{len(ok) / elapsed:.2f}")
    print(f"{'output throughput (tok/s)':<28}{out_tokens / elapsed:.1f}")
    if prompt_tokens:
        print(f"{'total throughput (tok/s)':<28}{(out_tokens + prompt_tokens) / elapsed:.1f}")
    print(f"{'metric (ms)':<28}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name, vals in (("TTFT", [r.ttft for r in ok if r.ttft is not None]),
                       ("TPOT", [r.tpot for r in ok if r.tpot is not None]),
                       ("E2E", [r.e2e for r in ok])):
        if vals:
            ms = [v * 1e3 for v in vals]
            print(f"{name:<28}{statistics.fmean(ms):>10.1f}{pct(ms, 50):>10.1f}{pct(ms, 90):>10.1f}"
                  f"{pct(ms, 99):>10.1f}")
    hits = after.get("mla_prefix_cache_hits_tokens_total", 0) - before.get("mla_prefix_cache_hits_tokens_total", 0)
    queried = (after.get("mla_prefix_cache_queries_tokens_total", 0)
               - before.get("mla_prefix_cache_queries_tokens_total", 0))
    if queried:
        print(f"{'prefix-cache hit rate':<28}{hits / queried:.1%}")
    pre = after.get("mla_preemptions_total", 0) - before.get("mla_preemptions_total", 0)
    print(f"{'preemptions':<28}{pre:.0f}")
    print(f"{'cache blocks used after':<28}{after.get('mla_latent_cache_blocks_used', float('nan')):.0f}")
    if samples.t:
        soak_report(samples, soak_warmup(args))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": [r.__dict__ for r in results], "elapsed": elapsed,
                                               "samples": samples.__dict__}, indent=1))


# -- multi-turn prefix reuse ------------------------------------------------------------------------
async def run_multi_turn(args: argparse.Namespace) -> int:
    """Sequential two-turn chats: turn 2 repeats turn 1 (+ the reply) and should reuse its cached prefix."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows = []
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, headers=headers) as client:
        await wait_ready(client)
        for _ in tqdm(range(args.multi_turn), desc="conversations", file=sys.stderr):
            ids = tok.encode(python_like_text(rng, args.prompt_len // 4), add_special_tokens=False)
            while len(ids) < args.prompt_len:
                ids += tok.encode(python_like_text(rng, 20), add_special_tokens=False)
            first = [{"role": "user", "content": tok.decode(ids[:args.prompt_len])}]
            r1, reply = await stream_request(client, args, None, args.output_len, "chat", first)
            second = first + [{"role": "assistant", "content": reply},
                              {"role": "user", "content": python_like_text(rng, 2)}]
            r2, _ = await stream_request(client, args, None, args.output_len, "chat", second)
            if not (r1.ok and r2.ok):
                print(f"error: {r1.error or r2.error}", file=sys.stderr)
                return 1
            rows.append((r1, r2))
    print(f"\n== multi-turn prefix reuse: {len(rows)} conversations, turn-1 prompt ~{args.prompt_len} tokens, "
          f"{args.output_len} output tokens ==")
    print(f"{'turn':<8}{'prompt tok':>12}{'cached tok':>12}{'TTFT mean ms':>14}{'TTFT p50 ms':>13}")
    for turn in (0, 1):
        rs = [row[turn] for row in rows]
        ttfts = [r.ttft * 1e3 for r in rs if r.ttft is not None]
        print(f"{turn + 1:<8}{statistics.fmean(r.prompt_tokens for r in rs):>12.0f}"
              f"{statistics.fmean(r.cached_tokens for r in rs):>12.0f}{statistics.fmean(ttfts):>14.1f}"
              f"{pct(ttfts, 50):>13.1f}")
    ratio = statistics.median(r2.ttft / r1.ttft for r1, r2 in rows if r1.ttft and r2.ttft)
    print(f"turn-2 / turn-1 TTFT (median of per-conversation ratios): {ratio:.2f}")
    return 0


# -- replicas: round robin vs affinity routing -----------------------------------------------------
async def run_conversations(args: argparse.Namespace, base_url: str, tok: Any) -> list[tuple[int, Result]]:
    """``--sessions`` chats of ``--turns`` turns, interleaved: every chat's turn t (in a seeded random order, at most
    ``--concurrency`` at once) before any turn t + 1. Each turn resends the whole chat, so its prefix is cached
    wherever the previous turn ran. No session id is sent: only the prompt's prefix can steer the router."""
    rng = random.Random(args.seed)
    chats: list[list[dict[str, str]]] = []
    for _ in range(args.sessions):
        ids = tok.encode(python_like_text(rng, args.prompt_len // 4), add_special_tokens=False)
        while len(ids) < args.prompt_len:
            ids += tok.encode(python_like_text(rng, 20), add_special_tokens=False)
        chats.append([{"role": "user", "content": tok.decode(ids[:args.prompt_len])}])
    rows: list[tuple[int, Result]] = []
    slots = asyncio.Semaphore(max(1, args.concurrency))
    async with httpx.AsyncClient(base_url=base_url, timeout=args.timeout) as client:
        async def turn(t: int, chat: list[dict[str, str]]) -> None:
            async with slots:
                res, reply = await stream_request(client, args, None, args.output_len, "chat", chat)
            if not res.ok:
                raise RuntimeError(f"request failed: {res.status} {res.error}")
            rows.append((t, res))
            chat += [{"role": "assistant", "content": reply}, {"role": "user", "content": python_like_text(rng, 2)}]

        for t in range(args.turns):
            order = list(range(args.sessions))
            rng.shuffle(order)
            await asyncio.gather(*(turn(t, chats[i]) for i in order))
    return rows


def replica_hit_tokens(text: str) -> tuple[float, float]:
    """(prefix-cache hit tokens, looked-up tokens), summed over the replicas' series."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = {"mla_prefix_cache_hits_tokens_total": 0.0, "mla_prefix_cache_queries_tokens_total": 0.0}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums["mla_prefix_cache_hits_tokens_total"], sums["mla_prefix_cache_queries_tokens_total"]


def run_replicas(args: argparse.Namespace) -> int:
    """Deploy ``--replicas`` replicas on a local Ray, once per router and round (round robin, affinity, round robin,
    ...: fresh replicas and caches each time), run the same multi-turn workload, compare hit rate and TTFT."""
    import socket

    from ray import serve
    from transformers import AutoTokenizer

    from mla_runtime.engine.config import EngineConfig
    from mla_runtime.serving import ray_replicas
    from mla_runtime.serving.config import ReplicaConfig, ServerConfig

    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = EngineConfig(model=args.replica_model, dtype="float32", max_model_len=args.max_model_len, block_size=16,
                          kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(4, args.concurrency))
    config = ServerConfig(port=port, served_model_name="demo", request_timeout=args.timeout)
    started = ray_replicas.start_ray(ReplicaConfig(replicas=args.replicas))
    table: dict[str, list[tuple[float, float, float]]] = {"round_robin": [], "affinity": []}
    try:
        for _ in range(args.rounds):
            for router in table:
                ray_replicas.deploy(engine, config, ReplicaConfig(
                    replicas=args.replicas, router=router, affinity_queue_threshold=args.affinity_queue_threshold))
                rows = asyncio.run(run_conversations(args, f"http://127.0.0.1:{port}", tok))
                hits, queries = replica_hit_tokens(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
                later = [r.ttft * 1e3 for t, r in rows if t > 0 and r.ttft is not None]
                table[router].append((hits / max(queries, 1), statistics.median(later), pct(later, 90)))
                print(f"{router:<12} hit rate {hits / max(queries, 1):.3f}  TTFT turns 2+ p50 "
                      f"{statistics.median(later):.1f} ms p90 {pct(later, 90):.1f} ms", file=sys.stderr)
                serve.delete(ray_replicas.APP_NAME)
    finally:
        serve.shutdown()
        if started:
            import ray

            ray.shutdown()
    report_replicas(args, table)
    return 0


def report_replicas(args: argparse.Namespace, table: dict[str, list[tuple[float, float, float]]]) -> None:
    print(f"\n== {args.replicas} replicas, {args.sessions} chats x {args.turns} turns, first prompt ~{args.prompt_len} "
          f"tokens, {args.output_len} output tokens, concurrency {args.concurrency}, {args.rounds} round(s), "
          f"affinity queue threshold {args.affinity_queue_threshold} ==")
    print(f"{'router':<14}{'hit rate':>10}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}   (turns 2+, median over rounds)")
    med = {}
    for router, runs in table.items():
        med[router] = [statistics.median(col) for col in zip(*runs)]
        print(f"{router:<14}{med[router][0]:>10.3f}{med[router][1]:>13.1f}{med[router][2]:>13.1f}")
    rr, aff = med["round_robin"], med["affinity"]
    print(f"affinity / round robin: hit rate {aff[0] / max(rr[0], 1e-9):.2f}x, TTFT p50 {aff[1] / rr[1]:.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=("generate", "completions"), default="generate")
    p.add_argument("--model", default=None, help="model id sent to the OpenAI routes (default: the server's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=str(DEMO_MODEL), help="tokenizer folder used to build exact-length prompts")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests to send (default 100; with --duration: no limit but the time)")
    p.add_argument("--rate", type=float, default=float("inf"), help="Poisson arrival rate, requests/s")
    p.add_argument("--concurrency", type=int, default=0, help="fixed number of requests in flight (0: off)")
    p.add_argument("--duration", type=float, default=0.0, help="soak mode: keep sending for this many seconds")
    p.add_argument("--sample-every", type=float, default=2.0, help="soak: seconds between /metrics samples")
    p.add_argument("--warmup", type=float, default=None, help="soak: seconds excluded from the drift "
                                                              "(default: 10%% of --duration)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range", type=float, default=0.5, help="lengths drawn from mean × [1 - range, 1 + range]")
    p.add_argument("--pool", type=int, default=512, help="distinct prompts (reused round-robin beyond)")
    p.add_argument("--multi-turn", type=int, default=0, help="run N two-turn chats and compare their TTFT")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write every request's numbers to this file")
    p.add_argument("--replicas", type=int, default=0, help="start a local Ray Serve with N replicas of --replica-model "
                   "and compare round robin with affinity routing on a multi-turn workload")
    p.add_argument("--replica-model", default=str(DEMO_MODEL))
    p.add_argument("--sessions", type=int, default=16, help="replicas: chats")
    p.add_argument("--turns", type=int, default=4, help="replicas: turns per chat")
    p.add_argument("--rounds", type=int, default=2, help="replicas: deployments per router (alternating)")
    p.add_argument("--max-model-len", type=int, default=1024, help="replicas: each replica's context limit")
    p.add_argument("--kv-cache-memory", default="9MiB", help="replicas: each replica's latent cache")
    p.add_argument("--affinity-queue-threshold", type=int, default=None,
                   help="replicas: ongoing requests beyond which affinity falls back to the least loaded")
    p.add_argument("--out", default=None, help="soak: write PREFIX.csv (series), PREFIX.txt (summary), PREFIX.png "
                                               "(default with --duration: bench/out/soak/soak-<UTC time>)")
    p.add_argument("--analyze", default=None, metavar="CSV", help="print the soak figures and plot of a series")
    args = p.parse_args(argv)
    if args.replicas:
        return run_replicas(args)
    if args.analyze:
        samples = Samples.read_csv(Path(args.analyze))
        warmup = args.warmup if args.warmup is not None else 0.1 * samples.t[-1]
        soak_report(samples, warmup)
        plot(samples, Path(args.analyze).with_suffix(".png"), warmup)
        return 0
    if args.duration and not args.out:
        args.out = str(Path(__file__).parent / "out" / "soak" / time.strftime("soak-%Y%m%d-%H%M%S", time.gmtime()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.duration and not args.concurrency and args.rate == float("inf"):
        p.error("--duration needs --rate or --concurrency (otherwise requests would be started without bound)")
    if args.multi_turn:
        return asyncio.run(run_multi_turn(args))
    return asyncio.run(run_load(args))


if __name__ == "__main__":
    sys.exit(main())
