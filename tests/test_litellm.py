"""litellm, the client library many agent frameworks call models through, against a live server: OpenAI chat
completions with tools (``tool_choice: "auto"`` in GLM's syntax, parsed by the server), whole and streamed, read
back as litellm reads OpenAI's; and Anthropic's Messages route through litellm's ``anthropic_messages``. litellm is in
the ``test`` extra; its import takes several seconds."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator

import httpx
import pytest

from tests.test_server import Live
from tests.test_tool_parsers import OUTPUTS, TOOLS, tool_checkpoint  # noqa: F401 - a fixture

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else its import fetches a price list from the network
litellm = pytest.importorskip("litellm", reason="litellm is in the test extra: pip install -e '.[test]'")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # litellm's own typed dicts warn under pydantic
KEY = "sk-litellm"
WEATHER = {"city": "Paris", "days": 3}


@pytest.fixture(scope="module")
def server(tool_checkpoint) -> Iterator[Live]:  # noqa: F811 - the fixture
    live = Live(tool_checkpoint, engine={"max_model_len": 512}, api_key=KEY)
    yield live
    live.stop()


def test_chat_completions_with_tools_whole_and_streamed(server):
    """The model writes GLM's call (a choice constraint makes it); litellm gets it as an OpenAI tool call."""
    kw = dict(model="openai/tiny", api_base=server.base + "/v1", api_key=KEY, temperature=0, max_tokens=300,
              messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS,
              extra_body={"structured_outputs": {"choice": [OUTPUTS["glm45"]]}})
    whole = litellm.completion(**kw)
    built = litellm.stream_chunk_builder(list(litellm.completion(**kw, stream=True)))
    for r in (whole, built):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking. "
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == WEATHER


def test_anthropic_messages_through_litellm(server):
    """litellm's Anthropic Messages client reaches /v1/messages: the answer is the route's own, and a forced tool is
    a tool_use block."""
    body = {"max_tokens": 6, "messages": [{"role": "user", "content": "weather?"}], "temperature": 0}
    want = httpx.post(server.base + "/v1/messages", json={"model": "tiny", **body}, timeout=60,
                      headers={"x-api-key": KEY}).json()
    got = asyncio.run(litellm.anthropic_messages(model="anthropic/tiny", api_base=server.base, api_key=KEY, **body))
    assert got["type"] == "message" and got["content"] == want["content"] and got["stop_reason"] == "max_tokens"
    tool = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
    called = asyncio.run(litellm.anthropic_messages(
        model="anthropic/tiny", api_base=server.base, api_key=KEY, tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"}, **{**body, "max_tokens": 120}))
    [use] = [b for b in called["content"] if b["type"] == "tool_use"]
    assert use["name"] == "get_weather" and set(use["input"]) <= {"city", "days"}
