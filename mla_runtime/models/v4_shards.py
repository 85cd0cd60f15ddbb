"""DeepSeek-V4 under tensor parallelism: which part of each tensor a rank keeps.

Each of ``N`` ranks keeps (names are the model's, ``deepseek_v4.stored_name``):

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
"""

from __future__ import annotations

import re
from typing import Any

import torch

from mla_runtime.layers.fp8 import Fp8Weight
from mla_runtime.layers.qweight import QuantizedWeight
from mla_runtime.parallel import ParallelContext

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
# the model's names (within a layer) -> (what it splits by, the dim it splits)
_SPLITS = {"self_attn.q_b_proj.weight": ("heads", 0), "self_attn.sinks": ("heads", 0),
           "self_attn.o_a_proj.weight": ("groups", 0), "self_attn.o_b_proj.weight": ("groups", 1),
           "mlp.shared_experts.gate_proj.weight": ("inter", 0), "mlp.shared_experts.up_proj.weight": ("inter", 0),
           "mlp.shared_experts.down_proj.weight": ("inter", 1), "mlp.experts.gate_up_proj": ("experts", 0),
           "mlp.experts.down_proj": ("experts", 0)}
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def check_v4_parallel(cfg: Any, world: int) -> None:
    """Refuse, saying what to change, a ``tensor_parallel_size`` that does not split ``cfg`` (a ``V4Config``)."""
    if world == 1:
        return
    sizes = {"num_attention_heads": cfg.num_attention_heads, "o_groups": cfg.o_groups,
             "n_routed_experts": cfg.n_routed_experts, "moe_intermediate_size": cfg.moe_intermediate_size}
    bad = [f"{k} ({v})" for k, v in sizes.items() if v % world]
    if bad:
        fit = [n for n in range(1, cfg.o_groups + 1) if all(v % n == 0 for v in sizes.values())]
        raise ValueError(f"tensor_parallel_size={world} cannot split this deepseek_v4 model: " + ", ".join(bad)
                         + f" not divisible by it (candidates: {fit})")


def _split_of(name: str) -> tuple[str, int] | None:
    """(what ``name`` splits by, its dim), or None for a tensor every rank keeps whole."""
    if name in _VOCAB:
        return "vocab", 0
    _, sep, rest = name.partition(".layers.")
    if not sep:
        return None
    return _SPLITS.get(rest.split(".", 1)[1] if "." in rest else rest)


def _span(cfg: Any, kind: str, size: int, par: ParallelContext) -> tuple[int, int, int]:
    """``(start, stop, rows)`` of this rank's part of ``size`` items along a dim split by ``kind``."""
    if kind == "vocab":
        start, stop, rows = par.vocab_split(cfg.vocab_size)
        return start, stop, rows
    start, stop = par.split(size)
    return start, stop, stop - start


def shard_tensor(cfg: Any, name: str, t: torch.Tensor, par: ParallelContext) -> torch.Tensor:
    """This rank's part of the float tensor ``name`` (padded with zero rows for the vocabulary's last shard)."""
    split = _split_of(name)
    if not par.enabled or split is None:
        return t
    kind, dim = split
    if kind == "experts" and t.shape[0] != cfg.n_routed_experts:
        return t  # stacked from this rank's experts only (``expert_on_rank``)
    start, stop, rows = _span(cfg, kind, t.shape[dim], par)
    part = t.narrow(dim, start, stop - start)
    if part.shape[dim] < rows:
        pad = list(part.shape)
        pad[dim] = rows - part.shape[dim]
        part = torch.cat([part, part.new_zeros(pad)], dim=dim)
    return part.contiguous()


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


__all__ = ["check_v4_parallel", "expert_on_rank", "shard_fraction", "shard_stored", "shard_tensor"]
