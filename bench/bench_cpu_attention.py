"""The compiled absorbed decode attention (``mla_kernels::absorbed_decode``) alone, each variant side by side.

    python bench/bench_cpu_attention.py                       # 1, 8, 32 rows; 128 and 512 keys a row
    python bench/bench_cpu_attention.py --rows 8 --keys 4096 --rounds 9

One call is a layer's decode attention for ``rows`` query rows (each with its own ``keys`` cached latents): the
absorption into the latent, the scores over the paged cache, the softmax, the weighted sum and the up-projection,
at the benchmark checkpoint's shapes by default (16 heads, d_n = d_r = d_v = 64, d_c = 512, float32 factors). For
each shape every variant this CPU executes runs in turn within each round (interleaved, so that the machine's load
falls on all alike); the table has the median time a call and the arithmetic rate it implies (two FLOPs a
multiply-add of the four stages), with each variant's time as a fraction of the AVX2 one's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from compare_peers import machine_description

from mla_kernels import cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--keys", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dims", type=int, nargs=4, default=[64, 64, 512, 64], metavar=("D_N", "D_R", "D_C", "D_V"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=5, help="calls a round")
    args = ap.parse_args()
    why = cpu_kernels.failure()
    if why is not None:
        raise SystemExit(f"the compiled CPU kernels do not run here: {why}")
    torch.set_num_threads(args.threads)
    variants = cpu_kernels.variants("float")
    d_n, d_r, d_c, d_v = args.dims
    h = args.heads
    g = torch.Generator().manual_seed(0)
    w_uk, w_uv_t = torch.randn(h, d_n, d_c, generator=g) * 0.05, torch.randn(h, d_c, d_v, generator=g) * 0.05
    print(f"# {machine_description()}; torch {torch.__version__}, {args.threads} threads, "
          f"{h} heads, d_n {d_n}, d_r {d_r}, d_c {d_c}, d_v {d_v}; medians of {args.rounds} interleaved rounds")
    print("| rows | keys a row | " + " | ".join(f"{v} ms | {v} GFLOP/s" for v in variants)
          + " | " + " | ".join(f"{v} ÷ avx2" for v in variants[1:]) + " |")
    print("|---:|---:|" + "---:|" * (2 * len(variants) + len(variants) - 1))
    for rows in args.rows:
        for keys in args.keys:
            cache = torch.randn(rows * keys + 16, d_c + d_r, generator=g)
            slots = torch.arange(rows * keys).view(rows, keys)
            lens = torch.full((rows,), keys, dtype=torch.int64)
            q_n, q_r = torch.randn(rows, h, d_n, generator=g), torch.randn(rows, h, d_r, generator=g)
            times: dict[str, list[float]] = {v: [] for v in variants}
            for v in variants:  # warm-up
                cpu_kernels.ops().absorbed_decode(q_n, q_r, w_uk, w_uv_t, cache, slots, lens, 0.1, v)
            for _ in range(args.rounds):
                for v in variants:
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        cpu_kernels.ops().absorbed_decode(q_n, q_r, w_uk, w_uv_t, cache, slots, lens, 0.1, v)
                    times[v].append((time.perf_counter() - t0) / args.calls)
            flops = 2 * rows * h * (d_n * d_c + keys * (d_c + d_r) + keys * d_c + d_c * d_v)
            med = {v: statistics.median(ts) for v, ts in times.items()}
            cells = [f"{med[v] * 1e3:.3f} | {flops / med[v] / 1e9:.0f}" for v in variants]
            ratios = [f"{med[v] / med[variants[0]]:.2f}" for v in variants[1:]]
            print(f"| {rows} | {keys} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
