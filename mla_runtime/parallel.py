"""Tensor parallelism: who this process is, how tensors are split, and the collectives.

Split (Megatron-style, one all-reduce per attention and per MLP/MoE block):
- attention: the heads (``q_proj``/``q_b_proj`` and ``kv_b_proj`` rows, ``o_proj`` columns); the
  latent projections ``q_a_proj``/``kv_a_proj_with_mqa`` and the norms are replicated, so every rank
  computes the same ``[c ; k_r]`` for every token;
- dense MLP and shared experts: the intermediate dimension; routed experts: whole experts per rank
  (the router is replicated, each rank runs its own experts);
- embedding and lm_head: the vocabulary (``ceil(V / N)`` rows per rank).

Latent-cache layouts (all ranks use the same block ids, chosen by rank 0's one scheduler):
- ``replicated``: every rank caches every token's latent and attends its own heads;
- ``sharded``: the token at position ``p`` is cached on rank ``p mod N`` only, in a block of
  ``block_size / N`` local slots. Every rank attends its tokens with the queries of *all* heads
  (all-gathered), and the partial outputs are merged by log-sum-exp:
  ``o = sum_r exp(lse_r - lse) o_r`` with ``lse = log sum_r exp(lse_r)``. Per-rank cache memory
  falls N-fold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mla_runtime.config import ModelConfig


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    latent_cache_layout: str = "replicated"

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def sharded_cache(self) -> bool:
        return self.enabled and self.latent_cache_layout == "sharded"

    def split(self, n: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``n`` items that divide evenly."""
        size = n // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def vocab_split(self, vocab: int) -> tuple[int, int, int]:
        """``(start, stop, rows)``: this rank's vocabulary range and its padded row count."""
        rows = -(-vocab // self.world_size)
        start = min(self.rank * rows, vocab)
        return start, min(start + rows, vocab), rows

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        if x.dtype in (torch.bfloat16, torch.float16):  # reduce in fp32 (gloo), round once
            y = x.float()
            dist.all_reduce(y)
            return y.to(x.dtype)
        dist.all_reduce(x)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' elementwise maximum of ``x`` (in place)."""
        if self.enabled:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (in place; every rank passes a tensor of the same shape)."""
        if self.enabled:
            dist.broadcast(x, src=0)
        return x

    def gather_to_first(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` on rank 0 (None elsewhere)."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=dim) if parts is not None else None


SINGLE_RANK = ParallelContext()


def check_tensor_parallel(cfg: ModelConfig, world_size: int, block_size: int, layout: str) -> None:
    """Fail at start-up, saying what to change, when the model cannot be split ``world_size`` ways."""
    if world_size == 1:
        return
    problems = []
    if cfg.num_attention_heads % world_size:
        problems.append(f"num_attention_heads ({cfg.num_attention_heads}) is not divisible by it")
    if cfg.moe is not None:
        if cfg.moe.n_routed_experts % world_size:
            problems.append(f"n_routed_experts ({cfg.moe.n_routed_experts}) is not divisible by it")
        shared = cfg.moe.moe_intermediate_size * cfg.moe.n_shared_experts
        if shared % world_size:
            problems.append(f"the shared experts' intermediate size ({shared}) is not divisible by it")
    if any(cfg.dense_mlps(i) for i in range(cfg.num_hidden_layers)) and cfg.intermediate_size % world_size:
        problems.append(f"intermediate_size ({cfg.intermediate_size}) is not divisible by it")
    if layout == "sharded" and (block_size % world_size or (block_size // world_size) % 16):
        problems.append(f"block_size / tensor_parallel_size ({block_size} / {world_size}) must be a multiple of 16 "
                        f"(each rank's block of the sharded latent cache)")
    if problems:
        divisors = [n for n in range(1, cfg.num_attention_heads + 1) if cfg.num_attention_heads % n == 0
                    and (cfg.moe is None or cfg.moe.n_routed_experts % n == 0)]
        raise ValueError(f"tensor_parallel_size={world_size} cannot split this model: " + "; ".join(problems)
                         + f". Use a tensor_parallel_size that divides them (candidates: {divisors}).")


def local_latent_view(positions: torch.Tensor, slot_mapping: torch.Tensor, token_seq_lens: torch.Tensor,
                      block_size: int, par: ParallelContext) -> tuple[torch.Tensor, torch.Tensor]:
    """For the sharded layout: this rank's slot of each new token (−1 when another rank keeps it) and
    how many of this rank's cached tokens each query may see."""
    n = par.world_size
    local_block = block_size // n
    mine = positions % n == par.rank
    local_slots = (slot_mapping // block_size) * local_block + (slot_mapping % block_size) // n
    local_slots = torch.where(mine, local_slots, torch.full_like(local_slots, -1))
    # positions p <= q_pos with p ≡ rank (mod n): floor((q_pos - rank) / n) + 1, at least 0
    visible = torch.div(token_seq_lens.to(torch.int64) - 1 - par.rank, n, rounding_mode="floor") + 1
    return local_slots, visible.clamp(min=0).to(torch.int32)
