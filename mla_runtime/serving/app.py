"""The FastAPI application: routes, authentication, body limits, timeouts, disconnects, SSE.

The routes are module functions over ``app.state.server`` (a ``ServerState``). Every generation
request goes through ``_generation``: authenticate (401) → read at most
``max_body_bytes`` (413) → parse JSON (400; a large body in a worker thread) → validate the schema (400)
→ check readiness (503) → build the job in a worker thread (400/404: the prompt's length in characters is
checked against what ``max_model_len`` tokens can hold before anything is tokenized, then templating and
tokenization run off the event loop) → admit (429, counting sequences) → submit and wait for the first
output, racing the client's disconnect and the request's deadline (400 from the engine's own validation,
504, abort on disconnect). Only then does a streaming request get its ``200`` and an SSE body, so a request
that never started still gets an honest status code. Every error body is
``{"error": {"message", "type", "code", "param"}}``; no response carries an internal exception's text.
``/openapi.json`` and ``/docs`` describe every route (``openapi.py``); with an API key they require it.

Fault injection (tests and ``bench/abuse.py`` only, see ``runtime.fault_injection``):
``MLA_FAULT_INJECTION=stream:K`` makes every stream raise an exception after its K-th engine output, to
check that a server-side failure ends the stream with an error event and is counted as an ``error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mla_runtime.engine.async_llm import AsyncLLM, EngineDeadError
from mla_runtime.engine.config import EngineConfig
from mla_runtime.errors import InvalidParam
from mla_runtime.serving.anthropic_messages import MESSAGES, MessagesRequest, messages_job
from mla_runtime.serving.config import ServerConfig
from mla_runtime.serving.jobs import JobBuilder
from mla_runtime.serving.metrics import ServerMetrics
from mla_runtime.serving.openai_responses import RESPONSES, ResponsesRequest, ResponseStore, responses_job, stored
from mla_runtime.serving.openapi import DOCS_ASSETS, docs_asset, docs_page, openapi_schema
from mla_runtime.serving.protocol import ApiError, ChatRequest, CompletionRequest, GenerateRequest, validation_error
from mla_runtime.serving.request_log import REQUEST_ID_HEADER, RequestIdMiddleware, RequestLog, RequestRecord
from mla_runtime.serving.responses import Job
from mla_runtime.serving.runtime import ServingRuntime, fault_injection
from mla_runtime.serving.streaming import (
    OPENAI,
    ApiShape,
    ClientDisconnected,
    RequestTimedOut,
    SSEResponse,
    StreamEnd,
    generate_job_outputs,
    guarded,
    job_events,
    last_output,
    timeout_error,
)

logger = logging.getLogger("mla_runtime.serving")
router = APIRouter()

THREAD_PARSE_BYTES = 64 * 1024  # JSON bodies above this size are parsed in a worker thread


def error_response(e: ApiError, shape: ApiShape = OPENAI) -> JSONResponse:
    return JSONResponse(shape.error(e), status_code=e.status, headers=e.headers)


def parse_json(body: bytes | bytearray) -> Any:
    """The body's JSON value; any parser failure (syntax, encoding, nesting too deep) is a 400 naming body."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"body: malformed JSON: {e}", param="body") from None
    except RecursionError:
        raise ApiError(400, "body: JSON nested too deeply", param="body") from None
    except ValueError as e:  # e.g. an integer literal with too many digits
        raise ApiError(400, f"body: malformed JSON: {e}", param="body") from None
    if b"\\ud" in body or b"\\uD" in body:  # "\ud800"-style escapes may encode a lone surrogate: not text
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "body: contains an unpaired UTF-16 surrogate escape (not valid Unicode text)",
                           param="body") from None
    return data


def validate(schema: type[BaseModel], body: Any) -> Any:
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise ApiError(400, "body: JSON nested too deeply", param="body") from None


@dataclass(frozen=True)
class ServerState:
    """What the routes share (``app.state.server``): the runtime, both configurations, metrics and the jobs."""

    rt: ServingRuntime
    engine_config: EngineConfig
    config: ServerConfig
    metrics: ServerMetrics
    jobs: JobBuilder
    parse_slot: asyncio.Semaphore  # large JSON bodies are parsed one at a time
    fault_after: int | None  # MLA_FAULT_INJECTION=stream:K (tests only)
    openapi: dict[str, Any]  # the OpenAPI document, built once
    responses: ResponseStore  # /v1/responses kept for previous_response_id


def _server(request: Request) -> ServerState:
    return request.app.state.server


def build_app(engine_config: EngineConfig, config: ServerConfig,
              on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The app; ``on_fatal`` is called once when the server must end with a failure (start-up failed, or the
    engine died or hung): the process should drain and exit non-zero so that its supervisor restarts it."""
    metrics = ServerMetrics()
    rt = ServingRuntime(engine_config, config, metrics, on_fatal)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(rt.start())
        try:
            yield
        finally:
            logger.info("shutting down: %d sequence(s) still in flight", rt.in_flight)
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            await rt.stop_watchdog()
            await asyncio.to_thread(rt.stop)
            logger.info("engine stopped")

    app = FastAPI(title="mla-runtime", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runtime = rt
    app.state.server = ServerState(rt, engine_config, config, metrics, JobBuilder(rt, engine_config, config),
                                   asyncio.Semaphore(1), fault_injection("stream"), openapi_schema(config),
                                   ResponseStore(config.responses_store))
    app.openapi_schema = app.state.server.openapi  # app.openapi() answers the same document
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal_error)
    app.include_router(router)
    app.state.request_log = RequestLog(config.log_prompts, rt.cache_blocks)
    app.add_middleware(RequestIdMiddleware, log=lambda: app.state.request_log)  # type: ignore[arg-type]
    return app


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    detail = exc.detail if isinstance(exc.detail, str) else "error"
    if exc.status_code == 404:
        detail = f"no route {request.url.path}"
    elif exc.status_code == 405:
        detail = f"method {request.method} is not allowed on {request.url.path}"
    return error_response(ApiError(exc.status_code, detail))


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    response = error_response(ApiError(500, "internal error; see the server log"))
    record = getattr(request.state, "request_record", None)
    if isinstance(record, RequestRecord):  # this handler answers outside the middleware that adds the header
        response.headers[REQUEST_ID_HEADER.decode()] = record.request_id
    return response


def check_auth(request: Request, config: ServerConfig) -> None:
    """The API key as ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>`` (Anthropic's)."""
    if config.api_key is None:
        return
    key = config.api_key.encode()
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key):
        return
    if hmac.compare_digest(request.headers.get("x-api-key", "").strip().encode(), key):
        return
    raise ApiError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>' (or "
                        "'x-api-key: <key>')", headers={"WWW-Authenticate": "Bearer"})


async def read_json(request: Request, limit: int, parse_slot: asyncio.Semaphore) -> Any:
    """The request's JSON body, read up to ``limit`` bytes (413 beyond); raises ClientDisconnected. A large
    body is parsed in a worker thread, one at a time (``parse_slot``): the parser holds the GIL throughout
    (~10 ms per MB), so parsing several at once would keep the event loop waiting for their sum."""
    declared = request.headers.get("content-length", "")
    too_large = ApiError(413, f"request body exceeds max_body_bytes ({limit:,} bytes)", param="body")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:
        raise ClientDisconnected() from None
    if len(body) > THREAD_PARSE_BYTES:
        async with parse_slot:
            return await asyncio.to_thread(parse_json, body)
    return parse_json(body)


async def run_job(request: Request, rt: ServingRuntime, config: ServerConfig, llm: AsyncLLM, job: Job,
                  fault_after: int | None, shape: ApiShape = OPENAI) -> Response:
    """Submit an admitted job and answer it in its API's ``shape``: a JSON body, or an SSE stream once the first
    output exists."""
    gen = generate_job_outputs(llm, job)
    deadline = rt.deadline(job)
    outcome, out, error = "error", None, None
    try:
        out = await guarded(request, anext(gen), deadline)
        if job.stream:
            outcome = "streaming"
            return stream_job(rt, config, job, gen, StreamEnd(out), deadline, fault_after, shape)
        out = await guarded(request, last_output(gen, out), deadline)
        body = await asyncio.to_thread(shape.body, job, out)
        outcome = "success"
        return JSONResponse(body)
    except ValueError as e:  # the engine's validation of the prompt: names the problem
        outcome, error = "invalid", ApiError(400, str(e), param=e.param if isinstance(e, InvalidParam) else None)
    except RequestTimedOut:
        outcome, error = "timeout", timeout_error(config.request_timeout)
    except ClientDisconnected:
        outcome = "client_disconnect"
        return Response(status_code=499)
    except EngineDeadError:
        error = ApiError(503, "the engine failed; see the server log")
    except asyncio.CancelledError:  # uvicorn cancels what outlives --shutdown-timeout
        outcome = "aborted"
        if not rt.shutting_down:
            raise
        error = ApiError(503, "aborted: the server shut down before the request finished")
    finally:
        if outcome != "streaming":
            rt.finish(job, outcome, out)
            await gen.aclose()
    return error_response(error, shape)


def stream_job(rt: ServingRuntime, config: ServerConfig, job: Job, gen: AsyncGenerator[Any, None], end: StreamEnd,
               deadline: float, fault_after: int | None, shape: ApiShape = OPENAI) -> Response:
    body = job_events(job, gen, end, deadline, config.request_timeout, fault_after, shape)

    async def close(reason: str) -> None:  # runs however the response ended, even if never iterated
        with contextlib.suppress(Exception):
            await body.aclose()
        rt.finish(job, end.outcome or reason, end.last)
        with contextlib.suppress(Exception):
            await gen.aclose()

    return SSEResponse(body, close, lambda: rt.shutting_down, deadline, config.stream_stall_timeout, shape.stream_error,
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _generation(request: Request, endpoint: str, schema: type[BaseModel],
                      make_job: Callable[[JobBuilder, Any], Job], shape: ApiShape = OPENAI) -> Response:
    srv = _server(request)
    rt, config = srv.rt, srv.config
    record: RequestRecord | None = getattr(request.state, "request_record", None)
    try:
        check_auth(request, config)
        body = await read_json(request, int(config.max_body_bytes), srv.parse_slot)
        req = validate(schema, body)
        llm = rt.check_ready()
        job = await asyncio.to_thread(make_job, srv.jobs, req)
        rt.admit(job)
    except ApiError as e:
        outcome = rt.reject(endpoint, e.status)
        if record is not None:
            record.outcome = outcome
        return error_response(e, shape)
    except ClientDisconnected:
        outcome = rt.reject(endpoint, 499)
        if record is not None:
            record.outcome = outcome
        return Response(status_code=499)
    if record is not None:
        record.job = job
    return await run_job(request, rt, config, llm, job, srv.fault_after, shape)


@router.post("/generate")
async def generate(request: Request) -> Response:
    return await _generation(request, "generate", GenerateRequest, JobBuilder.generate)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _generation(request, "completions", CompletionRequest, JobBuilder.completion)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generation(request, "chat", ChatRequest, JobBuilder.chat)


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    store = _server(request).responses
    return await _generation(request, "responses", ResponsesRequest,
                             lambda jobs, req: responses_job(jobs, store, req), RESPONSES)


async def _kept_response(request: Request, response_id: str, delete: bool) -> Response:
    """``GET`` or ``DELETE /v1/responses/{response_id}`` (``openai_responses.stored``), counted under its own
    endpoint label."""
    srv = _server(request)
    endpoint = "responses_delete" if delete else "responses_retrieve"
    try:
        check_auth(request, srv.config)
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise ApiError(400, "stream: a kept response is returned whole, not streamed again", param="stream")
        found = stored(srv.responses, response_id, delete)
    except ApiError as e:
        srv.rt.reject(endpoint, e.status)
        return error_response(e)
    srv.rt.metrics.requests.labels(endpoint, "success").inc()
    return JSONResponse(found)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    return await _kept_response(request, response_id, delete=False)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    return await _kept_response(request, response_id, delete=True)


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    return await _generation(request, "messages", MessagesRequest, messages_job, MESSAGES)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    srv = _server(request)
    try:
        check_auth(request, srv.config)
    except ApiError as e:
        return error_response(e)
    return JSONResponse({"object": "list", "data": [{
        "id": srv.config.served_model_name, "object": "model", "created": srv.rt.created, "owned_by": "mla-runtime",
        "root": srv.config.served_model_name, "max_model_len": srv.rt.max_model_len or None}]})


@router.get("/health")
async def health(request: Request) -> Response:
    problem = _server(request).rt.health_problem()
    if problem is not None:
        return error_response(ApiError(503, problem))
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> Response:
    srv = _server(request)
    try:
        srv.rt.check_ready()
    except ApiError as e:
        return error_response(e)
    return JSONResponse({"status": "ready", "model": srv.config.served_model_name})


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    srv = _server(request)
    if srv.config.metrics_auth:
        try:
            check_auth(request, srv.config)
        except ApiError as e:
            return error_response(e)
    body = await asyncio.to_thread(srv.metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/openapi.json")
async def openapi_document(request: Request) -> Response:
    srv = _server(request)
    try:
        check_auth(request, srv.config)
    except ApiError as e:
        return error_response(e)
    return JSONResponse(srv.openapi)


@router.get("/docs")
async def docs(request: Request) -> Response:
    srv = _server(request)
    try:
        check_auth(request, srv.config)
    except ApiError as e:
        return error_response(e)
    return HTMLResponse(docs_page(srv.openapi))


@router.get("/docs/{name}")
async def docs_assets(name: str) -> Response:
    """Swagger UI's script and stylesheet, from the installed package (no CDN); public, as the library code they are."""
    if name not in DOCS_ASSETS:
        return error_response(ApiError(404, f"docs: no asset {name!r} (swagger-ui-bundle.js, swagger-ui.css)", "name"))
    body = await asyncio.to_thread(docs_asset, name)
    return Response(body, media_type=DOCS_ASSETS[name], headers={"Cache-Control": "public, max-age=86400"})
