"""mla-runtime: an inference runtime specialised for multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)."""

from mla_runtime.llm import LLM
from mla_runtime.outputs import CompletionOutput, RequestOutput
from mla_runtime.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "AsyncLLM":
        from mla_runtime.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
