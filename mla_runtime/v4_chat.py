"""DeepSeek-V4's chat format, built in: its checkpoints ship the prompt format as a Python encoder
(``encoding/encoding_dsv4.py``), not as a chat template, so a ``deepseek_v4`` checkpoint whose tokenizer has no
``chat_template`` has its chats rendered here (by ``mla_runtime.tokenizer.apply_chat_template``).

The prompt, as DeepSeek-V4's encoder writes it:

- ``<｜begin▁of▁sentence｜>`` first; in thinking mode with ``reasoning_effort: "max"``, the format's effort
  instruction (``EFFORT_MAX``) right after it.
- A ``system`` message is its text, with no role token; the tools (``TOOLS_INTRO``, then each tool's ``function``
  object as one line of JSON) follow it after a blank line, then a ``response_format`` section. The request's tools
  go on a leading system message (an empty one is put first where the chat has none).
- A ``user`` message is ``<｜User｜>`` and its text. V4 has no tool role: a run of ``tool`` and ``user`` messages is
  one user turn, whose parts (each result as ``<tool_result>TEXT</tool_result>``, each user text as it is) are
  joined by blank lines, the results in the order of the calls they answer (their ``tool_call_id``). A
  ``developer`` message is written as a user turn that may carry the tools.
- After a user turn that an assistant turn follows (or that ends the chat), ``<｜Assistant｜>`` and ``<think>``
  (thinking: the model's output begins inside its thinking) or ``</think>`` (non-thinking, or a turn whose
  thinking was dropped).
- An ``assistant`` message is, in thinking mode, its ``reasoning_content`` and ``</think>`` (left out for the turns
  before the last user turn, whose thinking is dropped), then its content, then its calls, then
  ``<｜end▁of▁sentence｜>``. The calls are a DSML block after a blank line: ``<｜DSML｜tool_calls>``, one
  ``<｜DSML｜invoke name="NAME">`` element a line, each holding one ``<｜DSML｜parameter name="P" string="true">``
  element a line (``string="false"`` and JSON for a value that is not a string), ``</｜DSML｜tool_calls>`` last.

Thinking is on by default; ``chat_template_kwargs`` sets the rest (``OPTIONS``): ``thinking`` (or
``enable_thinking``) false for the non-thinking mode; ``reasoning_effort`` ``"high"`` (the default: nothing is
written), ``"max"`` or ``"none"`` (the non-thinking mode); ``drop_thinking`` false to keep earlier turns' thinking
(it is always kept where the request has tools, as the encoder keeps it); ``response_format``: a schema (any JSON
value) the answer must follow, shown to the model after the system text. A chat request's own ``reasoning_effort``
(OpenAI's levels) sets the format's where ``chat_template_kwargs`` does not (``request_effort``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mla_runtime.errors import InvalidParam

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
CALLS, CALLS_END = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
INVOKE_END, PARAM_END = f"</{DSML}invoke>", f"</{DSML}parameter>"
RESULT, RESULT_END = "<tool_result>", "</tool_result>"

OPTIONS = ("thinking", "enable_thinking", "reasoning_effort", "drop_thinking", "response_format")
EFFORTS = ("high", "max", "none")

# the format's own instructions, as the model was trained to read them
EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
TOOLS_INTRO = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
    f"writing a \"{CALLS}\" block like the following:\n\n{CALLS}\n<{DSML}invoke name=\"$TOOL_NAME\">\n"
    f"<{DSML}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE{PARAM_END}\n...\n"
    f"{INVOKE_END}\n<{DSML}invoke name=\"$TOOL_NAME2\">\n...\n{INVOKE_END}\n{CALLS_END}\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, "
    "arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    f"If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside "
    f"{THINK}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n")
TOOLS_OUTRO = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
FORMAT_INTRO = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


@dataclass(frozen=True)
class V4Options:
    """How a chat is rendered (module docstring): ``thinking`` mode, the maximum effort's instruction, whether the
    thinking of turns before the last user turn is dropped, and the answer's ``response_format``."""

    thinking: bool = True
    max_effort: bool = False
    drop_thinking: bool = True
    response_format: Any = None


def _flag(kwargs: dict[str, Any], key: str, default: bool) -> bool:
    value = kwargs.get(key, default)
    if not isinstance(value, bool):
        raise InvalidParam("chat_template_kwargs", f"{key} must be true or false, got {value!r}")
    return value


def options(kwargs: dict[str, Any]) -> V4Options:
    """The rendering options ``chat_template_kwargs`` sets; an unknown key or a bad value is an ``InvalidParam``
    naming it."""
    unknown = sorted(set(kwargs) - set(OPTIONS))
    if unknown:
        raise InvalidParam("chat_template_kwargs", f"{unknown[0]!r} is not a variable of DeepSeek-V4's chat format "
                                                   f"(it takes {', '.join(OPTIONS)})")
    thinking = _flag(kwargs, "thinking", _flag(kwargs, "enable_thinking", True))
    effort = kwargs.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise InvalidParam("chat_template_kwargs", f"reasoning_effort must be one of {', '.join(EFFORTS)} "
                                                   f"(DeepSeek-V4's levels), got {effort!r}")
    return V4Options(thinking=thinking and effort != "none", max_effort=effort == "max",
                     drop_thinking=_flag(kwargs, "drop_thinking", True),
                     response_format=kwargs.get("response_format"))


# OpenAI's reasoning_effort levels, as the format's: no thinking, or thinking at the default or maximum effort
REQUEST_EFFORTS = {"none": "none", "minimal": "high", "low": "high", "medium": "high", "high": "high",
                   "xhigh": "high", "max": "max"}


def request_effort(value: str) -> str:
    """The format's ``reasoning_effort`` for a chat request's own ``reasoning_effort`` (OpenAI's levels, and ``max``):
    V4 thinks at one default effort or at the maximum; an unknown level is an ``InvalidParam``."""
    if value not in REQUEST_EFFORTS:
        raise InvalidParam("reasoning_effort", f"must be one of {', '.join(REQUEST_EFFORTS)}, got {value!r}")
    return REQUEST_EFFORTS[value]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _arguments(call: Any, where: str) -> tuple[str, dict[str, Any]]:
    """An earlier call's name and arguments; arguments that are no JSON object are kept whole as one string value
    (a call cut short), as the encoder keeps them."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidParam(where, "a tool call needs function.name")
    args = function.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else {"arguments": args}
    if not isinstance(args, dict):
        raise InvalidParam(where, "a tool call's function.arguments must be a JSON object")
    return function["name"], args


def calls_block(calls: list[Any], where: str = "tool_calls") -> str:
    """An assistant turn's calls as DSML (module docstring), with the blank line before the block."""
    invokes = []
    for call in calls:
        name, args = _arguments(call, where)
        params = "\n".join(f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                           f'{v if isinstance(v, str) else _json(v)}{PARAM_END}' for k, v in args.items())
        invokes.append(f'<{DSML}invoke name="{name}">\n{params}\n{INVOKE_END}')
    return f"\n\n{CALLS}\n" + "\n".join(invokes) + f"\n{CALLS_END}"


def tools_section(tools: list[dict[str, Any]]) -> str:
    """The tools as the system text shows them: the instructions, then each tool's ``function`` object a line."""
    return TOOLS_INTRO + "\n".join(_json(t.get("function", t)) for t in tools) + TOOLS_OUTRO


def _user_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each run of ``user`` and ``tool`` messages made one user turn of ``parts``: ``(call id,
    text)`` for a tool's result, ``(None, text)`` for a user's text."""
    turns: list[dict[str, Any]] = []
    for k, m in enumerate(messages):
        if m["role"] not in ("user", "tool"):
            turns.append({**m, "index": k})
            continue
        part = (m.get("tool_call_id") or "", m.get("content") or "") if m["role"] == "tool" else \
            (None, m.get("content") or "")
        if turns and turns[-1]["role"] == "user":
            turns[-1]["parts"].append(part)
        else:
            turns.append({"role": "user", "parts": [part], "index": k})
    return turns


def _order_results(turns: list[dict[str, Any]]) -> None:
    """Each user turn's tool results in the order of the last calls made before it (by ``tool_call_id``; a result
    naming no call made is ordered as the first call's, as the encoder orders it), in the places the results take
    among its parts."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn["role"] == "assistant" and turn.get("tool_calls"):
            order = {c["id"]: k for k, c in enumerate(turn["tool_calls"]) if isinstance(c, dict) and c.get("id")}
        elif turn["role"] == "user" and order:
            results = iter(sorted((p for p in turn["parts"] if p[0] is not None), key=lambda p: order.get(p[0], 0)))
            turn["parts"] = [next(results) if p[0] is not None else p for p in turn["parts"]]


def _last_user(turns: list[dict[str, Any]]) -> int:
    return max((i for i, t in enumerate(turns) if t["role"] in ("user", "developer")), default=-1)


def _dropped(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns with the thinking of assistant turns before the last user turn left out, and the developer turns
    before it too (as the encoder drops them)."""
    last = _last_user(turns)
    kept = []
    for i, t in enumerate(turns):
        if i < last and t["role"] == "developer":
            continue
        kept.append({**t, "reasoning_content": None} if i < last and t["role"] == "assistant" else t)
    return kept


def _instructions(turn: dict[str, Any]) -> str:
    """The tools and response format a system (or developer) turn carries, each after a blank line."""
    text = "\n\n" + tools_section(turn["tools"]) if turn.get("tools") else ""
    if turn.get("response_format") is not None:
        text += "\n\n" + FORMAT_INTRO + _json(turn["response_format"])
    return text


def _turn(turn: dict[str, Any], opts: V4Options, keep_thinking: bool) -> str:
    """One turn's text, without what follows it."""
    role, i = turn["role"], turn.get("index", 0)
    if role == "system":
        return (turn.get("content") or "") + _instructions(turn)
    if role == "developer":
        if not turn.get("content"):
            raise InvalidParam(f"messages.{i}.content", "a developer message must not be empty")
        return USER + turn["content"] + _instructions(turn)
    if role == "user":
        return USER + "\n\n".join(text if call is None else f"{RESULT}{text}{RESULT_END}"
                                  for call, text in turn["parts"])
    thinking = (turn.get("reasoning_content") or "") + THINK_END if opts.thinking and keep_thinking else ""
    calls = calls_block(turn["tool_calls"], f"messages.{i}.tool_calls") if turn.get("tool_calls") else ""
    return thinking + (turn.get("content") or "") + calls + EOS


def _prepared(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              response_format: Any) -> list[dict[str, Any]]:
    """The chat as turns: the tools and response format on a leading system turn, tool results in user turns."""
    turns = _user_turns(messages)
    _order_results(turns)
    if tools or response_format is not None:
        if not turns or turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": ""})
        turns[0] = {**turns[0], "tools": tools or None, "response_format": response_format}
    return turns


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
           kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of a chat (OpenAI's messages: ``role``, ``content`` as text, an assistant's ``tool_calls``
    and ``reasoning_content``, a tool's ``tool_call_id``) with ``tools`` (OpenAI's tool definitions) and
    ``chat_template_kwargs`` (``OPTIONS``), ready for the model's generation (module docstring)."""
    opts = options(kwargs or {})
    turns = _prepared(messages, tools, opts.response_format)
    drop = opts.drop_thinking and not tools
    if opts.thinking and drop:
        turns = _dropped(turns)
    last = _last_user(turns)
    text = BOS + (EFFORT_MAX if opts.thinking and opts.max_effort else "")
    for i, turn in enumerate(turns):
        text += _turn(turn, opts, not drop or i > last)
        follows = turns[i + 1]["role"] if i + 1 < len(turns) else "assistant"
        if turn["role"] in ("user", "developer") and follows == "assistant":
            text += ASSISTANT + (THINK if opts.thinking and (not drop or i >= last) else THINK_END)
    return text
