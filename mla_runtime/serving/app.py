"""The FastAPI application: routes, authentication, body limits, timeouts, disconnects, SSE.

Every generation request goes through ``_generation``: authenticate (401) → read at most
``max_body_bytes`` (413) → parse JSON (400) → validate the schema (422) → check readiness (503) → build
the job (400/404) → admit (429) → submit and wait for the first output, racing the client's disconnect
and the request's deadline (400 from the engine's own validation, 504, abort on disconnect). Only then
does a streaming request get its ``200`` and an SSE body, so a request that never started still gets an
honest status code. Every error body is ``{"error": {"message", "type", "code", "param"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mla_runtime.engine.async_llm import AsyncLLM, EngineDeadError
from mla_runtime.engine.config import EngineConfig
from mla_runtime.outputs import RequestOutput
from mla_runtime.serving.config import ServerConfig
from mla_runtime.serving.metrics import ServerMetrics
from mla_runtime.serving.protocol import ApiError, ChatRequest, CompletionRequest, GenerateRequest, validation_error
from mla_runtime.serving.responses import Job, StreamState, full_body, merge_outputs, sse
from mla_runtime.serving.runtime import ServingRuntime
from mla_runtime.tokenizer import apply_chat_template

logger = logging.getLogger("mla_runtime.serving")


class ClientDisconnected(Exception):
    pass


class RequestTimedOut(Exception):
    pass


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def guarded(request: Request, awaitable: Awaitable[Any], deadline: float) -> Any:
    """Await ``awaitable`` unless the client disconnects or the deadline (loop time) passes first;
    then cancel it (which aborts the engine request it waits on) and raise."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        done, _ = await asyncio.wait({task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await task
    if task in done:
        return task.result()
    raise ClientDisconnected() if watcher in done else RequestTimedOut()


async def generate_job_outputs(llm: AsyncLLM, job: Job) -> AsyncIterator[RequestOutput]:
    """The job's outputs as the engine produces them; for a batch of prompts, one engine request each, run
    concurrently and merged (``merge_outputs``) each time one advances, once every prompt has started.
    The first failure (e.g. the engine refusing a prompt) is raised; closing this generator aborts them all."""
    if len(job.prompts) == 1:
        async for out in llm.generate(job.prompts[0], job.params, job.request_id):
            yield out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, prompt: Any, request_id: str) -> None:
        try:
            async for out in llm.generate(prompt, job.params, request_id):
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, prompt, rid))
             for i, (prompt, rid) in enumerate(zip(job.prompts, job.engine_request_ids))]
    latest: list[RequestOutput | None] = [None] * len(tasks)
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                running -= 1
                continue
            latest[i] = item
            if all(x is not None for x in latest):
                yield merge_outputs(job, latest)  # type: ignore[arg-type]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _last(gen: AsyncIterator[RequestOutput], first: RequestOutput) -> RequestOutput:
    out = first
    while not out.finished:
        out = await anext(gen)
    return out


def build_app(engine_config: EngineConfig, config: ServerConfig,
              on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    metrics = ServerMetrics()
    rt = ServingRuntime(engine_config, config, metrics, on_fatal)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(rt.start())
        try:
            yield
        finally:
            logger.info("shutting down: %d request(s) still in flight", rt.in_flight)
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            await asyncio.to_thread(rt.stop)
            logger.info("engine stopped")

    app = FastAPI(title="mla-runtime", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runtime = rt

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            detail = f"no route {request.url.path}"
        elif exc.status_code == 405:
            detail = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(ApiError(exc.status_code, detail))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                           headers={"WWW-Authenticate": "Bearer"})

    async def read_json(request: Request) -> Any:
        limit = int(config.max_body_bytes)
        declared = request.headers.get("content-length", "")
        too_large = ApiError(413, f"request body exceeds max_body_bytes ({limit:,} bytes)", param="body")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, f"body: malformed JSON: {e}", param="body") from e
        if b"\\ud" in body.lower():  # "\ud800"-style escapes may encode a lone surrogate: not text
            try:
                json.dumps(data, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:
                raise ApiError(400, "body: contains an unpaired UTF-16 surrogate escape (not valid Unicode text)",
                               param="body") from e
        return data

    def check_model(name: str | None) -> None:
        if name not in (None, config.served_model_name, engine_config.model):
            raise ApiError(404, f"model: {name!r} is not served here; this server serves "
                                f"{config.served_model_name!r}", param="model")

    def tokenizer() -> Any:
        assert rt.llm is not None
        return rt.llm.tokenizer

    def token_text(token: int) -> str:
        tok = tokenizer()
        return tok.decode([token]) if tok is not None else ""

    def generate_job(req: GenerateRequest) -> Job:
        prompt = req.prompt if isinstance(req.prompt, str) else {"prompt_token_ids": req.prompt}
        return Job("generate", [prompt], req.sampling_params(16), config.served_model_name or "", stream=req.stream)

    def completion_job(req: CompletionRequest) -> Job:
        check_model(req.model)
        req.check_unsupported()
        prompts = req.prompt_list()
        if len(prompts) > 1 and req.stream:
            raise ApiError(400, "stream: a list of prompts is answered in one response, not streamed; send one "
                                "streaming request per prompt", param="stream")
        echo = None
        if req.echo:
            tok = tokenizer()
            echo = [p if isinstance(p, str) else (tok.decode(p) if tok is not None else "") for p in prompts]
        return Job("completions", [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts],
                   req.sampling_params(16), config.served_model_name or "",
                   stream=req.stream, include_usage=bool(req.stream_options and req.stream_options.include_usage),
                   echo=echo, logprobs=req.logprobs_count(), token_text=token_text)

    def chat_job(req: ChatRequest) -> Job:
        check_model(req.model)
        req.check_unsupported()
        try:
            ids = apply_chat_template(tokenizer(), req.plain_messages())
        except ValueError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from e
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, rt.max_model_len - len(ids))
        params = req.sampling_params(max_tokens)
        return Job("chat", [{"prompt_token_ids": ids}], params, config.served_model_name or "", stream=req.stream,
                   include_usage=bool(req.stream_options and req.stream_options.include_usage),
                   logprobs=req.logprobs_count(), token_text=token_text)

    async def _generation(request: Request, endpoint: str, schema: type[BaseModel],
                          make_job: Callable[[Any], Job]) -> Response:
        try:
            check_auth(request)
            body = await read_json(request)
            try:
                req = schema.model_validate(body)
            except ValidationError as e:
                raise validation_error(e) from None
            llm = rt.check_ready()
            job = make_job(req)
            rt.admit(job)
        except ApiError as e:
            rt.reject(endpoint, e.status)
            return error_response(e)
        return await _run(request, llm, job)

    async def _run(request: Request, llm: AsyncLLM, job: Job) -> Response:
        gen = generate_job_outputs(llm, job)
        deadline = rt.deadline(job)
        outcome, out, error = "error", None, None
        try:
            out = await guarded(request, anext(gen), deadline)
            if job.stream:
                outcome = "streaming"
                return _stream(job, gen, out, deadline)
            out = await guarded(request, _last(gen, out), deadline)
            outcome = "success"
            return JSONResponse(full_body(job, out))
        except ValueError as e:  # the engine's validation of the prompt: names the problem
            outcome, error = "invalid", ApiError(400, str(e), param=str(e).split(" ")[0].rstrip(":"))
        except RequestTimedOut:
            outcome, error = "timeout", ApiError(504, f"request exceeded request_timeout "
                                                      f"({config.request_timeout:g} s) and was aborted")
        except ClientDisconnected:
            outcome = "client_disconnect"
            return Response(status_code=499)
        except EngineDeadError as e:
            error = ApiError(503, str(e))
        except asyncio.CancelledError:  # uvicorn cancels what outlives --shutdown-timeout
            outcome = "aborted"
            if not rt.shutting_down:
                raise
            error = ApiError(503, "aborted: the server shut down before the request finished")
        finally:
            if outcome != "streaming":
                rt.finish(job, outcome, out)
                await gen.aclose()
        return error_response(error)

    def _stream(job: Job, gen: AsyncIterator[RequestOutput], first: RequestOutput, deadline: float) -> Response:
        state = StreamState(job)
        last = first

        async def events() -> AsyncIterator[bytes]:
            nonlocal last
            outcome = "client_disconnect"
            try:
                for chunk in state.chunks(first):
                    yield chunk
                while not last.finished:
                    async with asyncio.timeout_at(deadline):
                        last = await anext(gen)
                    for chunk in state.chunks(last):
                        yield chunk
                outcome = "success"
            except TimeoutError:
                outcome = "timeout"
                yield sse(ApiError(504, f"request exceeded request_timeout ({config.request_timeout:g} s) "
                                        f"and was aborted").body())
            except EngineDeadError as e:
                outcome = "error"
                yield sse(ApiError(503, str(e)).body())
            finally:
                if rt.shutting_down and outcome == "client_disconnect":
                    outcome = "aborted"
                rt.finish(job, outcome, last)

        body = events()

        async def close() -> None:  # runs even if the body was never iterated (client already gone)
            with contextlib.suppress(Exception):
                await body.aclose()
            rt.finish(job, "client_disconnect", last)
            with contextlib.suppress(Exception):
                await gen.aclose()

        return ClosingStreamingResponse(body, close, lambda: rt.shutting_down, media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await _generation(request, "generate", GenerateRequest, generate_job)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generation(request, "completions", CompletionRequest, completion_job)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generation(request, "chat", ChatRequest, chat_job)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            check_auth(request)
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": 0, "owned_by": "mla-runtime",
            "root": engine_config.model, "max_model_len": rt.max_model_len or None}]})

    @app.get("/health")
    async def health() -> Response:
        if rt.llm is not None and rt.llm.error is not None:
            return error_response(ApiError(503, f"the engine failed: {rt.llm.error}"))
        if rt.status.startswith("start-up failed"):
            return error_response(ApiError(503, rt.status))
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        try:
            rt.check_ready()
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"status": "ready", "model": config.served_model_name})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = await asyncio.to_thread(metrics.render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that always runs ``on_close`` when the response ends, however it ends, and
    that ends with an error event when the server cancels it at shutdown."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 shutting_down: Callable[[], bool], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close
        self.shutting_down = shutting_down

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            if not self.shutting_down():
                raise
            end = sse(ApiError(503, "aborted: the server shut down before the request finished").body())
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": end, "more_body": False})
        finally:
            await self.on_close()
