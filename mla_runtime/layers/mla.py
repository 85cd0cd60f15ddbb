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
``path="auto"`` picks the cheaper path from a FLOP count of the batch. Which path a step takes, its RoPE
tables and its CPU decode plan are decided once per step (``attention_metadata``); every layer only reads
them. The first layer checks the kernels' arguments; the others run the same shapes unchecked. On a CPU where the
compiled kernels build (``mla_kernels.cpu_gemv``), a float32 decode step runs the latent side (norm, RoPE, cache
write) and the absorbed attention as two compiled calls after the projections.

Tensor parallel (``mla_runtime.parallel``): each rank owns ``n_h / N`` heads. With the sharded latent
cache a rank keeps only its share of the tokens, so attention always takes the absorbed path there:
all heads' queries are gathered, each rank attends its own tokens, and the partial outputs are merged
by log-sum-exp before each rank keeps its heads.
"""

from __future__ import annotations

import torch
from mla_kernels import (
    cpu_gemv,
    gather_latent,
    mla_decode,
    mla_decode_planned,
    prefill_attention,
    store_latent,
    write_latent,
)
from torch import nn

from mla_runtime.attention_metadata import AttentionDims, AttentionMetadata
from mla_runtime.cache.latent_cache import LayerCache
from mla_runtime.config import ModelConfig
from mla_runtime.layers.cpu_gemm import PackedWeight, linear, row_kernel_failure
from mla_runtime.layers.linear import Linear
from mla_runtime.layers.norm import RMSNorm
from mla_runtime.layers.rotary import RotaryEmbedding
from mla_runtime.parallel import SINGLE_RANK, ParallelContext

ATTENTION_PATHS = ("auto", "naive", "absorbed")


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, path: str = "auto",
                 backend: str | None = None, par: ParallelContext = SINGLE_RANK, layer: int = 0) -> None:
        super().__init__()
        if path not in ATTENTION_PATHS:
            raise ValueError(f"attention path must be one of {ATTENTION_PATHS}, got {path!r}")
        self.path = path
        self.backend = backend
        self.par = par
        self.validate = layer == 0  # kernel arguments are checked once per step, by the first layer
        self.n_h = cfg.num_attention_heads // par.world_size  # heads on this rank
        self.d_c, self.d_r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.d_n, self.d_v = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.scale = cfg.softmax_scale
        hidden, qk = cfg.hidden_size, cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj: Linear | None = Linear(hidden, self.n_h * qk, dtype)
        else:
            self.q_proj = None
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, dtype, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, self.n_h * qk, dtype)
        self.kv_a_proj_with_mqa = Linear(hidden, self.d_c + self.d_r, dtype, bias=cfg.attention_bias)
        if cfg.q_lora_rank is not None:  # prepare_inference() stacks the two
            self.q_a_proj.fused = self.kv_a_proj_with_mqa.fused = True
        self.kv_a_layernorm = RMSNorm(self.d_c, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = Linear(self.d_c, self.n_h * (self.d_n + self.d_v), dtype)
        self.o_proj = Linear(self.n_h * self.d_v, hidden, dtype, bias=cfg.attention_bias)
        self.rotary = RotaryEmbedding(cfg.rope, self.d_r)
        self.d_c_in = self.d_c  # width of the latent kv_a_proj_with_mqa produces
        self.latent_down: nn.Parameter | None = None  # [r, d_c_in] when the latent rank is truncated
        # contiguous copies of the absorbed weights, made by prepare_inference(): W_UK [n_h, d_n, d_c] and
        # W_UVᵀ [n_h, d_c, d_v], so that absorption and up-projection are one batched GEMM each (with int8 weights,
        # bfloat16 copies that only the compiled decode kernel reads: layers.quantization)
        self.w_uk: torch.Tensor | None = None
        self.w_uv_t: torch.Tensor | None = None
        # q_a_proj and kv_a_proj_with_mqa read the same input: one GEMM over their stacked weights
        self.qkv_a: PackedWeight | None = None
        self.qkv_a_bias: torch.Tensor | None = None
        self.decode_kernel = False  # planned CPU decodes run mla_kernels.cpu_gemv.absorbed_decode (float32)

    def prepare_inference(self) -> None:
        """Cache the absorbed weights and the stacked input projection (call again when the weights change)."""
        w_uk, w_uv = self.w_uk_uv()
        self.w_uk, self.w_uv_t = w_uk.contiguous(), w_uv.transpose(1, 2).contiguous()
        self.decode_kernel = (self.w_uk.device.type == "cpu" and self.w_uk.dtype == torch.float32
                              and not self.par.sharded_cache and row_kernel_failure() is None)
        if self.qkv_a is not None and self.qkv_a.quantized:  # quantised: final as it is
            return
        self.qkv_a, self.qkv_a_bias = None, None
        separate = [lin.packed for lin in (self.q_a_proj, self.kv_a_proj_with_mqa)] if self.q_proj is None else []
        if any(p is not None and p.quantized for p in separate):  # one of them quantised alone: run them apart
            for lin in (self.q_a_proj, self.kv_a_proj_with_mqa):
                lin.fused = False
                lin.prepare_inference()
            return
        if self.q_proj is None:
            self.qkv_a = PackedWeight.make(torch.cat([self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight]))
            a_bias, kv_bias = self.q_a_proj.bias, self.kv_a_proj_with_mqa.bias
            if self.qkv_a is not None and a_bias is not None and kv_bias is not None:  # both or neither
                self.qkv_a_bias = torch.cat([a_bias, kv_bias])

    def truncate_latent(self, basis: torch.Tensor) -> None:
        """Cache ``r`` values per token instead of ``d_c``: ``c' = basisᵀ norm(c)`` with ``basis [d_c, r]``
        orthonormal, and ``kv_b_proj`` folded to ``W · basis`` so that ``W c ≈ (W basis) c'``."""
        basis = basis.to(self.kv_b_proj.weight.device, self.kv_b_proj.weight.dtype)
        r = basis.shape[1]
        down = basis.T.contiguous() if self.latent_down is None else (self.latent_down.T @ basis).T.contiguous()
        folded = self.kv_b_proj.weight @ basis  # [n_h (d_n + d_v), r]
        self.kv_b_proj = Linear(r, folded.shape[0], folded.dtype)
        self.kv_b_proj.weight.data.copy_(folded)
        self.latent_down = nn.Parameter(down, requires_grad=False)
        self.d_c = r
        if self.w_uk is not None:
            self.kv_b_proj.prepare_inference()
            self.prepare_inference()

    # -- absorbed weights -------------------------------------------------------------------
    def w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [n_h, d_n, d_c]`` and ``W_UV [n_h, d_v, d_c]`` (views of ``kv_b_proj``)."""
        w = self.kv_b_proj.weight.view(self.n_h, self.d_n + self.d_v, self.d_c)
        return w[:, : self.d_n], w[:, self.d_n:]

    @property
    def dims(self) -> AttentionDims:
        return AttentionDims(self.d_c, self.d_r, self.d_n, self.d_v)

    # -- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: LayerCache) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self._compiled_decode(meta, cache, num_tokens):
            o = self._decode_compiled(x, meta, cache)
        else:
            o = self._attention(x, meta, cache)
        out = self.o_proj(o.reshape(num_tokens, self.n_h * self.d_v), bias=self.par.rank == 0)  # bias added once
        return self.par.all_reduce(out)

    def _attention(self, x: torch.Tensor, meta: AttentionMetadata, cache: LayerCache) -> torch.Tensor:
        """``x [T, d]`` -> ``[T, n_h, d_v]``: the new latents written, then the path the step planned."""
        num_tokens = x.shape[0]
        q_n, q_r, c, k_r = self._project(x)
        q_r, k_r = self.rotary(meta.batch.positions, q_r, k_r, meta.rope)
        if meta.plain_write:  # a CPU step with planned decodes: float cache, every slot valid
            write_latent(cache.kv, c, k_r, meta.slot_mapping)
        else:
            store_latent(cache.kv, cache.scales, c, k_r, meta.slot_mapping, backend=self.backend,
                         validate=self.validate)
        d = meta.num_planned
        if d == num_tokens:  # a CPU decode step
            return self._absorbed(q_n, q_r, meta, cache, planned=True)  # [T, n_h, d_v]
        if d:  # a mixed CPU step: planned decodes, then the prefill chunks as their own batch
            assert meta.rest is not None
            return torch.cat([self._absorbed(q_n[:d], q_r[:d], meta, cache, planned=True),
                              self._attend(q_n[d:], q_r[d:], meta.rest, cache)])
        return self._attend(q_n, q_r, meta, cache)

    def _compiled_decode(self, meta: AttentionMetadata, cache: LayerCache, num_tokens: int) -> bool:
        """Whether this step's attention runs as two compiled calls (``_decode_compiled``): a float32 CPU decode step
        whose every slot is valid, on prepared weights with the full latent rank."""
        return (self.decode_kernel and meta.num_planned == num_tokens and meta.plain_write
                and meta.decode_plan is not None and cache.kv.dtype == torch.float32 and self.latent_down is None
                and self.w_uk is not None and meta.rope.cos.dtype == torch.float32)

    def _decode_compiled(self, x: torch.Tensor, meta: AttentionMetadata, cache: LayerCache) -> torch.Tensor:
        """A float32 CPU decode step in two compiled calls after the projections: the latent side (norm, RoPE, cache
        write, the queries' RoPE) and the absorbed attention -> ``[T, n_h, d_v]``."""
        q, latent = self._queries_and_latent(x)
        q3 = q.view(x.shape[0], self.n_h, self.d_n + self.d_r)
        flat = cache.kv.view(-1, cache.kv.shape[-1])
        slots = meta.slot_mapping if meta.slot_mapping.dtype == torch.int64 else meta.slot_mapping.long()
        norm = self.kv_a_layernorm
        cpu_gemv.rope_store(latent, norm.weight, norm.eps, q3, self.d_n, meta.rope.cos, meta.rope.sin, flat, slots,
                            self.rotary.interleave)
        q_n, q_r = q3.split([self.d_n, self.d_r], dim=-1)
        plan = meta.decode_plan
        assert plan is not None and self.w_uk is not None and self.w_uv_t is not None
        return cpu_gemv.absorbed_decode(q_n, q_r, self.w_uk, self.w_uv_t, flat, plan.slots, plan.lens, self.scale)

    def _queries_and_latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, d]`` -> the queries ``[T, n_h (d_n + d_r)]`` and ``[c ; k_r] [T, d_c_in + d_r]`` (neither normed
        nor rotated)."""
        if self.q_proj is not None:
            return self.q_proj(x), self.kv_a_proj_with_mqa(x)
        if self.qkv_a is not None:
            q_lat, latent = linear(x, self.qkv_a.plain, self.qkv_a_bias, self.qkv_a).split(
                [self.q_a_proj.out_features, self.d_c_in + self.d_r], dim=-1)
            return self.q_b_proj(self.q_a_layernorm(q_lat)), latent
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))), self.kv_a_proj_with_mqa(x)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, d]`` -> ``q_n [T, n_h, d_n]``, ``q_r [T, n_h, d_r]`` (not rotated), the normalised latent
        ``c [T, d_c]`` (truncated when the latent rank is) and ``k_r [T, d_r]`` (not rotated)."""
        q, latent = self._queries_and_latent(x)
        q_n, q_r = q.view(x.shape[0], self.n_h, self.d_n + self.d_r).split([self.d_n, self.d_r], dim=-1)
        c, k_r = latent.split([self.d_c_in, self.d_r], dim=-1)
        c = self.kv_a_layernorm(c)
        if self.latent_down is not None:
            c = torch.nn.functional.linear(c, self.latent_down)  # [T, r]: the truncated latent
        return q_n, q_r, c, k_r

    def _attend(self, q_n: torch.Tensor, q_r: torch.Tensor, meta: AttentionMetadata, cache: LayerCache
                ) -> torch.Tensor:
        """Attention of ``meta.batch``'s queries over the latents already in ``cache`` -> ``[T, n_h, d_v]``."""
        if meta.path == "absorbed":
            return self._absorbed(q_n, q_r, meta, cache)
        batch = meta.batch
        cu_k = meta.host_cu_seqlens[1]
        key_lens = [b - a for a, b in zip(cu_k, cu_k[1:])]
        latent = gather_latent(cache.kv, cache.scales, batch.block_tables, batch.seq_lens, q_n.dtype, self.d_c,
                               backend=self.backend, host_lens=key_lens)  # [S, d_c + d_r]
        c_all, k_r_all = latent.split([self.d_c, self.d_r], dim=-1)
        kv = self.kv_b_proj(c_all).view(-1, self.n_h, self.d_n + self.d_v)
        k_n, v = kv.split([self.d_n, self.d_v], dim=-1)  # [S, n_h, d_n], [S, n_h, d_v]
        o, _ = prefill_attention(q_n, q_r, k_n, k_r_all, v, batch.query_start_loc, batch.seq_start_loc,
                                 self.scale, backend=self.backend, host_cu_seqlens=meta.host_cu_seqlens,
                                 validate=self.validate)
        return o

    def _absorbed(self, q_n: torch.Tensor, q_r: torch.Tensor, meta: AttentionMetadata, cache: LayerCache,
                  planned: bool = False) -> torch.Tensor:
        """Absorbed attention: ``q~ = W_UKᵀ q_n``, MQA over the latent, ``o = W_UV o_lat`` -> ``[T, n_h, d_v]``;
        ``planned``: the rows are the step's planned decodes (``meta.decode_plan``)."""
        plan, w_uk, w_uv_t = meta.decode_plan, self.w_uk, self.w_uv_t
        if w_uk is not None and w_uv_t is not None and planned and plan is not None and self.decode_kernel \
                and cache.kv.dtype == torch.float32:
            flat = cache.kv.view(-1, cache.kv.shape[-1])  # the whole layer in one compiled call
            return cpu_gemv.absorbed_decode(q_n, q_r, w_uk, w_uv_t, flat, plan.slots, plan.lens, self.scale)
        if w_uk is None or w_uv_t is None:  # not prepared: strided views of kv_b_proj
            w_uk, w_uv = self.w_uk_uv()
            w_uv_t = w_uv.transpose(1, 2)
        elif w_uk.dtype != q_n.dtype:  # the kernel's bfloat16 copies (int8 models): the same values, widened
            w_uk, w_uv_t = w_uk.to(q_n.dtype), w_uv_t.to(q_n.dtype)
        q_abs = torch.bmm(q_n.transpose(0, 1), w_uk).transpose(0, 1)  # [T, n_h, d_c]
        q_cat = torch.cat([q_abs, q_r], dim=-1)  # [T, n_h, d_c + d_r]
        if self.par.sharded_cache:
            o_lat = self._attend_sharded(q_cat, meta, cache)
        elif planned:
            o_lat = mla_decode_planned(q_cat, cache.kv, meta.decode_plan, self.scale, self.d_c)
        else:
            batch = meta.batch
            o_lat, _ = mla_decode(q_cat, cache.kv, cache.scales, batch.block_tables, meta.token_seq_lens,
                                  self.scale, self.d_c, req_indices=batch.token_req_idx,
                                  backend=self.backend, validate=self.validate)  # [T, n_h, d_c]
        return torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)  # [T, n_h, d_v]

    def _attend_sharded(self, q_cat: torch.Tensor, meta: AttentionMetadata, cache: LayerCache) -> torch.Tensor:
        """Absorbed attention over this rank's share of the tokens, merged across ranks by LSE."""
        q_all = self.par.all_gather(q_cat, dim=1)  # [T, n_h_total, d_c + d_r]: every head's query
        o_part, lse = mla_decode(q_all, cache.kv, cache.scales, meta.batch.block_tables, meta.token_seq_lens,
                                 self.scale, self.d_c, req_indices=meta.batch.token_req_idx, backend=self.backend,
                                 validate=self.validate)
        lse_all = self.par.all_gather(lse.unsqueeze(0), dim=0)  # [N, T, n_h_total]
        weight = torch.exp(lse - torch.logsumexp(lse_all, dim=0))  # 0 where this rank saw no token
        merged = self.par.all_reduce(o_part.float() * weight.unsqueeze(-1))  # [T, n_h_total, d_c]
        first = self.par.rank * self.n_h
        return merged[:, first:first + self.n_h].to(q_cat.dtype)
