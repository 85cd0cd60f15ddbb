"""DeepSeek-V4 as its checkpoints ship against the same weights in bfloat16: resident weight bytes, load time and
greedy decode speed of one sequence, on a random V4 built by transformers' classes.

    python bench/bench_v4_stored.py --hidden 2048 --layers 4 --experts 32 --rounds 3 --threads 2

The model (``--hidden``, ``--layers``, ``--experts`` routed experts of ``--inter``; heads of 128 with 64 rotated,
V4's layer mix of CSA and HCA layers) is written twice: as the released checkpoints store it (FP8 128 x 128 blocks
with UE8M0 scales for the attention and shared-expert projections, MXFP4 routed experts; ``tests/test_v4_stored.py``'s
writer) and as its dequantisation in bfloat16. Each row is ``load_deepseek_v4`` of one of them in bfloat16; a round
decodes ``--tokens`` greedy tokens after a ``--prompt``-token prompt with each in turn (the median tok/s over
``--rounds``), and the two's tokens are compared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mla_runtime.models.deepseek_v4 import DeepseekV4ForCausalLM, load_deepseek_v4  # noqa: E402
from tests.test_v4_stored import write_stored  # noqa: E402


def build(args: argparse.Namespace, root: Path) -> None:
    """A random V4 of the asked size, saved by transformers in bfloat16 under ``root / "float"``."""
    import transformers as tf

    kinds = ["heavily_compressed_attention"] + ["compressed_sparse_attention", "heavily_compressed_attention"] * 8
    cfg = tf.DeepseekV4Config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
        head_dim=128, partial_rotary_factor=0.5, q_lora_rank=512, o_groups=4, o_lora_rank=256, sliding_window=128,
        layer_types=kinds[:args.layers], index_n_heads=8, index_head_dim=128, index_topk=64, hc_mult=4,
        n_routed_experts=args.experts, num_experts_per_tok=6, moe_intermediate_size=args.inter,
        mlp_layer_types=(["hash_moe"] + ["moe"] * args.layers)[:args.layers], max_position_embeddings=8192)
    torch.manual_seed(0)
    model = tf.DeepseekV4ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, args.experts, b.shape))
    model.save_pretrained(root / "float")


def weight_bytes(model: DeepseekV4ForCausalLM) -> int:
    floats = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return floats + sum(m.nbytes if hasattr(m, "blocks") else m.stored_bytes() for m in model.modules()
                        if hasattr(m, "blocks") or hasattr(m, "stored_bytes"))


def decode(model: DeepseekV4ForCausalLM, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """Greedy tokens and the decode tok/s (the prompt's prefill not timed)."""
    state = model.new_state()
    hidden = model(torch.tensor(prompt), state)
    out = [int(model.compute_logits(hidden[-1:]).argmax(-1))]
    start = time.perf_counter()
    while len(out) < tokens:
        out.append(int(model.compute_logits(model(torch.tensor(out[-1:]), state)).argmax(-1)))
    return out, (tokens - 1) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="v4_stored_"))
    build(args, root)
    write_stored(root / "float", root / "stored", root / "dequant", "fp4", ue8m0=True, block=(128, 128))
    models, loads = {}, {}
    for name, folder in (("stored (FP8 + MXFP4)", "stored"), ("bfloat16 (dequantised)", "dequant")):
        start = time.perf_counter()
        models[name] = load_deepseek_v4(root / folder, dtype=torch.bfloat16)
        loads[name] = time.perf_counter() - start
    prompt = torch.randint(2, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    speeds: dict[str, list[float]] = {n: [] for n in models}
    outs: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, model in models.items():
            outs[name], tps = decode(model, prompt, args.tokens)
            speeds[name].append(tps)
    print(f"V4 hidden {args.hidden}, {args.layers} layers, {args.experts} experts of {args.inter}; torch threads "
          f"{torch.get_num_threads()}; prompt {args.prompt}, {args.tokens} tokens, {args.rounds} rounds")
    print("| weights | resident MiB | load s | decode tok/s (median) |\n|---|---|---|---|")
    for name, model in models.items():
        print(f"| {name} | {weight_bytes(model) / 2**20:.1f} | {loads[name]:.2f} | "
              f"{statistics.median(speeds[name]):.2f} |")
    a, b = outs.values()
    print(f"greedy tokens equal: {sum(x == y for x, y in zip(a, b))} of {len(a)}")


if __name__ == "__main__":
    main()
