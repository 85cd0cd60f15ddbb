"""Models by name: a local checkpoint folder, or a Hugging Face hub repo id resolved to a local snapshot.

``resolve_model("deepseek-ai/DeepSeek-V2-Lite")`` downloads (or finds in the cache) only what the runtime
reads (``ALLOW_PATTERNS``: config, generation config, tokenizer files, chat template, safetensors and their
index) through ``huggingface_hub.snapshot_download``, which shows its own progress bar and reads tokens from
the environment (``HF_TOKEN``) or ``hf auth login``. The cache location and offline mode are read from the
environment at call time (``HF_HUB_CACHE``, else ``HF_HOME``/hub; ``HF_HUB_OFFLINE``; through ``env.py``), so
they take effect even when ``huggingface_hub`` was imported before they were set.

A local folder, or a GGUF file (``gguf_meta``), is returned unchanged. A preset name (``mla_runtime/model_configs/``)
is a config without weights: an error here, usable only by the planner.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from mla_runtime import env
from mla_runtime.config import PRESET_DIR

logger = logging.getLogger("mla_runtime")

ALLOW_PATTERNS = [
    "config.json", "hf_quant_config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
]
# "org/name": letters, digits, "-", "_", "." (what the hub accepts), not starting with "." or "-"
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


class ModelNotFoundError(ValueError):
    """The model is neither a local checkpoint folder nor a hub repo that could be downloaded."""


def is_repo_id(model: str) -> bool:
    """``org/name`` that is not an existing local path."""
    return bool(REPO_ID_RE.match(model)) and ".." not in model and not Path(model).expanduser().exists()


def hub_cache_dir() -> str | None:
    """The hub cache from the environment now (None: huggingface_hub's default)."""
    return env.hf_hub_cache()


def hub_offline() -> bool:
    from huggingface_hub import constants

    return env.hf_hub_offline() or bool(constants.HF_HUB_OFFLINE)


def resolve_model(model: str, revision: str | None = None) -> str:
    """A local checkpoint directory for ``model`` (a folder, or a hub repo id at ``revision``)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return str(model)
    if path.is_file():
        from mla_runtime.gguf_meta import gguf_files

        if gguf_files(path) is None:
            raise ModelNotFoundError(f"model: {model!r} is a file but not a .gguf file (expected a checkpoint folder "
                                     f"with config.json and *.safetensors, a GGUF file, or a hub repo id org/name)")
        return str(model)
    if (PRESET_DIR / f"{model}.json").is_file():
        raise ModelNotFoundError(f"model: {model!r} is a preset (a config.json without weights, for "
                                 f"`mla-runtime plan`), not a checkpoint; pass a checkpoint folder or a hub "
                                 f"repo id (org/name)")
    if not is_repo_id(model):
        raise ModelNotFoundError(f"model: {model!r} does not exist (expected a checkpoint folder with config.json "
                                 f"and *.safetensors, a GGUF file, or a hub repo id org/name)")
    return download(model, revision)


def download(repo_id: str, revision: str | None = None) -> str:
    """``snapshot_download`` of the files the runtime reads; one-line ``ModelNotFoundError`` on failure."""
    from huggingface_hub import snapshot_download

    offline = hub_offline()
    at = f"@{revision}" if revision else ""
    logger.info("model %s%s: %s the hub cache", repo_id, at, "offline, from" if offline else "through")
    try:
        return str(snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(),
                                     allow_patterns=ALLOW_PATTERNS, local_files_only=offline))
    except Exception as e:  # network, HTTP, auth and cache errors all end the same way
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        where = "offline (HF_HUB_OFFLINE) and not in the local hub cache" if offline else reason
        rev = f" --revision {revision}" if revision else ""
        raise ModelNotFoundError(
            f"model {repo_id}{at} could not be downloaded ({where}); download it with "
            f"`hf download {repo_id}{rev}` (or `huggingface-cli download {repo_id}{rev}`) where the hub is "
            f"reachable, or pass a local checkpoint folder") from e
