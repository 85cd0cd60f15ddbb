"""``ServingRuntime``: the engine's life inside the server, admission, and per-request accounting.

Lifecycle: ``start`` loads the weights in a worker thread (``/health`` answers meanwhile, ``/ready`` is 503),
logs the operator summary, runs one probe generation and only then turns ready and starts the watchdog.
``admit`` is the single admission point (429 beyond ``max_num_seqs + max_queue`` sequences in flight: a
request holds ``n`` per prompt); ``finish`` records each admitted request's outcome exactly once; ``stop``
shuts the engine thread down.

The watchdog checks every ``WATCH_PERIOD`` s that the engine thread is alive and that no step has run for
more than ``--step-timeout`` seconds (a stopped or dead tensor-parallel rank blocks the step's collective).
On a fault ``/health`` answers 503 (at once: it reads the step's start time itself), new requests get 503,
and ``on_fatal`` asks the process to drain and exit non-zero, so that its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from mla_runtime import env
from mla_runtime.engine.async_llm import AsyncLLM
from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.info import EngineInfo
from mla_runtime.outputs import RequestOutput
from mla_runtime.sampling_params import SamplingParams
from mla_runtime.serving.config import ServerConfig
from mla_runtime.serving.metrics import ServerMetrics
from mla_runtime.serving.protocol import ApiError
from mla_runtime.serving.responses import Job

logger = logging.getLogger("mla_runtime.serving")

STATUS_OUTCOMES = {400: "invalid", 401: "unauthorized", 404: "invalid", 413: "too_large", 422: "invalid",
                   429: "rejected", 499: "client_disconnect", 503: "error", 504: "timeout"}
WATCH_PERIOD = 0.25  # s between the watchdog's checks
STARTUP_LOG_S = 30.0  # s between a waiting replica's log lines of what it waits for
FAULT_ENV = env.FAULT_INJECTION


def fault_injection(kind: str) -> int | None:
    """Fault injection for tests and bench/abuse.py: ``MLA_FAULT_INJECTION=stream:K`` makes every stream raise
    after its K-th engine output, ``step:K`` makes the K-th engine step after start-up raise (the engine
    thread dies), ``slow_step:K`` makes every engine step take K ms longer (a slow machine, whatever this one's
    speed). None when unset or of another kind."""
    return env.injected_fault(kind)


def _failing_step(after: int) -> Callable[[Any, Any], None]:
    steps = [0]

    def hook(engine: Any, outputs: Any) -> None:
        steps[0] += 1
        if steps[0] == after:
            raise RuntimeError(f"injected engine fault at step {after} ({FAULT_ENV})")

    return hook


def _slow_step(ms: int) -> Callable[[Any, Any], None]:
    def hook(engine: Any, outputs: Any) -> None:
        time.sleep(ms / 1000)

    return hook


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` can stand for: its longest vocabulary entry. For a
    byte-level BPE an entry has one character per byte, so it bounds the decoded text too; a normalizer
    could turn several characters into one, so its presence quadruples the bound."""
    vocab = tokenizer.get_vocab()
    longest = max((len(t) for t in vocab), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizer = getattr(backend, "normalizer", None) if backend is not None else None
    return max(1, longest) * (4 if normalizer is not None else 1)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class ServingRuntime:
    def __init__(self, engine_config: EngineConfig, config: ServerConfig, metrics: ServerMetrics,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.engine_config = engine_config
        self.config = config
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.llm: AsyncLLM | None = None
        self.ready = False
        self.status = "loading weights"
        self.shutting_down = False
        self.in_flight = 0  # sequences of admitted requests
        metrics.ready.set_function(lambda: float(self.ready))  # read at each scrape, never set under a signal
        self.info: EngineInfo | None = None
        self.created = int(time.time())  # the model's "created" on /v1/models: when this server started
        self.max_chars_per_token = 0  # 0: no tokenizer, no character bound
        self.fault: str | None = None
        self._watchdog: asyncio.Task | None = None

    # -- start-up ------------------------------------------------------------------------------
    async def start(self) -> None:
        t0 = time.monotonic()
        try:
            self.llm = await asyncio.to_thread(AsyncLLM, self.engine_config)
            engine = self.llm.engine
            self.info = engine.info()
            self.metrics.step_seconds.set_function(self.llm.step_seconds)
            self.metrics.attach_engine(self.llm.stats, self.info, self.config.served_model_name or "")
            if self.llm.tokenizer is not None:
                self.max_chars_per_token = await asyncio.to_thread(max_token_chars, self.llm.tokenizer)
            self._log_summary(self.info, engine.load_seconds)
            self.status = "running the probe generation"
            try:
                probe_s = await asyncio.wait_for(self._probe(), self.config.step_timeout)
            except TimeoutError:
                raise RuntimeError(f"the probe generation did not finish within step_timeout "
                                   f"({self.config.step_timeout:g} s)") from None
        except Exception as e:  # noqa: BLE001 - any start-up failure is fatal and must be reported
            self.status = f"start-up failed: {e}"
            logger.error("start-up failed: %s", e, exc_info=not isinstance(e, ValueError))
            if self.on_fatal is not None:
                self.on_fatal(e)
            return
        self.ready = True
        self.status = "ready"
        self._watchdog = asyncio.create_task(self._watch())
        if (after := fault_injection("step")) is not None:
            self.llm.step_hooks.append(_failing_step(after))
        if (ms := fault_injection("slow_step")) is not None:
            self.llm.step_hooks.append(_slow_step(ms))
        logger.info("ready in %.1f s (probe generation %.0f ms); serving http://%s:%d", time.monotonic() - t0,
                    probe_s * 1e3, self.config.host, self.config.port)

    async def _probe(self) -> float:
        assert self.llm is not None
        t0 = time.monotonic()
        engine = self.llm.engine
        bos = engine.model_config.bos_token_id
        prompt = {"prompt_token_ids": [bos if bos is not None else 0]}
        last: RequestOutput | None = None
        async for out in self.llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), "probe"):
            last = out
        if last is None or len(last.outputs[0].token_ids) != 1:
            raise RuntimeError("the probe generation returned no token")
        return time.monotonic() - t0

    async def wait_ready(self, deadline_s: float, name: str, failures: list[BaseException] | None = None,
                         log_every_s: float = STARTUP_LOG_S) -> None:
        """Wait until ``start`` has made the runtime ready, logging what it is doing every ``log_every_s``; raise
        ``RuntimeError`` naming ``name`` and the stage when start-up fails (or ``failures`` gets one) or has not
        finished after ``deadline_s`` (``startup_timeout``)."""
        t0 = logged = time.monotonic()
        while not self.ready:
            if failures or self.status.startswith("start-up failed"):
                raise RuntimeError(f"{name}: {self.status}")
            now = time.monotonic()
            if now - t0 >= deadline_s:
                raise RuntimeError(f"{name}: not ready after {now - t0:.0f} s (startup_timeout {deadline_s:g} s), "
                                   f"still {self.status}")
            if now - logged >= log_every_s:
                logger.info("%s still starting after %.0f s: %s", name, now - t0, self.status)
                logged = now
            await asyncio.sleep(0.05)

    def _log_summary(self, d: EngineInfo, load_seconds: float) -> None:
        c = self.config
        logger.info("model %s (%s, from %s): %d layers, %d heads, d_c=%d, d_r=%d, dtype %s, attention backend %s, "
                    "loaded in %.1f s", c.served_model_name, d.family, d.checkpoint, d.layers, d.heads, d.d_c, d.d_r,
                    d.dtype, d.attention_backend, load_seconds)
        state = "verified" if d.weights_verified else "from the manifest, not checked (--verify-weights checks it)"
        logger.info("weights fingerprint %s", f"{d.weights_fingerprint} ({state})" if d.weights_fingerprint
                    else "unknown: the checkpoint has no sha256 manifest (write one with `mla-runtime hash`)")
        logger.info("latent cache: %s, block size %d, %d blocks, %s/token -> max concurrent tokens %d "
                    "(max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d)",
                    d.cache_dtype, d.block_size, d.num_blocks, human_bytes(d.cache_bytes_per_token),
                    d.max_concurrent_tokens, d.max_model_len, d.max_num_seqs, d.max_num_batched_tokens)
        if d.state_bytes_per_sequence:
            logger.info("state cache: %s/sequence over %d slots (%s); %s", human_bytes(d.state_bytes_per_sequence),
                        d.max_num_seqs, human_bytes(d.state_bytes),
                        f"prefix caching with {d.state_snapshots} state snapshots "
                        f"({human_bytes(d.state_snapshot_bytes)})" if d.prefix_caching
                        else "prefix caching off for this model (no state snapshots)")
        total = d.weight_bytes + d.cache_bytes + d.state_bytes + d.state_snapshot_bytes + d.activation_bytes
        logger.info("memory on %s: weights %s | latent cache %s | activations (reserve) %s | total %s",
                    d.device, human_bytes(d.weight_bytes), human_bytes(d.cache_bytes),
                    human_bytes(d.activation_bytes), human_bytes(total))
        if d.host_capacity_bytes:
            logger.info("host tier: capacity %s = %d tokens in host RAM, %s", human_bytes(d.host_capacity_bytes),
                        d.host_capacity_tokens, "over the disk tier" if d.kv_cache_dir is not None
                        else "no disk tier under it: nothing survives a restart")
        if d.kv_cache_dir is not None:
            logger.info("disk tier: %s, capacity %s = %d tokens (%s per file of %d tokens), %s",
                        d.kv_cache_dir, human_bytes(d.disk_capacity_bytes), d.disk_capacity_tokens,
                        human_bytes(d.disk_file_bytes), d.block_size,
                        "write-through" if d.kv_cache_write_through else "written on eviction and at shutdown")
        logger.info("serving: request_timeout %.0f s, max_queue %d, max_body_bytes %s, api key %s, model id %r",
                    c.request_timeout, c.max_queue, human_bytes(int(c.max_body_bytes)),
                    "required" if c.api_key else "not required", c.served_model_name)

    # -- faults --------------------------------------------------------------------------------
    def health_problem(self) -> str | None:
        """Why /health must answer 503, or None: start-up failed, the engine thread died, or a step hangs."""
        if self.status.startswith("start-up failed"):
            return self.status
        if self.fault is not None:
            return self.fault
        llm = self.llm
        if llm is None:
            return None
        if llm.error is not None or (self.ready and not llm.alive):
            return "the engine failed; see the server log"
        seconds = llm.step_seconds()
        if seconds > self.config.step_timeout:
            return f"an engine step has run for {seconds:.0f} s (step_timeout {self.config.step_timeout:g} s)"
        return None

    async def _watch(self) -> None:
        while self.fault is None and not self.shutting_down:
            await asyncio.sleep(min(WATCH_PERIOD, self.config.step_timeout / 4))
            problem = self.health_problem()
            if problem is not None and not self.shutting_down:
                self.declare_fault(problem)

    def declare_fault(self, problem: str) -> None:
        """The engine cannot go on: refuse new requests and ask the process to drain and exit non-zero."""
        if self.fault is not None:
            return
        self.fault = problem
        logger.error("fault: %s; draining, then exiting with a failure so that the supervisor restarts the "
                     "server", problem)
        self.begin_shutdown()
        if self.on_fatal is not None:
            self.on_fatal(RuntimeError(problem))

    async def stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog

    # -- requests ------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len if self.info is not None else 0

    @property
    def max_prompt_chars(self) -> int:
        """Characters beyond which a text prompt cannot fit in max_model_len tokens (0: unknown)."""
        return self.max_chars_per_token * self.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer if self.llm is not None else None

    def check_ready(self) -> AsyncLLM:
        if self.fault is not None:
            raise ApiError(503, f"the server is restarting: {self.fault}")
        if self.shutting_down:
            raise ApiError(503, "the server is shutting down")
        if self.llm is not None and self.llm.error is not None:
            raise ApiError(503, "the engine failed; see the server log")
        if not self.ready or self.llm is None:
            raise ApiError(503, f"not ready: {self.status}", headers={"Retry-After": "5"})
        return self.llm

    def admit(self, job: Job) -> None:
        """Count ``job``'s sequences in flight (``n`` for each prompt of a batch), or refuse it."""
        limit = self.engine_config.max_num_seqs + self.config.max_queue
        weight = job.num_choices
        if weight > limit:
            param = "n" if len(job.prompts) == 1 else "prompt"
            raise ApiError(400, f"{param}: {len(job.prompts)} prompt(s) × n={job.params.n} = {weight} sequences "
                                f"exceed the server's capacity of {limit} sequences in flight (max_num_seqs + "
                                f"max_queue); split the request", param=param)
        if self.in_flight + weight > limit:
            raise ApiError(429, f"server at capacity: {self.in_flight} sequences in flight (max_num_seqs "
                                f"{self.engine_config.max_num_seqs} + max_queue {self.config.max_queue}); "
                                f"retry later", headers={"Retry-After": "1"})
        self.in_flight += weight
        self.metrics.in_flight.inc(weight)

    def reject(self, endpoint: str, status: int) -> str:
        """Count a request refused before admission; returns its outcome label."""
        outcome = STATUS_OUTCOMES.get(status, "error")
        self.metrics.requests.labels(endpoint, outcome).inc()
        return outcome

    def cache_blocks(self) -> tuple[int, int] | None:
        """(used, total) latent-cache blocks in the engine's latest snapshot; None before it started."""
        if self.llm is None:
            return None
        stats = self.llm.stats()
        return stats.num_blocks - stats.num_free_blocks, stats.num_blocks

    def deadline(self, job: Job) -> float:
        """Event-loop time at which ``job`` times out."""
        return asyncio.get_running_loop().time() - (time.monotonic() - job.arrival) + self.config.request_timeout

    def finish(self, job: Job, outcome: str, out: RequestOutput | None) -> None:
        """Record an admitted job's end (idempotent); abort it in the engine unless it finished there."""
        if job.outcome is not None:
            return
        job.outcome = outcome
        if self.llm is not None and (out is None or not out.finished):
            for request_id in job.engine_request_ids:
                self.llm.abort(request_id)
        self.in_flight -= job.num_choices
        m = self.metrics
        m.in_flight.dec(job.num_choices)
        m.requests.labels(job.endpoint, outcome).inc()
        job.last_output = out
        if out is None:
            return
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        m.cached_prompt_tokens.inc(out.num_cached_tokens)
        if outcome == "success":
            m.e2e.observe(time.monotonic() - job.arrival)
            if out.metrics.ttft is not None:
                m.ttft.observe(out.metrics.ttft)
            if out.metrics.time_per_output_token is not None:
                m.tpot.observe(out.metrics.time_per_output_token)

    def begin_shutdown(self) -> None:
        """SIGTERM: refuse new requests (503) and turn /ready off so balancers drain; in-flight ones go on. Only
        sets flags: the server's signal handler calls it."""
        self.shutting_down = True
        self.ready = False

    def stop(self) -> None:
        self.begin_shutdown()
        if self.llm is None:
            return
        if self.fault is not None:  # a hung rank would block the orderly stop: end the ranks first
            self._kill_ranks()
        # the engine thread, the disk tier's flush of resident blocks (its own shutdown_timeout), the ranks
        self.llm.shutdown(flush_timeout=self.config.shutdown_timeout)

    def _kill_ranks(self) -> None:
        group = getattr(self.llm.engine, "tp_group", None) if self.llm is not None else None
        for p in getattr(group, "procs", []):
            if p.is_alive():
                logger.error("killing tensor-parallel rank process %s (pid %s)", p.name, p.pid)
                p.kill()
