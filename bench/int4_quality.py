"""How far weight-only int4 inference is from float32, next to llama.cpp's Q4_0 on the same tokens.

    python bench/int4_quality.py --prompts 4 --new-tokens 24

The protocol of ``bench/bf16_quality.py`` and ``bench/int8_quality.py``: on the benchmark checkpoint, transformers
float32 generates ``--new-tokens`` greedy tokens after each 128-token prompt; every system then scores that same
continuation (teacher forcing) and the log-probability it gives each chosen token is compared with float32's.

- **mla-runtime int4**: ``quantize_model(model, "int4")`` on the loaded float32 model: every product weight an
  ``Int4Weight`` (Q4_0's weights: groups of 32 with a float16 scale, values in [-8, 7]); the activations entering
  each product rounded to int16 per row (the CPU kernel, up to 64 rows: every decode step) or kept float32 (the
  dequantising fallback: the prefill's 128-row products) — through its real paths (one prefill step through the
  paged latent cache, then one decode step per token). ``kv_b_proj`` keeps its dtype with its values rounded to
  bfloat16, and the embedding stays float32, as ``quantize_model`` does.
- **Q4_0 (ggml's numerics)**: transformers float32 with Q4_0 applied as llama.cpp's CPU backend applies it to a
  q4_0 GGUF: every matrix but the router (embedding, attention projections including ``kv_b``, experts, lm_head:
  llama-quantize's ``--pure`` mix; its default keeps the lm_head at Q6_K) rounded to Q4_0, and the activations
  entering each of those products quantised to Q8_0 (``vec_dot_type`` of Q4_0 is Q8_0). The weights are made by
  ``mla_runtime.layers.int4.quantize_q4_0`` (tested against a transcription of ggml's ``quantize_row_q4_0_ref``), so
  they are the very weights of the mla-runtime side; what differs is the activations and which matrices are
  quantised. This reproduces the arithmetic, not llama.cpp's code (summation order, the absorbed attention's order).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bf16_quality import greedy_reference, mla_runtime_logprobs
from int8_quality import ggml_products
from peer_checkpoint import CONFIG, build_checkpoint, make_prompts
from profile_decode import OUT

from mla_runtime.layers import quantization
from mla_runtime.layers.int4 import GROUP, Int4Weight, quantize_q4_0


def q4_0_round_trip(w: torch.Tensor) -> torch.Tensor:
    """``w [..., K]`` (``K`` a multiple of 32) through ggml's Q4_0 and back, in ``w``'s dtype."""
    flat = w.detach().reshape(-1, w.shape[-1])
    q, scales = quantize_q4_0(flat)
    wide = q.float().view(flat.shape[0], -1, GROUP) * scales.float().unsqueeze(-1)
    return wide.reshape(w.shape).to(w.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    # ``quantize_model`` makes every format ``WEIGHT_FORMATS`` names
    quantization.WEIGHT_FORMATS.setdefault("int4", Int4Weight)
    build_checkpoint(OUT)
    hf = AutoModelForCausalLM.from_pretrained(OUT, dtype=torch.float32).eval()
    prompts = make_prompts(args.prompts, args.prompt_len, CONFIG["vocab_size"], seed=0)
    seqs, ids, positions, ref = greedy_reference(hf, prompts, args.prompt_len, args.new_tokens)
    with torch.inference_mode():
        with ggml_products(hf, q4_0_round_trip):
            systems = {"Q4_0, ggml's numerics (transformers)": torch.log_softmax(
                hf(ids).logits[:, positions].float(), dim=-1)}
    del hf
    systems["mla-runtime int4"] = mla_runtime_logprobs(str(OUT), "float32", seqs, args.prompt_len, "int4")
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


if __name__ == "__main__":
    main()
