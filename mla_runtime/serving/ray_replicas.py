"""Replicas on Ray Serve: one port, N engine replicas, requests routed where their prefix or session is cached.

    client ─► Ray Serve HTTP proxy ─► Ingress (1 replica) ──handle, AffinityRouter──► EngineReplica × N
                                        │ reads the body, computes the routing key      │ the single-process
                                        │ (session; leading block hashes), /metrics      │ FastAPI app + engine

Ray Serve's HTTP proxy hands a request to a deployment before its body is read, so a request router placed there
cannot see the prompt. The thin ``Ingress`` deployment therefore reads the body, computes the routing key
(``affinity.route_key``) and calls the engine deployment through a ``DeploymentHandle`` whose custom
``AffinityRouter`` (Ray Serve's pluggable ``RequestRouter``) reads that key from the call's argument. Each
``EngineReplica`` runs the request through the same FastAPI app as ``mla-runtime serve`` without Ray
(``asgi_call.call_asgi``): auth, limits, admission (429), timeouts, streaming and errors are that app's.

The replica's answer is a stream: first ``("accepted", replica id)``, then the response's start, then its body.
A replica that dies before accepting a request has not started it, so the ingress sends it to another replica
(Ray replaces the dead one); one that dies later ends the request with a clean 503 (or, mid-stream, a final SSE
error event). A replica's 429 sends the request on to a replica not tried yet; when every replica answered
429 the client gets the last one, ``Retry-After`` included.

Model versions (``rollout.py``): with a canary, a second engine deployment (``EngineReplica-b``) serves it; the
ingress picks a deployment per request (``Rollout.choose``: by weight, sessions sticky), names the version in
``X-Model-Version``, serves ``/v1/models`` (both versions) and the admin routes (``/admin/rollout``), and can roll
back by itself (``--auto-rollback``). With ``--min/--max-replicas`` each engine deployment scales on load and on
latent-cache usage (``scaling.MemoryAwarePolicy``, Ray Serve's custom autoscaling policy): each replica reports
its cache usage and its cold-start time through ``record_autoscaling_stats``.

Only ``mla-runtime serve --replicas N`` imports this module (and Ray); the single-process path never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import ray
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from ray import serve
from ray.exceptions import RayError
from ray.serve.config import HTTPOptions, RequestRouterConfig
from ray.serve.exceptions import RayServeException
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from mla_runtime.engine.config import EngineConfig
from mla_runtime.serving.affinity import GENERATION_PATHS, SESSION_HEADER, AffinityPolicy, Decision, RouteKey, route_key
from mla_runtime.serving.asgi_call import HttpRequest, ResponseStart, call_asgi
from mla_runtime.serving.config import ReplicaConfig, ServerConfig, canary_engine_config
from mla_runtime.serving.protocol import ApiError
from mla_runtime.serving.replica_metrics import ReplicaScrape, render
from mla_runtime.serving.request_log import REQUEST_ID_HEADER, configure_logging
from mla_runtime.serving.responses import sse
from mla_runtime.serving.rollout import VERSION_HEADER, Outcomes, Rollout, RolloutError, Version, judge
from mla_runtime.serving.scaling import MemoryAwarePolicy, kv_key, published

logger = logging.getLogger("mla_runtime.serving")

APP_NAME = "mla-runtime"
ENGINE_DEPLOYMENT = "EngineReplica"  # the first slot: the stable version when the deployment starts
CANARY_DEPLOYMENT = "EngineReplica-b"  # the second slot: the canary when it starts (roles swap on promote)
ADMIN_PATH = "/admin/rollout"
ROLLOUT_KV_KEY = "rollout/{app}"
JUDGE_PERIOD_S = 5.0
METRICS_INTERVAL_S = 2.0  # autoscaling: how often replicas report their load and cache usage
LOOK_BACK_S = 10.0  # ... and the window Ray Serve averages them over
LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
HEADROOM = 16  # ongoing requests a replica takes beyond its admission limit (probes, scrapes, 429 answers)
OBJECT_STORE_BYTES = 200 * 1024**2  # a local Ray's object store: requests and answers are small
HEALTH_CHECK_PERIOD_S = 2.0
SCRAPE_TIMEOUT_S = 5.0
MAX_ATTEMPTS = 6  # sends of one request (replicas that died before accepting it, or answered 429)
REPLICA_HEADER = "X-Replica-Id"
RAY_FAILURES = (RayError, RayServeException)

# The engine deployment's router in this process (the ingress's), by deployment name: Ray constructs it inside
# the handle; /metrics reads its replicas and decision counts.
_ROUTERS: dict[str, AffinityRouter] = {}


def routers() -> dict[str, AffinityRouter]:
    """This process's routers, by deployment. Reached through ``sys.modules``: Ray may ship a class by value,
    its methods then seeing a copy of this module's globals."""
    return importlib.import_module("mla_runtime.serving.ray_replicas")._ROUTERS  # type: ignore[no-any-return]


class AffinityRouter(RequestRouter):
    """Ray Serve request router: ranks replicas with ``AffinityPolicy`` from the routing key that the ingress put
    on the call (``HttpRequest.route``); a request with ``pin`` goes to that replica (per-replica scrapes)."""

    def initialize_state(self, policy: str = "affinity", queue_threshold: int = 8, max_blocks: int = 4096,
                         **kwargs: Any) -> None:
        self.policy = AffinityPolicy(policy, queue_threshold, max_blocks)
        self.plans: OrderedDict[str, Decision] = OrderedDict()
        routers()[self._deployment_id.name] = self

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if hasattr(self, "policy"):
            self.policy.forget([r.replica_id.unique_id for r in replicas])

    def queue_len(self, replica: RunningReplica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        req = pending_request.args[0] if pending_request is not None and pending_request.args else None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if pending_request is not None:  # every rank is offered each time: wait (back off) before the next try
            pending_request.routing_context.should_backoff = True
        if not isinstance(req, HttpRequest) or not by_id:
            return [candidate_replicas]
        if req.pin is not None:
            return [[by_id[req.pin]]] if req.pin in by_id else [candidate_replicas]
        usable = [i for i in by_id if i not in req.avoid] or list(by_id)
        key = req.route if isinstance(req.route, RouteKey) else RouteKey()
        decision = self.policy.decide(usable, {i: self.queue_len(by_id[i]) for i in usable}, key)
        if pending_request is not None:
            self.plans[pending_request.metadata.internal_request_id] = decision
            while len(self.plans) > 10_000:  # requests cancelled before they were routed
                self.plans.popitem(last=False)
        first, *rest = decision.ranked
        return [[by_id[first]], [by_id[i] for i in rest]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        decision = self.plans.pop(pending_request.metadata.internal_request_id, None)
        req = pending_request.args[0] if pending_request.args else None
        if isinstance(req, HttpRequest) and req.pin is None and isinstance(req.route, RouteKey):
            self.policy.record(replica_id.unique_id, req.route, decision)


class EngineReplica:
    """One engine and the single-process FastAPI app, serving the requests the ingress routes here."""

    async def __init__(self, engine_config: EngineConfig, config: ServerConfig) -> None:  # type: ignore[misc]
        from mla_runtime.serving.app import build_app

        # a replica is a fresh Ray worker process: without this its INFO lines (the start-up summary: model shape,
        # latent cache, dtype, CPU path) are dropped, as Ray configures only its own loggers there
        configure_logging(config.log_format)
        started = time.monotonic()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine_config = engine_config
        self.failures: list[BaseException] = []
        self.app = build_app(engine_config, config, on_fatal=self.failures.append)
        self.rt = self.app.state.runtime
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()  # loads the weights and runs the probe generation in the background
        await self.rt.wait_ready(config.startup_timeout, f"replica {self.replica_id}", self.failures)
        self.load_s = time.monotonic() - started  # the cold start: what the autoscaler starts replicas ahead by
        logger.info("replica %s ready (pid %d) in %.1f s", self.replica_id, os.getpid(), self.load_s)

    async def http(self, req: HttpRequest) -> AsyncIterator[tuple[str, str] | ResponseStart | bytes]:
        yield ("accepted", self.replica_id)
        async for part in call_asgi(self.app, req):
            yield part

    async def scrape(self, req: HttpRequest) -> ReplicaScrape:
        body = await asyncio.to_thread(self.app.state.server.metrics.render)
        return ReplicaScrape(self.replica_id, os.getpid(), body.decode())

    async def ping(self, req: HttpRequest) -> str:
        return self.replica_id

    async def describe(self, req: HttpRequest) -> dict[str, Any]:
        """What this replica serves: its model, revision, weights fingerprint and engine settings."""
        info = self.rt.info
        return {"replica": self.replica_id, "model": self.engine_config.model,
                "revision": self.engine_config.revision,
                "fingerprint": info.weights_fingerprint if info is not None else None,
                "engine": json_safe(asdict(self.engine_config)), "cold_start_s": self.load_s}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics (``scaling.MemoryAwarePolicy`` reads them)."""
        blocks = self.rt.cache_blocks()
        usage = blocks[0] / blocks[1] if blocks is not None and blocks[1] else 0.0
        return {"cache_usage": usage, "cold_start_s": self.load_s}

    def check_health(self) -> None:
        """Ray Serve's health check: a dead engine thread or a hung step replaces the replica."""
        problem = self.rt.health_problem() or self.rt.fault
        if problem is not None:
            raise RuntimeError(problem)

    async def __del__(self) -> None:
        """Ray Serve stops the replica (after its ongoing requests, up to --shutdown-timeout): stop the engine."""
        self.rt.begin_shutdown()
        await self.lifespan.__aexit__(None, None, None)


@dataclass
class Slot:
    """One engine deployment (a model version's replicas) as the ingress calls it."""

    name: str
    handle: Any
    stream: Any
    engine_config: EngineConfig


class Ingress:
    """The HTTP entry: reads each request, computes its routing key, picks the model version (``Rollout``) and
    forwards the request to an engine replica of that version; serves the admin routes and ``/metrics``."""

    async def __init__(self, engine: Any, engine_config: EngineConfig, config: ServerConfig,  # type: ignore[misc]
                       rc: ReplicaConfig | None = None, canary: Any = None,
                       canary_config: EngineConfig | None = None) -> None:
        from mla_runtime.tokenizer import load_tokenizer

        configure_logging(config.log_format)
        self.config = config
        self.rc = rc or ReplicaConfig()
        self.block_size = engine_config.block_size
        try:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, engine_config.model)
        except Exception:  # noqa: BLE001 - without a tokenizer, routing keys hash the prompt's bytes
            logger.warning("ingress: no tokenizer for %s; routing keys hash the prompt's bytes", engine_config.model)
            self.tokenizer = None
        self.engine = engine
        self.stream = engine.options(stream=True)
        self.slots = {ENGINE_DEPLOYMENT: Slot(ENGINE_DEPLOYMENT, engine, self.stream, engine_config)}
        if canary is not None and canary_config is not None:
            self.slots[CANARY_DEPLOYMENT] = Slot(CANARY_DEPLOYMENT, canary, canary.options(stream=True), canary_config)
        versions = {}
        for slot in self.slots.values():  # creates each handle's router, shared below
            logger.info("ingress: waiting for a %s replica to describe its model", slot.name)
            try:
                d = await asyncio.wait_for(slot.handle.describe.remote(HttpRequest("GET", "/describe")),
                                           config.startup_timeout)
            except TimeoutError:
                raise RuntimeError(f"ingress: no {slot.name} replica described its model within startup_timeout "
                                   f"({config.startup_timeout:g} s)") from None
            versions[slot.name] = Version(slot.name, d["model"], d["revision"], d["fingerprint"], d["engine"])
        self.rollout = Rollout(versions[ENGINE_DEPLOYMENT], versions.get(CANARY_DEPLOYMENT),
                               self.rc.canary_weight if canary is not None else 0.0, self.rc.stable_name,
                               self.rc.canary_name)
        try:
            self.app_name = serve.get_replica_context().app_name
        except Exception:  # noqa: BLE001 - outside a replica (tests)
            self.app_name = APP_NAME
        self.state_key = ROLLOUT_KV_KEY.format(app=self.app_name)
        if (saved := published(self.state_key)) is not None and self.rollout.restore(json.dumps(saved),
                                                                                     list(self.slots)):
            logger.warning("ingress: resumed the rollout state: %s", json.dumps(self.rollout.weights()))
        self.outcomes = {name: Outcomes(self.rc.rollback_window) for name in self.slots}
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("mla_rollout_requests", "Requests answered by the ingress, by model version and "
                                "HTTP status", ["version", "code"], registry=self.registry)
        self.latency = Histogram("mla_rollout_request_seconds", "Arrival at the ingress to the end of the answer, "
                                 "by model version", ["version"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.judge_task = asyncio.get_running_loop().create_task(self.watch()) if (
            self.rc.auto_rollback and canary is not None) else None
        logger.info("ingress: versions %s", ", ".join(
            f"{name}={v.model} (weights {v.fingerprint or 'unknown'}, share {self.rollout.weights()[name]:.0%})"
            for name, v in self.rollout.versions()))

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics":
            return await self.metrics(request)
        if path == ADMIN_PATH or path.startswith(ADMIN_PATH + "/"):
            return await self.admin(request)
        if path == "/v1/models" and len(self.slots) > 1:
            return self.models(request)
        arrival = time.monotonic()
        try:
            body = await read_body(request, int(self.config.max_body_bytes))
        except ApiError as e:
            return error_response(e)
        except ClientDisconnect:
            return Response(status_code=499)
        if path in GENERATION_PATHS:
            key = await asyncio.to_thread(route_key, path, request.headers, body, self.tokenizer, self.block_size)
            slot = self.slots.get(self.rollout.choose(key)) or self.slots[self.rollout.stable.slot]
        else:
            key = RouteKey(request.headers.get(SESSION_HEADER))
            slot = self.slots[self.rollout.stable.slot]
        client = (request.client.host, request.client.port) if request.client else None
        req = HttpRequest(request.method, path, request.url.query.encode(), tuple(request.headers.items()), body,
                          client, key)
        version = self.rollout.role(slot.name)

        def done(status: int, failed: bool) -> None:
            seconds = time.monotonic() - arrival
            self.requests.labels(version, str(status)).inc()
            self.latency.labels(version).observe(seconds)
            if path in GENERATION_PATHS and status != 429:
                self.outcomes[slot.name].add(failed, seconds)

        response = await self.forward(req, slot, done)
        response.headers[VERSION_HEADER] = version
        if not isinstance(response, StreamingResponse):
            done(response.status_code, response.status_code >= 500)
        return response

    async def forward(self, req: HttpRequest, slot: Slot | None = None,
                      on_end: Callable[[int, bool], None] | None = None) -> Response:
        stream = slot.stream if slot is not None else self.stream
        tried: set[str] = set()
        for attempt in range(MAX_ATTEMPTS):
            gen = stream.http.remote(replace(req, avoid=frozenset(tried)))
            try:  # bounded: with no live replica at all, routing waits for one
                _, replica = await asyncio.wait_for(anext(gen), self.config.request_timeout)
            except TimeoutError:
                gen.cancel()
                return error_response(ApiError(503, "no engine replica took the request within request_timeout; "
                                                    "retry later", headers={"Retry-After": "5"}))
            except RAY_FAILURES as e:  # the replica died before it accepted the request: send it elsewhere
                logger.warning("ingress: a replica failed before accepting %s %s (%s); retrying", req.method,
                               req.path, type(e).__name__)
                await asyncio.sleep(0.05 * (attempt + 1))
                continue
            except asyncio.CancelledError:
                gen.cancel()
                raise
            answer = await self.answer(gen, replica, retry=replica not in tried, on_end=on_end)
            if answer is not None:
                return answer
            tried.add(replica)
        return error_response(ApiError(503, "no engine replica could take the request; retry later",
                                       headers={"Retry-After": "1"}))

    async def answer(self, gen: Any, replica: str, retry: bool,
                     on_end: Callable[[int, bool], None] | None = None) -> Response | None:
        """The response of an accepted request; None when the replica was full (429) and another may not be."""
        try:
            start = await asyncio.wait_for(anext(gen), self.config.request_timeout + 10)
            if not isinstance(start, ResponseStart):
                raise RuntimeError(f"replica {replica} answered without a response start")
            if start.status == 429:
                body = b"".join([chunk async for chunk in gen])
                if retry:
                    return None
                return Response(body, 429, headers=relayed_headers(start.headers))
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except (*RAY_FAILURES, RuntimeError, StopAsyncIteration, TimeoutError) as e:
            gen.cancel()
            logger.error("ingress: replica %s failed while serving a request: %r", replica, e)
            timed_out = isinstance(e, TimeoutError)
            return error_response(ApiError(504 if timed_out else 503, "request timed out" if timed_out else
                                           "the replica serving this request failed; retry"))
        headers = relayed_headers(start.headers)
        headers[REPLICA_HEADER] = replica
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(relay(gen, replica, sse, start.status, on_end), status_code=start.status,
                                 headers=headers)

    # -- versions ------------------------------------------------------------------------------------
    def models(self, request: Request) -> Response:
        """``/v1/models`` with versions: one entry per deployed version (the same served name), with its share."""
        from fastapi.responses import JSONResponse

        from mla_runtime.serving.app import check_auth

        try:
            check_auth(request, self.config)  # type: ignore[arg-type]
        except ApiError as e:
            return error_response(e)
        weights = self.rollout.weights()
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.served_model_name, "object": "model", "owned_by": "mla-runtime",
            "root": v.model, "version": name, "weight": weights[name], "revision": v.revision,
            "fingerprint": v.fingerprint, "max_model_len": v.engine.get("max_model_len")}
            for name, v in self.rollout.versions()]})

    async def admin(self, request: Request) -> Response:
        """``GET /admin/rollout``; ``POST /admin/rollout/weight`` ``{"weight": W}``, ``/promote``, ``/rollback``."""
        from fastapi.responses import JSONResponse

        from mla_runtime.serving.app import check_auth

        try:
            if self.config.api_key is None:
                raise ApiError(403, "the admin routes need an API key: start the server with --api-key (or "
                                    "$MLA_API_KEY)")
            check_auth(request, self.config)  # type: ignore[arg-type]
            action = request.url.path[len(ADMIN_PATH):].strip("/")
            if request.method == "GET" and action == "":
                return JSONResponse(await self.status())
            if request.method != "POST" or action not in ("weight", "promote", "rollback"):
                raise ApiError(404, f"no admin route {request.method} {request.url.path}: GET {ADMIN_PATH}, "
                                    f"POST {ADMIN_PATH}/weight, /promote, /rollback")
            body = await read_body(request, 4096)
            data = json.loads(body) if body.strip() else {}
            if not isinstance(data, dict):
                raise ApiError(400, "the body must be a JSON object")
            if action == "weight":
                event = self.rollout.set_weight(data.get("weight"), str(data.get("reason", "admin")))
            elif action == "promote":
                event = self.rollout.promote(str(data.get("reason", "admin")))
            else:
                event = self.rollout.rollback(str(data.get("reason", "admin")))
        except ApiError as e:
            return error_response(e)
        except RolloutError as e:
            return error_response(ApiError(e.status, str(e)))
        except ValueError:
            return error_response(ApiError(400, "the body is not valid JSON"))
        self.changed(event)
        return JSONResponse({"event": event, **(await self.status())})

    def changed(self, event: dict[str, Any]) -> None:
        logger.warning("rollout: %s (%s): new traffic %s; stable %s (weights %s)", event["action"], event["why"],
                       json.dumps(self.rollout.weights()), self.rollout.stable.model,
                       self.rollout.stable.fingerprint or "unknown")
        with contextlib.suppress(Exception):
            from ray.experimental.internal_kv import _internal_kv_put

            from mla_runtime.serving.scaling import KV_NAMESPACE

            _internal_kv_put(self.state_key, self.rollout.dump(), overwrite=True, namespace=KV_NAMESPACE)

    async def status(self) -> dict[str, Any]:
        out = self.rollout.status()
        for name, version in self.rollout.versions():
            router = routers().get(version.slot)
            n, err, p99 = self.outcomes[version.slot].summary()
            out["versions"][name].update(
                replicas=sorted(r.unique_id for r in router.curr_replicas) if router is not None else [],
                window={"seconds": self.rc.rollback_window, "requests": n, "error_rate": err, "p99_s": p99})
        out["auto_rollback"] = self.rc.auto_rollback
        return out

    async def watch(self) -> None:
        """``--auto-rollback``: every few seconds, compare the canary with the stable version over the window."""
        while True:
            await asyncio.sleep(JUDGE_PERIOD_S)
            try:
                self.check_canary()
            except Exception:  # noqa: BLE001 - the watch must outlive a bad tick
                logger.exception("rollout: the automatic rollback check failed")

    def check_canary(self, now: float | None = None) -> str | None:
        canary = self.rollout.canary
        if canary is None or self.rollout.weight <= 0:
            return None
        now = time.monotonic() if now is None else now
        for o in self.outcomes.values():
            o.trim(now)
        why = judge(self.outcomes[self.rollout.stable.slot].summary(), self.outcomes[canary.slot].summary(),
                    self.rc.rollback_error_margin, self.rc.rollback_latency_factor)
        if why is not None:
            self.changed(self.rollout.rollback(f"automatic: {why}"))
        return why

    # -- /metrics ------------------------------------------------------------------------------------
    async def metrics(self, request: Request) -> Response:
        if self.config.metrics_auth:
            from mla_runtime.serving.app import check_auth

            try:
                check_auth(request, self.config)  # type: ignore[arg-type]
            except ApiError as e:
                return error_response(e)
        good: dict[str, ReplicaScrape] = {}
        versions: dict[str, str] = {}
        decisions: dict[str, dict[str, int]] = {}
        for slot in self.slots.values():
            version = self.rollout.role(slot.name)
            router = routers().get(slot.name)
            ids = [r.unique_id for r in router.curr_replicas] if router is not None else []
            for i in ids:
                try:
                    s = await asyncio.wait_for(slot.handle.scrape.remote(HttpRequest("GET", "/metrics", pin=i)),
                                               SCRAPE_TIMEOUT_S)
                    good[s.replica] = s
                    versions[s.replica] = version
                except (*RAY_FAILURES, TimeoutError) as e:
                    logger.warning("ingress: replica %s did not answer the metrics scrape: %r", i, e)
            if router is not None and hasattr(router, "policy"):
                decisions[version] = dict(router.policy.counts)
        extra = [*self.registry.collect(), *self.rollout_families(), *self.scaling_families()]
        body = await asyncio.to_thread(render, sorted(good.values(), key=lambda s: s.replica), decisions, versions,
                                       extra)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def rollout_families(self) -> list[Metric]:
        weight = GaugeMetricFamily("mla_rollout_weight", "Share of new traffic sent to each model version",
                                   labels=["version"])
        info = GaugeMetricFamily("mla_rollout_version_info", "Deployed model versions (value 1): model, revision, "
                                 "weights fingerprint and Ray Serve deployment", labels=["version", "model", "revision",
                                                                                         "weights", "deployment"])
        for name, v in self.rollout.versions():
            weight.add_metric([name], self.rollout.weights()[name])
            info.add_metric([name, v.model, v.revision or "", v.fingerprint or "unknown", v.slot], 1)
        events = CounterMetricFamily("mla_rollout_events", "Rollout actions (set_weight, promote, rollback)",
                                     labels=["action"])
        for action in ("set_weight", "promote", "rollback"):
            events.add_metric([action], self.rollout.counts.get(action, 0))
        return [weight, info, events]

    def scaling_families(self) -> list[Metric]:
        """The autoscaling policy's latest decision per version (published by Ray Serve's controller)."""
        desired = GaugeMetricFamily("mla_autoscale_desired_replicas", "Replicas the autoscaling policy asks for, "
                                    "by model version", labels=["version", "reason"])
        signal = GaugeMetricFamily("mla_autoscale_signal", "The autoscaling policy's inputs and their targets: "
                                   "ongoing requests per replica, latent-cache usage, cold-start seconds, and the "
                                   "values projected one cold start ahead", labels=["version", "signal"])
        changes = CounterMetricFamily("mla_autoscale_decisions", "Changes of the replica count asked for, by "
                                      "direction and reason", labels=["version", "direction", "reason"])
        for slot in self.slots:
            record = published(kv_key(self.app_name, slot))
            if record is None:
                continue
            version = self.rollout.role(slot)
            desired.add_metric([version, record["reason"]], record["desired"])
            for name, key in (("ongoing_per_replica", "ongoing_per_replica"), ("cache_usage", "cache_usage"),
                              ("cold_start_seconds", "cold_start_s"), ("predicted_ongoing", "predicted_ongoing"),
                              ("predicted_cache_usage", "predicted_usage"), ("target_ongoing", "target_ongoing"),
                              ("target_cache_usage", "target_cache_usage")):
                signal.add_metric([version, name], float(record.get(key, 0.0)))
            for k, n in record.get("counts", {}).items():
                direction, _, reason = k.partition("/")
                changes.add_metric([version, direction, reason], n)
        return [desired, signal, changes]


# Serve's HTTP proxy adds X-Request-Id to every answer itself: the client's id, or a fresh one it also put on the
# request, so the replica's app saw and logged the same id. The replica's copy would make it appear twice.
DROPPED_HEADERS = frozenset({"content-length", "transfer-encoding", REQUEST_ID_HEADER.decode()})


def relayed_headers(headers: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """The headers of a replica's answer that the ingress passes on."""
    return {k: v for k, v in headers if k.lower() not in DROPPED_HEADERS}


async def relay(gen: Any, replica: str, sse_stream: bool, status: int = 200,
                on_end: Callable[[int, bool], None] | None = None) -> AsyncIterator[bytes]:
    """The body of an answer; a replica that fails mid-stream ends an SSE stream with an error event.
    ``on_end(status, failed)`` runs once the body is over (failed: a 5xx, or the replica failed mid-stream)."""
    failed = status >= 500
    try:
        async for chunk in gen:
            yield chunk
    except RAY_FAILURES as e:
        failed = True
        logger.error("ingress: replica %s failed mid-response: %r", replica, e)
        if sse_stream:
            yield sse(ApiError(503, "the replica serving this request failed; retry").body())
    finally:
        gen.cancel()
        if on_end is not None:
            on_end(status, failed)


def error_response(e: ApiError) -> Response:
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    too_large = ApiError(413, f"request body exceeds max_body_bytes ({limit:,} bytes)", param="body")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


# -- the application and the process -------------------------------------------------------------------
def application(engine_config: EngineConfig, config: ServerConfig, rc: ReplicaConfig) -> Any:
    """The Ray Serve application: the ingress bound to the engine deployment (and the canary's, with one)."""
    deployment: Any = serve.deployment
    engine = deployment(EngineReplica).options(**engine_options(ENGINE_DEPLOYMENT, engine_config, config, rc,
                                                                 rc.initial)).bind(engine_config, config)
    canary_config = canary_engine_config(engine_config, rc)
    canary = None
    if canary_config is not None:
        canary = deployment(EngineReplica).options(**engine_options(
            CANARY_DEPLOYMENT, canary_config, config, rc, rc.canary_initial)).bind(canary_config, config)
    ingress = deployment(Ingress).options(name="Ingress", num_replicas=1, max_ongoing_requests=
                                                config.max_connections, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine, engine_config, config, rc, canary, canary_config)


def engine_options(name: str, engine_config: EngineConfig, config: ServerConfig, rc: ReplicaConfig,
                   initial: int) -> dict[str, Any]:
    """One engine deployment's Ray Serve options: the affinity router, health checks, and its replica count or
    autoscaling (on load and latent-cache usage: ``scaling.MemoryAwarePolicy``)."""
    threshold = engine_config.max_num_seqs if rc.affinity_queue_threshold is None else rc.affinity_queue_threshold
    router = RequestRouterConfig(request_router_class=f"{__name__}.AffinityRouter",  # type: ignore[arg-type]
                                 request_router_kwargs={"policy": rc.router, "queue_threshold": threshold})
    options: dict[str, Any] = dict(
        name=name, max_ongoing_requests=engine_config.max_num_seqs + config.max_queue + HEADROOM,
        request_router_config=router, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=max(30.0, config.step_timeout), graceful_shutdown_timeout_s=config.shutdown_timeout,
        ray_actor_options={"num_cpus": rc.replica_cpus})
    if rc.autoscaling:
        low, high = rc.bounds
        target = rc.target_ongoing_requests or engine_config.max_num_seqs
        options["autoscaling_config"] = {
            "min_replicas": low, "max_replicas": high, "initial_replicas": initial,
            "target_ongoing_requests": target, "upscale_delay_s": rc.upscale_delay,
            "downscale_delay_s": rc.downscale_delay, "metrics_interval_s": METRICS_INTERVAL_S,
            "look_back_period_s": LOOK_BACK_S,
            "policy": {"policy_function": f"{MemoryAwarePolicy.__module__}:{MemoryAwarePolicy.__name__}",
                       "policy_kwargs": {"target_ongoing_requests": target,
                                         "target_cache_usage": rc.target_cache_usage}}}
    else:
        options["num_replicas"] = initial
    return options


def json_safe(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` with what JSON cannot hold as text (paths, for instance)."""
    return json.loads(json.dumps(value, default=str))  # type: ignore[no-any-return]


def start_ray(rc: ReplicaConfig) -> bool:
    """Join ``--ray-address`` or start a local Ray instance (True: started here, so stopped here too)."""
    if ray.is_initialized():
        return False
    if rc.ray_address is not None:
        ray.init(address=rc.ray_address, include_dashboard=False, log_to_driver=True)
        return False
    most = rc.bounds[1] if rc.autoscaling else rc.initial
    cpus = max(os.cpu_count() or 1, math.ceil(rc.replica_cpus * most))
    ray.init(num_cpus=cpus, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False, log_to_driver=True)
    return True


def deploy(engine_config: EngineConfig, config: ServerConfig, rc: ReplicaConfig) -> None:
    """Start Serve's HTTP proxy on ``config.host:config.port`` and run the application (returns once every
    replica has loaded its model and passed the probe generation)."""
    serve.start(http_options=HTTPOptions(host=config.host, port=config.port, keep_alive_timeout_s=5))
    serve.run(application(engine_config, config, rc), name=APP_NAME, route_prefix="/", blocking=False)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(engine_config: EngineConfig, config: ServerConfig, rc: ReplicaConfig, prog: str) -> int:
    """``mla-runtime serve --replicas N``: serve until SIGTERM or Ctrl-C, then shut Serve (and a local Ray) down."""
    started = start_ray(rc)
    stop = threading.Event()
    # Ctrl-C or SIGTERM while the replicas load interrupts the start (then Serve and a local Ray are shut down)
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        logger.info("starting %d replica(s) of %s on Ray Serve (each has up to startup_timeout %g s)",
                    rc.bounds[0] if rc.autoscaling else rc.initial, engine_config.model, config.startup_timeout)
        deploy(engine_config, config, rc)
        for sig in previous:
            signal.signal(sig, lambda *_: stop.set())
        scale = f"{rc.bounds[0]}..{rc.bounds[1]} (autoscaling)" if rc.autoscaling else str(rc.initial)
        logger.info("serving http://%s:%d with %s replica(s) on Ray Serve, router %s", config.host, config.port,
                    scale, rc.router)
        if rc.rollout:
            logger.info("canary %s: %s, %.0f%% of new sessions (mla-runtime rollout status|set-weight|promote|"
                        "rollback --url http://%s:%d)", rc.canary_name, rc.canary_model or engine_config.model,
                        100 * rc.canary_weight, config.host, config.port)
        stop.wait()
        logger.info("shutting down: replicas finish their requests (up to %s s)", config.shutdown_timeout)
        return 0
    except (RayServeException, RuntimeError) as e:
        print(f"{prog}: start-up failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: start-up interrupted", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(Exception):
            serve.shutdown()
        if started:
            ray.shutdown()
