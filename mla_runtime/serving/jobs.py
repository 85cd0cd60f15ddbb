"""``JobBuilder``: a validated request schema → a ``Job`` (the prompts, sampling parameters and answer shape).

It checks the model name and the prompt's size in characters (before anything is tokenised), tokenises the
prompts (or applies the chat template) and settles each job's output limit against ``max_model_len``, and renders
echoes. It runs in a worker thread (tokenising, templating and decoding cost CPU) and reads only immutable state.

Output limits: a limit the request sets (``max_tokens``, ``max_completion_tokens``, ``max_length`` on
``/generate``) that cannot fit ``max_model_len`` after the prompt is a 400 naming the numbers, as vLLM and OpenAI
answer it; a default limit (16 on ``/generate`` and ``/v1/completions``, what the prompt leaves on chat) is never
refused: generation also stops at ``max_model_len`` (``finish_reason: "length"``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.requests import Tokenized, check_token_ids, tokenize
from mla_runtime.errors import InvalidParam
from mla_runtime.sampling_params import SamplingParams
from mla_runtime.serving.config import ServerConfig
from mla_runtime.serving.protocol import ApiError, ChatRequest, CompletionRequest, GenerateRequest
from mla_runtime.serving.reasoning import END, Reasoning, choose_parser, starts_inside
from mla_runtime.serving.responses import Job
from mla_runtime.serving.runtime import ServingRuntime
from mla_runtime.serving.tool_parsers import choose_tool_parser, every_marker
from mla_runtime.serving.tools import renders_tools
from mla_runtime.tokenizer import apply_chat_template, chat_format
from mla_runtime.v4_chat import request_effort

PROMPT_TAIL_TOKENS = 32  # the prompt's last tokens, read for an open <think> (the template's generation prompt)


class JobBuilder:
    """Request schema → ``Job``: checks the model name and the prompt's size, applies the chat template.
    Runs in a worker thread (templating and decoding cost CPU); reads only immutable state."""

    def __init__(self, rt: ServingRuntime, engine_config: EngineConfig, config: ServerConfig) -> None:
        self.rt, self.engine_config, self.config = rt, engine_config, config
        self.model = config.served_model_name or ""
        self._tool_syntax: tuple[str | None] | None = None  # the model's tool-call syntax, resolved once
        self._hidden: frozenset[int] | None = None  # special tokens raw_text leaves out, looked up once
        self._reasoning_parser: tuple[str | None] | None = None  # the reasoning parser, resolved once
        self._end_token: tuple[int | None] | None = None  # the id of </think> where it is one token, looked up once

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
        """Tokens' text with the tool-call and thinking markers kept, the other special tokens (end of sequence, ...)
        left out as the engine's text leaves them out."""
        tok = self.rt.tokenizer
        if tok is None:
            return ""
        if self._hidden is None:
            vocab = tok.get_vocab()
            kept = {vocab[m] for m in every_marker() | {"<think>", "</think>"} if m in vocab}
            self._hidden = frozenset(set(getattr(tok, "all_special_ids", [])) - kept)
        return tok.decode([t for t in tokens if t not in self._hidden], skip_special_tokens=False)

    def tool_syntax(self) -> str | None:
        """The syntax ``tool_choice: "auto"`` parses (``tool_parsers.py``), resolved against the model once; None
        where the server parses none or the chat template does not show the model the tools (a built-in format,
        ``tokenizer.chat_format``, shows them)."""
        if self._tool_syntax is None:
            llm = self.rt.llm
            model_type = llm.engine.model_config.model_type if llm is not None else None
            template, built_in = getattr(self.rt.tokenizer, "chat_template", None), chat_format(self.rt.tokenizer)
            syntax = choose_tool_parser(self.config.tool_call_parser, built_in or model_type, template)
            self._tool_syntax = (syntax if built_in or renders_tools(template) else None,)
        return self._tool_syntax[0]

    def tokenized(self, prompt: str | list[int]) -> tuple[Tokenized, int]:
        """The prompt as the engine takes it (text and token ids: it is not tokenised twice; token ids given by the
        client checked against the vocabulary here, before anything decodes them, and not again), and its length.
        Token ids outside the vocabulary are a 400 naming ``prompt``, the field of every route that takes them."""
        vocab = self.rt.llm.engine.model_config.vocab_size if self.rt.llm is not None else 0
        try:
            text, ids = tokenize(self.rt.tokenizer, prompt)
            if text is None and vocab:
                check_token_ids(ids, vocab, field="prompt")
        except InvalidParam as e:
            raise ApiError(400, str(e), param=e.param) from e
        return Tokenized(text, ids, vocab if text is None else 0), len(ids)

    def output_limit(self, lengths: list[int], requested: int | None, param: str, default: int | None,
                     max_length: int | None = None, prompt_param: str = "prompt") -> int:
        """``max_tokens`` for prompts of ``lengths`` tokens: the tighter of ``requested`` (set by field ``param``)
        and ``max_length - prompt``; ``default`` (None: what max_model_len leaves) when the request sets neither.
        A limit the request sets must fit max_model_len after the longest prompt (400 naming the numbers)."""
        limit, longest = self.rt.max_model_len, max(lengths)
        if limit and longest >= limit:
            raise ApiError(400, f"{prompt_param}: the prompt has {longest} tokens, but max_model_len is {limit}: the "
                                f"prompt must be shorter to leave room for output", param=prompt_param)
        if max_length is not None:
            if max_length <= longest:
                raise ApiError(400, f"max_length: {max_length} counts the prompt's tokens too (transformers' meaning) "
                                    f"and the prompt already has {longest}; give more than {longest}, or max_tokens "
                                    f"for the generated tokens alone", param="max_length")
            if limit and max_length > limit:
                raise ApiError(400, f"max_length: {max_length} exceeds max_model_len ({limit})", param="max_length")
            if requested is None or max_length - longest < requested:
                requested, param = max_length - longest, "max_length"
        if requested is None:
            return default if default is not None else max(1, limit - longest)
        if limit and longest + requested > limit:
            raise ApiError(400, f"{param}: the prompt has {longest} tokens and {param} is {requested}: "
                                f"{longest + requested} exceeds max_model_len ({limit}); ask for at most "
                                f"{limit - longest} tokens or shorten the prompt", param=param)
        return requested

    def generate(self, req: GenerateRequest) -> Job:
        if isinstance(req.prompt, str):
            self.check_text(req.prompt, "prompt")
        prompt, length = self.tokenized(req.prompt)
        requested, param = req.requested_max_tokens()
        max_tokens = self.output_limit([length], requested, param, 16, req.max_length)
        return Job("generate", [prompt], req.sampling_params(max_tokens), self.model, stream=req.stream)

    def completion(self, req: CompletionRequest) -> Job:
        self.check_model(req.model)
        req.check_unsupported()
        prompts = req.prompt_list()
        for p in prompts:
            if isinstance(p, str):
                self.check_text(p, "prompt")
        engine_prompts, lengths = zip(*(self.tokenized(p) for p in prompts))
        echo = None
        if req.echo:
            tok = self.rt.tokenizer
            echo = [p if isinstance(p, str) else (tok.decode(p) if tok is not None else "") for p in prompts]
        requested, param = req.requested_max_tokens()
        max_tokens = self.output_limit(list(lengths), requested, param, 16)
        return Job("completions", list(engine_prompts), req.sampling_params(max_tokens), self.model,
                   stream=req.stream, include_usage=bool(req.stream_options and req.stream_options.include_usage),
                   echo=echo, logprobs=req.logprobs_count(), token_text=self.token_text)

    def chat(self, req: ChatRequest) -> Job:
        self.check_model(req.model)
        req.check_unsupported()
        tools = req.tool_mode(self.tool_syntax())
        messages = req.plain_messages()
        self.check_text("".join(m["content"] for m in messages), "messages")
        ids = self.chat_prompt(messages, req.tool_dicts() if tools else None, self.template_kwargs(req))
        requested, param = req.requested_max_tokens()
        max_tokens = self.output_limit([len(ids)], requested, param, None, prompt_param="messages")
        params, reasoning = req.sampling_params(max_tokens), self.reasoning(ids)
        if params.structured_outputs is not None and reasoning is not None:
            params, reasoning = self.constrained_after_thinking(params, reasoning)
        return Job("chat", [Tokenized(None, ids)], params, self.model,
                   stream=req.stream, include_usage=bool(req.stream_options and req.stream_options.include_usage),
                   logprobs=req.logprobs_count(), token_text=self.token_text, tools=tools, raw_text=self.raw_text,
                   reasoning=reasoning)

    def template_kwargs(self, req: ChatRequest) -> dict[str, Any] | None:
        """The request's ``chat_template_kwargs``, with its ``reasoning_effort`` as the variable of DeepSeek-V4's
        built-in format where the format renders the chat and the variable is not set (``v4_chat.request_effort``)."""
        kwargs = req.chat_template_kwargs
        if req.reasoning_effort is None or chat_format(self.rt.tokenizer) != "deepseek_v4" \
                or "reasoning_effort" in (kwargs or {}):
            return kwargs
        try:
            return {**(kwargs or {}), "reasoning_effort": request_effort(req.reasoning_effort)}
        except InvalidParam as e:
            raise ApiError(400, f"{e.param}: {e}", param=e.param) from e

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    template_kwargs: dict[str, Any] | None) -> list[int]:
        """The chat's prompt token ids; a template (or built-in format) that fails on the request's messages or
        ``chat_template_kwargs`` is a 400 naming the field."""
        try:
            return apply_chat_template(self.rt.tokenizer, messages, tools, template_kwargs)
        except InvalidParam as e:
            raise ApiError(400, f"{e.param}: {e}", param=e.param) from e
        except ValueError as e:
            param = "chat_template_kwargs" if template_kwargs and "template" in str(e) else "messages"
            raise ApiError(400, f"{param}: {e}", param=param) from e

    def reasoning_parser(self) -> str | None:
        """The server's reasoning parser (``reasoning.py``), resolved against the model once."""
        if self._reasoning_parser is None:
            llm = self.rt.llm
            model_type = llm.engine.model_config.model_type if llm is not None else None
            template, built_in = getattr(self.rt.tokenizer, "chat_template", None), chat_format(self.rt.tokenizer)
            self._reasoning_parser = (choose_parser(self.config.reasoning_parser, built_in or model_type, template),)
        return self._reasoning_parser[0]

    def constrained_after_thinking(self, params: SamplingParams, reasoning: Reasoning
                                   ) -> tuple[SamplingParams, Reasoning]:
        """A constrained chat under a reasoning parser: where its output begins inside the thinking and ``</think>``
        is one token, the constraint (structured output, forced tool call) holds from the token after it, the
        thinking before it free; elsewhere it holds from the first token, and the output is read as one that does not
        begin inside the thinking (the answer, unless the constraint itself lets it open with ``<think>``)."""
        if self._end_token is None:
            tok = self.rt.tokenizer
            ids = tok.encode(END, add_special_tokens=False) if tok is not None else []
            self._end_token = (ids[0] if len(ids) == 1 else None,)
        end, spec = self._end_token[0], params.structured_outputs
        if not reasoning.inside or end is None or spec is None:
            return params, Reasoning(inside=False)
        return replace(params, structured_outputs=replace(spec, after_token=end)), reasoning

    def reasoning(self, prompt_ids: list[int]) -> Reasoning | None:
        """How a chat answer's thinking part is split off (None: no reasoning parser): its output begins inside the
        thinking where the rendered prompt ends in an open ``<think>``."""
        if self.reasoning_parser() is None:
            return None
        return Reasoning(inside=starts_inside(self.raw_text(prompt_ids[-PROMPT_TAIL_TOKENS:])))
