"""The models' own tool-call syntaxes (``tool_choice: "auto"``): one parser per syntax, chosen from the model.

Each parser reads the answer's text, decoded with the tool-call markers kept (``JobBuilder.raw_text``), into
``Parsed``: the content (the text before the first call) and the calls so far. ``parse(text, end)`` is written so
that it can be called on every prefix of an output while it streams: the content, each call's name and each call's
``arguments`` only ever grow (text that may be the start of a marker, or a value not yet closed, is held back), so
the stream's deltas always add up to the parse of the whole output. ``end``: the output ended by itself (a stop
token or string), which closes a call whose syntax has no end marker (Mistral's); an output cut by ``max_tokens``
is parsed as a prefix, its last call incomplete.

Streamed, the answer is not parsed again from its start with each piece: ``ToolStream.feed`` hands the parser the
content that may still start a marker, or, once the calls began, the text from the first call that may still change
(``scan`` returns where that is: after the last complete call), so that each complete call is read once.

``arguments`` is the JSON text the model wrote (for the syntaxes that write JSON) or the JSON object built from the
named parameters it wrote (DSML, GLM); it is not checked against the tool's schema, as OpenAI's is not. Text after
the first call's marker is never content.

The syntaxes (``TOOL_CALL_PARSERS``), as the families' published chat templates and encoders write them:

- ``deepseek_v3`` (DeepSeek-V3, V2.5): a block between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``;
  each call is ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``, a newline, the arguments in a fenced
  ```` ```json ```` block, then ``<｜tool▁call▁end｜>``.
- ``deepseek_v31`` (DeepSeek-V3.1): the same block, each call ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
  <｜tool▁call▁end｜>`` with the JSON arguments written bare.
- ``deepseek_v32`` (DeepSeek-V3.2's DSML; the ``｜`` are full-width bars): a ``<｜DSML｜function_calls>`` element
  holding one ``<｜DSML｜invoke name="NAME">`` element per call, each holding one
  ``<｜DSML｜parameter name="P" string="true|false">VALUE</｜DSML｜parameter>`` per argument; ``string="true"``
  marks a value written as plain text, ``false`` one written as JSON.
- ``deepseek_v4`` (DeepSeek-V4): V3.2's DSML elements in a ``<｜DSML｜tool_calls>`` block; the blank line the
  format writes before the block is not content.
- ``kimi_k2`` (Kimi-K2): ``<|tool_calls_section_begin|>``, then per call ``<|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>ARGS<|tool_call_end|>``, then ``<|tool_calls_section_end|>``; the call's id is
  ``functions.NAME:IDX`` (IDX counts the conversation's calls), and it is returned as the call's ``id``.
- ``glm45`` (GLM-4.5, 4.6, 4.7, 5): per call ``<tool_call>NAME`` then ``<arg_key>K</arg_key><arg_value>V
  </arg_value>`` pairs (GLM-4.5 puts newlines between them) and ``</tool_call>``; the templates write a string
  value as it is and any other value as JSON, so a value is JSON-decoded where it parses, except for a parameter
  the tool's schema types as ``string``, which stays text.
- ``mistral`` (Mistral's tokenizers): ``[TOOL_CALLS]NAME[ARGS]{...}`` per call (newer templates; an optional
  ``[CALL_ID]ID`` before ``[ARGS]`` gives the call's id), or ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
  (older ones). The newer layout has no end marker: a call ends at the next ``[TOOL_CALLS]`` or at the end of the
  output. Ids are nine letters and digits, the form Mistral's templates require of earlier calls.
- ``minicpm3`` (MiniCPM3): ``<|tool_call_start|>``, a fenced ```` ```python ```` block of Python calls
  ``NAME(KEY=VALUE, ...)``, one a line, then ``<|tool_call_end|>``; the template writes each value as JSON, and a
  value written as a Python literal (``'text'``, ``True``, ``None``) is read too (positional arguments, which have no
  name, are left out). The ``<|thought_start|>`` … ``<|thought_end|>`` explanation the template asks for before the
  calls is content, without its markers. A call's arguments grow an argument at a time: each once the comma or
  parenthesis after it is written.
- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` per call, ``name`` written first; the
  fallback for families whose syntax is not one of the above. ``longcat`` (LongCat-Flash) is the same with
  ``<longcat_tool_call>`` tags, or, as LongCat's later models write it, GLM's layout with ``longcat_`` before every
  tag name (``<longcat_tool_call>NAME<longcat_arg_key>K</longcat_arg_key><longcat_arg_value>V
  </longcat_arg_value></longcat_tool_call>``).
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("auto", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4", "kimi_k2", "glm45",
                     "mistral", "minicpm3", "hermes", "longcat", "none")
# model types whose chat template may not say which syntax they write; any other falls back to hermes
MODEL_TYPE_PARSERS = {"deepseek_v2": "deepseek_v3", "deepseek_v3": "deepseek_v3", "deepseek_v32": "deepseek_v32",
                      "deepseek_v4": "deepseek_v4",
                      "kimi_k2": "kimi_k2", "kimi_k25": "kimi_k2", "glm4_moe_lite": "glm45", "glm_moe_dsa": "glm45",
                      "mistral4": "mistral", "mistral_large4": "mistral", "mistral_large4_text": "mistral",
                      "longcat_flash": "longcat", "minicpm3": "minicpm3"}
FALLBACK = "hermes"

DS_CALLS, DS_CALL, DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
DS_CALL_END, DS_CALLS_END = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"
DSML_TAG = "｜DSML｜"
DSML_V4_CALLS = f"<{DSML_TAG}tool_calls>"
KIMI_SECTION, KIMI_CALL = "<|tool_calls_section_begin|>", "<|tool_call_begin|>"
KIMI_ARGS, KIMI_CALL_END = "<|tool_call_argument_begin|>", "<|tool_call_end|>"
KIMI_SECTION_END = "<|tool_calls_section_end|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
CPM_CALLS, CPM_CALLS_END = "<|tool_call_start|>", "<|tool_call_end|>"
CPM_THOUGHT, CPM_THOUGHT_END = "<|thought_start|>", "<|thought_end|>"


@dataclass(frozen=True)
class Call:
    """A call as written so far: ``arguments`` grows until ``complete``; ``id``: the syntax's own id, if any."""

    name: str
    arguments: str
    complete: bool
    id: str | None = None


@dataclass(frozen=True)
class Parsed:
    """An answer's ``content`` (the text before the calls), its ``calls``, and whether a call marker was seen."""

    content: str
    calls: list[Call] = field(default_factory=list)
    started: bool = False


@dataclass(frozen=True)
class Scan:
    """The calls read from a position on; the first ``kept`` are complete and end before ``resume``, where a later
    read of a longer text may start again (the calls before it cannot change, and no call starts between them and
    it); ``closed``: the calls' block ended, and no later text is read."""

    calls: list[Call]
    resume: int
    kept: int
    closed: bool = False


def held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def open_args(text: str, closer: str) -> str:
    """The arguments of a call still being written: the text without a possible start of ``closer`` at its end and
    without surrounding white space (trailing space may yet be inside the value)."""
    return text[:len(text) - held(text, closer)].strip()


def json_value(text: str, start: int) -> int | None:
    """The end of the JSON value at ``start`` once it is surely whole (a number may still grow): None until then."""
    try:
        value, end = json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        return None
    return end if isinstance(value, (dict, list, str)) or end < len(text) else None


def json_object(pairs: list[tuple[str, str]], closed: bool) -> str:
    """The JSON object text of ``(key, JSON value text)`` pairs; without its ``}`` while more may come."""
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in pairs)
    return "{" + body + ("}" if closed else "")


def as_json(value: str) -> str:
    """A value written as JSON, re-encoded; as a string where it does not parse."""
    try:
        return json.dumps(json.loads(value), ensure_ascii=False)
    except json.JSONDecodeError:
        return json.dumps(value, ensure_ascii=False)


class ToolParser:
    """One syntax: ``begin`` opens the calls, ``markers`` are the texts the raw decoding must keep."""

    name = ""
    begin = ""
    markers: tuple[str, ...] = ()

    def __init__(self, strings: frozenset[tuple[str, str]] = frozenset()) -> None:
        self.strings = strings  # (tool, parameter) pairs the tools' schemas type as string

    def parse(self, text: str, end: bool) -> Parsed:
        i = text.find(self.begin)
        if i < 0:
            return Parsed(self.content_of(text, end)[0])
        return Parsed(self.before_calls(text[:i]), self.scan(text, i, end).calls, True)

    def before_calls(self, head: str) -> str:
        """The content of ``head``, the whole text before the calls' opening marker."""
        return self.content_of(head, True)[0]

    def content_of(self, head: str, end: bool) -> tuple[str, int]:
        """The content of ``head`` (text with no call marker), and how many of its characters that settles: all at the
        end, else all but what may start a marker."""
        used = len(head) if end else len(head) - held(head, self.begin)
        return head[:used], used

    def scan(self, text: str, pos: int, end: bool) -> Scan:
        """The calls from ``pos``: the opening marker's position, or a ``Scan.resume`` of a shorter text."""
        raise NotImplementedError

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


class Delimited(ToolParser):
    """Calls between ``call_begin`` and ``closer``: a header (the name) up to ``opener``, then the arguments."""

    def __init__(self, name: str, begin: str, call_begin: str, opener: str, closer: str, markers: tuple[str, ...],
                 header: Callable[[str], tuple[str, str | None] | None],
                 strings: frozenset[tuple[str, str]] = frozenset()) -> None:
        super().__init__(strings)
        self.name, self.begin, self.call_begin, self.opener, self.closer = name, begin, call_begin, opener, closer
        self.markers, self.header = markers, header

    def scan(self, text: str, pos: int, end: bool) -> Scan:
        found: list[Call] = []
        resume = pos
        while (j := text.find(self.call_begin, pos)) >= 0:
            k = text.find(self.opener, j + len(self.call_begin))
            head = self.header(text[j + len(self.call_begin):k]) if k >= 0 else None
            if head is None:  # a header not written yet, or one that is no call's: no call is read after it
                return Scan(found, resume, len(found), k >= 0)
            a = k + len(self.opener)
            e = text.find(self.closer, a)
            if e < 0:
                found.append(Call(head[0], open_args(text[a:], self.closer), False, head[1]))
                break
            found.append(Call(head[0], text[a:e].strip(), True, head[1]))
            pos = resume = e + len(self.closer)
        else:
            resume = max(resume, len(text) - held(text, self.call_begin))
        return Scan(found, resume, len(found) - (bool(found) and not found[-1].complete))


def _v3_header(head: str) -> tuple[str, str | None] | None:
    kind, sep, name = head.partition(DS_SEP)
    return (name.strip(), None) if sep and kind.strip() == "function" and name.strip() else None


def _plain_header(head: str) -> tuple[str, str | None] | None:
    return (head.strip(), None) if head.strip() else None


def _kimi_header(head: str) -> tuple[str, str | None] | None:
    """``functions.NAME:IDX`` → NAME, with the whole header as the call's id."""
    ident = head.strip()
    name = ident.removeprefix("functions.")
    base, colon, index = name.rpartition(":")
    if colon and index.isdigit():
        name = base
    return (name, ident) if name else None


_DS_MARKERS = (DS_CALLS, DS_CALL, DS_SEP, DS_CALL_END, DS_CALLS_END)
_KIMI_MARKERS = (KIMI_SECTION, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END, KIMI_SECTION_END)


class Dsml(ToolParser):
    """DeepSeek-V3.2's DSML elements (module docstring)."""

    name = "deepseek_v32"
    begin = f"<{DSML_TAG}function_calls>"
    markers = (begin,)
    INVOKE = re.compile(f'<{DSML_TAG}invoke\\s+name="([^"]*)"\\s*>')
    PARAM = re.compile(f'\\s*<{DSML_TAG}parameter\\s+name="([^"]*)"\\s+string="(true|false)"\\s*>'
                       f'(.*?)</{DSML_TAG}parameter>', re.S)
    INVOKE_START, INVOKE_END = f"<{DSML_TAG}invoke", f"</{DSML_TAG}invoke>"

    def scan(self, text: str, pos: int, end: bool) -> Scan:
        found: list[Call] = []
        resume = pos
        while (m := self.INVOKE.search(text, pos)) is not None:
            close = text.find(self.INVOKE_END, m.end())
            body = text[m.end():close] if close >= 0 else text[m.end():]
            pairs, q = [], 0
            while (p := self.PARAM.match(body, q)) is not None:
                value = json.dumps(p[3], ensure_ascii=False) if p[2] == "true" else as_json(p[3])
                pairs.append((p[1], value))
                q = p.end()
            found.append(Call(m[1], json_object(pairs, close >= 0), close >= 0))
            if close < 0:
                break
            pos = resume = close + len(self.INVOKE_END)
        else:
            start = text.find(self.INVOKE_START, pos)
            resume = start if start >= 0 else max(resume, len(text) - held(text, self.INVOKE_START))
        return Scan(found, resume, len(found) - (bool(found) and not found[-1].complete))


class DsmlV4(Dsml):
    """DeepSeek-V4's DSML: V3.2's elements in a ``<｜DSML｜tool_calls>`` block, after a blank line that is not
    content (module docstring)."""

    name = "deepseek_v4"
    begin = DSML_V4_CALLS
    markers = (begin,)
    LEAD = "\n\n"

    def content_of(self, head: str, end: bool) -> tuple[str, int]:
        """As ``ToolParser.content_of``, also holding back a blank line that may be the one before the block."""
        used = len(head) if end else len(head) - held(head, self.LEAD + self.begin)
        return head[:used], used

    def before_calls(self, head: str) -> str:
        return head.removesuffix(self.LEAD)


class GLM(ToolParser):
    """GLM-4.5 to 5's ``<tool_call>NAME<arg_key>…`` (module docstring); ``prefix`` starts every tag's name
    (``longcat_`` for LongCat's)."""

    NAME = re.compile(r"\s*([^\s<]+)(?=[\s<])")

    def __init__(self, strings: frozenset[tuple[str, str]] = frozenset(), prefix: str = "") -> None:
        super().__init__(strings)
        self.name, self.begin, self.end = "glm45", f"<{prefix}tool_call>", f"</{prefix}tool_call>"
        key, value = f"{prefix}arg_key", f"{prefix}arg_value"
        self.markers = (self.begin, self.end, f"<{key}>", f"</{key}>", f"<{value}>", f"</{value}>")
        self.pair = re.compile(f"\\s*<{key}>(.*?)</{key}>\\s*<{value}>(.*?)</{value}>", re.S)

    def scan(self, text: str, pos: int, end: bool) -> Scan:
        found: list[Call] = []
        resume = pos
        while (j := text.find(self.begin, pos)) >= 0:
            m = self.NAME.match(text, j + len(self.begin))
            if m is None:
                break
            close = text.find(self.end, m.end())
            body = text[m.end():close] if close >= 0 else text[m.end():]
            pairs, q = [], 0
            while (p := self.pair.match(body, q)) is not None:
                key = p[1].strip()
                value = json.dumps(p[2], ensure_ascii=False) if (m[1], key) in self.strings else as_json(p[2])
                pairs.append((key, value))
                q = p.end()
            found.append(Call(m[1], json_object(pairs, close >= 0), close >= 0))
            if close < 0:
                break
            pos = resume = close + len(self.end)
        else:
            resume = max(resume, len(text) - held(text, self.begin))
        return Scan(found, resume, len(found) - (bool(found) and not found[-1].complete))


class Longcat(ToolParser):
    """LongCat's ``<longcat_tool_call>`` elements, holding JSON (Hermes' layout) or GLM's key and value tags (module
    docstring); the first call's first character decides."""

    name = "longcat"
    begin = "<longcat_tool_call>"

    def __init__(self, strings: frozenset[tuple[str, str]] = frozenset()) -> None:
        super().__init__(strings)
        self.json, self.tags = Hermes("longcat", "longcat_tool_call", strings), GLM(strings, "longcat_")
        self.markers = self.tags.markers

    FIRST = re.compile(r"\s*(\S)")

    def scan(self, text: str, pos: int, end: bool) -> Scan:
        j = text.find(self.begin, pos)
        first = self.FIRST.match(text, j + len(self.begin)) if j >= 0 else None
        if first is None:
            return Scan([], pos if j >= 0 else max(pos, len(text) - held(text, self.begin)), 0)
        return (self.json if first[1] == "{" else self.tags).scan(text, pos, end)


_NAME_THEN_ARGS = r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'


class Hermes(ToolParser):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (module docstring); ``tag`` names the element."""

    HEAD = re.compile(_NAME_THEN_ARGS)

    def __init__(self, name: str = "hermes", tag: str = "tool_call",
                 strings: frozenset[tuple[str, str]] = frozenset()) -> None:
        super().__init__(strings)
        self.name, self.begin, self.end = name, f"<{tag}>", f"</{tag}>"
        self.markers = (self.begin, self.end)

    def scan(self, text: str, pos: int, end: bool) -> Scan:
        found: list[Call] = []
        resume, kept = pos, 0
        while (j := text.find(self.begin, pos)) >= 0:
            b = j + len(self.begin)
            close = text.find(self.end, b)
            body = text[b:close] if close >= 0 else text[b:]
            h = self.HEAD.match(body)
            if h is None:  # not name-first: a whole element may still be read once closed
                call = _whole_object(body) if close >= 0 else None
                if call is None:  # not closed yet, or no call's: no call is read after it
                    return Scan(found, resume, kept, close >= 0)
                found.append(call)
            else:
                stop = json_value(body, h.end())
                if stop is None:
                    found.append(Call(json.loads(f'"{h[1]}"'), body[h.end():].strip(), False))
                    break
                found.append(Call(json.loads(f'"{h[1]}"'), body[h.end():stop], close >= 0 or end))
            if close < 0:
                break
            pos = resume = close + len(self.end)
            kept = len(found)
        else:
            resume = max(resume, len(text) - held(text, self.begin))
        return Scan(found, resume, kept)


def _whole_object(text: str) -> Call | None:
    try:
        item = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    args = item.get("arguments", item.get("parameters", {}))
    return Call(item["name"], json.dumps(args, ensure_ascii=False), True)


class Mistral(ToolParser):
    """Mistral's ``[TOOL_CALLS]`` layouts (module docstring)."""

    name = "mistral"
    begin = MISTRAL_CALLS
    markers = (MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_ID)
    ITEM = re.compile(r"\s*[\[,]?" + _NAME_THEN_ARGS)
    ITEM_END = re.compile(r'\s*(?:,\s*"id"\s*:\s*"[^"]*"\s*)?\}')

    ARRAY = re.compile(r"\s*[\[,{\]]")  # a list's opening, or a resumed read inside it
    ARRAY_END = re.compile(r"\s*\]")

    def scan(self, text: str, pos: int, end: bool) -> Scan:
        k = pos + len(MISTRAL_CALLS) if text.startswith(MISTRAL_CALLS, pos) else pos
        if self.ARRAY.match(text, k):
            return self._array(text, k)
        found: list[Call] = []
        resume = pos
        while text.startswith(MISTRAL_CALLS, pos):
            a = pos + len(MISTRAL_CALLS)
            after = text.find(MISTRAL_CALLS, a)
            head, found_args, args = (text[a:after] if after >= 0 else text[a:]).partition(MISTRAL_ARGS)
            name, _, ident = head.partition(MISTRAL_ID)
            if not found_args or not name.strip():
                break
            whole = after >= 0 or end
            found.append(Call(name.strip(), args.strip() if whole else open_args(args, MISTRAL_CALLS), whole,
                              ident.strip() or None))
            if after < 0:
                break
            pos = resume = after
        return Scan(found, resume, len(found) - (bool(found) and not found[-1].complete))

    def _array(self, text: str, pos: int) -> Scan:
        found: list[Call] = []
        resume, kept = pos, 0
        while (m := self.ITEM.match(text, pos)) is not None:
            name = json.loads(f'"{m[1]}"')
            stop = json_value(text, m.end())
            if stop is None:
                found.append(Call(name, text[m.end():].strip(), False))
                break
            found.append(Call(name, text[m.end():stop], True))
            tail = self.ITEM_END.match(text, stop)
            if tail is None:
                break
            pos = resume = tail.end()
            kept = len(found)
        return Scan(found, resume, kept, self.ARRAY_END.match(text, pos) is not None)

    def new_id(self) -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class Pythonic(ToolParser):
    """MiniCPM3's Python calls (module docstring)."""

    name = "minicpm3"
    begin = CPM_CALLS
    markers = (CPM_CALLS, CPM_CALLS_END, CPM_THOUGHT, CPM_THOUGHT_END)
    THOUGHT = re.compile(re.escape(CPM_THOUGHT) + r"\n?|" + re.escape(CPM_THOUGHT_END) + r"\n?")
    BETWEEN = re.compile(r"(?:\s|,|\[|\]|```(?:python)?)*")  # fences, blank lines, a list's brackets and commas
    HEAD = re.compile(r"([A-Za-z_][\w.]*)\(")

    MARKER_AT_END = re.compile("(?:" + re.escape(CPM_THOUGHT) + "|" + re.escape(CPM_THOUGHT_END) + r")\Z")

    def content_of(self, head: str, end: bool) -> tuple[str, int]:
        """The text without the thought's markers (each with the newline after it): a marker at the end, or what may
        start one, is held until the next character decides."""
        used = len(head)
        if not end:
            used -= max(held(head, m) for m in self.markers)
            at_end = self.MARKER_AT_END.search(head, 0, used)
            used = at_end.start() if at_end is not None else used
        return self.THOUGHT.sub("", head[:used]), used

    def scan(self, text: str, pos: int, end: bool) -> Scan:
        if text.startswith(self.begin, pos):
            pos += len(self.begin)
        stop = text.find(CPM_CALLS_END, pos)
        limit = stop if stop >= 0 else len(text)
        found: list[Call] = []
        resume = pos
        while (m := self.HEAD.match(text, self.BETWEEN.match(text, pos, limit).end(), limit)) is not None:  # type: ignore[union-attr]
            pairs, pos, closed = python_arguments(text, m.end(), limit)
            found.append(Call(m[1], json_object(pairs, closed), closed))
            if not closed:
                break
            resume = pos
        return Scan(found, resume, len(found) - (bool(found) and not found[-1].complete), stop >= 0)


# a whole quoted string (skipped in one match), a quote that opens one not yet closed, or a bracket or comma
PY_TOKEN = re.compile(r""""(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|["'()\[\]{},]""", re.S)


def python_arguments(text: str, start: int, limit: int) -> tuple[list[tuple[str, str]], int, bool]:
    """The keyword arguments of the Python call whose ``(`` ends at ``start`` (read up to ``limit``), as ``(name,
    JSON value text)`` pairs (those whose value is settled), where the call's text ends, and whether its ``)`` was
    written."""
    pairs: list[tuple[str, str]] = []
    piece, depth = start, 0
    for m in PY_TOKEN.finditer(text, start, limit):
        token = m[0]
        if token in ("\"", "'"):  # a string still being written
            break
        if len(token) > 1:
            continue
        if token in "([{":
            depth += 1
        elif token in ")]}" and depth:
            depth -= 1
        elif token in ",)" and not depth:
            named = keyword_argument(text[piece:m.start()])
            if named is not None:
                pairs.append(named)
            if token == ")":
                return pairs, m.end(), True
            piece = m.end()
    return pairs, limit, False


def keyword_argument(text: str) -> tuple[str, str] | None:
    """``KEY=VALUE`` → ``(KEY, VALUE as JSON text)``; the value written as JSON or as a Python literal. None: not a
    keyword argument with a literal value."""
    key, eq, value = text.partition("=")
    if not eq or not key.strip().isidentifier():
        return None
    try:
        return key.strip(), json.dumps(json.loads(value), ensure_ascii=False)
    except json.JSONDecodeError:
        pass
    try:
        return key.strip(), json.dumps(ast.literal_eval(value.strip()), ensure_ascii=False)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def make_parser(name: str, strings: frozenset[tuple[str, str]] = frozenset()) -> ToolParser:
    """The parser of syntax ``name`` (one of ``TOOL_CALL_PARSERS`` but auto and none)."""
    if name == "deepseek_v3":
        return Delimited(name, DS_CALLS, DS_CALL, "\n```json\n", "\n```", _DS_MARKERS, _v3_header, strings)
    if name == "deepseek_v31":
        return Delimited(name, DS_CALLS, DS_CALL, DS_SEP, DS_CALL_END, _DS_MARKERS, _plain_header, strings)
    if name == "kimi_k2":
        return Delimited(name, KIMI_SECTION, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END, _KIMI_MARKERS, _kimi_header,
                         strings)
    simple: dict[str, Callable[[frozenset[tuple[str, str]]], ToolParser]] = {
        "deepseek_v32": Dsml, "deepseek_v4": DsmlV4, "glm45": GLM, "mistral": Mistral, "minicpm3": Pythonic,
        "hermes": lambda s: Hermes(strings=s), "longcat": Longcat}
    if name not in simple:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}")
    return simple[name](strings)


def every_marker() -> set[str]:
    """The markers of every syntax (the texts a raw decoding keeps)."""
    return {m for n in TOOL_CALL_PARSERS if n not in ("auto", "none") for m in make_parser(n).markers}


# the template text that tells each syntax apart, most specific first
_TEMPLATE_SIGNS = ((DSML_V4_CALLS, "deepseek_v4"), (DSML_TAG, "deepseek_v32"), (KIMI_SECTION, "kimi_k2"),
                   ("<arg_key>", "glm45"), (MISTRAL_CALLS, "mistral"), (CPM_CALLS, "minicpm3"),
                   ("<longcat_tool_call>", "longcat"), ("<tool_call>", "hermes"))


def choose_tool_parser(setting: str, model_type: str | None, chat_template: Any) -> str | None:
    """The tool-call syntax of a server: ``setting`` (``TOOL_CALL_PARSERS``) resolved against the model (None: no
    parser, ``tool_choice: "auto"`` refused). ``auto`` reads the chat template's text, then the ``model_type``, and
    falls back to ``hermes``."""
    if setting not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {setting!r}")
    if setting != "auto":
        return None if setting == "none" else setting
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    text = "".join(t for t in templates if isinstance(t, str))
    if DS_CALLS in text:
        return "deepseek_v3" if "```json" in text else "deepseek_v31"
    for sign, name in _TEMPLATE_SIGNS:
        if sign in text:
            return name
    return MODEL_TYPE_PARSERS.get(model_type or "", FALLBACK)


class ToolStream:
    """A streamed answer's tool-call deltas (OpenAI's shape: an entry with the call's index, id, type and name and
    empty ``arguments`` first, then entries with pieces of ``arguments``) and content.

    ``feed`` takes the answer's new text and reads only what is not settled: the content that may start a marker,
    or, once the calls began, the text from the first call that may still change (complete calls are read once).
    ``update`` takes the parse of the whole answer (at its end) and returns what it adds to what was sent.
    ``read``: the characters handed to the parser so far."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content = 0  # characters of content sent
        self.sent: list[int] = []  # characters of each call's arguments sent
        self.pending = ""  # the answer's text not settled yet
        self.started = False  # the calls' opening marker was read
        self.kept = 0  # calls complete and read for the last time
        self.closed = False  # the calls' block ended: no later text can add to them
        self.read = 0

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and entries that ``delta`` (the answer's next text, not its end) adds."""
        if not delta or self.closed:
            return "", []
        text, content = self.pending + delta, ""
        self.read += len(text)
        if not self.started:
            i = text.find(self.parser.begin)
            if i < 0:
                content, used = self.parser.content_of(text, False)
                self.pending = text[used:]
                self.content += len(content)
                return content, []
            content = self.parser.before_calls(text[:i])
            self.content += len(content)
            self.started, text = True, text[i:]
        found = self.parser.scan(text, 0, False)
        entries = self._entries(found.calls, self.kept)
        self.pending, self.kept, self.closed = text[found.resume:], self.kept + found.kept, found.closed
        return content, entries

    def update(self, parsed: Parsed) -> tuple[str, list[dict[str, Any]]]:
        content = parsed.content[self.content:]
        self.content = max(self.content, len(parsed.content))
        return content, self._entries(parsed.calls, 0)

    def _entries(self, calls: list[Call], first: int) -> list[dict[str, Any]]:
        """The entries of ``calls`` (the calls from index ``first`` on) beyond what was sent."""
        entries: list[dict[str, Any]] = []
        for k, call in enumerate(calls, first):
            if k == len(self.sent):
                entries.append({"index": k, "id": call.id or self.parser.new_id(), "type": "function",
                                "function": {"name": call.name, "arguments": ""}})
                self.sent.append(0)
            piece = call.arguments[self.sent[k]:]
            if piece:
                entries.append({"index": k, "function": {"arguments": piece}})
                self.sent[k] = len(call.arguments)
        return entries
