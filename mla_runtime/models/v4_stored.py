"""DeepSeek-V4 checkpoints as they ship: block-FP8 attention and dense weights, MXFP4 (or FP8) routed experts, read
and kept as stored.

The released checkpoints' ``quantization_config`` is transformers' ``FineGrainedFP8Config``: ``quant_method``
``fp8``, ``fmt`` ``e4m3``, ``activation_scheme`` ``dynamic``, ``weight_block_size`` ``[128, 128]``, ``scale_fmt``
``ue8m0`` or ``float``, and ``expert_dtype`` ``fp4`` or ``fp8`` (V4.1 puts it in the quantization config, V4 beside
it; transformers' ``DeepseekV4Config`` moves it in). A matrix the checkpoint quantises is its ``X.weight`` beside a
scale, ``X.scale`` (the released name) or ``X.weight_scale_inv`` (transformers'):

- FP8: ``weight [N, K]`` float8_e4m3fn and one scale per ``weight_block_size`` block ``[ceil(N / bn),
  ceil(K / bk)]``: float32, or UE8M0 (float8_e8m0fnu, or its bytes as uint8) powers of two; ``W = weight x scale``.
  It becomes an ``Fp8Weight`` (one byte per value, the scales in float32).
- MXFP4 (``expert_dtype`` ``fp4``, the routed experts): ``weight [N, K / 2]`` int8 (or uint8, or
  float4_e2m1fn_x2), two E2M1 values a byte, value ``2i`` in the low nibble, and ``scale [N, K / 32]``, a UE8M0
  power of two per 32 values of a row (float8_e8m0fnu, uint8, or float32 powers of two). It becomes an
  ``Mxfp4Weight`` (half a byte per value, a byte per 32).

What the checkpoint leaves unquantised (the embedding, the head, norms, the router, the hyper-connections, and in
V4-Flash the compressors' and the indexer's ``wkv``/``wgate``/``weights_proj``, shipped in bfloat16) loads as before,
in the model's dtype. Any other scheme, setting, scale or stored dtype is refused by name, as is a quantised tensor
the model has no linear layer for (``install_stored``) and experts stored packed, several in one tensor (each stored
matrix is one ``[N, K]`` matrix).

Hunyuan V4 and dots3-note read the same scheme through ``load_stored``: their routed experts one matrix per expert,
``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` (``PROJ_EXPERT_NAMES``; V4's ``w1``/``w3``/``w2``), the
family named in every error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mla_kernels.fp4_format import MX_GROUP, mx_scales
from mla_runtime.layers.fp4 import Mxfp4Weight
from mla_runtime.layers.fp8 import Fp8Weight
from mla_runtime.layers.hyper import PackedExperts, StoredLinear
from mla_runtime.layers.qweight import QuantizedWeight
from mla_runtime.models.own_checkpoint import read_checkpoint
from mla_runtime.models.v4_shards import V4_SPLITS, expert_on_rank, shard_fraction, shard_stored, shard_tensor
from mla_runtime.parallel import SINGLE_RANK, ParallelContext

SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
EXPERT_DTYPES = {"fp4": "mxfp4", "fp8": "fp8"}
_FP4_DTYPES = tuple(t for t in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if t is not None)
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e8m0fnu, torch.uint8)


@dataclass(frozen=True)
class V4Quantization:
    """A V4 checkpoint's stored scheme: FP8 blocks of ``block`` and routed experts in ``experts`` (``mxfp4`` or
    ``fp8``)."""

    block: tuple[int, int]
    experts: str


def v4_quantization(raw: dict[str, Any], family: str = "deepseek_v4") -> V4Quantization | None:
    """The stored scheme of a ``config.json`` of ``family`` (None: float weights; a multimodal config's may sit in its
    ``text_config``); what is not the released V4 checkpoints' scheme is refused by name."""
    text = raw.get("text_config") or {}
    q = raw.get("quantization_config") or text.get("quantization_config")
    if not q:
        return None
    expert_dtype = q.get("expert_dtype", raw.get("expert_dtype", text.get("expert_dtype"))) or "fp8"
    block = q.get("weight_block_size") or [128, 128]
    wants = {"quant_method": ("fp8",), "fmt": ("e4m3", None), "activation_scheme": ("dynamic", None),
             "scale_fmt": ("ue8m0", "float", None), "expert_dtype": tuple(EXPERT_DTYPES)}
    got = {**{k: q.get(k) for k in wants}, "expert_dtype": expert_dtype}
    bad = [f"{k} {got[k]!r} (read: {', '.join(repr(v) for v in ok if v is not None)})" for k, ok in wants.items()
           if got[k] not in ok]
    if not isinstance(block, (list, tuple)) or len(block) != 2 or any(int(b) < 1 for b in block):
        bad.append(f"weight_block_size {block!r} (two positive sizes)")
    if q.get("modules_to_convert"):
        bad.append("modules_to_convert (FP8 embeddings)")
    if bad:
        raise ValueError(f"{family}: quantization_config not supported: " + "; ".join(bad) + " (read: the "
                         "released checkpoints' FP8 blocks with FP4 or FP8 experts, docs/deepseek-v4.md)")
    return V4Quantization((int(block[0]), int(block[1])), EXPERT_DTYPES[str(expert_dtype)])


def split_stored(tensors: dict[str, torch.Tensor], family: str = "deepseek_v4"
                 ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(the float tensors, each quantised ``X.weight`` with its scale) of a checkpoint's tensors: a scale without
    its weight, or a quantised weight without its scale, is refused by name."""
    floats: dict[str, torch.Tensor] = {}
    scales: dict[str, tuple[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            floats[name] = t
        else:
            scales[name[:-len(suffix)] + ".weight"] = (name, t)
    pairs = {}
    for name, (scale_name, scale) in scales.items():
        if name in floats:
            pairs[name] = (floats.pop(name), scale)
        elif scale_name.endswith(".weight_scale_inv"):
            raise ValueError(f"{family}: {scale_name} has no weight {name} beside it")
        else:  # a parameter that is called scale (transformers' in-memory ``attn_hc.scale``)
            floats[scale_name] = scale
    packed = sorted(n for n in floats if n.endswith(("_scale_inv", "_blocks", "_scales")))
    if packed:
        raise ValueError(f"{family}: {packed[0]}: quantised matrices stored packed (several experts in one tensor) "
                         f"are not read; each is one [N, K] matrix beside its scale (routed experts "
                         f"experts.{{e}}.*.weight with X.weight_scale_inv or X.scale)")
    stray = sorted(n for n, t in floats.items() if (not t.is_floating_point() and n.endswith(".weight"))
                   or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2))
    if stray:
        raise ValueError(f"{family}: {stray[:3]} are stored as {floats[stray[0]].dtype} without a scale "
                         f"(X.scale or X.weight_scale_inv)")
    return floats, pairs


def _fp8_scales(name: str, scale: torch.Tensor) -> torch.Tensor:
    """Float32 block scales from float32/bfloat16 or UE8M0 (float8_e8m0fnu, or its bytes as uint8) scales."""
    if scale.dtype == torch.uint8:
        return mx_scales(scale)
    if scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{name}: FP8 scales must be float32 or UE8M0, got {scale.dtype}")
    return scale.float()


def _mx_exponents(name: str, scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 exponent bytes from float8_e8m0fnu, uint8 or float32 powers of two (anything else refused)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{name}: MXFP4 scales must be UE8M0 or float32 powers of two, got {scale.dtype}")
    mantissa, exp = torch.frexp(scale.float())
    if bool((mantissa != 0.5).any()) or bool(((exp - 1) < -127).any()) or bool(((exp - 1) > 127).any()):
        raise ValueError(f"{name}: MXFP4 scales are powers of two (2^-127 .. 2^127); found others")
    return (exp - 1 + 127).to(torch.uint8)


def stored_matrix(name: str, weight: torch.Tensor, scale: torch.Tensor, q: V4Quantization, expert: bool,
                  dtype: torch.dtype, family: str = "deepseek_v4") -> QuantizedWeight:
    """The ``QuantizedWeight`` of one stored matrix (``name`` for the errors): a routed expert's in the config's
    ``expert_dtype``, any other FP8."""
    want, label = q.experts if expert else "fp8", f"{family}: {name}"
    if weight.dim() != 2:
        raise ValueError(f"{label} is stored quantised as {list(weight.shape)}: a stored matrix is read as one "
                         f"[N, K] matrix (routed experts one per expert, experts.{{e}}.*.weight)")
    if weight.dtype == torch.float8_e4m3fn and want == "fp8":
        scales = _fp8_scales(label, scale).to(weight.device)
        try:
            return Fp8Weight(weight, scales, q.block, dtype)
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None
    if weight.dtype in _FP4_DTYPES and want == "mxfp4":
        if tuple(scale.shape) != (weight.shape[0], 2 * weight.shape[1] // MX_GROUP):
            raise ValueError(f"{label}: MXFP4 stores [N, K / 2] bytes and [N, K / 32] scales, got "
                             f"{tuple(weight.shape)} and {tuple(scale.shape)}")
        return Mxfp4Weight(weight.contiguous().view(torch.uint8), _mx_exponents(label, scale).to(weight.device),
                           None, dtype)
    raise ValueError(f"{label} is stored as {weight.dtype}; the config's scheme stores "
                     f"{'routed experts' if expert else 'it'} as {want}")


V4_EXPERT_NAMES = ("w1", "w3", "w2")  # a routed expert's gate, up and down matrices, as V4's model names them
PROJ_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")  # as Hunyuan V4's and dots3-note's name them


def install_stored(model: nn.Module, matrices: dict[str, QuantizedWeight], family: str = "deepseek_v4",
                   expert_names: tuple[str, str, str] = V4_EXPERT_NAMES) -> None:
    """Put the stored matrices (by the model's ``X.weight`` names) in ``model``: each linear layer becomes a
    ``StoredLinear``, each layer's routed experts (``mlp.experts.{e}.{gate,up,down}.weight``, named by
    ``expert_names``) keep theirs (``PackedExperts.keep_stored``)."""
    experts: dict[str, dict[str, dict[int, QuantizedWeight]]] = {}
    for name, m in matrices.items():
        head, sep, tail = name.partition(".mlp.experts.")
        pieces = tail.split(".")
        if sep and len(pieces) == 3 and pieces[0].isdigit():
            experts.setdefault(head, {}).setdefault(pieces[1], {})[int(pieces[0])] = m
            continue
        path = name.removesuffix(".weight")
        parent_name, _, child = path.rpartition(".")
        module = model.get_submodule(path) if name.endswith(".weight") and _has(model, path) else None
        if not isinstance(module, nn.Linear) or module.weight.shape != m.shape:
            raise ValueError(f"{family}: {name} is stored quantised {tuple(m.shape)}; the model has no linear "
                             f"layer of that shape there")
        parent = model.get_submodule(parent_name)
        groups = int(getattr(parent, "groups", 1)) if child == "o_a_proj" else 1
        setattr(parent, child, StoredLinear(m, groups))
    for head, kinds in experts.items():
        module = model.get_submodule(head + ".mlp.experts") if _has(model, head + ".mlp.experts") else None
        if not isinstance(module, PackedExperts):
            raise ValueError(f"{family}: {head}: quantised routed experts where the model has none")
        gate, up, down = expert_names
        order = sorted(kinds.get(gate, {}))
        if set(kinds) != set(expert_names) or any(sorted(v) != order for v in kinds.values()):
            raise ValueError(f"{family}: {head}: quantised routed experts need {gate}, {up} and {down} for every "
                             f"expert (got {sorted(kinds)})")
        module.keep_stored([kinds[gate][e] for e in order], [kinds[up][e] for e in order],
                           [kinds[down][e] for e in order])


def load_stored(model: nn.Module, path: str | Path, model_types: tuple[str, ...], cfg: Any,
                rename: Callable[[str], str | None], dtype: torch.dtype, device: torch.device | str | None = None,
                par: ParallelContext = SINGLE_RANK, splits: dict[str, tuple[str, int]] = V4_SPLITS,
                expert_names: tuple[str, str, str] = PROJ_EXPERT_NAMES) -> dict[str, torch.Tensor]:
    """For a model of its own (Hunyuan V4, dots3-note, of config ``cfg``) whose checkpoint at ``path`` is in V4's
    stored scheme: put its quantised matrices in ``model`` as stored (on ``device``; ``rename``: a stored name -> the
    model's, None for what it does not read) and return its float tensors, by the model's names, for its own loading.
    Under tensor parallelism (``par``, the model's ``splits``) this rank's shard, as V4's (``v4_shards``): only its
    routed experts are read (renumbered from 0), the other tensors read whole and cut (``shard_stored``: an FP8
    matrix on its scale blocks, a column cut inside a block refused by name; ``shard_tensor``)."""
    family = model_types[0]

    def mine(name: str) -> str | None:
        model_name = rename(name)
        return None if model_name is None else expert_on_rank(cfg, model_name, par)

    _, raw, tensors = read_checkpoint(path, model_types, quantized=True, keep=lambda name: mine(name) is not None)
    quant = v4_quantization(raw, family)
    if quant is None:
        raise ValueError(f"{family}: {path} is not in V4's stored scheme (no quantization_config)")
    floats, pairs = split_stored(tensors, family)
    matrices = {}
    for name, (w, s) in pairs.items():
        if (m := mine(name)) is not None:
            stored = stored_matrix(name, w.to(device or w.device), s, quant, ".mlp.experts." in m, dtype, family)
            matrices[m] = shard_stored(cfg, m, stored, par, splits, family)
    install_stored(model, matrices, family, expert_names)
    return {m: shard_tensor(cfg, m, t, par, splits) for name, t in floats.items() if (m := mine(name)) is not None}


def stored_weight_bytes(root: Path, dtype: torch.dtype, cfg: Any = None, par: ParallelContext = SINGLE_RANK,
                        keep: Callable[[str], bool] | None = None, rename: Callable[[str], str | None] | None = None,
                        splits: dict[str, tuple[str, int]] = V4_SPLITS) -> int:
    """Bytes the loaded model holds for a quantised checkpoint (read from the files' headers, no tensor read): FP8
    and MXFP4 matrices as stored, FP8 block scales in float32, MXFP4 scales a byte each, every other tensor in
    ``dtype``; what the model does not read left out (``keep``: the names it reads; default V4's, all but the MTP
    layers). Under tensor parallelism (``par``, with the model's config ``cfg``) one rank's: its experts, and its
    share of what it splits (``v4_shards.shard_fraction``; ``rename``: a stored name -> the model's, default V4's;
    ``splits``: the model's)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[str, int]] = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                if keep(name) if keep is not None else not name.startswith(("mtp.", "model.mtp.")):
                    piece = handle.get_slice(name)
                    shapes[name] = (piece.get_dtype(), math.prod(piece.get_shape()))
    total = 0
    for name, (kind, numel) in shapes.items():
        kept, parts = shard_fraction(cfg, name, par, rename, splits)
        if not kept:
            continue
        numel //= parts
        suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            weight = shapes.get(name[:-len(suffix)] + ".weight", ("", 0))[0]
            total += numel * (4 if weight == "F8_E4M3" else 1)
        elif kind in ("F8_E4M3", "I8", "U8", "F4"):
            total += numel
        else:
            total += numel * dtype.itemsize
    return total


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


__all__ = ["PROJ_EXPERT_NAMES", "V4_EXPERT_NAMES", "V4Quantization", "install_stored", "load_stored", "split_stored",
           "stored_matrix", "stored_weight_bytes", "v4_quantization"]
