"""Long-context decode of a hybrid model (MLA layers between Kimi Delta Attention layers) beside a pure-MLA model of
the same width: decode tok/s and the bytes a sequence holds, by context length.

    python bench/bench_hybrid_long.py --contexts 1024 16384 65536 131072 --threads 2

The models, random weights from transformers' own classes, loaded by the runtime:

- ``hybrid``: Kimi Linear (``kimi_linear``) at the benchmark checkpoint's width (``peer_checkpoint.CONFIG``: hidden
  1024, 8 layers, 16 MLA heads, d_c 512 + d_r 64, the same MoE), three KDA layers to one MLA layer as Kimi Linear
  (6 KDA + 2 MLA), KDA with ``--linear-heads`` heads of 128 (Kimi Linear's head size);
- ``mla``: the same config as DeepSeek-V3 (every layer MLA).

Each context is filled with random latents and, for the hybrid, random recurrent and convolution states (a prefill of
128k tokens through the models would take hours on a CPU and measures something else): a decode step's cost does not
depend on the values it reads. Then ``--batch`` sequences decode ``--steps`` tokens. The hybrid runs with the decode
kernels its layers chose (``compiled``: the CPU operators where the kernel plan has them) and again with the float32
torch reference in their place (``torch``). Rounds interleave the three; each cell is the median over rounds.

Bytes per sequence: the latent cache's bytes per token times the context (the MLA layers only, for the hybrid) plus the
hybrid's fixed state per sequence (``StateCache``): the state does not grow with the context.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_checkpoint import CONFIG  # noqa: E402

from mla_runtime.cache.latent_cache import LatentCache  # noqa: E402
from mla_runtime.cache.state_cache import StateCache  # noqa: E402
from mla_runtime.forward_batch import ForwardBatch  # noqa: E402
from mla_runtime.layers.kda import LinearKernels  # noqa: E402
from mla_runtime.loader import load_model  # noqa: E402

BLOCK = 64


def machine() -> str:
    """lscpu's model name (else /proc/cpuinfo's), the cores and the x86 levels."""
    model, flags = platform.processor(), ""
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout.splitlines()
        model = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name"))
        flags = next((line for line in lines if line.startswith("Flags")), "")
    except (OSError, StopIteration, subprocess.SubprocessError):
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags.split()]
    return f"{model}, {os.cpu_count()} cores, {'/'.join(isa) or 'no AVX2'}"


def build(out: Path, kind: str, linear_heads: int, max_len: int, layers: int) -> Path:
    """The ``hybrid`` (Kimi Linear) or ``mla`` (DeepSeek-V3) checkpoint of the benchmark width."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=CONFIG["vocab_size"], hidden_size=CONFIG["hidden_size"], num_hidden_layers=layers,
                  num_attention_heads=CONFIG["num_attention_heads"], num_key_value_heads=CONFIG["num_key_value_heads"],
                  kv_lora_rank=CONFIG["kv_lora_rank"], q_lora_rank=CONFIG["q_lora_rank"],
                  qk_rope_head_dim=CONFIG["qk_rope_head_dim"], qk_nope_head_dim=CONFIG["qk_nope_head_dim"],
                  v_head_dim=CONFIG["v_head_dim"], intermediate_size=CONFIG["intermediate_size"],
                  moe_intermediate_size=CONFIG["moe_intermediate_size"], num_experts_per_tok=2,
                  max_position_embeddings=max_len, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                  pad_token_id=None)
    if kind == "mla":
        cfg = {**CONFIG, "num_hidden_layers": layers, "max_position_embeddings": max_len}
        for key in ("topk_method", "scoring_func"):
            cfg.pop(key)
        tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**cfg)).eval().save_pretrained(out)
        return out
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    hf = tf.KimiLinearForCausalLM(tf.KimiLinearConfig(
        **common, num_local_experts=CONFIG["n_routed_experts"], linear_num_heads=linear_heads, linear_head_dim=128,
        linear_conv_kernel_dim=4, layer_types=types))
    hf.eval().save_pretrained(out)
    return out


def fill(cache: LatentCache, tokens: int, g: torch.Generator) -> None:
    """Random latents in the first ``tokens`` slots of every layer, and random states in every slot (in pieces)."""
    for layer in cache.layers:
        flat = layer.kv.view(-1, layer.kv.shape[-1])
        for s in range(0, tokens, 8192):
            rows = flat[s:min(s + 8192, tokens)]
            rows.copy_(torch.randn(rows.shape, generator=g).to(rows.dtype))
    for state in cache.states.layers if cache.states is not None else ():
        state.recurrent.copy_(0.05 * torch.randn(state.recurrent.shape, generator=g))
        state.conv.copy_(torch.randn(state.conv.shape, generator=g))


def decode_rate(model, cache: LatentCache, ctx: int, batch: int, steps: int) -> float:
    """tok/s of ``steps`` one-token decodes of ``batch`` sequences at context ``ctx`` (reading the same blocks; each
    sequence its own state slot)."""
    tables = [list(range(-(-(ctx + steps + 1) // BLOCK)))] * batch
    slots = list(range(batch)) if cache.states is not None else None
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(steps):
            fb = ForwardBatch.build([[7 + b] for b in range(batch)], [ctx + i] * batch, tables, BLOCK,
                                    state_slots=slots)
            model.compute_logits(model(fb, cache))
    return batch * steps / (time.perf_counter() - start)


def setup(kind: str, args: argparse.Namespace, tmp: Path, top: int):
    """The loaded model and its filled cache (with the hybrid's state slots, one per sequence of the batch)."""
    model = load_model(build(tmp / kind, kind, args.linear_heads, top + 1024, args.layers), dtype=args.dtype)
    cfg = model.config
    cache = LatentCache(model.num_cache_layers, -(-(top + args.steps + 1) // BLOCK), BLOCK, cfg.latent_dim,
                        model.dtype)
    if cfg.linear_attention is not None:
        cache.states = StateCache(cfg.linear_attention, args.batch)
    fill(cache, top, torch.Generator().manual_seed(0))
    return model, cache


def set_kernels(model, kernels: LinearKernels | None) -> list[LinearKernels]:
    """Put ``kernels`` in every linear layer (None: leave them); returns what they held."""
    held = [layer.kernels for layer in model.linear_layers()]
    for layer in model.linear_layers():
        layer.kernels = kernels or layer.kernels
    return held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384, 65536, 131072])
    ap.add_argument("--linear-heads", type=int, default=8, help="KDA heads of 128 (hidden 1024: 8)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (the hybrid: every fourth one MLA)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    top = max(args.contexts)
    with tempfile.TemporaryDirectory() as tmp:
        hybrid, hcache = setup("hybrid", args, Path(tmp), top)
        mla, mcache = setup("mla", args, Path(tmp), top)
    chosen = set_kernels(hybrid, None)
    state = hcache.states.bytes_per_slot if hcache.states is not None else 0
    print(f"# {machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"# hidden {hybrid.config.hidden_size}, {args.layers} layers (hybrid: {len(hybrid.linear_layers())} KDA of "
          f"{args.linear_heads} x 128 + {len(hybrid.attention_layers())} MLA), d_c 512 + d_r 64, {args.dtype}, batch "
          f"{args.batch}, {args.steps} steps x {args.rounds} rounds; hybrid decode kernels: {chosen[0].decode} "
          f"({chosen[0].reason}); caches filled with random latents and states, no prefill")
    print("| context | hybrid tok/s | hybrid (torch rule) tok/s | MLA tok/s | hybrid B/seq | MLA B/seq |\n"
          "|---:|---:|---:|---:|---:|---:|")
    results = []
    for ctx in args.contexts:
        rates: dict[str, list[float]] = {"hybrid": [], "torch": [], "mla": []}
        for _ in range(args.rounds + 1):  # the first round warms up
            for kind, model, cache in (("hybrid", hybrid, hcache), ("torch", hybrid, hcache), ("mla", mla, mcache)):
                set_kernels(hybrid, LinearKernels("torch", "the benchmark's reference") if kind == "torch" else None)
                rates[kind].append(decode_rate(model, cache, ctx, args.batch, args.steps))
                for layer, k in zip(hybrid.linear_layers(), chosen):
                    layer.kernels = k
        med = {k: statistics.median(v[1:]) for k, v in rates.items()}
        hbytes = ctx * hcache.bytes_per_token() + state
        mbytes = ctx * mcache.bytes_per_token()
        results.append({"context": ctx, **med, "hybrid_bytes": hbytes, "mla_bytes": mbytes})
        print(f"| {ctx:,} | {med['hybrid']:.2f} | {med['torch']:.2f} | {med['mla']:.2f} | {hbytes:,} | {mbytes:,} |",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
