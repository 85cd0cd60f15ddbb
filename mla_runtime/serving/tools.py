"""Tool calls on ``/v1/chat/completions``: OpenAI's ``tools`` and ``tool_choice``.

- ``tool_choice: {"type": "function", "function": {"name": N}}`` constrains the output to a JSON value of tool
  N's ``parameters`` schema; it is returned as one call of N with that value as its ``arguments``.
- ``tool_choice: "required"`` constrains the output to a JSON array of ``{"name": ..., "parameters": {...}}``
  objects, each naming one of the tools and matching its schema (one item with ``parallel_tool_calls: false``);
  each item becomes one call.
- ``tool_choice: "auto"`` (OpenAI's default when tools are given) leaves the output free and parses the
  model's own tool-call syntax out of it (``tool_parsers.py``: the syntax is chosen from the model, or set by
  ``--tool-call-parser``). It needs a chat template that shows the model the tools; elsewhere (or with
  ``--tool-call-parser none``) it is refused with 400 naming ``tool_choice``.

An output cut short (by ``max_tokens`` or a stop string) is answered as OpenAI answers it: with whatever was
produced. Its calls are those whose name was written; the last one's ``arguments`` is the JSON text written so far
(it does not parse). Constrained JSON is never returned as content; the text before an ``auto`` answer's first
tool call is.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's answer carries tool calls: ``kind`` is ``named`` (``name`` set), ``required`` or
    ``auto`` (``syntax``: the model's tool-call syntax, ``tool_parsers.py``; ``strings``: the ``(tool, parameter)``
    pairs whose schema type is string)."""

    kind: str
    name: str | None = None
    syntax: str | None = None
    strings: frozenset[tuple[str, str]] = frozenset()


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


_ITEM_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]+)"')
_ITEM_ARGS = re.compile(r'\s*,\s*"parameters"\s*:\s*')
_ITEM_END = re.compile(r"\s*\}\s*,?")


def calls_of_output(mode: ToolMode, text: str) -> tuple[list[dict[str, Any]], bool]:
    """``(tool_calls, complete)`` of a finished constrained (``named`` / ``required``) output; ``complete`` is
    False when the output was cut short (then the last call's arguments do not parse, see the module docstring)."""
    if mode.kind == "named":
        assert mode.name is not None
        return [tool_call(mode.name, text)], _parses(text)
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return _partial_calls(text), False
    return [tool_call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items], True


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _partial_calls(text: str) -> list[dict[str, Any]]:
    """The calls of a cut ``required`` array (``[{"name": N, "parameters": {...}}, ...``): each item whose name
    was written, the last one with the arguments' text so far. The grammar writes ``name`` before ``parameters``,
    in the schema's order."""
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    pos = text.find("[") + 1
    while pos > 0 and (name := _ITEM_NAME.match(text, pos)) is not None:
        start = _ITEM_ARGS.match(text, name.end())
        if start is None:  # cut before the arguments
            calls.append(tool_call(name[1], ""))
            break
        try:
            args, end = decoder.raw_decode(text, start.end())
        except json.JSONDecodeError:
            calls.append(tool_call(name[1], text[start.end():]))
            break
        calls.append(tool_call(name[1], json.dumps(args, ensure_ascii=False)))
        tail = _ITEM_END.match(text, end)
        pos = tail.end() if tail is not None else 0
    return calls


def renders_tools(chat_template: Any) -> bool:
    """Whether a chat template shows the model the tools (it reads ``tools``): ``tool_choice: "auto"`` needs it."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    return any(isinstance(t, str) and "tools" in t for t in templates)


def string_parameters(tools: list[dict[str, Any]]) -> frozenset[tuple[str, str]]:
    """The ``(tool, parameter)`` pairs whose JSON schema type is ``string`` (a syntax that writes values as bare text
    keeps those as text); ``tools`` as the request gives them (``{"type": "function", "function": {...}}``)."""
    functions = [t.get("function", t) for t in tools]
    return frozenset((f["name"], key) for f in functions
                     for key, schema in ((f.get("parameters") or {}).get("properties") or {}).items()
                     if isinstance(schema, dict) and schema.get("type") == "string")
