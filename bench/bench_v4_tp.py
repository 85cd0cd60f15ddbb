"""DeepSeek-V4 under tensor parallelism on one machine: a rank's weights and state, and throughput, of N = 1 and 2.

    python bench/bench_v4_tp.py --prompts 8 --prompt-len 300 --max-tokens 32

Builds a seeded random ``deepseek_v4`` checkpoint with transformers' classes (hidden 512, 4 layers of every kind, 8
heads of 128 in 4 output groups, 8 routed experts, a window of 64, CSA every 4 tokens with a top-k of 32, HCA every
64) under bench/out/, then for N = 1 and 2 prints a rank's weight bytes (the shard: heads, output groups, experts,
shared expert and vocabulary split; the KV head, compressors and indexer whole), the fixed state bytes per sequence
(every rank holds every sequence's whole state), generation throughput (output tokens / wall second of
``LLM.generate``, after a warm-up) and whether the greedy tokens equal N = 1's, measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from mla_runtime import LLM, SamplingParams

OUT = Path(__file__).resolve().parent / "out" / "v4_tp_model"
VOCAB = 8192


def build_checkpoint(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, head_dim=128,
        partial_rotary_factor=0.25, q_lora_rank=256, o_groups=4, o_lora_rank=128, sliding_window=64,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 64}, index_n_heads=8,
        index_head_dim=64, index_topk=32, hc_mult=4, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=256, mlp_layer_types=["hash_moe", "moe", "moe", "moe"], bos_token_id=0,
        eos_token_id=1, max_position_embeddings=4096)
    tf.DeepseekV4ForCausalLM(cfg).save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    path = build_checkpoint(OUT)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(2, VOCAB) for _ in range(args.prompt_len)]}
               for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    print("| N | weights per rank (B) | fixed state per sequence per rank (B) | tok/s | x N=1 | tokens = N=1 |")
    print("|---|---|---|---|---|---|")
    reference, base = None, None
    for tp in (1, 2):
        with LLM(str(path), dtype="float32", max_model_len=args.prompt_len + args.max_tokens + 16,
                 max_num_seqs=args.prompts, kv_cache_memory="256MiB", tensor_parallel_size=tp) as llm:
            llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
            start = time.perf_counter()
            out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
            rate = sum(map(len, out)) / (time.perf_counter() - start)
            w = llm.engine.worker
            reference, base = reference or out, base or rate
            print(f"| {tp} | {w.weight_bytes:,} | {w.state_bytes_per_sequence:,} | {rate:.1f} | {rate / base:.2f} | "
                  f"{out == reference} |")


if __name__ == "__main__":
    main()
