"""The models' tool-call syntaxes (``serving/tool_parsers.py``): each parsed whole, streamed a character at a time and
in random pieces (the deltas add up to the whole parse, no marker leaks into content), cut short, several calls, text
before and after; the work of streaming them counted; the parser chosen from the model; and ``tool_choice: "auto"``
end to end through the server for GLM's, Kimi-K2's and MiniCPM3's syntaxes."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator

import httpx
import pytest

from mla_runtime import SamplingParams
from mla_runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mla_runtime.serving.reasoning import Reasoning
from mla_runtime.serving.responses import Job, StreamState, chat_message
from mla_runtime.serving.tool_parsers import TOOL_CALL_PARSERS, ToolStream, choose_tool_parser, make_parser
from mla_runtime.serving.tools import ToolMode
from tests.checkpoints import byte_tokenizer, chat_checkpoint
from tests.test_server import Live

WEATHER = ("get_weather", {"city": "Paris", "days": 3})
LOOKUP = ("lookup", {"q": "a < b", "ok": True})


def v3(name: str, args: dict) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(args)}\n```<｜tool▁call▁end｜>"


def v31(name: str, args: dict) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(args)}<｜tool▁call▁end｜>"


def dsml(name: str, args: dict) -> str:
    params = "".join(f'<｜DSML｜parameter name="{k}" string="{str(isinstance(v, str)).lower()}">'
                     f'{v if isinstance(v, str) else json.dumps(v)}</｜DSML｜parameter>\n' for k, v in args.items())
    return f'<｜DSML｜invoke name="{name}">\n{params}</｜DSML｜invoke>\n'


def kimi(index: int):
    def call(name: str, args: dict) -> str:
        return (f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{json.dumps(args)}"
                f"<|tool_call_end|>")
    return call


def glm(name: str, args: dict) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                    for k, v in args.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def mistral(name: str, args: dict) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(args)}"


def minicpm3(calls: list[tuple[str, dict]]) -> str:
    """MiniCPM3's block, as its template writes earlier calls: keyword arguments whose values are JSON."""
    lines = "".join(f"{n}({','.join(f'{k}={json.dumps(v)}' for k, v in a.items())})\n" for n, a in calls)
    return "<|tool_call_start|>\n```python\n" + lines + "```\n<|tool_call_end|>\n"


def hermes(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>\n'


def wrap(syntax: str, calls: list[tuple[str, dict]]) -> str:
    """The model's text for ``calls`` in ``syntax``."""
    if syntax == "deepseek_v3":
        return "<｜tool▁calls▁begin｜>" + "\n".join(v3(*c) for c in calls) + "<｜tool▁calls▁end｜>"
    if syntax == "deepseek_v31":
        return "<｜tool▁calls▁begin｜>" + "".join(v31(*c) for c in calls) + "<｜tool▁calls▁end｜>"
    if syntax == "deepseek_v32":
        return "\n\n<｜DSML｜function_calls>\n" + "".join(dsml(*c) for c in calls) + "</｜DSML｜function_calls>"
    if syntax == "deepseek_v4":
        return "\n\n<｜DSML｜tool_calls>\n" + "".join(dsml(*c) for c in calls) + "</｜DSML｜tool_calls>"
    if syntax == "kimi_k2":
        body = "".join(kimi(i)(*c) for i, c in enumerate(calls))
        return "<|tool_calls_section_begin|>" + body + "<|tool_calls_section_end|>"
    if syntax == "minicpm3":
        return minicpm3(calls)
    if syntax == "mistral_old":
        return "[TOOL_CALLS][" + ", ".join(json.dumps({"name": n, "arguments": a}) for n, a in calls) + "]"
    one = {"glm45": glm, "mistral": mistral, "hermes": hermes,
           "longcat": lambda n, a: hermes(n, a).replace("tool_call>", "longcat_tool_call>"),
           "longcat_tags": lambda n, a: re.sub(r"<(/?)(tool_call|arg_key|arg_value)>", r"<\1longcat_\2>",
                                               glm(n, a))}[syntax]
    return "\n".join(one(*c) for c in calls)


SYNTAXES = ["deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4", "kimi_k2", "glm45", "mistral", "mistral_old",
            "minicpm3", "hermes", "longcat", "longcat_tags"]
PARSER_OF = {"mistral_old": "mistral", "longcat_tags": "longcat"}  # a syntax's second layout, read by the same parser


def parser(syntax: str):
    return make_parser(PARSER_OF.get(syntax, syntax))


def whole(syntax: str, text: str, end: bool = True) -> tuple[str, list[tuple[str, str, bool]]]:
    parsed = parser(syntax).parse(text, end)
    return parsed.content, [(c.name, c.arguments, c.complete) for c in parsed.calls]


def streamed(syntax: str, text: str, sizes: Iterator[int], end: bool = True) -> tuple[str, list[dict]]:
    """The content and the ``delta.tool_calls`` entries of ``text`` growing by ``sizes`` (each piece fed as the
    server feeds it), then the parse of the whole text at its end."""
    p, pos = parser(syntax), 0
    stream = ToolStream(p)
    content, entries = "", []
    while pos < len(text):
        step = next(sizes)
        c, e = stream.feed(text[pos:pos + step])
        content, entries, pos = content + c, entries + e, pos + step
    named = [n for n, _ in joined(entries)]
    c, e = stream.update(p.parse(text, end))
    assert named == [n for n, _ in joined(entries + e)]  # every call was announced while it streamed
    return content + c, entries + e


def joined(entries: list[dict]) -> list[tuple[str, str]]:
    """The calls a client assembles from the entries: each index's name, and its argument pieces joined."""
    calls: dict[int, list[str]] = {}
    for e in entries:
        if "id" in e:
            assert e["index"] == len(calls) and e["type"] == "function" and e["function"]["arguments"] == ""
            calls[e["index"]] = [e["function"]["name"], ""]
        else:
            assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
            calls[e["index"]][1] += e["function"]["arguments"]
    return [(n, a) for n, a in calls.values()]


def sizes_of(kind: str, seed: int) -> Iterator[int]:
    rng = random.Random(seed)
    while True:
        yield 1 if kind == "chars" else rng.randint(1, 12)


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_calls_parse_whole_with_the_text_before_them_as_content(syntax):
    text = "Let me check." + wrap(syntax, [WEATHER, LOOKUP])
    content, calls = whole(syntax, text)
    assert content == "Let me check." + ("\n\n" if syntax == "deepseek_v32" else "")
    assert [(n, json.loads(a), done) for n, a, done in calls] == \
        [("get_weather", WEATHER[1], True), ("lookup", LOOKUP[1], True)]
    assert whole(syntax, "no calls at all < [ here")[0] == "no calls at all < [ here"


@pytest.mark.parametrize("kind", ["chars", "random"])
@pytest.mark.parametrize("syntax", SYNTAXES)
@pytest.mark.parametrize("after", ["", " and text after the calls"])
def test_a_streamed_answer_adds_up_to_the_whole_parse(syntax, kind, after):
    """A character at a time (every marker split) or in random pieces: the content deltas and the calls assembled
    from the entries equal the whole parse; no marker piece reaches the content."""
    text = "Sure: <tool" + wrap(syntax, [WEATHER, LOOKUP]) + after
    content, calls = whole(syntax, text)
    for seed in range(3):
        got_content, entries = streamed(syntax, text, sizes_of(kind, seed))
        assert got_content == content
        assert joined(entries) == [(n, a) for n, a, _ in calls]
        if kind == "chars":
            break


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_an_answer_cut_short_keeps_every_named_call_and_the_arguments_so_far(syntax):
    """Cut anywhere (``max_tokens``): never an error; the content is the text before the calls, complete calls are
    whole, the last one incomplete with a prefix of its arguments; the stream of the cut answer adds up to it."""
    text = "Hi." + wrap(syntax, [WEATHER, LOOKUP])
    final = whole(syntax, text)[1]
    for cut in range(len(text)):
        content, calls = whole(syntax, text[:cut], end=False)
        assert content == text[:min(cut, 3)].rstrip("<[") or syntax == "deepseek_v32"
        for k, (name, args, done) in enumerate(calls):
            assert name == final[k][0] and final[k][1].startswith(args)
            assert done or k == len(calls) - 1
        got_content, entries = streamed(syntax, text[:cut], sizes_of("random", cut), end=False)
        assert (got_content, joined(entries)) == (content, [(n, a) for n, a, _ in calls])


def test_kimi_calls_keep_their_own_ids_and_mistral_ids_are_nine_characters():
    stream = ToolStream(make_parser("kimi_k2"))
    _, entries = stream.update(make_parser("kimi_k2").parse(wrap("kimi_k2", [WEATHER, LOOKUP]), True))
    assert [e["id"] for e in entries if "id" in e] == ["functions.get_weather:0", "functions.lookup:1"]
    stream = ToolStream(make_parser("mistral"))
    _, entries = stream.update(make_parser("mistral").parse(wrap("mistral", [WEATHER]), True))
    assert len(entries[0]["id"]) == 9 and entries[0]["id"].isalnum()
    parsed = make_parser("mistral").parse('[TOOL_CALLS]f[CALL_ID]abc123XYZ[ARGS]{"a": 1}', True)
    assert parsed.calls[0].id == "abc123XYZ" and parsed.calls[0].arguments == '{"a": 1}'


def test_glm_values_are_json_where_they_parse_unless_the_schema_says_string():
    text = glm("f", {"n": 3, "flag": True, "s": "Paris", "zip": "75001", "obj": {"a": [1]}})
    assert json.loads(make_parser("glm45").parse(text, True).calls[0].arguments) == \
        {"n": 3, "flag": True, "s": "Paris", "zip": 75001, "obj": {"a": [1]}}
    typed = make_parser("glm45", frozenset({("f", "zip")})).parse(text, True)
    assert json.loads(typed.calls[0].arguments)["zip"] == "75001"
    compact = "<tool_call>f<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>"  # GLM-4.7's layout
    assert make_parser("glm45").parse(compact, True).calls[0].arguments == '{"x": 1}'


def test_dsml_string_flag_decides_how_a_value_is_read():
    text = ('<｜DSML｜function_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="a" string="true">42'
            '</｜DSML｜parameter><｜DSML｜parameter name="b" string="false">42</｜DSML｜parameter></｜DSML｜invoke>'
            '</｜DSML｜function_calls>')
    assert json.loads(make_parser("deepseek_v32").parse(text, True).calls[0].arguments) == {"a": "42", "b": 42}


@pytest.mark.parametrize("syntax, text", [
    ("hermes", '<tool_call>not a call</tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>' + "x" * 200),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>not_function<｜tool▁sep｜>f\n```json\n{}\n```"
                    "<｜tool▁call▁end｜>" + "x" * 200),
])
def test_no_call_is_read_after_one_that_is_no_call_and_the_stream_stops_reading(syntax, text):
    assert whole(syntax, text) == ("", [])
    stream = ToolStream(parser(syntax))
    element = len(text) - 200
    assert [stream.feed(ch) for ch in text[:element]] == [("", [])] * element
    read = stream.read
    assert [stream.feed(ch) for ch in text[element:]] == [("", [])] * 200
    assert stream.read == read  # the text after the element that is no call is not read


def test_a_mistral_call_ends_with_the_output_or_the_next_call():
    text = '[TOOL_CALLS]f[ARGS]{"a": 1}'
    assert make_parser("mistral").parse(text, True).calls[0].complete
    assert not make_parser("mistral").parse(text, False).calls[0].complete  # cut by max_tokens: may go on


def test_minicpm3_thought_is_content_without_its_markers_and_python_literals_are_read():
    """The thought the template asks for before the calls streams as content, its markers never; values written as
    Python literals (quotes, ``True``, ``None``) or JSON read the same, commas and brackets inside a value are not
    separators, and a positional argument (no name) is left out."""
    calls = ("get_weather(city='Paris, (FR)', days=3, [1, 2], flags={'a': [True, None]})\n"
             'lookup(q="a < b", ok=true)\n')
    text = ("<|thought_start|>\nI need the weather.\n<|thought_end|>\n<|tool_call_start|>\n```python\n" + calls
            + "```\n<|tool_call_end|>\nI will report back.")
    content, found = whole("minicpm3", text)
    assert content == "I need the weather.\n"
    assert [(n, json.loads(a), done) for n, a, done in found] == [
        ("get_weather", {"city": "Paris, (FR)", "days": 3, "flags": {"a": [True, None]}}, True),
        ("lookup", {"q": "a < b", "ok": True}, True)]
    for kind in ("chars", "random"):
        got_content, entries = streamed("minicpm3", text, sizes_of(kind, 5))
        assert got_content == content and joined(entries) == [(n, a) for n, a, _ in found]
    assert whole("minicpm3", "<|thought_start|>\nNo call needed.\n<|thought_end|>\nIt is 4.") == \
        ("No call needed.\nIt is 4.", [])
    assert whole("minicpm3", "<|thought_start|>\nthinking so far <|thought", end=False)[0] == "thinking so far "


def stream_tokens(job: Job, pieces: list[str], reason: str = "stop") -> list[dict]:
    """The chat chunks of an output of ``pieces`` (token ``i`` is ``pieces[i]``) growing a token at a time."""
    state, events, text = StreamState(job), [], ""
    for k, piece in enumerate(pieces):
        text += piece
        last = k == len(pieces) - 1
        c = CompletionOutput(0, text, list(range(k + 1)), reason if last else None)
        events += state.payloads(RequestOutput("r", None, [1], [c], last, RequestMetrics(0.0)))
    job.last_state = state  # type: ignore[attr-defined]
    return [e["choices"][0] for e in events if isinstance(e, dict) and e["choices"]]


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_a_streamed_auto_answer_is_decoded_and_parsed_in_linear_work(syntax):
    """Streamed a token at a time, a long answer (thinking, text, many calls, text after them) has each token decoded
    a bounded number of times, and its text handed to the tool-call parser once, but for the call being written,
    which is read again with each token until it is complete: the work grows with the answer's length (times the
    longest call's), not with its square. The streamed answer is the non-streamed one."""
    calls = [(f"tool_{k}", {"k": k, "s": "x" * (k % 7)}) for k in range(60)]
    after = "" if syntax == "mistral" else " And words after them." * 150  # a Mistral call runs to the end
    text = "I should look.</think>" + "Some words before the calls. " * 150 + wrap(syntax, calls) + after
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    decoded = [0]

    def raw_text(ids: list[int]) -> str:
        decoded[0] += len(ids)
        return "".join(pieces[i] for i in ids)

    job = Job("chat", [{"prompt_token_ids": [1]}], SamplingParams(max_tokens=len(pieces)), "m", raw_text=raw_text,
              tools=ToolMode("auto", syntax=PARSER_OF.get(syntax, syntax)), reasoning=Reasoning(inside=True))
    deltas = stream_tokens(job, pieces)
    whole_message, reason = chat_message(job, CompletionOutput(0, text, list(range(len(pieces))), "stop"))
    entries = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == whole_message["content"]
    assert joined(entries) == [(t["function"]["name"], t["function"]["arguments"])
                               for t in whole_message["tool_calls"]]
    assert deltas[-1]["finish_reason"] == reason == "tool_calls"
    tokens, chars = len(pieces), len(text)
    assert decoded[0] <= 6 * tokens  # each token in about three windows, and the whole once at the end (twice here)
    longest_call, call_tokens = max(len(wrap(syntax, [c])) for c in calls), len(wrap(syntax, calls)) // 4 + 1
    read = job.last_state.tool_streams[0].read  # type: ignore[attr-defined]
    assert read <= 2 * chars + call_tokens * longest_call < tokens * chars // 50  # the square's fiftieth


@pytest.mark.parametrize("model_type, template, syntax", [
    ("deepseek_v3", "{% if tools %}<｜tool▁calls▁begin｜>function<｜tool▁sep｜>```json{% endif %}", "deepseek_v3"),
    ("deepseek_v3", "{% if tools %}<｜tool▁calls▁begin｜>{{ name }}<｜tool▁sep｜>{% endif %}", "deepseek_v31"),
    ("deepseek_v32", None, "deepseek_v32"),
    ("deepseek_v4", None, "deepseek_v4"),
    ("deepseek_v32", "{{ '<｜DSML｜tool_calls>' }}<｜DSML｜invoke", "deepseek_v4"),
    ("kimi_k25", "<|tool_calls_section_begin|>", "kimi_k2"),
    ("kimi_k2", None, "kimi_k2"),
    ("glm_moe_dsa", "<tool_call>{{ name }}<arg_key>", "glm45"),
    ("glm4_moe_lite", None, "glm45"),
    ("mistral4", "[TOOL_CALLS]", "mistral"),
    ("mistral_large4_text", None, "mistral"),
    ("longcat_flash", None, "longcat"),
    (None, "<longcat_tool_call>{{ name }}<longcat_arg_key>{{ k }}</longcat_arg_key>", "longcat"),
    ("minicpm3", "<tool_call>", "hermes"),
    ("minicpm3", None, "minicpm3"),
    ("minicpm3", "<|tool_call_start|>\n```python\n", "minicpm3"),
    ("youtu", {"default": "x", "tool_use": "<tool_call>"}, "hermes"),
])
def test_the_syntax_is_chosen_from_the_template_then_the_model_type(model_type, template, syntax):
    assert choose_tool_parser("auto", model_type, template) == syntax


def test_the_setting_overrides_the_model_and_unknown_names_are_refused():
    assert choose_tool_parser("glm45", "deepseek_v3", "<｜tool▁calls▁begin｜>") == "glm45"
    assert choose_tool_parser("none", "deepseek_v3", "<｜tool▁calls▁begin｜>") is None
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, deepseek_v3"):
        choose_tool_parser("qwen", None, None)
    for name in TOOL_CALL_PARSERS:
        if name not in ("auto", "none"):
            assert make_parser(name).name == name


# -- end to end: tool_choice "auto" through the server, in GLM's, Kimi-K2's and MiniCPM3's syntaxes ---------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
# a template that shows the tools and says how GLM writes calls (so that auto picks glm45)
TOOL_TEMPLATE = ("{{ bos_token }}{% if tools %}{{ '# tools: ' + (tools | map(attribute='function') | "
                 "map(attribute='name') | join(',')) + '\\n' }}{% endif %}{% for message in messages %}"
                 "{{ '# ' + message['role'] + ':\\n' + (message['content'] or '') + '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}"
                 "{# calls: <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call> #}")
OUTPUTS = {
    "glm45": "Checking. <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
             "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    "kimi_k2": "Checking. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
               '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>',
    "minicpm3": 'Checking. <|tool_call_start|>\n```python\nget_weather(city="Paris",days=3)\n```\n<|tool_call_end|>\n',
}


@pytest.fixture(scope="module")
def tool_checkpoint(tmp_path_factory):
    """A tiny V3 model with a byte-level tokenizer (any text can be written) and ``TOOL_TEMPLATE``."""
    tok = byte_tokenizer(list(OUTPUTS.values()) * 20, 400, template=TOOL_TEMPLATE)
    return chat_checkpoint(tmp_path_factory.mktemp("tool_ckpt"), tok)


@pytest.fixture(scope="module", params=["glm45", "kimi_k2", "minicpm3"])
def tool_server(request, tool_checkpoint) -> Iterator[tuple[str, Live]]:
    """GLM's syntax chosen from the template (``auto``), Kimi-K2's and MiniCPM3's set by ``--tool-call-parser``."""
    setting = "auto" if request.param == "glm45" else request.param
    live = Live(tool_checkpoint, engine={"max_model_len": 512}, tool_call_parser=setting)
    yield request.param, live
    live.stop()


def tool_chat(live: Live, output: str, **body) -> dict:
    """A chat whose output is ``output``, written by the model under a choice constraint."""
    body = {"messages": [{"role": "user", "content": "weather in Paris?"}], "tools": TOOLS, "temperature": 0,
            "max_tokens": 300, "structured_outputs": {"choice": [output]}, **body}
    if not body.get("stream"):
        r = httpx.post(live.base + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    with httpx.stream("POST", live.base + "/v1/chat/completions", json=body, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0] for e in events if e["choices"]]
    entries = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
    ids = [t["id"] for t in entries if "id" in t]
    calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
             for i, (n, a) in zip(ids, joined(entries))]
    return {"message": {"content": "".join(d["delta"].get("content") or "" for d in deltas) or None,
                        "tool_calls": calls}, "finish_reason": deltas[-1]["finish_reason"]}


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_returns_the_models_calls_in_its_own_syntax(tool_server, stream):
    syntax, live = tool_server
    choice = tool_chat(live, OUTPUTS[syntax], stream=stream)
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] == "Checking. "
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    if syntax == "kimi_k2":
        assert call["id"] == "functions.get_weather:0"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_finishes_with_length_and_its_arguments_so_far(tool_server, stream):
    syntax, live = tool_server
    full = tool_chat(live, OUTPUTS[syntax])["message"]["tool_calls"][0]["function"]["arguments"]
    cut = OUTPUTS[syntax][:OUTPUTS[syntax].index("days")]  # inside the second argument
    tokens = len(live.app.state.runtime.tokenizer.encode(cut, add_special_tokens=False))
    choice = tool_chat(live, OUTPUTS[syntax], stream=stream, max_tokens=tokens)
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "Checking. "
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert full.startswith(call["function"]["arguments"]) and call["function"]["arguments"] != full


def test_tool_call_parser_none_refuses_auto(tool_checkpoint):
    live = Live(tool_checkpoint, tool_call_parser="none")
    try:
        r = httpx.post(live.base + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        r = httpx.post(live.base + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "max_tokens": 40,
            "tool_choice": "required"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"], r.text
    finally:
        live.stop()
