"""Rotary position embedding of the ``d_r`` decoupled key/query dims (default RoPE and YaRN).

Layouts: DeepSeek checkpoints rotate *interleaved* pairs ``(x0, x1), (x2, x3), ...``
(``rope_interleave``); other checkpoints rotate the two halves ``(x_i, x_{i + d_r/2})``. For the
interleaved layout the rotated vector is written de-interleaved (``[even' ; odd']``): queries and keys
get the same permutation, so every dot product — and therefore attention — is unchanged, and the cache
holds a contiguous layout that the kernels read without strides.

YaRN (arXiv 2309.00071) blends interpolated and extrapolated frequencies with a linear ramp between
the ``beta_fast``/``beta_slow`` correction dims; cos/sin are multiplied by the attention factor and the
softmax scale carries ``mscale_all_dim`` (see ``RopeConfig``).

A rotation is linear: ``x' = x R`` with ``R [d_r, d_r]`` holding each pair's ``cos``/``±sin`` (and the
de-interleaving permutation). A step of at most ``ROPE_MATRIX_MAX_TOKENS`` tokens (decodes, verifications)
builds every token's ``R`` once and each layer rotates its queries and key with one batched product — five
operator calls per layer instead of a dozen; longer steps use the complex product (interleaved) or the
cos/sin formula, whose tables do not grow with ``d_r²``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mla_runtime.attention.rope_tables import RopeTables
from mla_runtime.config import RopeConfig

ROPE_MATRIX_MAX_TOKENS = 64  # steps of at most this many tokens rotate by one batched product per layer
ROPE_TABLE_MIN_POSITIONS = 4096  # the cos/sin table covers at least this many positions (it doubles as needed)


def rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Inverse frequencies ``[dim / 2]`` (fp32)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    pos_freqs = rope.theta ** exponents
    if rope.kind == "none":  # no rotation: cos 1, sin 0 at every position
        return torch.zeros(dim // 2, dtype=torch.float32)
    if rope.kind == "default":
        return 1.0 / pos_freqs
    if rope.kind == "longrope":
        assert rope.short_factor is not None and len(rope.short_factor) == dim // 2  # validated by ModelConfig
        return 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * pos_freqs)
    orig = rope.original_max_position_embeddings
    assert orig is not None  # validated by RopeConfig

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rotation_slots(dim: int, interleave: bool) -> torch.Tensor:
    """Flat indices into a ``[dim, dim]`` rotation matrix of the entries ``[cos ; -sin ; cos ; sin]`` (each
    ``[dim / 2]``): pair ``i`` reads inputs ``(a, b)`` = ``(2i, 2i + 1)`` (interleaved) or ``(i, i + dim / 2)`` and
    writes outputs ``i`` (``a cos - b sin``) and ``i + dim / 2`` (``b cos + a sin``)."""
    half = dim // 2
    i = torch.arange(half)
    a, b = (2 * i, 2 * i + 1) if interleave else (i, i + half)
    return torch.cat([a * dim + i, b * dim + i, b * dim + half + i, a * dim + half + i])


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor
    slots: torch.Tensor

    def __init__(self, rope: RopeConfig, dim: int) -> None:
        super().__init__()
        self.interleave = rope.interleave
        self.scale = rope.cos_sin_scale
        self.rope, self.dim = rope, dim
        device = torch.get_default_device()
        with torch.device("cpu"):  # made on the CPU and moved: a model built on the meta device would run these through
            inv_freq, slots = rope_inv_freq(rope, dim), rotation_slots(dim, rope.interleave)  # torch's slow references
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.register_buffer("slots", slots.to(device), persistent=False)
        self._tables: dict[torch.dtype, torch.Tensor] = {}  # dtype -> [positions, d_r]: cos ; sin of each position
        self.frequency_scale: torch.Tensor | None = None  # LeRoPE's exp(alpha) [d_r / 2] (scale_frequencies)

    def materialize(self, device: torch.device | str) -> None:
        """Compute the buffers on ``device`` (a model built on the meta device has none)."""
        inv_freq = rope_inv_freq(self.rope, self.dim)
        if self.frequency_scale is not None:
            inv_freq = inv_freq * self.frequency_scale.to(inv_freq.device)
        self.inv_freq = inv_freq.to(device)
        self.slots = rotation_slots(self.dim, self.rope.interleave).to(device)
        self._tables = {}

    def scale_frequencies(self, scale: torch.Tensor | None) -> None:
        """Multiply each inverse frequency by ``scale [d_r / 2]`` (float32; Mistral Large 4's learned ``exp(alpha)``,
        ``RopeConfig.learned_frequency_scale``); None: the config's frequencies. Recomputes the tables."""
        self.frequency_scale = None if scale is None else scale.detach().to("cpu", torch.float32)
        self.materialize(self.inv_freq.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, d_r / 2]`` for integer positions ``[T]``: rows of a table of every position up to the
        largest seen, computed once by the same formula (so the same values) and doubled when a step goes past it.
        ``max_position``: the largest of ``positions`` when the caller knows it (saves reading it back)."""
        if positions.shape[0] == 0:
            empty = torch.empty(0, self.inv_freq.shape[0], dtype=dtype, device=positions.device)
            return empty, empty
        top = int(positions.max()) if max_position is None else max_position
        table = self._tables.get(dtype)
        if table is None or table.shape[0] <= top:
            size = max(ROPE_TABLE_MIN_POSITIONS, 2 * (top + 1))
            freqs = torch.arange(size, device=self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
            table = torch.cat([(freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)], dim=1)
            self._tables[dtype] = table
        rows = table.index_select(0, positions)
        half = self.inv_freq.shape[0]
        return rows[:, :half], rows[:, half:]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None) -> RopeTables:
        """The step's tables for ``positions [T]`` in ``dtype``: computed once, read by every layer."""
        cos, sin = self.cos_sin(positions, dtype, max_position)
        if dtype not in (torch.float32, torch.bfloat16):
            return RopeTables(cos, sin, None)
        if positions.shape[0] <= ROPE_MATRIX_MAX_TOKENS:
            return RopeTables(cos, sin, None, slots=self.slots)
        cis = torch.complex(cos.float(), sin.float()).unsqueeze(1) if self.interleave else None  # [T, 1, d_r / 2]
        return RopeTables(cos, sin, cis)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, ..., d_r]`` with cos/sin ``[T, d_r / 2]``; output de-interleaved."""
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.view(shape), sin.view(shape)
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                tables: RopeTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the RoPE parts of queries ``[T, n_h, d_r]`` and keys ``[T, d_r]``; ``tables`` may come
        precomputed (``tables(positions, q.dtype)``, shared by all layers of a step)."""
        tables = tables if tables is not None else self.tables(positions, q.dtype)
        if q.shape[0] == 0:
            return self.rotate(q, tables.cos, tables.sin), self.rotate(k, tables.cos, tables.sin)
        both = torch.cat([q, k.unsqueeze(1)], dim=1)  # [T, n_h + 1, d_r]: one rotation, the key as one more head
        if tables.matrix is not None and both.dtype in (torch.float32, torch.bfloat16):
            rotated = torch.bmm(both if both.dtype == torch.float32 else both.float(), tables.matrix)
            both = rotated if rotated.dtype == both.dtype else rotated.to(both.dtype)
        elif tables.cis is not None and both.dtype in (torch.float32, torch.bfloat16):
            # interleaved pairs are complex numbers: one complex product (fp32; bf16 rounds once at the
            # end, within one bf16 step of rounding each product as the reference does), then de-interleave
            dtype = both.dtype
            wide = both if dtype == torch.float32 else both.float()
            rotated = torch.view_as_real(torch.view_as_complex(wide.unflatten(-1, (-1, 2))) * tables.cis)
            both = rotated.transpose(-1, -2).flatten(-2)  # [T, n_h + 1, d_r] = [even' ; odd']
            if dtype != torch.float32:
                both = both.to(dtype)
        else:
            both = self.rotate(both, tables.cos, tables.sin)
        return both[:, :-1], both[:, -1]
