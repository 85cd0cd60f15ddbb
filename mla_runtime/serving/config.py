"""Server configuration: defaults < ``$MLA_API_KEY`` < ``--config serve.yaml`` < command-line flags.

Every option is a field of ``EngineConfig``, ``ServerConfig`` or ``ReplicaConfig``; its metadata
(``options.opt``) gives its place in the YAML file (sections model / kv_cache / speculative / engine / serving /
replicas / rollout), its flag and its help, and the parser, the YAML loader and ``where`` are built from those, so an
error can always say where the bad value came from. Unknown YAML keys are an error that names the key; the
values are validated by the config classes themselves. Nothing here imports torch: ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mla_runtime.engine.config import EngineConfig
from mla_runtime.env import API_KEY, api_key
from mla_runtime.hub import is_repo_id
from mla_runtime.options import Option, flag_type, opt, options_of, parse_bytes, yaml_kinds
from mla_runtime.serving.reasoning import REASONING_PARSERS
from mla_runtime.serving.tool_parsers import TOOL_CALL_PARSERS

DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo_model"
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=opt("serving.host", "address to listen on"))
    port: int = field(default=8000, metadata=opt("serving.listen_port", "port to listen on (0: any free port)"))
    request_timeout: float = field(default=120.0, metadata=opt(
        "serving.request_timeout", "seconds from arrival (queueing included) to the last token; then 504"))
    max_queue: int = field(default=256, metadata=opt(
        "serving.max_queue", "requests waiting beyond max_num_seqs; then 429"))
    api_key: str | None = field(default=None, metadata=opt(
        "serving.api_key", f"require 'Authorization: Bearer KEY' (default: ${API_KEY})"))
    max_body_bytes: int | str = field(default="4MiB", metadata=opt(
        "serving.max_body_bytes", "request body limit; then 413"))
    served_model_name: str | None = field(default=None, metadata=opt(
        "serving.served_model_name", "model id in /v1/models (default: the checkpoint folder's name)"))
    shutdown_timeout: float = field(default=30.0, metadata=opt(
        "serving.shutdown_timeout", "seconds SIGTERM waits for in-flight requests before aborting them (those "
                                    "then get up to 1 s more to send their error)"))
    header_timeout: float = field(default=10.0, metadata=opt(
        "serving.header_timeout", "seconds for a request's headers and body to arrive; then the connection "
                                  "closes"))
    stream_stall_timeout: float = field(default=30.0, metadata=opt(
        "serving.stream_stall_timeout", "seconds a streaming client may not read; then its stream is aborted"))
    step_timeout: float = field(default=120.0, metadata=opt(
        "serving.step_timeout", "seconds one engine step may run; then /health is 503 and the server exits 1 "
                                "after draining (so that its supervisor restarts it)"))
    startup_timeout: float = field(default=1800.0, metadata=opt(
        "serving.startup_timeout", "seconds a replica may take to load its model and pass the probe generation "
                                   "(the log says what it waits for every 30 s); then its start fails"))
    max_connections: int = field(default=1000, metadata=opt(
        "serving.max_connections", "open connections; beyond, new ones are closed at once"))
    metrics_auth: bool = field(default=False, metadata=opt("serving.metrics_auth", "/metrics requires the API key"))
    log_format: str = field(default="text", metadata=opt(
        "serving.log_format", "text (a line for a terminal) or json (one JSON object per line, a line per "
                              "request)", choices=LOG_FORMATS))
    log_prompts: bool = field(default=False, metadata=opt(
        "serving.log_prompts", "the request log carries the prompt's text (never logged otherwise)"))
    reasoning_parser: str = field(default="auto", metadata=opt(
        "serving.reasoning_parser", "how chat answers split <think>...</think> into reasoning_content: auto (the "
                                    "model's chat template or model_type decides), deepseek_r1, or none",
        choices=REASONING_PARSERS))
    tool_call_parser: str = field(default="auto", metadata=opt(
        "serving.tool_call_parser", "the tool-call syntax tool_choice \"auto\" parses: auto (the model's chat "
                                    "template or model_type decides; hermes where neither does), a syntax, or none "
                                    "(\"auto\" refused)", choices=TOOL_CALL_PARSERS))
    responses_store: int = field(default=1000, metadata=opt(
        "serving.responses_store", "responses of /v1/responses kept in memory for previous_response_id and GET "
                                   "/v1/responses/{id} (the least recently used are dropped first; 0: none)"))

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        for name in ("request_timeout", "shutdown_timeout", "header_timeout", "stream_stall_timeout", "step_timeout",
                     "startup_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if not isinstance(self.max_queue, int) or isinstance(self.max_queue, bool) or self.max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {self.max_queue!r}")
        if not isinstance(self.responses_store, int) or isinstance(self.responses_store, bool) or \
                self.responses_store < 0:
            raise ValueError(f"responses_store must be an integer >= 0, got {self.responses_store!r}")
        if not isinstance(self.max_connections, int) or isinstance(self.max_connections, bool) or \
                self.max_connections < 1:
            raise ValueError(f"max_connections must be an integer >= 1, got {self.max_connections!r}")
        if not isinstance(self.metrics_auth, bool):
            raise ValueError(f"metrics_auth must be true or false, got {self.metrics_auth!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be 'text' or 'json', got {self.log_format!r}")
        if not isinstance(self.log_prompts, bool):
            raise ValueError(f"log_prompts must be true or false, got {self.log_prompts!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
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

    replicas: int | None = field(default=None, metadata=opt(
        "replicas.count", "engine replicas behind one port, on Ray Serve; the initial count when autoscaling "
                          "(default: one process, no Ray)"))
    ray_address: str | None = field(default=None, metadata=opt(
        "replicas.ray_address", "join this Ray cluster (default: start a local Ray instance)"))
    min_replicas: int | None = field(default=None, metadata=opt(
        "replicas.min", "autoscale on ongoing requests, down to this many replicas (default: no autoscaling; "
                        "with --max-replicas: --replicas or 1)"))
    max_replicas: int | None = field(default=None, metadata=opt(
        "replicas.max", "autoscale up to this many replicas (default: no autoscaling; with --min-replicas: "
                        "--replicas or the minimum)"))
    target_ongoing_requests: float | None = field(default=None, metadata=opt(
        "replicas.target_ongoing_requests", "autoscaling: ongoing requests per replica to aim at "
                                            "(default: max-num-seqs)"))
    router: str = field(default="affinity", metadata=opt(
        "replicas.router", "affinity (session, then longest cached prefix) or round_robin", choices=ROUTERS))
    affinity_queue_threshold: int | None = field(default=None, metadata=opt(
        "replicas.affinity_queue_threshold", "ongoing requests beyond which the preferred replica is passed over "
                                             "for the least loaded (default: max-num-seqs)"))
    replica_cpus: float = field(default=1.0, metadata=opt(
        "replicas.cpus_per_replica", "Ray CPUs each replica reserves (its torch threads follow them)"))
    target_cache_usage: float = field(default=0.8, metadata=opt(
        "replicas.target_cache_usage", "autoscaling: latent-cache usage (blocks in use / total, mean over a "
                                       "version's replicas) above which replicas are added"))
    upscale_delay: float = field(default=30.0, metadata=opt(
        "replicas.upscale_delay", "autoscaling: seconds a signal stays above its target before replicas are added"))
    downscale_delay: float = field(default=300.0, metadata=opt(
        "replicas.downscale_delay", "autoscaling: seconds of quiet (every signal below its target) before "
                                    "replicas are removed"))
    # -- rollout: a second model version behind the same endpoint (serving/rollout.py)
    canary_model: str | None = field(default=None, metadata=opt(
        "rollout.canary_model", "a second version behind the same endpoint, given a share of new traffic: "
                                "checkpoint directory or hub repo id (default: no canary; with --canary-revision "
                                "or --canary-engine alone: --model)"))
    canary_revision: str | None = field(default=None, metadata=opt(
        "rollout.canary_revision", "hub branch, tag or commit of the canary (default: --revision)"))
    canary_engine: dict[str, Any] | str | None = field(default=None, metadata=opt(
        "rollout.canary_engine", "engine settings of the canary that differ from the stable's: "
                                 "'max_num_seqs=8,dtype=float32' (serve.yaml: a mapping of engine fields) "
                                 "(default: the stable's)"))
    canary_weight: float = field(default=0.05, metadata=opt(
        "rollout.canary_weight", "share of new sessions sent to the canary, 0..1"))
    canary_replicas: int | None = field(default=None, metadata=opt(
        "rollout.canary_replicas", "replicas of the canary (default: as many as the stable version)"))
    stable_name: str = field(default="stable", metadata=opt(
        "rollout.stable_name", "the stable version's name (X-Model-Version, the version label of /metrics)"))
    canary_name: str = field(default="canary", metadata=opt(
        "rollout.canary_name", "the canary version's name"))
    auto_rollback: bool = field(default=False, metadata=opt(
        "rollout.auto_rollback", "roll back by itself when the canary's error rate or p99 latency over "
                                 "--rollback-window exceeds the stable's by the bounds below"))
    rollback_window: float = field(default=120.0, metadata=opt(
        "rollout.rollback_window", "seconds of requests the automatic rollback compares"))
    rollback_error_margin: float = field(default=0.02, metadata=opt(
        "rollout.rollback_error_margin", "automatic rollback: the canary's error rate may exceed the stable's by "
                                         "this much (0.02: 2 points)"))
    rollback_latency_factor: float = field(default=2.0, metadata=opt(
        "rollout.rollback_latency_factor", "automatic rollback: the canary's p99 latency may be this many times "
                                           "the stable's"))

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
        for name in ("target_cache_usage", "canary_weight", "rollback_error_margin"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
        for name in ("upscale_delay", "downscale_delay", "rollback_window", "rollback_latency_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        _count("canary_replicas", self.canary_replicas, 1)
        for name in ("stable_name", "canary_name"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _VERSION_NAME.fullmatch(value):
                raise ValueError(f"{name} must be 1-32 characters of A-Z a-z 0-9 . _ -, got {value!r}")
        if self.stable_name == self.canary_name:
            raise ValueError(f"canary_name must differ from stable_name ({self.stable_name!r})")
        object.__setattr__(self, "canary_engine", canary_overrides(self.canary_engine))
        if self.rollout and not self.enabled:
            raise ValueError("canary_model (a canary version) needs --replicas N (or --min/--max-replicas)")

    @property
    def enabled(self) -> bool:
        return self.replicas is not None or self.min_replicas is not None or self.max_replicas is not None

    @property
    def rollout(self) -> bool:
        """A canary version is deployed next to the stable one."""
        return self.canary_model is not None or self.canary_revision is not None or bool(self.canary_engine)

    @property
    def canary_initial(self) -> int:
        """Canary replicas started first."""
        if self.canary_replicas is None:
            return self.initial
        if self.autoscaling:
            low, high = self.bounds
            return min(max(self.canary_replicas, low), high)
        return self.canary_replicas

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


_VERSION_NAME = re.compile(r"[A-Za-z0-9._-]{1,32}")
_NOT_OVERRIDDEN = ("model", "revision")  # --canary-model and --canary-revision set these


def canary_overrides(value: object) -> dict[str, Any]:
    """``--canary-engine`` ('max_num_seqs=8,dtype=float32') or its serve.yaml mapping → engine fields and values
    (each flag-style text parsed as that field's flag parses it); an unknown field is an error naming it."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        pairs: dict[str, Any] = {}
        for part in value.split(","):
            name, eq, text = part.strip().partition("=")
            if not eq or not name.strip():
                raise ValueError(f"canary_engine: expected FIELD=VALUE pairs separated by commas, got {part!r}")
            pairs[name.strip().replace("-", "_")] = text.strip()
        value = pairs
    if not isinstance(value, dict):
        raise ValueError(f"canary_engine must be a mapping of engine fields, got {value!r}")
    out: dict[str, Any] = {}
    for name, v in value.items():
        o = _ENGINE.get(name)
        if o is None or name in _NOT_OVERRIDDEN:
            hint = " (use canary_model / canary_revision)" if name in _NOT_OVERRIDDEN else ""
            raise ValueError(f"canary_engine: {name!r} is not an engine setting{hint}")
        if isinstance(v, str) and o.kinds == (bool,):
            v = v.lower() in ("1", "true", "yes", "on")
        elif isinstance(v, str) and str not in o.kinds:
            try:
                v = flag_type(o)(v)
            except ValueError as e:
                raise ValueError(f"canary_engine: {name}: {e}") from e
        out[name] = v
    return out


def canary_engine_config(engine: EngineConfig, rc: ReplicaConfig) -> EngineConfig | None:
    """The canary's engine configuration: the stable's, with the canary's model, revision and settings."""
    if not rc.rollout:
        return None
    overrides = dict(rc.canary_engine) if isinstance(rc.canary_engine, dict) else {}
    if rc.canary_model is not None:
        overrides["model"] = rc.canary_model
        overrides["revision"] = rc.canary_revision if rc.canary_revision is not None else \
            EngineConfig.__dataclass_fields__["revision"].default
    elif rc.canary_revision is not None:
        overrides["revision"] = rc.canary_revision
    try:
        return replace(engine, **overrides)
    except (ValueError, TypeError) as e:
        raise ValueError(f"invalid configuration: canary: {e} (set with rollout.canary_engine / "
                         f"--canary-engine)") from e


# the serve.yaml sections, in --help's order
SECTIONS = ("model", "kv_cache", "speculative", "engine", "serving", "replicas", "rollout")
_ENGINE, _SERVER, _REPLICA = options_of(EngineConfig), options_of(ServerConfig), options_of(ReplicaConfig)
OPTIONS: dict[str, Option] = {**_ENGINE, **_SERVER, **_REPLICA}
ENGINE_FIELDS, SERVER_FIELDS, REPLICA_FIELDS = set(_ENGINE), set(_SERVER), set(_REPLICA)
YAML_KEYS = {o.yaml: name for name, o in OPTIONS.items()}
YAML_HINTS = {"kv_cache.gpu_memory_util": "size the latent cache in bytes with kv_cache.memory (e.g. '40GiB')"}


def where(name: str) -> str:
    """Where an option can be set, for error messages: ``kv_cache.block_size / --block-size``."""
    o = OPTIONS.get(name)
    return name if o is None else f"{o.yaml} / {o.flag}"


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
    out: dict[str, Any] = {}
    for section, body in raw.items():
        if section not in SECTIONS:
            raise ValueError(f"--config {path}: unknown section {section!r} (known: {', '.join(sorted(SECTIONS))})")
        if not isinstance(body, dict):
            raise ValueError(f"--config {path}: {section} must be a mapping of keys")
        for key, value in body.items():
            dotted = f"{section}.{key}"
            if dotted not in YAML_KEYS:
                known = ", ".join(k.split(".")[1] for k in YAML_KEYS if k.startswith(section + "."))
                hint = YAML_HINTS.get(dotted, f"known keys in {section}: {known}")
                raise ValueError(f"--config {path}: unknown key {dotted!r}; {hint}")
            out[YAML_KEYS[dotted]] = _check_type(dotted, OPTIONS[YAML_KEYS[dotted]], value)
    return out


def _check_type(dotted: str, option: Option, value: Any) -> Any:
    kinds = yaml_kinds(option)
    if value is None or (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise ValueError(f"{dotted} must be {' or '.join(t.__name__ for t in kinds)}, got {value!r}")
    return value


def build_parser(prog: str = "server.py") -> argparse.ArgumentParser:
    """Every option's flag, grouped by its serve.yaml section. Flags default to None so that the config file
    can set what they leave out; a boolean also has ``--no-FLAG``, to turn off what the file (or the default)
    turned on (shown in --help where the default is on)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Serve an MLA checkpoint over HTTP (/generate, /v1/*, /metrics).",
        epilog=f"Every switch --FLAG also has --no-FLAG. Precedence: flags > --config file > ${API_KEY} > "
               "defaults.")
    parser.add_argument("--config", help="serve.yaml (sections model / kv_cache / speculative / engine / serving / "
                                         "replicas / rollout; see mla_runtime/serving/serve.example.yaml)")
    groups = {s: parser.add_argument_group(f"{s} (serve.yaml section {s})") for s in SECTIONS}
    for name, o in OPTIONS.items():
        group = groups[o.yaml.split(".")[0]]
        if o.kinds == (bool,) and o.default is True:
            group.add_argument(o.flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=_help(o))
        elif o.kinds == (bool,):  # a switch; its --no- form (to override the file) is left out of --help
            group.add_argument(o.flag, dest=name, action="store_true", default=None, help=_help(o))
            group.add_argument(f"--no-{o.flag[2:]}", dest=name, action="store_false", default=None,
                               help=argparse.SUPPRESS)
        else:  # choices only as the metavar: the config class rejects others with a message naming the field
            metavar = "{" + ",".join(map(str, o.choices)) + "}" if o.choices else None
            group.add_argument(o.flag, dest=name, type=flag_type(o), default=None, metavar=metavar, help=_help(o))
    return parser


def _help(o: Option) -> str:
    """The flag's help with its default (unless the help says what the default means)."""
    text = o.help if "default:" in o.help else f"{o.help} (default: {'none' if o.default is None else o.default})"
    return text.replace("%", "%%")  # argparse formats help with %


def default_model() -> str:
    if not (DEMO_MODEL / "config.json").is_file() or not any(DEMO_MODEL.glob("*.safetensors")):
        raise ValueError(f"no model given and the embedded demo model is missing from {DEMO_MODEL} (it needs "
                         f"config.json and *.safetensors; build it with bench/train_demo_model.py); "
                         f"pass --model PATH or set model.path in --config")
    return str(DEMO_MODEL)


def resolve(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, prog: str = "server.py"
            ) -> tuple[EngineConfig, ServerConfig]:
    """Command line (and optional YAML file) → validated engine and server configs (``env``: the environment,
    default the process's)."""
    engine, server, _ = resolve_all(argv, env, prog)
    return engine, server


def resolve_all(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, prog: str = "server.py"
                ) -> tuple[EngineConfig, ServerConfig, ReplicaConfig]:
    """``resolve`` and the replica configuration (``replicas`` section, ``--replicas`` and its flags)."""
    args = build_parser(prog).parse_args(argv)
    values: dict[str, Any] = {}
    if key := api_key(env):
        values["api_key"] = key
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
    if replica_kw.get("canary_model") is not None:
        replica_kw["canary_model"] = _check_model(str(replica_kw["canary_model"]), "canary_model")
    engine_config, replicas = _build(EngineConfig, engine_kw), _build(ReplicaConfig, replica_kw)
    canary_engine_config(engine_config, replicas)  # the canary's settings are checked before anything starts
    return engine_config, _build(ServerConfig, server_kw), replicas


def _check_model(model: str, name: str = "model") -> str:
    """A local checkpoint folder (with config.json), a GGUF model (a ``.gguf`` file, its first split part, or a folder
    holding one), or a hub repo id (downloaded when the engine starts)."""
    from mla_runtime.gguf_meta import gguf_files

    if is_repo_id(model):
        return model
    path = Path(model).expanduser()
    if not (path / "config.json").is_file() and gguf_files(path) is None:
        also = "" if path.is_dir() else " nor a hub repo id (org/name)"
        raise ValueError(f"{name} ({where(name)}): {path} is not a checkpoint directory (no config.json) or a GGUF "
                         f"file{also}")
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
