"""Reasoning output on ``/v1/chat/completions``: a thinking model's ``<think>…</think>`` part as
``message.reasoning_content`` (streamed: ``delta.reasoning_content``), the rest as ``content``.

The parser is chosen from the model (``reasoning_parser: auto``, the default): ``deepseek_r1`` where the chat template
writes ``<think>`` or ``</think>`` (DeepSeek-R1, DeepSeek-V3.1 and later, Kimi-K2-Thinking, GLM's thinking
templates) or the ``model_type`` is one of ``THINKING_MODEL_TYPES`` (DeepSeek-V4's built-in format,
``v4_chat.py``, thinks by default); ``none`` elsewhere. ``--reasoning-parser`` sets it instead. The markers must be
text the tokenizer keeps when it decodes (they are ordinary tokens in those tokenizers).

Two shapes of output are read: one that starts with ``<think>`` (the template leaves the model to open its thinking),
and one that starts inside the thinking, with only ``</think>`` to come, where the rendered prompt ends in an open
``<think>`` (DeepSeek-R1's template, or DeepSeek-V3.1's with ``chat_template_kwargs: {"thinking": true}``). An
output that ends before ``</think>`` (``max_tokens``) is all reasoning, its ``content`` null. Text after
``</think>`` is the answer, kept as written; tool calls are parsed out of it and nothing else.

Streamed, a marker may arrive split across chunks (``</th`` then ``ink>``): the text that may be the start of a marker
is held back until the next chunk decides it, so the deltas always add up to the answer a non-streamed request gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

START, END = "<think>", "</think>"
REASONING_PARSERS = ("auto", "deepseek_r1", "none")
# model types whose released checkpoints all think in <think> blocks by default (GLM-4.7-Flash, GLM-5, DeepSeek-V4):
# the parser is on for them even where the checkpoint ships no chat template that says so
THINKING_MODEL_TYPES = frozenset({"glm4_moe_lite", "glm_moe_dsa", "deepseek_v4"})


def choose_parser(setting: str, model_type: str | None, chat_template: Any) -> str | None:
    """The reasoning parser of a server: ``setting`` (``REASONING_PARSERS``) resolved against the model; None: no
    parser (every answer is content)."""
    if setting not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {setting!r}")
    if setting != "auto":
        return None if setting == "none" else setting
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    if any(isinstance(t, str) and (START in t or END in t) for t in templates) or model_type in THINKING_MODEL_TYPES:
        return "deepseek_r1"
    return None


def starts_inside(prompt_tail: str) -> bool:
    """Whether the output of a prompt ending in ``prompt_tail`` (decoded with its special tokens) begins inside the
    thinking: the prompt's last ``<think>`` is not closed."""
    return prompt_tail.rfind(START) > prompt_tail.rfind(END)


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``marker`` (held back until more arrives)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits an output into ``(reasoning, content)`` as it grows: ``feed`` a text delta, ``finish`` at the end.
    ``inside``: the output begins inside the thinking (``starts_inside``)."""

    def __init__(self, inside: bool = False) -> None:
        self.mode = "opening"  # before the first non-blank text: it may open with <think>
        self.inside = inside
        self.buffer = ""
        self.saw_end = False  # </think> was written: the content is the answer, even if empty

    def feed(self, delta: str) -> tuple[str, str]:
        """The ``(reasoning, content)`` text that ``delta`` completes (text that may start a marker is held)."""
        self.buffer += delta
        reasoning = content = ""
        if self.mode == "opening":
            rest = self.buffer.lstrip()
            if START.startswith(rest):  # blank, or a part of <think>: undecided
                return "", ""
            if rest.startswith(START):
                self.buffer = rest[len(START):]
                self.mode = "reasoning"
            else:
                self.mode = "reasoning" if self.inside else "content"
        if self.mode == "reasoning":
            head, found, tail = self.buffer.partition(END)
            if found:
                reasoning, self.buffer, self.mode, self.saw_end = head, tail, "content", True
            else:
                keep = _held(self.buffer, END)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        if self.mode == "content":
            content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held text at the end of the output: reasoning when the thinking never closed, else content."""
        held, self.buffer = self.buffer, ""
        if self.mode == "reasoning" or (self.mode == "opening" and self.inside):
            return held, ""
        return "", held

    @property
    def reasoned(self) -> bool:
        """The output has a thinking part (it opened with ``<think>`` or began inside one)."""
        return self.mode == "reasoning" or self.saw_end or (self.mode == "opening" and self.inside)


@dataclass(frozen=True)
class Reasoning:
    """A chat request's reasoning parse: ``inside`` as in ``ReasoningSplitter``."""

    inside: bool = False

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.inside)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A finished output's ``(reasoning_content, content)``: None for a part the output does not have (no
        thinking; or no answer, the thinking never closed). Equal to what ``feed`` and ``finish`` stream."""
        s = self.splitter()
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        reasoning, content = r1 + r2, c1 + c2
        if not s.reasoned:
            return None, content
        return reasoning, (content if s.saw_end else None)
