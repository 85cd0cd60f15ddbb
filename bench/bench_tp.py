"""Tensor parallelism on one machine: capacity and throughput of N = 1 and 2, replicated vs sharded
latent cache, at the same per-rank cache budget.

    python bench/bench_tp.py --cache-per-rank 64MiB --prompts 16 --prompt-len 64 --max-tokens 32

Builds a seeded random DeepseekV3-layout checkpoint with transformers (hidden 512, 4 layers, 8 heads,
kv_lora_rank 256, qk_rope_head_dim 32) under bench/out/, then for each setup prints the blocks and
tokens the cache holds, the cache bytes per token per rank, and generation throughput (output tokens /
wall second of ``LLM.generate``), with ratios against N = 1 measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.options import parse_bytes

OUT = Path(__file__).resolve().parent / "out" / "tp_model"


def build_checkpoint(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=8192, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=4,
                           n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=256,
                           q_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                           first_k_dense_replace=1, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1)
    DeepseekV3ForCausalLM(cfg).save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-per-rank", default="64MiB")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    path = build_checkpoint(OUT)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 8192) for _ in range(args.prompt_len)]}
               for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    budget = parse_bytes(args.cache_per_rank)
    rows = []
    reference = None
    for tp, layout in ((1, "replicated"), (2, "replicated"), (2, "sharded")):
        with LLM(str(path), dtype="float32", max_model_len=1024, kv_cache_memory=budget, tensor_parallel_size=tp,
                 latent_cache_layout=layout, max_num_seqs=args.prompts) as llm:
            llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            engine = llm.engine
            toks = [o.outputs[0].token_ids for o in outs]
            reference = reference or toks
            rows.append((tp, layout, engine.pool.num_blocks, engine.pool.num_blocks * engine.config.block_size,
                         engine.worker.bytes_per_token_per_rank, engine.worker.cache.nbytes(),
                         sum(map(len, toks)) / seconds, toks == reference))
    base_tokens, base_tps = rows[0][3], rows[0][6]
    print(f"per-rank cache budget {budget:,} B; {args.prompts} prompts x {args.prompt_len} tokens in, "
          f"{args.max_tokens} out; {torch.get_num_threads()} threads")
    print("| N | layout | blocks | max concurrent tokens | x N=1 | cache B/token/rank | cache B/rank | tok/s "
          "| x N=1 | tokens = N=1 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tp, layout, blocks, tokens, bpt, nbytes, tps, same in rows:
        print(f"| {tp} | {layout} | {blocks:,} | {tokens:,} | {tokens / base_tokens:.2f} | {bpt:,} | {nbytes:,} "
              f"| {tps:.1f} | {tps / base_tps:.2f} | {same} |")


if __name__ == "__main__":
    main()
