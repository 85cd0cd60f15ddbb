"""Server configuration: serve.yaml layout, flag precedence, errors that name the key (no server started)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mla_runtime import env
from mla_runtime.serving import config as cfg
from mla_runtime.serving import server
from mla_runtime.serving.config import ServerConfig, resolve

EXAMPLE = Path(cfg.__file__).with_name("serve.example.yaml")
ROOT = Path(__file__).resolve().parent.parent


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


def test_every_engine_setting_has_a_flag(model_dir):
    engine, _ = resolve(["--model", str(model_dir), "--no-enable-prefix-caching", "--num-threads", "auto",
                         "--attention-backend", "torch", "--attention-path", "naive", "--seed", "7",
                         "--device", "cpu", "--latent-projection", "pca", "--latent-calibration", "calib.txt",
                         "--max-num-batched-tokens", "512", "--verify-weights"], env={})
    assert engine.enable_prefix_caching is False and engine.num_threads == "auto" and engine.verify_weights
    assert (engine.attention_backend, engine.attention_path, engine.seed, engine.device) == ("torch", "naive", 7, "cpu")
    assert (engine.latent_projection, engine.latent_calibration, engine.max_num_batched_tokens) == \
        ("pca", "calib.txt", 512)
    engine, _ = resolve(["--model", str(model_dir), "--num-threads", "3"], env={})
    assert engine.num_threads == 3 and engine.enable_prefix_caching is True


def test_every_engine_setting_has_a_yaml_key_and_flags_turn_booleans_off(tmp_path, model_dir):
    path = write(tmp_path, f"""
model: {{path: {model_dir}, attention_backend: torch, attention_path: absorbed, verify_weights: true}}
kv_cache: {{prefix_caching: false, max_num_batched_tokens: 256}}
engine: {{seed: 3, device: cpu, num_threads: 2}}
""")
    engine, _ = resolve(["--config", path], env={})
    assert (engine.attention_backend, engine.attention_path, engine.verify_weights) == ("torch", "absorbed", True)
    assert (engine.enable_prefix_caching, engine.max_num_batched_tokens) == (False, 256)
    assert (engine.seed, engine.device, engine.num_threads) == (3, "cpu", 2)
    engine, _ = resolve(["--config", path, "--enable-prefix-caching", "--no-verify-weights"], env={})
    assert engine.enable_prefix_caching is True and engine.verify_weights is False


def test_a_bad_thread_count_is_a_usage_error(model_dir, capsys):
    with pytest.raises(SystemExit) as done:
        resolve(["--model", str(model_dir), "--num-threads", "many"], env={})
    assert done.value.code == 2
    assert "--num-threads: expected a count or 'auto', got 'many'" in capsys.readouterr().err


def test_yaml_errors_name_the_new_keys(tmp_path, model_dir):
    path = write(tmp_path, "engine: {seed: '7'}\n")
    with pytest.raises(ValueError, match=r"engine\.seed must be int, got '7'"):
        resolve(["--config", path, "--model", str(model_dir)], env={})
    path = write(tmp_path, "model: {attention_backend: tpu}\n")
    with pytest.raises(ValueError, match=r"attention_backend.*model\.attention_backend / --attention-backend"):
        resolve(["--config", path, "--model", str(model_dir)], env={})


def test_an_empty_api_key_in_the_environment_is_no_key(model_dir):
    _, srv = resolve(["--model", str(model_dir)], env={"MLA_API_KEY": ""})
    assert srv.api_key is None


@pytest.mark.parametrize("code", [
    "from mla_runtime.cli import main; main(['serve', '--help'])",
    "import runpy; sys.argv = ['server.py', '--help']; runpy.run_path(str(ROOT / 'server.py'), run_name='__main__')",
])
def test_serve_help_imports_neither_torch_nor_triton(code):
    script = (f"import sys\nfrom pathlib import Path\nROOT = Path({str(ROOT)!r})\ntry:\n    {code}\n"
              f"except SystemExit:\n    pass\nprint('MODULES', sorted(sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in done.stdout
    modules = done.stdout.rsplit("MODULES", 1)[1]
    assert "'torch'" not in modules and "'triton'" not in modules


def test_the_docs_list_every_option_and_environment_variable():
    text = (ROOT / "docs" / "configuration.md").read_text()
    for o in cfg.OPTIONS.values():
        assert f"`{o.flag}`" in text and f"`{o.yaml}`" in text, o.name
    for name in ("MLA_API_KEY", "MLA_TP_WAIT_S", "HF_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "TORCHELASTIC_RUN_ID",
                 "WORLD_SIZE", "RANK", "MLA_FAULT_INJECTION", "CXX", "MLA_KERNEL_CACHE", "XDG_CACHE_HOME",
                 "MLA_CPU_ISA", "MLA_CPU_EMULATE_AMX", "MLA_REQUIRE_PROMTOOL"):
        assert f"`{name}`" in text and name in env.__doc__, name


def test_the_torch_free_vocabulary_matches_the_tables_it_names():
    from mla_runtime import options
    from mla_runtime.dtypes import CACHE_DTYPES
    from mla_runtime.layers.quantization import WEIGHT_FORMATS

    assert options.CACHE_DTYPE_NAMES == tuple(CACHE_DTYPES)
    assert options.WEIGHT_QUANTIZATIONS == tuple(WEIGHT_FORMATS)
