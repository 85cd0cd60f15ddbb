"""The benchmark checkpoint: a DeepseekV3-layout model built with transformers, seeded.

hidden 1024, 8 layers, 16 heads, kv_lora_rank 512, qk_rope_head_dim 64, q_lora_rank 384, qk_nope_head_dim 64,
v_head_dim 64, 4 routed experts (top-2) + 1 shared, first layer dense, vocab 32000 — the latent widths
(512 + 64) are DeepSeek-V3's, the only ones vLLM's CPU MLA backend accepts. Weights are transformers'
own initialisation under ``torch.manual_seed(seed)``; the router's correction bias is randomised so that
it matters. The same (seed, config) always gives the same bytes, so every process of a comparison can
rebuild or reuse it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=4,
    n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=384,
    qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=1,
    max_position_embeddings=4096, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None,
    # implied by transformers' DeepseekV3 but read by vLLM (without them it skips the router's correction bias)
    topk_method="noaux_tc", scoring_func="sigmoid",
)


def demo_config() -> dict[str, Any]:
    """The embedded demo model's architecture (4 layers, hidden 256, d_c 128, vocab 8192) with random weights:
    a checkpoint small enough for hours of serving on two CPU cores (the soak in ``RESULTS_serving.md``)."""
    demo = json.loads((Path(__file__).resolve().parent.parent / "mla_runtime" / "demo_model" / "config.json")
                      .read_text())
    keep = set(CONFIG) | {"rms_norm_eps", "rope_theta"}
    return {k: v for k, v in demo.items() if k in keep}


def build_checkpoint(out: Path, seed: int = 0, config: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` to ``out`` (skipped when a build of the same seed and
    config is there); ``config`` defaults to ``CONFIG``."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = CONFIG if config is None else config
    stamp = out / "bench_build.json"
    want = {"seed": seed, "config": config}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return out
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**config)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    stamp.write_text(json.dumps(want))
    return out


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn uniformly (ids 0/1 — bos/eos — excluded)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


if __name__ == "__main__":
    import sys

    args = [a for a in sys.argv[1:] if a != "--demo-config"]
    print(build_checkpoint(Path(args[0] if args else "bench/out/peer_ckpt"),
                           config=demo_config() if "--demo-config" in sys.argv else None))
