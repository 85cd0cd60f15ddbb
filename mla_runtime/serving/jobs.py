"""``JobBuilder``: a validated request schema → a ``Job`` (the prompts, sampling parameters and answer shape).

It checks the model name and the prompt's size in characters (before anything is tokenised), applies the chat
template and renders echoes. It runs in a worker thread (templating and decoding cost CPU) and reads only
immutable state.
"""

from __future__ import annotations

from mla_runtime.engine.config import EngineConfig
from mla_runtime.serving.config import ServerConfig
from mla_runtime.serving.protocol import ApiError, ChatRequest, CompletionRequest, GenerateRequest
from mla_runtime.serving.responses import Job
from mla_runtime.serving.runtime import ServingRuntime
from mla_runtime.serving.tools import deepseek_begin_token
from mla_runtime.tokenizer import apply_chat_template


class JobBuilder:
    """Request schema → ``Job``: checks the model name and the prompt's size, applies the chat template.
    Runs in a worker thread (templating and decoding cost CPU); reads only immutable state."""

    def __init__(self, rt: ServingRuntime, engine_config: EngineConfig, config: ServerConfig) -> None:
        self.rt, self.engine_config, self.config = rt, engine_config, config
        self.model = config.served_model_name or ""
        self._tool_marker: tuple[int | None] | None = None  # the chat template's tool-call marker, looked up once

    def check_model(self, name: str | None) -> None:
        if name not in (None, self.config.served_model_name, self.engine_config.model):
            raise ApiError(404, f"model: {name!r} is not served here; this server serves "
                                f"{self.config.served_model_name!r}", param="model")

    def check_text(self, text: str, param: str) -> None:
        """400 for an empty prompt, or one whose length alone proves it exceeds max_model_len tokens."""
        if not text and param == "prompt":
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        limit, per_token = self.rt.max_prompt_chars, self.rt.max_chars_per_token
        if limit and len(text) > limit:
            raise ApiError(400, f"{param}: {len(text):,} characters cannot fit in max_model_len "
                                f"({self.rt.max_model_len}) tokens (a token of this tokenizer covers at most "
                                f"{per_token} characters)", param=param)

    def token_text(self, token: int) -> str:
        tok = self.rt.tokenizer
        return tok.decode([token]) if tok is not None else ""

    def raw_text(self, tokens: list[int]) -> str:
        """Tokens' text with the special tokens kept (tool-call markers)."""
        tok = self.rt.tokenizer
        return tok.decode(tokens, skip_special_tokens=False) if tok is not None else ""

    def tool_marker(self) -> int | None:
        if self._tool_marker is None:
            self._tool_marker = (deepseek_begin_token(self.rt.tokenizer),)
        return self._tool_marker[0]

    def generate(self, req: GenerateRequest) -> Job:
        if isinstance(req.prompt, str):
            self.check_text(req.prompt, "prompt")
        prompt = req.prompt if isinstance(req.prompt, str) else {"prompt_token_ids": req.prompt}
        return Job("generate", [prompt], req.sampling_params(16), self.model, stream=req.stream)

    def completion(self, req: CompletionRequest) -> Job:
        self.check_model(req.model)
        req.check_unsupported()
        prompts = req.prompt_list()
        for p in prompts:
            if isinstance(p, str):
                self.check_text(p, "prompt")
        echo = None
        if req.echo:
            tok = self.rt.tokenizer
            echo = [p if isinstance(p, str) else (tok.decode(p) if tok is not None else "") for p in prompts]
        return Job("completions", [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts],
                   req.sampling_params(16), self.model,
                   stream=req.stream, include_usage=bool(req.stream_options and req.stream_options.include_usage),
                   echo=echo, logprobs=req.logprobs_count(), token_text=self.token_text)

    def chat(self, req: ChatRequest) -> Job:
        self.check_model(req.model)
        req.check_unsupported()
        tools = req.tool_mode(self.tool_marker())
        messages = req.plain_messages()
        self.check_text("".join(m["content"] for m in messages), "messages")
        try:
            ids = apply_chat_template(self.rt.tokenizer, messages, req.tool_dicts() if tools else None)
        except ValueError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from e
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, self.rt.max_model_len - len(ids))
        return Job("chat", [{"prompt_token_ids": ids}], req.sampling_params(max_tokens), self.model,
                   stream=req.stream, include_usage=bool(req.stream_options and req.stream_options.include_usage),
                   logprobs=req.logprobs_count(), token_text=self.token_text, tools=tools, raw_text=self.raw_text)
