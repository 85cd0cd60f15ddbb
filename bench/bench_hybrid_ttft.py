"""A hybrid model's time to first token on a repeated prompt: prefix caching (the MLA layers' blocks and the linear
layers' state snapshot at the prompt's last full block) against a cold prefill, on a Kimi-Linear-shaped random
checkpoint (three linear-attention (KDA) layers to one MLA layer, as Kimi Linear).

    python bench/bench_hybrid_ttft.py                                   # ~4k-token prompt, 8 layers, hidden 1024
    python bench/bench_hybrid_ttft.py --prompt-tokens 300 --hidden 128 --layers 4 --repeats 2   # a quick check

Each repeat sends a fresh random prompt (cold: nothing of it cached), then the same prompt again (its full blocks
and the state snapshot at their end come from the prefix cache: only the tail is computed). Prints a markdown table
of the median TTFTs, with the CPU's model name (lscpu).
"""

from __future__ import annotations

import argparse
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.random_checkpoint import write_random_checkpoint


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def hybrid_config(hidden: int, layers: int, vocab: int, max_len: int) -> dict[str, Any]:
    """A Kimi Linear config (transformers' own defaults filled in) of this size: every fourth layer MLA."""
    import transformers

    heads = max(1, hidden // 128)
    kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    return transformers.KimiLinearConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, kv_lora_rank=4 * hidden // 8, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, linear_num_heads=heads, linear_head_dim=128, linear_conv_kernel_dim=4, num_local_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=hidden // 2, intermediate_size=2 * hidden, layer_types=kinds,
        bos_token_id=0, eos_token_id=1, pad_token_id=None, max_position_embeddings=max_len).to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--block-size", type=int, default=64)
    args = parser.parse_args()
    max_len = args.prompt_tokens + 64
    folder = Path(tempfile.mkdtemp(prefix="hybrid-ttft-"))
    try:
        write_random_checkpoint(hybrid_config(args.hidden, args.layers, args.vocab, max_len), folder,
                                getattr(torch, args.dtype))
        llm = LLM(str(folder), dtype=args.dtype, max_model_len=max_len, block_size=args.block_size, max_num_seqs=4,
                  kv_cache_memory=str(64 * 2**20 + 4 * max_len * 4096))
        try:
            rows = measure(llm, args.prompt_tokens, args.vocab, args.repeats)
            info = llm.engine.info()
        finally:
            llm.shutdown()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\nCPU: {cpu_model()}; {torch.get_num_threads()} threads; {args.layers} layers (hidden {args.hidden}, "
          f"{args.dtype}), {args.prompt_tokens}-token prompt, block {args.block_size}; state "
          f"{info.state_bytes_per_sequence / 2**20:.2f} MiB/sequence, {info.state_snapshots} state snapshots\n")
    print(f"| prompt | cached tokens | TTFT (median of {args.repeats}) |")
    print("|---|---:|---:|")
    for name, cached, ttfts in rows:
        print(f"| {name} | {cached:,} | {statistics.median(ttfts) * 1000:,.0f} ms |")
    cold, warm = (statistics.median(r[2]) for r in rows)
    print(f"\nspeed-up of the repeated prompt: {cold / warm:.1f}x")


def measure(llm: LLM, tokens: int, vocab: int, repeats: int) -> list[tuple[str, int, list[float]]]:
    """Per repeat: a fresh prompt (cold), then the same prompt again (prefix cached). A first untimed request warms
    the kernels up."""
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    cold: list[float] = []
    warm: list[float] = []
    cached = 0
    for r in range(repeats + 1):
        prompt = [rng.randrange(2, vocab) for _ in range(tokens)]
        first = llm.generate([{"prompt_token_ids": prompt}], one)[0]
        again = llm.generate([{"prompt_token_ids": prompt}], one)[0]
        if first.num_cached_tokens:
            raise RuntimeError("the cold prompt found a cached prefix")
        if not again.num_cached_tokens:
            raise RuntimeError("the repeated prompt took nothing from the prefix cache")
        if r == 0:
            continue  # warm-up
        assert first.metrics is not None and again.metrics is not None
        cold.append(first.metrics.ttft)
        warm.append(again.metrics.ttft)
        cached = again.num_cached_tokens
    return [("cold (nothing cached)", 0, cold), ("repeated (prefix cached)", cached, warm)]


if __name__ == "__main__":
    main()
