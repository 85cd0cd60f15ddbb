"""Offline throughput: N prompts of seeded random lengths through ``LLM.generate``, against transformers'
``generate`` on the same checkpoint and prompts, measured in the same run.

    python bench/bench_throughput.py                                  # 32 prompts, 16-256 tokens, 64 out
    python bench/bench_throughput.py --num-prompts 64 --max-tokens 128 --dtype bfloat16 --hf-batch 16

mla-runtime gets every prompt at once (continuous batching: the scheduler admits them as the token budget
and ``--max-num-seqs`` allow). transformers runs static batches of ``--hf-batch`` prompts in order, left-padded
with an attention mask. Both decode greedily for exactly ``--max-tokens`` tokens (EOS ignored); throughput is
output tokens / wall seconds of the whole workload (prefill included), after a short warm-up of each system.
The checkpoint is the issue-8 benchmark model (``bench/peer_checkpoint.py``) unless ``--checkpoint`` names
another ``config.json`` + safetensors directory.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peer_checkpoint import build_checkpoint  # noqa: E402

from mla_runtime import LLM, SamplingParams  # noqa: E402


def make_workload(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def run_mla(path: Path, prompts: list[list[int]], args) -> float:
    llm = LLM(str(path), dtype=args.dtype, max_model_len=args.max_len + args.max_tokens + 16,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs or len(prompts),
              num_threads=args.threads, enable_prefix_caching=False)  # the warm-up must not prefill for it
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4, temperature=0))
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    seconds = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
    return seconds


@torch.inference_mode()
def run_transformers(path: Path, prompts: list[list[int]], args) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    model.generation_config.eos_token_id = None  # never stop early: same work as ignore_eos

    def generate(batch: list[list[int]], max_tokens: int) -> torch.Tensor:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, pad_token_id=0)

    generate(prompts[:2], 4)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch):
        batch = prompts[i:i + args.hf_batch]
        out = generate(batch, args.max_tokens)
        assert out.shape[1] == max(len(p) for p in batch) + args.max_tokens
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--hf-batch", type=int, default=8, help="transformers' static batch size")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="mla-runtime's (default: all prompts)")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's, i.e. all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.checkpoint or build_checkpoint(HERE / "out" / "peer_ckpt")
    import json

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = make_workload(args.num_prompts, args.min_len, args.max_len, vocab, args.seed)
    n_out = len(prompts) * args.max_tokens
    print(f"{len(prompts)} prompts, {args.min_len}-{args.max_len} tokens (seed {args.seed}, "
          f"{sum(map(len, prompts))} prompt tokens), {args.max_tokens} out each, greedy, {args.dtype}, "
          f"{torch.get_num_threads()} threads; checkpoint {path}", flush=True)
    t_mla = run_mla(path, prompts, args)
    print(f"mla-runtime LLM.generate:          {n_out / t_mla:8.1f} tok/s ({t_mla:.1f} s)", flush=True)
    if args.skip_transformers:
        return
    t_hf = run_transformers(path, prompts, args)
    print(f"transformers generate (batch {args.hf_batch:>2}): {n_out / t_hf:8.1f} tok/s ({t_hf:.1f} s)")
    print(f"ratio mla-runtime / transformers: {t_hf / t_mla:.2f}x")


if __name__ == "__main__":
    main()
