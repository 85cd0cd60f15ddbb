"""Tool calls on ``/v1/chat/completions``: OpenAI's ``tools`` and ``tool_choice``.

- ``tool_choice: {"type": "function", "function": {"name": N}}`` constrains the output to a JSON value of tool
  N's ``parameters`` schema; it is returned as one call of N with that value as its ``arguments``.
- ``tool_choice: "required"`` constrains the output to a JSON array of ``{"name": ..., "parameters": {...}}``
  objects, each naming one of the tools and matching its schema (one item with ``parallel_tool_calls: false``);
  each item becomes one call.
- ``tool_choice: "auto"`` (OpenAI's default when tools are given) leaves the output free and parses the
  model's own tool-call syntax out of it. It needs a chat template that shows the model the tools and a
  tool-call format this server can parse: DeepSeek-V3's (``DEEPSEEK_MARKERS``). Elsewhere it is refused with
  400 naming ``tool_choice``.

DeepSeek-V3 writes its calls between special tokens, after any text content::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"arg": 1}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

and DeepSeek-V3.1 as ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"arg": 1}<｜tool▁call▁end｜>``; both are parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_MARKERS = (CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, CALLS_END)
_FENCED = re.compile(r"^(?P<name>[^\n]*)\n```(?:json)?\n(?P<args>.*?)\n?```\s*$", re.S)


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's answer carries tool calls: ``kind`` is ``named`` (``name`` set), ``required`` or
    ``auto`` (DeepSeek-V3 syntax, ``begin_token`` the id of its first marker)."""

    kind: str
    name: str | None = None
    begin_token: int | None = None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"``: an array of calls, each naming a tool and matching its
    parameters."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t["name"]},
                             "parameters": t.get("parameters") or {"type": "object"}}} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def calls_of_output(mode: ToolMode, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a finished constrained (``named`` / ``required``) output; a truncated output
    that is not valid JSON stays content."""
    if mode.kind == "named":
        assert mode.name is not None
        return None, [tool_call(mode.name, text)]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return text, []
    return None, [tool_call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]


def parse_deepseek(raw: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a DeepSeek-V3 answer decoded with its special tokens (see the module
    docstring). Calls whose arguments are not a JSON object are dropped; text without calls is all content."""
    head, found, rest = raw.partition(CALLS_BEGIN)
    if not found:
        return raw, []
    calls = []
    for chunk in rest.split(CALL_BEGIN)[1:]:
        body = chunk.split(CALL_END)[0]
        left, sep, right = body.partition(SEP)
        if not sep:
            continue
        fenced = _FENCED.match(right)
        name, args = (fenced["name"], fenced["args"]) if fenced else (left, right)
        try:
            value = json.loads(args)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and name.strip():
            calls.append(tool_call(name.strip(), json.dumps(value, ensure_ascii=False)))
    return (head or None) if calls else raw, calls


def deepseek_begin_token(tokenizer: Any) -> int | None:
    """The id of DeepSeek-V3's tool-calls marker when the tokenizer has every marker as one token and its chat
    template renders ``tools``; None otherwise (``tool_choice: "auto"`` is then refused)."""
    template = getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not isinstance(template, str) or "tools" not in template:
        return None
    vocab = tokenizer.get_vocab()
    if not all(m in vocab for m in DEEPSEEK_MARKERS):
        return None
    return int(vocab[CALLS_BEGIN])
