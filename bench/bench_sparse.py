"""Decode speed of DeepSeek Sparse Attention against the same model run densely, by context length.

    python bench/bench_sparse.py --contexts 1024 4096 16384 65536 --threads 2

The model: the benchmark checkpoint's shape (``peer_checkpoint.CONFIG``: hidden 1024, 8 layers, d_c 512 + d_r 64) with
DeepSeek-V3.2's indexer (64 heads x 128, top-k 2048) and ``--heads`` attention heads (DeepSeek-V3.2 has 128: the more
heads, the more a dense step's attention costs beside the indexer's scan), built with random weights by transformers
(``deepseek_v32``) and loaded by the runtime. Each context is filled with random latents and indexer keys (a prefill of
64k tokens would take hours on a CPU and measures something else), then one sequence (``--batch``: several) decodes.
``sparse``: index_topk 2048, each query attends to the 2048 keys of highest score after the indexer scans all of them;
``dense``: the same model and cache with index_topk above the context, which attends to every key (what the reference
does for such a top-k, and what the runtime runs while a sequence is shorter than its top-k). Rounds interleave the two
on one model; each cell is the median over rounds of the decode tok/s of ``--steps`` steps (model forward + logits).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from peer_checkpoint import CONFIG

from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.dtypes import index_cache_dtype
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.loader import load_model
from mla_runtime.plan import latent_bytes_per_token

TOPK = 2048


def machine() -> str:
    model, flags = platform.processor(), []
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
        flags = next(line for line in info if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    return f"{model}, {os.cpu_count()} cores, {'/'.join(isa)}"


def build(out: Path, heads: int, max_len: int) -> Path:
    """The DSA model's checkpoint (random weights, transformers' initialisation)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    cfg = {**CONFIG, "num_attention_heads": heads, "num_key_value_heads": heads, "index_topk": TOPK,
           "index_n_heads": 64, "index_head_dim": 128, "max_position_embeddings": max_len,
           "mlp_layer_types": ["dense"] + ["sparse"] * (CONFIG["num_hidden_layers"] - 1)}
    for key in ("topk_method", "scoring_func", "rope_interleave"):
        cfg.pop(key)
    torch.manual_seed(0)
    DeepseekV32ForCausalLM(DeepseekV32Config(**cfg)).eval().save_pretrained(out)
    return out


def fill(cache: LatentCache, tokens: int, g: torch.Generator) -> None:
    """Random latents and indexer keys in the first ``tokens`` slots of every layer (in pieces: no big temporaries)."""
    for layer in cache.layers:
        for t in (layer.kv, layer.index):
            assert t is not None
            flat = t.view(-1, t.shape[-1])
            for s in range(0, tokens, 8192):
                rows = flat[s:min(s + 8192, tokens)]
                rows.copy_(torch.randn(rows.shape, generator=g).to(t.dtype))


def decode_rate(model, cache: LatentCache, ctx: int, batch: int, steps: int, block: int) -> float:
    """tok/s of ``steps`` one-token decodes of ``batch`` sequences at context ``ctx`` (reading the same blocks)."""
    tables = [list(range(-(-(ctx + steps + 1) // block)))] * batch  # the sequences share the context's blocks
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(steps):
            fb = ForwardBatch.build([[7 + b] for b in range(batch)], [ctx + i] * batch, tables, block)
            model.compute_logits(model(fb, cache))
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--heads", type=int, default=128, help="attention heads (DeepSeek-V3.2: 128)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    block, top = 64, max(args.contexts)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(build(Path(tmp), args.heads, max(top + 1024, 4096)), dtype=args.dtype)
    cfg, dtype = model.config, model.dtype
    blocks = -(-(top + args.steps + 1) // block)
    cache = LatentCache(cfg.num_hidden_layers, blocks, block, cfg.latent_dim, dtype, index_dim=cfg.index_dim,
                        index_dtype=index_cache_dtype(dtype, dtype))
    fill(cache, top, torch.Generator().manual_seed(0))
    assert cache.bytes_per_token() == latent_bytes_per_token(cfg, "auto", args.dtype), "planner != allocation"
    indexers = [a.indexer for a in model.attention_layers() if a.indexer is not None]
    print(f"# {machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"# deepseek_v32, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, "
          f"d_c {cfg.kv_lora_rank} + d_r {cfg.qk_rope_head_dim}, indexer 64 x 128 top-{TOPK}, {args.dtype}, batch "
          f"{args.batch}; cache {cache.bytes_per_token():,} B/token (planner: "
          f"{latent_bytes_per_token(cfg, 'auto', args.dtype):,})")
    print("| context | sparse tok/s | dense tok/s | sparse / dense |\n|---:|---:|---:|---:|")
    results = []
    for ctx in args.contexts:
        rates: dict[str, list[float]] = {"sparse": [], "dense": []}
        for _ in range(args.rounds + 1):  # the first round warms up
            for kind in ("sparse", "dense"):
                for ix in indexers:
                    ix.topk = TOPK if kind == "sparse" else 1 << 30
                rates[kind].append(decode_rate(model, cache, ctx, args.batch, args.steps, block))
        sparse, dense = (statistics.median(rates[k][1:]) for k in ("sparse", "dense"))
        results.append({"context": ctx, "sparse": sparse, "dense": dense})
        print(f"| {ctx:,} | {sparse:.2f} | {dense:.2f} | {sparse / dense:.2f}x |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
