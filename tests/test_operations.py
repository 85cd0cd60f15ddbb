"""What an operator relies on: shipped alert rules and dashboard, request ids and the per-request log,
weights checked by sha256, and the cache-pressure policy.

The rules are run by ``promtool`` (the Debian ``prometheus`` package; ``.ci/run`` installs it) against their
unit tests; every metric the rules and the dashboard name must be exported by a running server.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from mla_runtime import SamplingParams
from mla_runtime.checksums import MANIFEST, WeightsMismatch, fingerprint, sha256_file, verify
from mla_runtime.checksums import main as hash_main
from mla_runtime.engine.block_pool import BlockPool
from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.worker import Worker
from mla_runtime.serving.request_log import JsonFormatter
from tests.test_engine import new_llm, tokens
from tests.test_server import Live, text_checkpoint, wait_idle  # noqa: F401 - text_checkpoint is a fixture

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "mla-runtime.json"
LOG_FIELDS = {"request_id", "endpoint", "arrival", "queue_time_s", "ttft_s", "duration_s", "prompt_tokens",
              "cached_tokens", "generated_tokens", "finish_reason", "status", "cache_blocks_used",
              "cache_blocks_total", "rss_bytes"}


# -- alert rules and dashboard ------------------------------------------------------------------
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI") or os.environ.get("MLA_REQUIRE_PROMTOOL"):
            pytest.fail("promtool is missing: install the Debian 'prometheus' package (.ci/run does)")
        pytest.skip("promtool is not installed here (apt-get install prometheus); CI installs and requires it")
    return found


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["expr"] for g in groups for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


def test_rules_pass_promtool_check_and_unit_tests():
    tool = promtool()
    for args in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)]):
        run = subprocess.run([tool, *args], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    tested = {case["alertname"] for t in tests for case in t["alert_rule_test"] if case["exp_alerts"]}
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    assert tested == alerts  # every alert has a case where it fires (and the others check that it stays silent)


def test_dashboard_shows_every_alerted_signal():
    names = set(re.findall(r"\b(mla[_:][\w:]+|process_\w+)", " ".join(dashboard_exprs())))
    recorded = {r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "record" in r}
    assert {n for n in names if ":" in n} <= recorded  # the dashboard's mla:* series come from the rules
    alerts = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]
    for rule in alerts:
        shown = set(re.findall(r"\b(mla[_:][\w:]+|process_\w+)", rule["expr"])) & names
        assert shown, f"no panel shows the signal of {rule['alert']}"
    assert "mla_memory_bytes" in dashboard_exprs()  # the memory split: one series per part (weights, cache, ...)


# -- a running server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ops_server(text_checkpoint) -> Iterator[Live]:  # noqa: F811 - the fixture imported above
    write = hash_main([str(text_checkpoint)])
    assert write == 0 and (text_checkpoint / MANIFEST).is_file()
    live = Live(text_checkpoint, engine={"verify_weights": True}, log_format="json")
    yield live
    live.stop()


def test_every_metric_of_the_rules_and_dashboard_is_exported(ops_server):
    httpx.post(ops_server.base + "/generate", json={"prompt": "def hello", "max_tokens": 2}).raise_for_status()
    exported = {line.split("{")[0].split(" ")[0] for line in httpx.get(ops_server.base + "/metrics").text.splitlines()
                if line and not line.startswith("#")}
    named = set()
    for expr in rule_exprs() + dashboard_exprs():
        named |= set(re.findall(r"\b(mla_\w+|process_\w+)", expr))
    assert named and named <= exported, sorted(named - exported)


def request_line(caplog, request_id: str, timeout: float = 10.0) -> logging.LogRecord:
    """The log record of ``request_id`` (written once its response, a stream included, is over)."""
    end = time.monotonic() + timeout
    while True:
        found = [r for r in caplog.records if getattr(r, "request", {}).get("request_id") == request_id]
        if found:
            assert len(found) == 1
            return found[0]
        assert time.monotonic() < end, f"no request log line for {request_id}"
        time.sleep(0.05)


def test_json_request_log_line_and_request_id(ops_server, caplog):
    caplog.set_level(logging.INFO, logger="mla_runtime.requests")
    base = ops_server.base
    r = httpx.post(base + "/generate", json={"prompt": "def hello(world):", "max_tokens": 4},
                   headers={"X-Request-Id": "client-id.42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-id.42"
    with httpx.stream("POST", base + "/v1/completions", json={"prompt": "the quick", "max_tokens": 3,
                                                             "stream": True}) as s:
        streamed_id = s.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", streamed_id) and s.read()
    bad = httpx.post(base + "/generate", json={"prompt": "", "max_tokens": 4}, headers={"X-Request-Id": "bad id!"})
    assert bad.status_code == 400 and re.fullmatch(r"[0-9a-f]{32}", bad.headers["x-request-id"])
    assert httpx.get(base + "/health").headers["x-request-id"]
    wait_idle(ops_server)
    ok = json.loads(JsonFormatter().format(request_line(caplog, "client-id.42")))
    assert LOG_FIELDS <= set(ok) and "prompt" not in ok and "error_type" not in ok
    assert ok["endpoint"] == "/generate" and ok["status"] == 200 and ok["generated_tokens"] == 4
    assert ok["finish_reason"] == "length" and ok["prompt_tokens"] > 0 and ok["rss_bytes"] > 0
    assert 0 <= ok["queue_time_s"] <= ok["ttft_s"] <= ok["duration_s"]
    assert ok["cache_blocks_total"] == ops_server.llm.engine.pool.num_blocks and ok["arrival"].endswith("Z")
    streamed = request_line(caplog, streamed_id).request  # type: ignore[attr-defined]
    assert streamed["status"] == 200 and streamed["generated_tokens"] == 3 and streamed["outcome"] == "success"
    refused = request_line(caplog, bad.headers["x-request-id"]).request  # type: ignore[attr-defined]
    assert refused["status"] == 400 and refused["error_type"] == "invalid" and "prompt_tokens" not in refused


def test_prompt_text_is_logged_only_with_log_prompts(ops_server, caplog):
    caplog.set_level(logging.INFO, logger="mla_runtime.requests")
    log = ops_server.app.state.request_log
    for flag in (False, True):
        log.log_prompts = flag
        rid = f"prompts-{flag}"
        httpx.post(ops_server.base + "/generate", json={"prompt": "secret words", "max_tokens": 1},
                   headers={"X-Request-Id": rid}).raise_for_status()
        line = JsonFormatter().format(request_line(caplog, rid))
        assert ("secret words" in line) is flag
    log.log_prompts = False


def test_weights_fingerprint_in_model_info(ops_server, text_checkpoint):  # noqa: F811
    info = [line for line in httpx.get(ops_server.base + "/metrics").text.splitlines()
            if line.startswith("mla_model_info{")][0]
    want = fingerprint({f.name: sha256_file(f) for f in text_checkpoint.glob("*.safetensors")})
    assert f'weights="{want}"' in info and 'weights_verified="true"' in info
    assert 'attention_backend="cpu"' in info  # the backend the model attends through on this CPU


# -- verified weights ---------------------------------------------------------------------------
def flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_weights_rejects_a_flipped_byte(tmp_path, tiny_checkpoint):
    src, _ = tiny_checkpoint("v3")
    ckpt = Path(shutil.copytree(src, tmp_path / "ckpt"))
    with pytest.raises(WeightsMismatch, match="no sha256 manifest"):
        verify(ckpt)
    assert hash_main([str(ckpt)]) == 0
    good = verify(ckpt)
    assert hash_main([str(ckpt), "--check"]) == 0
    weights = sorted(ckpt.glob("*.safetensors"))[0]
    flip_byte(weights)
    with pytest.raises(WeightsMismatch, match=re.escape(weights.name)):
        verify(ckpt)
    with pytest.raises(WeightsMismatch, match=re.escape(weights.name)):  # start-up stops before loading
        Worker(EngineConfig(model=str(ckpt), dtype="float32", verify_weights=True)).load()
    flip_byte(weights)
    assert verify(ckpt) == good


def test_hub_snapshot_is_checked_against_its_lfs_hashes(tmp_path, tiny_checkpoint):
    """A hub-cache snapshot links each file to blobs/<sha256>: those are the hashes checked."""
    src, _ = tiny_checkpoint("v3")
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "0123abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for f in src.iterdir():
        digest = sha256_file(f)
        shutil.copy(f, blobs / digest)
        (snap / f.name).symlink_to(Path("../..") / "blobs" / digest)
    assert not (snap / MANIFEST).exists()
    verify(snap)
    flip_byte((snap / "model.safetensors").resolve())
    with pytest.raises(WeightsMismatch, match="model.safetensors.*hub's LFS hashes"):
        verify(snap)


# -- cache pressure ----------------------------------------------------------------------------
def cached_idle_pool(watermark: float) -> tuple[BlockPool, list[int]]:
    """10 blocks: 6 hold indexed prefixes no sequence uses (freed in order 5, 4, ... 0), none in use."""
    pool = BlockPool(10, 16, watermark=watermark)
    blocks = pool.allocate(6)
    for k, b in enumerate(blocks):
        pool.register(b, hash(("prefix", k)))
    pool.free(blocks)
    return pool, blocks


def test_pressure_frees_idle_prefix_blocks_lru_first_and_never_running_ones():
    pool, cached = cached_idle_pool(0.8)
    assert pool.relieve_pressure() == 0 and pool.num_idle_cached_blocks == 6  # 6 of 10 occupied: below 80 %
    running = pool.allocate(3)  # taken from the plain free blocks: the cached ones stay
    assert pool.num_idle_cached_blocks == 6 and pool.occupancy() == 0.9
    assert pool.relieve_pressure() == 1 and pool.pressure_freed == 1
    assert pool.occupancy() == 0.8 and pool.num_idle_cached_blocks == 5
    assert pool.lookup([hash(("prefix", 5))], 16) == []  # block 5 was freed first: the least recently used
    assert len(pool.lookup([hash(("prefix", 0))], 16)) == 1
    rest = pool.allocate(pool.num_free_blocks - pool.num_idle_cached_blocks)  # the plain free ones
    assert all(pool.ref_counts[b] == 1 for b in running)
    full = pool.allocate(pool.num_idle_cached_blocks)  # running work may still take every block
    assert pool.usage() == 1.0 and pool.relieve_pressure() == 0
    pool.free(running + rest + full + [cached[0]])
    pool.check_whole()


def test_watermark_one_keeps_idle_blocks_until_an_allocation_needs_them():
    pool, _ = cached_idle_pool(1.0)
    pool.allocate(4)
    assert pool.relieve_pressure() == 0 and pool.num_idle_cached_blocks == 6


def test_engine_relieves_pressure_between_steps_without_changing_tokens_or_preempting(tiny_checkpoint):
    path, _ = tiny_checkpoint("v3")
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 200) for _ in range(40)]} for _ in range(10)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    size = 20 * 16 * (32 + 16) * 3 * 4  # 20 blocks of 16 tokens, fp32
    runs = {}
    for watermark in (1.0, 0.5):
        llm = new_llm(path, kv_cache_memory=size, cache_watermark=watermark)
        engine, peak = llm.engine, [0.0]
        step = engine.step

        def traced_step(step=step, engine=engine, peak=peak):
            out = step()
            peak[0] = max(peak[0], engine.pool.usage())
            return out

        engine.step = traced_step  # type: ignore[method-assign]
        runs[watermark] = (tokens(llm.generate(prompts, params)), engine.stats(), peak[0], engine.pool)
    (plain, plain_stats, _, _), (relieved, stats, peak, pool) = runs[1.0], runs[0.5]
    assert relieved == plain
    assert plain_stats.pressure_freed_blocks == 0 and stats.pressure_freed_blocks > 0
    assert peak > 0.5  # running work still fills the cache past the watermark
    assert pool.occupancy() <= 0.5 and stats.seconds_above_watermark > 0
    pool.check_whole()
