"""llama.cpp next to mla-runtime on the benchmark checkpoint: decode and prefill tokens/s, and each as a fraction of
the machine's streaming bandwidth (``python bench/compare_peers.py --decode-table``; see its docstring).

llama.cpp comes from ``bash bench/setup_peers.sh llama.cpp`` (``bench/llama.cpp/build/bin``; its converter's
environment ``bench/llama.cpp/venv``). GGUF files are written once per format under ``bench/out/gguf``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

from peer_checkpoint import CONFIG, make_prompts
from roofline import expected_experts, stream_bandwidth

HERE = Path(__file__).resolve().parent
LLAMA = HERE / "llama.cpp"
BIN = LLAMA / "build" / "bin"  # built for this CPU (GGML_NATIVE); the converter and llama-quantize always come from it
# the builds the benchmarks run, by instruction set (--isa): avx2 is bench/setup_peers.sh llama.cpp-avx2's
RUN_BINS = {"native": BIN, "avx2": LLAMA / "build-avx2" / "bin"}
_run_bin = [BIN]  # the build decode_table runs (its --isa)
CONVERTER_PYTHON = LLAMA / "venv" / "bin" / "python"
GGUF_DIR = HERE / "out" / "gguf"
# bytes per weight of each format (q8_0: 32 int8 + one float16 scale per block; q4_0 / int4: 16 bytes of nibbles +
# one float16 scale per 32); mla-runtime int8 adds a float32 scale per output row (negligible) and keeps kv_b_proj in
# float32
BYTES = {"f32": 4.0, "fp32": 4.0, "bf16": 2.0, "bf16w": 2.0, "q8_0": 34 / 32, "int8": 1.0, "q4_0": 18 / 32,
         "int4": 18 / 32}
PREFILL_REPEATS = 3  # prefill tok/s: the median of this many prompts per round, for both systems (one is noisy)
PEER_OF = {"fp32": "f32", "bf16": "bf16", "bf16w": "bf16", "int8": "q8_0", "int4": "q4_0"}
# mla-runtime's formats: (dtype, quantization, kv_cache_dtype); bf16w is a float32 model with bfloat16 weights over
# a bfloat16 latent cache, what dtype="auto" runs a bfloat16 checkpoint as where the compiled kernels read such weights
MLA_FORMATS = {"fp32": ("float32", None, "auto"), "bf16": ("bfloat16", None, "auto"),
               "bf16w": ("float32", "bf16", "bfloat16"), "int8": ("float32", "int8", "auto"),
               "int4": ("float32", "int4", "auto")}


def convert(checkpoint: Path, fmt: str) -> Path:
    """The checkpoint as a GGUF file of ``fmt`` (f32, bf16, q8_0: llama.cpp's converter; q4_0: its ``llama-quantize``
    from the f32 file, as llama.cpp's users make Q4_0 files)."""
    out = GGUF_DIR / f"{checkpoint.name}-{fmt}.gguf"
    if out.exists() and out.stat().st_mtime >= (checkpoint / "model.safetensors").stat().st_mtime:
        return out
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    if fmt == "q4_0":
        subprocess.run([str(BIN / "llama-quantize"), str(convert(checkpoint, "f32")), str(out), "q4_0"], check=True,
                       capture_output=True)
        return out
    subprocess.run([str(CONVERTER_PYTHON), str(HERE / "llama_convert.py"), str(checkpoint), "--outtype", fmt,
                    "--outfile", str(out)], check=True, capture_output=True)
    return out


def step_bytes(fmt: str, batch: int) -> float:
    """Weight bytes one decode step of ``batch`` sequences reads: every matrix once, in ``fmt``."""
    c = CONFIG
    d, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    latent = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    attn = d * c["q_lora_rank"] + c["q_lora_rank"] * heads * qk + d * latent + heads * c["v_head_dim"] * d
    kv_b = c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
    moe_layers = c["num_hidden_layers"] - c["first_k_dense_replace"]
    expert = 3 * d * c["moe_intermediate_size"]
    experts = expected_experts(c["n_routed_experts"], c["num_experts_per_tok"], batch) + c["n_shared_experts"]
    matrices = (c["num_hidden_layers"] * attn + c["first_k_dense_replace"] * 3 * d * c["intermediate_size"]
                + moe_layers * experts * expert + c["vocab_size"] * d)
    factors = 2.0 if fmt in ("int8", "int4") else BYTES[fmt]  # kv_b_proj: the decode kernel's bfloat16 copies
    return matrices * BYTES[fmt] + c["num_hidden_layers"] * kv_b * factors


def long_checkpoint(checkpoint: Path, positions: int) -> Path:
    """``checkpoint`` itself where its ``max_position_embeddings`` holds ``positions``; else a copy (its weights linked)
    whose config holds them: the benchmark's RoPE has no scaling, so the weights serve any length (the values at
    long positions are as random as the weights)."""
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("max_position_embeddings", 0) >= positions:
        return checkpoint
    out = checkpoint.parent / f"{checkpoint.name}_{positions}"
    out.mkdir(exist_ok=True)
    for f in checkpoint.iterdir():
        target = out / f.name
        if f.name != "config.json" and not target.exists():
            target.symlink_to(f.resolve())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}, indent=1))
    return out


# GGUF files whose weight repacking aborted llama.cpp on this CPU (on an Intel Xeon with AMX, q8_0's repacking fails
# ``GGML_ASSERT(*cur_backend_id != -1)``): they run with repacking off (``--repack 0``), and the table says so
NO_REPACK: set[Path] = set()


def _llama(tool: str, gguf: Path, args: list[str], repack_off: list[str]) -> subprocess.CompletedProcess:
    """Run a llama.cpp tool on ``gguf``; where its weight repacking aborts it (SIGABRT), again with ``repack_off``."""
    def run() -> subprocess.CompletedProcess:
        off = repack_off if gguf in NO_REPACK else []
        return subprocess.run([str(_run_bin[0] / tool), "-m", str(gguf), *args, *off], check=True,
                              capture_output=True, text=True)
    try:
        return run()
    except subprocess.CalledProcessError as e:
        if e.returncode != -6 or gguf in NO_REPACK or "GGML_ASSERT" not in (e.stderr or ""):
            raise
        NO_REPACK.add(gguf)
        return run()


def llama_bench(gguf: Path, threads: int, prompt_len: int, steps: int, prefill_repeats: int = PREFILL_REPEATS
                ) -> tuple[float, float]:
    """(decode tok/s at batch 1 with ``prompt_len`` tokens in context, prefill tok/s of ``prompt_len`` tokens), with
    flash attention (``-fa on``: llama.cpp's MLA path with flash attention, its fastest on a CPU)."""
    def run(reps: int, *extra: str) -> float:
        out = _llama("llama-bench", gguf, ["-t", str(threads), "-r", str(reps), "-o", "json", "-fa", "on", *extra],
                     ["--repack", "0"]).stdout
        row = json.loads(out)[0]
        return float(statistics.median(row["samples_ts"]) if row.get("samples_ts") else row["avg_ts"])

    decode = run(1, "-p", "0", "-n", str(steps), "-d", str(prompt_len))
    return decode, run(prefill_repeats, "-p", str(prompt_len), "-n", "0") if prefill_repeats else float("nan")


def llama_batched(gguf: Path, threads: int, prompt_len: int, steps: int, batch: int) -> float:
    """Decode tok/s of ``batch`` sequences after ``prompt_len`` tokens each (``llama-batched-bench``)."""
    out = _llama("llama-batched-bench", gguf,
                 ["-t", str(threads), "-tb", str(threads), "-c", str(batch * (prompt_len + steps) + 64), "-npp",
                  str(prompt_len), "-ntg", str(steps), "-npl", str(batch), "-fa", "on", "--output-format", "jsonl"],
                 ["--no-repack"])
    rows = [json.loads(line) for line in (out.stdout + out.stderr).splitlines() if line.startswith("{")]
    return float(rows[-1]["speed_tg"])


class MlaPeer:
    """One mla-runtime engine (``fmt``: ``MLA_FORMATS``; int8 / int4 / bf16w: fp32 weights quantised at load)."""

    def __init__(self, checkpoint: Path, fmt: str, threads: int, prompt_len: int, steps: int, batch: int) -> None:
        from mla_runtime import LLM, SamplingParams

        dtype, quantization, cache_dtype = MLA_FORMATS[fmt]
        length = prompt_len + steps + 32
        c = CONFIG  # the latent cache of every sequence at full length (float32 or bfloat16), with room to spare
        latent = 4 * c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * length * max(batch, 1)
        self.llm = LLM(str(long_checkpoint(checkpoint, length)), dtype=dtype, quantization=quantization,
                       kv_cache_dtype=cache_dtype, max_model_len=length, max_num_seqs=max(batch, 1),
                       kv_cache_memory=max(512 << 20, 2 * latent), enable_prefix_caching=False, num_threads=threads)
        self.params = SamplingParams(max_tokens=steps + 3, temperature=0, ignore_eos=True)
        self.once = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        self.prompts = make_prompts(max(batch, 1), prompt_len, CONFIG["vocab_size"], seed=0)
        self.steps, self.ids = steps, 0

    def _prefill(self, prompts: list[list[int]], params) -> float:  # type: ignore[no-untyped-def]
        """Seconds until every prompt has its first token (a long prompt takes several chunked steps)."""
        engine = self.llm.engine
        waiting = set()
        for p in prompts:
            engine.add_request(f"peer-{self.ids}", {"prompt_token_ids": p}, params)
            waiting.add(f"peer-{self.ids}")
            self.ids += 1
        t0 = time.perf_counter()
        while waiting:
            waiting -= {o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids}
        return time.perf_counter() - t0

    def run(self, batch: int, prefill_repeats: int = PREFILL_REPEATS) -> tuple[float, float]:
        """(decode tok/s: ``batch`` / median step after the prompt, prefill tok/s of the prompts; at batch 1, the
        median of ``prefill_repeats`` prefills)."""
        engine = self.llm.engine
        prompts = self.prompts[:batch]
        prefills = []
        # prefill only: the request ends after its token
        for _ in range(prefill_repeats - 1 if batch == 1 and prefill_repeats else 0):
            prefills.append(len(prompts[0]) / self._prefill(prompts, self.once))
            while engine.has_unfinished_requests():
                engine.step()
        prefill = batch * len(prompts[0]) / self._prefill(prompts, self.params)
        prefills.append(prefill if prefill_repeats or batch > 1 else float("nan"))
        engine.step()  # warm-up decode
        times = []
        for _ in range(self.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
        engine.pool.check_whole()
        return batch / statistics.median(times), statistics.median(prefills)


def _measure(args, systems: dict[str, object], batch: int) -> dict[str, dict[str, list[float]]]:
    """Interleaved rounds; ``batch`` 0 leaves the batched decode out (long contexts: its prefill alone is minutes)."""
    got: dict[str, dict[str, list[float]]] = {name: {"b1": [], "bn": [], "prefill": []} for name in systems}
    for r in range(args.rounds):
        for name, system in systems.items():
            if isinstance(system, MlaPeer):
                b1, prefill = system.run(1, args.prefill_repeats)
                bn = system.run(batch)[0] if batch else float("nan")
            else:
                b1, prefill = llama_bench(system, args.threads, args.prompt_len, args.decode_steps,  # type: ignore[arg-type]
                                          args.prefill_repeats)
                bn = llama_batched(system, args.threads, args.prompt_len, args.decode_steps,  # type: ignore[arg-type]
                                   batch) if batch else float("nan")
            for key, value in (("b1", b1), ("bn", bn), ("prefill", prefill)):
                got[name][key].append(value)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    return got


def decode_table(args) -> str:
    import torch

    torch.set_num_threads(args.threads)
    batch = args.decode_batch
    systems: dict[str, object] = {}
    notes = []
    _run_bin[0] = RUN_BINS[args.isa]
    if not (_run_bin[0] / "llama-bench").exists():
        setup = "llama.cpp" if args.isa == "native" else "llama.cpp-avx2"
        notes.append(f"llama.cpp: skipped ({_run_bin[0] / 'llama-bench'} missing; run bash bench/setup_peers.sh "
                     f"{setup})")
    else:
        for fmt in args.formats:
            systems[f"llama.cpp {fmt}"] = convert(args.checkpoint, fmt)
    for fmt in args.mla_formats:
        try:
            systems[f"mla-runtime {fmt}"] = MlaPeer(args.checkpoint, fmt, args.threads, args.prompt_len,
                                                    args.decode_steps, batch)
        except Exception as e:  # e.g. bf16 on a CPU without its fast path: reported, not fatal
            notes.append(f"mla-runtime {fmt}: fails at load: {str(e).splitlines()[0][:160]}")
    bw_before = stream_bandwidth()
    got = _measure(args, systems, batch)
    bw = statistics.median([bw_before, stream_bandwidth()])
    med = {name: {k: statistics.median(v) for k, v in m.items()} for name, m in got.items()}
    lines = [f"streaming bandwidth {bw / 1e9:.1f} GB/s (torch.sum over 1 GiB, {args.threads} threads; before "
             f"{bw_before / 1e9:.1f}); {args.threads} threads; decode after {args.prompt_len} prompt tokens, "
             f"{args.decode_steps} steps; medians of {args.rounds} interleaved rounds (llama.cpp with -fa on)", "",
             f"| system | decode b1 tok/s | decode b{batch} tok/s | prefill b1 tok/s | weights/step b1 | "
             f"b1 fraction of bandwidth | b{batch} fraction | ×llama.cpp b1 | ×llama.cpp b{batch} | "
             "×llama.cpp prefill |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in med.items():
        fmt = name.split()[-1]
        b1_bytes, bn_bytes = step_bytes(fmt, 1), step_bytes(fmt, max(batch, 1))
        peer = med.get(f"llama.cpp {PEER_OF.get(fmt, '')}")
        ratio = [f"{m[k] / peer[k]:.2f}" if peer else "–" for k in ("b1", "bn", "prefill")] \
            if name.startswith("mla") else ["", "", ""]
        lines.append(f"| {name} | {m['b1']:.1f} | {m['bn']:.1f} | {m['prefill']:.0f} | {b1_bytes / 1e6:.0f} MB | "
                     f"{m['b1'] * b1_bytes / bw:.2f} | {m['bn'] / max(batch, 1) * bn_bytes / bw:.2f} | "
                     + " | ".join(ratio) + " |")
    notes += [f"llama.cpp {path.stem.split('-')[-1]}: its weight repacking aborted on this CPU, so it ran with "
              "repacking off (--repack 0)" for path in sorted(NO_REPACK)]
    return "\n".join(lines + [""] + notes)
