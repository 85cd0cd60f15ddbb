"""``RopeTables``: one step's rotary tables, made once by the model (``layers/rotary.py``) and read by every layer's
attention through the step's metadata."""

from __future__ import annotations

import torch


class RopeTables:
    """One step's RoPE tables: ``cos``/``sin [T, d_r / 2]`` in the model dtype; for fp32/bf16, either each
    token's rotation matrix ``[T, d_r, d_r]`` (fp32; short steps; made at its first use, which a step whose layers
    run as compiled calls never has) or, for interleaved pairs, ``cis = cos + i·sin [T, 1, d_r / 2]`` (complex64) for
    the one-product rotation."""

    __slots__ = ("cos", "sin", "cis", "_matrix", "_slots")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, cis: torch.Tensor | None,
                 matrix: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> None:
        self.cos, self.sin, self.cis = cos, sin, cis
        self._matrix = matrix
        self._slots = slots  # rotation_slots(): the matrix is made from them on first use

    @property
    def matrix(self) -> torch.Tensor | None:
        if self._matrix is None and self._slots is not None:
            self._matrix = rotation_matrices(self.cos, self.sin, self._slots)
        return self._matrix

    def tail(self, start: int) -> RopeTables:
        """The tables of tokens ``[start:]``."""
        return RopeTables(self.cos[start:], self.sin[start:], None if self.cis is None else self.cis[start:],
                          None if self._matrix is None else self._matrix[start:], self._slots)


def rotation_matrices(cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``R [T, d_r, d_r]`` (fp32) with ``x R`` = ``rotate(x)`` for each token's cos/sin ``[T, d_r / 2]``
    (``slots``: ``rotation_slots``)."""
    c, s = cos.float(), sin.float()
    dim = 2 * c.shape[1]
    matrix = torch.zeros(c.shape[0], dim * dim, dtype=torch.float32, device=c.device)
    matrix.index_copy_(1, slots, torch.cat([c, -s, c, s], dim=1))
    return matrix.view(-1, dim, dim)
