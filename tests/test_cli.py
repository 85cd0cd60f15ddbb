"""The ``mla-runtime`` command: subcommands, --help defaults, exit codes, and the first five minutes (a taken
port before the model loads, plan's verdict, a sweep from --model and --eval-text alone, progress bars)."""

from __future__ import annotations

import io
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mla_runtime import LLM, SamplingParams
from mla_runtime.cli import COMMANDS, main
from mla_runtime.serving.config import DEMO_MODEL, OPTIONS

ROOT = Path(__file__).resolve().parent.parent
PLAN_V3 = ["--model", "deepseek-v3", "--max-seq-len", "32768", "--max-num-seqs", "16",
           "--device-memory", "141GiB", "--tensor-parallel-size", "16"]


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_plan_subcommand_prints_the_per_token_cost(capsys):
    assert main(["plan", *PLAN_V3]) == 0
    out = capsys.readouterr().out
    assert "70,272" in next(line for line in out.splitlines() if "latent cache per token" in line)
    assert "FITS" in out


def test_plan_exits_1_when_the_sequences_do_not_fit(capsys):
    assert main(["plan", *PLAN_V3[:4], "--max-num-seqs", "64", *PLAN_V3[6:], "--max-num-batched-tokens", "8192"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out.upper()


def test_plan_errors_name_the_subcommand(capsys):
    assert main(["plan", "--model", "no-such-preset", "--device-memory", "80GiB"]) == 2
    assert capsys.readouterr().err.startswith("mla-runtime plan: error: model: 'no-such-preset'")


def test_python_m_plan_prints_no_runpy_warning():
    done = subprocess.run([sys.executable, "-m", "mla_runtime.plan", *PLAN_V3], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "70,272" in done.stdout
    assert "RuntimeWarning" not in done.stderr and "found in sys.modules" not in done.stderr


def test_serve_help_lists_every_server_flag_with_its_default(capsys):
    text = _help("serve", capsys)
    assert text.startswith("usage: mla-runtime serve")
    flat = " ".join(text.split())
    for opt in OPTIONS.values():
        assert opt.flag in text
    assert "--port PORT port to listen on (0: any free port) (default: 8000)" in flat
    assert "--max-num-seqs MAX_NUM_SEQS sequences running at once (default: 64)" in flat
    assert ("--model MODEL checkpoint directory, GGUF file, or hub repo id org/name (default: the embedded demo "
            "model)") in flat
    assert "(default: none)" not in flat and "(default: None)" not in flat


@pytest.mark.parametrize("command, expected", [
    ("plan", "--max-num-seqs MAX_NUM_SEQS sequences that must fit at once (default: 256)"),
    ("sweep", "--ranks RANKS comma-separated; capped at the model's d_c (default: 512,256,128,64,32)"),
    ("bench", "--max-tokens MAX_TOKENS tokens generated per prompt (default: 64)"),
    ("token-map", "--size SIZE tokens in the map (the special tokens come on top) (default: 32768)"),
    ("warm", "--kv-cache-write-through write every full block to the disk tier as soon as it is complete "
             "(default: False)"),
    ("rollout", "--url URL the deployment (default: http://127.0.0.1:8000)"),
])
def test_every_subcommand_help_shows_defaults(command, expected, capsys):
    flat = " ".join(_help(command, capsys).split())
    assert expected in flat
    assert "(default: None)" not in flat


def test_top_level_help_names_the_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert set(COMMANDS) == {"serve", "plan", "sweep", "bench", "hash", "warm", "token-map", "quantize",
                             "rollout"}
    with pytest.raises(SystemExit) as done:
        main(["warp"])
    assert done.value.code == 2


def test_a_taken_port_fails_before_the_model_loads(tmp_path, capsys):
    shutil.copy(DEMO_MODEL / "config.json", tmp_path / "config.json")  # no weights: loading would fail
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(tmp_path), "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"mla-runtime serve: error: cannot listen on 127.0.0.1:{port}: ")
    assert "in use" in err[0] and "start-up failed" not in err[0]


def test_sweep_needs_no_method_or_calibration_flags(tmp_path, monkeypatch, capsys):
    """Beyond --model and --eval-text, only flags that make it quick: no --methods, no calibration."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "eval.txt").write_text((ROOT / "mla_runtime" / "plan.py").read_text()[:1500])
    assert main(["sweep", "--model", str(DEMO_MODEL), "--eval-text", "eval.txt", "--ranks", "32",
                 "--cache-dtypes", "int8", "--decode-steps", "0", "--window", "64", "--max-eval-tokens", "128",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    methods = {row.split("|")[1].strip() for row in out.splitlines() if re.match(r"\| (full|svd|pca) ", row)}
    assert methods == {"full", "svd"}  # no calibration text: no PCA
    assert (tmp_path / "bench" / "out" / "sweep" / "sweep.csv").is_file()


def test_bench_prints_throughput_on_the_demo_model(capsys):
    assert main(["bench", "--num-prompts", "3", "--min-len", "4", "--max-len", "12", "--max-tokens", "5",
                 "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "3 prompts, 4-12 tokens" in out and "5 out each" in out
    assert float(re.search(r"LLM\.generate \(float32\):\s+([\d.]+) tok/s", out).group(1)) > 0
    assert main(["bench", "--min-len", "9", "--max-len", "3"]) == 1
    assert "--max-len (3) must be >= --min-len (9)" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_show_on_a_terminal_only(monkeypatch, capsys):
    llm = LLM(str(DEMO_MODEL), dtype="float32", max_model_len=64, kv_cache_memory="4MiB")
    sp = SamplingParams(max_tokens=2, temperature=0)
    llm.generate(["a", "b"], sp)
    assert "generate" not in capsys.readouterr().err  # stderr is not a terminal under pytest
    llm.generate(["a", "b"], sp, use_tqdm=True)
    err = capsys.readouterr().err
    assert "generate: 100%" in err and "2/2" in err
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    llm.generate(["a"], sp)
    LLM(str(DEMO_MODEL), dtype="float32", max_model_len=64, kv_cache_memory="4MiB").shutdown()
    monkeypatch.undo()
    shown = terminal.getvalue()
    assert "generate: 100%" in shown and "loading weights" in shown
    llm.shutdown()
