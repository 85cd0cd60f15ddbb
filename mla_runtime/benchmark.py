"""Offline throughput on a checkpoint: N prompts of seeded random lengths through ``LLM.generate``, and
optionally transformers' ``generate`` on the same checkpoint and prompts, measured in the same run.

    mla-runtime bench                                    # the embedded demo model, 32 prompts, 64 tokens out
    mla-runtime bench --model PATH_OR_ORG/NAME --num-prompts 64 --max-tokens 128 --compare-transformers

mla-runtime gets every prompt at once (continuous batching: the scheduler admits them as the token budget
and ``--max-num-seqs`` allow). transformers runs static batches of ``--hf-batch`` prompts in order,
left-padded with an attention mask. Both decode greedily for exactly ``--max-tokens`` tokens (EOS ignored);
throughput is output tokens / wall seconds of the whole workload (prefill included), after a short warm-up
of each system. Prompts are random token ids (no tokenizer needed).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from mla_runtime.config import ModelConfig
from mla_runtime.help_format import DefaultsHelpFormatter
from mla_runtime.hub import resolve_model


def make_workload(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of uniform random length in [min_len, max_len], token ids in [2, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def run_mla(path: str, prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, torch.dtype]:
    """Wall seconds of ``LLM.generate`` on every prompt at once, and the dtype the engine ran in."""
    from mla_runtime import LLM, SamplingParams

    llm = LLM(path, dtype=args.dtype, max_model_len=args.max_len + args.max_tokens + 16,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs or len(prompts),
              num_threads=args.threads, enable_prefix_caching=False)  # the warm-up must not prefill for it
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4, temperature=0),
                 use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    if any(len(o.outputs[0].token_ids) != args.max_tokens for o in outs):
        raise RuntimeError(f"a request ended before {args.max_tokens} tokens despite ignore_eos")
    dtype = llm.engine.worker.dtype
    llm.shutdown()
    return seconds, dtype


@torch.inference_mode()
def run_transformers(path: str, prompts: list[list[int]], dtype: torch.dtype, max_tokens: int,
                     batch_size: int) -> float:
    """Wall seconds of transformers' ``generate`` in static left-padded batches of ``batch_size``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # never stop early: same work as ignore_eos

    def generate(batch: list[list[int]], n: int) -> torch.Tensor:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                              pad_token_id=0)

    generate(prompts[:2], 4)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        out = generate(batch, max_tokens)
        if out.shape[1] != max(len(p) for p in batch) + max_tokens:
            raise RuntimeError("transformers generated a different number of tokens than asked")
    return time.perf_counter() - t0


def build_parser(prog: str = "mla-runtime bench", description: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=description or __doc__,
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", "--checkpoint", dest="model", default=None,
                    help="checkpoint folder or hub repo id org/name (default: the embedded demo model)")
    ap.add_argument("--revision", default=None, help="hub branch, tag or commit of a repo id (default: main)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=16, help="shortest prompt (tokens)")
    ap.add_argument("--max-len", type=int, default=256, help="longest prompt (tokens)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--dtype", default="auto", help="auto, float32, bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="sequences at once (default: all prompts)")
    ap.add_argument("--kv-cache-memory", default="1GiB", help="latent-cache bytes")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's, i.e. all cores)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt lengths and ids")
    ap.add_argument("--compare-transformers", action="store_true",
                    help="also time transformers' generate on the same prompts and print the ratio")
    ap.add_argument("--hf-batch", type=int, default=8, help="transformers' static batch size")
    return ap


def run(args: argparse.Namespace) -> int:
    """Print the workload, mla-runtime's tokens/s and (with ``compare_transformers``) the ratio."""
    for name in ("num_prompts", "min_len", "max_tokens", "hf_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_len < args.min_len:
        raise ValueError(f"--max-len ({args.max_len}) must be >= --min-len ({args.min_len})")
    if args.model is None:
        from mla_runtime.serving.config import default_model

        args.model = default_model()
    path = resolve_model(args.model, args.revision)
    if args.threads:
        torch.set_num_threads(args.threads)
    vocab = ModelConfig.from_pretrained(path).vocab_size
    prompts = make_workload(args.num_prompts, args.min_len, args.max_len, vocab, args.seed)
    n_out = len(prompts) * args.max_tokens
    print(f"{len(prompts)} prompts, {args.min_len}-{args.max_len} tokens (seed={args.seed}, "
          f"{sum(map(len, prompts))} prompt tokens), {args.max_tokens} out each, greedy, "
          f"{torch.get_num_threads()} threads; checkpoint {Path(path)}", flush=True)
    t_mla, dtype = run_mla(path, prompts, args)
    print(f"mla-runtime LLM.generate ({str(dtype).removeprefix('torch.')}): {n_out / t_mla:8.1f} tok/s "
          f"({t_mla:.1f} s)", flush=True)
    if args.compare_transformers:
        t_hf = run_transformers(path, prompts, dtype, args.max_tokens, args.hf_batch)
        print(f"transformers generate (batch {args.hf_batch:>2}): {n_out / t_hf:8.1f} tok/s ({t_hf:.1f} s)")
        print(f"ratio mla-runtime / transformers: {t_hf / t_mla:.2f}x")
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "mla-runtime bench") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
