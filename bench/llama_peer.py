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
BIN = LLAMA / "build" / "bin"
CONVERTER_PYTHON = LLAMA / "venv" / "bin" / "python"
GGUF_DIR = HERE / "out" / "gguf"
# bytes per weight of each format (q8_0: 32 int8 + one float16 scale per block); mla-runtime int8 adds a float32
# scale per output row (negligible) and keeps kv_b_proj in float32
BYTES = {"f32": 4.0, "fp32": 4.0, "bf16": 2.0, "q8_0": 34 / 32, "int8": 1.0}
PREFILL_REPEATS = 3  # prefill tok/s: the median of this many prompts per round, for both systems (one is noisy)
PEER_OF = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0"}


def convert(checkpoint: Path, fmt: str) -> Path:
    """The checkpoint as a GGUF file of ``fmt`` (f32, bf16, q8_0), converted by llama.cpp's own converter."""
    out = GGUF_DIR / f"{checkpoint.name}-{fmt}.gguf"
    if out.exists() and out.stat().st_mtime >= (checkpoint / "model.safetensors").stat().st_mtime:
        return out
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
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
    factors = 2.0 if fmt == "int8" else BYTES[fmt]  # kv_b_proj: the decode kernel's bfloat16 copies under int8
    return matrices * BYTES[fmt] + c["num_hidden_layers"] * kv_b * factors


def llama_bench(gguf: Path, threads: int, prompt_len: int, steps: int) -> tuple[float, float]:
    """(decode tok/s at batch 1 with ``prompt_len`` tokens in context, prefill tok/s of ``prompt_len`` tokens)."""
    def run(reps: int, *extra: str) -> float:
        out = subprocess.run([str(BIN / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", str(reps), "-o",
                              "json", *extra], check=True, capture_output=True, text=True).stdout
        row = json.loads(out)[0]
        return float(statistics.median(row["samples_ts"]) if row.get("samples_ts") else row["avg_ts"])

    return (run(1, "-p", "0", "-n", str(steps), "-d", str(prompt_len)),
            run(PREFILL_REPEATS, "-p", str(prompt_len), "-n", "0"))


def llama_batched(gguf: Path, threads: int, prompt_len: int, steps: int, batch: int) -> float:
    """Decode tok/s of ``batch`` sequences after ``prompt_len`` tokens each (``llama-batched-bench``)."""
    out = subprocess.run([str(BIN / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
                          "-c", str(batch * (prompt_len + steps) + 64), "-npp", str(prompt_len), "-ntg", str(steps),
                          "-npl", str(batch), "--output-format", "jsonl"],
                         check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out.stdout + out.stderr).splitlines() if line.startswith("{")]
    return float(rows[-1]["speed_tg"])


class MlaPeer:
    """One mla-runtime engine (``fmt``: fp32, bf16, int8 = fp32 weights quantised at load)."""

    def __init__(self, checkpoint: Path, fmt: str, threads: int, prompt_len: int, steps: int, batch: int) -> None:
        from mla_runtime import LLM, SamplingParams

        dtype = {"fp32": "float32", "int8": "float32", "bf16": "bfloat16"}[fmt]
        self.llm = LLM(str(checkpoint), dtype=dtype, quantization="int8" if fmt == "int8" else None,
                       max_model_len=prompt_len + steps + 32, max_num_seqs=batch, kv_cache_memory="512MiB",
                       enable_prefix_caching=False, num_threads=threads)
        self.params = SamplingParams(max_tokens=steps + 3, temperature=0, ignore_eos=True)
        self.once = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        self.prompts = make_prompts(batch, prompt_len, CONFIG["vocab_size"], seed=0)
        self.steps, self.ids = steps, 0

    def run(self, batch: int) -> tuple[float, float]:
        """(decode tok/s: ``batch`` / median step after the prompt, prefill tok/s of the prompts' one step; at batch
        1, the median of ``PREFILL_REPEATS`` prefills)."""
        engine = self.llm.engine
        prefills = []
        for _ in range(PREFILL_REPEATS - 1 if batch == 1 else 0):  # prefill only: the request ends after its step
            engine.add_request(f"peer-{self.ids}", {"prompt_token_ids": self.prompts[0]}, self.once)
            self.ids += 1
            t0 = time.perf_counter()
            engine.step()
            prefills.append(len(self.prompts[0]) / (time.perf_counter() - t0))
            while engine.has_unfinished_requests():
                engine.step()
        for p in self.prompts[:batch]:
            engine.add_request(f"peer-{self.ids}", {"prompt_token_ids": p}, self.params)
            self.ids += 1
        t0 = time.perf_counter()
        engine.step()
        prefills.append(batch * len(self.prompts[0]) / (time.perf_counter() - t0))
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
    got: dict[str, dict[str, list[float]]] = {name: {"b1": [], "bn": [], "prefill": []} for name in systems}
    for r in range(args.rounds):
        for name, system in systems.items():
            if isinstance(system, MlaPeer):
                b1, prefill = system.run(1)
                bn = system.run(batch)[0]
            else:
                b1, prefill = llama_bench(system, args.threads, args.prompt_len, args.decode_steps)  # type: ignore[arg-type]
                bn = llama_batched(system, args.threads, args.prompt_len, args.decode_steps, batch)  # type: ignore[arg-type]
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
    if not (BIN / "llama-bench").exists():
        notes.append(f"llama.cpp: skipped ({BIN / 'llama-bench'} missing; run bash bench/setup_peers.sh llama.cpp)")
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
             f"{args.decode_steps} steps; medians of {args.rounds} interleaved rounds", "",
             f"| system | decode b1 tok/s | decode b{batch} tok/s | prefill b1 tok/s | weights/step b1 | "
             f"b1 fraction of bandwidth | b{batch} fraction | ×llama.cpp b1 | ×llama.cpp b{batch} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in med.items():
        fmt = name.split()[-1]
        b1_bytes, bn_bytes = step_bytes(fmt, 1), step_bytes(fmt, batch)
        peer = med.get(f"llama.cpp {PEER_OF.get(fmt, '')}")
        ratio = [f"{m[k] / peer[k]:.2f}" if peer else "–" for k in ("b1", "bn")] if name.startswith("mla") \
            else ["", ""]
        lines.append(f"| {name} | {m['b1']:.1f} | {m['bn']:.1f} | {m['prefill']:.0f} | {b1_bytes / 1e6:.0f} MB | "
                     f"{m['b1'] * b1_bytes / bw:.2f} | {m['bn'] / batch * bn_bytes / bw:.2f} | "
                     + " | ".join(ratio) + " |")
    return "\n".join(lines + [""] + notes)
