"""The agent APIs: OpenAI's Responses API (``POST /v1/responses``) and Anthropic's Messages API (``POST /v1/messages``),
through the official ``openai`` and ``anthropic`` clients against a live server on the demo model: text, streamed or
not, equal to the chat route's answer; forced tool calls and their results fed back; ``previous_response_id`` and the
bound of the store; the API key (bearer or ``x-api-key``); bad input answered 400 naming the field, in each API's
error shape; thinking as a ``reasoning`` item and a ``thinking`` block; metrics labels and freed cache blocks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from mla_runtime import SamplingParams
from mla_runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mla_runtime.serving.anthropic_messages import MessagesStream
from mla_runtime.serving.openai_responses import ResponsesJob, ResponsesStream
from mla_runtime.serving.reasoning import Reasoning
from mla_runtime.serving.responses import Job
from mla_runtime.tokenizer import apply_chat_template
from tests.test_reasoning import thinking_server  # noqa: F401 - a fixture
from tests.test_server import Live, requests_total, wait_idle, wait_ready

DEMO = Path(__file__).resolve().parent.parent / "mla_runtime" / "demo_model"
KEY = "sk-agents"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENUM = {"type": "object", "required": ["mode", "level"], "additionalProperties": False,
        "properties": {"mode": {"enum": ["read", "write", "append"]},
                       "level": {"type": "string", "enum": ["low", "high"]}}}
PROMPT = "def f(x):"
STORE = 3
GREEDY = {"temperature": 0}  # the anthropic client leaves sampling fields to extra_body


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    server = Live(DEMO, engine=dict(kv_cache_memory="4MiB"), wait=False, api_key=KEY, metrics_auth=True,
                  responses_store=STORE)
    wait_ready(server.base, timeout=600)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oai(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(live) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.base, api_key=KEY, max_retries=0)


def chat_text(oai: openai.OpenAI, messages: list[dict], max_tokens: int = 12) -> str | None:
    r = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_an_agent_stream_reads_the_chat_stream_without_decoding_json(api, monkeypatch):
    """Each API's stream takes the chat stream's deltas as data, not as the JSON text the chat route sends: no JSON
    is decoded, and each event's JSON is encoded once."""
    kind, stream = (ResponsesJob, ResponsesStream) if api == "responses" else (Job, MessagesStream)
    job = kind(api, [{"prompt_token_ids": [1]}], SamplingParams(max_tokens=64), "m", request_id=f"{api}_1",
               reasoning=Reasoning(inside=True))
    decoded, encoded, real_loads, real_dumps = [], [], json.loads, json.dumps
    monkeypatch.setattr(json, "loads", lambda *a, **k: decoded.append(a) or real_loads(*a, **k))
    monkeypatch.setattr(json, "dumps", lambda *a, **k: encoded.append(a) or real_dumps(*a, **k))
    state, text, events = stream(job), "", []
    pieces = ["Two and", " two.", "</think>", "Four", " it is."]
    for k, piece in enumerate(pieces):
        text += piece
        last = k == len(pieces) - 1
        c = CompletionOutput(0, text, list(range(k + 1)), "stop" if last else None)
        events += state.chunks(RequestOutput("r", None, [1], [c], last, RequestMetrics(0.0)))
    assert decoded == [] and len(encoded) == len(events)
    deltas = [real_loads(e.split(b"data: ", 1)[1]) for e in events]
    said = "".join(d.get("delta", "") if isinstance(d.get("delta"), str) else d.get("delta", {}).get("text", "")
                   for d in deltas)
    assert said.endswith("Four it is.")


# -- /v1/responses -------------------------------------------------------------------------------------
def test_responses_text_equals_the_chat_answer_streamed_or_not(oai):
    want = chat_text(oai, [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}])
    r = oai.responses.create(model="tiny", input=PROMPT, instructions="be brief", max_output_tokens=12,
                             temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == want
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and r.usage.total_tokens == r.usage.input_tokens + 12
    events = list(oai.responses.create(model="tiny", input=[{"role": "developer", "content": "be brief"}, {
        "role": "user", "content": [{"type": "input_text", "text": PROMPT}]}], max_output_tokens=12, temperature=0,
        stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want == events[-1].response.output_text


def test_responses_forced_function_calls_and_their_output_fed_back(oai):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": ENUM}]
    for stream in (False, True):
        kw = dict(model="tiny", input="weather?", tools=tools, tool_choice={"type": "function", "name": "get_weather"},
                  max_output_tokens=64, temperature=0)
        if stream:
            events = list(oai.responses.create(**kw, stream=True))
            args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            done = next(e for e in events if e.type == "response.function_call_arguments.done")
            assert done.arguments == args and done.name == "get_weather"
            r = events[-1].response
            assert events[-1].type == "response.completed"
        else:
            r = oai.responses.create(**kw)
        calls = [i for i in r.output if i.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), ENUM)
    follow = oai.responses.create(model="tiny", previous_response_id=r.id, max_output_tokens=4, temperature=0, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.previous_response_id == r.id and follow.output[0].type == "message"
    again = oai.responses.create(model="tiny", max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert again.output_text == follow.output_text  # the same conversation, given in full


def test_previous_response_id_continues_and_the_store_is_bounded(oai, live):
    first = oai.responses.create(model="tiny", input="hello", max_output_tokens=6, temperature=0)
    second = oai.responses.create(model="tiny", input="and then?", previous_response_id=first.id,
                                  max_output_tokens=6, temperature=0)
    want = chat_text(oai, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first.output_text},
                           {"role": "user", "content": "and then?"}], 6)
    assert second.output_text == want and second.usage.input_tokens > first.usage.input_tokens
    unkept = oai.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    for _ in range(STORE):
        oai.responses.create(model="tiny", input="filler", max_output_tokens=2)
    for gone in (first.id, unkept.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as e:
            oai.responses.create(model="tiny", input="x", previous_response_id=gone, max_output_tokens=2)
        assert e.value.body["param"] == "previous_response_id"
    assert len(live.app.state.server.responses) == STORE


@pytest.mark.parametrize("body, param", [
    ({"input": 5}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "web_search_call"}]}, "input.0.type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "model": "other"}, "model"),
])
def test_responses_bad_input_is_a_400_naming_the_field(live, body, param):
    r = httpx.post(live.base + "/v1/responses", json=body, headers=AUTH, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err


# -- /v1/messages --------------------------------------------------------------------------------------
def test_messages_text_equals_the_chat_answer_streamed_or_not(oai, claude):
    want = chat_text(oai, [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}])
    m = claude.messages.create(model="tiny", max_tokens=12, extra_body=GREEDY, system="be brief",
                               messages=[{"role": "user", "content": PROMPT}])
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want
    assert m.usage.output_tokens == 12 and m.usage.input_tokens > 0
    with claude.messages.stream(model="tiny", max_tokens=12, extra_body=GREEDY,
                                system=[{"type": "text", "text": "be brief"}],
                                messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == want and final.stop_reason == "max_tokens" and final.usage.output_tokens == 12


def test_messages_stop_sequences_say_which_one_stopped(claude):
    m = claude.messages.create(model="tiny", max_tokens=24, extra_body=GREEDY, messages=[{"role": "user",
                                                                                     "content": PROMPT}])
    text = m.content[0].text
    stop = text[3:5]  # a piece of the greedy answer: it stops there
    m = claude.messages.create(model="tiny", max_tokens=24, extra_body=GREEDY, stop_sequences=["zzz", stop],
                               messages=[{"role": "user", "content": PROMPT}])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == text[:text.index(stop)]


def test_messages_forced_tool_use_and_the_result_fed_back(claude):
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": ENUM}]
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}):
        m = claude.messages.create(model="tiny", max_tokens=64, extra_body=GREEDY, tools=tools, tool_choice=choice,
                                   messages=[{"role": "user", "content": "weather?"}])
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
        jsonschema.validate(m.content[0].input, ENUM)
        with claude.messages.stream(model="tiny", max_tokens=64, extra_body=GREEDY, tools=tools, tool_choice=choice,
                                    messages=[{"role": "user", "content": "weather?"}]) as s:
            events = list(s)
            streamed = s.get_final_message()
        assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
        assert streamed.stop_reason == "tool_use" and streamed.content[0].input == m.content[0].input
    use = m.content[0]
    # the demo model's template has no tool-call format of its own: "auto" is refused there, as on chat
    follow = claude.messages.create(model="tiny", max_tokens=4, extra_body=GREEDY, tools=tools,
                                    tool_choice={"type": "none"}, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"},
                                     {"type": "text", "text": "so?"}]}])
    assert follow.content and follow.content[0].type == "text"


@pytest.mark.parametrize("body, says", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens: Field required"),
    ({"max_tokens": 4, "messages": []}, "messages: List should have at least 1 item"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content.0: "),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages.0.content.0.tool_use_id: required"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature: "),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]}, "system.0: "),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool", "name": "n"}},
     "tool_choice.name: must name one of tools"),
    ({"max_tokens": 10**6, "messages": [{"role": "user", "content": "x"}]}, "max_tokens: the prompt has"),
])
def test_messages_bad_input_is_a_400_in_anthropics_shape(live, body, says):
    r = httpx.post(live.base + "/v1/messages", json={"model": "tiny", **body}, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith(says), r.json()


def test_the_anthropic_client_sees_its_errors(claude):
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        claude.messages.create(model="tiny", max_tokens=4, extra_body={"temperature": 3},
                               messages=[{"role": "user", "content": "x"}])


# -- both ----------------------------------------------------------------------------------------------
def test_both_routes_need_the_key_and_are_counted_and_free_their_blocks(live):
    bodies = {"/v1/responses": {"input": "x", "max_output_tokens": 2},
              "/v1/messages": {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}}
    for path, body in bodies.items():
        r = httpx.post(live.base + path, json=body, timeout=60)
        assert r.status_code == 401, r.text
        shape = r.json()["error"]
        assert shape["type"] == "authentication_error" and "API key" in shape["message"]
        for headers in (AUTH, {"x-api-key": KEY}):
            assert httpx.post(live.base + path, json=body, headers=headers, timeout=60).status_code == 200
        with httpx.stream("POST", live.base + path, json={**body, "stream": True}, headers=AUTH, timeout=60) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            next(s.iter_lines())  # then the client goes away mid-stream
    m = wait_idle(live)
    for endpoint in ("responses", "messages"):
        assert requests_total(m, "unauthorized", endpoint) >= 1 and requests_total(m, "success", endpoint) >= 2
    assert m[("mla_latent_cache_blocks_used",)] == 0


def test_a_kept_response_is_retrieved_and_deleted_through_the_client(oai, live):
    """``client.responses.retrieve`` returns the response as it was answered (streamed or not); ``delete`` forgets it,
    after which retrieving, deleting or continuing it is a 404 in OpenAI's shape naming ``response_id``; a response
    made with ``store: false`` was never kept. Both are behind the API key and counted under their own labels."""
    before = live.metrics()
    made = oai.responses.create(model="tiny", input="hello", max_output_tokens=4, temperature=0)
    got = oai.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    events = list(oai.responses.create(model="tiny", input="hi", max_output_tokens=3, temperature=0, stream=True))
    final = events[-1].response
    assert oai.responses.retrieve(final.id).model_dump() == final.model_dump()
    assert oai.responses.delete(made.id) is None
    unkept = oai.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    for gone in (made.id, unkept.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as e:
            oai.responses.retrieve(gone)
        assert e.value.body["param"] == "response_id" and gone in e.value.body["message"]
        assert e.value.body["type"] and "code" in e.value.body
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model="tiny", input="x", previous_response_id=made.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    url = f"{live.base}/v1/responses/{final.id}"
    assert httpx.get(url, timeout=10).status_code == 401 and httpx.delete(url, timeout=10).status_code == 401
    r = httpx.get(url, params={"stream": "true"}, headers=AUTH, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    after = live.metrics()
    for endpoint, outcome, more in (("responses_retrieve", "success", 2), ("responses_retrieve", "invalid", 4),
                                    ("responses_retrieve", "unauthorized", 1), ("responses_delete", "success", 1),
                                    ("responses_delete", "invalid", 1), ("responses_delete", "unauthorized", 1)):
        assert requests_total(after, outcome, endpoint) - requests_total(before, outcome, endpoint) == more


def test_both_routes_are_in_the_openapi_document(live):
    doc = httpx.get(live.base + "/openapi.json", headers=AUTH).json()
    for path, model in (("/v1/responses", "ResponsesRequest"), ("/v1/messages", "MessagesRequest")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(f"/{model}")
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"bearer": []} in doc["paths"]["/v1/messages"]["post"]["security"]
    assert {"api_key": []} in doc["paths"]["/v1/messages"]["post"]["security"]
    assert doc["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]["schema"][
        "$ref"].endswith("/AnthropicError")
    kept = doc["paths"]["/v1/responses/{response_id}"]
    for method, model in (("get", "ResponseObject"), ("delete", "ResponseDeleted")):
        assert kept[method]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert kept[method]["responses"]["404"]["content"]["application/json"]["schema"]["$ref"].endswith("/Error")
        assert kept[method]["security"] == [{"bearer": []}] and kept[method]["parameters"][0]["in"] == "path"


# -- thinking --------------------------------------------------------------------------------------------
def test_thinking_is_a_reasoning_item_and_a_thinking_block(thinking_server):  # noqa: F811 - the fixture
    live = thinking_server
    ids = apply_chat_template(live.app.state.runtime.tokenizer, [{"role": "user", "content": "two and two?"}], None,
                              {"thinking": True})
    text = httpx.post(live.base + "/v1/completions", json={"prompt": ids, "max_tokens": 16, "temperature": 0},
                      timeout=60).json()["choices"][0]["text"]
    thought, answer = Reasoning(inside=True).split(text)
    assert thought

    oai = openai.OpenAI(base_url=live.base + "/v1", api_key="unused", max_retries=0)
    r = oai.responses.create(model="tiny", input="two and two?", reasoning={"effort": "high"}, max_output_tokens=16,
                             temperature=0)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == thought
    assert (r.output_text or None) == (answer or None)
    events = list(oai.responses.create(model="tiny", input="two and two?", reasoning={"effort": "high"},
                                       max_output_tokens=16, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought

    claude = anthropic.Anthropic(base_url=live.base, api_key="unused", max_retries=0)
    kw = dict(model="tiny", max_tokens=16, extra_body=GREEDY, thinking={"type": "enabled", "budget_tokens": 1024},
              messages=[{"role": "user", "content": "two and two?"}])
    m = claude.messages.create(**kw)
    assert m.content[0].type == "thinking" and m.content[0].thinking == thought
    with claude.messages.stream(**kw) as s:
        deltas = [e.delta.thinking for e in s if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    assert "".join(deltas) == thought
