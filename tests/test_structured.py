"""Structured outputs and tool calls on the demo model: through the engine (batches mixed with unconstrained
requests, n > 1, speculative decoding, preemption) and through the official ``openai`` client (JSON schemas
validated with ``jsonschema``, regex and choice constraints, tool calls, errors in OpenAI's shape)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from mla_runtime import LLM, SamplingParams, StructuredOutputs
from mla_runtime.errors import InvalidParam
from mla_runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mla_runtime.serving.responses import Job, StreamState, chat_message
from mla_runtime.serving.tool_parsers import make_parser
from mla_runtime.serving.tools import ToolMode, calls_of_output
from tests.test_server import Live, wait_ready

DEMO = Path(__file__).resolve().parent.parent / "mla_runtime" / "demo_model"
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory="4MiB")
PROMPTS = ["def load(path):\n", "class Point:\n    def __init__(self, x, y):\n", "import os\n"]

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user"],
               "properties": {"user": {"type": "object", "required": ["id", "name"], "additionalProperties": False,
                                       "properties": {"id": {"type": "integer"},
                                                      "name": {"type": "string", "maxLength": 12}}}}},
    "array": {"type": "object", "required": ["tags"], "additionalProperties": False,
              "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                      "items": {"type": "string", "maxLength": 8}}}},
    "enum": {"type": "object", "required": ["mode", "level"], "additionalProperties": False,
             "properties": {"mode": {"enum": ["read", "write", "append"]},
                            "level": {"type": "string", "enum": ["low", "high"]}}},
    "bounded": {"type": "object", "required": ["age", "ratio"], "additionalProperties": False,
                "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                               "ratio": {"type": "number", "minimum": 0, "maximum": 1}}},
    "optional": {"type": "object", "required": ["path"], "additionalProperties": False,
                 "properties": {"path": {"type": "string", "maxLength": 16}, "size": {"type": "integer"},
                                "hidden": {"type": "boolean"}}},
    "closed": {"type": "object", "additionalProperties": False, "required": ["ok", "count"],
               "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0}}},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": SCHEMAS["enum"]}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": SCHEMAS["closed"]}}
GREEDY = dict(temperature=0, max_tokens=48)


def constrained(spec: StructuredOutputs, **kw) -> SamplingParams:
    return SamplingParams(**{**GREEDY, **kw}, structured_outputs=spec)


# -- engine -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    with LLM(str(DEMO), **ENGINE) as llm:
        yield llm


def test_mixed_batch_keeps_unconstrained_greedy_output_and_constrains_the_rest(llm):
    free = SamplingParams(**GREEDY, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free)]
    specs = [StructuredOutputs(json=SCHEMAS["nested"]), StructuredOutputs(regex=r"[a-z]{2,6}_[0-9]{1,3}"),
             StructuredOutputs(choice=["alpha", "beta", "gamma"])]
    outs = llm.generate(PROMPTS * 2, [free] * 3 + [constrained(s) for s in specs])
    assert [o.outputs[0].token_ids for o in outs[:3]] == alone
    value = json.loads(outs[3].outputs[0].text)
    jsonschema.validate(value, SCHEMAS["nested"])
    import re

    assert re.fullmatch(r"[a-z]{2,6}_[0-9]{1,3}", outs[4].outputs[0].text)
    assert outs[5].outputs[0].text in ("alpha", "beta", "gamma")
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[3:])  # ended at the grammar's end
    llm.engine.pool.check_whole()


def test_each_sample_follows_its_own_grammar_state(llm):
    spec = StructuredOutputs(json=SCHEMAS["array"])
    out = llm.generate([PROMPTS[0]], constrained(spec, n=3, temperature=1.0, seed=5))[0]
    values = [json.loads(c.text) for c in out.outputs]
    for v in values:
        jsonschema.validate(v, SCHEMAS["array"])
    assert len({json.dumps(v) for v in values}) > 1  # sampled, independently
    compiled = llm.engine.grammars.num_compiled
    llm.generate([PROMPTS[1]], constrained(StructuredOutputs(json=dict(SCHEMAS["array"]))))
    assert llm.engine.grammars.num_compiled == compiled  # the same schema is compiled once


def test_a_constraint_llguidance_refuses_names_its_field(llm):
    with pytest.raises(InvalidParam) as e:
        llm.generate(["x"], constrained(StructuredOutputs(json={"type": "strin"})))
    assert e.value.param == "structured_outputs"
    with pytest.raises(InvalidParam):
        llm.generate(["x"], constrained(StructuredOutputs(regex="[a-")))
    with pytest.raises(InvalidParam):
        StructuredOutputs(json={"type": "object"}, regex="a")
    llm.engine.pool.check_whole()


@pytest.mark.parametrize("extra", [dict(num_speculative_tokens=4),
                                   dict(max_model_len=128, block_size=16, kv_cache_memory=10 * 16 * 144 * 4 * 4)])
def test_speculative_decoding_and_preemption_keep_constrained_tokens(llm, extra):
    """Drafts are cut to what the grammar accepts before they are verified; a preempted sequence is recomputed
    with its grammar state intact. Either way the greedy tokens are plain decoding's."""
    schema = {"type": "array", "maxItems": 6, "items": SCHEMAS["closed"]}  # repeated keys: drafts get accepted
    params = [constrained(StructuredOutputs(json=schema), max_tokens=60), SamplingParams(**GREEDY, ignore_eos=True)]
    prompts = PROMPTS[:2] * 2
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params * 2)]
    with LLM(str(DEMO), **{**ENGINE, **extra}) as other:
        got = [o.outputs[0].token_ids for o in other.generate(prompts, params * 2)]
        stats = other.engine.stats()
        other.engine.pool.check_whole()
    assert got == plain
    if "num_speculative_tokens" in extra:
        assert stats.num_accepted_tokens > 0
    else:
        assert stats.num_preemptions > 0


def test_drafts_are_cut_to_the_grammars_prefix(llm):
    state = llm.engine.grammars.new_state(StructuredOutputs(choice=["ab", "cd"]))
    tok = llm.engine.tokenizer
    good = tok.encode("ab", add_special_tokens=False)
    assert state.valid_prefix(good + tok.encode("zz", add_special_tokens=False)) == good
    assert state.valid_prefix(tok.encode("zz", add_special_tokens=False)) == []


# -- the OpenAI API, through the openai client --------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    live = Live(DEMO, engine=dict(kv_cache_memory="4MiB"), wait=False)
    wait_ready(live.base, timeout=600)  # a loaded machine takes its time
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "def f(x):"}],
                                          **{"temperature": 0, "max_tokens": 64, **kw})


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_validates(client, name):
    r = chat(client, response_format={"type": "json_schema",
                                      "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.refusal is None
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_object_on_completions_and_streamed_chat(client):
    r = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=64, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMAS["enum"]}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["enum"])
    r = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=16, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text  # any object: the demo model's keys run long, so it may be cut by max_tokens
    assert isinstance(json.loads(text), dict) if r.choices[0].finish_reason == "stop" else text.startswith('{"')
    stream = chat(client, stream=True, response_format={"type": "json_schema", "json_schema": {
        "name": "b", "schema": SCHEMAS["bounded"]}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS["bounded"])


def test_regex_and_choice_on_every_route(server, client):
    r = chat(client, extra_body={"guided_regex": r"\d{3}-[A-Z]{2}"})
    assert __import__("re").fullmatch(r"\d{3}-[A-Z]{2}", r.choices[0].message.content)
    r = client.completions.create(model="tiny", prompt="x =", max_tokens=8, temperature=0, n=2, seed=3,
                                  extra_body={"structured_outputs": {"choice": ["True", "False", "None"]}})
    assert {c.text for c in r.choices} <= {"True", "False", "None"}
    g = httpx.post(server.base + "/generate", json={"prompt": "x =", "max_tokens": 8, "temperature": 0,
                                                    "guided_choice": ["yes", "no"]}).json()
    assert g["text"] in ("yes", "no") and g["finish_reason"] == "stop"
    g = httpx.post(server.base + "/generate", json={"prompt": "x =", "max_tokens": 12, "temperature": 0,
                                                    "structured_outputs": {"grammar": 'start: "f(" NUM ")"\n'
                                                                                      'NUM: /[0-9]{1,3}/'}}).json()
    assert __import__("re").fullmatch(r"f\([0-9]{1,3}\)", g["text"])


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_come_back_as_tool_calls(client, stream):
    for choice, names in ((({"type": "function", "function": {"name": "get_weather"}}), {"get_weather"}),
                          ("required", {"get_weather", "lookup"})):
        # one call: the demo model, free to add calls, repeats its first one until max_tokens
        r = chat(client, tools=[WEATHER, LOOKUP], tool_choice=choice, stream=stream, parallel_tool_calls=False)
        if stream:
            chunks = [c for c in r if c.choices]
            calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
            assert not "".join(c.choices[0].delta.content or "" for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
            assert r.choices[0].message.content is None
        assert reason == "tool_calls" and calls
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
            schema = WEATHER if call.function.name == "get_weather" else LOOKUP
            jsonschema.validate(json.loads(call.function.arguments), schema["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_cut_by_max_tokens_finishes_with_length_and_its_partial_arguments(client, stream):
    for choice, max_tokens in (({"type": "function", "function": {"name": "get_weather"}}, 6), ("required", 20)):
        r = chat(client, tools=[WEATHER, LOOKUP], tool_choice=choice, stream=stream, parallel_tool_calls=False,
                 max_tokens=max_tokens)
        if stream:
            chunks = [c for c in r if c.choices]
            assert not "".join(c.choices[0].delta.content or "" for c in chunks)  # never the JSON as content
            calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
            reason = chunks[-1].choices[0].finish_reason
        else:
            message = r.choices[0].message
            assert message.content is None
            calls, reason = message.tool_calls, r.choices[0].finish_reason
        assert reason == "length" and len(calls) == 1, (choice, calls)
        call = calls[0]
        assert call.function.name == "get_weather" and call.function.arguments.startswith('{"mode')
        with pytest.raises(json.JSONDecodeError):  # what was written so far: it does not parse
            json.loads(call.function.arguments)
    r = chat(client, tools=[WEATHER, LOOKUP], tool_choice="required", max_tokens=3)  # cut before any name
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None
    assert not r.choices[0].message.tool_calls


def test_cut_tool_calls_keep_every_named_call():
    mode = ToolMode("required")
    calls, complete = calls_of_output(mode, '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y')
    assert not complete and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("a", '{"x": 1}'), ("b", '{"y')]
    assert calls_of_output(mode, '[{"name": "a", "para')[0][0]["function"]["arguments"] == ""
    assert calls_of_output(mode, '[{"name": "a')[0] == []
    calls, complete = calls_of_output(mode, '[{"name": "a", "parameters": {}}]')
    assert complete and calls[0]["function"]["arguments"] == "{}"
    calls, complete = calls_of_output(ToolMode("named", name="f"), '{"x": ')
    assert not complete and calls[0]["function"] == {"name": "f", "arguments": '{"x": '}
    v3 = ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
          '{"city": "Par')
    parsed = make_parser("deepseek_v3").parse(v3, False)
    assert parsed.content == "Checking."
    assert [(c.name, c.arguments, c.complete) for c in parsed.calls] == [("get_weather", '{"city": "Par', False)]
    unnamed = "Hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_wea"
    assert make_parser("deepseek_v3").parse(unnamed, False).calls == []
    v31 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>lookup<｜tool▁sep｜>{"ok": tr'
    assert make_parser("deepseek_v31").parse(v31, False).calls[0].arguments == '{"ok": tr'


def test_an_auto_answer_cut_short_keeps_its_text_as_content_and_its_call():
    raw = "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>lookup<｜tool▁sep｜>{\"ok\": tr"
    job = Job("chat", [{"prompt_token_ids": [1]}], SamplingParams(max_tokens=9), "m",
              tools=ToolMode("auto", syntax="deepseek_v31"), raw_text=lambda ids: raw)
    cut = CompletionOutput(0, "Checking.lookup{\"ok\": tr", [1, 7, 2], "length")
    message, reason = chat_message(job, cut)
    assert reason == "length" and message["content"] == "Checking."
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "lookup", "arguments": '{"ok": tr'}]
    out = RequestOutput("r", None, [1], [cut], True, RequestMetrics(0.0))
    events = [json.loads(e[6:]) for e in StreamState(job).chunks(out) if e.startswith(b"data: {")]
    deltas = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Checking."
    assert deltas[-1]["finish_reason"] == "length"
    assert deltas[-1]["delta"]["tool_calls"][0]["function"]["name"] == "lookup"


def test_openai_errors_name_the_field(client, server):
    cases = [(dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
              "response_format"),
             (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
             (dict(tools=[WEATHER]), "tool_choice"),  # "auto": the demo template has no tool-call format
             (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
             (dict(extra_body={"guided_regex": "a", "guided_choice": ["a"]}), "guided_choice"),
             (dict(extra_body={"best_of": 3}), "best_of"),
             (dict(modalities=["text", "audio"]), "modalities"),
             (dict(temperature="hot"), "temperature")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                           **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)
        assert e.value.body["code"] is None or isinstance(e.value.body["code"], str)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", suffix="y")
    assert e.value.body["param"] == "suffix"
    models = client.models.list().data
    assert models[0].created > 1_700_000_000
    g = httpx.post(server.base + "/generate", json={"prompt": "x", "guided_json": {"type": "strin"}})
    assert g.status_code == 400 and g.json()["error"]["param"] == "guided_json"


def test_assistant_tool_call_history_is_accepted(client):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert r.choices[0].message.role == "assistant"


# -- DeepSeek-V3 tool-call syntax ---------------------------------------------------------------------
def test_deepseek_tool_calls_parse_in_both_layouts():
    v3 = ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
          '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>lookup\n```json\n'
          '{"ok": true}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    parsed = make_parser("deepseek_v3").parse(v3, True)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments), c.complete) for c in parsed.calls] == \
        [("get_weather", {"city": "Paris"}, True), ("lookup", {"ok": True}, True)]
    v31 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
    parsed = make_parser("deepseek_v31").parse(v31, True)
    assert parsed.content == "" and json.loads(parsed.calls[0].arguments) == {"city": "Oslo"}
    assert make_parser("deepseek_v31").parse("plain text", True).content == "plain text"
    broken = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{not json<｜tool▁call▁end｜>"
    assert make_parser("deepseek_v31").parse(broken, True).calls[0].arguments == "{not json"  # as written
