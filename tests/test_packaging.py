"""``pip install .`` (not editable) carries what a user needs: the wheel, installed into a fresh virtual
environment in a temporary folder, runs ``mla-runtime plan`` on a preset, ``mla-runtime serve --help``, and
serves the embedded demo model, all from outside the checkout.

Offline and fast: the wheel is built from a copy of the sources without build isolation; the new
environment has no pip and no packages of its own besides the wheel (installed with ``--no-deps``); a
``.pth`` line puts the test environment's site-packages after its own, for torch and the other
dependencies. A ``.pth`` line adds a directory without running the ``.pth`` files in it, so the
checkout's editable install stays invisible (asserted: ``mla_runtime.__file__`` is in the new environment).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

from mla_kernels import cpu_kernels

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "mla_runtime", "mla_kernels")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str], Path]:
    """(the new environment's bin folder, a clean environment for subprocesses, a cwd outside the checkout)."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name, **({"ignore": ignore} if (ROOT / name).is_dir() else {}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(tmp / "dist"), str(src)], cwd=tmp, env=env, timeout=300)
    wheel = next((tmp / "dist").glob("mla_runtime-*.whl"))
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp, env=env)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
          str(wheel)], cwd=tmp, env=env)
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   cwd=tmp, env=env).stdout.strip()
    (Path(purelib) / "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp / "elsewhere"
    work.mkdir()
    return venv / "bin", env, work


def test_the_wheel_carries_presets_demo_model_and_example(installed):
    bin_dir, env, work = installed
    code = ("import mla_runtime, mla_kernels; from importlib.resources import files; r = files('mla_runtime'); "
            "print(mla_runtime.__file__); print(mla_kernels.__file__); "
            "print(sorted(p.name for p in (r / 'model_configs').iterdir())); "
            "print(sorted(p.name for p in (r / 'demo_model').iterdir())); "
            "print((r / 'serving' / 'serve.example.yaml').is_file()); "
            "from mla_kernels import cpu_kernels, cpu_ops; "
            "print(all(p.is_file() for p in (*cpu_ops.sources(), *cpu_ops.HEADERS))); "
            f"print(cpu_kernels.failure() == {cpu_kernels.failure()!r})")
    lines = _run([str(bin_dir / "python"), "-c", code], cwd=work, env=env).stdout.splitlines()
    venv = str(bin_dir.parent)
    assert lines[0].startswith(venv) and lines[1].startswith(venv), lines  # not the checkout
    assert "deepseek-v3.json" in lines[2] and "kimi-k2.json" in lines[2]
    assert "model.safetensors" in lines[3] and "tokenizer.json" in lines[3] and "config.json" in lines[3]
    assert "speculative_token_map.json" in lines[3] and "mtp.safetensors" in lines[3]
    assert lines[4] == "True" and lines[5] == "True"  # the compiled kernels' C sources and header ship too
    assert lines[6] == "True"  # and build (or fail, for the same reason) from the installed package


def test_installed_cli_plans_a_preset_and_lists_serve_flags(installed):
    bin_dir, env, work = installed
    plan = _run([str(bin_dir / "mla-runtime"), "plan", "--model", "deepseek-v3", "--max-seq-len", "32768",
                 "--max-num-seqs", "16", "--device-memory", "141GiB", "--tensor-parallel-size", "16"],
                cwd=work, env=env).stdout
    assert "70,272" in next(line for line in plan.splitlines() if "latent cache per token" in line)
    serve = " ".join(_run([str(bin_dir / "mla-runtime"), "serve", "--help"], cwd=work, env=env).stdout.split())
    assert serve.startswith("usage: mla-runtime serve")
    assert "--revision REVISION" in serve and "(default: 8000)" in serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except OSError:
        return 0


def test_installed_cli_serves_the_demo_model(installed):
    bin_dir, env, work = installed
    port = _free_port()
    # a short drain: this is the installed package's test; shutdown's own timing is tested in test_server.py
    server = subprocess.Popen([str(bin_dir / "mla-runtime"), "serve", "--port", str(port), "--dtype", "float32",
                               "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--shutdown-timeout", "5"],
                              cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while _get(f"http://127.0.0.1:{port}/ready") != 200:
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, "the server did not become ready in 90 s"
            time.sleep(0.5)
        body = json.dumps({"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        assert len(answer["token_ids"]) == 8 and answer["text"]
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            out, _ = server.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # fail with what the server said and where its threads were
            server.send_signal(signal.SIGUSR1)  # the server dumps every thread's stack to stderr
            time.sleep(2)
            server.kill()
            out, _ = server.communicate()
            pytest.fail(f"the server did not exit within 120 s of SIGTERM; its output ended:\n{out[-12000:]}")
    assert server.returncode == 0, out
    assert "demo_model" in out and str(bin_dir.parent) in out  # the installed copy of the demo model served
