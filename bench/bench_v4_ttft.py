"""DeepSeek-V4's time to first token on a repeated prompt: prefix caching (the state snapshot at the prompt's last full
block: every window, partial window, compressed entry and indexer key) against a cold prefill, on a random V4 built
by transformers' classes (V4's layer mix of CSA and HCA layers, heads of 128 with 64 rotated).

    python bench/bench_v4_ttft.py                                      # ~4k-token prompt, 4 layers, hidden 1024
    python bench/bench_v4_ttft.py --prompt-tokens 300 --hidden 256 --layers 2 --experts 4 --repeats 2   # quick

Each repeat sends a fresh random prompt (cold: nothing of it cached), then the same prompt again (resumed from the
snapshot: only the tail is computed); the two's greedy tokens must be equal. Prints a markdown table of the median
TTFTs, the snapshots' budget and the bytes of the snapshot the repeat resumed from, with the CPU's model name.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hybrid_ttft import cpu_model, measure  # noqa: E402

from mla_runtime import LLM, SamplingParams  # noqa: E402
from mla_runtime.models.deepseek_v4 import state_bytes  # noqa: E402


def build(args: argparse.Namespace, folder: Path, max_len: int) -> None:
    """A random V4 of the asked size, saved by transformers in bfloat16."""
    import transformers as tf

    kinds = ["heavily_compressed_attention"] + ["compressed_sparse_attention", "heavily_compressed_attention"] * 8
    cfg = tf.DeepseekV4Config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
        head_dim=128, partial_rotary_factor=0.5, q_lora_rank=512, o_groups=4, o_lora_rank=256, sliding_window=128,
        layer_types=kinds[:args.layers], index_n_heads=8, index_head_dim=128, index_topk=64, hc_mult=4,
        n_routed_experts=args.experts, num_experts_per_tok=2, moe_intermediate_size=args.hidden // 2,
        mlp_layer_types=(["hash_moe"] + ["moe"] * args.layers)[:args.layers], max_position_embeddings=max_len,
        bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = tf.DeepseekV4ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, args.experts, b.shape))
    model.save_pretrained(folder)


def same_tokens(llm: LLM, tokens: int, vocab: int) -> None:
    """A fresh prompt cold and resumed from its snapshot: the same greedy tokens."""
    prompt = torch.randint(2, vocab, (tokens,), generator=torch.Generator().manual_seed(7)).tolist()
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cold, again = (llm.generate([{"prompt_token_ids": prompt}], greedy)[0] for _ in range(2))
    if not again.num_cached_tokens or cold.outputs[0].token_ids != again.outputs[0].token_ids:
        raise RuntimeError(f"the resumed prompt ({again.num_cached_tokens} tokens cached) gave "
                           f"{again.outputs[0].token_ids}, the cold one {cold.outputs[0].token_ids}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=64)
    args = parser.parse_args()
    max_len = args.prompt_tokens + 64
    folder = Path(tempfile.mkdtemp(prefix="v4-ttft-"))
    try:
        build(args, folder, max_len)
        llm = LLM(str(folder), dtype="bfloat16", max_model_len=max_len, block_size=args.block_size, max_num_seqs=4)
        try:
            same_tokens(llm, args.prompt_tokens, args.vocab)
            rows = measure(llm, args.prompt_tokens, args.vocab, args.repeats)
            info, cfg = llm.engine.info(), llm.engine.worker.v4_config
        finally:
            llm.shutdown()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print_table(args, rows, info.state_snapshot_bytes, state_bytes(cfg, rows[1][1], 2))


def print_table(args: argparse.Namespace, rows: list, budget: int, snapshot: int) -> None:
    print(f"\nCPU: {cpu_model()}; {torch.get_num_threads()} threads; deepseek_v4, {args.layers} layers (hidden "
          f"{args.hidden}, bfloat16), {args.prompt_tokens}-token prompt, block {args.block_size}; snapshot budget "
          f"{budget / 2**20:.1f} MiB, the repeat's snapshot {snapshot / 2**20:.2f} MiB\n")
    print(f"| prompt | cached tokens | TTFT (median of {args.repeats}) |")
    print("|---|---:|---:|")
    for name, cached, ttfts in rows:
        print(f"| {name} | {cached:,} | {statistics.median(ttfts) * 1000:,.0f} ms |")
    cold, warm = (statistics.median(r[2]) for r in rows)
    print(f"\nspeed-up of the repeated prompt: {cold / warm:.1f}x")


if __name__ == "__main__":
    main()
