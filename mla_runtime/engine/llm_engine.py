"""``LLMEngine``: requests in, ``RequestOutput``s out, one scheduler step at a time.

Request lifecycle:
1. ``add_request`` validates the prompt and parameters and queues one ``Sequence`` per sample;
2. ``step`` asks the scheduler for a batch, the runner runs it and samples, the scheduler indexes the
   newly full blocks, and finished sequences hand their blocks back to the pool;
3. every request touched by the step gets a fresh ``RequestOutput`` (cumulative text and tokens);
4. ``abort`` finishes a request at any stage and frees its blocks.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mla_runtime.config import ModelConfig
from mla_runtime.engine.block_pool import BlockPool
from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.model_runner import ModelRunner
from mla_runtime.engine.scheduler import Scheduler
from mla_runtime.engine.sequence import Sequence
from mla_runtime.engine.thread_tuner import ThreadTuner
from mla_runtime.engine.tp_workers import (
    TensorParallelGroup,
    launched_by_torchrun,
    make_cache,
    run_torchrun_worker,
    torchrun_rank,
)
from mla_runtime.hub import resolve_model
from mla_runtime.latent_rank import truncate_latent_rank
from mla_runtime.loader import load_model
from mla_runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mla_runtime.parallel import SINGLE_RANK, check_tensor_parallel
from mla_runtime.plan import (
    activation_reserve_bytes,
    default_max_num_batched_tokens,
    latent_bytes_per_token,
    resolve_cache_dtype,
    resolve_model_dtype,
    weight_bytes,
)
from mla_runtime.sampling_params import SamplingParams
from mla_runtime.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger("mla_runtime")

PromptType = str | dict[str, Any] | list[int]
CPU_CACHE_FRACTION = 0.25
CALIBRATION_TOKENS = 16384  # of available RAM, when kv_cache_memory is not given


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    texts: list[str]
    metrics: RequestMetrics
    finished: bool = False
    user_data: dict[str, Any] = field(default_factory=dict)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config = replace(config, model=resolve_model(config.model, config.revision))  # hub id → local folder
        self.config = config
        t0 = time.monotonic()
        cfg = self.model_config = ModelConfig.from_pretrained(config.model)
        if config.latent_rank is not None:
            if config.latent_rank > cfg.kv_lora_rank:
                raise ValueError(f"latent_rank ({config.latent_rank}) exceeds the model's kv_lora_rank "
                                 f"({cfg.kv_lora_rank})")
            cfg = self.model_config = cfg.with_overrides(kv_lora_rank=config.latent_rank)  # the cache's d_c
        tp = config.tensor_parallel_size
        check_tensor_parallel(cfg, tp, config.block_size, config.latent_cache_layout)
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() and tp == 1 else "cpu"))
        model_dtype = resolve_model_dtype(config.dtype, cfg, self.device)
        self.thread_tuner: ThreadTuner | None = None
        if config.num_threads is not None and self.device.type == "cpu" and tp == 1:
            if config.num_threads == "auto":
                self.thread_tuner = ThreadTuner(len(os.sched_getaffinity(0)))
            else:
                torch.set_num_threads(config.num_threads)  # process-wide, as torch's own setting is
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        self.max_num_batched_tokens = config.max_num_batched_tokens or default_max_num_batched_tokens(
            self.max_model_len, config.max_num_seqs)
        self.cache_dtype = resolve_cache_dtype(config.kv_cache_dtype, model_dtype)
        self.bytes_per_token = latent_bytes_per_token(cfg, self.cache_dtype.dtype, model_dtype)
        sharded = tp > 1 and config.latent_cache_layout == "sharded"
        self.bytes_per_token_per_rank = self.bytes_per_token // tp if sharded else self.bytes_per_token
        self.weight_bytes = weight_bytes(cfg, model_dtype, tp)
        if tp > 1 and launched_by_torchrun() and torchrun_rank() != 0:
            run_torchrun_worker(config)  # serves rank 0's steps, then ends this process
        num_blocks = self._num_blocks()
        self.tp_group = TensorParallelGroup(config, num_blocks, self.cache_dtype.dtype) if tp > 1 else None
        par = self.tp_group.par if self.tp_group else SINGLE_RANK
        try:
            self.model = load_model(config.model, dtype=model_dtype, attention_path=config.attention_path,
                                    backend=config.attention_backend, device=self.device, par=par)
            self.tokenizer = load_tokenizer(config.model)
            if config.latent_rank is not None:
                self._truncate_latent()
            self.cache = make_cache(self.model, num_blocks, config, self.cache_dtype.dtype, par, self.device)
            if self.tp_group:
                self.tp_group.ready()
        except BaseException:
            self.shutdown()
            raise
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                                   config.num_speculative_tokens, (config.prompt_lookup_max, config.prompt_lookup_min))
        self.runner = ModelRunner(self.model, self.cache, self.device, config.seed, config.block_size, self.tp_group,
                                  self.thread_tuner)
        self.requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        self.load_seconds = time.monotonic() - t0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_draft_tokens = 0  # speculative tokens proposed / accepted by the model
        self.num_accepted_tokens = 0

    def _truncate_latent(self) -> None:
        cfg = self.config
        calibration = None
        if cfg.latent_projection == "pca":
            text = open(cfg.latent_calibration or "", encoding="utf-8").read()
            if self.tokenizer is None:
                raise ValueError("latent_calibration needs a tokenizer in the checkpoint directory")
            ids = self.tokenizer.encode(text)[:CALIBRATION_TOKENS]
            calibration = [ids[i:i + 512] for i in range(0, len(ids), 512)]
        if self.tp_group:  # every rank truncates its shard with the same bases (computed on rank 0)
            self.tp_group.send_calibration(calibration)
        truncate_latent_rank(self.model, cfg.latent_rank, cfg.latent_projection, calibration)
        logger.info("latent rank truncated to %d (%s)", cfg.latent_rank, cfg.latent_projection)

    # -- sizing --------------------------------------------------------------------------------
    def _num_blocks(self) -> int:
        """Blocks that fit the per-rank cache budget (every rank holds the same block ids)."""
        cfg, bs = self.config, self.config.block_size
        per_block = self.bytes_per_token_per_rank * bs
        seq_blocks = -(-self.max_model_len // bs)
        if cfg.kv_cache_memory is not None:
            budget = int(cfg.kv_cache_memory)
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            activations = activation_reserve_bytes(self.model_config, dtype=cfg.dtype,
                                                   max_num_batched_tokens=self.max_num_batched_tokens,
                                                   max_num_seqs=cfg.max_num_seqs)
            budget = int(free * 0.9) - self.weight_bytes - activations
        else:  # no point reserving more than max_num_seqs full-length sequences on a CPU
            budget = min(int(_available_ram() * CPU_CACHE_FRACTION), seq_blocks * cfg.max_num_seqs * per_block)
        num_blocks = budget // per_block
        if num_blocks < seq_blocks:
            raise ValueError(
                f"kv_cache_memory: {budget:,} B hold {num_blocks} blocks of {bs} tokens ({per_block:,} B each), "
                f"but one sequence of max_model_len={self.max_model_len} needs {seq_blocks}; raise kv_cache_memory "
                f"to at least {seq_blocks * per_block:,} B or lower max_model_len")
        return num_blocks

    def describe(self) -> dict[str, Any]:
        """What an operator needs at start-up (logged by the server, exported as metrics)."""
        cfg = self.model_config
        return {
            "model": self.config.model, "family": cfg.family, "layers": cfg.num_hidden_layers,
            "heads": cfg.num_attention_heads, "d_c": cfg.kv_lora_rank, "d_r": cfg.qk_rope_head_dim,
            "dtype": str(self.model.dtype).removeprefix("torch."), "cache_dtype": self.cache_dtype.name,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "latent_cache_layout": self.config.latent_cache_layout,
            "cache_bytes_per_token_per_rank": self.bytes_per_token_per_rank,
            "block_size": self.config.block_size, "num_blocks": self.cache.num_blocks,
            "cache_bytes": self.cache.nbytes(), "cache_bytes_per_token": self.bytes_per_token,
            "weight_bytes": self.weight_bytes, "max_model_len": self.max_model_len,
            "max_concurrent_tokens": self.pool.num_blocks * self.config.block_size,
            "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens, "device": str(self.device),
            "num_threads": torch.get_num_threads(),
        }

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list):
            return None, list(prompt)
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, a token-id list or a dict, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("prompt: this checkpoint has no tokenizer files; pass {'prompt_token_ids': [...]}")
        return prompt, self.tokenizer.encode(prompt)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> RequestState:
        return self.submit(self.prepare_request(request_id, prompt, params, arrival_time))

    def prepare_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                        arrival_time: float | None = None) -> RequestState:
        """Validate and tokenize a request into its state without touching the scheduler (safe to call from
        another thread than the one stepping the engine); ``submit`` then queues it. Bad input raises
        ValueError."""
        params = params or SamplingParams()
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        bad_bias = [t for t in params.logit_bias or {} if t >= vocab]
        if bad_bias:
            raise ValueError(f"logit_bias names token {bad_bias[0]}, outside the vocabulary [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids or []):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: the prompt "
                             f"must be shorter to leave room for output")
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            seqs.append(Sequence(seq_id=next(self._seq_ids), request_id=request_id, index=i, prompt_token_ids=ids,
                                 params=params, arrival_time=now, generator=gen,
                                 share_prefix_with=None))
        for s in seqs[1:]:
            s.share_prefix_with = seqs[0]
        return RequestState(request_id, text, ids, params, seqs,
                            [IncrementalDetokenizer(self.tokenizer, ids) for _ in seqs], ["" for _ in seqs],
                            RequestMetrics(arrival_time=now))

    def submit(self, state: RequestState) -> RequestState:
        """Queue a prepared request for scheduling (in the thread that steps the engine)."""
        if state.request_id in self.requests:
            raise ValueError(f"request_id {state.request_id!r} is already in use")
        self.requests[state.request_id] = state
        for s in state.seqs:
            self.scheduler.add(s)
        self.num_prompt_tokens += len(state.prompt_token_ids)
        return state

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for s in state.seqs:
            self.scheduler.finish(s, "abort")
        state.finished = True
        state.metrics.finished_time = time.monotonic()
        return self._output(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- stepping ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        sampled, accepted = self.runner.execute(batch)
        self.num_draft_tokens += sum(len(s.draft_token_ids) for s in batch.seqs)
        self.num_accepted_tokens += sum(accepted.values())
        self.scheduler.on_step_done(batch, accepted)
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for new in sampled:
            seq = new.seq
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            for token, lp in zip(new.token_ids, new.logprobs):
                if seq.is_finished:  # a stop among a speculative step's tokens drops the rest
                    break
                self._append(state, seq, token, lp, now)
                touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if all(s.is_finished for s in state.seqs):
                state.finished = True
                state.metrics.finished_time = now
                del self.requests[state.request_id]
            outputs.append(self._output(state))
        return outputs

    def _append(self, state: RequestState, seq: Sequence, token: int, logprobs: dict[int, float] | None,
                now: float) -> None:
        params = seq.params
        seq.output_token_ids.append(token)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        seq.token_times.append(now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        if seq.index == 0:
            state.metrics.token_times.append(now)
        self.num_generation_tokens += 1
        detok = state.detoks[seq.index]
        if len(seq.output_token_ids) == params.min_tokens:  # the first token that may stop the sequence
            seq.stop_text_from = len(state.texts[seq.index])
        detok.add(token)
        text = detok.text
        reason = None
        if not params.ignore_eos and token in self.model_config.eos_token_ids:
            reason = "stop"
        elif params.stop_token_ids and token in params.stop_token_ids:
            reason = "stop"
        if len(seq.output_token_ids) < params.min_tokens:
            reason = None  # stop tokens cannot be sampled yet (the sampler suppresses them); stop strings wait
        elif params.stop_strings and reason is None:  # a stop string must end after the first min_tokens - 1 tokens
            found = (text.find(s, max(0, seq.stop_text_from - len(s) + 1)) for s in params.stop_strings)
            cut = min((i for i in found if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
                reason = "stop"
        state.texts[seq.index] = text
        if reason is None and len(seq.output_token_ids) >= params.max_tokens:
            reason = "length"
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _output(self, state: RequestState) -> RequestOutput:
        outs = [CompletionOutput(index=s.index, text=state.texts[s.index], token_ids=list(s.output_token_ids),
                                 finish_reason=s.finish_reason,
                                 logprobs=list(s.output_logprobs) if s.params.logprobs is not None else None)
                for s in state.seqs]
        cached = state.seqs[0].num_cached_prompt_tokens if state.seqs else 0
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs, state.finished,
                             state.metrics, cached)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker ranks (nothing to do on one rank)."""
        if getattr(self, "tp_group", None) is not None:
            self.tp_group.shutdown()

    # -- introspection (tests, metrics) --------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            "num_waiting": len(self.scheduler.waiting), "num_running": len(self.scheduler.running),
            "num_free_blocks": self.pool.num_free_blocks, "num_blocks": self.pool.num_blocks,
            "cache_usage": self.pool.usage(), "prefix_query_tokens": self.pool.query_tokens,
            "prefix_hit_tokens": self.pool.hit_tokens, "prefix_hit_rate": self.pool.hit_rate(),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_computed_tokens": self.scheduler.num_computed_tokens_total,
            "num_prompt_tokens": self.num_prompt_tokens, "num_generation_tokens": self.num_generation_tokens,
            "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
        }
