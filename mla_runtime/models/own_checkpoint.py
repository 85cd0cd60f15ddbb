"""Reading the checkpoint of a model of its own (DeepSeek-V4, GLM-5-Next, Hunyuan V4, dots3-note:
``families.OWN_MODEL``): a folder of ``config.json`` and ``*.safetensors``, refused by name where it is another model
type, quantised (but for DeepSeek-V4's stored scheme, read by ``v4_stored``), or holds no weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# of a tensor (its stored name, its shape): the slice ``(dim, start, stop)`` to read, None for the whole
Part = Callable[[str, list[int]], tuple[int, int, int] | None]


def read_checkpoint(path: str | Path, model_types: tuple[str, ...], quantized: bool = False,
                    keep: Callable[[str], bool] | None = None, part: Part | None = None
                    ) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    """(the folder, its config, every tensor of its ``*.safetensors`` by stored name) of a checkpoint whose
    ``model_type`` is one of ``model_types``; ``quantized``: a ``quantization_config`` is the caller's to read
    (DeepSeek-V4's stored FP8 / MXFP4, ``v4_stored``), else it is refused. ``keep``: read only the tensors whose
    names it keeps (a tensor-parallel rank's); ``part``: of a tensor (its stored name and shape), read only
    ``(dim, start, stop)`` (a rank's slice; None: the whole)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    root = Path(path)
    raw = json.loads((root / "config.json").read_text())
    name = model_types[0]
    if raw.get("model_type") not in model_types:
        raise ValueError(f"{root}: model_type {raw.get('model_type')!r} is not {' or '.join(model_types)}")
    stored = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if stored and not quantized:
        raise ValueError(f"{root}: quantised {name} checkpoints are not supported (load bfloat16 or float32)")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if keep is None and part is None:
            tensors.update(load_file(str(f)))
            continue
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                if keep is None or keep(name):
                    tensors[name] = _read(handle, name, part)
    return root, raw, tensors


def _read(handle: Any, name: str, part: Part | None) -> torch.Tensor:
    """The tensor ``name`` of an open safetensors file, or only the slice ``part`` names of it."""
    if part is None:
        return handle.get_tensor(name)
    piece = handle.get_slice(name)
    span = part(name, list(piece.get_shape()))
    if span is None:
        return handle.get_tensor(name)
    dim, start, stop = span
    t = piece[(slice(None),) * dim + (slice(start, stop),)]
    # a slice of columns is cut from the rows read whole: keep only its own values, not a view of them
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t
