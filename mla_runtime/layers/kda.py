"""Kimi Delta Attention (KDA): the linear-attention layer of a hybrid model (Kimi Linear).

For the new tokens ``x [T, d]`` of a step (several sequences, each contiguous)::

    [q ; k ; v] = silu(conv(x W_q ; x W_k ; x W_v))     a causal depthwise convolution of conv_kernel taps
    g = -exp(A_log) * softplus(f(x) + dt_bias)          per head and key channel: the log forget gate
    beta = sigmoid(b_proj(x))                            per head
    o = gated delta rule (layers.delta_rule) over (q, k, v, g, beta)
    out = o_proj(rmsnorm(o) * sigmoid(g(x)))             per head: a norm over d_v, then an output gate

Kimi Linear's ``f`` and ``g`` are low-rank (``f_b(f_a(x))``, ``g_b(g_a(x))``), Ling's full (``f_proj``, ``g_proj``);
Ling's forget gate is bounded: ``g = lower_bound * sigmoid(exp(A_log) * (f(x) + dt_bias))``
(``LinearAttentionConfig``).

The layer keeps no per-token cache. A sequence's state lives in its slot of the step's ``LayerState``: the
convolution's last ``conv_kernel - 1`` inputs and the recurrent ``[H, d_k, d_v]`` state, both float32. A sequence
whose step starts at position 0 starts from zeros (whatever its slot held before); a one-token step of a sequence
already started updates its state recurrently (all such rows of a step at once); any longer step runs the chunked
form of the rule from the slot's state. Each sequence reads and writes its own slot only. A step may ask for a
sequence's states after its first ``n`` new tokens (``ForwardBatch.state_snapshots``: a prefix-cache snapshot): its
tokens then run in two parts, and the slot's states between them are copied to the snapshot's row.

The kernels are chosen once per layer when the weights are prepared (``prepare_inference``, recorded as
``KimiDeltaAttention.kernels``): on CPU tensors the compiled operators where the kernel plan has them
(``KernelPlan.delta_failure`` None: ``mla_kernels.cpu_kernels.short_conv_step`` and ``delta_rule_step`` for the decode
rows, ``delta_rule_prefill`` for longer steps, all updating the slots in place), on CUDA tensors the Triton kernels of
the rule (``mla_kernels.linear_attention``), else the float32 torch reference (``layers.delta_rule``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mla_kernels import cpu_kernels, linear_attention
from mla_runtime.cache.state_cache import LayerState
from mla_runtime.config import LinearAttentionConfig, ModelConfig
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.kernel_plan import KernelPlan
from mla_runtime.layers import delta_rule
from mla_runtime.layers.elementwise import wide
from mla_runtime.layers.linear import Linear

DECODE_KERNELS = ("compiled", "triton", "torch")


@dataclass(frozen=True)
class LinearKernels:
    """What runs a linear-attention layer's rule and convolution, and why. ``decode`` (the one-token rows of started
    sequences): "compiled" (the CPU operators: the short convolution and the rule's update, in place over the state
    slots), "triton" (the rule's update on CUDA; the convolution in torch) or "torch" (the float32 reference).
    ``prefill`` (every longer step of a sequence): "compiled" (the CPU operator running the rule token by token from
    the slot's state), "triton" (the same on CUDA) or "torch" (the chunked WY form)."""

    decode: str = "torch"
    reason: str = "not prepared"
    prefill: str = "torch"

    def __post_init__(self) -> None:
        if self.decode not in DECODE_KERNELS or self.prefill not in DECODE_KERNELS:
            raise ValueError(f"linear kernels: decode {self.decode!r} and prefill {self.prefill!r} must each be one "
                             f"of {', '.join(DECODE_KERNELS)}")


def linear_kernels(plan: KernelPlan, device: torch.device) -> LinearKernels:
    """The kernels of a layer whose weights are on ``device``, under the model's kernel ``plan``."""
    if device.type == "cuda":
        return LinearKernels("triton", "the Triton delta-rule kernels (mla_kernels.linear_attention) on CUDA tensors",
                             prefill="triton")
    if device.type == "cpu" and plan.delta_failure is None:
        return LinearKernels("compiled", "the compiled CPU operators (delta_rule_step, delta_rule_prefill, "
                             "short_conv_step)", prefill="compiled")
    return LinearKernels("torch", plan.delta_failure or f"no compiled kernel for {device.type} tensors")


class ShortConv(nn.Module):
    """The depthwise causal convolution's taps, ``weight [channels, 1, kernel]`` (the checkpoint's layout), kept in
    float32 whatever the model's dtype: the convolution runs in float32."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=torch.float32), requires_grad=False)


class ForgetGate(nn.Module):
    """The log forget gate ``[T, H, d_k]`` from ``f(x) + dt_bias``: ``-exp(A_log) softplus(.)``, or
    ``lower_bound sigmoid(exp(A_log) .)`` with a lower bound. ``f`` low-rank (``f_b(f_a(x))``, Kimi Linear, GLM-5-Next)
    or full (``f_proj``, Ling); ``A_log [1, 1, H, 1]`` (Kimi Linear) or ``[H]`` (``flat_a_log``)."""

    def __init__(self, hidden: int, lin: LinearAttentionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        heads, head_dim = lin.num_heads, lin.head_dim
        self.heads, self.head_dim, self.lower_bound = heads, head_dim, lin.gate_lower_bound
        self.f_proj = None if lin.low_rank_gates else Linear(hidden, heads * head_dim, dtype)
        self.f_a_proj = Linear(hidden, head_dim, dtype) if lin.low_rank_gates else None
        self.f_b_proj = Linear(head_dim, heads * head_dim, dtype) if lin.low_rank_gates else None
        self.dt_bias = nn.Parameter(torch.empty(heads * head_dim, dtype=torch.float32), requires_grad=False)
        shape = (heads,) if lin.flat_a_log else (1, 1, heads, 1)
        self.A_log = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
        self.exact = False  # True: computed in float64 (``wide``; the model's rows_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.f_proj(x) if self.f_proj is not None else cast(Linear, self.f_b_proj)(cast(Linear, self.f_a_proj)(x))
        raw = wide(f.float() + self.dt_bias.float(), self.exact).view(-1, self.heads, self.head_dim)
        rate = wide(self.A_log.float().exp(), self.exact).view(self.heads, 1)
        if self.lower_bound is not None:
            return (self.lower_bound * torch.sigmoid(rate * raw)).float()
        return (-rate * F.softplus(raw, threshold=20.0)).float()


class GatedHeadNorm(nn.Module):
    """Per head: an RMSNorm over ``d_v`` (float32, weight float32) times ``sigmoid(gate)``, cast back."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.exact = False  # True: the gate's sigmoid in float64 (``wide``; the model's rows_invariant)

    def forward(self, o: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        normed = F.rms_norm(o.float(), (o.shape[-1],), self.weight.float(), self.eps)
        return (normed * torch.sigmoid(wide(gate, self.exact)).float()).to(dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, state_layer: int) -> None:
        super().__init__()
        lin = cfg.linear_attention
        assert lin is not None
        self.state_layer = state_layer  # this layer's index among the model's linear-attention layers
        self.heads, self.head_dim, self.kernel = lin.num_heads, lin.head_dim, lin.conv_kernel
        width, hidden = lin.num_heads * lin.head_dim, cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj = (Linear(hidden, width, dtype) for _ in range(3))
        self.conv1d = ShortConv(3 * width, lin.conv_kernel)
        self.forget_gate = ForgetGate(hidden, lin, dtype)
        self.b_proj = Linear(hidden, lin.num_heads, dtype)
        self.g_proj = None if lin.low_rank_gates else Linear(hidden, width, dtype)
        self.g_a_proj = Linear(hidden, lin.head_dim, dtype) if lin.low_rank_gates else None
        self.g_b_proj = Linear(lin.head_dim, width, dtype) if lin.low_rank_gates else None
        self.o_norm = GatedHeadNorm(lin.head_dim, cfg.rms_norm_eps, dtype)
        self.o_proj = Linear(width, hidden, dtype)
        self.kernels = LinearKernels()  # the decode rows' kernels (prepare_inference)
        self.exact = False  # True: the step's elementwise gates in float64 (``wide``; the model's rows_invariant)

    def rows_invariant(self) -> None:
        """Every row's gates the same bits whatever rows share the step (``wide``)."""
        self.exact = self.forget_gate.exact = self.o_norm.exact = True

    def prepare_inference(self, plan: KernelPlan) -> None:
        """Choose the decode rows' kernels for the weights' device under ``plan`` (once the weights are final)."""
        self.kernels = linear_kernels(plan, self.conv1d.weight.device)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: LayerState) -> torch.Tensor:
        """``x [T, d]`` (the step's tokens, normed) -> ``[T, d]``, each sequence's state in ``state`` updated."""
        if batch.state_slots is None:
            raise ValueError("a linear-attention layer needs the step's state slots (ForwardBatch.state_slots)")
        t, h, dk = x.shape[0], self.heads, self.head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, 3 H d_k]
        g = self.forget_gate(x)
        beta = torch.sigmoid(wide(self.b_proj(x), self.exact)).float()
        out = torch.empty(t, h, dk, dtype=torch.float32, device=x.device)
        first = self._decodes(batch)
        cuts: dict[int, list[tuple[int, int]]] = {}  # sequence -> (tokens, state row) of its snapshots
        for b, n, row in sorted(batch.state_snapshots):
            cuts.setdefault(b, []).append((n, row))
        if first:
            self._decode_rows(mixed[:first], g[:first], beta[:first], out[:first], batch.state_slots[:first], state)
            for b in range(first):
                for _, row in cuts.get(b, []):
                    state.copy_row(batch.state_slots[b], row)
        start = first
        for b in range(first, batch.num_seqs):
            n, slot, done = batch.query_lens[b], batch.state_slots[b], 0
            for cut, row in [*cuts.get(b, []), (n, -1)]:
                if cut > done:  # the tokens up to the cut, from the slot's state (zeros at the sequence's start)
                    part = slice(start + done, start + cut)
                    out[part] = self._sequence(mixed[part], g[part], beta[part], slot,
                                               done == 0 and batch.context_lens_list[b] == 0, state)
                    done = cut
                if row >= 0:
                    state.copy_row(slot, row)
            start += n
        gate = (self.g_proj(x) if self.g_proj is not None
                else cast(Linear, self.g_b_proj)(cast(Linear, self.g_a_proj)(x))).view(t, h, dk)
        return self.o_proj(self.o_norm(out, gate, x.dtype).reshape(t, h * dk))

    @staticmethod
    def _decodes(batch: ForwardBatch) -> int:
        """The leading one-token rows of sequences already started (the step puts decodes first)."""
        n = 0
        for q, c in zip(batch.query_lens, batch.context_lens_list):
            if q != 1 or c == 0:
                break
            n += 1
        return n

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, h, dk = mixed.shape[0], self.heads, self.head_dim
        q, k, v = mixed.float().view(rows, 3, h, dk).unbind(1)
        q, k = delta_rule.prepared(q, k)
        return q, k, v

    def _decode_rows(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, out: torch.Tensor,
                     slots: tuple[int, ...], state: LayerState) -> None:
        """One token each of ``len(slots)`` started sequences: the convolution over its window, one step of the
        rule; their states written back to their slots (by ``self.kernels``)."""
        idx = torch.tensor(slots, dtype=torch.long, device=mixed.device)
        taps = self.conv1d.weight.float().squeeze(1)  # [C, K]
        if self.kernels.decode == "compiled":
            conv = cpu_kernels.short_conv_step(mixed.float(), state.conv, taps, idx).to(mixed.dtype)
        else:
            window = torch.cat([state.conv.index_select(0, idx), mixed.float().unsqueeze(-1)], dim=-1)  # [B, C, K]
            state.conv.index_copy_(0, idx, window[..., 1:])
            conv = F.silu((window * taps).sum(-1)).to(mixed.dtype)
        q, k, v = self._split(conv)
        if self.kernels.decode == "compiled":
            out.copy_(cpu_kernels.delta_rule_step(q, k, v, g, beta, state.recurrent, idx))
        elif self.kernels.decode == "triton":
            out.copy_(linear_attention.recurrent_step(q, k, v, g, beta, state.recurrent, idx))
        else:
            o, new = delta_rule.recurrent_step(q, k, v, g, beta, state.recurrent.index_select(0, idx))
            state.recurrent.index_copy_(0, idx, new)
            out.copy_(o)

    def _sequence(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slot: int, fresh: bool,
                  state: LayerState) -> torch.Tensor:
        """``L`` tokens of one sequence from its slot's state (zeros when ``fresh``: its first step): the chunked
        form of the rule; the state after them written back. Returns the outputs ``[L, H, d_v]``."""
        past = torch.zeros_like(state.conv[slot]) if fresh else state.conv[slot]
        window = torch.cat([past, mixed.float().t()], dim=-1)  # [C, K - 1 + L]
        state.conv[slot] = window[:, window.shape[1] - (self.kernel - 1):]
        conv = F.conv1d(window.unsqueeze(0), self.conv1d.weight.float(), groups=window.shape[0])[0]  # [C, L]
        q, k, v = self._split(F.silu(conv).t().to(mixed.dtype))
        if self.kernels.prefill != "torch":  # in place in the slot
            if fresh:
                state.recurrent[slot].zero_()
            run = (cpu_kernels.delta_rule_prefill if self.kernels.prefill == "compiled"
                   else linear_attention.chunked)
            return run(q, k, v, g, beta, state.recurrent, torch.tensor([slot], device=q.device),
                       torch.tensor([0, q.shape[0]], device=q.device))
        start = torch.zeros_like(state.recurrent[slot]) if fresh else state.recurrent[slot]
        o, state.recurrent[slot] = delta_rule.chunked(q, k, v, g, beta, start)
        return o
