"""mla-runtime: an inference runtime specialised for multi-head latent attention (DeepSeek-V2/V3, Kimi-K2).

The public names are imported on first use, so that ``python -m mla_runtime.plan`` (and the ``mla-runtime``
subcommands) import only what they run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mla_runtime.engine.async_llm import AsyncLLM
    from mla_runtime.llm import LLM
    from mla_runtime.outputs import CompletionOutput, RequestOutput
    from mla_runtime.sampling_params import SamplingParams, StructuredOutputs

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput"]
_HOMES = {"LLM": "mla_runtime.llm", "AsyncLLM": "mla_runtime.engine.async_llm",
          "SamplingParams": "mla_runtime.sampling_params",
          "StructuredOutputs": "mla_runtime.sampling_params", "RequestOutput": "mla_runtime.outputs",
          "CompletionOutput": "mla_runtime.outputs"}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'mla_runtime' has no attribute {name!r}")
