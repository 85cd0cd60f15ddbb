"""The reasoning parser (``serving/reasoning.py``): a thinking model's ``<think>…</think>`` part split from the answer,
whole or streamed in pieces of any size, markers split across pieces, with or without the opening marker, cut before
the closing one; and the parser chosen from the model or the server's setting."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator

import httpx
import pytest

from mla_runtime import SamplingParams
from mla_runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mla_runtime.serving.reasoning import Reasoning, ReasoningSplitter, choose_parser, starts_inside
from mla_runtime.serving.responses import Job, StreamState, chat_message
from mla_runtime.serving.tools import ToolMode
from mla_runtime.tokenizer import apply_chat_template
from tests.checkpoints import byte_tokenizer, chat_checkpoint
from tests.test_server import Live

CASES = [
    # (output, inside: the prompt ends in an open <think>, reasoning_content, content)
    ("<think>Let me count.</think>The answer is 4.", False, "Let me count.", "The answer is 4."),
    ("\n<think>\nplan\n</think>\n\nanswer", False, "\nplan\n", "\n\nanswer"),
    ("Let me count.</think>The answer is 4.", True, "Let me count.", "The answer is 4."),
    ("<think>both shapes</think>answer", True, "both shapes", "answer"),
    ("</think>answer at once", True, "", "answer at once"),
    ("<think>cut by max_tokens, no end", False, "cut by max_tokens, no end", None),
    ("still thinking </th", True, "still thinking </th", None),
    ("plain answer, no thinking", False, None, "plain answer, no thinking"),
    ("answer that mentions <think> later", False, None, "answer that mentions <think> later"),
    ("<thin", False, None, "<thin"),
    ("<think>a < b and c </ d</think>x </think> y", False, "a < b and c </ d", "x </think> y"),
    ("", False, None, ""),
    ("", True, "", None),
]


@pytest.mark.parametrize("text, inside, reasoning, content", CASES)
def test_a_whole_output_splits_into_reasoning_and_answer(text, inside, reasoning, content):
    assert Reasoning(inside).split(text) == (reasoning, content)


def streamed(text: str, inside: bool, size: int) -> tuple[str, str, list[tuple[str, str]]]:
    splitter = ReasoningSplitter(inside)
    deltas = [splitter.feed(text[i:i + size]) for i in range(0, len(text), size)] + [splitter.finish()]
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas), deltas


@pytest.mark.parametrize("size", [1, 2, 3, 5, 1000])
@pytest.mark.parametrize("text, inside, reasoning, content", CASES)
def test_a_streamed_output_adds_up_to_the_whole_one_whatever_the_pieces(text, inside, reasoning, content, size):
    """One character at a time (every marker split), a few at a time, or in one piece: the deltas add up to the
    whole output's split, and no delta carries a piece of a marker."""
    thought, answer, deltas = streamed(text, inside, size)
    assert (thought, answer) == (reasoning or "", content or "")
    for r, c in deltas:
        for marker in ("<think>", "</think>"):
            assert marker not in r and (marker not in c or marker in (content or ""))


def test_a_marker_split_across_tokens_is_held_until_it_is_decided():
    splitter = ReasoningSplitter(inside=True)
    assert splitter.feed("step one </") == ("step one ", "")  # "</" may start </think>: held
    assert splitter.feed("th") == ("", "")
    assert splitter.feed("ink>\n\nFour") == ("", "\n\nFour")
    assert splitter.feed(" and </th") == ("", " and </th")  # the answer is never held
    assert splitter.finish() == ("", "")

    splitter = ReasoningSplitter(inside=True)
    assert splitter.feed("a </t") == ("a ", "")
    assert splitter.feed("able>") == ("</table>", "")  # not the marker after all: released as reasoning
    assert splitter.feed("</thi") == ("", "")
    assert splitter.finish() == ("</thi", "")  # cut inside a would-be marker: it is reasoning text

    splitter = ReasoningSplitter()
    assert splitter.feed("  <th") == ("", "")  # may open the thinking
    assert splitter.feed("ink>x") == ("x", "")
    assert splitter.feed("</think>y") == ("", "y")


def test_the_prompt_says_whether_the_output_begins_inside_the_thinking():
    assert starts_inside("<｜Assistant｜><think>\n")
    assert not starts_inside("<｜Assistant｜></think>")  # DeepSeek-V3.1 without thinking
    assert not starts_inside("<think>earlier turn</think>answer<｜User｜>hi<｜Assistant｜>")
    assert not starts_inside("# assistant:\n")


@pytest.mark.parametrize("setting, model_type, template, parser", [
    ("auto", "deepseek_v3", "{{ messages }}{% if add_generation_prompt %}<think>\n{% endif %}", "deepseek_r1"),
    ("auto", "deepseek_v3", "{% if thinking %}<think>{% else %}</think>{% endif %}", "deepseek_r1"),
    ("auto", "deepseek_v3", {"default": "{{ messages }}", "tool_use": "<think>"}, "deepseek_r1"),
    ("auto", "deepseek_v3", "{{ messages }}", None),
    ("auto", "deepseek_v3", None, None),
    ("auto", "glm4_moe_lite", None, "deepseek_r1"),
    ("auto", "minicpm3", "{{ messages }}", None),
    ("none", "deepseek_v3", "<think>", None),
    ("deepseek_r1", "deepseek_v2", None, "deepseek_r1"),
])
def test_the_parser_is_chosen_from_the_template_and_model_type_unless_set(setting, model_type, template, parser):
    assert choose_parser(setting, model_type, template) == parser


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="reasoning_parser must be one of auto, deepseek_r1, none, got 'qwen'"):
        choose_parser("qwen", None, None)


# -- answers: the message, the stream, tool calls after the thinking ------------------------------------------------
def scripted_job(inside: bool, **kw) -> Job:
    return Job("chat", [{"prompt_token_ids": [1]}], SamplingParams(max_tokens=64), "m", reasoning=Reasoning(inside),
               **kw)


def stream_pieces(job: Job, pieces: list[str], reason: str = "stop", last_ids: list[int] | None = None) -> list[dict]:
    """The chat chunks of an output that grows by ``pieces`` (one token each), as the engine hands it out;
    ``last_ids``: the final output's token ids."""
    state, text, events = StreamState(job), "", []
    for k, piece in enumerate(pieces):
        text += piece
        last = k == len(pieces) - 1
        ids = last_ids if last and last_ids is not None else list(range(1, k + 2))
        c = CompletionOutput(0, text, ids, reason if last else None)
        events += state.chunks(RequestOutput("r", None, [1], [c], last, RequestMetrics(0.0)))
    return [json.loads(e[6:])["choices"][0] for e in events if e.startswith(b"data: {")]


@pytest.mark.parametrize("pieces, inside", [
    (["<", "think", ">", "Two and two", " make four.", "</", "th", "ink", ">", "\n\n", "Four", "."], False),
    (["Two and two", " make four.", "</th", "ink>\n\n", "Four."], True),
    (list("<think>Two and two make four.</think>\n\nFour."), False),
])
def test_a_chat_answer_carries_its_reasoning_apart_whole_or_streamed(pieces, inside):
    job = scripted_job(inside)
    text = "".join(pieces)
    message, reason = chat_message(job, CompletionOutput(0, text, list(range(len(pieces))), "stop"))
    assert (message["reasoning_content"], message["content"], reason) == ("Two and two make four.", "\n\nFour.", "stop")
    deltas = [d["delta"] for d in stream_pieces(job, pieces)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two make four."
    assert "".join(d.get("content", "") for d in deltas) == "\n\nFour."
    first_answer = next(k for k, d in enumerate(deltas) if d.get("content"))
    assert not any(d.get("reasoning_content") for d in deltas[first_answer:])  # the thinking comes first
    assert not any("think>" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)


def test_an_answer_cut_inside_the_thinking_is_all_reasoning():
    job = scripted_job(True)
    message, reason = chat_message(job, CompletionOutput(0, "Let me see </th", [1, 2, 3], "length"))
    assert (message["reasoning_content"], message["content"], reason) == ("Let me see </th", None, "length")
    deltas = [d["delta"] for d in stream_pieces(job, ["Let me", " see", " </th"], "length")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me see </th"
    assert not any(d.get("content") for d in deltas)


def test_tool_calls_are_parsed_from_the_answer_after_the_thinking():
    """The thinking may name a tool; only the answer's call is one."""
    calls = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>lookup<｜tool▁sep｜>{"ok": true}<｜tool▁call▁end｜>'
             '<｜tool▁calls▁end｜>')
    pieces = ["I should call lookup.", "</think>", "Checking.", calls]
    job = scripted_job(True, tools=ToolMode("auto", syntax="deepseek_v31"),
                       raw_text=lambda ids: "".join(dict(zip([1, 2, 3, 7], pieces))[t] for t in ids))
    c = CompletionOutput(0, 'I should call lookup.</think>Checking.lookup{"ok": true}', [1, 2, 3, 7], "stop")
    message, reason = chat_message(job, c)
    assert (message["reasoning_content"], message["content"], reason) == \
        ("I should call lookup.", "Checking.", "tool_calls")
    assert [t["function"] for t in message["tool_calls"]] == [{"name": "lookup", "arguments": '{"ok": true}'}]
    deltas = stream_pieces(job, ["I should call lookup.", "</think>", "Checking.", 'lookup{"ok": true}'],
                           last_ids=[1, 2, 3, 7])  # the last token holds the calls
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == "I should call lookup."
    assert "".join(d["delta"].get("content", "") for d in deltas) == "Checking."
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert [t["function"]["name"] for t in deltas[-1]["delta"]["tool_calls"] if "id" in t] == ["lookup"]


def test_a_choice_without_a_parser_has_no_reasoning_field():
    job = Job("chat", [{"prompt_token_ids": [1]}], SamplingParams(max_tokens=8), "m")
    message, _ = chat_message(job, CompletionOutput(0, "<think>x</think>y", [1, 2], "stop"))
    assert message["content"] == "<think>x</think>y" and "reasoning_content" not in message


# -- end to end: a thinking chat template on a tiny model, through the HTTP server ------------------------------------
THINKING_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '# ' + message['role'] + ':\\n' + "
                     "message['content'] + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '# assistant:\\n' }}"
                     "{% if thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory) -> Iterator[Live]:
    """A tiny V3 model whose byte-level tokenizer has ``<think>`` and ``</think>`` as tokens (as DeepSeek-R1's has)
    and whose chat template opens the thinking when ``thinking`` is set (as DeepSeek-V3.1's does)."""
    tok = byte_tokenizer(["the answer is four because two and two make four\n"] * 20, 300, ("<think>", "</think>"),
                         THINKING_TEMPLATE)
    path = chat_checkpoint(tmp_path_factory.mktemp("thinking_ckpt"), tok)
    live = Live(path)
    yield live
    live.stop()


def post_chat(live: Live, **body) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "two and two?"}], "max_tokens": 40, **body}
    return httpx.post(live.base + "/v1/chat/completions", json=body, timeout=60)


def same_output_as_completion(live: Live, sampling: dict, thinking: bool) -> str:
    """The text of the chat's tokens, from /v1/completions on the same prompt ids (no reasoning parser there)."""
    tokenizer = live.app.state.runtime.tokenizer
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "two and two?"}], None,
                              {"thinking": True} if thinking else None)
    r = httpx.post(live.base + "/v1/completions", json={"prompt": ids, "max_tokens": 40, **sampling}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_the_server_splits_the_thinking_of_a_thinking_template(thinking_server):
    """With ``chat_template_kwargs: {"thinking": true}`` the prompt ends in ``<think>``: the output begins inside
    the thinking, and the part up to ``</think>`` is reasoning_content, whole or streamed. A bias towards
    ``</think>`` makes the sampled output close its thinking part."""
    end = thinking_server.app.state.runtime.tokenizer.convert_tokens_to_ids("</think>")
    sampling = {"temperature": 1.0, "seed": 11, "logit_bias": {str(end): 4.0}}
    text = same_output_as_completion(thinking_server, sampling, thinking=True)
    assert "</think>" in text, text  # the seed gives an output with both parts
    want = text.split("</think>", 1)
    r = post_chat(thinking_server, chat_template_kwargs={"thinking": True}, **sampling)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (want[0], want[1])

    with httpx.stream("POST", thinking_server.base + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "two and two?"}], "max_tokens": 40, "stream": True,
            "chat_template_kwargs": {"thinking": True}, **sampling}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == want[0]
    assert "".join(d.get("content") or "" for d in deltas) == want[1]


def test_without_the_thinking_variable_the_answer_is_all_content(thinking_server):
    sampling = {"temperature": 0}
    text = same_output_as_completion(thinking_server, sampling, thinking=False)
    r = post_chat(thinking_server, **sampling)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == text and message["reasoning_content"] is None


@pytest.mark.parametrize("kwargs, says", [
    ("thinking", "chat_template_kwargs: Input should be a valid dictionary"),
    ([{"thinking": True}], "chat_template_kwargs: Input should be a valid dictionary"),
    ({"tokenize": False}, "chat_template_kwargs: 'tokenize' is an argument of apply_chat_template"),
])
def test_chat_template_kwargs_that_are_not_template_variables_are_refused_by_name(thinking_server, kwargs, says):
    r = post_chat(thinking_server, chat_template_kwargs=kwargs)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs"
    assert r.json()["error"]["message"].startswith(says), r.json()


def test_a_constraint_holds_after_the_thinking_which_stays_free(thinking_server):
    """Inside the thinking (the prompt opens it) a structured output constrains the answer after ``</think>`` only:
    the thinking is the same text an unconstrained request samples, the answer one of the choices."""
    end = thinking_server.app.state.runtime.tokenizer.convert_tokens_to_ids("</think>")
    sampling = {"temperature": 1.0, "seed": 11, "logit_bias": {str(end): 4.0}}
    free = same_output_as_completion(thinking_server, sampling, thinking=True).split("</think>", 1)[0]
    for stream in (False, True):
        body = {"messages": [{"role": "user", "content": "two and two?"}], "max_tokens": 40, "stream": stream,
                "chat_template_kwargs": {"thinking": True}, "structured_outputs": {"choice": ["four", "five"]},
                **sampling}
        if stream:
            with httpx.stream("POST", thinking_server.base + "/v1/chat/completions", json=body, timeout=60) as s:
                events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
            got = ("".join(d.get("reasoning_content", "") for d in deltas),
                   "".join(d.get("content") or "" for d in deltas))
        else:
            r = httpx.post(thinking_server.base + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            got = (message["reasoning_content"], message["content"])
        assert got[0] == free and got[1] in ("four", "five"), got


def test_without_the_thinking_a_constraint_holds_from_the_first_token(thinking_server):
    r = post_chat(thinking_server, temperature=0, structured_outputs={"choice": ["four", "five"]})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] in ("four", "five") and message["reasoning_content"] is None


def test_a_template_that_fails_to_render_is_a_value_error(thinking_server):
    tokenizer = copy.copy(thinking_server.app.state.runtime.tokenizer)
    tokenizer.chat_template = "{% if thinking %}{{ raise_exception('thinking is not offered') }}{% endif %}x"
    assert apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="^the chat template failed: thinking is not offered$"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}], None, {"thinking": True})
