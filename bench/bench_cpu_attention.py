"""The compiled absorbed decode attention (``mla_kernels::absorbed_decode``) alone, each variant side by side; with
``--prefill``, the compiled prefill attention (``mla_kernels::prefill_attention``) beside torch's flash kernel.

    python bench/bench_cpu_attention.py                       # 1, 8, 32 rows; 128 and 512 keys a row
    python bench/bench_cpu_attention.py --rows 8 --keys 4096 --rounds 9
    python bench/bench_cpu_attention.py --prefill             # prompts of 128, 512, 1024, 2048; 128 rows after 1920

With ``--prefill`` one call is a layer's up-projected attention of one chunk (``--chunks``: rows and keys, causal,
bottom-right aligned) over keys and values laid out as the model makes them (views of the up-projection), each
variant and ``flash`` (what float32 chunks ran before: torch's CPU flash kernel over the queries and keys
concatenated and the values zero-padded to one head size, ``mla_kernels.prefill``), with each variant's time as a
fraction of flash's.

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
    ap.add_argument("--prefill", action="store_true", help="the prefill attention instead of the decode one")
    ap.add_argument("--chunks", nargs="+", default=["128:128", "512:512", "1024:1024", "2048:2048", "128:2048"],
                    help="ROWS:KEYS of each prefill chunk")
    args = ap.parse_args()
    why = cpu_kernels.failure()
    if why is not None:
        raise SystemExit(f"the compiled CPU kernels do not run here: {why}")
    torch.set_num_threads(args.threads)
    variants = cpu_kernels.variants("float")
    if args.prefill:
        prefill(args, variants)
        return
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


def prefill(args: argparse.Namespace, variants: list[str]) -> None:
    from mla_kernels.prefill import _prefill_cpu_flash

    d_n, d_r, d_c, d_v = args.dims
    h = args.heads
    g = torch.Generator().manual_seed(0)
    print(f"# {machine_description()}; torch {torch.__version__}, {args.threads} threads, "
          f"{h} heads, d_n {d_n}, d_r {d_r}, d_v {d_v}; medians of {args.rounds} interleaved rounds")
    systems = ["flash", *variants]
    print("| rows | keys | " + " | ".join(f"{v} ms" for v in systems) + " | "
          + " | ".join(f"{v} ÷ flash" for v in variants) + " |")
    print("|---:|---:|" + "---:|" * (2 * len(systems) - 1))
    for chunk in args.chunks:
        rows, keys = (int(n) for n in chunk.split(":"))
        q_n, q_r = torch.randn(rows, h, d_n + d_r, generator=g).split([d_n, d_r], dim=-1)
        k_n, v = torch.randn(keys, h, d_n + d_v, generator=g).split([d_n, d_v], dim=-1)
        k_r = torch.randn(keys, d_c + d_r, generator=g)[:, d_c:]  # a view of the gathered latent rows
        scale = (d_n + d_r) ** -0.5
        a = (q_n, q_r, k_n, k_r, v, [0, rows], [0, keys], scale)
        calls = {"flash": lambda a=a: _prefill_cpu_flash(*a)}
        for name in variants:
            calls[name] = lambda a=a, name=name: cpu_kernels.ops().prefill_attention(*a, name)
        times: dict[str, list[float]] = {name: [] for name in systems}
        for call in calls.values():  # warm-up
            call()
        for _ in range(args.rounds):
            for name, call in calls.items():
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times[name].append((time.perf_counter() - t0) / args.calls)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"| {rows} | {keys} | " + " | ".join(f"{med[n] * 1e3:.2f}" for n in systems) + " | "
              + " | ".join(f"{med[n] / med['flash']:.2f}" for n in variants) + " |")


if __name__ == "__main__":
    main()
