"""Pre-quantised checkpoints in the compressed-tensors format (the one vLLM, transformers and llm-compressor read and
write), through the ``compressed-tensors`` library.

Two weight-only schemes map onto the runtime's formats; their tensors load as stored, with no re-quantisation:

- ``int8``: format ``int-quantized``; weights int, 8 bits, symmetric, strategy ``channel``. A matrix ``X`` is
  ``X.weight`` (int8 ``[N, K]``) and ``X.weight_scale`` (``[N, 1]``).
- ``int4``: format ``pack-quantized``; weights int, 4 bits, strategy ``group`` of 32, 64 or 128, symmetric or with
  zero points. A matrix ``X`` is ``X.weight_packed`` (int32 ``[N, K/8]``), ``X.weight_scale`` (``[N, K/g]``) and
  ``X.weight_shape`` (with ``X.weight_zero_point`` and ``X.weight_g_idx`` where it has them): ``stored_int4``
  reads it, as it reads AWQ's and GPTQ's int4 layouts.

The int8 scales are held in bfloat16 (the type the int8 kernels take), so a float32 scale is rounded to 8 significant
bits; int4 scales in float16; every other stored value is used as it is.

Anything else in a checkpoint's ``quantization_config`` (activation quantisation, other group sizes or bit widths,
asymmetric int8, float formats) is refused at load with an error naming it. An lm_head the checkpoint leaves
unquantised loads as stored; other matrices its ``ignore`` list leaves unquantised are quantised by the runtime while
loading, as it does for any checkpoint.

``mla-runtime quantize --model SRC --quantization int8|int4 --out DIR`` writes one from any checkpoint the runtime
loads (bfloat16, float32, FP8 blocks): the matrices it quantises (every attention projection except ``kv_b_proj``,
the MLPs and experts, an untied lm_head) in the runtime's own scheme (int4: symmetric groups of 32), everything
else as stored (FP8 ones dequantised to
bfloat16), one shard per decoder layer, with the permissions ``open`` gives a new file (0o644 under umask 022), and
the tokenizer, chat-template, generation and MTP draft-vocabulary (``speculative_token_map.json``) files copied.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from mla_runtime.config import INT4_GROUP, SCHEMES, Int4Layout
from mla_runtime.layers.int4 import Int4Weight
from mla_runtime.layers.quantization import Int8Weight
from mla_runtime.layers.qweight import QuantizedWeight
from mla_runtime.stored_int4 import int4_names, int4_shape, read_int4
from mla_runtime.token_map import MAP_FILE

CT_INT4 = Int4Layout("compressed-tensors", INT4_GROUP, True)  # the int4 layout ``mla-runtime quantize`` writes


def stored_names(name: str, quantization: str, layout: Int4Layout | None = None) -> list[str]:
    """The tensors a stored matrix ``<base>.weight`` may be stored as (``layout``: an int4 checkpoint's)."""
    base = name[: -len("weight")]
    if quantization == "int4":
        return int4_names(base, layout or CT_INT4)[1]
    return [name, base + "weight_scale"]


def is_stored_compressed(name: str, files: Collection[str], quantization: str,
                         layout: Int4Layout | None = None) -> bool:
    """Whether ``<base>.weight`` is stored quantised in a checkpoint holding ``files`` (else as a float tensor)."""
    if not name.endswith(".weight"):
        return False
    base = name[: -len("weight")]
    marker = int4_names(base, layout or CT_INT4)[0] if quantization == "int4" else base + "weight_scale"
    return marker in files


def stored_shape(reader: Any, name: str, quantization: str, layout: Int4Layout | None = None) -> list[int]:
    """``[N, K]`` of a stored matrix ``<base>.weight``."""
    if quantization == "int4":
        return int4_shape(reader, name[: -len("weight")], layout or CT_INT4)
    return list(reader.shape(name))


def quantization_config(quantization: str, ignore: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` of a checkpoint written in ``quantization`` (compressed-tensors' own model)."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
    )

    fmt, bits, strategy, group = SCHEMES[quantization]
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy=strategy, group_size=group)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                format=fmt, quantization_status=QuantizationStatus.COMPRESSED, ignore=ignore)
    return config.model_dump(exclude_none=True, mode="json")


def compress(weight: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The stored tensors (names after ``<base>.``) of a runtime matrix, through the library's compressors."""
    from compressed_tensors.compressors import IntQuantizationCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if isinstance(weight, Int8Weight):
        scale = weight.scales.unsqueeze(1)
        args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        compressor: Any = IntQuantizationCompressor
    elif isinstance(weight, Int4Weight):
        q, scale = weight.to_int()
        args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=INT4_GROUP)
        compressor = PackedQuantizationCompressor
    else:
        raise TypeError(f"compress: int8 or int4 matrices, got {type(weight).__name__}")
    # exact: every value is an integer times its scale, so the library's division gives the integers back
    dense = weight.dequantize()
    state = {"weight": dense, "weight_scale": scale}
    return dict(compressor.compress(state, QuantizationScheme(targets=["Linear"], weights=args)))


def read_stored(reader: Any, name: str, quantization: str, shard: tuple[int, int, int, int] | None,
                dtype: torch.dtype, device: torch.device,
                layout: Int4Layout | None = None) -> Iterator[tuple[int, QuantizedWeight]]:
    """(first row, rows) of the matrix ``<base>.weight`` as stored (this rank's part of it: ``shard`` on the rows, or
    on the columns at group boundaries), made into the runtime's format without re-quantising; an int4 matrix in
    blocks of rows (``stored_int4.read_int4``), read and converted one at a time."""
    base = name[: -len("weight")]
    if quantization == "int8":
        q = reader.stored(name, shard)
        scale = reader.get(base + "weight_scale", shard if shard is not None and shard[0] == 0 else None)
        yield 0, Int8Weight(q.to(device).contiguous(), scale.reshape(-1).to(device, torch.bfloat16), dtype)
        return
    yield from read_int4(reader, name, layout or CT_INT4, shard, dtype, device)


# -- writing ------------------------------------------------------------------------------------------------------
# the source's small files a copy needs beside its weights: the tokenizer, the chat template, the generation defaults
# and the draft vocabulary of MTP speculation
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
                "vocab.json", "merges.txt", MAP_FILE)


def new_file_mode() -> int:
    """The permission bits ``open`` gives a new file in this process: 0o666 less the umask (0o644 under 022)."""
    mask = os.umask(0o077)  # reading the umask sets it: the strictest value while the old one is put back
    os.umask(mask)
    return 0o666 & ~mask


def write_quantized_checkpoint(src: str | Path, out: str | Path, quantization: str) -> Path:
    """Write ``src`` (any checkpoint the runtime loads) to ``out`` in the compressed-tensors format of
    ``quantization``, tensor by tensor: each matrix is quantised exactly as loading ``src`` with ``quantization``
    quantises it (from its float32 values), so loading ``out`` gives the same weights without the work."""
    from safetensors.torch import save_file

    from mla_runtime.config import ModelConfig
    from mla_runtime.layers.quantization import quantized_parameter_names
    from mla_runtime.loader import _Reader, checkpoint_files, checkpoint_layout
    from mla_runtime.models.hybrid import causal_lm
    from mla_runtime.resolved_config import ResolvedConfig

    if quantization not in SCHEMES:
        raise ValueError(f"quantization: int8 or int4, got {quantization!r}")
    src, out = Path(src), Path(out)
    raw = json.loads((src / "config.json").read_text())
    cfg = ModelConfig.from_pretrained(src)
    if cfg.stored_quantization is not None:
        raise ValueError(f"{src} is already quantised ({cfg.stored_quantization}); quantise its original instead")
    out.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(src)
    with torch.device("meta"):
        model = causal_lm(ResolvedConfig(cfg, torch.float32, num_mtp_layers=cfg.num_nextn_predict_layers))
    products = set(quantized_parameter_names(model))
    table = checkpoint_layout(cfg, num_mtp_layers=cfg.num_nextn_predict_layers)
    reader = _Reader(files)
    block = cfg.fp8_block_size
    scales = {n for n in files if n.endswith(".weight_scale_inv")}
    shards: dict[Path, list[str]] = {}
    for name, f in files.items():
        if name not in scales:
            shards.setdefault(f, []).append(name)
    weight_map: dict[str, str] = {}
    ignore: set[str] = set()
    for i, names in enumerate(shards.values()):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            slot = table.get(name)
            _convert(name, tensors, ignore, reader, slot is not None and slot.param in products, quantization,
                     scales, block)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        os.chmod(out / fname, new_file_mode())  # safetensors renames a private (0o600) temporary file into place
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
    index = {"metadata": {"total_size": sum((out / f).stat().st_size for f in set(weight_map.values()))},
             "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    raw["quantization_config"] = quantization_config(quantization, sorted(ignore))
    if block is not None:
        raw["torch_dtype"] = "bfloat16"  # what the FP8 source's unquantised tensors are written in
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    for extra in COPIED_FILES:
        if (src / extra).is_file():
            shutil.copyfile(src / extra, out / extra)  # the content: the permissions are the umask's
    return out


def _convert(name: str, tensors: dict[str, torch.Tensor], ignore: set[str], reader: Any, product: bool,
             quantization: str, scales: set[str], block: tuple[int, int] | None) -> None:
    """One checkpoint tensor into ``tensors``: a product's matrix (``product``) quantised and compressed, anything
    else as it is (an FP8 one dequantised to bfloat16, its module named in ``ignore``)."""
    from mla_runtime.layers.quantization import WEIGHT_FORMATS
    from mla_runtime.loader import _dequantized, _row_chunks

    scale_name = name[: -len("weight")] + "weight_scale_inv" if name.endswith(".weight") else None
    fp8 = scale_name if scale_name in scales else None
    k = reader.shape(name)[-1]
    if product and name.endswith(".weight") and (quantization != "int4" or k % INT4_GROUP == 0):
        # the format's groups span whole rows
        fmt = WEIGHT_FORMATS[quantization]
        parts = [fmt.quantize(chunk.float()) for _, chunk in _row_chunks(reader, name, None, fp8, block)]
        matrix = parts[0] if len(parts) == 1 else type(parts[0]).cat(parts)
        base = name[: -len("weight")]
        tensors.update({base + key: v.contiguous() for key, v in compress(matrix).items()})
        return
    tensor = reader.get(name) if fp8 is None else _dequantized(reader, name, fp8, block, None)
    if fp8 is not None:
        tensor = tensor.to(torch.bfloat16)
    tensors[name] = tensor.contiguous()
    if name.endswith(".weight") and tensor.dim() == 2:
        ignore.add(name[: -len(".weight")])


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``mla-runtime quantize --model SRC --quantization int8|int4 --out DIR``."""
    import time

    from mla_runtime.help_format import DefaultsHelpFormatter
    from mla_runtime.hub import resolve_model

    ap = argparse.ArgumentParser(prog=prog, formatter_class=DefaultsHelpFormatter,
                                 description="Write a checkpoint's weights pre-quantised, in the compressed-tensors "
                                             "format: loading it then reads the quantised weights as stored.")
    ap.add_argument("--model", required=True, help="checkpoint folder or hub repo id")
    ap.add_argument("--revision", default=None, help="hub revision (with a repo id)")
    ap.add_argument("--quantization", required=True, choices=sorted(SCHEMES))
    ap.add_argument("--out", required=True, help="folder to write (created; must not hold a checkpoint already)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if (out / "config.json").exists():
        ap.error(f"--out {out}: already holds a checkpoint")
    t0 = time.monotonic()
    try:
        write_quantized_checkpoint(resolve_model(args.model, args.revision), out, args.quantization)
    except (ValueError, OSError) as e:
        print(f"mla-runtime quantize: {e}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"{out}: {args.quantization} weights in the compressed-tensors format, {size / 2**30:.2f} GiB, "
          f"written in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
