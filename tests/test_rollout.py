"""Versioned rollout and memory-aware autoscaling: the split, sticky sessions, promote / rollback, the automatic
rollback's test and the scaling policy as pure functions; then one local Ray deployment (the demo model as
stable, a copy with other random weights as canary, one CPU replica each) for the live checks: the split, the
admin routes and their API key, rollback under load, promote then rollback. The live tests are marked ``ray``."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mla_runtime.serving.affinity import RouteKey
from mla_runtime.serving.config import ReplicaConfig, canary_engine_config, resolve_all
from mla_runtime.serving.replica_metrics import ReplicaScrape, render
from mla_runtime.serving.rollout import Outcomes, Rollout, RolloutError, Version, bucket, judge
from mla_runtime.serving.scaling import MemoryAwarePolicy, Signals, decide, trend

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "mla_runtime" / "demo_model"
KEY = "sk-rollout"
AUTH = {"Authorization": f"Bearer {KEY}"}


def rollout(weight: float = 0.3) -> Rollout:
    return Rollout(Version("A", "/m/old", fingerprint="f-old"), Version("B", "/m/new", fingerprint="f-new"), weight)


def keys(n: int, prefix: str = "u") -> list[RouteKey]:
    return [RouteKey(f"{prefix}{i}") for i in range(n)]


# -- the split, as a pure function -----------------------------------------------------------------------
@pytest.mark.parametrize("weight", [0.05, 0.3, 0.5, 0.9])
def test_the_split_matches_the_weight(weight):
    r = rollout(weight)
    share = sum(r.choose(k) == "B" for k in keys(4000)) / 4000
    assert abs(share - weight) < 0.025, share
    keyless = sum(r.choose(RouteKey()) == "B" for _ in range(4000)) / 4000  # drawn at random
    assert abs(keyless - weight) < 0.03, keyless


def test_sessions_stay_on_their_version_as_the_weight_moves():
    r = rollout(0.3)
    first = {k: r.choose(k) for k in keys(1000)}
    r.set_weight(0.7)
    assert all(r.choose(k) == v for k, v in first.items())  # already seen: sticky
    assert abs(sum(r.choose(k) == "B" for k in keys(2000, "new")) / 2000 - 0.7) < 0.04
    r.set_weight(0.1)  # sessions beyond the new share leave the canary; the others stay
    moved = {k: r.choose(k) for k in first}
    assert all(v == "A" for k, v in moved.items() if first[k] == "A")
    assert all(moved[k] == "B" for k in first if first[k] == "B" and bucket("s:" + k.session, "/m/new") < 0.1)
    prefix = RouteKey(None, (123, 456))  # no session: the prompt's first block is the key
    assert len({r.choose(RouteKey(None, (123, i))) for i in range(20)} | {r.choose(prefix)}) == 1
    r.rollback()
    assert {r.choose(k) for k in first} == {"A"} and r.weight == 0


def test_promote_then_rollback_returns_to_the_old_version():
    r = rollout(0.5)
    r.promote()
    assert (r.stable.fingerprint, r.canary, r.previous.fingerprint) == ("f-new", None, "f-old")
    assert {r.choose(k) for k in keys(200)} == {"B"} and r.role("A") == "previous"
    with pytest.raises(RolloutError):
        r.set_weight(0.2)  # no canary after a promote
    r.rollback()
    assert (r.stable.fingerprint, r.canary.fingerprint, r.weight, r.previous) == ("f-old", "f-new", 0.0, None)
    assert {r.choose(k) for k in keys(200)} == {"A"}
    r.set_weight(0.2)  # the rolled-back version can be tried again
    restored = rollout(0.0)
    assert restored.restore(r.dump(), ["A", "B"]) and restored.weight == 0.2
    assert not rollout().restore(r.dump(), ["A", "C"])  # another deployment: not resumed
    with pytest.raises(RolloutError):
        r.set_weight(1.5)
    assert Rollout(Version("A", "/m")).weights() == {"stable": 1.0}


def test_automatic_rollback_judges_error_rate_and_p99_against_stable():
    ok = (100, 0.0, 0.5)
    assert judge(ok, (100, 0.01, 0.6), 0.02, 2.0) is None
    assert "error rate" in judge(ok, (100, 0.05, 0.6), 0.02, 2.0)
    assert "p99" in judge(ok, (100, 0.0, 1.2), 0.02, 2.0)
    assert judge(ok, (5, 1.0, 9.0), 0.02, 2.0) is None  # too few canary requests to judge
    window = Outcomes(10.0)
    for i in range(30):
        window.add(i % 10 == 0, 0.1 * (i + 1), now=float(i))
    n, err, p99 = window.summary()
    assert n == 11 and abs(err - 1 / 11) < 1e-9 and p99 == pytest.approx(3.0)  # times 19..29 in the window


# -- the scaling policy -------------------------------------------------------------------------------------
def test_memory_alone_adds_a_replica_when_the_watermark_stays_high():
    d = decide(Signals(replicas=1, ongoing=1, cache_usage=0.95), target_ongoing=8, target_cache_usage=0.8)
    assert (d.desired, d.reason) == (2, "memory")
    assert decide(Signals(1, 20, 0.1), 8, 0.8).reason == "load" and decide(Signals(1, 20, 0.1), 8, 0.8).desired == 3
    assert decide(Signals(3, 0, 0.05), 8, 0.8).reason == "quiet"
    assert decide(Signals(2, 8, 0.5), 8, 0.8).reason == "steady"


def test_replicas_start_ahead_of_need_by_the_cold_start():
    rising = [(float(t), 2.0, 0.4 + 0.01 * t) for t in range(0, 31, 2)]  # usage +0.01/s, now 0.70
    assert trend([(t, u) for t, _, u in rising]) == pytest.approx(0.01)
    late = decide(Signals(1, 2, 0.70, cold_start_s=5), 8, 0.8, rising)
    early = decide(Signals(1, 2, 0.70, cold_start_s=20), 8, 0.8, rising)
    assert late.reason == "steady" and (early.desired, early.reason) == (2, "predicted_memory")
    growing = [(float(t), 2.0 + 0.5 * t, 0.1) for t in range(0, 21, 2)]  # 12 ongoing now, +0.5/s
    d = decide(Signals(2, 12, 0.1, cold_start_s=30), 8, 0.8, growing)
    assert (d.desired, d.reason) == (4, "predicted_load")  # 12 + 15 = 27 ongoing in 30 s


def test_the_ray_policy_reads_the_replicas_cache_usage():
    policy = MemoryAwarePolicy(target_ongoing_requests=8, target_cache_usage=0.8)
    ctx = SimpleNamespace(
        aggregated_metrics={"cache_usage": {"r1": 0.92, "r2": 0.9}, "cold_start_s": {"r1": 12.0, "r2": 0}},
        running_replicas=["r1", "r2"], current_num_replicas=2, total_num_requests=2.0, current_time=100.0,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4, deployment_name="EngineReplica",
        app_name="test")
    desired, _ = policy(ctx)
    assert desired == 3 and policy.last.reason == "memory" and policy.cold_start_s == 12.0
    assert policy.counts == {"up/memory": 1}


# -- configuration and metrics -----------------------------------------------------------------------------
def test_rollout_flags_and_yaml_section(tmp_path):
    _, _, rc = resolve_all(["--replicas", "2", "--canary-model", str(DEMO), "--canary-weight", "0.1",
                            "--canary-engine", "max_num_seqs=8,enable_prefix_caching=false", "--downscale-delay",
                            "60", "--target-cache-usage", "0.7"])
    assert (rc.rollout, rc.canary_weight, rc.downscale_delay, rc.target_cache_usage) == (True, 0.1, 60, 0.7)
    assert rc.canary_engine == {"max_num_seqs": 8, "enable_prefix_caching": False}
    path = tmp_path / "serve.yaml"
    path.write_text(f"replicas:\n  count: 1\nrollout:\n  canary_model: {DEMO}\n  canary_weight: 0.25\n"
                    "  canary_engine: {max_num_seqs: 2}\n  canary_name: next\n  auto_rollback: true\n")
    engine, _, rc = resolve_all(["--config", str(path)])
    canary = canary_engine_config(engine, rc)
    assert (rc.canary_weight, rc.canary_name, rc.auto_rollback, canary.max_num_seqs) == (0.25, "next", True, 2)
    assert canary_engine_config(engine, ReplicaConfig(replicas=1)) is None
    for argv, field in ((["--canary-model", str(DEMO)], "canary_model"),
                        (["--replicas", "1", "--canary-weight", "1.5"], "canary_weight"),
                        (["--replicas", "1", "--canary-engine", "nope=1"], "canary_engine")):
        with pytest.raises(ValueError, match=field):
            resolve_all(argv)


def test_metrics_carry_the_version_label():
    text = "# TYPE mla_requests_total counter\nmla_requests_total{outcome=\"success\"} 4\n"
    body = render([ReplicaScrape("r1", 1, text), ReplicaScrape("r2", 2, text)], {"stable": {"session": 3}},
                  {"r1": "stable", "r2": "canary"}).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))) for f in text_string_to_metric_families(body)
               for s in f.samples}
    assert ("mla_requests_total", (("outcome", "success"), ("replica", "r2"), ("version", "canary"))) in samples
    assert ("mla_router_decisions_total", (("reason", "session"), ("version", "stable"))) in samples


# -- live: one Ray deployment with two versions -------------------------------------------------------------
def bench_module():
    spec = importlib.util.spec_from_file_location("bench_rollout", ROOT / "bench" / "bench_rollout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclass
class Live:
    base: str
    fingerprints: dict[str, str]
    canary_model: str

    def admin(self, action: str = "", body: dict | None = None, headers: dict | None = None) -> httpx.Response:
        h = AUTH if headers is None else headers
        if not action:
            return httpx.get(self.base + "/admin/rollout", headers=h, timeout=30)
        return httpx.post(self.base + "/admin/rollout/" + action, json=body or {}, headers=h, timeout=30)


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    ray = pytest.importorskip("ray", reason="Ray Serve is an optional extra (pip install 'mla-runtime[ray]')")
    pytest.importorskip("ray.serve")
    from ray import serve

    from mla_runtime.engine.config import EngineConfig
    from mla_runtime.serving import ray_replicas
    from mla_runtime.serving.config import ServerConfig

    bench = bench_module()
    tmp = tmp_path_factory.mktemp("rollout")
    fps = {"stable": bench.copy_checkpoint(DEMO, tmp / "stable"),
           "canary": bench.random_checkpoint(DEMO, tmp / "canary")}
    rc = ReplicaConfig(replicas=1, canary_model=str(tmp / "canary"), canary_weight=0.3, replica_cpus=1)
    started = ray_replicas.start_ray(rc)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = EngineConfig(model=str(tmp / "stable"), dtype="float32", max_model_len=256, block_size=16,
                          max_num_seqs=8, kv_cache_memory="4MiB")
    config = ServerConfig(port=port, served_model_name="demo", api_key=KEY, max_queue=32, request_timeout=60,
                          shutdown_timeout=5)
    try:
        ray_replicas.deploy(engine, config, rc)
        yield Live(f"http://127.0.0.1:{port}", fps, rc.canary_model)
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()


def generate(base: str, sessions: list[str], concurrency: int = 8, stream: bool = False, max_tokens: int = 1
             ) -> list[httpx.Response | tuple[int, str, list[str]]]:
    async def go():
        slots = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            async def one(s: str):
                body = {"prompt": f"def {s.replace('-', '_')}(x):", "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": stream}
                async with slots:
                    if not stream:
                        return await client.post(base + "/generate", json=body, headers={"X-Session-Id": s})
                    async with client.stream("POST", base + "/generate", json=body,
                                             headers={"X-Session-Id": s}) as r:
                        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                        return r.status_code, r.headers.get("x-model-version", ""), lines

            return await asyncio.gather(*(one(s) for s in sessions))

    return asyncio.run(go())


@pytest.mark.ray
def test_admin_routes_need_the_api_key(live):
    assert live.admin(headers={}).status_code == 401
    assert live.admin("rollback", headers={"Authorization": "Bearer wrong"}).status_code == 401
    status = live.admin().json()
    assert status["weights"] == {"stable": pytest.approx(0.7), "canary": pytest.approx(0.3)}
    assert {n: v["fingerprint"] for n, v in status["versions"].items()} == live.fingerprints
    assert live.admin("weight", {"weight": 2}).status_code == 400


@pytest.mark.ray
def test_live_split_sticky_sessions_and_version_everywhere(live):
    sessions = [f"split-{i}" for i in range(240)]
    rs = generate(live.base, sessions)
    assert {r.status_code for r in rs} == {200}
    versions = {s: r.headers["x-model-version"] for s, r in zip(sessions, rs)}
    # each session lands where its hash under the canary's salt says, so the share follows the weight
    expected = {s: "canary" if bucket("s:" + s, live.canary_model) < 0.3 else "stable" for s in sessions}
    assert versions == expected
    assert set(versions.values()) == {"stable", "canary"}  # the share itself: test_the_split_matches_the_weight
    again = generate(live.base, sessions[:60])
    assert all(r.headers["x-model-version"] == versions[s] for s, r in zip(sessions[:60], again))
    models = httpx.get(live.base + "/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m["version"], m["fingerprint"]) for m in models] == [
        ("demo", "stable", live.fingerprints["stable"]), ("demo", "canary", live.fingerprints["canary"])]
    text = httpx.get(live.base + "/metrics", headers=AUTH, timeout=30).text
    seen = {s.labels.get("version") for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "mla_latent_cache_usage_ratio"}
    assert seen == {"stable", "canary"}
    assert 'mla_rollout_requests_total{code="200",version="canary"}' in text


@pytest.mark.ray
def test_rollback_under_load_loses_no_request(live):
    from mla_runtime.serving.rollout import main as rollout_main

    assert live.admin("weight", {"weight": 0.5}).status_code == 200

    async def scenario():
        load = asyncio.create_task(asyncio.to_thread(generate, live.base, [f"rb-{i}" for i in range(48)], 8, True,
                                                     24))
        await asyncio.sleep(1.5)
        code = await asyncio.to_thread(rollout_main, ["rollback", "--url", live.base, "--api-key", KEY])
        return code, time.monotonic(), await load

    code, rolled_back, results = asyncio.run(scenario())
    assert code == 0
    for status, version, lines in results:
        assert status == 200 and version in ("stable", "canary")
        assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
        assert sum(len(json.loads(line[6:]).get("token_ids", [])) for line in lines[:-1]) == 24
    assert any(v == "canary" for _, v, _ in results)  # the canary had requests in flight
    after = generate(live.base, [f"after-{i}" for i in range(30)])
    assert {r.headers["x-model-version"] for r in after} == {"stable"}
    assert live.admin().json()["weights"]["canary"] == 0


@pytest.mark.ray
def test_promote_then_rollback_returns_to_the_old_fingerprint(live):
    before = live.admin().json()["versions"]
    assert live.admin("weight", {"weight": 0.2}).status_code == 200
    promoted = live.admin("promote").json()
    assert promoted["versions"]["stable"]["fingerprint"] == live.fingerprints["canary"]
    assert promoted["versions"]["previous"]["fingerprint"] == live.fingerprints["stable"]
    rs = generate(live.base, [f"promoted-{i}" for i in range(12)])
    assert {r.headers["x-model-version"] for r in rs} == {"stable"}
    assert {r.headers["x-replica-id"] for r in rs} <= set(before["canary"]["replicas"])  # the canary's replicas
    back = live.admin("rollback").json()
    assert back["versions"]["stable"]["fingerprint"] == live.fingerprints["stable"]
    rs = generate(live.base, [f"back-{i}" for i in range(12)])
    assert {r.headers["x-replica-id"] for r in rs} <= set(before["stable"]["replicas"])
    assert live.admin("rollback").json()["weights"]["canary"] == 0  # again: the canary stays at 0
