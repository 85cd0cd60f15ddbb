"""Response bodies and SSE chunks for ``/generate``, ``/v1/completions`` and ``/v1/chat/completions``.

The engine hands out cumulative ``RequestOutput``s; ``StreamState`` turns them into deltas. While a
request has stop strings, the last ``len(longest stop) - 1`` characters are held back, so text that
turns out to be the start of a stop string (cut from the final text) is never streamed: the
concatenated deltas always equal the non-streamed text.

A chat answer with tool calls (``tools.py``) carries them as ``message.tool_calls`` with
``finish_reason: "tool_calls"``; streamed, the constrained output is not sent as content but as one
``delta.tool_calls`` event when the choice ends; an ``auto`` answer is read from its text decoded with the tool-call
markers (``raw_text``) by the model's syntax (``tool_parsers.py``): the text before the first call streams as content,
then each call as OpenAI streams it (an entry with its id and name, then pieces of its arguments). A call cut short
by ``max_tokens`` keeps ``finish_reason: "length"`` and comes back the same way, with the arguments written so far.

Under a reasoning parser (``reasoning.py``) a chat answer's thinking part is ``message.reasoning_content`` (streamed:
``delta.reasoning_content``) and only the answer after it is content and is searched for tool calls.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from mla_runtime.engine.llm_engine import PromptType
from mla_runtime.outputs import CompletionOutput, RequestOutput
from mla_runtime.sampling_params import SamplingParams
from mla_runtime.serving.protocol import usage
from mla_runtime.serving.reasoning import Reasoning, ReasoningSplitter
from mla_runtime.serving.tool_parsers import Parsed, ToolParser, ToolStream, make_parser
from mla_runtime.serving.tools import ToolMode, calls_of_output
from mla_runtime.tokenizer import DecodeWindow

OBJECTS = {"completions": ("text_completion", "text_completion"),
           "chat": ("chat.completion", "chat.completion.chunk")}
ID_PREFIX = {"generate": "gen", "completions": "cmpl", "chat": "chatcmpl"}


@dataclass
class Job:
    """One admitted generation request, as the HTTP layer sees it."""

    endpoint: str  # "generate" | "completions" | "chat"
    prompts: list[PromptType]  # one, or several for a batched /v1/completions request
    params: SamplingParams
    model: str
    stream: bool = False
    include_usage: bool = False
    echo: list[str] | None = None  # each prompt's text, prepended to its choices (completions with echo)
    logprobs: int | None = None  # alternatives per generated token to return; None: no log-probabilities
    token_text: Callable[[int], str] = str  # a token id's text, for log-probability entries
    tools: ToolMode | None = None  # how the answer carries tool calls (chat with tools)
    raw_text: Callable[[list[int]], str] = lambda ids: ""  # tokens' text with special tokens (tool-call markers)
    reasoning: Reasoning | None = None  # how a chat answer's thinking part is split off (None: it is not)
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)
    outcome: str | None = None  # set once, when the request ends
    last_output: RequestOutput | None = None  # the engine's last output, kept for the request log

    def __post_init__(self) -> None:
        self.request_id = self.request_id or f"{ID_PREFIX[self.endpoint]}-{uuid.uuid4().hex}"

    @property
    def engine_request_ids(self) -> list[str]:
        """The engine requests behind this job: its own id, or ``<id>-<p>`` for prompt p of a batch."""
        if len(self.prompts) == 1:
            return [self.request_id]
        return [f"{self.request_id}-{p}" for p in range(len(self.prompts))]

    @property
    def num_choices(self) -> int:
        """Choices in the answer: ``n`` per prompt; prompt p's samples are choices ``p·n .. p·n + n - 1``."""
        return len(self.prompts) * self.params.n

    def echo_of(self, choice: int) -> str:
        return self.echo[choice // self.params.n] if self.echo else ""


def merge_outputs(job: Job, outs: list[RequestOutput]) -> RequestOutput:
    """One ``RequestOutput`` for a batched job: the prompts' choices re-indexed in prompt order, the prompt
    tokens (for usage) concatenated; timing metrics are the first prompt's."""
    if len(outs) == 1:
        return outs[0]
    n = job.params.n
    return RequestOutput(
        request_id=job.request_id, prompt=None,
        prompt_token_ids=[t for o in outs for t in o.prompt_token_ids],
        outputs=[replace(c, index=p * n + c.index) for p, o in enumerate(outs) for c in o.outputs],
        finished=all(o.finished for o in outs), metrics=outs[0].metrics,
        num_cached_tokens=sum(o.num_cached_tokens for o in outs))


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def split_reasoning(job: Job, c: CompletionOutput) -> tuple[str | None, str | None]:
    """A finished chat choice's ``(reasoning_content, answer)``: without a reasoning parser, no reasoning and the
    whole text; an answer of None: the thinking never closed."""
    if job.reasoning is None:
        return None, c.text
    return job.reasoning.split(c.text)


def tool_text(job: Job, c: CompletionOutput) -> str | None:
    """The answer part of a finished choice's text decoded with its tool-call markers (``raw_text``), a stop string
    cut as the engine cut it from the text. None: the thinking never closed."""
    raw = job.raw_text(c.token_ids)
    stops = job.params.stop_strings
    cuts = [i for i in (raw.find(s) for s in stops) if i >= 0] if c.finish_reason == "stop" else []
    raw = raw[:min(cuts)] if cuts else raw
    return raw if job.reasoning is None else job.reasoning.split(raw)[1]


def parse_auto(job: Job, c: CompletionOutput, parser: ToolParser) -> Parsed | None:
    """A finished ``auto`` choice's answer parsed in the model's tool-call syntax (``tool_parsers.py``); None: the
    thinking never closed."""
    answer = tool_text(job, c)
    return None if answer is None else parser.parse(answer, c.finish_reason == "stop")


class AnswerText:
    """A running ``auto`` choice's answer as ``tool_text`` reads it, given a piece at a time: each ``update`` decodes
    only the new tokens (``DecodeWindow``), holds the text that may start a stop string, and passes the rest through
    the reasoning split, returning the answer's new text (none inside the thinking)."""

    def __init__(self, job: Job) -> None:
        self.window = DecodeWindow(job.raw_text)
        self.hold = max((len(s) for s in job.params.stop_strings), default=1) - 1
        self.held = ""
        self.splitter = job.reasoning.splitter() if job.reasoning is not None else None

    def update(self, token_ids: list[int]) -> str:
        text = self.held + self.window.update(token_ids)
        cut = max(0, len(text) - self.hold)
        ready, self.held = text[:cut], text[cut:]
        return ready if self.splitter is None else self.splitter.feed(ready)[1]


def auto_parser(job: Job) -> ToolParser:
    assert job.tools is not None and job.tools.syntax is not None
    return make_parser(job.tools.syntax, job.tools.strings)


def tool_answer(job: Job, c: CompletionOutput) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """A finished chat choice's ``(content, tool_calls, finish_reason)``, of the answer after any thinking part:
    ``"tool_calls"`` only for complete calls; a cut output keeps its reason (``"length"``) and its partial calls, and
    is never content when constrained."""
    reason = finish_reason(c.finish_reason)
    answer = split_reasoning(job, c)[1]
    if job.tools is None or answer is None:
        return answer, [], reason
    if job.tools.kind == "auto":
        parser = auto_parser(job)
        parsed = parse_auto(job, c, parser)
        if parsed is None:
            return None, [], reason
        content = (parsed.content or None) if parsed.started else parsed.content
        calls = [{"id": t.id or parser.new_id(), "type": "function",
                  "function": {"name": t.name, "arguments": t.arguments}} for t in parsed.calls]
        complete = all(t.complete for t in parsed.calls)
    else:
        content = None
        calls, complete = calls_of_output(job.tools, answer)
    if calls and complete and reason == "stop":
        reason = "tool_calls"
    return content, calls, reason


def chat_message(job: Job, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
    """A finished chat choice's ``message`` and ``finish_reason``."""
    content, calls, reason = tool_answer(job, c)
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if job.reasoning is not None:
        message["reasoning_content"] = split_reasoning(job, c)[0]
    if calls:
        message["tool_calls"] = calls
    return message, reason


def _usage(out: RequestOutput) -> dict[str, Any]:
    return usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)


def _top(job: Job, entry: dict[int, float]) -> list[tuple[str, float]]:
    """The ``job.logprobs`` most likely tokens of one position (the sampler's entry also holds the chosen one)."""
    best = sorted(entry.items(), key=lambda kv: -kv[1])[: job.logprobs or 0]
    return [(job.token_text(t), v) for t, v in best]


def _by_text(top: list[tuple[str, float]]) -> dict[str, float]:
    """The legacy shape keys alternatives by text; tokens whose texts coincide (e.g. partial UTF-8 bytes, all
    "\ufffd") keep the most likely one's value."""
    out: dict[str, float] = {}
    for text, value in top:
        out.setdefault(text, value)
    return out


def completion_logprobs(job: Job, tokens: list[int], entries: list[dict[int, float]], offset: int
                        ) -> dict[str, Any]:
    """OpenAI's legacy completions ``logprobs`` object for ``tokens``; ``offset``: text offset of the first."""
    texts = [job.token_text(t) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [e[t] for t, e in zip(tokens, entries)],
            "top_logprobs": [_by_text(_top(job, e)) for e in entries] if job.logprobs else None,
            "text_offset": offsets}


def chat_logprobs(job: Job, tokens: list[int], entries: list[dict[int, float]]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object (``content``: one entry per token) for ``tokens``."""
    def item(text: str, value: float) -> dict[str, Any]:
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(job.token_text(t), e[t]), "top_logprobs": [item(x, v) for x, v in _top(job, e)]}
                        for t, e in zip(tokens, entries)]}


def _choice_logprobs(job: Job, tokens: list[int], entries: list[dict[int, float]] | None,
                     offset: int = 0) -> dict[str, Any] | None:
    if job.logprobs is None or entries is None:
        return None
    if job.endpoint == "completions":
        return completion_logprobs(job, tokens, entries, offset)
    return chat_logprobs(job, tokens, entries)


def full_body(job: Job, out: RequestOutput) -> dict[str, Any]:
    """The non-streamed answer."""
    if job.endpoint == "generate":
        if len(out.outputs) == 1:
            c = out.outputs[0]
            return {"id": job.request_id, "text": c.text, "token_ids": c.token_ids,
                    "finish_reason": finish_reason(c.finish_reason), "usage": _usage(out)}
        return {"id": job.request_id,
                "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                             "finish_reason": finish_reason(c.finish_reason)} for c in out.outputs],
                "usage": _usage(out)}
    head = {"id": job.request_id, "object": OBJECTS[job.endpoint][0], "created": job.created, "model": job.model}
    if job.endpoint == "completions":
        choices = [{"index": c.index, "text": job.echo_of(c.index) + c.text,
                    "logprobs": _choice_logprobs(job, c.token_ids, c.logprobs, len(job.echo_of(c.index))),
                    "finish_reason": finish_reason(c.finish_reason)} for c in out.outputs]
    else:
        choices = []
        for c in out.outputs:
            message, reason = chat_message(job, c)
            choices.append({"index": c.index, "message": message,
                            "logprobs": _choice_logprobs(job, c.token_ids, c.logprobs), "finish_reason": reason})
    return {**head, "choices": choices, "usage": _usage(out)}


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class StreamState:
    """Per-request streaming progress: how much text and how many tokens each sample has sent."""

    def __init__(self, job: Job) -> None:
        self.job = job
        n = job.num_choices
        self.sent_chars = [0] * n
        self.tool_streams: list[ToolStream] | None = (  # an auto tool choice's calls, streamed as they are written
            [ToolStream(auto_parser(job)) for _ in range(n)] if job.tools is not None and job.tools.kind == "auto"
            else None)
        self.answers = [AnswerText(job) for _ in range(n)] if self.tool_streams is not None else []
        self.splitters: list[ReasoningSplitter] | None = (
            None if job.reasoning is None else [job.reasoning.splitter() for _ in range(n)])
        self.sent_tokens = [0] * n
        self.token_chars = [len(job.echo_of(i)) for i in range(n)]  # text offset of the next token (logprobs)
        self.done = [False] * n
        self.started = False
        self.hold = max((len(s) for s in job.params.stop_strings), default=1) - 1

    def chunks(self, out: RequestOutput) -> list[bytes]:
        """SSE events for what ``out`` adds; after the final output also usage and ``[DONE]``."""
        return [sse(p) for p in self.payloads(out)]

    def payloads(self, out: RequestOutput) -> list[dict[str, Any] | str]:
        """The data of the SSE events ``chunks`` sends for ``out`` (``"[DONE]"`` last)."""
        events: list[dict[str, Any] | str] = []
        if not self.started:
            self.started = True
            events += self._opening()
        for c in out.outputs:
            i = c.index
            if self.done[i]:
                continue
            finished = c.finish_reason is not None
            end = len(c.text) if finished else max(self.sent_chars[i], len(c.text) - self.hold)
            text = c.text[self.sent_chars[i]:end]
            tokens = c.token_ids[self.sent_tokens[i]:]
            entries = None if c.logprobs is None else c.logprobs[self.sent_tokens[i]:]
            reason = finish_reason(c.finish_reason)
            thought = ""
            if self.splitters is not None:
                thought, text = self._split(i, text, finished)
            calls: list[dict[str, Any]] = []
            if self.job.tools is not None:
                text, calls, reason = self._tool_delta(c, text)
            self.sent_chars[i], self.sent_tokens[i] = end, len(c.token_ids)
            self.done[i] = finished
            per_token = self.job.endpoint == "generate" or self.job.logprobs is not None  # never drop a token's data
            if text or thought or calls or (tokens and per_token) or finished:
                lp = _choice_logprobs(self.job, tokens, entries, self.token_chars[i]) if tokens else None
                if lp is not None and self.job.endpoint == "completions":
                    self.token_chars[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                event = self._delta(i, text, tokens, reason, out if out.finished else None, lp, thought)
                if calls:
                    event["choices"][0]["delta"]["tool_calls"] = calls
                events.append(event)
        if out.finished:
            if self.job.include_usage and self.job.endpoint != "generate":
                events.append({**self._head(), "choices": [], "usage": _usage(out)})
            events.append("[DONE]")
        return events

    def _split(self, i: int, text: str, finished: bool) -> tuple[str, str]:
        """Choice ``i``'s ``(reasoning, content)`` delta of a text delta, under the reasoning parser."""
        assert self.splitters is not None
        thought, content = self.splitters[i].feed(text)
        if finished:
            more_thought, more_content = self.splitters[i].finish()
            thought, content = thought + more_thought, content + more_content
        return thought, content

    def _tool_delta(self, c: CompletionOutput, text: str) -> tuple[str, list[dict[str, Any]], str | None]:
        """A tool-call choice's ``(content delta, delta.tool_calls entries, finish_reason)``: a constrained output is
        never sent as content, its calls come whole when it ends; an ``auto`` output's content and calls stream as
        the model writes them (``tool_parsers.ToolStream``)."""
        tools = self.job.tools
        assert tools is not None
        finished = c.finish_reason is not None
        if self.tool_streams is not None:
            stream = self.tool_streams[c.index]
            if not finished:
                return *stream.feed(self.answers[c.index].update(c.token_ids)), None
            parsed = parse_auto(self.job, c, stream.parser)
            content, entries = stream.update(parsed) if parsed is not None else ("", [])
            reason = finish_reason(c.finish_reason)
            if parsed is not None and parsed.calls and all(t.complete for t in parsed.calls) and reason == "stop":
                reason = "tool_calls"
            return content, entries, reason
        if not finished:
            return "", [], None
        _, calls, reason = tool_answer(self.job, c)
        return "", [{"index": k, **call} for k, call in enumerate(calls)], reason

    def _head(self) -> dict[str, Any]:
        obj = OBJECTS[self.job.endpoint][1]
        return {"id": self.job.request_id, "object": obj, "created": self.job.created, "model": self.job.model}

    def _opening(self) -> list[dict[str, Any] | str]:
        job = self.job
        if job.endpoint == "chat":  # OpenAI's first chunk announces the role
            return [{**self._head(), "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}
                    for i in range(job.num_choices)]
        if job.endpoint == "completions" and job.echo:
            return [{**self._head(), "choices": [{"index": i, "text": job.echo_of(i), "logprobs": None,
                                                  "finish_reason": None}]} for i in range(job.num_choices)]
        return []

    def _delta(self, i: int, text: str, tokens: list[int], reason: str | None, final: RequestOutput | None,
               logprobs: dict[str, Any] | None = None, thought: str = "") -> dict[str, Any]:
        if self.job.endpoint == "generate":
            event: dict[str, Any] = {"id": self.job.request_id, "index": i, "text": text, "token_ids": tokens,
                                     "finish_reason": reason}
            if final is not None:
                event["usage"] = _usage(final)
            return event
        if self.job.endpoint == "completions":
            choice: dict[str, Any] = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
        else:
            delta = {"reasoning_content": thought} if thought else {}
            if text:
                delta["content"] = text
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {**self._head(), "choices": [choice]}
