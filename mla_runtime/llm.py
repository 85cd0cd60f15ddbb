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
from mla_runtime.outputs import RequestOutput
from mla_runtime.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, *, dtype: str = "auto", max_model_len: int | None = None, block_size: int = 64,
                 kv_cache_dtype: str = "auto", kv_cache_memory: int | str | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 tensor_parallel_size: int = 1, attention_backend: str | None = None,
                 latent_cache_layout: str = "replicated", latent_rank: int | None = None, seed: int = 0,
                 **kwargs) -> None:
        self.config = EngineConfig(
            model=str(model), dtype=dtype, max_model_len=max_model_len, block_size=block_size,
            kv_cache_dtype=kv_cache_dtype, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            tensor_parallel_size=tensor_parallel_size, attention_backend=attention_backend,
            latent_cache_layout=latent_cache_layout, latent_rank=latent_rank, seed=seed, **kwargs)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Release the engine (stops tensor-parallel worker ranks)."""
        self.engine.shutdown()

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
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
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
