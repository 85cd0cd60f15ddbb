"""How fast could *any* implementation decode the benchmark checkpoint on this machine?

    python bench/roofline.py --batch 1 8 --dtype float32 bfloat16 --threads 2

A decode step reads every weight it uses at least once, so for each (dtype, batch) it prints:

1. **weights/step** — the bytes of the weight matrices one decode step touches: every attention projection
   (``W_UK``/``W_UV`` included), the dense layer, the shared expert and the routed experts that the batch's
   tokens choose (``E · (1 − (1 − k/E)^B)`` of them, in expectation, for uniform routing), and the lm_head;
2. **bandwidth ceiling** — ``B ÷ (weights/step ÷ bandwidth)``, with the machine's streaming bandwidth
   measured here (best of 5 ``torch.sum`` over 1 GiB, same threads): no implementation decodes faster;
3. **GEMM-only ceiling** — the step's weight products alone, the checkpoint's own (packed) weights run back
   to back through ``cpu_gemm.linear`` / ``torch.bmm`` with the rows each would get, and nothing else
   (no attention over the context, norms, routing, sampling, Python between layers);
4. **mla-runtime** — its measured decode step (``LLMEngine.step``, median of ``--steps`` steps after a
   128-token prefill);
5. **transformers** — its end-to-end tokens/s (``generate``, ``--prompt-len`` in, ``--max-tokens`` out,
   the prefill included), measured in the same run, and 8× that: the project's target.

Both ceilings leave out the prefill and every non-GEMM operation, so a real system is below them; when the
bandwidth ceiling is under 8× transformers — whose figure here *includes* its prefill, which makes the
target easier — the target cannot be met on this machine by any implementation.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from peer_checkpoint import CONFIG, build_checkpoint, make_prompts

from mla_runtime import LLM, SamplingParams
from mla_runtime.layers.cpu_gemm import linear
from mla_runtime.layers.mlp import GatedMLP
from mla_runtime.layers.moe import MoE
from mla_runtime.loader import load_model

OUT = Path(__file__).resolve().parent / "out"


def stream_bandwidth(repeats: int = 5) -> float:
    """Bytes/s of the best ``torch.sum`` over a 1 GiB float32 tensor (read once per call)."""
    x = torch.ones(2**28)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def step_products(model, batch: int):
    """The decode step's weight products as (bytes, thunk) pairs, rows per product as in the real step."""
    dtype = model.dtype
    products = []

    def lin(weight, packed, rows):
        inp = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        products.append((weight.numel() * weight.element_size(), lambda: linear(inp, weight, None, packed)))

    def mlp(m: GatedMLP, rows):
        lin(m.gate_up_proj, m.gate_up_packed, rows)
        lin(m.down_proj, m.down_packed, rows)

    for layer in model.model.layers:
        attn = layer.self_attn
        lin(attn.qkv_a.plain, attn.qkv_a, batch)
        lin(attn.q_b_proj.weight, attn.q_b_proj.packed, batch)
        q_n = torch.randn(attn.n_h, batch, attn.d_n, dtype=dtype)
        o_lat = torch.randn(attn.n_h, batch, attn.d_c, dtype=dtype)
        w_uk, w_uv_t = attn.w_uk, attn.w_uv_t
        products.append((w_uk.numel() * w_uk.element_size(), lambda q=q_n, w=w_uk: torch.bmm(q, w)))
        products.append((w_uv_t.numel() * w_uv_t.element_size(), lambda o=o_lat, w=w_uv_t: torch.bmm(o, w)))
        lin(attn.o_proj.weight, attn.o_proj.packed, batch)
        if isinstance(layer.mlp, MoE):
            moe: MoE = layer.mlp
            experts = moe.experts
            k = moe.gate.cfg.num_experts_per_tok
            touched = max(1, round(expected_experts(experts.num_experts, k, batch)))
            rows = max(1, round(batch * k / touched))
            for e in range(touched):
                lin(experts.gate_up_proj[e], experts.gate_up_packed[e], rows)
                lin(experts.down_proj[e], experts.down_packed[e], rows)
            if moe.shared_experts is not None:
                mlp(moe.shared_experts, batch)
        else:
            mlp(layer.mlp, batch)
    lin(model.lm_head_weight, model.lm_head_packed, batch)
    return products


def gemm_only_step(products, repeats: int) -> float:
    for _, run in products:
        run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _, run in products:
            run()
        times.append(time.perf_counter() - t0)
    return min(times)


def mla_step(ckpt, dtype: str, batch: int, prompt_len: int, steps: int) -> float:
    llm = LLM(str(ckpt), dtype=dtype, max_model_len=prompt_len + 2 * steps + 64, max_num_seqs=batch,
              kv_cache_memory="1GiB", enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=2 * steps + 32, temperature=0, ignore_eos=True)
    for i, p in enumerate(make_prompts(batch, prompt_len, CONFIG["vocab_size"], seed=0)):
        engine.add_request(f"roof-{i}", {"prompt_token_ids": p}, params)
    for _ in range(steps):  # the prefill, then warm-up decode steps
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    llm.shutdown()
    return statistics.median(times)


def transformers_tok_s(ckpt, dtype: str, batch: int, prompt_len: int, max_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(make_prompts(batch, prompt_len, CONFIG["vocab_size"], seed=0))
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                       min_new_tokens=max_tokens, pad_token_id=0)
        return batch * max_tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128, help="transformers' generated tokens per prompt")
    ap.add_argument("--steps", type=int, default=24, help="mla-runtime decode steps timed")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = build_checkpoint(OUT / "peer_ckpt")
    bandwidth = stream_bandwidth()
    print(f"streaming bandwidth ({args.threads} threads, torch.sum over 1 GiB, best of 5): {bandwidth / 1e9:.1f} GB/s")
    print("| dtype | batch | weights/step MB | bandwidth ceiling tok/s | GEMM-only ceiling tok/s | "
          "mla-runtime decode tok/s | transformers tok/s (with prefill) | 8× transformers | "
          "bandwidth ceiling ÷ transformers |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dtype in args.dtype:
        model = load_model(str(ckpt), dtype=dtype)
        for batch in args.batch:
            products = step_products(model, batch)
            step_bytes = sum(b for b, _ in products)
            ceiling = batch / (step_bytes / bandwidth)
            gemm = batch / gemm_only_step(products, repeats=5)
            del products
            ours = batch / mla_step(ckpt, dtype, batch, args.prompt_len, args.steps)
            torch.set_num_threads(args.threads)  # the engine's thread tuner may have changed it
            if args.no_transformers:
                hf = float("nan")
            else:
                hf = transformers_tok_s(ckpt, dtype, batch, args.prompt_len, args.max_tokens)
            torch.set_num_threads(args.threads)
            print(f"| {dtype} | {batch} | {step_bytes / 1e6:.0f} | {ceiling:.1f} | {gemm:.1f} | {ours:.1f} | "
                  f"{hf:.1f} | {8 * hf:.1f} | {ceiling / hf:.1f}× |", flush=True)
        del model


if __name__ == "__main__":
    main()
