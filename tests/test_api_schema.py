"""The HTTP API's contract: ``/openapi.json`` and ``/docs`` (every route, its request and answer schemas, the
error shape, the API key), a schemathesis fuzz of every operation against a live server on the demo model, and the
request shapes operators use (``max_length``, limits that cannot fit ``max_model_len``).

The fuzzed server keeps ``max_model_len`` at 64 so that a generated request is small whatever its fields; the
fuzzed copy of the document also caps ``max_tokens`` and ``n`` (the live document does not), so a run takes seconds.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from mla_runtime.serving.app import router
from mla_runtime.serving.config import ServerConfig
from mla_runtime.serving.openapi import DOCS_ASSETS, docs_asset, openapi_schema
from tests.test_server import Live, assert_error, wait_idle, wait_ready

DEMO = Path(__file__).resolve().parent.parent / "mla_runtime" / "demo_model"
KEY = "sk-schema"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 64
BODIES = {"/generate": "GenerateRequest", "/v1/completions": "CompletionRequest",
          "/v1/chat/completions": "ChatRequest"}


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    server = Live(DEMO, engine=dict(kv_cache_memory="4MiB", max_model_len=MAX_MODEL_LEN), wait=False, api_key=KEY,
                  metrics_auth=True, request_timeout=30.0)
    wait_ready(server.base, timeout=600)
    yield server
    server.stop()


def post(live: Live, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.base + path, json=body, headers=AUTH, timeout=60)


# -- the document ------------------------------------------------------------------------------------
def test_openapi_lists_every_route_with_its_schemas_behind_the_key(live):
    assert_error(httpx.get(live.base + "/openapi.json"), 401, "API key")
    assert_error(httpx.get(live.base + "/docs"), 401, "API key")
    doc = httpx.get(live.base + "/openapi.json", headers=AUTH).json()
    routes = {(r.path, m.lower()) for r in router.routes if isinstance(r, APIRoute) for m in r.methods}
    assert routes == {(p, m) for p, item in doc["paths"].items() for m in item}
    schemas = doc["components"]["schemas"]
    for path, model in BODIES.items():
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(f"/{model}")
        assert {"200", "400", "401", "413", "429", "500", "503", "504"} <= set(op["responses"])
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert op["security"] == [{"bearer": []}]
        assert op["responses"]["429"]["content"]["application/json"]["schema"]["$ref"].endswith("/Error")
    assert {"max_length", "max_tokens", "prompt"} <= set(schemas["GenerateRequest"]["properties"])
    assert schemas["GenerateRequest"]["additionalProperties"] is False  # /generate refuses unknown fields
    assert schemas["ErrorDetail"]["required"] == ["message", "type", "code", "param"]
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer",
                                                              "description": "The server's --api-key"}
    assert "security" not in doc["paths"]["/health"]["get"] and "security" not in doc["paths"]["/ready"]["get"]
    assert doc["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]  # metrics_auth
    page = httpx.get(live.base + "/docs", headers=AUTH)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "SwaggerUIBundle" in page.text and '"/v1/chat/completions"' in page.text  # the document is inline
    # offline: every script and stylesheet comes from this server (the installed package), none from a CDN, and
    # they load without the key (library code: a browser sends none)
    linked = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(linked) == ["/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css"]
    for path in linked:
        got = httpx.get(live.base + path)
        name = path.rsplit("/", 1)[1]
        assert got.status_code == 200 and got.headers["content-type"] == DOCS_ASSETS[name]
        assert got.content == docs_asset(name) and len(got.content) > 10_000
    assert b"SwaggerUIBundle" in httpx.get(live.base + "/docs/swagger-ui-bundle.js").content
    assert_error(httpx.get(live.base + "/docs/openapi.json"), 404, "no asset 'openapi.json'")


def test_without_a_key_the_document_declares_no_security():
    doc = openapi_schema(ServerConfig())
    assert "securitySchemes" not in doc["components"]
    assert all("security" not in op and "401" not in op["responses"]
               for item in doc["paths"].values() for op in item.values())


# -- fuzzing -------------------------------------------------------------------------------------------
def bounded(doc: dict[str, Any]) -> dict[str, Any]:
    """The document with small output limits, for fuzzing on 2 CPU cores."""
    doc = copy.deepcopy(doc)
    for model in BODIES.values():
        props = doc["components"]["schemas"][model]["properties"]
        for name in ("max_tokens", "max_completion_tokens", "max_length"):
            if name in props:
                _cap(props[name], 8 if name != "max_length" else MAX_MODEL_LEN)
        _cap(props["n"], 2)
    return doc


def _cap(prop: dict[str, Any], most: int) -> None:
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") == "integer":
            branch["maximum"] = most


def test_schemathesis_finds_no_server_error_and_the_server_stays_ready(live):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    doc = bounded(httpx.get(live.base + "/openapi.json", headers=AUTH).json())
    schema = schemathesis.openapi.from_dict(doc)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    for result in schema.get_all_operations():
        op = result.ok()
        examples = 40 if op.method.upper() == "POST" else 5  # the generation routes are where the bugs hide

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=st.one_of([op.as_strategy(mode) for mode in schemathesis.GenerationMode]))
        def fuzz(case: Any) -> None:
            case.validate_response(case.call(base_url=live.base, headers=AUTH, timeout=60), checks=checks)

        fuzz()
    assert httpx.get(live.base + "/ready").status_code == 200
    assert wait_idle(live)[("mla_latent_cache_blocks_used",)] == 0


def test_what_the_fuzzer_found_stays_fixed(live):
    # a top_k beyond int64 once killed the engine thread (every request then got 503)
    r = post(live, "/generate", {"prompt": "x", "top_k": 2**90, "max_tokens": 2})
    assert r.status_code == 200, r.text  # above every vocabulary: every token is kept, as with -1
    # token ids outside the vocabulary once reached the tokenizer's decoder (echo) and answered 500
    for prompt in ([5, -3], [[2**70]]):
        r = post(live, "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 1})
        assert_error(r, 400, "prompt: token ids must be integers in [0, ")
    assert httpx.get(live.base + "/health").status_code == 200


# -- request shapes --------------------------------------------------------------------------------------
def test_max_length_counts_the_prompt_as_transformers_does(live):
    prompt = "解释KV Cache的作用："
    r = post(live, "/generate", {"prompt": prompt, "max_length": 40, "temperature": 0.7, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["total_tokens"] == 40 and r.json()["finish_reason"] == "length"
    length = usage["prompt_tokens"]
    both = post(live, "/generate", {"prompt": prompt, "max_length": 40, "max_tokens": 3, "ignore_eos": True})
    assert both.json()["usage"]["completion_tokens"] == 3  # the tighter limit wins
    both = post(live, "/generate", {"prompt": prompt, "max_length": length + 2, "max_tokens": 30, "ignore_eos": True})
    assert both.json()["usage"]["completion_tokens"] == 2
    short = post(live, "/generate", {"prompt": prompt, "max_length": length})
    assert_error(short, 400, f"the prompt already has {length}")
    assert short.json()["error"]["param"] == "max_length"
    assert_error(post(live, "/generate", {"prompt": prompt, "max_length": MAX_MODEL_LEN + 1}), 400,
                 f"exceeds max_model_len ({MAX_MODEL_LEN})")


@pytest.mark.parametrize("path,field", [("/generate", "max_tokens"), ("/v1/completions", "max_tokens"),
                                        ("/v1/chat/completions", "max_tokens"),
                                        ("/v1/chat/completions", "max_completion_tokens")])
def test_a_limit_that_cannot_fit_max_model_len_is_refused_naming_the_numbers(live, path, field):
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                            else {"prompt": "def f(x):"})
    r = post(live, path, {**body, field: MAX_MODEL_LEN})
    assert_error(r, 400, f"exceeds max_model_len ({MAX_MODEL_LEN})")
    err = r.json()["error"]
    assert err["param"] == field and f"{field} is {MAX_MODEL_LEN}" in err["message"]
    room = int(err["message"].split("at most ")[1].split()[0])
    ok = post(live, path, {**body, field: room, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] == MAX_MODEL_LEN


def test_a_default_limit_is_never_refused_and_stops_at_max_model_len(live):
    long = "def f(x): return x " * 7  # 51 tokens of the 64: the default 16 does not fit
    r = post(live, "/generate", {"prompt": long, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["finish_reason"] == "length" and body["usage"]["total_tokens"] == MAX_MODEL_LEN
    chat = post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["usage"]["total_tokens"] == MAX_MODEL_LEN


def test_unknown_generate_fields_are_still_refused(live):
    assert_error(post(live, "/generate", {"prompt": "x", "max_new_tokens": 5}), 400, "max_new_tokens: unknown field")


def test_sse_answers_are_declared_as_event_streams(live):
    with httpx.stream("POST", live.base + "/generate", json={"prompt": "x", "max_tokens": 2, "stream": True},
                      headers=AUTH) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and all("token_ids" in json.loads(e) for e in events[:-1])
