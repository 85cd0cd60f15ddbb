"""How far bfloat16 inference is from float32, for mla-runtime and for transformers' own bf16 model.

    python bench/bf16_quality.py --prompts 4 --new-tokens 24

On the benchmark checkpoint: transformers float32 generates ``--new-tokens`` greedy tokens after
each 128-token prompt; then every system scores that same continuation (teacher forcing) and the
log-probability it gives each chosen token is compared with float32's. mla-runtime runs its real paths:
the prompt as one prefill step through the paged latent cache, then one decode step per token (absorbed
attention, the CPU decode plan). Greedy agreement alone says little on a random-weight checkpoint — its
next-token distributions are nearly flat, so any bf16 rounding flips near-ties within a few tokens — so
this compares the log-probabilities position by position instead.
"""

from __future__ import annotations

import argparse
import copy

import torch
from peer_checkpoint import CONFIG, build_checkpoint, make_prompts
from profile_decode import OUT

from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.layers.quantization import quantize_model
from mla_runtime.loader import load_model


@torch.inference_mode()
def mla_runtime_logprobs(path: str, dtype: str, seqs: list[list[int]], prompt_len: int,
                         quantization: str | None = None) -> torch.Tensor:
    """[B, new, V] log-probabilities of positions prompt_len - 1 ... len - 2: prefill, then decode steps
    (``quantization="int8"``: the weights quantised as ``LLM(..., quantization="int8")`` does)."""
    model = load_model(path, dtype=dtype)
    quantize_model(model, quantization)
    block, per_seq = 64, -(-len(seqs[0]) // 64)
    cache = LatentCache(model.config.num_hidden_layers, per_seq * len(seqs), block, model.config.latent_dim,
                        model.dtype)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(seqs))]

    def step(chunks: list[list[int]], context: int) -> torch.Tensor:
        batch = ForwardBatch.build(chunks, [context] * len(chunks), tables, block)
        hidden = model(batch, cache)
        return torch.log_softmax(model.compute_logits(hidden[batch.logits_indices]).float(), dim=-1)

    out = [step([s[:prompt_len] for s in seqs], 0)]
    for t in range(prompt_len, len(seqs[0]) - 1):
        out.append(step([[s[t]] for s in seqs], t))
    return torch.stack(out, dim=1)


@torch.inference_mode()
def greedy_reference(hf, prompts: list[list[int]], prompt_len: int, new_tokens: int
                     ) -> tuple[list[list[int]], torch.Tensor, slice, torch.Tensor]:
    """transformers' greedy continuations of ``prompts`` (exactly ``new_tokens`` each): the sequences, as one tensor,
    the positions that predict the new tokens, and the model's log-probabilities there (the reference)."""
    seqs = [hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                        min_new_tokens=new_tokens)[0].tolist() for p in prompts]
    ids = torch.tensor(seqs)
    positions = slice(prompt_len - 1, ids.shape[1] - 1)
    return seqs, ids, positions, torch.log_softmax(hf(ids).logits[:, positions].float(), dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    build_checkpoint(OUT)
    hf = AutoModelForCausalLM.from_pretrained(OUT, dtype=torch.float32).eval()
    prompts = make_prompts(args.prompts, args.prompt_len, CONFIG["vocab_size"], seed=0)
    seqs, ids, positions, ref = greedy_reference(hf, prompts, args.prompt_len, args.new_tokens)
    with torch.inference_mode():
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
        systems = {"transformers bf16": torch.log_softmax(hf_bf16(ids).logits[:, positions].float(), dim=-1)}
    systems["mla-runtime bf16"] = mla_runtime_logprobs(str(OUT), "bfloat16", seqs, args.prompt_len)
    systems["mla-runtime fp32"] = mla_runtime_logprobs(str(OUT), "float32", seqs, args.prompt_len)
    chosen = ids[:, args.prompt_len:].unsqueeze(-1)
    ref_chosen = ref.gather(-1, chosen)
    print(f"{args.prompts} prompts × {args.prompt_len} tokens, {args.new_tokens} float32-greedy tokens scored "
          "by each system; |log p - log p_fp32| of the chosen tokens")
    print("| system | median | p90 | max | argmax = float32's |\n|---|---:|---:|---:|---:|")
    for name, lp in systems.items():
        err = (lp.gather(-1, chosen) - ref_chosen).abs().flatten()
        agree = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"| {name} | {err.median().item():.4f} | {err.quantile(0.9).item():.4f} | {err.max().item():.3f} "
              f"| {agree * 100:.1f}% |")


if __name__ == "__main__":
    main()
