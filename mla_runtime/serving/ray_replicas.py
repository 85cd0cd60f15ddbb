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

Only ``mla-runtime serve --replicas N`` imports this module (and Ray); the single-process path never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import os
import signal
import sys
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import ray
from prometheus_client import CONTENT_TYPE_LATEST
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
from mla_runtime.serving.config import ReplicaConfig, ServerConfig
from mla_runtime.serving.protocol import ApiError
from mla_runtime.serving.replica_metrics import ReplicaScrape, render
from mla_runtime.serving.request_log import REQUEST_ID_HEADER, configure_logging
from mla_runtime.serving.responses import sse

logger = logging.getLogger("mla_runtime.serving")

APP_NAME = "mla-runtime"
ENGINE_DEPLOYMENT = "EngineReplica"
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
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.failures: list[BaseException] = []
        self.app = build_app(engine_config, config, on_fatal=self.failures.append)
        self.rt = self.app.state.runtime
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()  # loads the weights and runs the probe generation in the background
        while not self.rt.ready:
            if self.failures or self.rt.status.startswith("start-up failed"):
                raise RuntimeError(f"replica {self.replica_id}: {self.rt.status}")
            await asyncio.sleep(0.05)
        logger.info("replica %s ready (pid %d)", self.replica_id, os.getpid())

    async def http(self, req: HttpRequest) -> AsyncIterator[tuple[str, str] | ResponseStart | bytes]:
        yield ("accepted", self.replica_id)
        async for part in call_asgi(self.app, req):
            yield part

    async def scrape(self, req: HttpRequest) -> ReplicaScrape:
        body = await asyncio.to_thread(self.app.state.server.metrics.render)
        return ReplicaScrape(self.replica_id, os.getpid(), body.decode())

    async def ping(self, req: HttpRequest) -> str:
        return self.replica_id

    def check_health(self) -> None:
        """Ray Serve's health check: a dead engine thread or a hung step replaces the replica."""
        problem = self.rt.health_problem() or self.rt.fault
        if problem is not None:
            raise RuntimeError(problem)

    async def __del__(self) -> None:
        """Ray Serve stops the replica (after its ongoing requests, up to --shutdown-timeout): stop the engine."""
        self.rt.begin_shutdown()
        await self.lifespan.__aexit__(None, None, None)


class Ingress:
    """The HTTP entry: reads each request, computes its routing key, forwards it to an engine replica."""

    async def __init__(self, engine: Any, engine_config: EngineConfig, config: ServerConfig) -> None:  # type: ignore[misc]
        from mla_runtime.tokenizer import load_tokenizer

        configure_logging(config.log_format)
        self.config = config
        self.block_size = engine_config.block_size
        try:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, engine_config.model)
        except Exception:  # noqa: BLE001 - without a tokenizer, routing keys hash the prompt's bytes
            logger.warning("ingress: no tokenizer for %s; routing keys hash the prompt's bytes", engine_config.model)
            self.tokenizer = None
        self.engine = engine
        await engine.ping.remote(HttpRequest("GET", "/ping"))  # creates the handle's router, shared below
        self.stream = engine.options(stream=True)

    async def __call__(self, request: Request) -> Response:
        if request.url.path == "/metrics":
            return await self.metrics(request)
        try:
            body = await read_body(request, int(self.config.max_body_bytes))
        except ApiError as e:
            return error_response(e)
        except ClientDisconnect:
            return Response(status_code=499)
        path = request.url.path
        if path in GENERATION_PATHS:
            key = await asyncio.to_thread(route_key, path, request.headers, body, self.tokenizer, self.block_size)
        else:
            key = RouteKey(request.headers.get(SESSION_HEADER))
        client = (request.client.host, request.client.port) if request.client else None
        req = HttpRequest(request.method, path, request.url.query.encode(), tuple(request.headers.items()), body,
                          client, key)
        return await self.forward(req)

    async def forward(self, req: HttpRequest) -> Response:
        tried: set[str] = set()
        for attempt in range(MAX_ATTEMPTS):
            gen = self.stream.http.remote(replace(req, avoid=frozenset(tried)))
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
            answer = await self.answer(gen, replica, retry=replica not in tried)
            if answer is not None:
                return answer
            tried.add(replica)
        return error_response(ApiError(503, "no engine replica could take the request; retry later",
                                       headers={"Retry-After": "1"}))

    async def answer(self, gen: Any, replica: str, retry: bool) -> Response | None:
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
        return StreamingResponse(relay(gen, replica, sse), status_code=start.status, headers=headers)

    async def metrics(self, request: Request) -> Response:
        if self.config.metrics_auth:
            from mla_runtime.serving.app import check_auth

            try:
                check_auth(request, self.config)  # type: ignore[arg-type]
            except ApiError as e:
                return error_response(e)
        router = routers().get(ENGINE_DEPLOYMENT)
        ids = [r.unique_id for r in router.curr_replicas] if router is not None else []
        good: dict[str, ReplicaScrape] = {}
        for i in ids:
            try:
                s = await asyncio.wait_for(self.engine.scrape.remote(HttpRequest("GET", "/metrics", pin=i)),
                                           SCRAPE_TIMEOUT_S)
                good[s.replica] = s
            except (*RAY_FAILURES, TimeoutError) as e:
                logger.warning("ingress: replica %s did not answer the metrics scrape: %r", i, e)
        counts = dict(router.policy.counts) if router is not None and hasattr(router, "policy") else {}
        body = await asyncio.to_thread(render, sorted(good.values(), key=lambda s: s.replica), counts)
        return Response(body, media_type=CONTENT_TYPE_LATEST)


# Serve's HTTP proxy adds X-Request-Id to every answer itself: the client's id, or a fresh one it also put on the
# request, so the replica's app saw and logged the same id. The replica's copy would make it appear twice.
DROPPED_HEADERS = frozenset({"content-length", "transfer-encoding", REQUEST_ID_HEADER.decode()})


def relayed_headers(headers: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """The headers of a replica's answer that the ingress passes on."""
    return {k: v for k, v in headers if k.lower() not in DROPPED_HEADERS}


async def relay(gen: Any, replica: str, sse_stream: bool) -> AsyncIterator[bytes]:
    """The body of an answer; a replica that fails mid-stream ends an SSE stream with an error event."""
    try:
        async for chunk in gen:
            yield chunk
    except RAY_FAILURES as e:
        logger.error("ingress: replica %s failed mid-response: %r", replica, e)
        if sse_stream:
            yield sse(ApiError(503, "the replica serving this request failed; retry").body())
    finally:
        gen.cancel()


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
    """The Ray Serve application: the ingress bound to the engine deployment."""
    threshold = engine_config.max_num_seqs if rc.affinity_queue_threshold is None else rc.affinity_queue_threshold
    router = RequestRouterConfig(request_router_class=f"{__name__}.AffinityRouter",  # type: ignore[arg-type]
                                 request_router_kwargs={"policy": rc.router, "queue_threshold": threshold})
    options: dict[str, Any] = dict(
        name=ENGINE_DEPLOYMENT, max_ongoing_requests=engine_config.max_num_seqs + config.max_queue + HEADROOM,
        request_router_config=router, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=max(30.0, config.step_timeout), graceful_shutdown_timeout_s=config.shutdown_timeout,
        ray_actor_options={"num_cpus": rc.replica_cpus})
    if rc.autoscaling:
        low, high = rc.bounds
        options["autoscaling_config"] = {
            "min_replicas": low, "max_replicas": high, "initial_replicas": rc.initial,
            "target_ongoing_requests": rc.target_ongoing_requests or engine_config.max_num_seqs}
    else:
        options["num_replicas"] = rc.initial
    deployment: Any = serve.deployment
    engine = deployment(EngineReplica).options(**options).bind(engine_config, config)
    ingress = deployment(Ingress).options(name="Ingress", num_replicas=1, max_ongoing_requests=
                                                config.max_connections, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine, engine_config, config)


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


def main(engine_config: EngineConfig, config: ServerConfig, rc: ReplicaConfig, prog: str) -> int:
    """``mla-runtime serve --replicas N``: serve until SIGTERM or Ctrl-C, then shut Serve (and a local Ray) down."""
    started = start_ray(rc)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        deploy(engine_config, config, rc)
        scale = f"{rc.bounds[0]}..{rc.bounds[1]} (autoscaling)" if rc.autoscaling else str(rc.initial)
        logger.info("serving http://%s:%d with %s replica(s) on Ray Serve, router %s", config.host, config.port,
                    scale, rc.router)
        stop.wait()
        logger.info("shutting down: replicas finish their requests (up to %s s)", config.shutdown_timeout)
        return 0
    except (RayServeException, RuntimeError) as e:
        print(f"{prog}: start-up failed: {e}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(Exception):
            serve.shutdown()
        if started:
            ray.shutdown()
