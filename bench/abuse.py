"""Abuse suite: starts ``server.py`` (the demo model, small limits) and attacks it as a hostile client and an
unlucky operator would, printing PASS/FAIL with the figures of each probe.

    python bench/abuse.py                      # every probe (about 3 minutes on 2 cores)
    python bench/abuse.py --probes slow_reader,large_prompt

Probes:
- slow_reader: 4 streaming chats (n=2, top_logprobs 20, 1900 tokens) from sockets with a 4 KiB receive
  buffer that never read; every slot must come back within the request timeout (the stall timeout ends them).
- large_prompt: 3.8 MB prompts, 4 at a time, while /health is polled every 10 ms: /health p99 < 100 ms,
  each prompt refused with 400 naming the prompt.
- slowloris: 300 connections sending one header byte per second: all closed after --header-timeout; then
  more connections than --max-connections: the extra ones closed at once.
- nested_json: ``[`` × 100,000 → 400 naming body, counted as invalid.
- disconnect_storm: 100 streams reset (RST) after a random number of events: every one counted, no slot held.
- streamed_batch: a batch of 3 prompts streamed 100 times equals the non-streamed answer each time.
- rss: resident memory after each of two identical load runs (bounded cache vs growth).
- drain: SIGTERM while a stream runs: /ready and new requests get 503, the stream finishes, exit 0.
- error_injection: a second server with ``MLA_FAULT_INJECTION=stream:3``: the stream ends with an error
  event and ``[DONE]``, counted as error (not client_disconnect), no internal text.
- hung_rank: a third server with 2 tensor-parallel ranks; SIGSTOP rank 1 during a request: /health turns
  503 within --step-timeout (+ 1 s), the process drains and exits non-zero.
After the probes on the main server, every latent-cache block must be free (``/metrics`` block gauges).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
MAIN_FLAGS = ["--max-num-seqs", "4", "--max-queue", "4", "--request-timeout", "45", "--stream-stall-timeout", "5",
              "--header-timeout", "5", "--max-connections", "400", "--shutdown-timeout", "10"]
RESULTS: list[tuple[str, bool, str]] = []


# -- the server process -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, flags: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(tempfile.gettempdir()) / f"mla_abuse_{self.port}.log", "w")  # noqa: SIM115 - stop()
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "server.py"), "--port", str(self.port), *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        end = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, f"server exited during start-up; see {self.log.name}"
            assert time.monotonic() < end, "server not ready after 300 s"
            try:
                if httpx.get(self.base + "/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def metrics(self) -> dict[tuple, float]:
        text = httpx.get(self.base + "/metrics", timeout=30).text
        return {(s.name, *sorted(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def outcomes(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in self.metrics().items():
            if key[0] == "mla_requests_total":
                outcome = dict(key[1:])["outcome"]
                out[outcome] = out.get(outcome, 0) + value
        return out

    def wait_idle(self, timeout: float) -> float:
        """Seconds until nothing is in flight, running or holding a block; raises after ``timeout``."""
        t0 = time.monotonic()
        while True:
            m = self.metrics()
            if (m[("mla_requests_in_flight",)] == 0 and m[("mla_latent_cache_blocks_used",)] == 0
                    and m[("mla_running_sequences",)] == 0 and m[("mla_queue_depth",)] == 0):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"still busy after {timeout} s: in flight {m[('mla_requests_in_flight',)]}, "
                                   f"blocks used {m[('mla_latent_cache_blocks_used',)]}")
            time.sleep(0.1)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        return code


def record(name: str, ok: bool, figures: str) -> None:
    RESULTS.append((name, ok, figures))
    print(f"{'PASS' if ok else 'FAIL'}  {name:18s} {figures}", flush=True)


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0)) for k, v in after.items() if v - before.get(k, 0)}


def http_request(path: str, body: dict | bytes) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


# -- probes on the main server ----------------------------------------------------------------------
def probe_slow_reader(srv: Server) -> None:
    before = srv.outcomes()
    body = {"messages": [{"role": "user", "content": "def hello(world):"}], "max_tokens": 1900, "n": 2,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "stream": True}
    socks = []
    t0 = time.monotonic()
    for _ in range(4):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", srv.port))
        s.sendall(http_request("/v1/chat/completions", body))
        socks.append(s)
    try:
        srv.wait_idle(120)
    except TimeoutError as e:
        record("slow_reader", False, str(e))
        return
    finally:
        for s in socks:
            s.close()
    got = diff(srv.outcomes(), before)
    record("slow_reader", time.monotonic() - t0 <= 45 + 5 and sum(got.values()) == 4,
           f"4 non-reading streams (8 sequences): slots free after {time.monotonic() - t0:.1f} s "
           f"(request timeout 45 s, stall timeout 5 s); outcomes {got}")


def _health_latencies(base: str, stop: threading.Event, lat: list[float]) -> None:
    """Poll /health every 10 ms until ``stop``; a thread of its own, so the uploads do not delay it here."""
    with httpx.Client(base_url=base, timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = client.get("/health")
            lat.append(time.perf_counter() - t0)
            assert r.status_code == 200
            time.sleep(0.01)


async def _large_prompts(base: str, n: int) -> list[tuple[int, str, float]]:
    body = json.dumps({"prompt": "def hello(world):\n    return world + 1\n" * 100_000, "max_tokens": 4}).encode()
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        async def one() -> tuple[int, str, float]:
            t0 = time.perf_counter()
            r = await client.post("/generate", content=body, headers={"Content-Type": "application/json"})
            return r.status_code, r.json()["error"]["param"] if r.status_code != 200 else "", time.perf_counter() - t0
        out = []
        for _ in range(n // 4):
            out += await asyncio.gather(*(one() for _ in range(4)))
        return out


def probe_large_prompt(srv: Server) -> None:
    idle: list[float] = []
    stop = threading.Event()
    threading.Timer(2.0, stop.set).start()
    _health_latencies(srv.base, stop, idle)  # the baseline: /health on an idle server, same client
    base = statistics.quantiles(idle, n=100)
    lat: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=_health_latencies, args=(srv.base, stop, lat))
    poller.start()
    time.sleep(0.5)
    answers = asyncio.run(_large_prompts(srv.base, 32))
    stop.set()
    poller.join()
    q = statistics.quantiles(lat, n=100)
    refused = all(status == 400 and param == "prompt" for status, param, _ in answers)
    worst = max(t for _, _, t in answers)
    record("large_prompt", q[98] < 0.1 and refused,
           f"32 × 3.8 MB prompts: all 400 naming prompt: {refused}, slowest answer {worst * 1e3:.0f} ms; "
           f"/health over {len(lat)} probes p50 {q[49] * 1e3:.1f} ms p99 {q[98] * 1e3:.1f} ms (< 100 ms; idle "
           f"p50 {base[49] * 1e3:.1f} ms p99 {base[98] * 1e3:.1f} ms, p99 ratio {q[98] / base[98]:.1f}×)")


async def _slowloris(port: int, n: int, header_timeout: float) -> tuple[int, float]:
    line = b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 1000
    closed_at: list[float] = []
    t0 = time.monotonic()

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for b in line:
                writer.write(bytes([b]))
                await writer.drain()
                try:
                    if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                        break
                except TimeoutError:
                    continue
        except (ConnectionError, OSError):
            pass
        closed_at.append(time.monotonic() - t0)
        writer.close()

    await asyncio.wait_for(asyncio.gather(*(one() for _ in range(n))), header_timeout + 60)
    return len(closed_at), max(closed_at)


def _over_the_cap(port: int, n: int) -> int:
    """Open ``n`` idle connections; how many the server closed at once (within 1 s)."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    refused = 0
    for s in socks:
        s.settimeout(0.002)
        try:
            refused += s.recv(1) == b""
        except TimeoutError:
            pass
        except ConnectionResetError:
            refused += 1
    for s in socks:
        s.close()
    return refused


def probe_slowloris(srv: Server) -> None:
    closed, last = asyncio.run(_slowloris(srv.port, 300, 5))
    time.sleep(0.5)
    refused = _over_the_cap(srv.port, 450)
    ok_health = httpx.get(srv.base + "/health").status_code == 200
    record("slowloris", closed == 300 and last < 5 + 3 and refused >= 50 and ok_health,
           f"300 one-byte-per-second clients: all closed, the last after {last:.1f} s (header timeout 5 s); "
           f"450 idle connections with max_connections 400: {refused} closed at once")


def probe_nested_json(srv: Server) -> None:
    before = srv.outcomes()
    r = httpx.post(srv.base + "/generate", content=b"[" * 100_000, headers={"Content-Type": "application/json"})
    err = r.json().get("error", {})
    got = diff(srv.outcomes(), before)
    record("nested_json", r.status_code == 400 and err.get("param") == "body" and got == {"invalid": 1},
           f"[ × 100,000: {r.status_code} {err.get('message')!r}; counted {got}")


def probe_disconnect_storm(srv: Server) -> None:
    before = srv.outcomes()
    rng = random.Random(0)
    body = http_request("/generate", {"prompt": "def hello(world):", "max_tokens": 400, "ignore_eos": True,
                                      "stream": True})
    for _ in range(100):
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(body)
        s.settimeout(10)
        try:
            for _ in range(rng.randint(0, 30)):
                if not s.recv(256):
                    break
        except TimeoutError:
            pass
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
        s.close()
    try:
        freed = srv.wait_idle(60)
    except TimeoutError as e:
        record("disconnect_storm", False, str(e))
        return
    got = diff(srv.outcomes(), before)
    record("disconnect_storm", sum(got.values()) == 100 and "error" not in got,
           f"100 streams reset mid-way: all counted {got}; idle {freed:.1f} s after the last")


def probe_streamed_batch(srv: Server, runs: int = 100) -> None:
    body = {"prompt": ["def hello(world):", "class Data:", "import"], "max_tokens": 12, "temperature": 0}
    want = {c["index"]: (c["text"], c["finish_reason"])
            for c in httpx.post(srv.base + "/v1/completions", json=body, timeout=60).json()["choices"]}
    bad = 0
    for _ in range(runs):
        texts: dict[int, str] = {}
        reasons: dict[int, str] = {}
        with httpx.stream("POST", srv.base + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                        reasons[c["index"]] = c["finish_reason"] or reasons.get(c["index"])
        bad += {i: (texts[i], reasons[i]) for i in texts} != want
    record("streamed_batch", bad == 0 and len(want) == 3, f"{runs} streamed batches of 3 prompts: {bad} differ "
                                                          f"from the non-streamed answer")


def probe_rss(srv: Server) -> None:
    async def load() -> None:
        async with httpx.AsyncClient(base_url=srv.base, timeout=120) as client:
            async def one(i: int) -> None:
                r = await client.post("/v1/completions", json={"prompt": f"def f{i}(x):" * 20, "max_tokens": 64,
                                                               "ignore_eos": True, "logprobs": 5})
                assert r.status_code in (200, 429)
            for k in range(0, 64, 8):
                await asyncio.gather(*(one(i) for i in range(k, k + 8)))

    rss = [srv.metrics()[("process_resident_memory_bytes",)]]
    for _ in range(2):
        asyncio.run(load())
        srv.wait_idle(60)
        rss.append(srv.metrics()[("process_resident_memory_bytes",)])
    mb = [r / 2**20 for r in rss]
    record("rss", True, f"RSS before / after run 1 / after run 2: {mb[0]:.0f} / {mb[1]:.0f} / {mb[2]:.0f} MB "
                        f"(growth in run 2: {mb[2] - mb[1]:+.0f} MB)")


def probe_blocks_free(srv: Server) -> None:
    m = srv.metrics()
    used, total = m[("mla_latent_cache_blocks_used",)], m[("mla_latent_cache_blocks_total",)]
    record("blocks_free", used == 0 and m[("mla_requests_in_flight",)] == 0,
           f"{int(used)} of {int(total)} latent-cache blocks used, {int(m[('mla_requests_in_flight',)])} in flight")


def probe_drain(srv: Server) -> None:
    lines: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", srv.base + "/generate", timeout=60, json={
                "prompt": "def", "max_tokens": 300, "ignore_eos": True, "stream": True}) as s:
            lines.extend(line for line in s.iter_lines() if line)

    t = threading.Thread(target=stream)
    t.start()
    while not lines:
        time.sleep(0.01)
    srv.proc.send_signal(signal.SIGTERM)
    ready = httpx.get(srv.base + "/ready").status_code
    new = httpx.post(srv.base + "/generate", json={"prompt": "x"}).status_code
    code = srv.stop()
    t.join(30)
    record("drain", ready == 503 and new == 503 and lines[-1] == "data: [DONE]" and code == 0,
           f"during the drain /ready {ready}, new request {new}; the running stream ended with {lines[-1]!r}; "
           f"exit {code}")


# -- probes on their own servers --------------------------------------------------------------------
def probe_error_injection() -> None:
    srv = Server(MAIN_FLAGS, env={"MLA_FAULT_INJECTION": "stream:3"})
    try:
        with httpx.stream("POST", srv.base + "/generate", timeout=60, json={
                "prompt": "def", "max_tokens": 50, "ignore_eos": True, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
        srv.wait_idle(30)
        got = srv.outcomes()
        err = json.loads(lines[-2][6:]).get("error", {})
        ok = lines[-1] == "data: [DONE]" and err.get("code") == "internal_error" and "injected" not in " ".join(lines)
        record("error_injection", ok and got.get("error") == 1 and not got.get("client_disconnect"),
               f"stream ended with {err.get('message')!r} then [DONE]; outcomes {diff(got, {})}")
    finally:
        srv.stop()


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def probe_hung_rank() -> None:
    srv = Server(["--tensor-parallel-size", "2", "--step-timeout", "5", "--shutdown-timeout", "5"])
    try:
        ranks = [p for p in _children(srv.proc.pid) if "mla-tp-rank" in Path(f"/proc/{p}/cmdline").read_text()
                 or "multiprocessing" in Path(f"/proc/{p}/cmdline").read_text()]
        if not ranks:
            record("hung_rank", False, "no tensor-parallel rank process found")
            return
        os.kill(ranks[-1], signal.SIGSTOP)
        t0 = time.monotonic()
        with httpx.Client(base_url=srv.base, timeout=60) as client:
            def request() -> None:  # it waits on the hung step; the process then ends under it
                with contextlib.suppress(httpx.HTTPError):
                    client.post("/generate", json={"prompt": "x", "max_tokens": 4})

            threading.Thread(target=request, daemon=True).start()
            health = 200
            while health == 200 and time.monotonic() - t0 < 30:
                time.sleep(0.1)
                health = httpx.get(srv.base + "/health").status_code
            seen = time.monotonic() - t0
        try:
            code = srv.proc.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        record("hung_rank", health == 503 and seen < 5 + 2 and code not in (None, 0),
               f"rank {ranks[-1]} stopped: /health {health} after {seen:.1f} s (step timeout 5 s); process exit "
               f"{code} after {time.monotonic() - t0:.1f} s")
    finally:
        for p in _children(srv.proc.pid) if srv.proc.poll() is None else []:
            os.kill(p, signal.SIGKILL)
        srv.stop()


MAIN_PROBES: dict[str, Callable[[Server], None]] = {
    "slow_reader": probe_slow_reader, "large_prompt": probe_large_prompt, "slowloris": probe_slowloris,
    "nested_json": probe_nested_json, "disconnect_storm": probe_disconnect_storm,
    "streamed_batch": probe_streamed_batch, "rss": probe_rss}
OTHER_PROBES: dict[str, Callable[[], None]] = {"error_injection": probe_error_injection,
                                               "hung_rank": probe_hung_rank}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", default=",".join([*MAIN_PROBES, "drain", *OTHER_PROBES]),
                        help="comma-separated subset of the probes")
    chosen = parser.parse_args().probes.split(",")
    srv = Server(MAIN_FLAGS)
    try:
        for name, probe in MAIN_PROBES.items():
            if name in chosen:
                probe(srv)
        probe_blocks_free(srv)
        if "drain" in chosen:
            probe_drain(srv)
    finally:
        srv.stop()
    for name, other in OTHER_PROBES.items():
        if name in chosen:
            other()
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)} of {len(RESULTS)} probes passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
