"""Decode-kernel benchmark: mla_decode over a paged latent cache for a grid of batch x context.

Every query row n reads its whole sequence once, so the ideal (minimum) traffic of one call is

    bytes = Σ_n L_n (d_c + d_r) e_cache  [+ 8 L_n for the fp8/int8 scales]       latent cache read
          + N H (d_c + d_r) e_q                                                    absorbed queries read
          + N H d_c e_q + 4 N H                                                     output and lse written

(e_* = bytes per element, L_n = context length, N = batch, H = heads) and GB/s = bytes / time. Decode is
memory-bound, so that is the honest measure (as in FlashMLA and gpt-fast).

On CUDA it times the Triton path and reports GB/s as a fraction of a device-to-device copy bandwidth
measured in the same run (copy reads and writes: 2 × size / time). On CPU it times the vectorised torch
path against the fp32 reference (``mla_kernels.reference``) and reports the speed-up.

    python bench/bench_kernels.py                                   # default grid for the device
    python bench/bench_kernels.py --batch 1 8 --ctx 512 4096 --heads 16 --dtype bfloat16 --cache-dtype int8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from mla_kernels import mla_decode, store_latent
from mla_kernels.reference import ref_mla_decode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CACHE_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def build_case(batch: int, ctx: int, heads: int, d_c: int, d_r: int, block_size: int, q_dtype: torch.dtype,
               cache_dtype: torch.dtype, device: str, seed: int = 0):
    """A full batch of ctx-token sequences on shuffled blocks, and one absorbed query row per sequence."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-ctx // block_size)
    num_blocks = batch * per_seq
    block_tables = torch.randperm(num_blocks, generator=gen).int().view(batch, per_seq).to(device)
    cache = torch.zeros(num_blocks, block_size, d_c + d_r, device=device).to(cache_dtype)
    scales = None
    if cache_dtype in (torch.float8_e4m3fn, torch.int8):
        scales = torch.ones(num_blocks, block_size, 2, device=device)
    pos = torch.arange(ctx, device=device)
    slots = (block_tables[:, pos // block_size].long() * block_size + pos % block_size).flatten()
    store_latent(cache, scales, torch.randn(batch * ctx, d_c, device=device).to(q_dtype),
                 torch.randn(batch * ctx, d_r, device=device).to(q_dtype), slots)
    q = torch.randn(batch, heads, d_c + d_r, device=device).to(q_dtype)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, cache, scales, block_tables, seq_lens


def decode_bytes(batch: int, ctx: int, heads: int, d_c: int, d_r: int, q_dtype: torch.dtype,
                 cache_dtype: torch.dtype) -> int:
    e_q, e_c = q_dtype.itemsize, cache_dtype.itemsize
    scale_bytes = 8 if cache_dtype in (torch.float8_e4m3fn, torch.int8) else 0
    latent = batch * ctx * ((d_c + d_r) * e_c + scale_bytes)
    return latent + batch * heads * ((d_c + d_r) * e_q + d_c * e_q + 4)


def time_cpu(fn: Callable[[], object], iters: int) -> float:
    """Median wall time in seconds after one warm-up call."""
    fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def time_cuda(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100) / 1e3


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_cuda(lambda: dst.copy_(src))


def bench_point(args: argparse.Namespace, batch: int, ctx: int, device: str, copy_bw: float | None) -> str:
    """One table row: time mla_decode for batch x ctx (Triton on CUDA; torch path and reference on CPU)."""
    q_dtype = DTYPES[args.dtype]
    cache_dtype = CACHE_DTYPES[args.cache_dtype or args.dtype]
    sm_scale = (128 + args.d_r) ** -0.5  # DeepSeek: (d_n + d_r)^-1/2 with d_n = 128
    q, cache, scales, block_tables, seq_lens = build_case(batch, ctx, args.heads, args.d_c, args.d_r,
                                                          args.block_size, q_dtype, cache_dtype, device)
    nbytes = decode_bytes(batch, ctx, args.heads, args.d_c, args.d_r, q_dtype, cache_dtype)

    def run(backend: str) -> object:
        return mla_decode(q, cache, scales, block_tables, seq_lens, sm_scale, args.d_c,
                          num_kv_splits=args.num_kv_splits, backend=backend)

    def reference() -> object:
        return ref_mla_decode(q, cache, scales, block_tables, seq_lens, sm_scale, args.d_c)

    if copy_bw is not None:
        t = time_cuda(lambda: run("triton"))
        return f"{batch:>5} {ctx:>6} {t * 1e3:>10.3f} {nbytes / t / 1e9:>8.0f} {nbytes / t / copy_bw:>8.1%}"
    t = time_cpu(lambda: run("torch"), args.iters)
    t_ref = time_cpu(reference, max(1, args.iters // 2))
    return f"{batch:>5} {ctx:>6} {t * 1e3:>10.2f} {nbytes / t / 1e9:>8.2f} {t_ref * 1e3:>10.2f} {t_ref / t:>8.1f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", help="batch sizes (default: 1 8 32)")
    parser.add_argument("--ctx", type=int, nargs="+", help="context lengths (default: 512 4096 16384; CPU: 512 4096)")
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--d-c", type=int, default=512)
    parser.add_argument("--d-r", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="query/output dtype")
    parser.add_argument("--cache-dtype", choices=sorted(CACHE_DTYPES), help="default: --dtype")
    parser.add_argument("--num-kv-splits", type=int, help="default: the kernel's own choice")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per point on CPU")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        where = torch.cuda.get_device_name()
    else:  # the machine load matters: the CPU numbers below are only comparable within one run
        where = f"cpu, {torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.1f}"
    print(f"device: {where}; heads={args.heads} d_c={args.d_c} d_r={args.d_r} block_size={args.block_size} "
          f"q={args.dtype} cache={args.cache_dtype or args.dtype}")
    copy_bw = None
    if cuda:
        copy_bw = copy_bandwidth(device)
        print(f"device-to-device copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
        header = f"{'batch':>5} {'ctx':>6} {'triton ms':>10} {'GB/s':>8} {'of copy':>8}"
    else:
        header = f"{'batch':>5} {'ctx':>6} {'torch ms':>10} {'GB/s':>8} {'ref ms':>10} {'speed-up':>9}"
    print(header)
    print("-" * len(header))
    for batch in args.batch or [1, 8, 32]:
        for ctx in args.ctx or ([512, 4096, 16384] if cuda else [512, 4096]):
            print(bench_point(args, batch, ctx, device, copy_bw), flush=True)


if __name__ == "__main__":
    main()
