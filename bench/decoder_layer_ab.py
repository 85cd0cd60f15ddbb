"""The compiled decoder layer against the same layers called op by op, in one process, round by round.

    python bench/decoder_layer_ab.py --batch 1 8 --quantization none int8 --model peer twin

A float32 CPU decode step of one to eight rows runs each decoder layer as one call into the compiled kernels
(``mla_runtime.layers.decoder_kernel``). This times the engine's decode step with that call and without it (the
layer's torch and per-kernel calls: what a step ran before), alternating every ``--steps`` steps for ``--rounds``
rounds on the same engine and sequences, and prints the medians and their ratio. ``peer`` is the benchmark
checkpoint (``bench/peer_checkpoint.py``), ``twin`` its structural twin with tiny widths
(``bench/overhead_floor.py``): its step is almost all Python and dispatch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from overhead_floor import OUT, TWIN
from peer_checkpoint import build_checkpoint, make_prompts

from mla_runtime import LLM, SamplingParams
from mla_runtime.models import deepseek


def compare(model: str, batch: int, quantization: str | None, steps: int, rounds: int) -> tuple[float, float]:
    """Median decode-step milliseconds (compiled layer, op by op)."""
    path = build_checkpoint(OUT / "twin_ckpt", config=TWIN) if model == "twin" else build_checkpoint(OUT / "peer_ckpt")
    llm = LLM(str(path), dtype="float32", max_model_len=2048, max_num_seqs=batch, kv_cache_memory="512MiB",
              quantization=quantization)
    engine = llm.engine
    for i, prompt in enumerate(make_prompts(batch, 128, 1000, seed=0)):
        engine.add_request(f"ab-{i}", {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=2 * rounds * steps + 20, temperature=0.0, ignore_eos=True))
    for _ in range(10):
        engine.step()
    compiled = deepseek.DeepseekForCausalLM._decode_step
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(rounds):
            for on in (True, False):
                deepseek.DeepseekForCausalLM._decode_step = (  # type: ignore[method-assign]
                    compiled if on else lambda *a: None)
                t0 = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[on].append((time.perf_counter() - t0) / steps * 1e3)
    finally:
        deepseek.DeepseekForCausalLM._decode_step = compiled  # type: ignore[method-assign]
        llm.shutdown()
    return statistics.median(times[True]), statistics.median(times[False])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--quantization", nargs="+", default=["none", "int8"])
    ap.add_argument("--model", nargs="+", default=["peer"], choices=["peer", "twin"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| model | weights | batch | step ms, one call a layer | step ms, op by op | op by op ÷ one call |")
    print("|---|---|---:|---:|---:|---:|")
    for model in args.model:
        for quant in args.quantization:
            for batch in args.batch:
                on, off = compare(model, batch, None if quant == "none" else quant, args.steps, args.rounds)
                print(f"| {model} | {quant} | {batch} | {on:.2f} | {off:.2f} | {off / on:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
