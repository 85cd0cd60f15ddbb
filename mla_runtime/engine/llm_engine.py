"""``LLMEngine``: requests in, ``RequestOutput``s out, one scheduler step at a time.

Request lifecycle:
1. ``add_request`` validates the prompt and parameters and queues one ``Sequence`` per sample;
2. ``step`` runs the step pipeline: the proposer drafts for the running decodes, the scheduler turns them and
   its budget into a ``StepPlan``, the runner prepares it, executes it on the worker(s) and samples, the
   proposer observes the step, the scheduler indexes the newly full blocks, and finished sequences hand their
   blocks back to the pool;
3. every request touched by the step gets a fresh ``RequestOutput`` (cumulative text and tokens);
4. ``abort`` finishes a request at any stage and frees its blocks.

The model, its cache and their sizing belong to the ``Worker`` (``engine/worker.py``: read them there,
``engine.worker.cache``; a ``deepseek_v4`` checkpoint's is ``engine/v4_worker.py``'s ``V4Worker``); input and output
processing to ``engine/requests.py``.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from mla_runtime.config import ModelConfig
from mla_runtime.engine.block_pool import BlockPool
from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.info import EngineInfo, EngineStats, TokenCounts
from mla_runtime.engine.kv_tier import TierDriver, attach_lower_tier, attach_snapshot_tier
from mla_runtime.engine.model_runner import ModelRunner
from mla_runtime.engine.proposer import make_proposer
from mla_runtime.engine.requests import (
    PromptType,
    RequestState,
    Tokenized,
    check_request,
    make_output,
    new_request,
    record_sampled,
    tokenize,
)
from mla_runtime.engine.scheduler import Scheduler
from mla_runtime.engine.structured import GrammarCompiler
from mla_runtime.engine.thread_tuner import ThreadTuner
from mla_runtime.engine.tp_workers import TensorParallelGroup
from mla_runtime.engine.v4_worker import make_worker
from mla_runtime.latent_rank import calibration_from_file
from mla_runtime.outputs import RequestOutput
from mla_runtime.parallel import SINGLE_RANK, ParallelContext
from mla_runtime.sampling_params import SamplingParams
from mla_runtime.tokenizer import load_tokenizer

__all__ = ["LLMEngine", "PromptType", "RequestState"]

logger = logging.getLogger("mla_runtime")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.monotonic()
        self.config = config
        tp = config.tensor_parallel_size
        self.worker = make_worker(config, ParallelContext(0, tp, config.latent_cache_layout) if tp > 1 else SINGLE_RANK)
        self.tp_group = TensorParallelGroup(config) if tp > 1 else None  # bad settings fail before ranks start
        try:
            self._set_up_worker()
        except BaseException:
            self.shutdown()
            raise
        w = self.worker
        assert w.cache is not None
        self.thread_tuner = ThreadTuner.for_engine(config.num_threads, w.device, tp)
        self.pool = BlockPool(w.cache.num_blocks, config.block_size, w.prefix_caching, config.cache_watermark)
        self.kv_tier: TierDriver | None = attach_lower_tier(w, self.pool, self.tp_group, config.kv_cache_write_through)
        self.proposer = make_proposer(config, w, self.tp_group)
        snapshots = w.state_snapshots()
        if snapshots is not None:
            self.pool.attach_states(snapshots)
            self.kv_tier = self.kv_tier or attach_snapshot_tier(w, self.pool, snapshots)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, w.max_num_batched_tokens,
                                   self.proposer.trailing_slots, w.state_slots(), snapshots, w.own_prefix_copies,
                                   fixed_chunks=w.rows_invariant)
        self.runner = ModelRunner(w, config.seed, self.tp_group, self.thread_tuner)
        self.requests: dict[str, RequestState] = {}
        self.grammars = GrammarCompiler(self.tokenizer, w.model_config.vocab_size, self.runner.sampler.eos_token_ids)
        self._seq_ids = itertools.count()
        self.load_seconds = time.monotonic() - t0
        self.counts = TokenCounts.for_speculation(config.speculative_method, config.num_speculative_tokens)

    def _set_up_worker(self) -> None:
        """Load, truncate, size and allocate on every rank (the worker ranks follow rank 0's commands)."""
        w, tp = self.worker, self.tp_group
        w.load()
        self.tokenizer = load_tokenizer(w.model_path)
        if self.config.latent_rank is not None:
            c = self.config
            calibration = calibration_from_file(c.latent_projection, c.latent_calibration,
                                                self.tokenizer.encode if self.tokenizer is not None else None)
            if tp:
                tp.send("truncate", calibration, awaiting="load their shards")
            w.truncate_latent(calibration)
            logger.info("latent rank truncated to %d (%s)", self.config.latent_rank, self.config.latent_projection)
        num_blocks = w.num_blocks()
        if tp:
            tp.send("allocate", num_blocks, awaiting="load their shards")
        w.allocate(num_blocks)
        w.open_lower_tier()
        if tp:
            tp.ready()

    @property
    def model_config(self) -> ModelConfig:
        """The served model's configuration (after latent-rank truncation), for callers outside the engine; the
        rest of the model's facts are the worker's (``engine.worker``)."""
        return self.worker.model_config

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> RequestState:
        """Validate, tokenize and queue a request: the id check of a caller that steps the engine itself."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self.submit(self.prepare_request(request_id, prompt, params, arrival_time))

    def prepare_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                        arrival_time: float | None = None) -> RequestState:
        """Validate and tokenize a request into its state without touching the scheduler (safe to call from
        another thread than the one stepping the engine; a structured-outputs grammar is compiled here); ``submit``
        then queues it. Bad input raises ``InvalidParam`` (a ValueError naming the field)."""
        params, w = params or SamplingParams(), self.worker
        text, ids = tokenize(self.tokenizer, prompt)
        vocab = w.model_config.vocab_size
        check_request(ids, params, vocab, w.max_model_len, isinstance(prompt, Tokenized) and prompt.vocab == vocab)
        w.check_prompt(ids)
        return new_request(request_id, text, ids, params, self.tokenizer, self._seq_ids, w.device, arrival_time,
                           self.grammars)

    def submit(self, state: RequestState) -> RequestState:
        """Queue a prepared request for scheduling (in the thread that steps the engine). Its id was checked once, by
        ``add_request`` or by ``AsyncLLM``'s stream registry."""
        self.requests[state.request_id] = state
        for s in state.seqs:
            self.scheduler.add(s)
        self.counts.prompt += len(state.prompt_token_ids)
        return state

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for s in state.seqs:
            self.scheduler.finish(s, "abort")
        state.finished = True
        state.metrics.finished_time = time.monotonic()
        return make_output(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- stepping ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """propose → schedule → prepare → execute → sample → observe → bookkeeping."""
        plan = self.scheduler.schedule(self.proposer.propose(self.scheduler.running))
        if not plan.seqs:
            self.scheduler.relieve_cache_pressure()
            return []
        start = time.monotonic()
        for seq in plan.seqs:
            state = self.requests.get(seq.request_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = start
        sampled, accepted = self.runner.run(plan)
        self.proposer.observe(plan, sampled)  # before the bookkeeping: it reads the state the step started from
        self.counts.count_drafts(plan.seqs, plan.extra_token_ids, accepted)
        self.scheduler.on_step_done(plan, accepted)
        touched = record_sampled(self.requests, sampled, self.worker.model_config, self.worker.max_model_len,
                                 self.scheduler.finish, self.counts)
        self.scheduler.relieve_cache_pressure()  # finished sequences' blocks are back: free idle ones now
        return [make_output(state) for state in touched]

    def shutdown(self, flush_timeout: float = 30.0) -> None:
        """Write the resident full blocks that are not on disk yet (with a disk tier, up to ``flush_timeout`` s; the
        host tier's blocks too), then stop the tensor-parallel worker ranks."""
        kv_tier, self.kv_tier = getattr(self, "kv_tier", None), None
        if kv_tier is not None:
            kv_tier.shutdown(self.pool, flush_timeout)
        if self.tp_group is not None:
            self.tp_group.shutdown()

    # -- introspection (operators, metrics, tests) -----------------------------------------------
    def info(self) -> EngineInfo:
        """What an operator needs at start-up (logged by the server, exported as metrics)."""
        return EngineInfo.of(self.worker, self.pool.num_blocks, torch.get_num_threads())

    def stats(self) -> EngineStats:
        disk, host = self.worker.disk_tier, self.worker.host_tier
        return EngineStats.of(self.scheduler, self.pool, self.counts, disk.stats() if disk is not None else None,
                              host.stats() if host is not None else None)
