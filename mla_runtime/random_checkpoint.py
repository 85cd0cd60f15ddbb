"""Write a checkpoint of any MLA config with random weights, one shard per decoder layer, without ever holding the
model in memory: for benchmarks and tests at real size (a DeepSeek-V2-Lite-shaped checkpoint is 31 GB of bfloat16)
on machines that cannot download one.

The tensor names and shapes are those of the Hugging Face layout the loader reads (``loader.checkpoint_layout`` on
one rank, routed experts one tensor per expert as DeepSeek ships them), so the result loads exactly as a real
checkpoint of that config does. Values: products ``N(0, 0.02²)`` (the config's ``initializer_range``), norms 1,
biases and the router's correction bias 0; one generator seeded per tensor name, so a tensor's values do not depend
on the shard layout.

    python -m mla_runtime.random_checkpoint --config mla_runtime/model_configs/deepseek-v2-lite.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import re
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mla_runtime.config import PRESET_DIR, ModelConfig

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
STD = 0.02


def tensor_shapes(cfg: ModelConfig, num_mtp_layers: int = 0) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint of ``cfg`` (one rank, per-expert tensors) -> its shape, in load order."""
    from mla_runtime.loader import checkpoint_layout
    from mla_runtime.models.hybrid import causal_lm
    from mla_runtime.resolved_config import ResolvedConfig

    with torch.device("meta"):
        model = causal_lm(ResolvedConfig(cfg, torch.bfloat16, num_mtp_layers=num_mtp_layers))
    params = dict(model.named_parameters())
    shapes: dict[str, tuple[int, ...]] = {}
    for name, slot in checkpoint_layout(cfg, num_mtp_layers=num_mtp_layers).items():
        assert slot is not None  # one rank: every tensor is this rank's
        shapes[name] = tuple(params[slot.param][slot.index].shape)
    return shapes


def _values(name: str, shape: tuple[int, ...], dtype: torch.dtype, std: float) -> torch.Tensor:
    if name.endswith(("layernorm.weight", "norm.weight")):
        return torch.ones(shape, dtype=dtype)
    if name.endswith((".bias", "e_score_correction_bias")):
        return torch.zeros(shape, dtype=dtype if not name.endswith("correction_bias") else torch.float32)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=g) * std).to(dtype)


def _shard_of(name: str) -> str:
    m = _LAYER_RE.match(name)
    return f"layer-{int(m.group(1)):03d}" if m else "embeddings"


def _groups(shapes: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, list[str]]]:
    current: str | None = None
    names: list[str] = []
    for name in shapes:
        shard = _shard_of(name)
        if shard != current and names:
            yield current or "", names
            names = []
        current = shard
        names.append(name)
    if names:
        yield current or "", names


def write_random_checkpoint(config: dict[str, Any], out: str | Path, dtype: torch.dtype = torch.bfloat16,
                            seed_note: str = "") -> Path:
    """Write ``config`` (a ``config.json`` dict) and random weights of it into ``out``: one safetensors shard per
    decoder layer (plus one for the embeddings, norm and head) and ``model.safetensors.index.json``. Peak memory: one
    layer's tensors. Returns ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(config)
    shapes = tensor_shapes(cfg)
    std = float(config.get("initializer_range", STD))
    groups = list(_groups(shapes))
    weight_map: dict[str, str] = {}
    total = 0
    for i, (_, names) in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: _values(n, shapes[n], dtype, std) for n in names}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
        del tensors
    index = {"metadata": {"total_size": total, "note": f"random weights{seed_note}"}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    written = dict(config, torch_dtype=str(dtype).removeprefix("torch."))
    written.pop("quantization_config", None)  # random weights are written in ``dtype``, never FP8 blocks
    (out / "config.json").write_text(json.dumps(written, indent=2))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_runtime.random_checkpoint",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True,
                        help="a config.json, or a preset name of mla_runtime/model_configs (e.g. deepseek-v2-lite)")
    parser.add_argument("--out", required=True, help="folder to write (created)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--num-hidden-layers", type=int, default=None, help="override the layer count")
    args = parser.parse_args(argv)
    path = Path(args.config)
    if not path.is_file():
        path = PRESET_DIR / f"{args.config}.json"
    config = json.loads(path.read_text())
    if args.num_hidden_layers is not None:
        config["num_hidden_layers"] = args.num_hidden_layers
    write_random_checkpoint(config, args.out, getattr(torch, args.dtype))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
