"""The state cache of a hybrid model: one slot per running sequence, beside the paged latent cache.

A linear-attention layer keeps no per-token rows. Each running sequence owns one slot, which holds, for every
linear-attention layer ``j``: ``layers[j].recurrent[slot] [H, d_k, d_v]`` (the gated delta rule's state) and
``layers[j].conv[slot] [3 H d_k, conv_kernel - 1]`` (the short convolution's last inputs), both float32. A slot's
size does not grow with the sequence: ``bytes_per_slot`` is the state bytes per sequence (``ModelConfig.
state_bytes_per_sequence``), as the latent cache's bytes per token are per token.

``StateSlots`` hands the slot ids out (the scheduler takes one when it admits a sequence and gives it back on every
path that ends or suspends its run: finish, abort, preemption); the tensors never move. A slot's content is not
cleared when it is given back: the model starts a sequence's first step from zeros, whatever its slot holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_runtime.config import LinearAttentionConfig


@dataclass
class LayerState:
    recurrent: torch.Tensor  # [slots, H, d_k, d_v] float32
    conv: torch.Tensor  # [slots, 3 H d_k, conv_kernel - 1] float32


class StateCache:
    def __init__(self, lin: LinearAttentionConfig, num_slots: int, device: torch.device | str = "cpu") -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        h, d = lin.num_heads, lin.head_dim
        self.layers = [LayerState(torch.zeros(num_slots, h, d, d, dtype=torch.float32, device=device),
                                  torch.zeros(num_slots, lin.conv_channels, lin.conv_kernel - 1,
                                              dtype=torch.float32, device=device))
                       for _ in range(lin.num_layers)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.layers for t in (s.recurrent, s.conv))

    @property
    def bytes_per_slot(self) -> int:
        return self.nbytes() // self.num_slots


class StateSlots:
    """The free slot ids of a ``StateCache`` (plain integers: the scheduler's side)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot: the scheduler admits a sequence only while one is free")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not taken")
        self._free.append(slot)
