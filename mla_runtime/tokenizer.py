"""Tokenizer loaded from the checkpoint directory (local files only) and incremental detokenisation.

The incremental detokeniser decodes a sliding window of the output and only releases text once it no
longer ends in U+FFFD, so a multi-byte character split across tokens is never emitted half-done.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


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

    return AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None,
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a chat, using the tokenizer's template (or a plain ``role: content`` layout); ``tools``:
    OpenAI tool definitions, for a template that shows them to the model; ``template_kwargs``: variables the template
    reads besides the messages (``{"thinking": True}``). A key that names one of ``apply_chat_template``'s own
    arguments is refused (``ValueError``): the runtime sets those; so is a template that fails to render (jinja's
    errors, ``raise_exception`` included)."""
    if tokenizer is None:
        raise ValueError("chat requests need a tokenizer, and this checkpoint has none")
    template_kwargs = template_kwargs or {}
    if template_kwargs:
        params = inspect.signature(tokenizer.apply_chat_template).parameters.items()
        own = {name for name, p in params if p.kind is not p.VAR_KEYWORD} | {"messages", "conversation"}
        taken = sorted(own & set(template_kwargs))
        if taken:
            raise ValueError(f"{taken[0]!r} is an argument of apply_chat_template, not a template variable")
    if getattr(tokenizer, "chat_template", None):
        try:
            ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                **template_kwargs)
        except Exception as e:
            if not any(cls.__module__.startswith("jinja2") for cls in type(e).__mro__):
                raise
            raise ValueError(f"the chat template failed: {e}") from e
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
