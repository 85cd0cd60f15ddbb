"""Multi-head latent attention over the paged latent cache.

Notation: ``d_c = kv_lora_rank``, ``d_r = qk_rope_head_dim``, ``d_n = qk_nope_head_dim``,
``d_v = v_head_dim``, ``n_h`` heads, ``T`` new tokens, ``S`` cached tokens of the batch.

    [c ; k_r] = kv_a_proj_with_mqa(h);  c = kv_a_layernorm(c);  k_r = RoPE(k_r)
    the cache stores exactly [c ; k_r]  (d_c + d_r values per token per layer)
    kv_b_proj.weight viewed as [n_h, d_n + d_v, d_c]:  W_UK = [:, :d_n],  W_UV = [:, d_n:]

Two ways to attend, equal up to rounding (each is the other's oracle):

- **naive / up-projected** (compute-friendly, long prefill chunks): gather the sequence's latents,
  ``k_i = [W_UK_i c ; k_r]``, ``v_i = W_UV_i c``, causal varlen attention per head.
- **absorbed** (decode, short chunks): ``q~_i = W_UK_i^T q_n_i`` (d_c wide), score
  ``q~_i · c_j + q_r_i · k_r_j``, ``o_i = W_UV_i (sum_j p_ij c_j)`` — MQA with one ``d_c + d_r`` key and a
  ``d_c`` value that is a prefix of the key; the cache is read once for all heads.

Softmax scale ``(d_n + d_r)^-1/2 * m^2`` with the YaRN ``m`` (``ModelConfig.softmax_scale``).
The layer computes its projections and hands them to the step's attention backend (``mla_runtime.attention``):
``write`` stores the new latents and returns the queries, ``forward`` attends. Which path a step takes, its RoPE
tables and any CPU decode plan are decided once per step by the backend's ``prepare``; every layer only reads them.
The first layer checks the kernels' arguments; the others run the same shapes unchecked.

Mistral Large 4: no Q-LoRA (``q_proj`` from ``h``); each head's queries times a learned ``scale ln(1 + p) + bias``
(``query_log_scaling``: ``softmax_scaling``); NoPE layers (``ModelConfig.rope_layers``) whose queries and latent are
padded with zeros as ``q_r`` and ``k_r`` (``nope_padded``), so every layer's cache row is ``d_c + d_r`` wide.

A.X-K2 (``ModelConfig.query_gate``) has no ``q_b_proj``: ``q_gate_proj`` maps ``[q_resid ; q_a_proj(h)]`` to each
head's query and a gate ``g`` (``d_n + d_r`` then ``d_v`` rows per head), and ``o_i`` becomes ``o_i * sigmoid(g_i)``
before ``o_proj``.

Tensor parallel (``mla_runtime.parallel``): each rank owns ``n_h / N`` heads; ``o_proj``'s partial products are
summed across ranks (its bias added once).
"""

from __future__ import annotations

import torch
from torch import nn

from mla_runtime.attention.layer import AttentionLayer, LayerKernels
from mla_runtime.attention.metadata import AttentionDims, AttentionMetadata
from mla_runtime.cache.latent_cache import LayerCache
from mla_runtime.config import ModelConfig
from mla_runtime.kernel_plan import KernelPlan
from mla_runtime.layers.bf16 import Bf16Weight
from mla_runtime.layers.cpu_gemm import PackedWeight, linear
from mla_runtime.layers.factor_runs import FactorRuns, absorbed_factors
from mla_runtime.layers.indexer import Indexer, LogPositionScaling, log_position_scaled, sparse_selection
from mla_runtime.layers.linear import Linear
from mla_runtime.layers.norm import RMSNorm
from mla_runtime.layers.rotary import RotaryEmbedding
from mla_runtime.resolved_config import ATTENTION_PATHS, ResolvedConfig

__all__ = ["ATTENTION_PATHS", "MLAttention", "attention_layer", "nope_padded", "stack_input_projections"]


class MLAttention(nn.Module):
    def __init__(self, rc: ResolvedConfig, layer: int = 0) -> None:
        super().__init__()
        cfg, dtype, self.par = rc.model, rc.dtype, rc.par
        self.validate = layer == 0  # kernel arguments are checked once per step, by the first layer
        self.n_h = cfg.num_attention_heads // self.par.world_size  # heads on this rank
        self.d_c, self.d_r, self.d_n, self.d_v = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.layer_nope_dim(layer), \
            cfg.v_head_dim  # a NoPE layer's d_n: the model's d_n + d_r (nope_padded)
        self.scale = cfg.softmax_scale
        self.query_scale, self.softmax_scaling = query_scalings(cfg, self.n_h, dtype)  # position_scaled
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.kv_a_proj_with_mqa = Linear(hidden, self.d_c + self.d_r * cfg.uses_rope(layer), dtype, bias=bias)
        self.q_proj, self.q_b_proj, self.q_gate_proj, self.g_proj = query_projections(cfg, self.n_h, dtype)
        if cfg.q_lora_rank is not None:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, dtype, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_eps, dtype)
            self.q_a_proj.fused = self.kv_a_proj_with_mqa.fused = True  # prepare_inference() stacks the two
        self.kv_a_layernorm = RMSNorm(self.d_c, cfg.latent_eps, dtype)
        self.kv_b_proj = Linear(self.d_c, self.n_h * (self.d_n + self.d_v), dtype)
        self.o_proj = Linear(self.n_h * self.d_v, hidden, dtype, bias=bias, row_parallel=self.par)  # this rank's heads
        self.rotary = RotaryEmbedding(cfg.rope, self.d_r)
        self.d_c_in, self.rope = self.d_c, cfg.uses_rope(layer)  # the latent's width kv_a_proj_with_mqa gives; RoPE
        self.latent_down: nn.Parameter | None = None  # [r, d_c_in] when the latent rank is truncated (latent_rank)
        self.w_uk: torch.Tensor | None = None  # W_UK [n_h, d_n, d_c], W_UVᵀ [n_h, d_c, d_v]: prepare_inference's
        self.w_uv_t: torch.Tensor | None = None
        self.factor_runs: FactorRuns | None = None  # a GGUF file's factors as runs for the kernels (the loader's)
        self.qkv_a: PackedWeight | None = None  # q_a_proj and kv_a_proj_with_mqa stacked: one GEMM
        self.qkv_a_bias: torch.Tensor | None = None
        # the compiled CPU kernels that run this layer, as its backend decided (``attention_layer``)
        self.kernels = LayerKernels()
        self.layer, (self.indexer, self.shares_selection) = layer, Indexer.of_layer(rc, layer)  # sparse attention

    def prepare_inference(self, plan: KernelPlan) -> None:
        """Cache the absorbed weights and the stacked input projection (call again when the weights change)."""
        w_uk, w_uv = self.w_uk_uv()
        self.w_uk, self.w_uv_t = absorbed_factors(self.factor_runs, w_uk, w_uv)  # one batched GEMM each
        stack_input_projections(self, plan)

    def w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [n_h, d_n, d_c]`` and ``W_UV [n_h, d_v, d_c]`` (views of ``kv_b_proj``)."""
        w = self.kv_b_proj.weight.view(self.n_h, self.d_n + self.d_v, self.d_c)
        return w[:, : self.d_n], w[:, self.d_n:]

    @property
    def dims(self) -> AttentionDims:
        return AttentionDims(self.d_c, self.d_r, self.d_n, self.d_v)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: LayerCache) -> torch.Tensor:
        q, latent, q_resid, gate = self.project(x)
        q, latent = scaled_and_padded(self, q, latent, meta.batch.positions)
        q_n, q_r = meta.backend.write(self.layer, q, latent, meta, cache)
        selected = sparse_selection(self, x, q_resid, meta, cache)  # sparse attention: the keys each query reads
        o = (meta.backend.forward(self.layer, q_n, q_r, meta, cache) if selected is None  # [T, n_h, d_v]
             else meta.backend.sparse_forward(self.layer, q_n, q_r, meta, cache, selected))
        out = self.o_proj(gated(o, gate).reshape(x.shape[0], self.n_h * self.d_v), bias=self.par.rank == 0)  # bias once
        return self.par.all_reduce(out)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``x [T, d]`` -> the queries ``[T, n_h (d_n + d_r)]``, ``[c ; k_r] [T, d_c_in + d_r]`` (neither normed
        nor rotated), the normed low-rank query ``q_resid [T, q_lora_rank]`` (None without a Q-LoRA) and the output
        gate: ``query_gate``'s ``[T, n_h, d_v]``, ``attention_head_gate``'s ``[T, n_h, 1]`` (``head_gate``), or None."""
        if self.q_proj is not None:
            return self.q_proj(x), self.kv_a_proj_with_mqa(x), None, head_gate(self, x)
        widths = [self.q_a_proj.out_features, self.d_c_in + self.d_r]
        q_lat, latent = (self.q_a_proj(x), self.kv_a_proj_with_mqa(x)) if self.qkv_a is None else linear(
            x, self.qkv_a.plain, self.qkv_a_bias, self.qkv_a).split(widths, dim=-1)
        q, q_resid, gate = queries(self, q_lat)
        return q, latent, q_resid, head_gate(self, x) if gate is None else gate

    def split(self, q: torch.Tensor, latent: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``project``'s outputs -> ``q_n [T, n_h, d_n]``, ``q_r [T, n_h, d_r]`` (not rotated), the normalised
        latent ``c [T, d_c]`` (truncated when the latent rank is) and ``k_r [T, d_r]`` (not rotated)."""
        q_n, q_r = q.view(q.shape[0], self.n_h, self.d_n + self.d_r).split([self.d_n, self.d_r], dim=-1)
        c, k_r = latent.split([self.d_c_in, self.d_r], dim=-1)
        c = self.kv_a_layernorm(c)
        if self.latent_down is not None:
            c = torch.nn.functional.linear(c, self.latent_down)  # [T, r]: the truncated latent
        return q_n, q_r, c, k_r


def kernel_factors(attn: MLAttention) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The absorbed factors the compiled float32 decode kernels read: the runs where kept (``factor_runs``), else
    the prepared factors (None before ``prepare_inference``)."""
    if attn.factor_runs is not None and attn.factor_runs.runs is not None:
        return attn.factor_runs.runs
    return None if attn.w_uk is None or attn.w_uv_t is None else (attn.w_uk, attn.w_uv_t)


def attention_layer(attn: MLAttention, plan: KernelPlan) -> AttentionLayer:
    """What the attention backend holds of ``attn`` once its weights are final (``attention/layer.py``), under the
    load's kernel ``plan``."""
    w_uk, w_uv_t = attn.w_uk, attn.w_uv_t
    if w_uk is None or w_uv_t is None:
        w_uk, w_uv = attn.w_uk_uv()
        w_uv_t = w_uv.transpose(1, 2)
    norm, packed = attn.kv_a_layernorm, attn.kv_b_proj.packed
    return AttentionLayer(
        layer_id=attn.layer, dtype=attn.kv_b_proj.weight.dtype, n_h=attn.n_h, d_c=attn.d_c, d_r=attn.d_r,
        d_n=attn.d_n, d_v=attn.d_v, scale=attn.scale, validate=attn.validate, w_uk=w_uk, w_uv_t=w_uv_t,
        kernel_factors=kernel_factors(attn) or (w_uk, w_uv_t),
        rebuild=attn.kv_b_proj, rebuild_in_bfloat16=isinstance(packed, Bf16Weight) and packed.native is not None,
        split=attn.split, rotate=attn.rotary, interleave=attn.rotary.interleave,
        latent_norm=(norm.weight, norm.eps) if attn.latent_down is None else None,
        kernels_allowed=plan.row_kernels, sparse=attn.indexer is not None)


def query_projections(cfg: ModelConfig, n_h: int, dtype: torch.dtype
                      ) -> tuple[Linear | None, Linear | None, Linear | None, Linear | None]:
    """The queries' projections for ``n_h`` heads: without a Q-LoRA ``q_proj [n_h (d_n + d_r), d]``; else the
    up-projection ``q_b_proj [n_h (d_n + d_r), q_lora_rank]``, or with ``query_gate`` ``q_gate_proj
    [n_h (d_n + d_r + d_v), 2 q_lora_rank]`` in its place; and with ``attention_head_gate`` (Ling) ``g_proj [n_h, d]``,
    one output gate per head from the layer's input. (q_proj, q_b_proj, q_gate_proj, g_proj), None where absent."""
    g_proj = Linear(cfg.hidden_size, n_h, dtype) if cfg.attention_head_gate else None
    if cfg.q_lora_rank is None:
        return Linear(cfg.hidden_size, n_h * cfg.qk_head_dim, dtype), None, None, g_proj
    if not cfg.query_gate:
        return None, Linear(cfg.q_lora_rank, n_h * cfg.qk_head_dim, dtype), None, g_proj
    return None, None, Linear(2 * cfg.q_lora_rank, n_h * (cfg.qk_head_dim + cfg.v_head_dim), dtype), g_proj


def head_gate(attn: MLAttention, x: torch.Tensor) -> torch.Tensor | None:
    """Ling's per-head output gate ``[T, n_h, 1]`` from the layer's input ``x [T, d]`` (None without ``g_proj``)."""
    return None if attn.g_proj is None else attn.g_proj(x).unsqueeze(-1)


def query_scalings(cfg: ModelConfig, n_h: int, dtype: torch.dtype
                   ) -> tuple[tuple[float, int], LogPositionScaling | None]:
    """The queries' position scalings: Mistral 4's ``(beta, length)`` (``position_scaled``) and Mistral Large 4's
    learned per-head log scaling of this rank's ``n_h`` heads (``query_log_scaling``; None without)."""
    beta = (cfg.query_scale_beta, cfg.rope.original_max_position_embeddings or 1)
    return beta, LogPositionScaling(n_h, dtype) if cfg.query_log_scaling else None


def scaled_and_padded(attn: MLAttention, q: torch.Tensor, latent: torch.Tensor, positions: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``project``'s queries scaled by position (``position_scaled``, ``query_log_scaling``: both linear in ``q``,
    so the same before RoPE as after it), and on a NoPE layer both padded (``nope_padded``)."""
    q = log_position_scaled(position_scaled(q, positions, *attn.query_scale), positions, attn.softmax_scaling)
    return (q, latent) if attn.rope else nope_padded(q, latent, attn.n_h, attn.d_r)


def nope_padded(q: torch.Tensor, latent: torch.Tensor, n_h: int, d_r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A NoPE layer's queries ``[T, n_h (d_n + d_r)]`` (all without position: the layer's ``d_n``) and latent
    ``[T, d_c]`` as a RoPE layer's: each head's query and the latent followed by ``d_r`` zeros, its ``q_r`` and
    ``k_r``. The cache keeps one row width, ``d_c + d_r``, for every layer; the zeros rotate to zeros, so the score is
    exactly ``q_n . W_UK c`` with the softmax scale of ``(d_n + d_r)`` dims, as the reference's NoPE layer computes;
    the cost is ``d_r`` of ``d_c + d_r`` values a token that a per-layer width would save."""
    t = q.shape[0]
    q = torch.cat([q.view(t, n_h, -1), q.new_zeros(t, n_h, d_r)], dim=-1).view(t, -1)
    return q, torch.cat([latent, latent.new_zeros(t, d_r)], dim=-1)


def queries(attn: MLAttention, q_lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``q_a_proj``'s output ``q_lat [T, q_lora_rank]`` -> the queries ``[T, n_h (d_n + d_r)]`` (contiguous),
    ``q_resid`` (``q_lat`` normed) and the output gate ``[T, n_h, d_v]`` (None without ``query_gate``)."""
    q_resid = attn.q_a_layernorm(q_lat)
    if attn.q_gate_proj is None:
        assert attn.q_b_proj is not None
        return attn.q_b_proj(q_resid), q_resid, None
    fused = attn.q_gate_proj(torch.cat([q_resid, q_lat], dim=-1)).view(q_lat.shape[0], attn.n_h, -1)
    q, gate = fused.split([attn.d_n + attn.d_r, attn.d_v], dim=-1)
    return q.contiguous().view(q_lat.shape[0], -1), q_resid, gate


def gated(o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """The attention output ``o [T, n_h, d_v]`` times ``sigmoid(gate)`` (in fp32, cast back, as the reference
    does); ``o`` itself without a gate."""
    return o if gate is None else (o * torch.sigmoid(gate.float())).to(o.dtype)


def position_scaled(q: torch.Tensor, positions: torch.Tensor, beta: float, length: int) -> torch.Tensor:
    """Mistral 4's (Llama-4) query scaling: the queries ``q [T, ...]`` at position ``p`` times
    ``1 + beta * ln(1 + floor(p / length))`` (``beta`` 0: ``q`` as it is). Linear in ``q``: the same before RoPE as
    after it."""
    if not beta:
        return q
    scale = 1 + beta * torch.log1p(torch.floor(positions[: q.shape[0]].to(torch.float32) / length))
    return q * scale.to(q.dtype).unsqueeze(-1)


def stack_input_projections(attn: MLAttention, plan: KernelPlan) -> None:
    """``q_a_proj`` and ``kv_a_proj_with_mqa`` read the same input: one product over their stacked weights, unless
    one of them is quantised alone (then they run apart); a quantised stack is final as it is."""
    if attn.qkv_a is not None and attn.qkv_a.quantized:
        attn.qkv_a.bind(plan)
        return
    attn.qkv_a, attn.qkv_a_bias = None, None
    if attn.q_proj is not None:
        return
    pair = (attn.q_a_proj, attn.kv_a_proj_with_mqa)
    if any(lin.packed is not None and lin.packed.quantized for lin in pair):
        for lin in pair:
            lin.fused = False
            lin.prepare_inference(plan)
        return
    attn.qkv_a = PackedWeight.make(torch.cat([lin.weight for lin in pair]), plan)
    a_bias, kv_bias = attn.q_a_proj.bias, attn.kv_a_proj_with_mqa.bias
    if attn.qkv_a is not None and a_bias is not None and kv_bias is not None:  # both or neither
        attn.qkv_a_bias = torch.cat([a_bias, kv_bias])
