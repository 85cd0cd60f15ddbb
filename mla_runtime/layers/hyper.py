"""Manifold-constrained hyper-connections, the clamped SwiGLU and the packed routed experts, shared by the models of
their own (DeepSeek-V4, GLM-5-Next, Hunyuan V4).

Hyper-connections keep ``N`` residual streams per token (``hc_mult``) instead of one. Around each block (the
attention, the MLP) a learned mix computed from the RMS-normalised streams collapses them into the block's input
(``pre [N]``), spreads the block's output back (``post [N]``) and mixes the streams themselves (``comb [N, N]``,
Sinkhorn-normalised towards a doubly stochastic matrix), all in float32::

    pre, post, comb = HyperConnection(streams)          streams [T, N, d]
    out = block(sum_n pre[n] streams[n])
    streams = post[:, None] out + comb^T streams        HyperConnection.merge

Hunyuan V4's independent form (``IndependentHyperConnection``) has no ``comb``: the streams pass the block unmixed,
``streams = post[:, None] out + streams``, and its ``post`` is ``hc_magnitude sigmoid(.) + eps``. Both models collapse
the streams at the end with ``HyperHead``'s ``pre`` alone.

The clamped SwiGLU (``swiglu_limit``) is ``silu(min(gate, limit)) * clamp(up, -limit, limit)``; the routed experts
(``PackedExperts``) apply it to each expert's rows of a step, their weights stored packed as transformers keeps them,
or, from a quantised checkpoint, each expert's matrices as stored (``keep_stored``: ``QuantizedWeight``s, FP8 blocks
or MXFP4, whose products run their formats' kernels). ``StoredLinear`` is a linear layer over such a matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mla_runtime.layers.fp8 import Fp8Weight
from mla_runtime.layers.qweight import QuantizedWeight, released_like


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS norm over the last dim (in ``x``'s dtype, the scale computed in float32)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def frozen_linear(rows: int, cols: int, dtype: torch.dtype) -> nn.Linear:
    """A bias-free ``[rows, cols]`` linear layer whose weight a checkpoint fills (no gradient)."""
    layer = nn.Linear(cols, rows, bias=False, dtype=dtype)
    layer.weight.requires_grad_(False)
    return layer


class ClampedMLP(nn.Module):
    """``down(clamped_swiglu(gate(x), up(x), limit))``: a dense MLP or a shared expert of either model."""

    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj, self.up_proj = frozen_linear(inter, hidden, dtype), frozen_linear(inter, hidden, dtype)
        self.down_proj = frozen_linear(hidden, inter, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


def row_blocks(matrix: QuantizedWeight, count: int) -> list[QuantizedWeight]:
    """``matrix`` split into ``count`` equal blocks of rows, each keeping its stored bytes (an FP8 matrix whose blocks
    end on its scale blocks is sliced; otherwise each row keeps its own scale row, ``select_rows``)."""
    rows = matrix.shape[0] // count
    if isinstance(matrix, Fp8Weight) and rows % matrix.block[0] == 0:
        per = rows // matrix.block[0]
        return [Fp8Weight(matrix.weight[g * rows:(g + 1) * rows], matrix.scale_inv[g * per:(g + 1) * per],
                          matrix.block, matrix.plain.dtype) for g in range(count)]
    return [matrix.select_rows(torch.arange(g * rows, (g + 1) * rows)) for g in range(count)]


class StoredLinear(nn.Module):
    """A bias-free linear layer over a checkpoint's stored matrix (a ``QuantizedWeight``), its products run by the
    format's kernels. ``groups`` > 1: a grouped projection (V4's ``o_a_proj``), whose ``grouped`` product multiplies
    each group of the input by its own block of rows."""

    def __init__(self, matrix: QuantizedWeight, groups: int = 1) -> None:
        super().__init__()
        if groups < 1 or matrix.shape[0] % groups:
            raise ValueError(f"StoredLinear: {groups} groups do not divide the {matrix.shape[0]} rows")
        self.shape, self.dtype = matrix.shape, matrix.plain.dtype
        self.blocks = [matrix] if groups == 1 else row_blocks(matrix, groups)

    @property
    def weight(self) -> torch.Tensor:
        """A stand-in of the float weight: its shape and dtype, no values."""
        return released_like(self.shape, self.dtype, self.blocks[0].plain.device)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored matrix and its scales."""
        return sum(m.nbytes for m in self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.blocks) != 1:
            raise RuntimeError("a grouped StoredLinear multiplies through grouped()")
        return self.blocks[0].matmul(x, None)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, groups, K / groups]`` -> ``[T, N]``: group ``g`` times its block of rows."""
        return torch.cat([m.matmul(x[:, g].contiguous(), None) for g, m in enumerate(self.blocks)], dim=-1)


class PackedExperts(nn.Module):
    """The routed experts, stored packed: ``gate_up_proj [E, 2 i, d]`` (gate rows first), ``down_proj [E, d, i]``;
    each token's output is the sum of its chosen experts' clamped SwiGLU MLPs times their routing weights. From a
    quantised checkpoint (``keep_stored``) each expert's matrices instead, as stored. ``first``: the first of the
    model's experts these are (under tensor parallelism a rank holds ``experts`` from it; a token's other experts are
    other ranks')."""

    def __init__(self, experts: int, hidden: int, inter: int, limit: float, dtype: torch.dtype, first: int = 0
                 ) -> None:
        super().__init__()
        self.limit, self.sizes, self.first = limit, (experts, hidden, inter), first
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.zeros(experts, hidden, inter, dtype=dtype), requires_grad=False)
        self.stored: tuple[list[list[QuantizedWeight]], list[QuantizedWeight]] | None = None

    def keep_stored(self, gate: list[QuantizedWeight], up: list[QuantizedWeight], down: list[QuantizedWeight]) -> None:
        """Run on each expert's stored ``gate [i, d]``, ``up [i, d]`` and ``down [d, i]`` matrices (gate and up
        stacked into one where their format stacks them as stored); the packed float parameters are dropped."""
        experts, hidden, inter = self.sizes
        shapes = {"gate": (gate, (inter, hidden)), "up": (up, (inter, hidden)), "down": (down, (hidden, inter))}
        for name, (mats, shape) in shapes.items():
            bad = [e for e, m in enumerate(mats) if tuple(m.shape) != shape]
            if len(mats) != experts or bad:
                raise ValueError(f"routed experts: {len(mats)} {name} matrices (expected {experts} of {list(shape)})"
                                 + (f"; expert {bad[0]}'s is {list(mats[bad[0]].shape)}" if bad else ""))
        del self.gate_up_proj, self.down_proj
        self.stored = ([_stacked(g, u) for g, u in zip(gate, up)], list(down))

    def _gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.stored is None:
            return F.linear(x, self.gate_up_proj[e])
        return torch.cat([m.matmul(x, None) for m in self.stored[0][e]], dim=-1)

    def _down(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.down_proj[e]) if self.stored is None else self.stored[1][e].matmul(x, None)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``x [T, d]``, each token's routing ``weights`` and chosen ``experts`` ``[T, k]`` -> ``[T, d]``."""
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            if not self.first <= e < self.first + self.sizes[0]:
                continue  # another rank's expert
            rows, slot = torch.where(experts == e)
            gate, up = self._gate_up(e - self.first, x[rows]).chunk(2, dim=-1)
            y = self._down(e - self.first, clamped_swiglu(gate, up, self.limit)) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out

    def stored_bytes(self) -> int:
        """Bytes of the stored expert matrices (0 for the packed float parameters)."""
        if self.stored is None:
            return 0
        return sum(m.nbytes for ms in self.stored[0] for m in ms) + sum(m.nbytes for m in self.stored[1])


def _stacked(gate: QuantizedWeight, up: QuantizedWeight) -> list[QuantizedWeight]:
    """``[gate; up]`` as one matrix where the format stacks the two as stored (FP8: ``gate`` ending on a block of
    rows; MXFP4 always), else the two."""
    try:
        return [type(gate).cat([gate, up])]
    except (ValueError, NotImplementedError):
        return [gate, up]


def pack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` -> the packed ``gate_up_proj``,
    ``down_proj`` (a checkpoint already packed passes as it is)."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in tensors.items():
        head, sep, tail = name.partition(".mlp.experts.")
        pieces = tail.split(".")
        if sep and len(pieces) == 3 and pieces[0].isdigit():
            parts.setdefault(head, {}).setdefault(pieces[1], {})[int(pieces[0])] = t
        else:
            out[name] = t
    for head, kinds in parts.items():
        order = sorted(kinds.get("gate_proj", {}))
        if set(kinds) != {"gate_proj", "up_proj", "down_proj"} or any(sorted(v) != order for v in kinds.values()):
            raise ValueError(f"{head}: routed experts need gate_proj, up_proj and down_proj for every expert")
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([kinds["gate_proj"][e], kinds["up_proj"][e]]) for e in order])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([kinds["down_proj"][e] for e in order])
    return out


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)


class HyperConnection(nn.Module):
    """Mixes the ``N`` residual streams around one block: from the RMS-normalised streams, ``pre [N]`` collapses
    them into the block's input, ``post [N]`` spreads its output, ``comb [N, N]`` (Sinkhorn-normalised towards a
    doubly stochastic matrix) mixes the streams themselves. Float32."""

    def __init__(self, n: int, hidden: int, iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = n, iters, eps, norm_eps
        self.fn = _param((2 + n) * n, n * hidden)
        self.base = _param((2 + n) * n)
        self.scale = _param(3)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, N, d]`` -> ``post [T, N]``, ``comb [T, N, N]``, the block's input ``[T, d]``."""
        n = self.n
        mixes = F.linear(rms(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after the block: ``post`` spreads ``out [T, d]``, ``comb`` mixes ``streams [T, N, d]``."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + comb.to(dtype).transpose(-1, -2) @ streams


class IndependentHyperConnection(nn.Module):
    """Hunyuan V4's hyper-connection: ``pre [N]`` and ``post [N]`` from the RMS-normalised streams, no stream mix
    (the module docstring). Float32."""

    def __init__(self, n: int, hidden: int, magnitude: float, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.magnitude, self.eps, self.norm_eps = n, magnitude, eps, norm_eps
        self.fn = _param(2 * n, n * hidden)
        self.base = _param(2 * n)
        self.scale = _param(2)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``streams [T, N, d]`` -> ``post [T, N]``, the block's input ``[T, d]``."""
        mixes = F.linear(rms(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w = mixes.split(self.n, dim=-1)
        pre_b, post_b = self.base.split(self.n)
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = self.magnitude * torch.sigmoid(post_w * self.scale[1] + post_b) + self.eps
        return post, (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
        """The streams after the block, in float32 and cast back: ``post`` spreads ``out [T, d]`` over them."""
        return (post.unsqueeze(-1) * out.float().unsqueeze(1) + streams.float()).to(streams.dtype)


class HyperHead(nn.Module):
    """The streams' final collapse (before the final norm): ``sum_n pre[n] streams[n]``."""

    def __init__(self, n: int, hidden: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = _param(n, n * hidden)
        self.hc_base = _param(n)
        self.hc_scale = _param(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(rms(streams.flatten(1).float(), self.norm_eps), self.hc_fn)
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
