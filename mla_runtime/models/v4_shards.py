"""The models of their own under tensor parallelism: which part of each tensor a rank keeps.

DeepSeek-V4 (``V4_SPLITS``): each of ``N`` ranks keeps (names are the model's, ``deepseek_v4.stored_name``):

- the query heads ``[r h / N, (r + 1) h / N)``: their rows of ``q_b_proj`` and their ``sinks``; with them the output
  groups they feed (``o_groups / N`` of them, heads ``g h / G ..`` feed group ``g``): those groups' rows of the
  grouped ``o_a_proj`` and their columns of ``o_b_proj``, whose partial outputs the ranks sum (one all-reduce);
- the routed experts ``[r E / N, (r + 1) E / N)``, whole, and the shared expert's intermediate slice (rows of
  ``gate_proj``/``up_proj``, columns of ``down_proj``); the router is replicated, the routed and shared outputs are
  summed in one all-reduce;
- the vocabulary rows ``ceil(V / N)`` of the embedding and the head (as every other family);
- everything else whole: ``q_a_proj``, the single shared K=V head (``kv_proj``, ``kv_norm``), the compressors and the
  indexer, the norms and the hyper-connections. V4 attends one KV head, which every head reads: splitting it would
  give no rank a smaller share, so every rank computes the same latents, compressed entries and indexer selection
  (the indexer whole too: its top-k over the sum of its heads' scores stays bit-for-bit one rank's, with no
  collective), and each rank's state slots hold the whole of each sequence's windows and entries.

A released FP8 / MXFP4 checkpoint shards the same way (``shard_stored``): whole experts; an FP8 matrix cut on its
scale blocks (rows off a block boundary keep a scale row each), a column cut off a block boundary refused by name.

Hunyuan V4 and dots3-note (``HY_V4_SPLITS``, ``DOTS3_SPLITS``) split the same way, by their own names: each rank keeps
its query heads' rows of ``q_b_proj`` and ``kv_b_proj``, their columns of ``o_proj``, their output gates' rows
(``gate_proj`` / ``g_proj``) and sinks; its routed experts whole, its slice of the shared expert's and the dense MLPs'
intermediate size; its vocabulary rows. The latent projections, norms, the indexer (whose top-k then needs no
collective and is the same on every rank), the router and the hyper-connections stay whole, so every rank computes
the same latents and indexer keys and holds every sequence's state. A dots3-note sliding layer splits its own head
count. A rank reads only its part of each split tensor from the files (``read_part``): its rows or columns of a
matrix, its experts of the packed ones.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from mla_runtime.layers.fp8 import Fp8Weight
from mla_runtime.layers.qweight import QuantizedWeight
from mla_runtime.models.own_checkpoint import read_checkpoint
from mla_runtime.parallel import ParallelContext

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
# the model's names (within a layer) -> (what it splits by, the dim it splits)
V4_SPLITS = {"self_attn.q_b_proj.weight": ("heads", 0), "self_attn.sinks": ("heads", 0),
             "self_attn.o_a_proj.weight": ("groups", 0), "self_attn.o_b_proj.weight": ("groups", 1),
             "mlp.shared_experts.gate_proj.weight": ("inter", 0), "mlp.shared_experts.up_proj.weight": ("inter", 0),
             "mlp.shared_experts.down_proj.weight": ("inter", 1), "mlp.experts.gate_up_proj": ("experts", 0),
             "mlp.experts.down_proj": ("experts", 0)}
# Hunyuan V4's and dots3-note's: MLA's per-head projections, the dense MLPs too
_MLA_SPLITS = {"self_attn.q_b_proj.weight": ("heads", 0), "self_attn.kv_b_proj.weight": ("heads", 0),
               "self_attn.o_proj.weight": ("heads", 1), "self_attn.sinks": ("heads", 0),
               "mlp.gate_proj.weight": ("inter", 0), "mlp.up_proj.weight": ("inter", 0),
               "mlp.down_proj.weight": ("inter", 1), "mlp.shared_experts.gate_proj.weight": ("inter", 0),
               "mlp.shared_experts.up_proj.weight": ("inter", 0), "mlp.shared_experts.down_proj.weight": ("inter", 1),
               "mlp.experts.gate_up_proj": ("experts", 0), "mlp.experts.down_proj": ("experts", 0)}
HY_V4_SPLITS = {**_MLA_SPLITS, "self_attn.gate_proj.weight": ("heads", 0)}  # the output gate: v_head_dim per head
DOTS3_SPLITS = {**_MLA_SPLITS, "self_attn.g_proj.weight": ("heads", 0)}  # the output gate: one per head
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def check_parallel(family: str, sizes: dict[str, int], world: int) -> None:
    """Refuse, saying what to change, a ``tensor_parallel_size`` (``world``) that does not divide every one of
    ``sizes`` (what a rank takes its share of: heads, output groups, experts, intermediate sizes)."""
    if world == 1:
        return
    bad = [f"{k} ({v})" for k, v in sizes.items() if v % world]
    if bad:
        fit = [n for n in range(1, min(sizes.values()) + 1) if all(v % n == 0 for v in sizes.values())]
        raise ValueError(f"tensor_parallel_size={world} cannot split this {family} model: " + ", ".join(bad)
                         + f" not divisible by it (candidates: {fit})")


def check_v4_parallel(cfg: Any, world: int) -> None:
    """Refuse, saying what to change, a ``tensor_parallel_size`` that does not split ``cfg`` (a ``V4Config``)."""
    check_parallel("deepseek_v4", {"num_attention_heads": cfg.num_attention_heads, "o_groups": cfg.o_groups,
                                   "n_routed_experts": cfg.n_routed_experts,
                                   "moe_intermediate_size": cfg.moe_intermediate_size}, world)


def _split_of(name: str, splits: dict[str, tuple[str, int]] = V4_SPLITS) -> tuple[str, int] | None:
    """(what ``name`` splits by, its dim) in the model's ``splits``, or None for a tensor every rank keeps whole."""
    if name in _VOCAB:
        return "vocab", 0
    _, sep, rest = name.partition(".layers.")
    if not sep:
        return None
    return splits.get(rest.split(".", 1)[1] if "." in rest else rest)


def _span(cfg: Any, kind: str, size: int, par: ParallelContext) -> tuple[int, int, int]:
    """``(start, stop, rows)`` of this rank's part of ``size`` items along a dim split by ``kind``."""
    if kind == "vocab":
        start, stop, rows = par.vocab_split(cfg.vocab_size)
        return start, stop, rows
    start, stop = par.split(size)
    return start, stop, stop - start


def read_part(cfg: Any, name: str, shape: list[int] | torch.Size, par: ParallelContext,
              splits: dict[str, tuple[str, int]] = V4_SPLITS) -> tuple[int, int, int] | None:
    """``(dim, start, stop)``: the part of the tensor ``name`` (the model's name; ``shape`` as stored) this rank
    keeps, or None for the whole of it (kept whole, or stacked from this rank's experts only)."""
    split = _split_of(name, splits)
    if not par.enabled or split is None:
        return None
    kind, dim = split
    if kind == "experts" and shape[0] != cfg.n_routed_experts:
        return None  # stacked from this rank's experts only (``expert_on_rank``)
    start, stop, _ = _span(cfg, kind, shape[dim], par)
    return dim, start, stop


def pad_vocab(cfg: Any, name: str, part: torch.Tensor, par: ParallelContext) -> torch.Tensor:
    """This rank's vocabulary rows ``part`` of ``name`` with zero rows added up to ``ceil(V / N)`` (the last
    shard's); any other tensor as it is."""
    if not par.enabled or name not in _VOCAB:
        return part
    rows = par.vocab_split(cfg.vocab_size)[2]
    if part.shape[0] < rows:
        part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
    return part


def read_shard(path: str | Path, model_types: tuple[str, ...], cfg: Any, par: ParallelContext,
               splits: dict[str, tuple[str, int]], rename: Callable[[str], str | None]) -> dict[str, torch.Tensor]:
    """This rank's tensors of a float checkpoint by the model's names (``rename``: a stored name -> the model's, None
    for one not read), read from the files as this rank keeps them: its part of each split tensor only
    (``read_part``), the vocabulary's padded to ``ceil(V / N)`` rows; per-expert tensors of this rank's experts only,
    renumbered from 0 (``expert_on_rank``)."""
    def mine(name: str) -> str | None:
        model_name = rename(name)
        return None if model_name is None else expert_on_rank(cfg, model_name, par)

    _, _, tensors = read_checkpoint(path, model_types, keep=lambda name: mine(name) is not None,
                                    part=lambda name, shape: read_part(cfg, cast(str, mine(name)), shape, par, splits))
    return {n: pad_vocab(cfg, n, t, par) for name, t in tensors.items() if (n := mine(name)) is not None}


def shard_tensor(cfg: Any, name: str, t: torch.Tensor, par: ParallelContext,
                 splits: dict[str, tuple[str, int]] = V4_SPLITS) -> torch.Tensor:
    """This rank's part of the float tensor ``name`` (padded with zero rows for the vocabulary's last shard)."""
    span = read_part(cfg, name, t.shape, par, splits)
    if span is None:
        return t
    dim, start, stop = span
    return pad_vocab(cfg, name, t.narrow(dim, start, stop - start), par).contiguous()


def expert_on_rank(cfg: Any, name: str, par: ParallelContext) -> str | None:
    """A per-expert tensor's name (``...mlp.experts.{e}.w1.weight``) renumbered to this rank's experts, None where
    another rank keeps that expert; any other name as it is."""
    m = _EXPERT.search(name)
    if not par.enabled or m is None:
        return name
    start, stop = par.split(cfg.n_routed_experts)
    e = int(m.group(1))
    return None if not start <= e < stop else name[:m.start(1)] + str(e - start) + name[m.end(1):]


def shard_stored(cfg: Any, name: str, m: QuantizedWeight, par: ParallelContext) -> QuantizedWeight:
    """This rank's part of the stored matrix ``name`` (a routed expert's is whole: ``expert_on_rank`` chose it)."""
    split = _split_of(name)
    if not par.enabled or split is None or ".mlp.experts." in name:
        return m
    kind, dim = split
    start, stop, rows = _span(cfg, kind, m.shape[dim], par)
    if stop - start != rows:
        raise ValueError(f"deepseek_v4: {name} is stored quantised; its vocabulary does not split evenly over "
                         f"tensor_parallel_size={par.world_size}: load it with tensor_parallel_size 1")
    if dim == 0:
        if isinstance(m, Fp8Weight) and start % m.block[0] == 0 and (stop % m.block[0] == 0 or stop == m.shape[0]):
            bn = m.block[0]
            return Fp8Weight(m.weight[start:stop], m.scale_inv[start // bn:-(-stop // bn)], m.block, m.plain.dtype)
        return m.select_rows(torch.arange(start, stop))
    if isinstance(m, Fp8Weight) and start % m.block[1] == 0 and (stop % m.block[1] == 0 or stop == m.shape[1]):
        bk = m.block[1]
        return Fp8Weight(m.weight[:, start:stop], m.scale_inv[:, start // bk:-(-stop // bk)], m.block, m.plain.dtype)
    raise ValueError(f"deepseek_v4: tensor_parallel_size={par.world_size} cuts {name}'s input columns "
                     f"[{start}, {stop}) off its stored blocks ({type(m).__name__}"
                     f"{' ' + str(m.block) if isinstance(m, Fp8Weight) else ''}): load it with a tensor_parallel_size "
                     f"whose slices end on the blocks, or with 1")


def shard_fraction(cfg: Any, name: str, par: ParallelContext) -> tuple[bool, int]:
    """For sizing a stored checkpoint from its files' headers: (whether this rank keeps the tensor ``name``, in the
    released layout or the model's, and the parts of it this rank keeps 1 in: 1 whole, ``N`` a shard)."""
    from mla_runtime.models.deepseek_v4 import stored_name

    if not par.enabled:
        return True, 1
    base = name
    for suffix in (".weight_scale_inv", ".scale"):
        if name.endswith(suffix):
            base = name[:-len(suffix)] + ".weight"
    mine = stored_name(base)
    if mine is None or expert_on_rank(cfg, mine, par) is None:
        return False, 1
    if _EXPERT.search(mine):
        return True, 1
    return True, (par.world_size if _split_of(mine) is not None else 1)


__all__ = ["DOTS3_SPLITS", "HY_V4_SPLITS", "V4_SPLITS", "check_parallel", "check_v4_parallel", "expert_on_rank",
           "pad_vocab", "read_part", "read_shard", "shard_fraction", "shard_stored", "shard_tensor"]
