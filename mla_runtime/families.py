"""The MLA family: one adapter per ``model_type``, mapping its checkpoint onto the one model the runtime runs.

Every MLA architecture the runtime loads is DeepSeek's decoder with some variations named in ``ModelConfig`` (router,
RoPE layout, MLP/MoE layer schedule, ...). An adapter (``Family``) says which layout it follows (``deepseek_v2`` or
``deepseek_v3``: their router and RoPE rules), how to rewrite its ``config.json`` into the fields ``config.py`` reads
(``normalise``), and how its tensor names map onto the model's parameter names (``rename``: None drops a tensor the
text model does not use). A variation the runtime does not implement is refused by ``normalise`` with a message that
names it: never silently wrong output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Raw = dict[str, Any]


def _same(raw: Raw) -> Raw:
    return raw


def _same_name(name: str) -> str | None:
    return name


@dataclass(frozen=True)
class Family:
    model_type: str
    layout: str  # "deepseek_v2" | "deepseek_v3": the router and RoPE rules it follows
    example: str  # a checkpoint of this family (for the docs and messages)
    normalise: Callable[[Raw], Raw] = _same  # its config.json -> the fields config.py reads (raises on what is missing)
    rename: Callable[[str], str | None] = _same_name  # a checkpoint tensor name -> the model's (None: not used)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("deepseek_v2", "deepseek_v2", "deepseek-ai/DeepSeek-V2-Lite"),
    Family("deepseek_v3", "deepseek_v3", "deepseek-ai/DeepSeek-V3"),
    Family("kimi_k2", "deepseek_v3", "moonshotai/Kimi-K2-Instruct"),
)}
# checkpoints that name only their architecture
ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}


def family_of(raw: Raw) -> Family:
    """The adapter of a ``config.json`` (by ``model_type``, else by ``architectures``), or a ``ValueError`` that names
    the supported ones."""
    model_type = raw.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    for arch in raw.get("architectures") or []:
        if arch in ARCHITECTURES:
            return FAMILIES[ARCHITECTURES[arch]]
    raise ValueError(
        f"model_type {model_type!r} (architectures {raw.get('architectures')}) is not supported: mla-runtime runs the "
        f"multi-head latent attention architectures with model_type one of {sorted(FAMILIES)} (or architectures "
        f"{sorted(ARCHITECTURES)})")
