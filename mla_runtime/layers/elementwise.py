"""Elementwise ops whose float32 value must not depend on the rows sharing their call.

ATen runs an elementwise op over a contiguous tensor as one flat loop, split between threads. The elements short of a
whole vector at the end of each thread's share take the scalar formula, which rounds differently from the vectorised
one; so in float32 an element's value depends on how many rows the call holds and on the thread count. Both formulas
agree in float64 far below float32's rounding: computed there and rounded back to float32, an element gets the same
bits wherever it falls.
"""

from __future__ import annotations

import torch


def wide(x: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """``x`` in float64 where ``exact`` (for an op whose float32 result must not depend on the call's rows), else in
    float32."""
    return x.double() if exact else x.float()
