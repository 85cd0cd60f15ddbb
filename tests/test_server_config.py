"""Server configuration: serve.yaml layout, flag precedence, errors that name the key (no server started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mla_runtime.serving import config as cfg
from mla_runtime.serving import server
from mla_runtime.serving.config import ServerConfig, resolve

EXAMPLE = Path(cfg.__file__).with_name("serve.example.yaml")


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "serve.yaml"
    p.write_text(text)
    return str(p)


def test_yaml_layout_maps_onto_engine_and_server_configs(tmp_path, model_dir):
    path = write(tmp_path, f"""
model:
  path: {model_dir}
  dtype: bfloat16
kv_cache:
  max_seq_len: 4096
  memory: 2GiB
  block_size: 32
  max_num_seqs: 8
  dtype: fp8
serving:
  listen_port: 8080
  request_timeout: 30
  max_queue: 16
  api_key: secret
""")
    engine, srv = resolve(["--config", path], env={})
    assert (engine.model, engine.dtype, engine.max_model_len, engine.kv_cache_memory, engine.block_size,
            engine.max_num_seqs, engine.kv_cache_dtype) == (str(model_dir), "bfloat16", 4096, 2 * 2**30, 32, 8, "fp8")
    assert (srv.port, srv.request_timeout, srv.max_queue, srv.api_key) == (8080, 30, 16, "secret")
    assert srv.served_model_name == "my-model" and srv.host == "127.0.0.1"


def test_flags_override_the_file_and_the_file_overrides_the_environment(tmp_path, model_dir):
    path = write(tmp_path, f"model: {{path: {model_dir}}}\nserving: {{listen_port: 8080, api_key: from-file}}\n")
    engine, srv = resolve(["--config", path, "--port", "9000", "--max-num-seqs", "3", "--tensor-parallel-size",
                           "2", "--latent-cache-layout", "sharded", "--kv-cache-dtype", "int8",
                           "--max-body-bytes", "1MiB", "--request-timeout", "2.5"], env={"MLA_API_KEY": "env"})
    assert srv.port == 9000 and engine.max_num_seqs == 3 and srv.api_key == "from-file"
    assert (engine.tensor_parallel_size, engine.latent_cache_layout, engine.kv_cache_dtype) == (2, "sharded", "int8")
    assert srv.max_body_bytes == 2**20 and srv.request_timeout == 2.5
    engine, srv = resolve(["--model", str(model_dir), "--latent-rank", "16", "--kv-cache-memory", "64MiB",
                           "--max-model-len", "1024"], env={"MLA_API_KEY": "env"})
    assert srv.api_key == "env" and srv.port == 8000
    assert (engine.latent_rank, engine.kv_cache_memory, engine.max_model_len) == (16, 64 * 2**20, 1024)
    path = write(tmp_path, f"model: {{path: {model_dir}}}\nspeculative: {{num_tokens: 4, prompt_lookup_max: 5}}\n")
    engine, _ = resolve(["--config", path, "--prompt-lookup-min", "2"], env={})
    assert (engine.num_speculative_tokens, engine.prompt_lookup_max, engine.prompt_lookup_min) == (4, 5, 2)


@pytest.mark.parametrize("text, named", [
    ("kv_cache: {gpu_memory_util: 0.9}", "kv_cache.memory"),  # the seed's key: point at ours
    ("serving: {listen_prot: 1}", "serving.listen_prot"),
    ("server: {port: 1}", "server"),
    ("kv_cache: {block_size: '16'}", "kv_cache.block_size"),
    ("serving: {listen_port: true}", "serving.listen_port"),
    ("- a list", "mapping"),
])
def test_unknown_or_mistyped_yaml_keys_are_errors_naming_them(tmp_path, model_dir, text, named):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        resolve(["--config", path, "--model", str(model_dir)], env={})


@pytest.mark.parametrize("argv, named", [
    (["--block-size", "24"], "block_size"),
    (["--kv-cache-dtype", "int3"], "kv_cache_dtype"),
    (["--port", "70000"], "port"),
    (["--max-queue", "-1"], "max_queue"),
    (["--request-timeout", "0"], "request_timeout"),
    (["--max-body-bytes", "lots"], "lots"),
    (["--latent-cache-layout", "diagonal"], "latent_cache_layout"),
])
def test_bad_values_name_the_field_and_where_to_set_it(model_dir, argv, named):
    with pytest.raises(ValueError, match=named) as e:
        resolve(["--model", str(model_dir), *argv], env={})
    assert str(e.value).startswith("invalid configuration")


def test_missing_model_and_missing_demo_model_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no config.json"):
        resolve(["--model", str(tmp_path / "nowhere")], env={})
    monkeypatch.setattr(cfg, "DEMO_MODEL", tmp_path / "demo_model")
    with pytest.raises(ValueError, match="--model PATH"):
        resolve([], env={})


def test_server_main_exits_2_with_the_reason(tmp_path, capsys):
    assert server.main(["--model", str(tmp_path), "--port", "1"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_the_shipped_example_is_valid(model_dir):
    engine, srv = resolve(["--config", str(EXAMPLE), "--model", str(model_dir)], env={})
    assert isinstance(srv, ServerConfig) and engine.model == str(model_dir)


def test_no_model_flag_serves_the_embedded_demo_model():
    assert (cfg.DEMO_MODEL / "config.json").is_file()  # shipped in the package: the README's first command needs it
    engine, srv = resolve([], env={})
    assert engine.model == str(cfg.DEMO_MODEL) and srv.served_model_name == "demo_model"
    assert (srv.host, srv.port) == ("127.0.0.1", 8000)
