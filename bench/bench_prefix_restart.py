"""Time to first token after a restart: recomputing a prefix against loading it from the disk tier.

    python bench/bench_prefix_restart.py [--prefixes 1024 4096 8192] [--rounds 3] [--dtype auto]

The model is the benchmark checkpoint (``bench/peer_checkpoint.py``: hidden 1024, 8 layers, latent 512 + 64), read
through a copy of its ``config.json`` whose ``max_position_embeddings`` is 16,384 (the weights are the same file,
linked), so that an 8k-token prefix fits. Each round, for each prefix length ``L``, a prompt is a fresh random
``L``-token prefix plus a 16-token question:

1. recompute: an engine with a disk tier (``kv_cache_dir``) and an empty cache answers it, 1 token (its TTFT is the
   whole prefill); the engine is shut down, which writes the prompt's full blocks to the directory;
2. the directory's files are dropped from the page cache (``posix_fadvise(DONTNEED)``: only these files), so the
   restart reads them from the disk;
3. restart: a new engine on the same directory answers the same prompt: ``L`` tokens come from the disk tier
   (checked), the question is computed. Its greedy token must equal the recompute's;
4. the same prompt once more in that engine: the prefix is now in the device pool (the best a cache can do).

Each engine first answers a 16-token warm-up prompt, so that no measured request pays the engine's one-time costs.

The rounds alternate recompute and restart, and the table gives medians. Bytes read per cached token are the
disk tier's file bytes read over the tokens it served, against the planner's latent bytes per token (the
payload is exactly that; the rest is one ~280-byte header per block). The restart is a new engine in the same
process: its pool, disk tier and scheduler are new, only the process's one-time CPU GEMM probe is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from peer_checkpoint import build_checkpoint  # noqa: E402

from mla_runtime import LLM, SamplingParams  # noqa: E402

QUESTION = 16


def long_context_checkpoint(out: Path) -> Path:
    """The benchmark checkpoint's weights (linked) with ``max_position_embeddings`` 16,384."""
    src = build_checkpoint(ROOT / "bench" / "out" / "peer_ckpt")
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    (out / "config.json").write_text(json.dumps(config, indent=2))
    link = out / "model.safetensors"
    if not link.exists():
        link.symlink_to((src / "model.safetensors").resolve())
    return out


def drop_from_page_cache(directory: Path) -> None:
    for f in directory.rglob("*.blk"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one_round(ckpt: Path, lengths: list[int], r: int, args: argparse.Namespace, rows: dict) -> None:
    d = Path(tempfile.mkdtemp(prefix="kvbench", dir=args.cache_parent))
    kw = dict(dtype=args.dtype, max_model_len=max(lengths) + QUESTION + 64, kv_cache_memory=args.kv_cache_memory,
              kv_cache_dir=str(d))
    p = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(1000 * r)
    prompts = {L: [rng.randrange(2, 32000) for _ in range(L + QUESTION)] for L in lengths}
    warm_up = {"prompt_token_ids": [rng.randrange(2, 32000) for _ in range(QUESTION)]}  # one-time costs first
    first = LLM(str(ckpt), **kw)
    first.generate([warm_up], p, use_tqdm=False)
    cold = {L: first.generate([{"prompt_token_ids": prompts[L]}], p, use_tqdm=False)[0] for L in lengths}
    first.shutdown(flush_timeout=args.flush_timeout)  # every block on disk before the restart
    drop_from_page_cache(d)
    again = LLM(str(ckpt), **kw)
    again.generate([warm_up], p, use_tqdm=False)
    for L in lengths:
        before = again.engine.stats().disk
        out = again.generate([{"prompt_token_ids": prompts[L]}], p, use_tqdm=False)[0]
        after = again.engine.stats().disk
        hit = again.generate([{"prompt_token_ids": prompts[L]}], p, use_tqdm=False)[0]
        assert out.num_cached_tokens == L, (L, out.num_cached_tokens)
        assert out.outputs[0].token_ids == cold[L].outputs[0].token_ids
        assert cold[L].num_cached_tokens == 0 and hit.num_cached_tokens == L
        row = rows.setdefault(L, {"recompute": [], "disk": [], "device": [], "read": []})
        row["recompute"].append(cold[L].metrics.ttft)
        row["disk"].append(out.metrics.ttft)
        row["device"].append(hit.metrics.ttft)
        row["read"].append((after.bytes_read - before.bytes_read) / L)
        print(f"round {r} L={L}: recompute {cold[L].metrics.ttft:.3f} s, disk {out.metrics.ttft:.3f} s, "
              f"device {hit.metrics.ttft:.3f} s, read {row['read'][-1]:,.1f} B per cached token "
              f"(latent {again.engine.worker.bytes_per_token:,} B)", flush=True)
    rows["bytes_per_token"] = again.engine.worker.bytes_per_token
    rows["file_bytes"] = again.engine.worker.disk_tier.file_bytes()
    rows["dtype"] = str(again.engine.worker.dtype).removeprefix("torch.")
    again.shutdown()
    shutil.rmtree(d)


def report(rows: dict, args: argparse.Namespace) -> None:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"\n{model}, {torch.get_num_threads()} threads, weights {rows['dtype']}, block 64, {args.rounds} rounds "
          f"(medians), {time.strftime('%Y-%m-%d')}")
    print(f"planner's latent bytes per token: {rows['bytes_per_token']:,} B; one block's file: "
          f"{rows['file_bytes']:,} B = {rows['file_bytes'] / 64:,.1f} B per token\n")
    print("| prefix | TTFT recompute | TTFT disk tier (restart) | TTFT device hit | recompute / disk | "
          "bytes read per cached token |")
    print("|---:|---:|---:|---:|---:|---:|")
    for L in args.prefixes:
        r = rows[L]
        rec, disk, dev = (statistics.median(r[k]) for k in ("recompute", "disk", "device"))
        print(f"| {L:,} | {rec * 1e3:,.0f} ms | {disk * 1e3:,.0f} ms | {dev * 1e3:,.0f} ms | {rec / disk:.1f}x | "
              f"{statistics.median(r['read']):,.1f} B |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flush-timeout", type=float, default=600.0,
                        help="seconds the first engine's shutdown may take to write its blocks")
    parser.add_argument("--cache-parent", default=str(ROOT / "bench" / "out" / "diskcache"),
                        help="the disk tier's directories are made here (on the disk under test)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = long_context_checkpoint(ROOT / "bench" / "out" / "diskcache" / "ckpt_16k")
    rows: dict = {}
    for r in range(args.rounds):
        one_round(ckpt, args.prefixes, r, args, rows)
    report(rows, args)


if __name__ == "__main__":
    main()
