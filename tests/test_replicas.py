"""Replicas on Ray Serve, end to end: a local Ray instance (started once for the module), 2 CPU replicas of the demo
model behind one port, real HTTP clients. Select these tests with ``-m ray`` (or leave them out with ``-m "not ray"``).

The deployment is small on purpose: ``max_num_seqs`` 4 and ``max_queue`` 2 per replica (admission: 6 sequences each),
and a latent cache of 64 blocks of 16 tokens, which holds about five of the workload's prefixes but not its eight:
round robin spreads every prefix over both caches and evicts them, affinity gives each cache half the prefixes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray", reason="Ray Serve is an optional extra (pip install 'mla-runtime[ray]')")
pytest.importorskip("ray.serve", reason="Ray Serve is an optional extra (pip install 'mla-runtime[ray]')")

from ray import serve  # noqa: E402

from mla_runtime.engine.config import EngineConfig  # noqa: E402
from mla_runtime.serving import ray_replicas  # noqa: E402
from mla_runtime.serving.config import ReplicaConfig, ServerConfig  # noqa: E402

pytestmark = pytest.mark.ray

DEMO = Path(__file__).resolve().parent.parent / "mla_runtime" / "demo_model"
KEY = "sk-replicas"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCK = 16
CACHE_BLOCKS = 64
BYTES_PER_TOKEN = (128 + 16) * 4 * 4  # demo model: (d_c + d_r) × 4 layers × fp32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Deployed:
    base: str
    engine: EngineConfig
    config: ServerConfig

    def deploy(self, router: str) -> None:
        with_router = ReplicaConfig(replicas=2, router=router, replica_cpus=1)
        if APP_RUNNING[0]:
            serve.delete(ray_replicas.APP_NAME)  # fresh replicas, fresh caches
        ray_replicas.deploy(self.engine, self.config, with_router)
        APP_RUNNING[0] = True

    def metrics(self) -> dict[tuple, float]:
        text = httpx.get(self.base + "/metrics", headers=AUTH, timeout=30).text
        return {(s.name, *sorted(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


APP_RUNNING = [False]


@pytest.fixture(scope="module")
def app() -> Iterator[Deployed]:
    started = ray_replicas.start_ray(ReplicaConfig(replicas=2))
    port = free_port()
    engine = EngineConfig(model=str(DEMO), dtype="float32", max_model_len=512, block_size=BLOCK, max_num_seqs=4,
                          kv_cache_memory=CACHE_BLOCKS * BLOCK * BYTES_PER_TOKEN)
    config = ServerConfig(port=port, served_model_name="demo", api_key=KEY, max_queue=2, request_timeout=60,
                          metrics_auth=True, shutdown_timeout=5)
    deployed = Deployed(f"http://127.0.0.1:{port}", engine, config)
    try:
        deployed.deploy("affinity")
        yield deployed
    finally:
        serve.shutdown()
        APP_RUNNING[0] = False
        if started:
            ray.shutdown()


def per_replica(m: dict, name: str) -> dict[str, float]:
    return {dict(k[1:])["replica"]: v for k, v in m.items() if k[0] == name and "replica" in dict(k[1:])}


def total(m: dict, name: str) -> float:
    return sum(per_replica(m, name).values())


# -- the pieces, without a Ray cluster ---------------------------------------------------------------
class _Handle:
    """The replica's answer as the ingress gets it from a handle call: parts, and ``cancel``."""

    def __init__(self, parts) -> None:
        self.parts = parts

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await anext(self.parts)

    def cancel(self) -> None:
        pass


def test_one_x_request_id_through_serves_proxy():
    """Serve's proxy middleware in front of the ingress's relay of a replica's app: the id appears once, the
    client's own when it sent one, else the proxy's, which the replica's app saw on the request."""
    from ray.serve._private.http_util import RequestIdMiddleware
    from starlette.requests import Request

    from mla_runtime.serving.app import build_app
    from mla_runtime.serving.asgi_call import HttpRequest, call_asgi

    config = ServerConfig()
    replica_app = build_app(EngineConfig(model=str(DEMO)), config)  # /health answers before the engine loads
    ingress = ray_replicas.Ingress.__new__(ray_replicas.Ingress)
    ingress.config = config
    seen: list[str | None] = []

    async def ingress_app(scope, receive, send) -> None:
        req = HttpRequest("GET", "/health", headers=tuple(Request(scope, receive).headers.items()))
        seen.append(req.header("x-request-id"))
        response = await ingress.answer(_Handle(call_asgi(replica_app, req)), "replica-1", retry=False)
        await response(scope, receive, send)

    async def get(headers: dict[str, str]) -> httpx.Response:
        transport = httpx.ASGITransport(app=RequestIdMiddleware(ingress_app))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return await client.get("/health", headers=headers)

    mine = asyncio.run(get({"X-Request-Id": "client-7"}))
    assert mine.status_code == 200 and mine.headers.get_list("x-request-id") == ["client-7"]
    fresh = asyncio.run(get({}))
    assert fresh.headers.get_list("x-request-id") == [seen[-1]]
    assert fresh.headers["x-replica-id"] == "replica-1"


def test_a_replica_logs_the_engine_summary(monkeypatch, capsys):
    """A replica runs in a Ray worker, whose root logger Ray leaves at WARNING: it sets up logging itself."""
    context = type("Context", (), {"replica_id": type("Id", (), {"unique_id": "replica-x"})()})()
    monkeypatch.setattr(ray_replicas.serve, "get_replica_context", lambda: context)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.setLevel(logging.WARNING)  # as in a fresh worker process
    class Replica(ray_replicas.EngineReplica):
        def __del__(self) -> None:  # Ray Serve awaits the real one when it stops a replica; run() does here
            pass

    replica = Replica.__new__(Replica)

    async def run() -> None:
        await replica.__init__(EngineConfig(model=str(DEMO), max_model_len=128, kv_cache_memory="4MiB"),
                               ServerConfig(served_model_name="demo"))
        await ray_replicas.EngineReplica.__del__(replica)

    try:
        asyncio.run(run())
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err
    assert "model demo (" in err and "latent cache:" in err and "replica replica-x ready" in err


# -- the API through Ray ---------------------------------------------------------------------------
def test_openai_client_and_streaming_through_ray(app):
    import openai

    client = openai.OpenAI(base_url=app.base + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["demo"]
    kw = dict(model="demo", prompt="def fibonacci(n):", max_tokens=8, temperature=0)
    whole = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert whole.choices[0].text and streamed == whole.choices[0].text
    chunks = list(client.chat.completions.create(model="demo", stream=True, max_tokens=6, temperature=0,
                                                 messages=[{"role": "user", "content": "import os"}]))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=app.base + "/v1", api_key="wrong", max_retries=0).completions.create(**kw)
    r = httpx.post(app.base + "/generate", headers=AUTH, json={"prompt": "", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert len(r.headers.get_list("x-request-id")) == 1
    assert httpx.get(app.base + "/ready").status_code == 200
    assert httpx.get(app.base + "/metrics").status_code == 401  # --metrics-auth, as in one process


def test_metrics_show_each_replica_labelled(app):
    m = app.metrics()
    assert m[("mla_replicas",)] == 2
    blocks = per_replica(m, "mla_latent_cache_blocks_total")
    assert len(blocks) == 2 and all(v > 0 for v in blocks.values())
    assert len(per_replica(m, "mla_replica_info")) == 2


# -- routing ---------------------------------------------------------------------------------------
def shared_prefix_workload(seed: int, prefixes: int = 8, per_prefix: int = 6, prefix_len: int = 160,
                           suffix_len: int = 16) -> list[list[int]]:
    """``prefixes`` × ``per_prefix`` prompts of token ids: a shared head and a private tail; each round visits
    every prefix once, in a new random order."""
    rng = random.Random(seed)
    heads = [[rng.randrange(300, 8000) for _ in range(prefix_len)] for _ in range(prefixes)]
    prompts = []
    for _ in range(per_prefix):
        order = list(range(prefixes))
        rng.shuffle(order)
        prompts += [heads[p] + [rng.randrange(300, 8000) for _ in range(suffix_len)] for p in order]
    return prompts


def run_workload(base: str, prompts: list[list[int]], concurrency: int = 2) -> list[int]:
    async def go() -> list[int]:
        slots = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            async def one(p: list[int]) -> int:
                async with slots:
                    r = await client.post(base + "/generate", json={"prompt": p, "max_tokens": 2, "temperature": 0})
                    return r.status_code

            statuses = []
            for i in range(0, len(prompts), concurrency):  # rounds stay in order
                statuses += await asyncio.gather(*(one(p) for p in prompts[i:i + concurrency]))
            return statuses

    return asyncio.run(go())


def hit_rate(app: Deployed, prompts: list[list[int]]) -> tuple[float, dict]:
    before = app.metrics()
    assert run_workload(app.base, prompts) == [200] * len(prompts)
    after = app.metrics()
    hits = total(after, "mla_prefix_cache_hits_tokens_total") - total(before, "mla_prefix_cache_hits_tokens_total")
    queries = (total(after, "mla_prefix_cache_queries_tokens_total")
               - total(before, "mla_prefix_cache_queries_tokens_total"))
    decisions = {dict(k[1:])["reason"]: v - before.get(k, 0) for k, v in after.items()
                 if k[0] == "mla_router_decisions_total"}
    return hits / queries, decisions


def test_affinity_router_reaches_1_5x_the_round_robin_hit_rate(app):
    prompts = shared_prefix_workload(seed=3)
    affinity, decisions = hit_rate(app, prompts)
    assert decisions["affinity_hit"] >= 36, decisions  # 8 first visits route by load, the rest by prefix
    app.deploy("round_robin")
    round_robin, rr_decisions = hit_rate(app, prompts)
    assert rr_decisions["round_robin"] >= len(prompts)
    print(f"prefix-cache hit rate: affinity {affinity:.3f}, round robin {round_robin:.3f}")
    assert affinity >= 1.5 * round_robin, (affinity, round_robin)


# -- admission and failover ------------------------------------------------------------------------
def test_every_replica_full_answers_429_with_retry_after(app):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            return await asyncio.gather(*(client.post(app.base + "/generate", json={
                "prompt": f"def f{i}(x):", "max_tokens": 120, "ignore_eos": True, "temperature": 0})
                for i in range(18)))

    rs = asyncio.run(burst())
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 12, codes  # a 429 only once both replicas hold their 6 sequences
    assert codes.count(429) >= 1 and all(r.headers.get("retry-after") for r in rs if r.status_code == 429)


async def open_stream(client: httpx.AsyncClient, base: str, i: int) -> tuple[str, asyncio.Task, asyncio.Event]:
    started = asyncio.Event()
    replica: list[str] = []

    async def read() -> list[dict]:
        events = []
        async with client.stream("POST", base + "/generate", headers={**AUTH, "X-Session-Id": f"kill-{i}"},
                                 json={"prompt": f"class Node{i}:", "max_tokens": 240, "ignore_eos": True,
                                       "stream": True, "temperature": 0}) as r:
            assert r.status_code == 200
            replica.append(r.headers["x-replica-id"])
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
                    started.set()
        return events

    task = asyncio.create_task(read())
    await asyncio.wait_for(started.wait(), 120)
    return replica[0], task, started


def test_killing_a_replica_fails_its_streams_cleanly_and_loses_no_new_request(app):
    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=180) as client:
            streams = [await open_stream(client, app.base, i) for i in range(4)]
            replicas = {r for r, _, _ in streams}
            assert len(replicas) == 2, "the four streams should spread over both replicas"
            pids = {dict(k[1:])["replica"]: int(dict(k[1:])["pid"]) for k in app.metrics()
                    if k[0] == "mla_replica_info"}
            victim = sorted(replicas)[0]
            os.kill(pids[victim], signal.SIGKILL)
            for i in range(6):  # not started when the replica died: every one is answered
                r = await client.post(app.base + "/generate", headers=AUTH,
                                      json={"prompt": f"import mod{i}", "max_tokens": 3})
                assert r.status_code == 200, r.text
                assert r.headers["x-replica-id"] != victim
            for replica, task, _ in streams:
                events = await asyncio.wait_for(task, 120)  # never a hang
                if replica == victim:
                    assert events[-1].get("error", {}).get("code") == "service_unavailable", events[-1]
                else:
                    assert events[-1] == {"done": True}
                    assert sum(len(e.get("token_ids", [])) for e in events) == 240

    asyncio.run(scenario())
    end = time.monotonic() + 180
    while time.monotonic() < end:  # Ray replaces the dead replica
        m = app.metrics()
        if m.get(("mla_replicas",)) == 2:
            break
        time.sleep(1)
    assert m.get(("mla_replicas",)) == 2


def test_every_cache_block_is_free_afterwards(app):
    end = time.monotonic() + 60
    while True:
        m = app.metrics()
        used = per_replica(m, "mla_latent_cache_blocks_used")
        in_flight = per_replica(m, "mla_requests_in_flight")
        if len(used) == 2 and not any(used.values()) and not any(in_flight.values()):
            break
        assert time.monotonic() < end, (used, in_flight)
        time.sleep(0.5)
