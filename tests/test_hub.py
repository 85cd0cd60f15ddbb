"""Models by hub repo id, offline: a local hub cache in tmp holds the demo model; ``LLM("org/name")``
loads it with ``HF_HUB_OFFLINE=1`` and generates the same tokens as the local folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mla_runtime import LLM, SamplingParams
from mla_runtime.hub import ModelNotFoundError, is_repo_id, resolve_model
from mla_runtime.serving.config import DEMO_MODEL, resolve

REPO = "test-org/demo-mla"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """``$HF_HUB_CACHE/models--test-org--demo-mla/{refs/main, snapshots/<commit>/...}``, offline."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    shutil.copytree(DEMO_MODEL, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / COMMIT


def _greedy(model: str, **kw) -> list[int]:
    with LLM(model, dtype="float32", max_model_len=256, kv_cache_memory="8MiB", **kw) as llm:
        out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return out[0].outputs[0].token_ids


def test_repo_id_loads_from_the_offline_cache_like_the_local_folder(hub_cache):
    assert resolve_model(REPO) == str(hub_cache)
    assert resolve_model(REPO, revision=COMMIT) == str(hub_cache)
    local = _greedy(str(DEMO_MODEL))
    assert len(local) == 12
    assert _greedy(REPO) == local
    assert _greedy(REPO, revision=COMMIT) == local


def test_hf_home_locates_the_cache(hub_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(hub_cache.parents[3]))  # $HF_HOME/hub/models--.../snapshots/<commit>
    assert resolve_model(REPO) == str(hub_cache)


def test_a_repo_id_not_cached_offline_gets_one_line_saying_what_to_do(hub_cache):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("nobody/not-cached")
    msg = str(err.value)
    assert "\n" not in msg
    assert "model nobody/not-cached could not be downloaded" in msg
    assert "HF_HUB_OFFLINE" in msg
    assert "hf download nobody/not-cached" in msg and "local checkpoint folder" in msg
    with pytest.raises(ModelNotFoundError, match="hf download test-org/demo-mla --revision v9"):
        resolve_model(REPO, revision="v9")  # a revision the cache does not hold


def test_an_engine_with_an_uncached_repo_id_fails_with_that_line(hub_cache):
    with pytest.raises(ValueError, match="nobody/not-cached could not be downloaded"):
        LLM("nobody/not-cached")


def test_local_folders_presets_and_missing_paths(tmp_path):
    assert resolve_model(str(tmp_path)) == str(tmp_path)  # a local folder is never looked up on the hub
    with pytest.raises(ModelNotFoundError, match="'deepseek-v3' is a preset"):
        resolve_model("deepseek-v3")
    for missing in (str(tmp_path / "nowhere"), "./nowhere/model", "nowhere"):
        with pytest.raises(ModelNotFoundError, match=f"{missing!r} does not exist"):
            resolve_model(missing)
    assert is_repo_id("deepseek-ai/DeepSeek-V2-Lite")
    assert not is_repo_id("a/b/c") and not is_repo_id("../x") and not is_repo_id(str(tmp_path))


def test_serve_takes_a_repo_id_and_revision_from_flags_and_yaml(tmp_path):
    engine, server = resolve(["--model", REPO, "--revision", "v1.0"], env={})
    assert (engine.model, engine.revision, server.served_model_name) == (REPO, "v1.0", REPO)
    (tmp_path / "serve.yaml").write_text(f"model:\n  path: {REPO}\n  revision: abc123\n")
    engine, _ = resolve(["--config", str(tmp_path / "serve.yaml")], env={})
    assert (engine.model, engine.revision) == (REPO, "abc123")
    with pytest.raises(ValueError, match="nor a hub repo id"):
        resolve(["--model", str(tmp_path / "missing")], env={})
