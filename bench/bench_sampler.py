"""What sampling costs a step at a real model's vocabulary: ``engine.sampler.sample`` against the textbook way (each
row sorted whole for top-k / top-p / min-p, then one exponential random number per vocabulary entry for the draw,
``argmax(p / E)``), both on the same logits, interleaved, in one process.

    python bench/bench_sampler.py                      # DeepSeek-V2's 102,400 and V3's 129,280 tokens, 1 / 8 / 32 rows
    python bench/bench_sampler.py --vocab 102400 --rows 8 --threads 2

The logits are ``N(0, sd²)`` per row: ``--sd 4`` (default) puts top-p 0.95's cut past the 1,024 largest, as a
random-weight model's flat rows do; ``--sd 8`` is a peaked row whose cut the candidates hold.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mla_runtime.engine.sampler import sample
from mla_runtime.sampling_params import SamplingParams

SETTINGS = {
    "greedy": SamplingParams(temperature=0),
    "temperature 1": SamplingParams(),
    "top_k 50": SamplingParams(top_k=50),
    "top_p 0.95": SamplingParams(top_p=0.95),
    "top_p 0.9, top_k 40": SamplingParams(top_p=0.9, top_k=40),
    "min_p 0.05": SamplingParams(min_p=0.05),
}


def textbook(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> list[int]:
    """The baseline: temperature, each whole row sorted for its cut, one exponential per vocabulary entry."""
    if p.greedy:
        return logits.argmax(dim=-1).tolist()
    x = logits / p.temperature
    values, order = x.sort(dim=-1, descending=True)
    probs = values.softmax(dim=-1)
    drop = (torch.arange(x.shape[-1]) >= (p.top_k if p.top_k > 0 else x.shape[-1])).expand(x.shape).clone()
    drop |= (probs.cumsum(dim=-1) - probs >= p.top_p) & (p.top_p < 1)
    drop |= probs < p.min_p * probs[:, :1]
    drop[:, 0] = False
    x = torch.empty_like(x).scatter_(1, order, values.masked_fill(drop, float("-inf")))
    noise = torch.empty_like(x).exponential_(generator=gen)
    return (x.softmax(dim=-1) / noise).argmax(dim=-1).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[102_400, 129_280])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sd", type=float, default=4.0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, logits N(0, {args.sd}²), median of "
          f"{args.rounds} interleaved calls")
    print("| vocab | rows | setting | sample ms | textbook ms | textbook ÷ sample |\n|---:|---:|---|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for vocab in args.vocab:
        for rows in args.rows:
            logits = torch.randn(rows, vocab, generator=g) * args.sd
            for name, p in SETTINGS.items():
                ours, base = [], []
                gen = torch.Generator().manual_seed(1)
                for _ in range(args.rounds + 1):  # the first of each is a warm-up
                    t = time.perf_counter()
                    sample(logits, [p] * rows, [None] * rows, gen)
                    ours.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    textbook(logits, p, gen)
                    base.append(time.perf_counter() - t)
                a, b = statistics.median(ours[1:]) * 1e3, statistics.median(base[1:]) * 1e3
                print(f"| {vocab} | {rows} | {name} | {a:.2f} | {b:.2f} | {b / a:.1f}× |")


if __name__ == "__main__":
    main()
