"""Reading the checkpoint of a model of its own (DeepSeek-V4, GLM-5-Next, Hunyuan V4, dots3-note:
``families.OWN_MODEL``): a folder of ``config.json`` and ``*.safetensors`` holding float tensors, refused by name
where it is another model type, quantised, or holds no weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def read_checkpoint(path: str | Path, model_types: tuple[str, ...]) -> tuple[Path, dict[str, Any],
                                                                           dict[str, torch.Tensor]]:
    """(the folder, its config, every tensor of its ``*.safetensors`` by stored name) of a checkpoint whose
    ``model_type`` is one of ``model_types``."""
    from safetensors.torch import load_file

    root = Path(path)
    raw = json.loads((root / "config.json").read_text())
    name = model_types[0]
    if raw.get("model_type") not in model_types:
        raise ValueError(f"{root}: model_type {raw.get('model_type')!r} is not {' or '.join(model_types)}")
    if raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config"):
        raise ValueError(f"{root}: quantised {name} checkpoints are not supported (load bfloat16 or float32)")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return root, raw, tensors
