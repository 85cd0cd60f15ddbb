"""The conformance matrix's stored checkpoint formats (``tests/conformance.py``): a family's tiny checkpoint written
at test time in a format the runtime loads as stored, and transformers holding that checkpoint's dequantised weights.

- compressed-tensors (``int4``, ``w4a16``, ``w8a8``, ``mxfp4``, ``nvfp4``): ``write_quantized_checkpoint``, the
  writer behind ``mla-runtime quantize``. The reference holds each matrix the file stores quantised as the runtime
  reads it back (``compressed.read_stored``, whose values ``tests/test_fp4.py``, ``test_w8a8.py`` and
  ``test_stored_int4.py`` hold to the library's dequantisation), each product the writer left whole (a row that is
  not a multiple of the format's group) as the runtime quantises it at load, and ``kv_b_proj`` in bfloat16.
- GGUF (``gguf-q8_0``; ``gguf-q4_k_m``, llama.cpp's Q4_K_M mix: Q6_K for the embedding, the head and the down
  projections, Q4_K for the other matrices, falling back as llama.cpp does to Q8_0 / Q5_0 where a row is not a
  multiple of 256): ``tests/gguf_files.py``'s writer, and its reference (the ``gguf`` package's dequantisation).
  The fixed configurations' rows (96 wide) hold no 256-value block, so the K-quant cell writes the family at a
  hidden size of 768 (``KQUANT_WIDTH``: three blocks, a multiple of every head count).
- ModelOpt NVFP4 (``modelopt-nvfp4``): ``tests/test_modelopt.py``'s writer and reference (ModelOpt's dequantisation).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path

import torch

COMPRESSED = ("int4", "w4a16", "w8a8", "mxfp4", "nvfp4")
GGUF = ("gguf-q8_0", "gguf-q4_k_m")
MODELOPT = ("modelopt-nvfp4",)
FORMATS = tuple(f"stored-{q}" for q in COMPRESSED) + GGUF + MODELOPT
KQUANT_WIDTH = 768  # the K-quant cell's hidden size: three 256-value blocks, a multiple of every head count
# the stored checkpoint's name of one expert's matrix; transformers holds the experts fused, [E, 2I, H] / [E, H, I]
_EXPERT = re.compile(r"^(?P<mlp>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def needs_wide(kind: str) -> bool:
    """Whether the format's cell writes the family at ``KQUANT_WIDTH``: its blocks (K-quants: 256 values, W4A16:
    groups of 128) are wider than the fixed configurations' rows."""
    return kind in ("gguf-q4_k_m", "stored-w4a16")


def write(kind: str, hf: torch.nn.Module, src: Path, out: Path) -> tuple[Path, torch.nn.Module]:
    """``hf`` (saved at ``src``) written to ``out`` in ``kind``: (the path to load, transformers holding the
    checkpoint's dequantised weights)."""
    if kind.startswith("stored-"):
        quantization = kind[len("stored-"):]
        from mla_runtime.compressed import write_quantized_checkpoint

        write_quantized_checkpoint(src, out, quantization)
        return out, compressed_reference(hf, out)
    if kind in GGUF:
        from tests.gguf_files import products_in, reference_model, write_gguf

        out.mkdir(parents=True, exist_ok=True)
        pick = products_in("Q8_0") if kind == "gguf-q8_0" else q4_k_m
        path, stored = write_gguf(hf, out / "model.gguf", pick)
        return path, reference_model(hf, stored)
    if kind == "modelopt-nvfp4":
        from tests.test_modelopt import reference_model as modelopt_reference
        from tests.test_modelopt import write_modelopt

        write_modelopt(src, out)
        return out, modelopt_reference(out)
    raise ValueError(f"stored format: {', '.join(FORMATS)}, got {kind!r}")


def q4_k_m(name: str, shape: tuple[int, ...]) -> str:
    """llama.cpp's Q4_K_M choice for a tensor of these tiny models: Q6_K for the embedding, the head and the down
    projections (llama.cpp gives Q6_K to the head and to half of them), Q4_K for the other matrices; where a row is
    not whole 256-value blocks, llama.cpp's fallbacks (Q6_K to Q8_0, Q4_K to Q5_0), F32 where neither fits, and for
    vectors and the router."""
    if len(shape) < 2 or "ffn_gate_inp" in name:
        return "F32"
    k = shape[-1]
    wide = name.startswith(("token_embd", "output.")) or "ffn_down" in name
    if k % 256 == 0:
        return "Q6_K" if wide else "Q4_K"
    if k % 32 == 0:
        return "Q8_0" if wide else "Q5_0"
    return "F32"


@torch.no_grad()
def compressed_reference(hf: torch.nn.Module, path: Path) -> torch.nn.Module:
    """A copy of ``hf`` holding the weights the runtime computes with from the compressed-tensors checkpoint at
    ``path`` (the module docstring), read as the runtime reads it (a W4A16 checkpoint as ``int4`` in its layout)."""
    from mla_runtime.compressed import is_stored_compressed, read_stored
    from mla_runtime.config import ModelConfig
    from mla_runtime.layers.quantization import WEIGHT_FORMATS
    from mla_runtime.loader import _Reader, checkpoint_files
    from tests.conformance import product_params

    cfg = ModelConfig.from_pretrained(path)
    quantization, layout = str(cfg.stored_quantization), cfg.stored_layout
    out = copy.deepcopy(hf)
    fmt = WEIGHT_FORMATS[quantization]
    for _, owner, param in product_params(out):  # what loading quantises itself; the stored ones replaced below
        if owner == "kv_b_proj":
            param.copy_(param.to(torch.bfloat16))
            continue
        for matrix in param.view(-1, *param.shape[-2:]):
            matrix.copy_(fmt.quantize(matrix.float()).dequantize())
    reader = _Reader(checkpoint_files(path))
    view = _stored_views(out)
    names = [n[: -len("_packed")] if n.endswith(".weight_packed") else n for n in reader.files]
    stored = [n for n in names if is_stored_compressed(n, reader.files.keys(), quantization, layout)]
    if not stored:
        raise AssertionError(f"{path}: no matrix is stored in {quantization}")
    for name in stored:
        target = view(name)
        if target is None:
            raise AssertionError(f"{path}: {name} names no parameter of transformers' model")
        for row, piece in read_stored(reader, name, quantization, None, torch.float32, torch.device("cpu"), layout):
            values = piece.dequantize()
            target[row: row + values.shape[0]].copy_(values.to(torch.bfloat16) if name.endswith("kv_b_proj.weight")
                                                     else values)
    return out


def _stored_views(out: torch.nn.Module) -> Callable[[str], torch.Tensor | None]:
    """The parameter (or one expert's part of a fused one) of ``out`` a stored tensor's name names; None if none."""
    from mla_runtime.families import FAMILIES

    params = dict(out.named_parameters())
    family = FAMILIES.get(out.config.model_type)
    if family is not None:  # the runtime writes the model's names: transformers' own under the family's renaming
        for hf_name, p in list(params.items()):
            renamed = family.rename(hf_name)
            if renamed is not None:
                params.setdefault(renamed, p)
    for hf_name, p in list(params.items()):  # A.X-K2's query and gate projection, which checkpoints store as q_b_proj
        if hf_name.endswith("self_attn.q_gate_proj.weight"):
            params.setdefault(hf_name.replace("q_gate_proj", "q_b_proj"), p)

    def view(name: str) -> torch.Tensor | None:
        if name in params:
            return params[name]
        m = _EXPERT.match(name)
        if m is None:
            return None
        e, proj = int(m["e"]), m["proj"]
        fused = params.get(f"{m['mlp']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
        if fused is None:
            return None
        half = fused.shape[1] // 2
        return {"down_proj": fused[e], "gate_proj": fused[e, :half], "up_proj": fused[e, half:]}[proj]
    return view

