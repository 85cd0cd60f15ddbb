"""How far weight-only int4 inference is from float32, next to llama.cpp's Q4_0 on the same tokens.

    python bench/int4_quality.py --prompts 4 --new-tokens 24

The protocol of ``bench/bf16_quality.py`` and ``bench/int8_quality.py``: on the benchmark checkpoint, transformers
float32 generates ``--new-tokens`` greedy tokens after each 128-token prompt; every system then scores that same
continuation (teacher forcing) and the log-probability it gives each chosen token is compared with float32's.

- **mla-runtime int4**: ``quantize_model(model, "int4")`` on the loaded float32 model: every product weight an
  ``Int4Weight`` (Q4_0's weights: groups of 32 with a float16 scale, values in [-8, 7]); the activations entering
  each product rounded to int8 per group of 32 as Q8_0 (the CPU kernel, up to 64 rows: every decode step) or kept
  float32 (the dequantising fallback: the prefill's 128-row products) — through its real paths (one prefill step
  through the paged latent cache, then one decode step per token). ``kv_b_proj`` keeps its dtype with its values
  rounded to bfloat16, and the embedding stays float32, as ``quantize_model`` does.
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
from int8_quality import compare

from mla_runtime.layers.int4 import GROUP, quantize_q4_0


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
    compare(args, "Q4_0", q4_0_round_trip, "int4")

if __name__ == "__main__":
    main()
