"""The server under hostile clients and faults: every slot, connection and cache block comes back.

Each test is a fast probe of ``bench/abuse.py``: a client that stops reading a stream, a slowloris client,
more connections than allowed, a prompt too large to tokenize, an exception inside a stream, a streamed
batch run many times, admission by sequences, ``/metrics`` behind the key, and a step that hangs. Waits
poll the server's own metrics with generous limits; nothing asserts a duration.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from mla_runtime.serving import streaming
from mla_runtime.serving.responses import StreamState
from tests.test_server import (
    API_KEY,
    Live,
    assert_error,
    auth,
    requests_total,
    slowed,
    streamed_choices,
    text_checkpoint,  # noqa: F401 - the module-scoped checkpoint fixture
    wait_idle,
)


@pytest.fixture(scope="module")
def guarded(text_checkpoint) -> Iterator[Live]:  # noqa: F811
    """Tight limits: 4 sequences, no queue, 1 s stall timeout, 3 s header timeout, 6 connections, metrics
    behind the API key; 16 KiB socket send buffers, so that a client that stops reading blocks the send soon."""
    live = Live(text_checkpoint, engine={"max_num_seqs": 4}, max_queue=0, request_timeout=60.0, api_key=API_KEY,
                metrics_auth=True, stream_stall_timeout=1.0, header_timeout=3.0, max_connections=6, sndbuf=16384)
    yield live
    live.stop()


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def raw_request(path: str, body: dict, key: str | None = API_KEY) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    return head.encode() + b"\r\n" + data


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """True once the server closes ``sock`` (EOF or reset) within ``timeout`` s; data read is discarded."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_client_that_stops_reading_loses_its_stream_and_slot(guarded):
    """Streams with 20 log-probabilities per token into sockets with a 4 KiB receive buffer that are never
    read: each is aborted after --stream-stall-timeout, counted as stalled, and its slot and blocks freed."""
    before = guarded.metrics()
    socks = []
    body = {"messages": [{"role": "user", "content": "the fox"}], "max_tokens": 220, "ignore_eos": True, "n": 2,
            "logprobs": True, "top_logprobs": 20, "stream": True}
    with slowed(guarded, 0.01):
        for _ in range(2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", int(guarded.base.rsplit(":", 1)[1])))
            s.sendall(raw_request("/v1/chat/completions", body))
            socks.append(s)
        wait_for(lambda: guarded.metrics()[("mla_requests_in_flight",)] == 4, "both streams admitted")
        after = wait_idle(guarded, timeout=60)
    assert requests_total(after, "stalled", "chat") - requests_total(before, "stalled", "chat") == 2
    assert after[("mla_generation_tokens_total",)] - before[("mla_generation_tokens_total",)] < 4 * 220
    for s in socks:
        assert closed_by_server(s, 30)
        s.close()
    r = httpx.post(guarded.base + "/generate", json={"prompt": "x", "max_tokens": 2}, headers=auth())
    assert r.status_code == 200  # the slots are free again


def test_slowloris_headers_and_bodies_are_cut_and_connections_capped(guarded):
    port = int(guarded.base.rsplit(":", 1)[1])
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    partial = socket.create_connection(("127.0.0.1", port))
    partial.sendall(raw_request("/generate", {"prompt": "the fox", "max_tokens": 2})[:-5])  # body cut short
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]  # 6 open: the cap
    extra = socket.create_connection(("127.0.0.1", port))
    assert closed_by_server(extra, 2.5)  # refused at once (the others live until the 3 s header timeout)
    for s in [slow, partial, *idle]:
        assert closed_by_server(s, 30)
        s.close()
    extra.close()
    wait_idle(guarded)
    r = httpx.post(guarded.base + "/generate", json={"prompt": "x", "max_tokens": 2}, headers=auth())
    assert r.status_code == 200


def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing(guarded, monkeypatch):
    tokenizer = guarded.llm.tokenizer
    calls = []
    monkeypatch.setattr(type(tokenizer), "encode", lambda self, *a, **k: calls.append(1) or [])
    big = "the fox " * 400_000  # 3.2 MB
    for path, body, field in (("/generate", {"prompt": big}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}, "messages")):
        r = httpx.post(guarded.base + path, json=body, headers=auth(), timeout=60)
        assert_error(r, 400, field)
        assert "max_model_len" in r.text
    assert not calls


def test_an_exception_in_a_stream_ends_it_with_an_error_event_counted_as_error(guarded, monkeypatch):
    original = StreamState.chunks
    seen = []

    def failing(self, out):
        seen.append(1)
        if len(seen) == 3:
            raise RuntimeError("secret internal detail")
        return original(self, out)

    monkeypatch.setattr(StreamState, "chunks", failing)
    monkeypatch.setattr(streaming, "LARGE_DELTA_TOKENS", 10**9)
    before = guarded.metrics()
    with httpx.stream("POST", guarded.base + "/generate", headers=auth(), timeout=60, json={
            "prompt": "the fox", "max_tokens": 50, "ignore_eos": True, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "internal_error" and "secret" not in json.dumps(lines)
    after = wait_idle(guarded)
    assert requests_total(after, "error") - requests_total(before, "error") == 1
    assert requests_total(after, "client_disconnect") == requests_total(before, "client_disconnect")


def test_internal_errors_never_reach_the_client(guarded, monkeypatch):
    from mla_runtime.serving import app as app_module

    def broken(self, req):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(app_module.JobBuilder, "generate", broken)
    r = httpx.post(guarded.base + "/generate", json={"prompt": "x"}, headers=auth())
    assert_error(r, 500, "internal error")
    assert "secret" not in r.text


def test_streamed_batches_equal_the_non_streamed_answer_every_time(guarded):
    import openai

    client = openai.OpenAI(base_url=guarded.base + "/v1", api_key=API_KEY, max_retries=0)
    kw = dict(model="tiny", prompt=["the quick brown", "def hello(", "a"], max_tokens=8, temperature=0, n=1)
    whole = client.completions.create(**kw)
    want = {c.index: (c.text, c.finish_reason) for c in whole.choices}
    assert len(want) == 3 and all(reason in ("stop", "length") for _, reason in want.values())
    for _ in range(30):
        assert streamed_choices(client.completions.create(**kw, stream=True)) == want
    wait_idle(guarded)


def test_admission_counts_sequences_and_metrics_need_the_key(guarded, text_checkpoint):  # noqa: F811
    r = httpx.post(guarded.base + "/generate", json={"prompt": "x", "n": 5}, headers=auth())
    assert_error(r, 400, "n")
    with slowed(guarded, 0.02), httpx.stream("POST", guarded.base + "/generate", headers=auth(), timeout=60, json={
            "prompt": "the fox", "n": 4, "max_tokens": 100, "ignore_eos": True, "stream": True}) as s:
        lines = s.iter_lines()  # kept: dropping the iterator closes the response
        next(lines)
        busy = httpx.post(guarded.base + "/generate", json={"prompt": "x", "max_tokens": 1}, headers=auth())
        assert_error(busy, 429, "4 sequences in flight")
    wait_idle(guarded)
    assert_error(httpx.get(guarded.base + "/metrics"), 401, "API key")
    text = httpx.get(guarded.base + "/metrics", headers=auth()).text
    assert 'model="tiny"' in text and str(text_checkpoint) not in text
    models = httpx.get(guarded.base + "/v1/models", headers=auth()).text
    assert str(text_checkpoint) not in models


def test_a_hung_step_turns_health_503_and_asks_for_a_restart(text_checkpoint):  # noqa: F811
    import threading

    fatal: list[BaseException] = []
    live = Live(text_checkpoint, step_timeout=0.5, on_fatal=fatal.append)
    release = threading.Event()
    try:
        assert httpx.get(live.base + "/health").status_code == 200
        live.llm.step_hooks.append(lambda engine, outputs: release.wait(30))
        pending = threading.Thread(target=httpx.post, args=(live.base + "/generate",),
                                   kwargs={"json": {"prompt": "x", "max_tokens": 2}, "timeout": 60})
        pending.start()
        wait_for(lambda: httpx.get(live.base + "/health").status_code == 503, "/health 503", 30)
        assert_error(httpx.get(live.base + "/health"), 503, "step_timeout")
        assert live.metrics()[("mla_engine_step_seconds",)] > 0.5
        wait_for(lambda: bool(fatal), "on_fatal called", 30)
        assert_error(httpx.get(live.base + "/ready"), 503, "restarting")
        assert_error(httpx.post(live.base + "/generate", json={"prompt": "x"}), 503, "restarting")
        release.set()
        pending.join(60)
    finally:
        release.set()
        live.stop()
