"""The replica pieces that need no Ray: routing keys, the affinity policy, the in-process ASGI call, the merged
``/metrics``, the ``replicas`` configuration, and that the single-process path never imports Ray."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from mla_runtime.engine.block_pool import block_hash
from mla_runtime.serving.affinity import AffinityPolicy, RouteKey, chained_hashes, route_key
from mla_runtime.serving.asgi_call import HttpRequest, ResponseStart, call_asgi
from mla_runtime.serving.config import ReplicaConfig, resolve_all
from mla_runtime.serving.replica_metrics import ReplicaScrape, render
from mla_runtime.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "mla_runtime" / "demo_model"


# -- routing keys ----------------------------------------------------------------------------------
def test_block_hashes_chain_like_the_block_pool():
    ids = list(range(40))
    hashes = chained_hashes(ids, 16)
    assert len(hashes) == 2  # full blocks only
    assert hashes[0] == block_hash(None, ids[:16]) and hashes[1] == block_hash(hashes[0], ids[16:32])
    assert chained_hashes(ids[:16] + [99] * 16, 16)[0] == hashes[0]  # a shared first block matches
    assert chained_hashes([7] + ids[1:], 16)[0] != hashes[0]


def test_route_key_session_header_then_user_field_then_prompt_tokens():
    tok = load_tokenizer(DEMO)
    prompt = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 4
    body = json.dumps({"prompt": prompt, "user": "alice"}).encode()
    key = route_key("/v1/completions", {}, body, tok, 16)
    assert key.session == "alice"
    assert key.block_hashes == chained_hashes(tok.encode(prompt), 16) and len(key.block_hashes) >= 2
    assert route_key("/v1/completions", {"x-session-id": "s1"}, body, tok, 16).session == "s1"
    ids = json.dumps({"prompt": list(range(33))}).encode()
    assert route_key("/generate", {}, ids, tok, 16).block_hashes == chained_hashes(list(range(33)), 16)
    chat = json.dumps({"messages": [{"role": "user", "content": prompt}]}).encode()
    assert len(route_key("/v1/chat/completions", {}, chat, tok, 16).block_hashes) >= 2
    no_tokenizer = route_key("/v1/completions", {}, body, None, 16)  # bytes stand in for tokens
    assert no_tokenizer.block_hashes == chained_hashes(list(prompt.encode()), 64)


@pytest.mark.parametrize("body", [b"", b"{not json", b"[1, 2]", b'{"prompt": 5}', b'{"messages": "x"}'])
def test_route_key_of_a_bad_body_is_empty_and_never_raises(body):
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        assert route_key(path, {}, body, None, 16) == RouteKey()


# -- the policy ------------------------------------------------------------------------------------
def key(*hashes: int, session: str | None = None) -> RouteKey:
    return RouteKey(session, tuple(hashes))


def test_policy_prefers_the_longest_prefix_then_spreads_new_ones():
    p = AffinityPolicy(queue_threshold=4)
    idle = {"a": 0, "b": 0}
    first = p.decide(["a", "b"], idle, key(1, 2, 3))
    assert first.reason == "least_loaded"
    p.record(first.ranked[0], key(1, 2, 3), first)
    other = next(r for r in "ab" if r != first.ranked[0])
    new = p.decide(["a", "b"], idle, key(9, 8))
    assert new.ranked[0] == other, "a new prefix goes to the replica holding fewer blocks"
    p.record(other, key(1, 2), new)  # the other replica holds a shorter run of the same prefix
    hit = p.decide(["a", "b"], idle, key(1, 2, 3, 4))
    assert (hit.ranked[0], hit.reason) == (first.ranked[0], "affinity_hit")
    assert p.matched_blocks(first.ranked[0], key(1, 2, 3, 4)) == 3 and p.matched_blocks(other, key(1, 2, 3, 4)) == 2


def test_policy_session_wins_and_a_busy_replica_falls_back_to_the_least_loaded():
    p = AffinityPolicy(queue_threshold=2)
    p.record("a", key(1, 2), None)
    p.record("b", key(5, session="s"), p.decide(["a", "b"], {}, key(5, session="s")))
    assert p.sessions["s"] == "b"
    d = p.decide(["a", "b"], {"a": 0, "b": 0}, key(1, 2, session="s"))
    assert (d.ranked[0], d.reason) == ("b", "session")
    d = p.decide(["a", "b"], {"a": 3, "b": 0}, key(1, 2))
    assert (d.ranked[0], d.reason) == ("b", "load_fallback")
    d = p.decide(["a", "b"], {"a": 0, "b": 0}, key(1, 2))
    assert p.record("b", key(1, 2), d) == "load_fallback"  # the preferred replica (a) was full: Ray took b
    assert p.counts["load_fallback"] == 1 and p.counts["least_loaded"] == 2
    p.forget(["a"])
    assert "b" not in p.blocks and "s" not in p.sessions


def test_policy_remembers_a_bounded_number_of_blocks_and_round_robin_cycles():
    p = AffinityPolicy(max_blocks=3)
    p.record("a", key(1, 2, 3, 4, 5), None)
    assert list(p.blocks["a"]) == [3, 4, 5]
    rr = AffinityPolicy(policy="round_robin")
    firsts = [rr.decide(["a", "b", "c"], {}, key(1)).ranked[0] for _ in range(6)]
    assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]
    with pytest.raises(ValueError, match="router"):
        AffinityPolicy(policy="random")


# -- one request through an ASGI app in process ----------------------------------------------------
def asgi_app(seen: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"body": (await request.body()).decode(), "q": request.url.query,
                             "h": request.headers.get("x-test")}, headers={"X-Out": "1"})

    @app.get("/stream")
    async def stream(request: Request) -> StreamingResponse:
        async def events():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                seen.append("closed")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    return app


def test_call_asgi_returns_status_headers_body_and_streams():
    async def run() -> None:
        seen: list[str] = []
        app = asgi_app(seen)
        req = HttpRequest("POST", "/echo", b"a=1", (("X-Test", "yes"),), b"hello")
        parts = [p async for p in call_asgi(app, req)]
        assert isinstance(parts[0], ResponseStart) and parts[0].status == 200
        assert ("x-out", "1") in parts[0].headers
        assert json.loads(b"".join(parts[1:])) == {"body": "hello", "q": "a=1", "h": "yes"}
        gen = call_asgi(app, HttpRequest("GET", "/stream"))
        start = await anext(gen)
        assert isinstance(start, ResponseStart) and start.status == 200
        assert await anext(gen) == b"data: 0\n\n"
        await gen.aclose()  # the consumer leaves mid-stream: the app's stream is closed, not left running
        assert seen == ["closed"]
        boom = [p async for p in call_asgi(app, HttpRequest("GET", "/boom"))]
        assert isinstance(boom[0], ResponseStart) and boom[0].status == 500

    asyncio.run(run())


# -- /metrics of the replicas ----------------------------------------------------------------------
def test_metrics_of_replicas_are_labelled_and_merged():
    text = ("# HELP mla_prefix_cache_hits_tokens_total hits\n# TYPE mla_prefix_cache_hits_tokens_total counter\n"
            "mla_prefix_cache_hits_tokens_total {v}\n# HELP mla_requests_total r\n# TYPE mla_requests_total counter\n"
            'mla_requests_total{{endpoint="generate",outcome="success"}} {v}\n')
    body = render([ReplicaScrape("r1", 11, text.format(v=3)), ReplicaScrape("r2", 12, text.format(v=5))],
                  {"affinity_hit": 7, "session": 1})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}
    assert samples[("mla_prefix_cache_hits_tokens_total", (("replica", "r1"),))] == 3
    assert samples[("mla_prefix_cache_hits_tokens_total", (("replica", "r2"),))] == 5
    assert samples[("mla_requests_total", (("endpoint", "generate"), ("outcome", "success"), ("replica", "r2")))] == 5
    assert samples[("mla_replica_info", (("pid", "12"), ("replica", "r2")))] == 1
    assert samples[("mla_replicas", ())] == 2
    assert samples[("mla_router_decisions_total", (("reason", "affinity_hit"),))] == 7
    assert body.decode().count("# TYPE mla_requests_total counter") == 1


# -- configuration ---------------------------------------------------------------------------------
def test_replica_flags_and_yaml_section(tmp_path):
    _, _, rc = resolve_all(["--replicas", "3", "--router", "round_robin", "--ray-address", "auto"])
    assert (rc.replicas, rc.router, rc.ray_address, rc.enabled, rc.autoscaling) == (3, "round_robin", "auto", True,
                                                                                    False)
    _, _, rc = resolve_all(["--min-replicas", "1", "--max-replicas", "4", "--target-ongoing-requests", "6"])
    assert rc.autoscaling and rc.bounds == (1, 4) and rc.initial == 1 and rc.target_ongoing_requests == 6
    path = tmp_path / "serve.yaml"
    path.write_text("replicas:\n  count: 2\n  max: 5\n  affinity_queue_threshold: 3\n")
    _, _, rc = resolve_all(["--config", str(path)])
    assert (rc.replicas, rc.bounds, rc.affinity_queue_threshold) == (2, (2, 5), 3)
    _, _, rc = resolve_all([])
    assert not rc.enabled


@pytest.mark.parametrize("argv,field", [
    (["--replicas", "0"], "replicas"), (["--replicas", "2", "--min-replicas", "3"], "replicas"),
    (["--min-replicas", "4", "--max-replicas", "2"], "min_replicas"), (["--ray-address", "auto"], "ray_address"),
    (["--replicas", "2", "--router", "random"], "router"),
    (["--replicas", "2", "--target-ongoing-requests", "0"], "target_ongoing_requests")])
def test_bad_replica_settings_name_the_field(argv, field):
    with pytest.raises(ValueError, match=field):
        resolve_all(argv)


def test_replica_config_defaults_mean_one_process():
    assert not ReplicaConfig().enabled


def test_the_single_process_path_never_imports_ray():
    code = ("import sys; import mla_runtime.serving.server, mla_runtime.serving.app, mla_runtime.engine.async_llm, "
            "mla_runtime.cli; from mla_runtime.serving.config import resolve_all; resolve_all([]); "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout
