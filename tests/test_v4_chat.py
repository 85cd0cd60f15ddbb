"""DeepSeek-V4's built-in chat format (``mla_runtime/v4_chat.py``): the prompts of representative chats against the
strings DeepSeek-V4's encoder (``encoding/encoding_dsv4.py`` of the released checkpoints) writes, written out here
by hand; the options ``chat_template_kwargs`` sets and the errors of bad ones; the calls an assistant turn writes read
back by the ``deepseek_v4`` tool-call parser; a ``deepseek_v4`` checkpoint without a chat template rendered with the
format; and, through the server on a tiny ``deepseek_v4`` checkpoint, thinking on by default, tool calls parsed
(streamed and not) and thinking turned off by ``chat_template_kwargs``."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mla_runtime.errors import InvalidParam
from mla_runtime.serving.reasoning import Reasoning, starts_inside
from mla_runtime.serving.tool_parsers import ToolStream, choose_tool_parser, make_parser
from mla_runtime.tokenizer import apply_chat_template, chat_format, load_tokenizer
from mla_runtime.v4_chat import calls_block, render

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
# the tools as DeepSeek-V4's encoder shows them, after the system text and a blank line
TOOLS_TEXT = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    "\"<｜DSML｜tool_calls>\" block like the following:\n\n"
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, "
    "arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Forecast", "parameters": {"type": "object", "properties": '
    '{"city": {"type": "string"}, "days": {"type": "integer"}}}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n")
CALLS = [{"id": "c1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
         {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
CALLS_TEXT = ('\n\n<｜DSML｜tool_calls>\n'
              '<｜DSML｜invoke name="get_weather">\n'
              '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
              '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
              '</｜DSML｜invoke>\n'
              '<｜DSML｜invoke name="get_weather">\n'
              '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
              '</｜DSML｜invoke>\n'
              '</｜DSML｜tool_calls>')
EARLIER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
           {"role": "user", "content": "1+1?"}]


def test_a_first_turn_opens_the_thinking_by_default_and_closes_it_without_thinking():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(chat) == BOS + "Be brief." + USER + "Hi" + ASSISTANT + "<think>"
    assert render(chat, None, {"thinking": False}) == BOS + "Be brief." + USER + "Hi" + ASSISTANT + "</think>"
    assert render(chat, None, {"enable_thinking": False}) == render(chat, None, {"reasoning_effort": "none"}) \
        == render(chat, None, {"thinking": False})
    assert render(chat, None, {"reasoning_effort": "high"}) == render(chat)


def test_earlier_thinking_is_dropped_unless_asked_to_keep_it():
    assert render(EARLIER) == (BOS + "Be brief." + USER + "Hi" + ASSISTANT + "</think>" + "Hello!" + EOS
                               + USER + "1+1?" + ASSISTANT + "<think>")
    assert render(EARLIER, None, {"drop_thinking": False}) == (
        BOS + "Be brief." + USER + "Hi" + ASSISTANT + "<think>" + "A greeting.</think>" + "Hello!" + EOS
        + USER + "1+1?" + ASSISTANT + "<think>")
    assert render(EARLIER, None, {"thinking": False}) == (
        BOS + "Be brief." + USER + "Hi" + ASSISTANT + "</think>" + "Hello!" + EOS + USER + "1+1?" + ASSISTANT
        + "</think>")


def test_the_maximum_effort_writes_its_instruction_first_in_thinking_mode_only():
    chat = [{"role": "user", "content": "Prove it."}]
    effort = ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
              "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
              "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
              "adversarial scenarios.\n"
              "Explicitly write out your entire deliberation process, documenting every intermediate step, "
              "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
              "unchecked.\n\n")
    assert render(chat, None, {"reasoning_effort": "max"}) == BOS + effort + USER + "Prove it." + ASSISTANT + "<think>"
    assert render(chat, None, {"reasoning_effort": "max", "thinking": False}) == \
        BOS + USER + "Prove it." + ASSISTANT + "</think>"


def test_tools_calls_and_results_as_the_encoder_writes_them():
    """The tools after the system text; an earlier turn's thinking and DSML calls kept (tools given); the tools'
    results one user turn, in the calls' order whatever order they come in, a user's text after them joined in."""
    chat = EARLIER[:2] + [
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
        {"role": "user", "content": "And tomorrow?"}]
    assert render(chat, TOOLS) == (
        BOS + "Be brief.\n\n" + TOOLS_TEXT + USER + "Hi" + ASSISTANT + "<think>" + "Look it up.</think>" + CALLS_TEXT
        + EOS + USER + "<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>\n\nAnd tomorrow?"
        + ASSISTANT + "<think>")
    # no system message: an empty one carries the tools; without thinking no reasoning is written
    assert render(chat[1:], TOOLS, {"thinking": False}) == (
        BOS + "\n\n" + TOOLS_TEXT + USER + "Hi" + ASSISTANT + "</think>" + CALLS_TEXT + EOS
        + USER + "<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>\n\nAnd tomorrow?"
        + ASSISTANT + "</think>")


def test_developer_turns_response_format_and_arguments_that_are_no_object():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert render([{"role": "user", "content": "x"}], None, {"response_format": schema}) == (
        BOS + "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        + json.dumps(schema) + USER + "x" + ASSISTANT + "<think>")
    chat = [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "x"}]
    assert render(chat, None, {"thinking": False}) == BOS + USER + "Rules." + USER + "x" + ASSISTANT + "</think>"
    assert render(chat) == BOS + USER + "x" + ASSISTANT + "<think>"  # dropped before the last user turn
    cut = [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1'}}]
    assert calls_block(cut) == ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
                                '<｜DSML｜parameter name="arguments" string="true">{"a": 1</｜DSML｜parameter>\n'
                                '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


@pytest.mark.parametrize("kwargs, messages, param, match", [
    ({"temperature": 1}, None, "chat_template_kwargs", "'temperature' is not a variable"),
    ({"reasoning_effort": "medium"}, None, "chat_template_kwargs", "reasoning_effort must be one of high, max"),
    ({"thinking": "yes"}, None, "chat_template_kwargs", "thinking must be true or false"),
    ({}, [{"role": "developer", "content": ""}], "messages.0.content", "must not be empty"),
    ({}, [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
     "messages.1.tool_calls", "needs function.name"),
])
def test_bad_options_and_messages_are_refused_naming_the_field(kwargs, messages, param, match):
    with pytest.raises(InvalidParam, match=match) as e:
        render(messages or [{"role": "user", "content": "x"}], None, kwargs)
    assert e.value.param == param


def test_the_parser_reads_the_calls_the_format_writes_whole_and_streamed():
    text = "Checking." + CALLS_TEXT
    parser = make_parser("deepseek_v4")
    parsed = parser.parse(text, True)
    assert parsed.content == "Checking."  # the blank line before the block is the format's, not content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in CALLS]
    stream = ToolStream(parser)
    pieces = [stream.feed(ch) for ch in text]
    content, entries = "".join(c for c, _ in pieces), [e for _, es in pieces for e in es]
    more_content, more = stream.update(parsed)
    assert content + more_content == "Checking."
    args: dict[int, str] = {}
    for e in entries + more:
        args[e["index"]] = args.get(e["index"], "") + e["function"]["arguments"]
    assert [json.loads(a) for a in args.values()] == [{"city": "Paris", "days": 3}, {"city": "Oslo"}]
    assert parser.parse("Two lines\n\nof text.", True).content == "Two lines\n\nof text."
    assert choose_tool_parser("auto", "deepseek_v4", None) == "deepseek_v4"
    assert choose_tool_parser("auto", None, "{{ '<｜DSML｜tool_calls>' }}") == "deepseek_v4"


def test_thinking_output_splits_into_reasoning_then_content_and_calls():
    prompt = render([{"role": "user", "content": "Weather?"}], TOOLS)
    assert starts_inside(prompt) and not starts_inside(render([{"role": "user", "content": "x"}], None,
                                                              {"thinking": False}))
    reasoning, content = Reasoning(inside=True).split("I should call it.</think>Checking." + CALLS_TEXT)
    assert reasoning == "I should call it." and make_parser("deepseek_v4").parse(content or "", True).calls


# -- a deepseek_v4 checkpoint without a chat template ------------------------------------------------------------
SPECIAL = (BOS, EOS, USER, ASSISTANT, "<think>", "</think>")


@functools.cache
def v4_tokenizer():
    """A byte-level tokenizer with V4's markers, no chat template (trained once: copy it to change it)."""
    from tests.checkpoints import byte_tokenizer

    corpus = [render(EARLIER[:2] + [{"role": "assistant", "content": None, "tool_calls": CALLS}], TOOLS)] * 3
    return byte_tokenizer(corpus, 1200, SPECIAL)


def test_a_checkpoint_without_a_template_is_rendered_with_the_built_in_format(tmp_path: Path):
    tok = v4_tokenizer()
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    loaded = load_tokenizer(tmp_path)
    assert chat_format(loaded) == "deepseek_v4"
    ids = apply_chat_template(loaded, EARLIER, TOOLS, {"thinking": False})
    assert loaded.decode(ids) == render(EARLIER, TOOLS, {"thinking": False})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert chat_format(load_tokenizer(tmp_path)) is None  # another model's: none built in
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    (tmp_path / "encoding").mkdir()
    (tmp_path / "encoding" / "encoding.py").write_text("")
    assert chat_format(load_tokenizer(tmp_path)) is None  # an encoder of another format (V4.1's)
    (tmp_path / "encoding" / "encoding_dsv4.py").write_text("")
    assert chat_format(load_tokenizer(tmp_path)) == "deepseek_v4"
    tok = copy.deepcopy(tok)
    tok.chat_template = "{{ messages[0]['content'] }}"
    tok.save_pretrained(tmp_path)
    assert chat_format(load_tokenizer(tmp_path)) is None  # a template of its own wins


# -- through the server -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v4_server(tmp_path_factory) -> Iterator:
    from tests.test_families_v4 import build
    from tests.test_server import Live

    tok = v4_tokenizer()
    path = tmp_path_factory.mktemp("v4_chat")
    build(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    live = Live(path, engine={"max_model_len": 512, "kv_cache_memory": "256KiB", "max_num_seqs": 2})
    yield live
    live.stop()


def chat(live, **body) -> dict:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "temperature": 0, **body}
    if not body.get("stream"):
        r = httpx.post(live.base + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    with httpx.stream("POST", live.base + "/v1/chat/completions", json=body, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0] for e in events if e["choices"]]
    entries = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
    args: dict[int, list[str]] = {}
    for e in entries:
        if "id" in e:
            args[e["index"]] = [e["function"]["name"], ""]
        else:
            args[e["index"]][1] += e["function"]["arguments"]
    return {"message": {"content": "".join(d["delta"].get("content") or "" for d in deltas) or None,
                        "reasoning_content": "".join(d["delta"].get("reasoning_content") or "" for d in deltas),
                        "tool_calls": [{"function": {"name": n, "arguments": a}} for n, a in args.values()]},
            "finish_reason": deltas[-1]["finish_reason"]}


def test_the_server_thinks_by_default_and_parses_v4_calls(v4_server):
    """By default the prompt opens the thinking, so an output cut before ``</think>`` is all reasoning; without
    thinking (``chat_template_kwargs``), an answer in V4's call syntax comes back as calls, streamed or not."""
    thought = chat(v4_server, max_tokens=3, logit_bias={str(i): -100 for i in
                                                       v4_server.app.state.runtime.tokenizer.encode("</think>")})
    assert thought["message"]["content"] is None and thought["message"]["reasoning_content"]
    output = "Checking." + calls_block(CALLS[:1])
    for stream in (False, True):
        got = chat(v4_server, tools=TOOLS, chat_template_kwargs={"thinking": False}, stream=stream,
                   structured_outputs={"choice": [output]})
        assert got["finish_reason"] == "tool_calls" and got["message"]["content"] == "Checking."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in got["message"]["tool_calls"]] == [("get_weather", {"city": "Paris", "days": 3})]
    for body, param in (({"chat_template_kwargs": {"reasoning_effort": "low"}}, "chat_template_kwargs"),
                        ({"reasoning_effort": "extreme"}, "reasoning_effort")):
        r = httpx.post(v4_server.base + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "x"}], **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_requests_own_reasoning_effort_sets_the_formats(v4_server):
    """OpenAI's ``reasoning_effort``: ``none`` answers without thinking (all content), ``max`` writes the maximum
    effort's instruction (a longer prompt), the other levels think at the default effort."""
    bias = {str(i): -100 for i in v4_server.app.state.runtime.tokenizer.encode("</think>")}
    plain = chat(v4_server, max_tokens=3, logit_bias=bias, reasoning_effort="none")["message"]
    assert plain["content"] and plain["reasoning_content"] is None

    def prompt_tokens(**body) -> int:
        r = httpx.post(v4_server.base + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **body})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    assert prompt_tokens(reasoning_effort="low") == prompt_tokens() < prompt_tokens(reasoning_effort="max")
    assert prompt_tokens(reasoning_effort="max", chat_template_kwargs={"reasoning_effort": "high"}) == prompt_tokens()
