"""Pre-quantised checkpoints in the compressed-tensors format (the one vLLM, transformers and llm-compressor read and
write), through the ``compressed-tensors`` library.

Five schemes map onto the runtime's formats; their tensors load as stored, with no re-quantisation:

- ``int8``: format ``int-quantized``; weights int, 8 bits, symmetric, strategy ``channel``. A matrix ``X`` is
  ``X.weight`` (int8 ``[N, K]``) and ``X.weight_scale`` (``[N, 1]``).
- ``int4``: format ``pack-quantized``; weights int, 4 bits, strategy ``group`` of 32, 64 or 128, symmetric or with
  zero points. A matrix ``X`` is ``X.weight_packed`` (int32 ``[N, K/8]``), ``X.weight_scale`` (``[N, K/g]``) and
  ``X.weight_shape`` (with ``X.weight_zero_point`` and ``X.weight_g_idx`` where it has them): ``stored_int4``
  reads it, as it reads AWQ's and GPTQ's int4 layouts.
- ``w4a16`` (written only): the ``int4`` format with asymmetric groups of 128 and zero points (llm-compressor's
  ``W4A16_ASYM``, as AWQ's checkpoints hold them): ``X.weight_zero_point`` (int32 ``[N / 8, K / 128]``, the signed
  zero points packed along the rows) beside the three tensors above; it loads as ``int4`` (``stored_int4``).
- ``w8a8``: the ``int8`` weights above with input activations quantised dynamically, int8, symmetric, strategy
  ``token`` (``config.W8A8_ACTIVATIONS``); also SGLang's ``quant_method: w8a8_int8`` (the same two tensors). The
  scales are held in float32 (``layers.w8a8``).
- ``mxfp4`` / ``nvfp4``: formats ``mxfp4-pack-quantized`` / ``nvfp4-pack-quantized``; weights float, 4 bits (E2M1),
  symmetric, strategy ``group`` of 32 / ``tensor_group`` of 16. A matrix ``X`` is ``X.weight_packed`` (uint8
  ``[N, K/2]``, two values a byte, the even one in the low nibble), ``X.weight_scale`` (uint8 UE8M0 exponents
  ``[N, K/32]`` / float8_e4m3fn ``[N, K/16]``) and, for NVFP4, ``X.weight_global_scale`` (float32 ``[1]``, which
  divides). FP4 input activations (NVFP4's W4A4 scheme) are not applied: the products take the model dtype's rows.

NVIDIA ModelOpt's exports (``hf_quant_config.json``, or ``quant_method: modelopt``; ``config.parse_modelopt_config``)
load here too (``modelopt=True``): NVFP4 as ``X.weight`` (the packed nibbles), ``X.weight_scale`` (E4M3 per 16) and
``X.weight_scale_2`` (a float32 per tensor that multiplies: held as its reciprocal, the runtime's global scale
dividing), FP8 as ``X.weight`` (float8_e4m3fn) with one float32 ``X.weight_scale`` (``read_modelopt_fp8``). Their
``input_scale`` is not applied. The modules their ``exclude_modules`` names stay unquantised (``loader``).

The int8 scales are held in bfloat16 (the type the int8 kernels take), so a float32 scale is rounded to 8 significant
bits; int4 scales in float16; every other stored value is used as it is.

Anything else in a checkpoint's ``quantization_config`` (other activation quantisation, other group sizes or bit
widths, asymmetric int8, other float formats) is refused at load with an error naming it. An lm_head the checkpoint
leaves unquantised loads as stored; other matrices its ``ignore`` list leaves unquantised are quantised by the runtime
while loading, as it does for any checkpoint.

``mla-runtime quantize --model SRC --quantization int8|int4|w4a16|w8a8|mxfp4|nvfp4 --out DIR`` writes one from any
checkpoint the runtime loads (bfloat16, float32, FP8 blocks): the matrices it quantises (every attention projection
except ``kv_b_proj``, the MLPs and experts, an untied lm_head) in the runtime's own scheme (int4: symmetric groups of
32; w4a16: ``layers.int4``'s W4A16 rule; a matrix whose ``K`` is not a whole number of the scheme's groups stays
float, named in ``ignore``, for loading to quantise), everything else as stored (FP8 ones dequantised to bfloat16),
one shard per decoder layer, with the permissions ``open`` gives a new file (0o644 under umask 022), and the
tokenizer, chat-template, generation and MTP draft-vocabulary (``speculative_token_map.json``) files copied.
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

from mla_kernels.fp4_format import GROUPS
from mla_runtime.config import (
    INT4_GROUP,
    MODELOPT_FP8_BLOCK,
    STORED_FORMATS,
    W4A16_GROUP,
    W8A8_ACTIVATIONS,
    Int4Layout,
)
from mla_runtime.layers.fp4 import Fp4Weight, Mxfp4Weight, Nvfp4Weight
from mla_runtime.layers.fp8 import Fp8Weight
from mla_runtime.layers.int4 import Int4Weight
from mla_runtime.layers.quantization import Int8Weight
from mla_runtime.layers.qweight import QuantizedWeight
from mla_runtime.layers.w8a8 import W8A8Weight
from mla_runtime.stored_int4 import int4_names, int4_shape, read_int4
from mla_runtime.token_map import MAP_FILE

CT_INT4 = Int4Layout("compressed-tensors", INT4_GROUP, True)  # the int4 layout ``mla-runtime quantize`` writes
FP4_FORMATS: dict[str, type[Fp4Weight]] = {"mxfp4": Mxfp4Weight, "nvfp4": Nvfp4Weight}


def stored_names(name: str, quantization: str, layout: Int4Layout | None = None, modelopt: bool = False) -> list[str]:
    """The tensors a stored matrix ``<base>.weight`` may be stored as (``layout``: an int4 checkpoint's;
    ``modelopt``: a ModelOpt export's)."""
    base = name[: -len("weight")]
    if modelopt:  # ModelOpt NVFP4: the packed values keep the name ``weight``; its input_scale is not applied
        return [name, base + "weight_scale", base + "weight_scale_2", base + "input_scale"]
    if quantization == "int4":
        return int4_names(base, layout or CT_INT4)[1]
    if quantization in FP4_FORMATS:
        return [base + "weight_packed", base + "weight_scale"] + \
            ([base + "weight_global_scale"] if quantization == "nvfp4" else [])
    return [name, base + "weight_scale"]


def is_stored_compressed(name: str, files: Collection[str], quantization: str,
                         layout: Int4Layout | None = None) -> bool:
    """Whether ``<base>.weight`` is stored quantised in a checkpoint holding ``files`` (else as a float tensor)."""
    if not name.endswith(".weight"):
        return False
    base = name[: -len("weight")]
    marker = int4_names(base, layout or CT_INT4)[0] if quantization == "int4" else base + "weight_scale"
    return marker in files


def stored_shape(reader: Any, name: str, quantization: str, layout: Int4Layout | None = None,
                 modelopt: bool = False) -> list[int]:
    """``[N, K]`` of a stored matrix ``<base>.weight``."""
    if quantization == "int4":
        return int4_shape(reader, name[: -len("weight")], layout or CT_INT4)
    if quantization in FP4_FORMATS:
        n, half = reader.shape(stored_names(name, quantization, modelopt=modelopt)[0])
        return [n, 2 * half]
    return list(reader.shape(name))


def quantization_config(quantization: str, ignore: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` of a checkpoint written in ``quantization`` (compressed-tensors' own model)."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
    )

    fmt, bits, strategy, group = STORED_FORMATS[quantization]
    args = _weight_args(quantization)
    acts = QuantizationArgs(**W8A8_ACTIVATIONS) if quantization == "w8a8" else None
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
    config = QuantizationConfig(config_groups={"group_0": scheme},
                                format=fmt, quantization_status=QuantizationStatus.COMPRESSED, ignore=ignore)
    return config.model_dump(exclude_none=True, mode="json")


def _weight_args(quantization: str) -> Any:
    """compressed-tensors' ``QuantizationArgs`` of ``quantization``'s weights."""
    from compressed_tensors.quantization import QuantizationArgs

    _, bits, strategy, group = STORED_FORMATS[quantization]
    if quantization in FP4_FORMATS:
        scale_dtype = torch.uint8 if quantization == "mxfp4" else torch.float8_e4m3fn
        return QuantizationArgs(num_bits=bits, type="float", symmetric=True, strategy=strategy, group_size=group,
                                scale_dtype=scale_dtype)
    return QuantizationArgs(num_bits=bits, type="int", symmetric=quantization != "w4a16", strategy=strategy,
                            group_size=group)


def _compress_fp4(weight: Fp4Weight) -> dict[str, torch.Tensor]:
    """An FP4 matrix through the library's MXFP4 / NVFP4 compressor: its float group scales (NVFP4: the E4M3 values
    and the global scale, which the library divides) and its dequantised values, which the library's rounding gives
    back exactly."""
    from compressed_tensors.compressors import MXFP4PackedCompressor, NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from mla_kernels.fp4_format import mx_scales

    state = {"weight": weight.dequantize()}
    if weight.variant == "mxfp4":
        state["weight_scale"] = mx_scales(weight.scales)
        compressor: Any = MXFP4PackedCompressor
    else:
        glob = weight.global_scales
        if glob is None or not bool((glob == glob[0]).all()):
            raise ValueError("compress: an NVFP4 matrix written as one tensor holds one global scale")
        state["weight_scale"], state["weight_global_scale"] = weight.scales.float(), glob[:1].clone()
        compressor = NVFP4PackedCompressor
    scheme = QuantizationScheme(targets=["Linear"], weights=_weight_args(weight.variant))
    return dict(compressor.compress(state, scheme))


def compress(weight: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The stored tensors (names after ``<base>.``) of a runtime matrix, through the library's compressors."""
    from compressed_tensors.compressors import IntQuantizationCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if isinstance(weight, Fp4Weight):
        return _compress_fp4(weight)
    if isinstance(weight, Int8Weight | W8A8Weight):
        scale = weight.scales.unsqueeze(1)
        args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        compressor: Any = IntQuantizationCompressor
    elif isinstance(weight, Int4Weight) and weight.q4_0:
        q, scale = weight.to_int()
        args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=INT4_GROUP)
        compressor = PackedQuantizationCompressor
    elif isinstance(weight, Int4Weight) and weight.zeros is not None and weight.group == W4A16_GROUP \
            and weight.orders is None:
        scale = weight.scales
        args = _weight_args("w4a16")
        compressor = PackedQuantizationCompressor
    else:
        raise TypeError(f"compress: int8, W8A8, int4 (Q4_0's or W4A16's groups) or FP4 matrices, got "
                        f"{type(weight).__name__}")
    # exact: every value is an integer (less its zero point) times its scale, so the library's division gives the
    # integers back
    dense = weight.dequantize()
    state = {"weight": dense, "weight_scale": scale}
    if isinstance(weight, Int4Weight) and weight.zeros is not None:  # the library's zero points are signed
        state["weight_zero_point"] = (weight.zeros.to(torch.int16) - 8).to(torch.int8)
    return dict(compressor.compress(state, QuantizationScheme(targets=["Linear"], weights=args)))


def read_stored(reader: Any, name: str, quantization: str, shard: tuple[int, int, int, int] | None,
                dtype: torch.dtype, device: torch.device, layout: Int4Layout | None = None,
                modelopt: bool = False) -> Iterator[tuple[int, QuantizedWeight]]:
    """(first row, rows) of the matrix ``<base>.weight`` as stored (this rank's part of it: ``shard`` on the rows, or
    on the columns at group boundaries), made into the runtime's format without re-quantising; an int4 matrix in
    blocks of rows (``stored_int4.read_int4``), read and converted one at a time."""
    base = name[: -len("weight")]
    if quantization in FP4_FORMATS:
        yield 0, read_fp4(reader, name, quantization, shard, dtype, device, modelopt)
        return
    if quantization == "fp8" and modelopt:
        yield 0, read_modelopt_fp8(reader, name, shard, dtype, device)
        return
    if quantization == "w8a8":
        yield 0, read_w8a8(reader, name, shard, dtype, device)
        return
    if quantization == "int8":
        q = reader.stored(name, shard)
        scale = reader.get(base + "weight_scale", shard if shard is not None and shard[0] == 0 else None)
        yield 0, Int8Weight(q.to(device).contiguous(), scale.reshape(-1).to(device, torch.bfloat16), dtype)
        return
    yield from read_int4(reader, name, layout or CT_INT4, shard, dtype, device)


def read_modelopt_fp8(reader: Any, name: str, shard: tuple[int, int, int, int] | None, dtype: torch.dtype,
                      device: torch.device) -> Fp8Weight:
    """A ModelOpt FP8 matrix ``<base>.weight`` (float8_e4m3fn ``[N, K]``, a view of the mapped file on a CPU where it
    is whole) with its one float32 ``<base>.weight_scale`` (a multiplier, ``amax / 448``): this rank's rows or columns,
    in blocks of ``MODELOPT_FP8_BLOCK`` that all hold that scale, so that the block-FP8 products run it as stored and
    matrices of different scales stack."""
    base = name[: -len("weight")]
    q = reader.stored(name, shard)
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: a ModelOpt FP8 weight is stored as float8_e4m3fn, got {q.dtype}")
    scale = reader.get(base + "weight_scale").float().reshape(-1)
    if scale.numel() != 1 or not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ValueError(f"{base}weight_scale: one finite, non-negative scale per tensor expected (ModelOpt's FP8), "
                         f"got {scale.numel()} values")
    rows, cols = q.shape[0], -(-q.shape[1] // MODELOPT_FP8_BLOCK[1])
    scales = scale.to(device).expand(rows, cols).contiguous()
    return Fp8Weight(q.to(device), scales, MODELOPT_FP8_BLOCK, dtype)


def read_w8a8(reader: Any, name: str, shard: tuple[int, int, int, int] | None, dtype: torch.dtype,
              device: torch.device) -> W8A8Weight:
    """The W8A8 matrix ``<base>.weight`` (int8 ``[N, K]``, a view of the mapped file on a CPU where it is whole) with
    its ``<base>.weight_scale`` (``[N, 1]``, any float dtype, held in float32): this rank's rows, or its columns (the
    scales are per row, so a column shard keeps them all)."""
    base = name[: -len("weight")]
    q = reader.stored(name, shard)
    if q.dtype != torch.int8:
        raise ValueError(f"{name}: a W8A8 weight is stored as int8, got {q.dtype}")
    scale = reader.get(base + "weight_scale", shard if shard is not None and shard[0] == 0 else None)
    return W8A8Weight(q.to(device).contiguous(), scale.reshape(-1).to(device, torch.float32), dtype)


def read_fp4(reader: Any, name: str, quantization: str, shard: tuple[int, int, int, int] | None, dtype: torch.dtype,
             device: torch.device, modelopt: bool = False) -> QuantizedWeight:
    """The MXFP4 / NVFP4 matrix ``<base>.weight`` as compressed-tensors stores it (``weight_packed [N, K / 2]`` uint8,
    ``weight_scale [N, K / group]`` uint8 exponents or float8_e4m3fn, NVFP4's ``weight_global_scale [1]``), or as a
    ModelOpt export stores NVFP4 (``modelopt``: ``weight``, ``weight_scale`` and ``weight_scale_2``): this rank's
    rows, or its columns, which must start and end on the groups of the scales."""
    fmt = FP4_FORMATS[quantization]
    group = GROUPS[quantization]
    names = stored_names(name, quantization, modelopt=modelopt)
    n, k = stored_shape(reader, name, quantization, modelopt=modelopt)
    if shard is not None and shard[0] != 0:
        a, b = shard[1], shard[2]
        if a % group or b % group:
            raise ValueError(f"{names[0]}: this rank's columns [{a}, {b}) do not start and end on the {quantization} "
                             f"scale groups of {group} values (K = {k}): choose a tensor_parallel_size that cuts "
                             f"whole groups")
        packed = reader.get(names[0], (1, a // 2, b // 2, k // 2))
        scale = reader.get(names[1], (1, a // group, b // group, k // group))
    else:
        packed, scale = reader.get(names[0], shard), reader.get(names[1], shard)
    if quantization == "mxfp4" and scale.dtype != torch.uint8:
        raise ValueError(f"{names[1]}: MXFP4 scales are uint8 exponents (UE8M0), got {scale.dtype}")
    glob = None if quantization != "nvfp4" else _global_scale(reader, names[2], modelopt)
    if glob is not None:
        glob = glob.to(device).expand(packed.shape[0]).contiguous()
    return fmt(packed.to(device).contiguous(), scale.to(device).contiguous(), glob, dtype)


def _global_scale(reader: Any, name: str, modelopt: bool) -> torch.Tensor:
    """An NVFP4 tensor's global scale ``[1]`` as the runtime holds it, a divisor: compressed-tensors'
    ``weight_global_scale`` as stored; ModelOpt's ``weight_scale_2``, a multiplier (``amax / (6 × 448)``), as its
    float32 reciprocal (so a group's scale ``e4m3 / (1 / weight_scale_2)`` is ModelOpt's ``e4m3 × weight_scale_2``
    to a few float32 roundings: relative 2.5e-7)."""
    stored = reader.get(name).float().reshape(-1)
    if stored.numel() != 1:
        raise ValueError(f"{name}: one global scale per tensor expected, got {stored.numel()}")
    if not modelopt:
        return stored
    if not bool(torch.isfinite(stored).all()) or bool((stored < 0).any()):
        raise ValueError(f"{name}: a ModelOpt weight_scale_2 is finite and not negative, got {stored.item()}")
    return 1.0 / stored  # 0 (an all-zero tensor): an infinite divisor, every group's scale 0


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

    from mla_runtime.config import ModelConfig, load_config_dict
    from mla_runtime.gguf_meta import gguf_files
    from mla_runtime.layers.quantization import quantized_parameter_names
    from mla_runtime.loader import _open_reader, checkpoint_layout
    from mla_runtime.models.hybrid import causal_lm
    from mla_runtime.resolved_config import ResolvedConfig

    if quantization not in STORED_FORMATS:
        raise ValueError(f"quantization: {', '.join(STORED_FORMATS)}, got {quantization!r}")
    src, out = Path(src), Path(out)
    gguf = gguf_files(src) is not None  # a GGUF file: its blocks widened to float32, then quantised
    raw = {k: v for k, v in load_config_dict(src).items() if k not in ("gguf_stored_bits", "gguf_repacked_bits",
                                                                         "gguf_factor_runs")}
    cfg = ModelConfig.from_pretrained(src)
    if cfg.stored_quantization is not None and not gguf:
        raise ValueError(f"{src} is already quantised ({cfg.stored_quantization}); quantise its original instead")
    out.mkdir(parents=True, exist_ok=True)
    # the tensors under the model's names (the family's renaming, as loading reads them), written under those names
    reader: Any = _open_reader(src, cfg, torch.device("cpu"))
    files: dict[str, Path] = reader.files
    with torch.device("meta"):
        model = causal_lm(ResolvedConfig(cfg, torch.float32, num_mtp_layers=cfg.num_nextn_predict_layers))
    products = set(quantized_parameter_names(model))
    table = checkpoint_layout(cfg, num_mtp_layers=cfg.num_nextn_predict_layers)
    block = cfg.fp8_block_size
    scales = {n for n in files if n.endswith(".weight_scale_inv")}
    shards = _shards(files, scales, gguf)
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
    _copy_tokenizer(src, out, gguf)
    return out


def _shards(files: dict[str, Path], scales: set[str], gguf: bool) -> dict[Path | str, list[str]]:
    """The tensors each output shard holds: a source shard's (its FP8 scales left out), or for a GGUF file, whose
    tensors lie in one file, a decoder layer's."""
    shards: dict[Path | str, list[str]] = {}
    for name, f in files.items():
        if name not in scales:
            shards.setdefault(".".join(name.split(".")[:3]) if gguf and name.startswith("model.layers.") else f,
                              []).append(name)
    return shards


def _copy_tokenizer(src: Path, out: Path, gguf: bool) -> None:
    """The source's tokenizer files into ``out``; for a GGUF file, the tokenizer its metadata describes (chat
    template included)."""
    from mla_runtime.gguf_meta import load_gguf_tokenizer

    if gguf:
        tokenizer = load_gguf_tokenizer(src)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
        return
    for extra in COPIED_FILES:
        if (src / extra).is_file():
            shutil.copyfile(src / extra, out / extra)  # the content: the permissions are the umask's


def _convert(name: str, tensors: dict[str, torch.Tensor], ignore: set[str], reader: Any, product: bool,
             quantization: str, scales: set[str], block: tuple[int, int] | None) -> None:
    """One checkpoint tensor into ``tensors``: a product's matrix (``product``) quantised and compressed, anything
    else as it is (an FP8 one dequantised to bfloat16, its module named in ``ignore``)."""
    from mla_runtime.layers.quantization import WEIGHT_FORMATS
    from mla_runtime.loader import _dequantized, _row_chunks

    scale_name = name[: -len("weight")] + "weight_scale_inv" if name.endswith(".weight") else None
    fp8 = scale_name if scale_name in scales else None
    k = reader.shape(name)[-1]
    group = {"int4": INT4_GROUP, "w4a16": W4A16_GROUP}.get(quantization, GROUPS.get(quantization, 1))
    if product and name.endswith(".weight") and k % group == 0:  # the library's layouts hold whole groups
        # the format's groups span whole rows
        fmt = WEIGHT_FORMATS[quantization]
        quantize = getattr(fmt, "quantize_tensor", fmt.quantize)  # NVFP4: one global scale per stored tensor
        parts = [quantize(chunk.float()) for _, chunk in _row_chunks(reader, name, None, fp8, block)]
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
    """``mla-runtime quantize --model SRC --quantization int8|int4|w4a16|w8a8|mxfp4|nvfp4 --out DIR``."""
    import time

    from mla_runtime.help_format import DefaultsHelpFormatter
    from mla_runtime.hub import resolve_model

    ap = argparse.ArgumentParser(prog=prog, formatter_class=DefaultsHelpFormatter,
                                 description="Write a checkpoint's weights pre-quantised, in the compressed-tensors "
                                             "format: loading it then reads the quantised weights as stored.")
    ap.add_argument("--model", required=True, help="checkpoint folder, GGUF file or hub repo id")
    ap.add_argument("--revision", default=None, help="hub revision (with a repo id)")
    ap.add_argument("--quantization", required=True, choices=sorted(STORED_FORMATS))
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
