"""How far weight-only int8 inference is from float32, next to llama.cpp's Q8_0 on the same tokens.

    python bench/int8_quality.py --prompts 4 --new-tokens 24

The protocol of ``bench/bf16_quality.py``: on the benchmark checkpoint, transformers float32 generates
``--new-tokens`` greedy tokens after each 128-token prompt; every system then scores that same continuation
(teacher forcing) and the log-probability it gives each chosen token is compared with float32's.

- **mla-runtime int8**: ``quantize_model(model, "int8")`` — what ``LLM(..., quantization="int8")`` runs: int8
  weights with one bfloat16 scale per output channel, activations rounded to bfloat16 into each int8 product
  (the CPU kernel's input; ``cpu_gemm=plain`` keeps them float32) — through its real paths (one prefill
  step through the paged latent cache, then one decode step per token).
- **Q8_0 (ggml's numerics)**: transformers float32 with ggml's Q8_0 applied as llama.cpp's CPU backend
  applies it to a ``--outtype q8_0`` GGUF: every matrix but the router (embedding, attention projections
  including ``kv_b``, experts, lm_head) rounded to blocks of 32 weights sharing one float16 scale
  ``d = absmax / 127``, and the activations entering each of those products quantised the same way (ggml
  computes Q8_0 × Q8_0 dot products: ``vec_dot_type`` of Q8_0 is Q8_0). This reproduces the arithmetic, not
  llama.cpp's code: its absorbed attention multiplies ``k_b``/``v_b`` in another order, and its summation order
  differs; the error it measures is that of the number format.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from bf16_quality import greedy_reference, mla_runtime_logprobs
from peer_checkpoint import CONFIG, build_checkpoint, make_prompts
from profile_decode import OUT

QK8_0 = 32


def q8_0_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` (last dim a multiple of 32) through ggml's Q8_0: per 32-block ``d = absmax / 127`` in float16."""
    blocks = x.float().reshape(*x.shape[:-1], -1, QK8_0)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1)), 0).clamp(-127, 127)
    return (q * d).reshape(x.shape).to(x.dtype)


@contextlib.contextmanager
def ggml_products(model: torch.nn.Module, weight_round_trip: Callable[[torch.Tensor], torch.Tensor]
                  ) -> Iterator[None]:
    """Round ``model``'s matrices through a ggml weight type (``weight_round_trip``) in place and, while inside,
    every ``F.linear`` input that meets one of them through Q8_0 (the ``vec_dot_type`` of Q8_0 and Q4_0 alike;
    experts are slices of a stacked parameter: matched by storage)."""
    stores = set()
    for name, p in model.named_parameters():
        if p.dim() >= 2 and not name.endswith("mlp.gate.weight") and p.shape[-1] % QK8_0 == 0:
            with torch.no_grad():
                p.copy_(weight_round_trip(p))
            stores.add(p.untyped_storage().data_ptr())
    plain = F.linear

    def linear(x, weight, bias=None):
        if weight.untyped_storage().data_ptr() in stores:
            x = q8_0_round_trip(x)
        return plain(x, weight, bias)

    F.linear = linear  # nn.Linear and transformers' experts both call torch.nn.functional.linear
    try:
        yield
    finally:
        F.linear = plain


def compare(args: argparse.Namespace, peer: str, weight_round_trip: Callable[[torch.Tensor], torch.Tensor],
            quantization: str) -> None:
    """Print the table: ggml's ``peer`` numerics (``weight_round_trip`` on the weights, Q8_0 activations),
    mla-runtime with ``quantization`` and mla-runtime float32, each against transformers float32 on the same tokens."""
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    build_checkpoint(OUT)
    hf = AutoModelForCausalLM.from_pretrained(OUT, dtype=torch.float32).eval()
    prompts = make_prompts(args.prompts, args.prompt_len, CONFIG["vocab_size"], seed=0)
    seqs, ids, positions, ref = greedy_reference(hf, prompts, args.prompt_len, args.new_tokens)
    with torch.inference_mode():
        with ggml_products(hf, weight_round_trip):
            systems = {f"{peer}, ggml's numerics (transformers)": torch.log_softmax(
                hf(ids).logits[:, positions].float(), dim=-1)}
    del hf
    systems[f"mla-runtime {quantization}"] = mla_runtime_logprobs(str(OUT), "float32", seqs, args.prompt_len,
                                                                 quantization)
    systems["mla-runtime fp32"] = mla_runtime_logprobs(str(OUT), "float32", seqs, args.prompt_len)
    chosen = ids[:, args.prompt_len:].unsqueeze(-1)
    ref_chosen = ref.gather(-1, chosen)
    print(f"{args.prompts} prompts × {args.prompt_len} tokens, {args.new_tokens} float32-greedy tokens scored "
          "by each system; |log p - log p_fp32| of the chosen tokens, and KL(fp32 ‖ system) per position")
    print("| system | median | p90 | max | mean KL | argmax = float32's |\n|---|---:|---:|---:|---:|---:|")
    for name, lp in systems.items():
        err = (lp.gather(-1, chosen) - ref_chosen).abs().flatten()
        kl = F.kl_div(lp, ref, log_target=True, reduction="none").sum(-1).mean().item()
        agree = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"| {name} | {err.median().item():.4f} | {err.quantile(0.9).item():.4f} | {err.max().item():.3f} "
              f"| {kl:.2e} | {agree * 100:.1f}% |")



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    compare(args, "Q8_0", q8_0_round_trip, "int8")

if __name__ == "__main__":
    main()
