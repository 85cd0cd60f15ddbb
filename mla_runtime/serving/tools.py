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

An output cut short (by ``max_tokens`` or a stop string) is answered as OpenAI answers it: with whatever was
produced. Its calls are those whose name was written; the last one's ``arguments`` is the JSON text written so far
(it does not parse). Constrained JSON is never returned as content; the text before an ``auto`` answer's
tool-call marker is.
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


_ITEM_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]+)"')
_ITEM_ARGS = re.compile(r'\s*,\s*"parameters"\s*:\s*')
_ITEM_END = re.compile(r"\s*\}\s*,?")
_FENCE_TAIL = re.compile(r"\n?`{1,3}$")  # a closing fence cut short (JSON never ends with a backtick)


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


def parse_deepseek(raw: str, cut: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a DeepSeek-V3 answer decoded with its special tokens (see the module
    docstring). Calls whose arguments are not a JSON object are dropped; text without calls is all content.
    ``cut``: the output was cut short; its content is the text before the markers, and a last call whose name
    was written is kept with the arguments written so far."""
    head, found, rest = raw.partition(CALLS_BEGIN)
    if not found:
        return raw, []
    calls = []
    chunks = rest.split(CALL_BEGIN)[1:]
    for i, chunk in enumerate(chunks):
        body, ended, _ = chunk.partition(CALL_END)
        left, sep, right = body.partition(SEP)
        if not sep:
            continue
        if cut and not ended and i == len(chunks) - 1:
            partial = _partial_deepseek(left, right)
            if partial is not None:
                calls.append(tool_call(*partial))
            continue
        fenced = _FENCED.match(right)
        name, args = (fenced["name"], fenced["args"]) if fenced else (left, right)
        try:
            value = json.loads(args)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and name.strip():
            calls.append(tool_call(name.strip(), json.dumps(value, ensure_ascii=False)))
    if cut:
        return head or None, calls
    return (head or None) if calls else raw, calls


def _partial_deepseek(left: str, right: str) -> tuple[str, str] | None:
    r"""``(name, arguments so far)`` of a cut call: V3's ``function<sep>NAME\n```json\n{...`` (None until its
    name's line ends) or V3.1's ``NAME<sep>{...``."""
    if left.strip() == "function":
        name, newline, after = right.partition("\n")
        if not newline or not name.strip():
            return None
        args = after.partition("\n")[2] if after.startswith("`") else after  # past the opening fence
        return name.strip(), _FENCE_TAIL.sub("", args)
    return (left.strip(), right) if left.strip() else None


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
