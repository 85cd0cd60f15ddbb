"""Decoding through the compiled whole-layer kernel (``cpu_tables.decoder_layer``), counted: what the tests of each
weight format in its tables assert."""

from __future__ import annotations

from pathlib import Path

import pytest

from mla_kernels import cpu_tables
from mla_runtime import LLM, SamplingParams
from mla_runtime.config import ModelConfig

PROMPTS = [[5, 9, 2, 7, 11, 3], list(range(3, 40)), [7, 7, 8], list(range(50, 60))]


def decode_in_layer_kernel(path: Path | str, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Serve ``path``, decode ``PROMPTS`` batched and one at a time, and return the weight kinds the layer kernel
    read; asserts the batch's tokens are each prompt's tokens alone, that every layer of every decode step ran in the
    kernel, and that steps of one row and of several did."""
    rows: list[int] = []
    kinds: set[str] = set()
    tables: set[int] = set()
    real = cpu_tables.decoder_layer

    def counted(table, step, *args):  # type: ignore[no-untyped-def]
        rows.append(step.rows)
        tables.add(id(table))
        kinds.update(table.table.kinds())
        return real(table, step, *args)

    monkeypatch.setattr(cpu_tables, "decoder_layer", counted)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    layers = ModelConfig.from_pretrained(path).num_hidden_layers
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert batched == [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in PROMPTS]
    assert 1 in rows and max(rows) > 1
    assert len(rows) % layers == 0 and len(tables) == layers  # every layer of every step
    return kinds
