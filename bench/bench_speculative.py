"""Speculative decoding (prompt lookup, or the model's MTP layer): tokens/s with and without drafts, in one run.

    python bench/bench_speculative.py --batch 1 8 --num-speculative-tokens 0 2 4 8 [--temperature 0.7]
    python bench/bench_speculative.py --method mtp prompt_lookup --num-speculative-tokens 1 2 3 --batch 1 8

With ``--method``, every (method, k) and plain decoding get an engine each, loaded side by side, and the runs
alternate between them round by round (``--rounds``); the tables give medians. Per row: tokens/s and the
speed-up over plain decoding, for the whole run (prefill included) and for decoding alone (the time after every
request's first token, and the tokens generated in it), mean acceptance length (1 + accepted drafts per
verification step), accepted tokens per decode step, the acceptance at each draft position, and whether the
greedy tokens equal plain decoding's. With ``mtp`` it also prints the median time of one MTP draft link
(``Worker.draft`` per link) against one plain main-model step (``Worker.execute``) at batch 1.

Runs the same requests through one engine per draft budget ``k`` (``k = 0`` is plain decoding, the
baseline) and prints, per batch size and ``k``: output tokens/s (prefill included), engine steps, drafts
proposed and accepted, and the speed-up over ``k = 0``. Greedy outputs (the default) are checked to be
identical to the baseline's. Prompts are Python-like source text (``bench_serving.python_like_text``,
seeded), the kind of input that repeats itself; ``--model`` defaults to the embedded demo model.

``--step-cost`` measures instead what a verification step costs, whatever the model accepts: every decode
is given exactly ``k`` drafts (the proposer is replaced by one that always proposes ``k`` tokens), and the
median engine step (batch 1) is printed against the plain step. With acceptance ``a`` drafts per step a
step yields ``1 + a`` tokens, so speculation pays when ``1 + a`` exceeds that ratio.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from bench_serving import python_like_text

from mla_runtime import LLM, SamplingParams

DEMO_MODEL = Path(__file__).resolve().parent.parent / "mla_runtime" / "demo_model"


def run(model: str, dtype: str, prompts: list[str], k: int, max_tokens: int, batch: int, repeats: int,
        temperature: float):
    with LLM(model, dtype=dtype, max_model_len=1024, kv_cache_memory="256MiB", max_num_seqs=batch,
             num_speculative_tokens=k, enable_prefix_caching=False) as llm:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0, ignore_eos=True)
        llm.generate(prompts[:batch], SamplingParams(max_tokens=8, temperature=0))  # warm-up
        best, outs, counts = float("inf"), None, None
        for _ in range(repeats):
            engine = llm.engine
            start = (engine.counts.draft, engine.counts.accepted)
            steps = 0
            t0 = time.perf_counter()
            for i, p in enumerate(prompts[:batch]):
                engine.add_request(f"spec-{k}-{i}-{time.perf_counter_ns()}", p, params)
            finished = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                steps += 1
            elapsed = time.perf_counter() - t0
            if elapsed < best:
                best = elapsed
                outs = [o.outputs[0].token_ids for o in sorted(finished.values(), key=lambda o: o.request_id)]
                counts = (steps, engine.counts.draft - start[0], engine.counts.accepted - start[1])
        return batch * max_tokens / best, outs, counts


def step_cost(model: str, dtype: str, ks: list[int], steps: int = 24) -> None:
    from mla_runtime.engine import proposer

    loop = list(range(100, 116))
    proposer.propose = lambda tokens, k, longest, shortest: (loop * (k // 16 + 1))[:k]  # always k drafts
    print(f"model {model} ({dtype}), batch 1, k drafts forced at every decode: median decode step")
    print("| k | step ms | drafts per step | step ÷ plain step |")
    print("|---:|---:|---:|---:|")
    base = None
    for k in ks:
        with LLM(model, dtype=dtype, max_model_len=1024, kv_cache_memory="256MiB", max_num_seqs=1,
                 num_speculative_tokens=k, enable_prefix_caching=False) as llm:
            engine = llm.engine
            engine.add_request("cost", {"prompt_token_ids": loop * 8},
                               SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
            for _ in range(4):  # prefill and warm-up
                engine.step()
            times, drafts = [], engine.counts.draft
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            per_step = (engine.counts.draft - drafts) / steps
        ms = sorted(times)[len(times) // 2] * 1e3
        base = base or ms
        print(f"| {k} | {ms:.2f} | {per_step:.1f} | {ms / base:.2f}× |", flush=True)


def _engine_counts(engine) -> tuple:
    c = engine.counts
    return (c.spec_steps, c.accepted, c.generation, tuple(c.drafts_by_position), tuple(c.accepted_by_position))


def one_round(llm, prompts: list[str], params: SamplingParams, tag: str) -> dict:
    """One batch of requests through ``llm``: seconds, tokens, engine steps and speculative counts."""
    engine = llm.engine
    before = _engine_counts(engine)
    steps, finished, first = 0, {}, {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}-{time.perf_counter_ns()}", p, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter()
            if out.finished:
                finished[out.request_id] = out
        steps += 1
    seconds = time.perf_counter() - t0
    decode_seconds = seconds - (max(first.values()) - t0)  # after every request's first token: decoding only
    after = _engine_counts(engine)
    outs = [o.outputs[0].token_ids for o in sorted(finished.values(), key=lambda o: o.request_id)]
    return {"seconds": seconds, "decode_seconds": decode_seconds, "steps": steps, "outs": outs,
            "verify": after[0] - before[0],
            "accepted": after[1] - before[1], "tokens": after[2] - before[2],
            "drafts_pos": [a - b for a, b in zip(after[3], before[3])],
            "accepted_pos": [a - b for a, b in zip(after[4], before[4])]}


class Timed:
    """Wraps ``Worker.execute`` / ``Worker.draft`` of one engine to record their wall times."""

    def __init__(self, worker) -> None:
        self.execute: list[float] = []
        self.draft: list[tuple[float, int]] = []  # (seconds, chain links)
        execute, draft = worker.execute, worker.draft

        def timed_execute(step):
            t0 = time.perf_counter()
            out = execute(step)
            self.execute.append(time.perf_counter() - t0)
            return out

        def timed_draft(d):
            t0 = time.perf_counter()
            out = draft(d)
            self.draft.append((time.perf_counter() - t0, max(map(len, out), default=0)))
            return out

        worker.execute, worker.draft = timed_execute, timed_draft


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def compare_methods(args, prompts: list[str]) -> None:
    """Every (method, k) against plain decoding, engines loaded side by side, rounds alternating."""
    configs = [("plain", 0)] + [(m, k) for m in args.method for k in sorted(set(args.num_speculative_tokens)) if k]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0, ignore_eos=True)
    print(f"model {args.model} ({args.dtype}), {args.max_tokens} tokens per prompt at temperature "
          f"{args.temperature:g}, median of {args.rounds} alternating rounds")
    for batch in args.batch:
        llms, timers = {}, {}
        for method, k in configs:
            kw = {} if method == "plain" else {"speculative_method": method, "num_speculative_tokens": k}
            llms[(method, k)] = LLM(args.model, dtype=args.dtype, max_model_len=1024, kv_cache_memory="32MiB",
                                    max_num_seqs=batch, enable_prefix_caching=False, **kw)
            llms[(method, k)].generate(prompts[:batch], SamplingParams(max_tokens=8, temperature=0))  # warm-up
            timers[(method, k)] = Timed(llms[(method, k)].engine.worker)
        rounds: dict = {c: [] for c in configs}
        for r in range(args.rounds):
            for c in configs:
                rounds[c].append(one_round(llms[c], prompts[:batch], params, f"{c[0]}{c[1]}-{r}"))
        print(f"\nbatch {batch}\n")
        print("| method | k | tok/s | speed-up | decode tok/s | decode speed-up | acceptance length | tokens/step "
              "| acceptance by position | same tokens |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
        base = median([x["seconds"] for x in rounds[("plain", 0)]])
        base_decode = median([x["decode_seconds"] for x in rounds[("plain", 0)]])
        base_outs = rounds[("plain", 0)][0]["outs"]
        for c in configs:
            xs = rounds[c]
            sec = median([x["seconds"] for x in xs])
            dec = median([x["decode_seconds"] for x in xs])
            verify, accepted = sum(x["verify"] for x in xs), sum(x["accepted"] for x in xs)
            length = f"{1 + accepted / verify:.2f}" if verify else "-"
            per_step = sum(x["tokens"] for x in xs) / sum(x["steps"] for x in xs)
            pos_d = [sum(v) for v in zip(*[x["drafts_pos"] for x in xs])]
            pos_a = [sum(v) for v in zip(*[x["accepted_pos"] for x in xs])]
            by_pos = " / ".join(f"{a / d:.0%}" for a, d in zip(pos_a, pos_d) if d) or "-"
            print(f"| {c[0]} | {c[1]} | {batch * args.max_tokens / sec:.1f} | {base / sec:.2f}× | "
                  f"{batch * (args.max_tokens - 1) / dec:.1f} | {base_decode / dec:.2f}× | {length} | {per_step:.2f} | "
                  f"{by_pos} | {same(xs[0]['outs'], base_outs, args.temperature)} |", flush=True)
        if batch == 1 and ("mtp", 1) in timers:
            main_step = median(timers[("plain", 0)].execute[-args.rounds * args.max_tokens:])
            links = [t / n for t, n in timers[("mtp", 1)].draft if n == 1]
            verify_step = median(timers[("mtp", 1)].execute)
            print(f"\ncost at batch 1: plain main-model step {main_step * 1e3:.2f} ms; verification step with 1 draft "
                  f"{verify_step * 1e3:.2f} ms ({verify_step / main_step:.2f}×); one MTP draft step "
                  f"{median(links) * 1e3:.2f} ms ({median(links) / main_step:.2f}× a main step)", flush=True)
        for llm in llms.values():
            llm.shutdown()


def same(outs, base_outs, temperature: float) -> str:
    if temperature > 0:
        return "- (sampled)"
    return "yes" if outs == base_outs else "NO"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[0, 2, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-lines", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--step-cost", action="store_true", help="time a verification step against a plain one")
    ap.add_argument("--method", nargs="+", choices=["mtp", "prompt_lookup"], default=None,
                    help="compare these speculative methods (alternating rounds, medians) instead of the k sweep")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per engine with --method")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.step_cost:
        step_cost(args.model, args.dtype, sorted(set(args.num_speculative_tokens) | {0}))
        return
    rng = random.Random(0)
    prompts = [python_like_text(rng, args.prompt_lines) for _ in range(max(args.batch))]
    if args.method:
        compare_methods(args, prompts)
        return
    ks = sorted(set(args.num_speculative_tokens) | {0})
    print(f"model {args.model} ({args.dtype}), {args.max_tokens} tokens per prompt at temperature "
          f"{args.temperature:g}, best of {args.repeats}")
    print("| batch | k | tok/s | steps | drafts | accepted | acceptance | speed-up vs k=0 | same tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for batch in args.batch:
        base_rate, base_outs = None, None
        for k in ks:
            rate, outs, (steps, drafts, accepted) = run(args.model, args.dtype, prompts, k, args.max_tokens, batch,
                                                        args.repeats, args.temperature)
            if k == 0:
                base_rate, base_outs = rate, outs
            share = f"{accepted / drafts:.0%}" if drafts else "-"
            print(f"| {batch} | {k} | {rate:.1f} | {steps} | {drafts} | {accepted} | {share} | "
                  f"{rate / base_rate:.2f}× | {same(outs, base_outs, args.temperature)} |", flush=True)


if __name__ == "__main__":
    main()
