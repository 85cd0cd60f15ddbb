"""``LLM``: the offline Python API, named as vLLM users expect.

    from mla_runtime import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")          # or a hub repo id: LLM("org/name", revision="main")
    out = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32, temperature=0))
    out[0].outputs[0].text, out[0].outputs[0].token_ids, out[0].outputs[0].finish_reason
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.llm_engine import LLMEngine, PromptType
from mla_runtime.engine.requests import Tokenized
from mla_runtime.engine.tp_workers import is_torchrun_worker, run_torchrun_worker
from mla_runtime.outputs import RequestOutput
from mla_runtime.sampling_params import SamplingParams


class LLM:
    """``LLM(model, **engine_keywords)``: every keyword is an ``EngineConfig`` field (``dtype``, ``max_model_len``,
    ``kv_cache_memory``, ``tensor_parallel_size``, ``latent_rank``, ``revision``, ...), validated there.

    Under ``torchrun`` with ``tensor_parallel_size > 1``, every rank runs the same script: on rank 0 this builds
    the engine; on the other ranks it serves rank 0's steps and then ends the process, so only rank 0 returns.
    """

    def __init__(self, model: str, **kwargs) -> None:
        self.config = EngineConfig(model=str(model), **kwargs)
        if is_torchrun_worker(self.config):
            run_torchrun_worker(self.config)
            raise SystemExit(0)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    def shutdown(self, flush_timeout: float = 30.0) -> None:
        """Release the engine: with a disk tier (``kv_cache_dir``), write the resident full blocks not on disk yet
        (up to ``flush_timeout`` s); stop tensor-parallel worker ranks."""
        self.engine.shutdown(flush_timeout)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs come back in prompt order. ``use_tqdm``: a
        progress bar of finished requests (None: when stderr is a terminal)."""
        if isinstance(prompts, (str, dict, Tokenized)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        from tqdm import tqdm

        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=None if use_tqdm is None else not use_tqdm)
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[rid] for rid in ids]
