"""The HTTP server, end to end: real uvicorn servers on free 127.0.0.1 ports, real HTTP clients.

Two in-process servers share a tiny random DeepSeek-V3 checkpoint that has a byte-level BPE tokenizer
(so text prompts and arbitrary Unicode work): ``server`` with generous limits, and ``strict`` with an API
key, ``max_num_seqs=2``, ``max_queue=2``, a short ``request_timeout`` and a small body limit. A third
server runs as a subprocess to check the start-up log and SIGTERM. Cache blocks are checked through
``/metrics`` the way an operator would see a leak.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from mla_runtime import LLM, SamplingParams
from mla_runtime.engine.config import EngineConfig
from mla_runtime.serving.app import build_app
from mla_runtime.serving.config import ServerConfig
from mla_runtime.serving.protocol import ERROR_CODES
from mla_runtime.serving.server import Server, uvicorn_config
from tests.checkpoints import build_hf_model, save_checkpoint

ROOT = Path(__file__).resolve().parent.parent
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '# ' + message['role'] + ':\\n' + "
                 "message['content'] + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '# assistant:\\n' }}"
                 "{% endif %}")
ENGINE = dict(dtype="float32", max_model_len=256, block_size=16, kv_cache_memory="8MiB")
API_KEY = "sk-test-key"
UNICODE = 'héllo 世界 🚀👩‍👩‍👧 "quoted" \\back\\slash\n\ttab \u0000nul עברית e\u0301 <|eos|> {"json": [1]}'
WORDS = ["def", "class", "return", "import", "the", "fox", "data", "loop", "世界", "🚀", "λ", "(", ")", ":", "\n"]


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory) -> Path:
    """The v3 test model with its vocabulary resized to a byte-level BPE tokenizer trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|bos|>", "<|eos|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def hello(world):\n    return world + 1\n", "the quick brown fox jumps"] * 20, trainer)
    hf = build_hf_model("v3")
    hf.resize_token_embeddings(tok.get_vocab_size(), mean_resizing=False)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # well-separated logits, as in the other engine tests
        for w in (hf.model.embed_tokens.weight, hf.lm_head.weight):
            w.copy_(0.08 * torch.randn(w.shape, generator=g))
    path = save_checkpoint(hf, tmp_path_factory.mktemp("text_ckpt"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """A uvicorn server in a background thread; ``sndbuf``: the kernel send buffer of its connections (bytes;
    default: the kernel's autotuning, up to several MB on loopback)."""

    def __init__(self, ckpt: Path, engine: dict | None = None, wait: bool = True, on_fatal=None,
                 sndbuf: int | None = None, **server: object) -> None:
        import uvicorn

        sock = socket.socket()
        if sndbuf is not None:  # inherited by accepted connections
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        config = ServerConfig(port=port, served_model_name="tiny", **server)
        self.app = build_app(EngineConfig(model=str(ckpt), **{**ENGINE, **(engine or {})}), config, on_fatal)
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.metrics_auth else {}
        self.server = uvicorn.Server(uvicorn_config(self.app, config, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        if wait:
            wait_ready(self.base)

    @property
    def llm(self):
        return self.app.state.runtime.llm

    def metrics(self) -> dict[tuple, float]:
        return parse_metrics(httpx.get(self.base + "/metrics", headers=self.headers).text)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def wait_ready(base: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc is None or proc.poll() is None, "the server process exited during start-up"
        try:
            if httpx.get(base + "/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base} not ready after {timeout} s")


def parse_metrics(text: str) -> dict[tuple, float]:
    """{(sample name, (label, value)...): value}."""
    return {(s.name, *sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def requests_total(m: dict, outcome: str, endpoint: str = "generate") -> float:
    return m[("mla_requests_total", ("endpoint", endpoint), ("outcome", outcome))]


def wait_idle(live: Live, timeout: float = 15.0) -> dict:
    """Poll /metrics until no request is running or holding a block; return the last scrape."""
    end = time.monotonic() + timeout
    while True:
        m = live.metrics()
        if (m[("mla_latent_cache_blocks_used",)] == 0 and m[("mla_running_sequences",)] == 0
                and m[("mla_queue_depth",)] == 0 and m[("mla_requests_in_flight",)] == 0):
            return m
        assert time.monotonic() < end, f"blocks not freed: {m[('mla_latent_cache_blocks_used',)]} used"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(text_checkpoint) -> Iterator[Live]:
    live = Live(text_checkpoint)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def strict(text_checkpoint) -> Iterator[Live]:
    live = Live(text_checkpoint, engine={"max_num_seqs": 2}, max_queue=2, request_timeout=3.0, api_key=API_KEY,
                max_body_bytes=4096)
    yield live
    live.stop()


@contextlib.contextmanager
def slowed(live: Live, delay: float) -> Iterator[None]:
    """Every engine step of ``live`` takes at least ``delay`` s, so requests overlap deterministically."""
    def hook(engine, outputs) -> None:
        time.sleep(delay)

    live.llm.step_hooks.append(hook)
    try:
        yield
    finally:
        live.llm.step_hooks.remove(hook)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def assert_error(r: httpx.Response, status: int, field: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == ERROR_CODES.get(status)  # a string or null
    assert field in err["message"], err


# -- probes and metrics -----------------------------------------------------------------------------
def test_health_ready_models_and_metrics_names(server):
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    assert httpx.get(server.base + "/ready").status_code == 200
    models = httpx.get(server.base + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 256
    m = server.metrics()
    info = server.llm.engine.info()
    assert m[("mla_memory_bytes", ("part", "weights"))] == info.weight_bytes > 0
    assert m[("mla_memory_bytes", ("part", "latent_cache"))] == info.cache_bytes > 0
    assert m[("mla_memory_bytes", ("part", "activations_reserve"))] > 0
    assert m[("mla_memory_bytes", ("part", "state_cache"))] == 0  # no linear-attention layers
    assert m[("mla_latent_cache_bytes_per_token",)] == info.cache_bytes_per_token > 0
    assert m[("mla_state_cache_bytes_per_sequence",)] == 0
    assert m[("mla_latent_cache_blocks_total",)] == info.num_blocks
    assert m[("mla_latent_cache_capacity_tokens",)] == info.max_concurrent_tokens
    assert m[("process_resident_memory_bytes",)] > 0 and m[("mla_ready",)] == 1
    names = {k[0] for k in m}
    for name in ("mla_queue_depth", "mla_running_sequences", "mla_latent_cache_usage_ratio",
                 "mla_prefix_cache_hit_rate", "mla_preemptions_total", "mla_time_to_first_token_seconds_bucket",
                 "mla_time_per_output_token_seconds_bucket", "mla_e2e_request_latency_seconds_bucket",
                 "mla_prompt_tokens_total", "mla_generation_tokens_total", "mla_spec_draft_tokens_total",
                 "mla_spec_accepted_tokens_total"):
        assert name in names, name


def test_ready_is_503_until_loaded_and_a_dead_engine_fails_health(text_checkpoint, monkeypatch):
    import mla_runtime.serving.runtime as runtime

    gate = threading.Event()

    class GatedAsyncLLM(runtime.AsyncLLM):  # loading "takes" until the test opens the gate
        def __init__(self, *args, **kwargs) -> None:
            assert gate.wait(60)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(runtime, "AsyncLLM", GatedAsyncLLM)
    live = Live(text_checkpoint, wait=False)
    try:
        while True:  # uvicorn is up long before the engine
            try:
                assert httpx.get(live.base + "/health").json() == {"status": "ok"}
                break
            except httpx.TransportError:
                time.sleep(0.05)
        assert_error(httpx.get(live.base + "/ready"), 503, "loading weights")
        assert_error(httpx.post(live.base + "/generate", json={"prompt": "x"}), 503, "not ready")
        gate.set()
        wait_ready(live.base)

        def crash(engine, outputs) -> None:
            raise RuntimeError("simulated device fault")

        live.llm.step_hooks.append(crash)
        for r in (httpx.post(live.base + "/generate", json={"prompt": "x", "max_tokens": 2}),
                  httpx.get(live.base + "/health")):
            assert_error(r, 503, "engine failed")
            assert "simulated device fault" not in r.text  # internal exception text stays in the log
        assert httpx.get(live.base + "/ready").status_code == 503
    finally:
        gate.set()
        live.stop()


# -- OpenAI compatibility ---------------------------------------------------------------------------
def test_openai_client_completes_and_streams(server):
    import openai

    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    kw = dict(model="tiny", prompt="def hello(", max_tokens=6, temperature=0)
    done = client.completions.create(**kw)
    assert done.object == "text_completion" and done.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens > 0

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 🚀"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.total_tokens == (
        chat.usage.prompt_tokens + chat.usage.completion_tokens)
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == chat.choices[0].finish_reason

    with pytest.raises(openai.NotFoundError, match="model"):
        client.completions.create(model="other", prompt="x", max_tokens=1)


def test_logit_bias_repetition_penalty_and_min_tokens_over_http(server):
    import openai

    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    biased = client.completions.create(model="tiny", prompt="def hello(", max_tokens=4, temperature=0, logprobs=0,
                                       logit_bias={"42": 100})
    assert len(biased.choices[0].logprobs.tokens) == 4
    r = httpx.post(server.base + "/generate", json={"prompt": "def hello(", "max_tokens": 4, "temperature": 0,
                                                   "logit_bias": {"42": 100}, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["token_ids"] == [42] * 4
    r = httpx.post(server.base + "/generate", json={"prompt": "def hello(", "max_tokens": 8, "temperature": 0,
                                                   "repetition_penalty": 1.3, "min_tokens": 8})
    assert r.status_code == 200 and len(r.json()["token_ids"]) == 8


def test_openai_logprobs_in_both_shapes_streamed_or_not(server):
    """Completions (``logprobs: k``) and chat (``logprobs`` + ``top_logprobs``) return one entry per generated
    token; greedy tokens are their position's most likely; streamed entries concatenate to the full answer."""
    import openai

    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    kw = dict(model="tiny", prompt="def hello(", max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    done = client.completions.create(**{k: v for k, v in kw.items() if k != "ignore_eos"},
                                     extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == done.usage.completion_tokens == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and value <= 0 and max(top.values()) == top[token] == pytest.approx(value, abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chunks = list(client.completions.create(**{k: v for k, v in kw.items() if k != "ignore_eos"}, stream=True,
                                            extra_body={"ignore_eos": True}))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    offsets = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset

    messages = [{"role": "user", "content": "héllo 🚀"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                                 logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e.logprob for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-6)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


# -- correctness under concurrency ------------------------------------------------------------------
def test_64_concurrent_requests_equal_one_by_one_greedy(server, text_checkpoint):
    import random

    rng = random.Random(0)
    prompts = ["".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(1, 40)))
               for _ in range(64)]
    before = server.metrics()

    async def send_all() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.base, timeout=120) as client:
            rs = await asyncio.gather(*(client.post("/generate", json={"prompt": p, "max_tokens": 6,
                                                                       "temperature": 0}) for p in prompts))
        assert [r.status_code for r in rs] == [200] * 64, [r.text for r in rs if r.status_code != 200]
        return [r.json() for r in rs]

    got = asyncio.run(send_all())
    llm = LLM(str(text_checkpoint), **ENGINE)
    for p, g in zip(prompts, got):
        ref = llm.generate(p, SamplingParams(max_tokens=6, temperature=0.0))[0]
        assert g["token_ids"] == ref.outputs[0].token_ids and g["text"] == ref.outputs[0].text
        assert g["finish_reason"] == ref.outputs[0].finish_reason
        assert g["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
        assert g["usage"]["total_tokens"] == len(ref.prompt_token_ids) + len(ref.outputs[0].token_ids)

    after = wait_idle(server)
    assert requests_total(after, "success") - requests_total(before, "success") == 64
    for name, key in (("mla_prompt_tokens_total", "prompt_tokens"),
                      ("mla_generation_tokens_total", "completion_tokens")):
        assert after[(name,)] - before[(name,)] == sum(g["usage"][key] for g in got)
    ttft = ("mla_time_to_first_token_seconds_count",)
    assert after[ttft] - before[ttft] == 64


def test_multi_turn_chat_reuses_the_prefix(server):
    first = [{"role": "user", "content": "def hello(world): return world + 1 " * 8}]
    r1 = httpx.post(server.base + "/v1/chat/completions",
                    json={"messages": first, "max_tokens": 8, "temperature": 0}).json()
    second = first + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "and again"}]
    r2 = httpx.post(server.base + "/v1/chat/completions",
                    json={"messages": second, "max_tokens": 8, "temperature": 0}).json()
    full_blocks = r1["usage"]["prompt_tokens"] // 16 * 16
    assert r2["usage"]["prompt_tokens"] > r1["usage"]["prompt_tokens"]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= full_blocks - 16 > 0


# -- bad input --------------------------------------------------------------------------------------
BAD = [  # (path, body, status, what the message must name)
    ("/generate", b"{not json", 400, "JSON"),
    ("/generate", b"[1, 2]", 400, "body"),
    ("/generate", {}, 400, "prompt"),
    ("/generate", {"prompt": ""}, 400, "prompt"),
    ("/generate", {"prompt": "fox " * 300}, 400, "max_model_len"),
    ("/generate", {"prompt": [1, 2, 99999]}, 400, "prompt: token ids must be integers in [0, "),
    ("/generate", {"prompt": 5}, 400, "prompt"),
    ("/generate", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/generate", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/generate", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/generate", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/generate", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/generate", {"prompt": "x", "temperature": float("nan")}, 400, "temperature: must be a finite number, got nan"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": float("inf")}, 400,
     "top_p: must be a finite number, got inf"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"5": float("nan")}}, 400,
     "logit_bias.5: must be a finite number"),
    ("/generate", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/generate", {"prompt": "x", "top_k": 0}, 400, "top_k"),
    ("/generate", {"prompt": "x", "seed": "s"}, 400, "seed"),
    ("/generate", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/generate", {"prompt": "x", "stop": [3]}, 400, "stop"),
    ("/generate", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/generate", {"prompt": "x", "max_new_tokens": 10}, 400, "max_new_tokens"),
    ("/generate", {"prompt": "x", "max_length": 1}, 400, "max_length"),
    ("/generate", b'{"prompt": "\\ud800"}', 400, "surrogate"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", ""]}, 400, "prompt"),  # one prompt of the batch is empty
    ("/generate", b"[" * 100_000, 400, "nested"),
    ("/generate", b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", 400, "body"),
    ("/generate", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/generate", {"prompt": "x", "frequency_penalty": "high"}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"5": 300}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/generate", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/generate", {"prompt": "x", "min_tokens": 50, "max_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 2, "echo": True}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
]


def test_the_error_names_the_field_the_client_sent(server):
    """Token ids outside the vocabulary came in ``prompt`` (the engine's own name for them is prompt_token_ids), and a
    NaN temperature is not a number, whatever its range: the error's ``param`` says so."""
    for path, body, param, message in [
            ("/generate", {"prompt": [1, 2, 99999]}, "prompt", "prompt: token ids must be integers in [0, 301)"),
            ("/v1/completions", {"model": "tiny", "prompt": [[3], [-1]]}, "prompt",
             "prompt: token ids must be integers in [0, 301)"),
            ("/generate", {"prompt": "x", "temperature": float("nan")}, "temperature",
             "temperature: must be a finite number, got nan")]:
        r = httpx.post(server.base + path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["message"]) == (param, message)


def test_every_bad_input_gets_a_json_error_naming_it_and_the_server_stays_ready(server):
    before = server.metrics()
    with httpx.Client(base_url=server.base) as client:
        for path, body, status, field in BAD:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = client.post(path, content=content, headers={"Content-Type": "application/json"})
            assert_error(r, status, field)
        assert_error(client.get("/no/such/route"), 404, "/no/such/route")
        assert_error(client.get("/generate"), 405, "GET")
        assert client.get("/ready").status_code == 200
        assert client.post("/generate", json={"prompt": "fine", "max_tokens": 2}).status_code == 200
    after = wait_idle(server)
    invalid = sum(requests_total(after, "invalid", e) - requests_total(before, "invalid", e)
                  for e in ("generate", "completions", "chat"))
    assert invalid == len(BAD)


def test_unicode_and_special_characters_pass_through_intact(server):
    tok = server.llm.tokenizer
    r = httpx.post(server.base + "/v1/completions",
                   json={"model": "tiny", "prompt": UNICODE, "max_tokens": 3, "echo": True, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"].startswith(UNICODE)
    assert body["usage"]["prompt_tokens"] == len(tok.encode(UNICODE))
    g = httpx.post(server.base + "/generate", json={"prompt": UNICODE, "max_tokens": 5, "temperature": 0}).json()
    with httpx.stream("POST", server.base + "/generate",
                      json={"prompt": UNICODE, "max_tokens": 5, "temperature": 0, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["text"] for e in events) == g["text"]
    assert [t for e in events for t in e["token_ids"]] == g["token_ids"]


# -- disconnects, timeouts, admission ---------------------------------------------------------------
def test_client_disconnect_aborts_and_frees_blocks(server):
    before = server.metrics()
    long = {"prompt": "the fox " * 20, "max_tokens": 180, "ignore_eos": True, "temperature": 0}  # 60 + 180 fit
    with slowed(server, 0.02), httpx.Client(base_url=server.base, timeout=30) as client:
        with client.stream("POST", "/generate", json={**long, "stream": True}) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
            during = server.metrics()
            assert during[("mla_running_sequences",)] == 1 and during[("mla_latent_cache_blocks_used",)] > 0
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            client.post("/generate", json=long, timeout=0.3)
        after = wait_idle(server)
    assert requests_total(after, "client_disconnect") - requests_total(before, "client_disconnect") == 2
    assert after[("mla_generation_tokens_total",)] - before[("mla_generation_tokens_total",)] < 180


def test_client_disconnect_aborts_every_prompt_of_a_batch(server):
    batch = {"model": "tiny", "prompt": ["the fox " * 10, "a dog " * 10, "the end"], "max_tokens": 150,
             "ignore_eos": True, "temperature": 0}
    engine = server.llm.engine
    before = engine.counts.generation
    with slowed(server, 0.02), httpx.Client(base_url=server.base, timeout=30) as client:
        with pytest.raises(httpx.ReadTimeout):  # a client that gives up
            client.post("/v1/completions", json=batch, timeout=0.3)
        after = wait_idle(server)  # no sequence left running, no block held
    assert after[("mla_requests_in_flight",)] == 0
    assert engine.counts.generation - before < 3 * 150  # every prompt stopped early


def test_api_key_and_body_limit(strict):
    prompt = {"prompt": "hi", "max_tokens": 2}
    assert_error(httpx.post(strict.base + "/generate", json=prompt), 401, "API key")
    assert_error(httpx.post(strict.base + "/generate", json=prompt, headers={"Authorization": "Bearer wrong"}),
                 401, "API key")
    assert httpx.post(strict.base + "/generate", json=prompt, headers=auth()).status_code == 200
    assert httpx.get(strict.base + "/health").status_code == 200  # probes stay open
    big = {"prompt": "x" * 5000}
    assert_error(httpx.post(strict.base + "/generate", json=big, headers=auth()), 413, "max_body_bytes")
    chunked = (bytes([b]) * 1000 for b in b"abcdefgh")  # no Content-Length: the limit applies while reading
    assert_error(httpx.post(strict.base + "/generate", content=chunked, headers=auth()), 413, "max_body_bytes")


def streamed_choices(chunks) -> dict[int, tuple[str, str | None]]:
    """{choice index: (concatenated text, finish reason)} of an OpenAI completions stream."""
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    return {i: (texts[i], reasons[i]) for i in sorted(texts)}


def test_batched_completions_answer_every_prompt_in_order(server, strict):
    """OpenAI's batch form of /v1/completions: ``n`` choices per prompt, prompt p's at ``p·n + i``, each equal to
    the prompt sent alone; streamed, the chunks of each choice concatenate to the same text and end with the
    same finish reason; usage sums over the prompts."""
    import openai

    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    prompts = ["the quick brown", "def hello(", "a"]
    kw = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    batch = client.completions.create(prompt=prompts, n=2, echo=True, **kw)
    assert [c.index for c in batch.choices] == list(range(6))
    for p, (prompt, single) in enumerate(zip(prompts, alone)):
        for i in range(2):
            assert batch.choices[2 * p + i].text == prompt + single.choices[0].text
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    streamed = streamed_choices(client.completions.create(prompt=prompts, n=2, echo=True, stream=True, **kw))
    assert streamed == {c.index: (c.text, c.finish_reason) for c in batch.choices}
    ids = client.completions.create(prompt=[[5, 6, 7], [8, 9]], **kw)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    # a batch counts as one request per prompt against max_num_seqs + max_queue (2 + 2 on this server)
    r = httpx.post(strict.base + "/v1/completions", headers=auth(),
                   json={"model": "tiny", "prompt": ["a"] * 5, "max_tokens": 2})
    assert_error(r, 400, "prompt")
    r = httpx.post(strict.base + "/v1/completions", headers=auth(),
                   json={"model": "tiny", "prompt": ["a"] * 4, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    wait_idle(server)
    wait_idle(strict)


def test_queue_bound_answers_429_and_loses_nothing(strict):
    before = strict.metrics()

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=strict.base, timeout=60, headers=auth()) as client:
            return await asyncio.gather(*(client.post("/generate", json={
                "prompt": f"fox {i}", "max_tokens": 40, "ignore_eos": True, "temperature": 0}) for i in range(12)))

    with slowed(strict, 0.01):
        rs = asyncio.run(burst())
    ok = [r for r in rs if r.status_code == 200]
    busy = [r for r in rs if r.status_code == 429]
    assert len(ok) + len(busy) == 12 and len(ok) >= 4 and busy
    for r in busy:
        assert_error(r, 429, "max_queue")
        assert int(r.headers["Retry-After"]) >= 1
    for r in ok:  # every admitted request ran to the end
        assert r.json()["usage"]["completion_tokens"] == 40 and r.json()["finish_reason"] == "length"
    after = wait_idle(strict)
    assert requests_total(after, "rejected") - requests_total(before, "rejected") == len(busy)
    assert requests_total(after, "success") - requests_total(before, "success") == len(ok)


def test_timeout_aborts_with_504_and_frees_blocks(strict):
    before = strict.metrics()
    long = {"prompt": "the fox", "max_tokens": 200, "ignore_eos": True}

    async def both() -> tuple[httpx.Response, list[dict]]:
        async with httpx.AsyncClient(base_url=strict.base, timeout=30, headers=auth()) as client:
            async def stream() -> list[dict]:
                async with client.stream("POST", "/generate", json={**long, "stream": True}) as s:
                    return [json.loads(line[6:]) async for line in s.aiter_lines() if line.startswith("data: {")]
            return await asyncio.gather(client.post("/generate", json=long), stream())

    t0 = time.monotonic()
    with slowed(strict, 0.05):
        plain, events = asyncio.run(both())
    assert 2.9 < time.monotonic() - t0 < 9
    assert_error(plain, 504, "request_timeout")
    assert events[0]["token_ids"] and events[-1]["error"]["code"] == "timeout"  # the stream had begun: an error event
    after = wait_idle(strict)
    assert requests_total(after, "timeout") - requests_total(before, "timeout") == 2


def test_every_cache_block_is_free_at_the_end(server, strict):
    for live in (server, strict):
        wait_idle(live)
        engine = live.llm.engine
        with live.llm._lock:
            engine.pool.check_whole()
            assert engine.pool.num_free_blocks == engine.pool.num_blocks and not engine.requests


# -- the process: start-up log and SIGTERM ----------------------------------------------------------
def test_subprocess_logs_the_plan_and_sigterm_exits_0(text_checkpoint, tmp_path):
    """SIGTERM drains (the listener stays open, /ready and new requests get 503), lets a short in-flight
    request finish, aborts one that outlives --shutdown-timeout, exits 0."""
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, str(ROOT / "server.py"), "--model", str(text_checkpoint), "--port", str(port),
           "--dtype", "float32", "--max-model-len", "512", "--block-size", "16", "--kv-cache-memory", "8MiB",
           "--shutdown-timeout", "1"]
    # every step 8 ms longer: 500 tokens (>= 4 s) outlive the 1 s grace period and the second uvicorn is given after it
    # to close connections (Server.on_tick) on any machine, 60 tokens (about 0.5 s) do not
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MLA_FAULT_INJECTION": "slow_step:8"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc=proc)
        text = log.read_text()
        for fact in ("3 layers", "4 heads", "d_c=32", "d_r=16", "block size 16", "max concurrent tokens",
                     "weights", "latent cache", "activations"):
            assert fact in text, fact
        proc.send_signal(signal.SIGUSR1)  # every thread's stack to the log; the server goes on
        deadline = time.monotonic() + 10
        while "most recent call first" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "(most recent call first)" in log.read_text() and proc.poll() is None
        assert httpx.get(base + "/ready").status_code == 200
        lines: dict[int, list[str]] = {}
        started = threading.Barrier(3)

        def stream(max_tokens: int) -> None:
            with httpx.stream("POST", base + "/generate", timeout=60, json={
                    "prompt": "fox", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}) as s:
                got = lines.setdefault(max_tokens, [])
                for line in s.iter_lines():
                    if line and not got:
                        started.wait()
                    if line:
                        got.append(line)

        threads = [threading.Thread(target=stream, args=(n,)) for n in (60, 500)]
        for t in threads:
            t.start()
        started.wait(30)
        proc.send_signal(signal.SIGTERM)
        # the drain: the listener stays open, /ready and new requests answer 503 while the streams go on
        assert_error(httpx.get(base + "/ready"), 503, "shutting down")
        assert_error(httpx.post(base + "/generate", json={"prompt": "x"}), 503, "shutting down")
        assert proc.wait(60) == 0
        for t in threads:
            t.join(10)
        assert lines[60][-1] == "data: [DONE]"  # finished within the grace period
        cut = json.loads(lines[500][-1][6:])  # aborted when the grace period ran out, and told so
        assert cut["error"]["code"] == "service_unavailable" and "shut down" in cut["error"]["message"]
        text = log.read_text()
        assert "received SIGTERM" in text and " aborted" in text and "engine stopped" in text
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_signal_only_sets_flags_and_the_drain_begins_on_the_loop():
    """SIGTERM's handler runs between two bytecodes of whatever the main thread was doing, a log write or a metric
    update under its lock: it must neither log nor take a lock. It refuses new requests at once; the drain's log
    line and deadline follow at the next tick, and a second signal ends the drain."""
    refused: list[bool] = []
    in_flight = [1]
    server = Server(uvicorn_config(object(), ServerConfig(shutdown_timeout=30.0)), on_exit=lambda: refused.append(True),
                    in_flight=lambda: in_flight[0])
    records: list[logging.LogRecord] = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("mla_runtime.serving")
    handler, level = Record(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        server.handle_exit(signal.SIGTERM, None)
        assert refused == [True] and records == [] and server.drain_until is None and not server.should_exit
        assert asyncio.run(server.on_tick(1)) is False  # one sequence still in flight: the drain goes on
        assert "received SIGTERM: finishing in-flight requests (up to 30.0 s)" in records[0].getMessage()
        assert server.drain_until is not None
        in_flight[0] = 0
        assert asyncio.run(server.on_tick(2)) is True  # nothing in flight: uvicorn's shutdown begins
        assert server.config.timeout_graceful_shutdown > 29
        server.handle_exit(signal.SIGTERM, None)
        assert server.should_exit and refused == [True] and len(records) == 1
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def test_subprocess_exits_1_when_the_engine_dies(text_checkpoint, tmp_path):
    """A fault after start-up (here the engine thread dies, by fault injection) turns /health 503 and ends the
    process with status 1 after the drain, so that a supervisor restarts it."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "server.py"), "--model", str(text_checkpoint), "--port", str(port),
           "--dtype", "float32", "--max-model-len", "256", "--block-size", "16", "--kv-cache-memory", "8MiB",
           "--shutdown-timeout", "2"]
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "MLA_FAULT_INJECTION": "step:3"})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc=proc)
        r = httpx.post(base + "/generate", json={"prompt": "fox", "max_tokens": 10, "ignore_eos": True}, timeout=60)
        assert_error(r, 503, "engine failed")
        assert proc.wait(60) == 1
        assert "stopped after a fault" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
