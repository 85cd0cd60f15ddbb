"""A real-size model on this machine: DeepSeek-V2-Lite's exact config and tensor names (15.7 B parameters, 31 GB of
bfloat16), random weights, loaded with int8 and int4 (and W8A8, W4A16: ``--modes pre:w8a8,pre:w4a16``) from the
bfloat16 checkpoint, from pre-quantised (compressed-tensors) copies of it and from the peers' own GGUF files
(``gguf:q8_0``, ``gguf:q4_0``, ``gguf:q4_k_m``: the very files they run), next to llama.cpp and ik_llama.cpp running
the same weights as q8_0 / q4_0 / Q4_K_M GGUF.

    python bench/bench_real_size.py --work /tmp/real_size               # everything (about an hour on 2 cores)
    python bench/bench_real_size.py --work /tmp/real_size --systems mla  # mla-runtime only
    python bench/bench_real_size.py --work /tmp/real_size --layers 4 --systems mla  # a shorter model, same shapes

(llama.cpp tells DeepSeek-V2-Lite, whose queries have no low-rank projection, from the larger models by its layer
count: it loads the config at 26 or 27 layers only.)

For each mla-runtime mode a fresh process loads the model and reports its peak resident memory (sampled every few
milliseconds, and the kernel's own high-water mark ``VmHWM``), the load's seconds (importing torch and the runtime
included), decode tokens/s at batch 1, 4 and 8 (the median step after the prompt) and prefill tokens/s of one
prompt of 128 and of 512 tokens (batch 1, to the first token's logits; the median of the rounds). Before the timed
rounds each process runs one untimed prompt of 512 tokens, as ``llama-bench`` runs a warm-up: it also touches the
pages of nearly every routed expert, which a GGUF file mapped here faults in on first use where llama.cpp's load
maps them all. Batches of 4 and
8 are timed twice (``WORKLOADS``): every sequence the same, which is what ``llama-batched-bench`` times and so what
the peers' columns hold, and a different prompt per sequence (mla-runtime only), which is what a server sees and
which reads several times the routed experts. The process guards its
own memory: past ``--rss-limit`` it stops itself with a message instead of letting the OOM killer pick a victim.
llama.cpp (``bash bench/setup_peers.sh llama.cpp``) runs its own converter (q8_0) and ``llama-quantize`` (q4_0 from
the q8_0 file, ``--allow-requantize``: the timing does not depend on the values), then ``llama-bench`` (batch 1;
its prefill with ``-p``, flash attention on) and ``llama-batched-bench`` (batch 8); its load time is the wall time
of a process that loads the file and generates one token (llama.cpp maps the file with ``MAP_POPULATE``, so its load
maps every page of it; it repacks q4_0 for its AVX2 kernels). Every peer process runs in ``--work`` (where it
writes its ``llama.log``), started by a small launcher process (``Launcher``) that reads back its peak resident
memory (``os.wait4``'s ``ru_maxrss``); a peer's "peak RSS" is the largest over its runs of a format, and counts the
pages of the GGUF file it maps and touched. The two systems run one after the other (their
weights do not fit this machine's memory together), each over the same files on the same warm page cache.

The "fraction of bandwidth" is the weight bytes one decode token reads (every matrix of a step once: attention,
the dense MLP, the shared experts, the routed experts a batch is expected to touch, the lm_head; in each system's
format) times tokens/s, over the machine's streaming bandwidth (``roofline.stream_bandwidth``).
Results: ``bench/RESULTS_real_size.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PRESET = HERE.parent / "mla_runtime" / "model_configs" / "deepseek-v2-lite.json"
PROMPT_LEN, STEPS = 64, 16
BATCHES = (1, 4, 8)
# Decode at batch > 1 runs two workloads. "same": every sequence of the batch has the same prompt and, greedy, the same
# tokens -- what llama-batched-bench times (it feeds token 0 at every position of every sequence), so its routed
# experts are a batch-1 step's; the peers' batch columns are this. "distinct": a different random prompt per sequence,
# as a server's batch is, so the batch touches ~3.5x (batch 4) and ~6x (batch 8) the routed experts of one token at
# DeepSeek-V2-Lite's 64 experts, top-6; mla-runtime only (llama-batched-bench cannot feed different prompts).
WORKLOADS = ("same", "distinct")
PREFILL_LENS = (128, 512)  # prompts whose prefill (batch 1, one step, the first token's logits) is timed
# bytes per weight of each format, scales included (q8_0/q4_0: a float16 scale per 32 weights; int8: a bfloat16 scale
# per row, negligible; int4: a float16 scale per 32; w8a8: a float32 scale per row, negligible; w4a16: a float16 scale
# and a byte zero point per 128 -- DeepSeek-V2-Lite's dense down_proj, whose 10944 inputs are not whole groups of 128,
# takes int4's groups of 32, a 0.3% share of the weights left out here)
BYTES = {"int8": 1.0, "int4": 18 / 32, "w8a8": 1.0, "w4a16": 0.5 + 3 / 128, "q8_0": 34 / 32, "q4_0": 18 / 32}
LLAMA_TYPES = {"q8_0": "q8_0", "q4_0": "q4_0", "q4_k_m": "Q4_K_M"}  # --llama-formats: llama-quantize's type names


def high_water_mark() -> int:
    """The kernel's peak RSS of this process (``VmHWM``; unlike ``ru_maxrss``, not inherited across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemoryGuard:
    """Samples this process's RSS; past ``limit`` bytes it prints why and ends the process (exit 3)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.peak, self.done = limit, 0, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.is_set():
            now = rss()
            self.peak = max(self.peak, now)
            if now > self.limit:
                print(json.dumps({"error": f"resident memory {now / 2**30:.1f} GiB passed the guard's "
                                           f"{self.limit / 2**30:.1f} GiB: stopped"}), flush=True)
                os._exit(3)
            time.sleep(0.005)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(self.peak, high_water_mark())


def step_bytes(cfg: dict, fmt: str, batch: int) -> float:
    """Weight bytes one decode step of ``batch`` rows reads in ``fmt`` (see the module docstring)."""
    from roofline import expected_experts

    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    q = d * heads * qk if not cfg.get("q_lora_rank") else d * cfg["q_lora_rank"] + cfg["q_lora_rank"] * heads * qk
    attn = q + d * latent + heads * cfg["v_head_dim"] * d
    kv_b = cfg["kv_lora_rank"] * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
    dense = cfg["first_k_dense_replace"]
    moe_layers = cfg["num_hidden_layers"] - dense
    expert = 3 * d * cfg["moe_intermediate_size"]
    experts = expected_experts(cfg["n_routed_experts"], cfg["num_experts_per_tok"], batch) + cfg["n_shared_experts"]
    matrices = (cfg["num_hidden_layers"] * attn + dense * 3 * d * cfg["intermediate_size"]
                + moe_layers * experts * expert + cfg["vocab_size"] * d)
    # kv_b_proj: llama.cpp stores it in the file's format; mla-runtime's decode kernel reads bfloat16 copies
    factors = BYTES[fmt] if fmt.startswith("q") else 2.0
    return matrices * BYTES[fmt] + cfg["num_hidden_layers"] * kv_b * factors


def decode_key(batch: int, workload: str = "same") -> str:
    """A decode result's key: "1", "4" (the same prompt in every sequence), "4d" (distinct prompts)."""
    return f"{batch}d" if workload == "distinct" else str(batch)


# -- one mla-runtime measurement, in its own process -------------------------------------------------------------
def worker(path: str, quantization: str, rounds: int, threads: int, limit: int, temperature: float) -> None:
    t0 = time.perf_counter()  # the load's seconds include importing torch and the runtime, as llama.cpp's its start
    import torch

    from mla_runtime import LLM, SamplingParams

    torch.set_num_threads(threads)
    base = rss()
    guard = MemoryGuard(limit)
    llm = LLM(path, dtype="float32", quantization=None if quantization == "stored" else quantization,
              max_model_len=max(PROMPT_LEN + STEPS, *PREFILL_LENS) + 64,
              max_num_seqs=max(BATCHES), kv_cache_memory="256MiB", enable_prefix_caching=False, num_threads=threads)
    load_s = time.perf_counter() - t0
    loaded = rss()
    engine = llm.engine
    params = SamplingParams(max_tokens=STEPS + 2, temperature=temperature, ignore_eos=True)
    vocab = json.loads((Path(path) / "config.json" if Path(path).is_dir() else PRESET).read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, min(vocab, 30000), (PROMPT_LEN,), generator=g).tolist() for _ in range(max(BATCHES))]
    warm_up = torch.randint(100, min(vocab, 30000), (max(PREFILL_LENS),), generator=torch.Generator().manual_seed(1))
    engine.add_request("warm-up", {"prompt_token_ids": warm_up.tolist()}, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():  # untimed (the module docstring)
        engine.step()
    runs = [(b, w) for b in BATCHES for w in (WORKLOADS if b > 1 else WORKLOADS[:1])]
    tok_s: dict[str, list[float]] = {decode_key(b, w): [] for b, w in runs}
    prefill: dict[int, list[float]] = {k: [] for k in PREFILL_LENS}
    n = 0
    for _ in range(rounds):
        for batch, workload in runs:
            for i in range(batch):
                engine.add_request(f"r{n}", {"prompt_token_ids": prompts[i if workload == "distinct" else 0]}, params)
                n += 1
            engine.step()  # the prompts
            engine.step()  # a first decode step
            times = []
            for _ in range(STEPS):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            while engine.has_unfinished_requests():
                engine.step()
            tok_s[decode_key(batch, workload)].append(batch / statistics.median(times))
        for length in PREFILL_LENS:  # a fresh prompt each time: no prefix is cached
            prompt = torch.randint(100, min(vocab, 30000), (length,), generator=g).tolist()
            engine.add_request(f"r{n}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, ignore_eos=True))
            n += 1
            t = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            prefill[length].append(length / (time.perf_counter() - t))
    peak = guard.stop()
    print(json.dumps({"load_s": load_s, "peak_rss": peak, "loaded_rss": loaded, "base_rss": base,
                      "tok_s": {k: statistics.median(v) for k, v in tok_s.items()},
                      "tok_s_rounds": tok_s,
                      "prefill": {str(k): statistics.median(v) for k, v in prefill.items()},
                      "prefill_rounds": {str(k): v for k, v in prefill.items()}}), flush=True)


def run_worker(path: Path, quantization: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(path), "--quantization", quantization,
           "--rounds", str(args.rounds), "--threads", str(args.threads), "--rss-limit", str(args.rss_limit),
           "--temperature", str(args.temperature)]
    print(f"  mla-runtime {quantization} from {path.name} ...", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:300]}
    return json.loads(lines[-1])


# -- the peers' processes: their output, wall time and peak resident memory --------------------------------------
@dataclass(frozen=True)
class Ran:
    """A finished peer process: exit status, wall seconds, peak RSS in bytes (``ru_maxrss``), its output."""

    rc: int
    wall_s: float
    maxrss: int
    stdout: str
    stderr: str


def run_rusage(cmd: list[str], cwd: Path) -> Ran:
    """Run ``cmd`` in ``cwd`` to its end and return its peak resident set: ``os.wait4``'s ``ru_maxrss`` of that child
    (KiB on Linux), its output read back from temporary files (``wait4`` reaps the child, so ``communicate`` cannot)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Ran(proc.returncode, wall, usage.ru_maxrss * 1024, out.read().decode(errors="replace"),
                   err.read().decode(errors="replace"))


def launcher() -> None:
    """``--launcher``: run each command read from stdin (a JSON line ``{"cmd", "cwd"}``) and answer a JSON line of its
    ``Ran``."""
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(run_rusage(req["cmd"], Path(req["cwd"])).__dict__), flush=True)


class Launcher:
    """A small process that starts the peers' commands. Linux carries a process's high-water mark of resident memory
    across ``exec``, so a child of this benchmark (which imports torch and writes quantised copies) would report at
    least the benchmark's own peak as its ``ru_maxrss``: the launcher starts before the benchmark grows, and
    ``floor`` is what its children inherit (a ``true``'s ``ru_maxrss``), tens of MiB."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--launcher"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.floor = self.run(["true"], Path("/")).maxrss

    def run(self, cmd: list[str], cwd: Path, check: bool = True) -> Ran:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, "cwd": str(cwd)}) + "\n")
        self.proc.stdin.flush()
        ran = Ran(**json.loads(self.proc.stdout.readline()))
        if check and ran.rc != 0:
            raise RuntimeError(f"{Path(cmd[0]).name} exited {ran.rc}: {(ran.stderr or ran.stdout)[-500:]}")
        return ran

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


# -- the llama.cpp family of peers -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Peer:
    """A llama.cpp build and the flags it runs with: ``bench`` for llama-bench (decode at batch 1, prefill),
    ``batched`` for llama-batched-bench (decode at batch 4 and 8). ``depth_flag``: how its llama-bench times decode
    after a prompt (mainline ``-d PROMPT``; ik_llama.cpp's ``-gp PROMPT,STEPS``, "tg@pp")."""

    name: str
    bin: Path
    bench: tuple[str, ...]
    batched: tuple[str, ...]
    setup: str
    depth_flag: str = "-d"

    def decode_args(self) -> tuple[str, ...]:
        """llama-bench's arguments for STEPS decode tokens after PROMPT_LEN tokens of context."""
        if self.depth_flag == "-gp":
            return ("-p", "0", "-n", "0", "-gp", f"{PROMPT_LEN},{STEPS}")
        return ("-p", "0", "-n", str(STEPS), "-d", str(PROMPT_LEN))

    def version(self) -> str:
        said = self.bin.parent.parent / "VERSION"
        return said.read_text().strip() if said.exists() else ""


PEERS = {
    # mainline: flash attention for prefill (its fastest MLA path on a CPU), as llama-bench's users run it
    "llama.cpp": Peer("llama.cpp", HERE / "llama.cpp" / "build" / "bin", (), (),
                      "bash bench/setup_peers.sh llama.cpp"),
    # ik_llama.cpp's best CPU flags for DeepSeek models: MLA with the latent cache (-mla 3), flash attention, the
    # fused MoE, and the weights repacked into its row-interleaved layouts at load (-rtr; it reads the file instead
    # of mapping it)
    "ik_llama.cpp": Peer("ik_llama.cpp", HERE / "ik_llama.cpp" / "build" / "bin",
                         ("-mla", "3", "-fa", "1", "-fmoe", "1", "-rtr", "1"), ("-mla", "3", "-fa", "on", "-rtr"),
                         "IK_LLAMA_SRC=DIR bash bench/setup_peers.sh ik_llama.cpp", depth_flag="-gp"),
}


def batched_speed(text: str) -> float:
    """S_TG (decode tokens/s) of llama-batched-bench's last row: its jsonl line, or its table (ik_llama.cpp prints
    only the table: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |)."""
    rows = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
    if rows:
        return float(rows[-1]["speed_tg"])
    table = [ln.strip().strip("|").split("|") for ln in text.splitlines() if ln.strip().startswith("|")]
    numbers = [cells for cells in table if len(cells) == 10 and cells[0].strip().isdigit()]
    if not numbers:
        raise RuntimeError(f"no result row in llama-batched-bench's output: {text[-300:]}")
    return float(numbers[-1][7])


def llama_measure(gguf: Path, args, peer: Peer, launcher: Launcher) -> dict:
    """One peer on one GGUF file: its load, decode and prefill speeds, and its peak RSS (the largest ``ru_maxrss`` of
    its processes). Each runs in ``--work``, where it writes its ``llama.log``."""
    peak = 0

    def run(cmd: list[str]) -> Ran:
        nonlocal peak
        ran = launcher.run(cmd, args.work)
        peak = max(peak, ran.maxrss)
        return ran

    def bench(batch: int) -> float:
        if batch == 1:
            out = run([str(peer.bin / "llama-bench"), "-m", str(gguf), "-t", str(args.threads), "-r", "1",
                       "-o", "json", *peer.decode_args(), *peer.bench])
            return float(json.loads(out.stdout)[0]["avg_ts"])
        cmd = [str(peer.bin / "llama-batched-bench"), "-m", str(gguf), "-t", str(args.threads), "-tb",
               str(args.threads), "-c", str(batch * (PROMPT_LEN + STEPS) + 64), "-npp", str(PROMPT_LEN),
               "-ntg", str(STEPS), "-npl", str(batch), *peer.batched,
               *(() if peer.name == "ik_llama.cpp" else ("--output-format", "jsonl"))]
        for attempt in range(3):  # llama-batched-bench now and then ends (status 0) without printing its row
            out = run(cmd)
            try:
                return batched_speed(out.stdout + out.stderr)
            except RuntimeError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def start() -> float:
        """Seconds from the process's start to its first generated token (one token of prompt, one generated)."""
        return run([str(peer.bin / "llama-batched-bench"), "-m", str(gguf), "-t", str(args.threads), "-tb",
                    str(args.threads), "-c", "256", "-npp", "1", "-ntg", "1", "-npl", "1", *peer.batched]).wall_s

    def prefill(length: int) -> float:
        """Prompt tokens/s of one ``length``-token prompt (``llama-bench -p``, flash attention on)."""
        flags = peer.bench if "-fa" in peer.bench else ("-fa", "on")
        out = run([str(peer.bin / "llama-bench"), "-m", str(gguf), "-t", str(args.threads), "-r", "1",
                   "-o", "json", "-p", str(length), "-n", "0", *flags])
        return float(json.loads(out.stdout)[0]["avg_ts"])

    tok_s: dict[int, list[float]] = {b: [] for b in BATCHES}
    prefills: dict[int, list[float]] = {k: [] for k in PREFILL_LENS}
    loads = []
    for _ in range(args.rounds):
        loads.append(start())
        for batch in BATCHES:
            tok_s[batch].append(bench(batch))
        for length in PREFILL_LENS:
            prefills[length].append(prefill(length))
    return {"load_s": statistics.median(loads), "peak_rss": peak, "rss_floor": launcher.floor,
            "tok_s": {str(b): statistics.median(v) for b, v in tok_s.items()},
            "tok_s_rounds": {str(b): v for b, v in tok_s.items()},
            "prefill": {str(k): statistics.median(v) for k, v in prefills.items()},
            "prefill_rounds": {str(k): v for k, v in prefills.items()}, "version": peer.version()}


def llama_files(src: Path, work: Path, formats: list[str]) -> dict[str, Path]:
    """The peers' GGUF files of ``src``: q8_0 by llama.cpp's converter, the others by its ``llama-quantize`` from the
    q8_0 file (``--allow-requantize``: the timing does not depend on the values)."""
    from llama_peer import BIN, CONVERTER_PYTHON

    q8 = work / "v2lite-q8_0.gguf"
    if not q8.exists():
        print("  converting to q8_0 GGUF (llama.cpp's converter) ...", flush=True)
        subprocess.run([str(CONVERTER_PYTHON), str(HERE / "llama_convert.py"), str(src), "--outtype", "q8_0",
                        "--outfile", str(q8)], check=True, capture_output=True, cwd=work)
    files = {}
    for fmt in formats:
        out = work / f"v2lite-{fmt}.gguf"
        if not out.exists():
            print(f"  llama-quantize q8_0 -> {LLAMA_TYPES[fmt]} ...", flush=True)
            subprocess.run([str(BIN / "llama-quantize"), "--allow-requantize", str(q8), str(out), LLAMA_TYPES[fmt],
                            str(os.cpu_count())], check=True, capture_output=True, cwd=work)
        files[fmt] = out
    return files


def gguf_bytes_per_weight(path: Path) -> float:
    """The mean bytes a weight takes in a GGUF file's product matrices (a mixed file's, Q4_K_M's, across its types)."""
    from gguf import GGUFReader

    tensors = [t for t in GGUFReader(path).tensors if len(t.shape) >= 2 and "token_embd" not in t.name]
    return sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


def warm(path: Path) -> None:
    """Read a file or folder once, so every system starts from the same warm page cache."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    for f in files:
        with open(f, "rb", buffering=0) as h:
            while h.read(64 << 20):
                pass


# -- the report -------------------------------------------------------------------------------------------------
def machine() -> str:
    from compare_peers import machine_description

    return machine_description()


def report(results: dict, cfg: dict, bandwidth: float, args) -> str:
    gib = 2**30
    keys = [decode_key(b) for b in BATCHES] + [decode_key(b, "distinct") for b in BATCHES if b > 1]
    heads = [f"b{b} tok/s" for b in BATCHES] + [f"b{b} distinct" for b in BATCHES if b > 1]
    lens = " | ".join(f"prefill {k} tok/s" for k in PREFILL_LENS)
    versions = [f"{n}: {r['version']}" for n, r in results.items() if r.get("version")]
    floors = [r["rss_floor"] for r in results.values() if r.get("rss_floor")]
    lines = [f"Machine: {machine()}; streaming bandwidth {bandwidth / 1e9:.1f} GB/s (roofline.stream_bandwidth).",
             f"Model: DeepSeek-V2-Lite's config ({cfg['num_hidden_layers']} layers), random bfloat16 weights; "
             f"{args.threads} threads, {args.rounds} rounds, prompt {PROMPT_LEN} tokens, {STEPS} decode steps "
             f"({'greedy' if args.temperature == 0 else f'temperature {args.temperature}'} in mla-runtime); "
             f"b4/b8: every sequence the same (as llama-batched-bench); distinct: a prompt each; "
             f"prefill: one prompt of each length at batch 1.",
             *([f"Peers: {'; '.join(versions)}."] if versions else []),
             *([f"Peak RSS: mla-runtime's, its process's (sampled, and the kernel's VmHWM); a peer's, the largest "
                f"ru_maxrss (os.wait4) of its processes over a format's runs. RSS counts the pages of a mapped file "
                f"that a process touched: llama.cpp maps the GGUF file and reads its weights through the mapping, so "
                f"its figure includes the file's pages (shared with the page cache, not memory of its own); "
                f"ik_llama.cpp with -rtr reads the file and repacks the weights into its own memory. At most "
                f"{max(floors) / 2**20:.0f} MiB of a peer's figure is the high-water mark its launcher passes on "
                f"across exec."] if floors else []),
             "",
             f"| system | weights from | peak RSS | load s | {' | '.join(heads)} | b1 bandwidth fraction | {lens} |",
             "|---|---|---:|---:|" + "---:|" * (len(keys) + 1 + len(PREFILL_LENS))]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | | {r['error']} | |" + " |" * (len(keys) + 1 + len(PREFILL_LENS)))
            continue
        fmt = name.split()[-1]
        frac = step_bytes(cfg, fmt, 1) * r["tok_s"]["1"] / bandwidth
        peak = f"{r['peak_rss'] / gib:.2f} GiB" if "peak_rss" in r else "–"
        load = f"{r['load_s']:.1f}" if r.get("load_s") is not None else "–"
        tok = " | ".join(f"{r['tok_s'][k]:.2f}" if k in r["tok_s"] else "–" for k in keys)
        pre = " | ".join(f"{r['prefill'][str(k)]:.1f}" for k in PREFILL_LENS)
        lines.append(f"| {name} | {r.get('source', '')} | {peak} | {load} | {tok} | {frac:.2f} | {pre} |")
    return "\n".join(lines + [""] + ratios(results)) + "\n"


# mla-runtime's rows and the peers' format each is compared with
PAIRS = (("bf16 int8", "q8_0"), ("pre int8", "q8_0"), ("gguf q8_0", "q8_0"), ("bf16 w8a8", "q8_0"),
         ("pre w8a8", "q8_0"), ("bf16 int4", "q4_0"), ("pre int4", "q4_0"), ("gguf q4_0", "q4_0"),
         ("gguf q4_k_m", "q4_k_m"), ("bf16 w4a16", "q4_0"), ("pre w4a16", "q4_0"), ("bf16 w4a16", "q4_k_m"),
         ("pre w4a16", "q4_k_m"))


def ratios(results: dict) -> list[str]:
    """mla-runtime over each peer's same-size format, by batch and prefill length (batches: the same workload)."""
    out = []
    for ours, fmt in PAIRS:
        a = results.get(f"mla-runtime {ours}")
        for peer in PEERS:
            b = results.get(f"{peer} {fmt}")
            if not a or not b or "error" in a or "error" in b:
                continue
            dec = ", ".join(f"batch {k} {a['tok_s'][str(k)] / b['tok_s'][str(k)]:.2f}×" for k in BATCHES)
            pre = ", ".join(f"prefill {k} {a['prefill'][str(k)] / b['prefill'][str(k)]:.2f}×" for k in PREFILL_LENS)
            out.append(f"- {ours} ÷ {peer} {fmt}: {dec}, {pre}"
                       + (f"; load {a['load_s'] / b['load_s']:.2f}× {peer}'s" if b.get("load_s") else ""))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/mla_real_size"), help="folder for the checkpoints")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (default: the real 27)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", default="mla,llama.cpp,ik_llama.cpp",
                    help="what to measure: mla (mla-runtime) and the peers llama.cpp, ik_llama.cpp (a peer that is not "
                         "built is named in the report with the command that builds it)")
    ap.add_argument("--modes", default="bf16:int8,bf16:int4,pre:int8,pre:int4",
                    help="mla-runtime modes: SOURCE:QUANTIZATION, SOURCE bf16 (quantised while loading), pre "
                         "(a pre-quantised checkpoint) or gguf (the peers' own GGUF file of a --llama-formats "
                         "type, as stored: gguf:q8_0, gguf:q4_0, gguf:q4_k_m)")
    ap.add_argument("--rss-limit", type=int, default=int(21.5 * 2**30), help="bytes: a worker stops itself past it")
    ap.add_argument("--keep", action="store_true", help="keep the pre-quantised copies")
    ap.add_argument("--llama-formats", default="q8_0,q4_0", help="the peers' formats to measure (q8_0, q4_0, q4_k_m)")
    ap.add_argument("--out", type=Path, default=None, help="write the report here too")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="mla-runtime's decode sampling (0: greedy, as llama-bench's; 1.0: the API's default)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quantization", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--launcher", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.quantization, args.rounds, args.threads, args.rss_limit, args.temperature)
        return
    if args.launcher:
        launcher()
        return
    args.work = args.work.resolve()  # the peers run in it: every path they are given is absolute
    systems = args.systems.split(",")
    # started first, while this process is small: its children inherit its high-water mark (Launcher)
    peer_launcher = Launcher() if any(name in PEERS for name in systems) else None

    from roofline import stream_bandwidth

    from mla_runtime.compressed import write_quantized_checkpoint
    from mla_runtime.random_checkpoint import write_random_checkpoint

    cfg = json.loads(PRESET.read_text())
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    args.work.mkdir(parents=True, exist_ok=True)
    src = args.work / f"v2lite-bf16-{cfg['num_hidden_layers']}"
    if not (src / "model.safetensors.index.json").exists():
        print(f"writing {src} (random bfloat16 weights) ...", flush=True)
        t0 = time.perf_counter()
        write_random_checkpoint(cfg, src)
        print(f"  {time.perf_counter() - t0:.0f} s", flush=True)
    bandwidth = stream_bandwidth()
    results: dict[str, dict] = {}
    modes = args.modes.split(",") if "mla" in systems else []
    peers = [PEERS[name] for name in systems if name in PEERS]
    formats = args.llama_formats.split(",") if peers else []
    files = {}
    if formats or any(m.startswith("gguf:") for m in modes):
        files = llama_files(src, args.work, sorted(set(formats) | {m[5:] for m in modes if m.startswith("gguf:")}))
        BYTES.update({f: gguf_bytes_per_weight(path) for f, path in files.items() if f not in BYTES})
    for mode in modes:
        source, quantization = mode.split(":")
        path = src
        if source == "pre":
            path = args.work / f"{src.name}-{quantization}"
            if not (path / "config.json").exists():
                t0 = time.perf_counter()
                write_quantized_checkpoint(src, path, quantization)
                print(f"  wrote {path.name} in {time.perf_counter() - t0:.0f} s", flush=True)
        elif source == "gguf":
            path = files[quantization]
        warm(path)
        # a pre-quantised copy loads as stored (a w4a16 copy is an int4 checkpoint: asking for w4a16 would be refused)
        r = run_worker(path, "stored" if source in ("gguf", "pre") else quantization, args)
        r["source"] = {"bf16": "bf16 checkpoint", "pre": "pre-quantised", "gguf": "the peers' GGUF"}[source]
        results[f"mla-runtime {source} {quantization}"] = r
        print(f"  {json.dumps(r)}", flush=True)
        if source == "pre" and not args.keep:
            shutil.rmtree(path)
    for peer in [p for p in peers if not (p.bin / "llama-bench").exists()]:
        for fmt in formats:
            results[f"{peer.name} {fmt}"] = {"error": f"not built ({peer.setup})"}
    for fmt in formats:
        warm(files[fmt])
        for peer in [p for p in peers if (p.bin / "llama-bench").exists()]:
            print(f"  {peer.name} {fmt} ...", flush=True)
            assert peer_launcher is not None
            r = llama_measure(files[fmt], args, peer, peer_launcher)
            r["source"] = "GGUF"
            results[f"{peer.name} {fmt}"] = r
            print(f"  {json.dumps(r)}", flush=True)
    if peer_launcher is not None:
        peer_launcher.close()
    text = report(results, cfg, bandwidth, args)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
