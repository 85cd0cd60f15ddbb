"""Server configuration: defaults < ``MLA_API_KEY`` < ``--config serve.yaml`` < command-line flags.

Every option has one flat name (the ``EngineConfig`` or ``ServerConfig`` field it sets). ``OPTIONS`` maps
each to its place in the YAML file (the seed's ``model`` / ``kv_cache`` / ``serving`` layout) and to its
flag, so an error can always say where the bad value came from. Unknown YAML keys are an error that names
the key; the engine options are validated by ``EngineConfig`` itself.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from mla_runtime.engine.config import EngineConfig
from mla_runtime.hub import is_repo_id
from mla_runtime.plan import parse_bytes

DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo_model"
API_KEY_ENV = "MLA_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    request_timeout: float = 120.0  # seconds from arrival (queueing included) to the last token
    max_queue: int = 256  # requests admitted beyond max_num_seqs before answering 429
    api_key: str | None = None
    max_body_bytes: int | str = "4MiB"
    served_model_name: str | None = None
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests before aborting them
    header_timeout: float = 10.0  # seconds for a request's headers and body to arrive, then the connection closes
    stream_stall_timeout: float = 30.0  # seconds a streaming client may not read before its stream is aborted
    step_timeout: float = 120.0  # seconds one engine step may run before /health turns 503 and the server restarts
    max_connections: int = 1000  # open connections; beyond, new ones are closed at once
    metrics_auth: bool = False  # /metrics requires the API key too
    log_format: str = "text"  # "text" (a line for a terminal) or "json" (one JSON object per line)
    log_prompts: bool = False  # the request log carries the prompt's text

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        for name in ("request_timeout", "shutdown_timeout", "header_timeout", "stream_stall_timeout", "step_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if not isinstance(self.max_queue, int) or isinstance(self.max_queue, bool) or self.max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {self.max_queue!r}")
        if not isinstance(self.max_connections, int) or isinstance(self.max_connections, bool) or \
                self.max_connections < 1:
            raise ValueError(f"max_connections must be an integer >= 1, got {self.max_connections!r}")
        if not isinstance(self.metrics_auth, bool):
            raise ValueError(f"metrics_auth must be true or false, got {self.metrics_auth!r}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be 'text' or 'json', got {self.log_format!r}")
        if not isinstance(self.log_prompts, bool):
            raise ValueError(f"log_prompts must be true or false, got {self.log_prompts!r}")
        if self.metrics_auth and self.api_key is None:
            raise ValueError("metrics_auth needs an API key (--api-key or $MLA_API_KEY)")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string")
        body = parse_bytes(self.max_body_bytes)
        if body < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes!r}")
        object.__setattr__(self, "max_body_bytes", body)


ROUTERS = ("affinity", "round_robin")


def _count(name: str, value: object, low: int) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class ReplicaConfig:
    """Replicas on Ray Serve (``serving/ray_replicas.py``); ``replicas`` None (and no min/max): one process."""

    replicas: int | None = None  # engine replicas (the initial count when autoscaling)
    ray_address: str | None = None  # join this Ray cluster (default: start a local Ray instance)
    min_replicas: int | None = None  # autoscaling bounds (either one turns autoscaling on)
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # per replica, for autoscaling (default: max_num_seqs)
    router: str = "affinity"  # affinity (prefix/session) or round_robin
    affinity_queue_threshold: int | None = None  # ongoing requests beyond which a replica is passed over
    replica_cpus: float = 1.0  # Ray CPUs each replica reserves (its torch threads follow them)

    def __post_init__(self) -> None:
        _count("replicas", self.replicas, 1)
        _count("min_replicas", self.min_replicas, 1)
        _count("max_replicas", self.max_replicas, 1)
        _count("affinity_queue_threshold", self.affinity_queue_threshold, 0)
        low, high = self.min_replicas, self.max_replicas
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_replicas ({low}) must be <= max_replicas ({high})")
        if self.replicas is not None and ((low is not None and self.replicas < low) or
                                          (high is not None and self.replicas > high)):
            raise ValueError(f"replicas ({self.replicas}) must lie within min_replicas..max_replicas")
        target = self.target_ongoing_requests
        if target is not None and (not isinstance(target, (int, float)) or isinstance(target, bool) or target <= 0):
            raise ValueError(f"target_ongoing_requests must be a number > 0, got {target!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if not isinstance(self.replica_cpus, (int, float)) or self.replica_cpus < 0:
            raise ValueError(f"replica_cpus must be a number >= 0, got {self.replica_cpus!r}")
        if not self.enabled and (self.ray_address is not None or self.target_ongoing_requests is not None):
            raise ValueError("ray_address and target_ongoing_requests need --replicas N (or --min/--max-replicas)")

    @property
    def enabled(self) -> bool:
        return self.replicas is not None or self.min_replicas is not None or self.max_replicas is not None

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def initial(self) -> int:
        """Replicas started first."""
        return self.replicas or self.min_replicas or 1

    @property
    def bounds(self) -> tuple[int, int]:
        """(min, max) replicas when autoscaling."""
        low = self.min_replicas or min(self.initial, self.max_replicas or self.initial)
        return low, self.max_replicas or max(low, self.initial)


@dataclass(frozen=True)
class Option:
    yaml: str | None  # "section.key" in serve.yaml
    flag: str | None
    type: Any = str
    help: str = ""


ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}
SERVER_FIELDS = {f.name for f in fields(ServerConfig)}
REPLICA_FIELDS = {f.name for f in fields(ReplicaConfig)}

OPTIONS: dict[str, Option] = {
    "model": Option("model.path", "--model", str, "checkpoint directory or hub repo id org/name "
                                                  "(default: the embedded demo model)"),
    "revision": Option("model.revision", "--revision", str,
                       "hub branch, tag or commit of a repo id --model (default: main)"),
    "dtype": Option("model.dtype", "--dtype", str, "weight/compute dtype: auto, bfloat16, float16, float32"),
    "quantization": Option("model.quantization", "--quantization", str,
                           "weight-only quantisation at load: none or int8 (per-channel scales) "
                           "(default: the checkpoint's weights in --dtype)"),
    "tensor_parallel_size": Option("model.tensor_parallel_size", "--tensor-parallel-size", int,
                                   "ranks the model is sharded across (torchrun or worker processes)"),
    "latent_rank": Option("model.latent_rank", "--latent-rank", int,
                          "truncate the cached latent to this rank (default: the model's kv_lora_rank)"),
    "attention_backend": Option(None, "--attention-backend", str, "triton or torch (default: by device)"),
    "max_model_len": Option("kv_cache.max_seq_len", "--max-model-len", int,
                            "context limit per request (default: the model's max_position_embeddings)"),
    "kv_cache_memory": Option("kv_cache.memory", "--kv-cache-memory", str,
                              "latent-cache bytes, e.g. 8GiB (default: on CPU a quarter of the available RAM, "
                              "at most max-num-seqs full sequences; on GPU 90%% of free memory less weights "
                              "and activations)"),
    "block_size": Option("kv_cache.block_size", "--block-size", int, "tokens per cache block (multiple of 16)"),
    "max_num_seqs": Option("kv_cache.max_num_seqs", "--max-num-seqs", int, "sequences running at once"),
    "max_num_batched_tokens": Option(None, "--max-num-batched-tokens", int,
                                     "token budget of one step (default: max-model-len capped at 8192, "
                                     "at least 2048)"),
    "kv_cache_dir": Option("kv_cache.dir", "--kv-cache-dir", str,
                           "directory of the disk tier: evicted prefix-cache blocks are written there and found "
                           "again after a restart; several processes may share it (default: off)"),
    "kv_cache_write_through": Option("kv_cache.write_through", "--kv-cache-write-through", bool,
                                     "write every full block to the disk tier as soon as it is complete"),
    "kv_cache_disk_bytes": Option("kv_cache.disk_bytes", "--kv-cache-disk-bytes", str,
                                  "bound of the disk tier's directory, e.g. 500GiB; least recently used files go "
                                  "first (default: its current size plus 90%% of the free disk space)"),
    "kv_cache_host_bytes": Option("kv_cache.host_bytes", "--kv-cache-host-bytes", str,
                                  "host RAM for the host tier between the GPU's cache and the disk tier, e.g. "
                                  "64GiB; 0: none (default: on CUDA a quarter of the available RAM, on a CPU none)"),
    "kv_cache_dtype": Option("kv_cache.dtype", "--kv-cache-dtype", str, "auto, bfloat16, float16, fp8, int8…"),
    "latent_cache_layout": Option("kv_cache.layout", "--latent-cache-layout", str, "replicated or sharded"),
    "speculative_method": Option("speculative.method", "--speculative-method", str,
                                 "where drafts come from: prompt_lookup, or mtp (the checkpoint's "
                                 "multi-token-prediction layer)"),
    "num_speculative_tokens": Option("speculative.num_tokens", "--num-speculative-tokens", int,
                                     "draft tokens per decode step (0: off; mtp alone: 1)"),
    "speculative_token_map": Option("speculative.token_map", "--speculative-token-map", str,
                                    "JSON list of the token ids MTP drafts may propose ('none': all; default: "
                                    "the checkpoint's speculative_token_map.json, else all)"),
    "prompt_lookup_max": Option("speculative.prompt_lookup_max", "--prompt-lookup-max", int,
                                "longest suffix looked up for drafts"),
    "prompt_lookup_min": Option("speculative.prompt_lookup_min", "--prompt-lookup-min", int,
                                "shortest suffix looked up for drafts"),
    "host": Option("serving.host", "--host", str, "address to listen on"),
    "port": Option("serving.listen_port", "--port", int, "port to listen on (0: any free port)"),
    "request_timeout": Option("serving.request_timeout", "--request-timeout", float, "seconds; then 504"),
    "max_queue": Option("serving.max_queue", "--max-queue", int, "requests waiting beyond max_num_seqs; then 429"),
    "api_key": Option("serving.api_key", "--api-key", str, f"require 'Authorization: Bearer KEY' "
                                                           f"(default: ${API_KEY_ENV})"),
    "max_body_bytes": Option("serving.max_body_bytes", "--max-body-bytes", str, "request body limit; then 413"),
    "served_model_name": Option("serving.served_model_name", "--served-model-name", str,
                                "model id in /v1/models (default: the checkpoint folder's name)"),
    "shutdown_timeout": Option("serving.shutdown_timeout", "--shutdown-timeout", float,
                               "seconds SIGTERM waits for in-flight requests"),
    "header_timeout": Option("serving.header_timeout", "--header-timeout", float,
                             "seconds for a request's headers and body to arrive; then the connection closes"),
    "stream_stall_timeout": Option("serving.stream_stall_timeout", "--stream-stall-timeout", float,
                                   "seconds a streaming client may not read; then its stream is aborted"),
    "step_timeout": Option("serving.step_timeout", "--step-timeout", float,
                           "seconds one engine step may run; then /health is 503 and the server exits 1 "
                           "after draining"),
    "max_connections": Option("serving.max_connections", "--max-connections", int,
                              "open connections; beyond, new ones are closed at once"),
    "metrics_auth": Option("serving.metrics_auth", "--metrics-auth", bool, "/metrics requires the API key"),
    "replicas": Option("replicas.count", "--replicas", int, "engine replicas behind one port, on Ray Serve "
                                                            "(default: one process, no Ray)"),
    "ray_address": Option("replicas.ray_address", "--ray-address", str,
                          "join this Ray cluster (default: start a local Ray instance)"),
    "min_replicas": Option("replicas.min", "--min-replicas", int,
                           "autoscale on ongoing requests, down to this many replicas (default: no autoscaling; "
                           "with --max-replicas: --replicas or 1)"),
    "max_replicas": Option("replicas.max", "--max-replicas", int,
                           "autoscale up to this many replicas (default: no autoscaling; with --min-replicas: "
                           "--replicas or the minimum)"),
    "target_ongoing_requests": Option("replicas.target_ongoing_requests", "--target-ongoing-requests", float,
                                      "autoscaling: ongoing requests per replica to aim at "
                                      "(default: max-num-seqs)"),
    "router": Option("replicas.router", "--router", str, "affinity (prefix and session) or round_robin"),
    "affinity_queue_threshold": Option("replicas.affinity_queue_threshold", "--affinity-queue-threshold", int,
                                       "ongoing requests beyond which the preferred replica is passed over for "
                                       "the least loaded (default: max-num-seqs)"),
    "replica_cpus": Option("replicas.cpus_per_replica", "--replica-cpus", float,
                           "Ray CPUs each replica reserves"),
    "log_format": Option("serving.log_format", "--log-format", str,
                         "text (a line for a terminal) or json (one JSON object per line, a line per request)"),
    "log_prompts": Option("serving.log_prompts", "--log-prompts", bool,
                          "the request log carries the prompt's text (never logged otherwise)"),
    "verify_weights": Option("model.verify_weights", "--verify-weights", bool,
                             "check every *.safetensors file against the checkpoint's sha256 manifest (the hub's "
                             "LFS hashes, or SHA256SUMS from 'mla-runtime hash') before loading"),
    "cache_watermark": Option("kv_cache.watermark", "--cache-watermark", float,
                              "fraction of latent-cache blocks (in use or cached) above which idle cached prefix "
                              "blocks are freed between steps, least recently used first (1.0: off)"),
}
YAML_KEYS = {opt.yaml: name for name, opt in OPTIONS.items() if opt.yaml}
YAML_HINTS = {"kv_cache.gpu_memory_util": "size the latent cache in bytes with kv_cache.memory (e.g. '40GiB')"}


def where(name: str) -> str:
    """Where an option can be set, for error messages: ``kv_cache.block_size / --block-size``."""
    opt = OPTIONS.get(name)
    if opt is None:
        return name
    return " / ".join(p for p in (opt.yaml, opt.flag) if p)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """serve.yaml → flat options. Unknown sections and keys are errors that name them."""
    import yaml

    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read the file ({e.strerror})") from e
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {e}") from e
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: the top level must be a mapping with model / kv_cache / serving")
    sections = sorted({k.split(".")[0] for k in YAML_KEYS})
    out: dict[str, Any] = {}
    for section, body in raw.items():
        if section not in sections:
            raise ValueError(f"--config {path}: unknown section {section!r} (known: {', '.join(sections)})")
        if not isinstance(body, dict):
            raise ValueError(f"--config {path}: {section} must be a mapping of keys")
        for key, value in body.items():
            dotted = f"{section}.{key}"
            if dotted not in YAML_KEYS:
                known = ", ".join(k.split(".")[1] for k in YAML_KEYS if k.startswith(section + "."))
                hint = YAML_HINTS.get(dotted, f"known keys in {section}: {known}")
                raise ValueError(f"--config {path}: unknown key {dotted!r}; {hint}")
            out[YAML_KEYS[dotted]] = _check_type(dotted, YAML_KEYS[dotted], value)
    return out


def _check_type(dotted: str, name: str, value: Any) -> Any:
    want = OPTIONS[name].type
    if name in ("kv_cache_memory", "max_body_bytes", "kv_cache_disk_bytes", "kv_cache_host_bytes"):  # "8GiB" or bytes
        want = (str, int)
    elif want is float:
        want = (int, float)
    if value is None or (isinstance(value, bool) and want is not bool) or not isinstance(value, want):
        kinds = " or ".join(t.__name__ for t in (want if isinstance(want, tuple) else (want,)))
        raise ValueError(f"{dotted} must be {kinds}, got {value!r}")
    return value


def build_parser(prog: str = "server.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Serve an MLA checkpoint over HTTP (/generate, /v1/*, /metrics).",
        epilog="Precedence: flags > --config file > $MLA_API_KEY > defaults.")
    parser.add_argument("--config", help="serve.yaml (sections model / kv_cache / speculative / serving; see "
                                         "mla_runtime/serving/serve.example.yaml)")
    for name, opt in OPTIONS.items():
        if opt.flag is None:
            continue
        if opt.type is bool:  # a switch: given → true
            parser.add_argument(opt.flag, dest=name, action="store_true", default=None, help=_help(name, opt))
            continue
        parser.add_argument(opt.flag, dest=name, type=opt.type, default=None, help=_help(name, opt))
    return parser


def _help(name: str, opt: Option) -> str:
    """The flag's help with its default (flags default to None so that the config file can set them)."""
    if "default:" in opt.help:
        return opt.help
    cls = EngineConfig if name in ENGINE_FIELDS else ReplicaConfig if name in REPLICA_FIELDS else ServerConfig
    default = next(f.default for f in fields(cls) if f.name == name)
    shown = "none" if default is None else default
    return f"{opt.help} (default: {shown})" if opt.help else f"(default: {shown})"


def default_model() -> str:
    if not (DEMO_MODEL / "config.json").is_file() or not any(DEMO_MODEL.glob("*.safetensors")):
        raise ValueError(f"no model given and the embedded demo model is missing from {DEMO_MODEL} (it needs "
                         f"config.json and *.safetensors; build it with bench/train_demo_model.py); "
                         f"pass --model PATH or set model.path in --config")
    return str(DEMO_MODEL)


def resolve(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, prog: str = "server.py"
            ) -> tuple[EngineConfig, ServerConfig]:
    """Command line (and optional YAML file) → validated engine and server configs (``env``: the environment,
    default ``os.environ``)."""
    engine, server, _ = resolve_all(argv, env, prog)
    return engine, server


def resolve_all(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, prog: str = "server.py"
                ) -> tuple[EngineConfig, ServerConfig, ReplicaConfig]:
    """``resolve`` and the replica configuration (``replicas`` section, ``--replicas`` and its flags)."""
    environ: Mapping[str, str] = os.environ if env is None else env
    args = build_parser(prog).parse_args(argv)
    values: dict[str, Any] = {}
    if environ.get(API_KEY_ENV):
        values["api_key"] = environ[API_KEY_ENV]
    if args.config:
        values.update(load_yaml(args.config))
    values.update({k: v for k, v in vars(args).items() if k in OPTIONS and v is not None})
    if values.get("model") is None:
        values["model"] = default_model()
    values["model"] = model = _check_model(str(values["model"]))
    engine_kw = {k: v for k, v in values.items() if k in ENGINE_FIELDS}
    server_kw = {k: v for k, v in values.items() if k in SERVER_FIELDS}
    server_kw.setdefault("served_model_name", model if is_repo_id(model) else Path(model).name)
    replica_kw = {k: v for k, v in values.items() if k in REPLICA_FIELDS}
    return _build(EngineConfig, engine_kw), _build(ServerConfig, server_kw), _build(ReplicaConfig, replica_kw)


def _check_model(model: str) -> str:
    """A local checkpoint folder (with config.json), or a hub repo id (downloaded when the engine starts)."""
    if is_repo_id(model):
        return model
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        also = "" if path.is_dir() else " nor a hub repo id (org/name)"
        raise ValueError(f"model ({where('model')}): {path} is not a checkpoint directory (no config.json){also}")
    return str(path)


def _build(cls: type, kw: dict[str, Any]) -> Any:
    try:
        return cls(**kw)
    except (ValueError, TypeError) as e:
        msg = str(e)
        field = next((n for n in kw if msg.startswith(n)), None) or next(
            (n for n, v in kw.items() if isinstance(v, str) and repr(v) in msg), None)
        suffix = f" (set with {where(field)})" if field else ""
        raise ValueError(f"invalid configuration: {e}{suffix}") from e
