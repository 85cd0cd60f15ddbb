"""Tokenizer loaded from the checkpoint directory (local files only) and incremental detokenisation.

The incremental detokeniser decodes a sliding window of the output and only releases text once it no
longer ends in U+FFFD, so a multi-byte character split across tokens is never emitted half-done.

Chat templates read an earlier tool call's ``arguments`` in two ways: as an object (GLM's and MiniCPM3's iterate its
``items()``, others write it with ``tojson``) or as the JSON text itself (DeepSeek-V3.1's joins it to its markers
with ``+``). OpenAI clients send the text: a template is rendered with the objects (``template_messages``), and
where that fails, again with the text as the client sent it.

A checkpoint whose chat format is written in code rather than in a template (DeepSeek-V4's ships
``encoding/encoding_dsv4.py``) has a built-in format where its tokenizer has no ``chat_template``: ``load_tokenizer``
records it (``chat_format``) from the checkpoint's ``model_type`` (``BUILT_IN_FORMATS``; not where the checkpoint's
``encoding/`` folder holds another encoder), and ``apply_chat_template`` renders with it (``v4_chat.render``).
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("mla_runtime")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BUILT_IN_FORMATS = ("deepseek_v4",)  # model types whose chat format is built in (module docstring)
FORMAT_ATTR = "mla_chat_format"  # the tokenizer's attribute naming its built-in format


def load_tokenizer(path: str | Path) -> Any | None:
    """The checkpoint's tokenizer, or None when the directory has no tokenizer files; a GGUF model's from its
    metadata (``gguf_meta.load_gguf_tokenizer``)."""
    from mla_runtime.gguf_meta import gguf_files, load_gguf_tokenizer

    if gguf_files(path) is not None:
        return load_gguf_tokenizer(path)
    p = Path(path)
    if not p.is_dir() or not any((p / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)
    built_in = _built_in_format(p)
    if built_in is not None and not getattr(tokenizer, "chat_template", None):
        setattr(tokenizer, FORMAT_ATTR, built_in)
    return tokenizer


def _built_in_format(path: Path) -> str | None:
    """The built-in chat format of the checkpoint at ``path``: its ``model_type``'s, unless the checkpoint's own
    encoder is another one (an ``encoding/`` folder without DeepSeek-V4's ``encoding_dsv4.py``: V4.1's encoder writes
    another format)."""
    model_type = _model_type(path)
    if model_type not in BUILT_IN_FORMATS:
        return None
    encoders = path / "encoding"
    if encoders.is_dir() and not (encoders / "encoding_dsv4.py").is_file():
        logger.warning("%s: the checkpoint's chat encoder (encoding/) is not DeepSeek-V4's encoding_dsv4.py: its "
                       "chats are not rendered with the built-in DeepSeek-V4 format; give the tokenizer a "
                       "chat_template", path)
        return None
    return model_type


def _model_type(path: Path) -> str | None:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def chat_format(tokenizer: Any) -> str | None:
    """The built-in chat format a tokenizer renders chats with (module docstring): None where it has a template of
    its own, or none at all."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None):
        return None
    return getattr(tokenizer, FORMAT_ATTR, None)


def _template_call(call: Any) -> Any:
    """A tool call of a message with its ``function.arguments`` text as the object it encodes (kept as it is where
    the text is not a JSON object)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(text := function.get("arguments"), str):
        return call
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return call
    if not isinstance(value, dict):
        return call
    return {**call, "function": {**function, "arguments": value}}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each tool call's arguments as an object (transformers' convention for chat templates)."""
    return [{**m, "tool_calls": [_template_call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


def _in_template(e: BaseException) -> bool:
    """Whether ``e`` is the template's failure: one of jinja's errors (``raise_exception`` included), or any error
    raised while the template's own code ran (``"a" + none``)."""
    if any(cls.__module__.startswith("jinja2") for cls in type(e).__mro__):
        return True
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            return True
        tb = tb.tb_next
    return False


def _rendered(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              template_kwargs: dict[str, Any]) -> Any:
    """The template's token ids, with the calls' arguments as objects, else as text (module docstring); a template
    that fails either way raises ``ValueError`` with the first failure."""
    first: Exception | None = None
    for chat in (template_messages(messages), messages):
        try:
            return tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=True,
                                                 **template_kwargs)
        except Exception as e:
            if not _in_template(e):
                raise
            first = first or e
        if chat == messages:
            break
    raise ValueError(f"the chat template failed: {first}") from first


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None,
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a chat, using the tokenizer's template or built-in format (or a plain ``role: content`` layout);
    ``tools``: OpenAI tool definitions, for a template that shows them to the model; ``template_kwargs``: variables
    the template reads besides the messages (``{"thinking": True}``). A key that names one of
    ``apply_chat_template``'s own arguments is refused (``ValueError``): the runtime sets those; so is a template that
    fails to render (jinja's errors, ``raise_exception`` included), and a chat or variable the built-in format cannot
    render (``InvalidParam`` naming the field)."""
    if tokenizer is None:
        raise ValueError("chat requests need a tokenizer, and this checkpoint has none")
    template_kwargs = template_kwargs or {}
    if template_kwargs:
        params = inspect.signature(tokenizer.apply_chat_template).parameters.items()
        own = {name for name, p in params if p.kind is not p.VAR_KEYWORD} | {"messages", "conversation"}
        taken = sorted(own & set(template_kwargs))
        if taken:
            raise ValueError(f"{taken[0]!r} is an argument of apply_chat_template, not a template variable")
    if chat_format(tokenizer) == "deepseek_v4":
        from mla_runtime.v4_chat import render

        return list(tokenizer.encode(render(messages, tools, template_kwargs), add_special_tokens=False))
    if getattr(tokenizer, "chat_template", None):
        ids = _rendered(tokenizer, messages, tools, template_kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return tokenizer.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start (tokens)
        self._read = 0  # tokens whose text is already emitted

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (maybe empty)."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        prev = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=True)
        if full.endswith("\ufffd") or len(full) <= len(prev):
            return ""
        delta = full[len(prev):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


class DecodeWindow:
    """The text of a growing list of token ids through ``decode`` (any ids → text function), a window at a time:
    each ``update`` decodes only the tokens since the last released text (and the few before them that give it its
    context), and releases text once it no longer ends in a partly decoded character."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self._prefix = 0  # window start (tokens)
        self._read = 0  # tokens whose text is released

    def update(self, ids: list[int]) -> str:
        """The text that ``ids`` (the whole list so far) adds to what was released."""
        if len(ids) <= self._read:
            return ""
        prev = self.decode(ids[self._prefix:self._read]) if self._read > self._prefix else ""
        full = self.decode(ids[self._prefix:])
        if full.endswith("\ufffd") or len(full) <= len(prev):
            return ""
        self._prefix, self._read = self._read, len(ids)
        return full[len(prev):]
