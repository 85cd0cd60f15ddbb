"""Public chat templates (``tests/chat_templates/``, sources in its ``SOURCES.md``) through the runtime's
``apply_chat_template``: each shows the model the tools (or, for one that does not, is known not to), renders earlier
tool calls (their ``arguments`` sent as JSON text, read as the object it encodes or as the text, whichever the
template needs) and the tools' results, and opens or closes the thinking as its model expects; the tool-call and
reasoning parsers chosen automatically from the template read exactly the syntax it teaches."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from mla_runtime.serving.reasoning import Reasoning, choose_parser, starts_inside
from mla_runtime.serving.tool_parsers import choose_tool_parser, make_parser
from mla_runtime.serving.tools import renders_tools, string_parameters
from mla_runtime.tokenizer import apply_chat_template, template_messages
from tests.checkpoints import byte_tokenizer

HERE = Path(__file__).resolve().parent / "chat_templates"
# template file → (model_type, the tool-call syntax auto picks, the reasoning parser auto picks)
TEMPLATES = {
    "deepseek_v3": ("deepseek_v3", "deepseek_v3", None),
    "deepseek_v31": ("deepseek_v3", "deepseek_v31", "deepseek_r1"),
    "deepseek_v31_published": ("deepseek_v3", "deepseek_v31", "deepseek_r1"),
    "deepseek_v32": ("deepseek_v32", "deepseek_v31", "deepseek_r1"),
    "glm45": ("glm4_moe_lite", "glm45", "deepseek_r1"),
    "glm46": ("glm4_moe_lite", "glm45", "deepseek_r1"),
    "kimi_k2": ("kimi_k2", "kimi_k2", "deepseek_r1"),
    "minicpm3": ("minicpm3", "minicpm3", None),
    "mistral": ("mistral4", "mistral", None),
}
HIDES_TOOLS = {"deepseek_v31_published"}  # templates that do not show the model the tools: "auto" is refused
ENCODINGS = {"deepseek_v32_dsml"}  # templates used for the turns they write, not as a server's chat template
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city", "parameters": {
        "type": "object", "required": ["city"],
        "properties": {"city": {"type": "string", "description": "City name"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "lookup", "description": "Search the notes", "parameters": {
        "type": "object", "required": ["q"], "properties": {"q": {"type": "string"}, "ok": {"type": "boolean"}}}}},
]
CALLS = [("call0000A1", "get_weather", {"city": "Paris", "days": 3}),
         ("call0000B2", "lookup", {"q": "a < b", "ok": True})]
RESULTS = ["sunny, 21 degrees", "found: b is larger"]
ASKED = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


def called(name: str) -> dict:
    """The assistant turn that makes ``CALLS``, as a client sends it back (Kimi-K2's ids are its own)."""
    ids = [f"functions.{n}:{k}" if name == "kimi_k2" else i for k, (i, n, _) in enumerate(CALLS)]
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (_, n, a) in zip(ids, CALLS)]}


def answered(name: str) -> list[dict]:
    calls = called(name)["tool_calls"]
    return [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(calls, RESULTS)]


@pytest.fixture(scope="module")
def base_tokenizer():
    """A byte-level tokenizer: any rendered text encodes and decodes back exactly."""
    return byte_tokenizer(["the weather in Paris is sunny\n"] * 10, 300)


def tokenizer_for(base, name: str):
    tok = copy.copy(base)
    tok.chat_template = (HERE / f"{name}.jinja").read_text()
    return tok


def rendered(tok, messages: list[dict], tools: list[dict] | None = TOOLS, **kwargs) -> str:
    """The prompt the runtime builds (with the generation prompt), decoded with its special tokens."""
    return tok.decode(apply_chat_template(tok, messages, tools, kwargs or None), skip_special_tokens=False)


def written_turn(tok, name: str, messages: list[dict]) -> tuple[str, str]:
    """The prompt of ``messages`` (ending with a user's), and the text of the assistant turn that ``called`` adds after
    it as the template writes it: what follows the generation prompt (the prompt's text after the user's message, up
    to white space, which the templates lay out differently in the two places)."""
    prompt, with_calls = rendered(tok, messages), rendered(tok, messages + [called(name)])
    last = messages[-1]["content"]
    generation = prompt[prompt.rindex(last) + len(last):].split()
    rest = with_calls[with_calls.rindex(last) + len(last):]
    found = re.match(r"\s*" + r"\s*".join(map(re.escape, generation)), rest)
    assert found is not None, (generation, rest)
    return prompt, rest[found.end():]


def answer_of(tok, name: str, text: str, prompt: str) -> str:
    """The answer part of a model output ``text`` after ``prompt``, as the server splits it."""
    if TEMPLATES[name][2] is None:
        return text
    _, answer = Reasoning(inside=starts_inside(prompt[-200:])).split(text)
    assert answer is not None
    return answer


def test_every_template_file_is_listed_with_its_source():
    listed = (HERE / "SOURCES.md").read_text()
    assert sorted(p.stem for p in HERE.glob("*.jinja")) == sorted([*TEMPLATES, *ENCODINGS])
    assert all(f"`{name}.jinja`" in listed for name in [*TEMPLATES, *ENCODINGS])


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_parsers_are_chosen_from_the_template(name):
    template = (HERE / f"{name}.jinja").read_text()
    model_type, syntax, reasoning = TEMPLATES[name]
    assert renders_tools(template) is (name not in HIDES_TOOLS)
    assert choose_tool_parser("auto", model_type, template) == syntax
    assert choose_tool_parser("auto", None, template) == syntax  # the template alone decides
    assert choose_parser("auto", None, template) == reasoning


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_template_shows_the_tools(base_tokenizer, name):
    tok = tokenizer_for(base_tokenizer, name)
    prompt = rendered(tok, ASKED)
    for tool in TOOLS:
        shown = tool["function"]["name"] in prompt and tool["function"]["description"] in prompt
        assert shown is (name not in HIDES_TOOLS)
    assert "Weather in Paris?" in prompt and "Be brief." in prompt
    assert "get_weather" not in rendered(tok, ASKED, None)


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_chosen_parser_reads_the_calls_the_template_writes(base_tokenizer, name):
    """An earlier assistant turn with two calls, rendered by the template, is the text the model learnt to write: the
    parser chosen from the template reads it back as the same calls (after the thinking part, where there is one)."""
    tok = tokenizer_for(base_tokenizer, name)
    before, turn = written_turn(tok, name, ASKED)
    model_type, syntax, _ = TEMPLATES[name]
    template = tok.chat_template
    parser = make_parser(syntax, string_parameters(TOOLS))
    assert choose_tool_parser("auto", model_type, template) == syntax
    parsed = parser.parse(answer_of(tok, name, turn, before), True)
    assert parsed.started and not parsed.content.strip()
    assert [(c.name, json.loads(c.arguments), c.complete) for c in parsed.calls] == \
        [(n, a, True) for _, n, a in CALLS]


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_tools_results_follow_the_calls_in_order(base_tokenizer, name):
    tok = tokenizer_for(base_tokenizer, name)
    prompt = rendered(tok, ASKED + [called(name)] + answered(name))
    calls_at = rendered(tok, ASKED + [called(name)]).rindex("lookup")
    first, second = prompt.index(RESULTS[0]), prompt.index(RESULTS[1])
    assert calls_at < first < second


@pytest.mark.parametrize("name, kwargs, inside", [
    ("deepseek_v31", {}, False), ("deepseek_v31", {"thinking": True}, True),
    ("deepseek_v32", {}, False), ("deepseek_v32", {"thinking": True}, True),
    ("deepseek_v31_published", {}, False), ("deepseek_v31_published", {"thinking": True}, True),
    ("glm45", {}, False), ("glm45", {"enable_thinking": False}, False),
    ("glm46", {}, False), ("glm46", {"enable_thinking": False}, False),
    ("kimi_k2", {}, False),
])
def test_the_thinking_opens_where_the_template_opens_it(base_tokenizer, name, kwargs, inside):
    """DeepSeek-V3.1's generation prompt ends in ``<think>`` with ``thinking`` (the output begins inside the thinking)
    and in ``</think>`` without; GLM-4.5 leaves the model to open it, or closes it empty when thinking is off. A
    thinking output followed by calls splits into the reasoning and the calls."""
    tok = tokenizer_for(base_tokenizer, name)
    prompt = rendered(tok, ASKED, **kwargs)
    assert starts_inside(prompt[-200:]) is inside
    parser = make_parser(TEMPLATES[name][1])
    turn = written_turn(tok, name, ASKED)[1]
    calls = turn[turn.index(parser.begin):]
    thought = "" if "</think>" in prompt[-20:] else ("I should look it up.</think>\n" if inside else
                                                      "<think>I should look it up.</think>\n")
    reasoning, answer = Reasoning(inside).split(thought + calls)
    assert reasoning == ("I should look it up." if thought else None)
    parsed = parser.parse(answer or "", True)
    assert [c.name for c in parsed.calls] == ["get_weather", "lookup"] and parsed.content == ("\n" if thought else "")


def test_the_dsml_deepseek_v32_writes_is_read_back(base_tokenizer):
    """DeepSeek-V3.2 publishes a Python encoder for its DSML calls, not a chat template; a template reproducing it
    (``deepseek_v32_dsml.jinja``) shows the tools and writes an assistant turn's calls with each parameter marked as
    a string or not: the parsers chosen from it read them back, after the thinking the prompt opens."""
    tok = tokenizer_for(base_tokenizer, "deepseek_v32_dsml")
    template = tok.chat_template
    assert renders_tools(template) and choose_tool_parser("auto", None, template) == "deepseek_v32"
    assert choose_parser("auto", None, template) == "deepseek_r1"
    text = tok.apply_chat_template(template_messages(ASKED + [called("deepseek_v32")]), tools=TOOLS, tokenize=False,
                                   add_generation_prompt=False)
    asked, turn = text.split("Weather in Paris?<｜Assistant｜>", 1)
    assert all(t["function"]["description"] in asked for t in TOOLS) and starts_inside(turn[:len("<think>")])
    reasoning, answer = Reasoning(inside=True).split(turn[len("<think>"):])
    assert reasoning == "" and answer is not None and 'string="false">3<' in answer
    parsed = make_parser("deepseek_v32").parse(answer, True)
    assert [(c.name, json.loads(c.arguments), c.complete) for c in parsed.calls] == \
        [(n, a, True) for _, n, a in CALLS]


def test_arguments_reach_a_template_as_an_object_or_as_the_text_it_needs(base_tokenizer):
    """A template that iterates the arguments gets the object; one that joins them to text gets the client's text."""
    tok = copy.copy(base_tokenizer)
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x":  1}'}}]}
    tok.chat_template = ("{% for k, v in messages[0].tool_calls[0].function.arguments.items() %}{{ k }}={{ v }}"
                         "{% endfor %}")
    assert tok.decode(apply_chat_template(tok, [call])) == "x=1"
    tok.chat_template = "{{ '<' + messages[0].tool_calls[0].function.arguments + '>' }}"
    assert tok.decode(apply_chat_template(tok, [call])) == '<{"x":  1}>'
    kept = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}]
    assert template_messages(kept) == kept  # text that is not an object stays text
    assert template_messages(ASKED) == ASKED


def test_a_template_that_fails_on_the_messages_is_a_value_error(base_tokenizer):
    """Jinja's own errors and any error raised by the template's code (a string joined to null, ``items()`` of a
    text) are the template's failure: a ``ValueError`` (the server's 400), never a crash."""
    tok = copy.copy(base_tokenizer)
    tok.chat_template = "{{ 'x' + messages[0]['extra'] }}"
    with pytest.raises(ValueError, match="^the chat template failed"):
        apply_chat_template(tok, [{"role": "user", "content": "hi", "extra": None}])
    tok = tokenizer_for(base_tokenizer, "glm45")
    bad = {**called("glm45"), "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "oops"}}]}
    with pytest.raises(ValueError, match="^the chat template failed"):
        apply_chat_template(tok, ASKED + [bad], TOOLS)
