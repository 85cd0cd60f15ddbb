"""``mla-runtime warm``: compute the prefixes of common prompts (system prompts, RAG templates) into the disk tier,
so that a server started later on the same directory serves them as cached tokens from its first request.

    mla-runtime warm --model PATH --kv-cache-dir DIR --prompts prompts.txt [any serve flag]

The prompts file holds one prompt per line (empty lines are skipped); a line that starts with ``"`` or ``{`` is
JSON: a string (for prompts with newlines), ``{"prompt": "..."}``, ``{"prompt_token_ids": [...]}`` or
``{"messages": [...]}`` (rendered with the model's chat template, as ``/v1/chat/completions`` does).

The cache is keyed by every setting that changes a latent's bytes, so pass the flags the server will run with
(``--dtype``, ``--kv-cache-dtype``, ``--block-size``, ``--latent-rank``, ``--tensor-parallel-size`` ...): warm
takes every flag of ``serve`` and ignores the HTTP ones. Each prompt runs for one generated token with the
disk tier in write-through mode; at the end every full block is on disk (exit 0), and the summary says how many.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from mla_runtime.engine.requests import PromptType


def read_prompts(path: str | Path) -> list[PromptType]:
    """The prompts of ``path`` (see the module docstring); a ``ValueError`` names the bad line."""
    prompts: list[PromptType] = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if not line.startswith(('"', "{")):
            prompts.append(line)
            continue
        try:
            value: Any = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts {path}, line {number}: not valid JSON ({e.msg})") from e
        if isinstance(value, dict) and not {"prompt", "prompt_token_ids", "messages"} & set(value):
            raise ValueError(f"--prompts {path}, line {number}: an object needs prompt, prompt_token_ids or messages")
        if not isinstance(value, (str, dict)):
            raise ValueError(f"--prompts {path}, line {number}: expected a JSON string or object")
        prompts.append(value["prompt"] if isinstance(value, dict) and "prompt" in value else value)
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts in the file")
    return prompts


def _ids(llm: Any, prompt: PromptType) -> PromptType:
    if isinstance(prompt, dict) and "messages" in prompt:
        from mla_runtime.tokenizer import apply_chat_template

        return {"prompt_token_ids": apply_chat_template(llm.tokenizer, prompt["messages"])}
    return prompt


def warm(engine_config: Any, prompts: Sequence[PromptType], flush_timeout: float = 600.0) -> dict[str, int | float]:
    """Run ``prompts`` (one token each) with write-through into ``engine_config.kv_cache_dir``; the summary."""
    from mla_runtime.llm import LLM
    from mla_runtime.sampling_params import SamplingParams

    t0 = time.monotonic()
    config = replace(engine_config, kv_cache_write_through=True, kv_cache_host_bytes=0)  # disk is the goal
    kwargs = {k: v for k, v in vars(config).items() if k != "model"}
    llm = LLM(config.model, **kwargs)
    try:
        outs = llm.generate([_ids(llm, p) for p in prompts], SamplingParams(max_tokens=1, temperature=0.0),
                            use_tqdm=None)
    finally:
        llm.shutdown(flush_timeout)
    stats = llm.engine.stats()
    disk = stats.disk
    block = config.block_size
    return {"prompts": len(outs), "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "blocks": sum(len(o.prompt_token_ids) // block for o in outs),
            "cached_tokens": sum(o.num_cached_tokens for o in outs),
            "bytes_written": disk.bytes_written if disk else 0, "usage_bytes": disk.usage_bytes if disk else 0,
            "seconds": time.monotonic() - t0}


def main(argv: Sequence[str] | None = None, prog: str = "mla-runtime warm") -> int:
    """Warm the disk tier; 0 on success, 2 on bad input."""
    import logging

    from mla_runtime.serving.config import build_parser, resolve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog=prog, add_help=False)
    parser.add_argument("--prompts")
    args, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        full = build_parser(prog)
        full.description = ("Compute the prefixes of common prompts into the disk tier (--kv-cache-dir); the serve "
                            "flags below set the engine (pass those the server will run with).")
        full.add_argument("--prompts", help="file: one prompt per line, or JSON lines (string, {prompt}, "
                                            "{prompt_token_ids} or {messages}) (required)")
        full.parse_args(["--help"])
    try:
        engine_config, _ = resolve(rest, prog=prog)
        if not args.prompts:
            raise ValueError("--prompts FILE is required (one prompt per line)")
        if engine_config.kv_cache_dir is None:
            raise ValueError("--kv-cache-dir is required (the disk tier to fill)")
        prompts = read_prompts(args.prompts)
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    summary = warm(engine_config, prompts)
    print(f"warmed {summary['prompts']} prompts ({summary['prompt_tokens']:,} tokens, {summary['blocks']:,} full "
          f"blocks, {summary['cached_tokens']:,} already cached) into {engine_config.kv_cache_dir}: "
          f"{summary['bytes_written']:,} B written, {summary['usage_bytes']:,} B in the directory, "
          f"{summary['seconds']:.1f} s")
    return 0
