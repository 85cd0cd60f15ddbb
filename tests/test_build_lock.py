"""A start never hangs on the kernel build: the build folder's OS lock dies with its holder, a lock file left by a
killed build is removed with a log line naming it, and a wait for a live builder has a deadline, after which the
process runs the torch paths and says why."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mla_kernels import cpu_ops
from tests.test_server import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
HOLD = ("import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.pwrite(fd, f'pid {os.getpid()} since now'.encode(), 0)\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")


def hold_lock(folder: Path) -> subprocess.Popen:
    """A live process holding ``folder``'s build lock (as a builder does while it builds)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder / cpu_ops.BUILD_LOCK)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_lock_file_without_a_live_builder_is_removed_at_once(tmp_path, caplog):
    """The extension builder's lock file, fresh or old, with no process holding the OS lock: a killed build's. It
    is removed at once, and the log names it."""
    left = tmp_path / cpu_ops.TORCH_LOCK
    left.write_text("")  # fresh: its age says nothing
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="mla_runtime"), cpu_ops.build_lock(tmp_path, wait_s=60):
        assert not left.exists()
        assert str(os.getpid()) in (tmp_path / cpu_ops.BUILD_LOCK).read_text()
    assert time.monotonic() - start < 5
    assert any(str(left) in r.getMessage() and "did not finish" in r.getMessage() for r in caplog.records)


def test_a_wait_for_a_live_builder_logs_and_ends_at_its_deadline(tmp_path, caplog):
    holder = hold_lock(tmp_path)
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="mla_runtime"), \
                pytest.raises(cpu_ops.BuildWaitTimeout, match=f"pid {holder.pid}"):
            with cpu_ops.build_lock(tmp_path, wait_s=1.0):
                pytest.fail("the lock was taken while another process held it")
        assert 1.0 <= time.monotonic() - start < 10
        waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
        assert waits and str(tmp_path / cpu_ops.BUILD_LOCK) in waits[0] and f"pid {holder.pid}" in waits[0]
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_builder_is_free_at_once(tmp_path):
    holder = hold_lock(tmp_path)
    (tmp_path / cpu_ops.TORCH_LOCK).write_text("")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    start = time.monotonic()
    with cpu_ops.build_lock(tmp_path, wait_s=30):
        assert not (tmp_path / cpu_ops.TORCH_LOCK).exists()
    assert time.monotonic() - start < 5


def test_the_wait_setting_is_checked(monkeypatch):
    monkeypatch.setenv(cpu_ops.BUILD_WAIT_ENV, "soon")
    with pytest.raises(ValueError, match="MLA_KERNEL_BUILD_WAIT_S"):
        cpu_ops.build_wait_s()
    monkeypatch.setenv(cpu_ops.BUILD_WAIT_ENV, "2.5")
    assert cpu_ops.build_wait_s() == 2.5
    monkeypatch.delenv(cpu_ops.BUILD_WAIT_ENV)
    assert cpu_ops.build_wait_s() == cpu_ops.BUILD_WAIT_S


def test_a_build_logs_where_it_builds_and_how_long_it_took(tmp_path, caplog):
    """A folder without the library: one line before the build naming the folder, one after with the seconds."""
    with caplog.at_level(logging.INFO, logger="mla_runtime"), cpu_ops.build_logged(tmp_path, "ops_key"):
        assert [r.getMessage() for r in caplog.records] == [
            f"building the typed CPU operators in {tmp_path}: once per cache folder for these sources, flags, "
            "compiler and torch installation (17-30 s on two cores)"]
        (tmp_path / "ops_key.so").write_bytes(b"")
    done = caplog.records[-1]
    assert done.levelno == logging.INFO and done.getMessage().endswith(" s")
    assert done.getMessage().startswith(f"built the typed CPU operators in {tmp_path} in ")


def test_a_load_of_a_built_library_logs_no_build(tmp_path, caplog):
    (tmp_path / "ops_key.so").write_bytes(b"")
    with caplog.at_level(logging.INFO, logger="mla_runtime"), cpu_ops.build_logged(tmp_path, "ops_key"):
        pass
    assert not [r for r in caplog.records if "built" in r.getMessage() or "building" in r.getMessage()]


def test_a_failed_build_logs_no_duration(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="mla_runtime"), pytest.raises(RuntimeError, match="compiler"):
        with cpu_ops.build_logged(tmp_path, "ops_key"):
            raise RuntimeError("compiler error")
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["building the typed CPU operators"]


BUILD = "from mla_kernels import cpu_ops; print(cpu_ops.failure(), flush=True)"


@pytest.mark.skipif(cpu_ops.failure() is not None, reason="the typed CPU operators do not build on this machine")
def test_a_server_starts_after_a_kernel_build_is_killed_midway(tmp_path):
    """SIGKILL a build half-way (its lock file left behind, some objects compiled), then start the server on the same
    kernel cache: it becomes ready, with the compiled operators, and its log names the lock it removed. A second
    start, while a live process holds the lock past the deadline, becomes ready on the torch paths and says why.

    The build starts from this process's own build folder less its library and one source's object (what a build
    killed after compiling the rest leaves), so the test compiles one file, not the whole extension, each time."""
    cache = tmp_path / "kernels"
    env = {**os.environ, "MLA_KERNEL_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    built = cpu_ops.cache_dir() / f"ops-{cpu_ops.build_key(cpu_ops._compiler())}"
    folder = cache / built.name
    shutil.copytree(built, folder, ignore=shutil.ignore_patterns("*.so", "gemv_f32.o", "*lock"))
    builder = subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (folder / cpu_ops.TORCH_LOCK).exists():  # the extension builder is under way
        assert builder.poll() is None and time.monotonic() < deadline, "the build did not start"
        time.sleep(0.05)
    time.sleep(1.0)
    assert builder.poll() is None, "the build finished before it could be killed"
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    lock = folder / cpu_ops.TORCH_LOCK
    assert lock.exists(), "the killed build left its lock file"
    assert not list(folder.glob("*.so")), "the killed build left no library"

    def serve(log: Path, extra_env: dict[str, str]) -> str:
        port = free_port()
        cmd = [sys.executable, str(ROOT / "server.py"), "--port", str(port), "--dtype", "float32"]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                    env={**env, **extra_env})
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, timeout=240, proc=proc)
            return httpx.get(base + "/metrics").text
        finally:
            proc.terminate()
            proc.wait(30)

    metrics = serve(tmp_path / "first.log", {})
    text = (tmp_path / "first.log").read_text()
    assert f"removing {lock}" in text and "did not finish" in text
    assert f"building the typed CPU operators in {lock.parent}" in text
    assert f"built the typed CPU operators in {lock.parent} in " in text
    assert "torch.ops.mla_kernels" in metrics and "unavailable" not in metrics

    holder = hold_lock(lock.parent)  # a live builder that never finishes
    try:
        metrics = serve(tmp_path / "second.log", {cpu_ops.BUILD_WAIT_ENV: "2"})
    finally:
        holder.kill()
        holder.wait()
    text = (tmp_path / "second.log").read_text()
    assert "waiting" in text and f"pid {holder.pid}" in text
    assert "unavailable: waited" in metrics and f"pid {holder.pid}" in metrics
