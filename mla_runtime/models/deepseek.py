"""DeepSeek-V2 / V3 / Kimi-K2 decoder: embeddings, MLA + (dense MLP | MoE) layers, final norm, lm_head.

Parameter names mirror the Hugging Face checkpoints (``model.layers.{i}.self_attn.kv_b_proj.weight``...)
so the loader's name table stays short; the only layout changes are fused/stacked weights
(``gate_up_proj`` of an MLP, the ``[E, ...]`` stacks of routed experts).

DeepSeek-V3's multi-token-prediction (MTP) layers, stored as ``model.layers.{num_hidden_layers + j}`` in the
checkpoint, are built only when asked for (``num_mtp_layers``) and live in ``mtp`` (the loader renames them).
The MTP layer attends over the same paged latent cache as one more layer (``cache.layers[num_hidden_layers + j]``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from mla_kernels import cpu_tables
from mla_runtime.attention import AttentionMetadata, make_backend
from mla_runtime.cache.latent_cache import LatentCache, LayerCache
from mla_runtime.config import ModelConfig
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.kernel_plan import KernelPlan
from mla_runtime.layers.cpu_gemm import PackedWeight, linear, prepared
from mla_runtime.layers.decoder_kernel import PlannedRows, decode_step, layer_weights, planned_rows
from mla_runtime.layers.embedding import VocabEmbedding
from mla_runtime.layers.kda import KimiDeltaAttention
from mla_runtime.layers.linear import Linear
from mla_runtime.layers.mla import MLAttention, attention_layer
from mla_runtime.layers.mlp import GatedMLP
from mla_runtime.layers.moe import MoE, Router
from mla_runtime.layers.norm import RMSNorm, decoder_norm
from mla_runtime.layers.quantization import quantized_weights
from mla_runtime.layers.qweight import QuantizedWeight, released_like
from mla_runtime.parallel import ParallelContext
from mla_runtime.resolved_config import ResolvedConfig


class DecoderLayer(nn.Module):
    def __init__(self, rc: ResolvedConfig, layer: int) -> None:
        super().__init__()
        cfg, dtype, par = rc.model, rc.dtype, rc.par
        self.self_attn = MLAttention(rc, layer)
        if cfg.is_moe_layer(layer):
            assert cfg.moe is not None
            self.mlp: nn.Module = MoE(cfg.moe, cfg.hidden_size, dtype, cfg.mlp_bias, par,
                                      cfg.rms_norm_eps if cfg.moe_output_norm else None)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, cfg.mlp_bias, par)
        gate = cfg.gated_norm_rank  # A.X-K2: gated norms on every layer's input and a MoE layer's MLP input
        self.input_layernorm = decoder_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, gate)
        self.post_attention_layernorm = decoder_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                                                     gate if cfg.is_moe_layer(layer) else 0)
        self.residual_scale = cfg.residual_scale  # µP: on each branch before it is added
        # the layer as one compiled call on the decode steps that take it (prepare_kernel), or None: call by call
        self.kernel: cpu_tables.DecoderLayerTable | None = None

    def prepare_kernel(self, one_path: bool = False) -> None:
        """Decide whether the layer's decode steps run as one compiled call (``layers.decoder_kernel``), from its
        weights as they are now and the kernels its attention backend chose (``prepare_attention``), and keep the
        table they read; ``one_path``: a row's bits must not depend on the rows beside it (``rows_invariant``)."""
        weights = layer_weights((self.input_layernorm, self.post_attention_layernorm), self.self_attn, self.mlp,
                                self.residual_scale, one_path)
        self.kernel = None if weights is None else cpu_tables.DecoderLayerTable(weights)

    def kernel_table(self) -> cpu_tables.DecoderLayerTable | None:
        """The layer's compiled table (``prepare_kernel``), or None where it runs call by call."""
        return self.kernel

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: LayerCache,
                step: cpu_tables.DecodeStep | PlannedRows | None = None) -> torch.Tensor:
        """``x [T, d]`` through the layer; ``step`` (``decode_step``): the layer runs as one compiled call where it
        can, and then ``x`` is updated in place."""
        table = self.kernel_table() if step is not None else None
        if isinstance(step, PlannedRows) and table is not None:
            return self._planned(x, step, table, cache)
        if isinstance(step, cpu_tables.DecodeStep) and table is not None:
            h = cpu_tables.decoder_layer(table, step, x, cache.kv.view(-1, cache.kv.shape[-1]), cache.flat_scales)
            return x if h is None else x + self.mlp(h)
        return self._call_by_call(x, meta, cache)

    def _planned(self, x: torch.Tensor, step: PlannedRows, table: cpu_tables.DecoderLayerTable,
                 cache: LayerCache) -> torch.Tensor:
        """``step``'s planned rows of ``x`` in place through the compiled layer, a chunk a call, and the rest of the
        step call by call as a batch of its own."""
        for r0, r1, chunk in step.chunks:
            part = x[r0:r1]
            h = cpu_tables.decoder_layer(table, chunk, part, cache.kv.view(-1, cache.kv.shape[-1]), cache.flat_scales)
            if h is not None:
                part += self.mlp(h)
        if step.rest is not None:
            x[step.rows:] = self._call_by_call(x[step.rows:], step.rest, cache)
        return x

    def _call_by_call(self, x: torch.Tensor, meta: AttentionMetadata, cache: LayerCache) -> torch.Tensor:
        s = self.residual_scale
        if s != 1.0:
            x = x + self.self_attn(self.input_layernorm(x), meta, cache) * s
            return x + self.mlp(self.post_attention_layernorm(x)) * s
        x = x + self.self_attn(self.input_layernorm(x), meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LongcatDecoderLayer(nn.Module):
    """LongCat-Flash's layer: ``attention_blocks_per_layer`` (two) blocks of attention and a dense MLP, each
    attention a cache layer of its own (``caches``, in order), and a shortcut MoE that reads the first block's
    post-attention norm and is added at the layer's end::

        h = x + attn0(ln0(x));  n = post_ln0(h);  s = moe(n);  h = h + mlp0(n)
        h = h + attn1(ln1(h));  h = h + mlp1(post_ln1(h));  out = h + s

    It runs call by call: the compiled whole-layer kernel (``DecoderLayer.prepare_kernel``) does not take it."""

    def __init__(self, rc: ResolvedConfig, layer: int) -> None:
        super().__init__()
        cfg, dtype, par = rc.model, rc.dtype, rc.par
        blocks = cfg.attention_blocks_per_layer
        assert cfg.moe is not None
        self.mlp = MoE(cfg.moe, cfg.hidden_size, dtype, cfg.mlp_bias, par)
        self.self_attn = nn.ModuleList(MLAttention(rc, layer * blocks + b) for b in range(blocks))
        self.mlps = nn.ModuleList(GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, cfg.mlp_bias, par)
                                  for _ in range(blocks))
        self.input_layernorm = nn.ModuleList(RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) for _ in range(blocks))
        self.post_attention_layernorm = nn.ModuleList(RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
                                                      for _ in range(blocks))

    def prepare_kernel(self, one_path: bool = False) -> None:
        """No compiled table: the layer runs call by call."""

    def kernel_table(self) -> None:
        return None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, caches: list[LayerCache],
                step: cpu_tables.DecodeStep | PlannedRows | None = None) -> torch.Tensor:
        shortcut: torch.Tensor | None = None
        for b, (attn, mlp) in enumerate(zip(self.self_attn, self.mlps)):
            x = x + attn(self.input_layernorm[b](x), meta, caches[b])
            normed = self.post_attention_layernorm[b](x)
            if shortcut is None:
                shortcut = self.mlp(normed)
            x = x + mlp(normed)
        assert shortcut is not None
        return x + shortcut


class SharedHead(nn.Module):
    """The MTP layer's own final norm (its ``head`` is the main model's ``lm_head``, see ``MTPLayer``)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3's multi-token-prediction module: for position ``i`` it takes the main model's hidden state
    ``h_i`` (after the final norm) and the next token ``t_{i+1}`` and predicts ``t_{i+2}``::

        x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]);  y = block(x);  logits = head(shared_head.norm(y))

    ``block`` is a whole decoder layer (MLA + MLP or MoE by its index). Chained drafting feeds ``y`` back as
    the next position's ``h``. The embedding and head are the main model's (DeepSeek-V3 shares them)."""

    def __init__(self, rc: ResolvedConfig, layer: int) -> None:
        super().__init__(rc, layer)
        cfg, dtype = rc.model, rc.dtype
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, dtype)
        self.shared_head = SharedHead(cfg, dtype)

    def fuse(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden.to(embedded.dtype))], dim=-1))


class LearnedFrequencies(nn.Module):
    """Mistral Large 4's LeRoPE: ``alpha [d_r / 2]`` (float32, replicated), each RoPE inverse frequency times
    ``exp(alpha)`` in every layer and indexer (``RotaryEmbedding.scale_frequencies``, at ``prepare_inference``)."""

    def __init__(self, d_r: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(d_r // 2, dtype=torch.float32), requires_grad=False)


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, par: ParallelContext) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, par)
        self.layers = nn.ModuleList()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary_emb = LearnedFrequencies(cfg.qk_rope_head_dim) if cfg.rope.learned_frequency_scale else None


class DeepseekForCausalLM(nn.Module):
    def __init__(self, rc: ResolvedConfig) -> None:
        super().__init__()
        cfg, dtype = rc.model, rc.dtype
        self.resolved = rc
        self.config = cfg  # the latent width follows a truncated latent rank (latent_rank.truncate_latent_rank)
        self.dtype = dtype
        self.par = rc.par
        self.attention = make_backend(rc)  # how every layer attends (mla_runtime.attention)
        self.model = DeepseekModel(cfg, dtype, rc.par)
        for i in range(cfg.num_hidden_layers):
            self.model.layers.append(self.decoder_layer(rc, i))
        self.mtp = nn.ModuleList(MTPLayer(rc, cfg.num_hidden_layers + j) for j in range(rc.num_mtp_layers))
        rows = self.model.embed_tokens.weight.shape[0]
        self.lm_head = (None if cfg.tie_word_embeddings else
                        nn.Parameter(torch.zeros(rows, cfg.hidden_size, dtype=dtype), requires_grad=False))

        self.lm_head_packed: PackedWeight | None = None
        # the MTP drafts' head: the lm_head rows of the draft vocabulary (``set_draft_vocab``), on this rank
        self.draft_ids: torch.Tensor | None = None  # their token ids, ascending (None: the whole head)
        self.draft_head: torch.Tensor | None = None
        self.draft_head_packed: PackedWeight | None = None
        self.rows_invariant = False  # prepare_inference: every float part gives a row the same bits at any batch

    def decoder_layer(self, rc: ResolvedConfig, i: int) -> nn.Module:
        """Decoder layer ``i`` (a subclass with other layer kinds overrides this)."""
        return DecoderLayer(rc, i) if rc.model.attention_blocks_per_layer == 1 else LongcatDecoderLayer(rc, i)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head

    @property
    def plan(self) -> KernelPlan:
        """What computes the products (``kernel_plan``): every weight is prepared against it."""
        return self.resolved.plan

    def prepare_inference(self) -> DeepseekForCausalLM:
        """Derive the inference layouts of the final weights for the kernel plan (packed GEMM weights on CPU, the
        quantised formats' kernels, contiguous absorbed attention weights). Call once the weights are loaded, and
        again after changing any."""
        for module in self.modules():
            if module is not self and hasattr(module, "prepare_inference"):
                cast(Any, module).prepare_inference(self.plan)
        learned = self.model.rotary_emb
        for attn in self.attention_layers():
            if learned is not None:  # LeRoPE: the learned frequencies, folded into every layer's tables
                attn.rotary.scale_frequencies(learned.alpha.float().exp())
        self.lm_head_packed = prepared(self.lm_head_weight, self.lm_head_packed, self.plan)
        if self.draft_head is not None and self.draft_head_packed is not None:
            self.draft_head_packed = prepared(self.draft_head, self.draft_head_packed, self.plan)
        mode = self.resolved.batch_invariant  # auto: where the products round their rows to int8
        self.rows_invariant = mode == "on" or (mode == "auto"
                                               and any(w.rounds_to_int8 for w in quantized_weights(self)))
        if self.rows_invariant:
            self._make_rows_invariant()
        self.prepare_attention()
        return self

    def _make_rows_invariant(self) -> None:
        """A model whose products round their input rows to int8 (int4, W4A16, W8A8, the GGUF block types): a last-bit
        difference in the float parts between batch shapes would become a step of that rounding, and a prompt's
        answer would depend on what shares its steps. So every float part gives a row the same bits whatever rows
        share its call: the norms take the compiled kernel at every count of rows, the float products and the
        router's oneDNN's (``PackedWeight.rows_invariant``, ``onednn_rows``), a lone row's MLP the torch path (the
        one-row MLP kernels compute the routing and the activation in arithmetic of their own), and a step's planned
        rows the compiled layers, chunk by chunk, whatever else the step holds (``PlannedRows``); a sparse layer's
        rows attend over their indexer's selection by one path (the backend's ``rows_invariant``)."""
        self.attention.rows_invariant = True
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.every_row = module.kernel
            elif isinstance(module, (GatedMLP, MoE)):
                module.row_call = False
            elif isinstance(module, Router):
                module.onednn = module.weight.device.type == "cpu" and self.plan.choice(torch.float32).path == "onednn"
            elif isinstance(module, KimiDeltaAttention):
                module.rows_invariant()
            for value in vars(module).values():  # the float matrices (quantised_weights: the others)
                for packed in value if isinstance(value, list) else [value]:
                    if isinstance(packed, PackedWeight) and not packed.quantized:
                        packed.rows_invariant()

    def prepare_attention(self) -> None:
        """Hand every attention layer to the backend as it is now (``attention/layer.py``), record which compiled
        kernels run it, and decide which decoder layers' decode steps run as one compiled call: after loading, and
        again whenever the weights change (a latent-rank truncation, quantisation)."""
        for attn in self.attention_layers():
            attn.kernels = self.attention.prepare_layer(attention_layer(attn, self.plan))
        for layer in self.model.layers:
            cast(DecoderLayer, layer).prepare_kernel(self.rows_invariant)

    def attention_layers(self) -> list[MLAttention]:
        """Every layer that attends over the latent cache, in cache order: the decoder's (a LongCat layer's blocks in
        order), then the MTP layers'."""
        found: list[MLAttention] = []
        for layer in [*self.model.layers, *self.mtp]:
            attn = layer.self_attn  # a LongCat layer's: one per block
            found += [cast(MLAttention, a) for a in (attn if isinstance(attn, nn.ModuleList) else [attn])]
        return found

    @property
    def num_cache_layers(self) -> int:
        return len(self.model.layers) * self.config.attention_blocks_per_layer + len(self.mtp)

    def attention_metadata(self, batch: ForwardBatch, cache: LatentCache) -> AttentionMetadata:
        """How every layer attends over ``batch`` this step (one object per step; see ``attention_metadata``)."""
        attn = self.attention_layers()[0]
        top = max(batch.key_lens) - 1 if batch.key_lens else None
        rope = attn.rotary.tables(batch.positions, self.dtype, top)  # every layer's RoPE is the same
        return self.attention.prepare(batch, rope, attn.dims, cache)

    def forward(self, batch: ForwardBatch, cache: LatentCache, meta: AttentionMetadata | None = None
                ) -> torch.Tensor:
        """Hidden states ``[T, d]`` after the final norm, writing each layer's latent into ``cache``; ``meta``
        defaults to ``attention_metadata(batch, cache)``."""
        meta = meta or self.attention_metadata(batch, cache)
        x = self.model.embed_tokens(batch.input_ids)
        if self.config.embedding_scale != 1.0:  # µP
            x = x * self.config.embedding_scale
        step = self._decode_step(meta, cache)
        if step is not None:
            x = x.float().contiguous()  # updated in place by the compiled layers (a bfloat16 model's: in float32)
        k = self.config.attention_blocks_per_layer  # cache layers of a decoder layer (LongcatDecoderLayer: each)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, meta, cache.layers[i] if k == 1 else cache.layers[i * k:(i + 1) * k], step)
        return self.model.norm(x if step is None else x.to(self.dtype))

    def _decode_step(self, meta: AttentionMetadata, cache: LatentCache) -> cpu_tables.DecodeStep | PlannedRows | None:
        """The step's rows for the compiled decoder layers, where the step and the first layer take them. A bfloat16
        model's layers compute such a step in float32 (float32 RoPE tables, its bfloat16 weights and cache read as
        they are), so every layer must take the compiled call: its hidden state never meets a bfloat16 product."""
        if self.rows_invariant and self.dtype == torch.float32 and self.model.layers and not self.par.enabled \
                and isinstance(self.model.layers[0], DecoderLayer) and meta.backend.name == "cpu":
            return planned_rows(meta, self.model.layers[0].kernel_table())
        if not self.model.layers or self.par.enabled or not meta.backend.compiled_rows(meta, cache.layers[0]):
            return None
        layers = [cast(DecoderLayer, layer) for layer in self.model.layers]
        first = layers[0].kernel_table()
        if self.dtype == torch.float32:
            return decode_step(meta, first)
        if first is None or any(layer.kernel_table() is None for layer in layers[1:]):
            return None
        return decode_step(meta, first, self.attention_layers()[0].rotary.tables(meta.batch.positions, torch.float32))

    def mtp_forward(self, batch: ForwardBatch, cache: LatentCache, hidden: torch.Tensor,
                    meta: AttentionMetadata | None = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The first MTP layer over ``batch``'s positions (``input_ids``, default the batch's own: the token after
        each position; ``hidden [T, d]``: the states it continues from), writing its latents into its cache layer;
        its output ``[T, d]`` before ``shared_head.norm``."""
        meta = meta or self.attention_metadata(batch, cache)
        layer = cast(MTPLayer, self.mtp[0])
        x = layer.fuse(self.model.embed_tokens(batch.input_ids if input_ids is None else input_ids), hidden)
        return cast(torch.Tensor, layer(x, meta, cache.layers[self.num_cache_layers - len(self.mtp)]))

    def set_draft_vocab(self, token_ids: list[int] | None) -> None:
        """Let MTP drafts propose only ``token_ids`` (sorted, distinct; None: the whole vocabulary): their head is a
        copy of those lm_head rows (this rank's share of them), read instead of the whole head by every draft link
        (``token_map``). Call after loading and before quantising."""
        if token_ids is None:
            self.draft_ids = self.draft_head = self.draft_head_packed = None
            return
        ids, start = torch.tensor(token_ids, dtype=torch.long), 0
        if self.par.enabled:  # this rank's lm_head holds the vocabulary rows [start, stop)
            start, stop, _ = self.par.vocab_split(self.config.vocab_size)
            ids = ids[(ids >= start) & (ids < stop)]
        weight, packed = self.lm_head_weight, self.lm_head_packed
        self.draft_ids = ids.to(weight.device)
        if isinstance(packed, QuantizedWeight):  # loaded quantised: the float head was never materialised
            self.draft_head_packed = packed.select_rows(self.draft_ids - start).bind(self.plan) if len(ids) else None
            self.draft_head = released_like((len(ids), weight.shape[1]), weight.dtype, weight.device)
            return
        self.draft_head = weight[self.draft_ids - start].contiguous()
        self.draft_head_packed = PackedWeight.make(self.draft_head, self.plan) if len(ids) else None  # none: none

    def mtp_greedy(self, out: torch.Tensor) -> torch.Tensor:
        """The MTP layer's greedy tokens ``[R]`` for its outputs ``out [R, d]`` (within the draft vocabulary), on
        every rank."""
        normed = cast(MTPLayer, self.mtp[0]).shared_head.norm(out)
        if self.draft_head is None:
            logits = linear(normed, self.lm_head_weight, None, self.lm_head_packed).float()
        else:
            logits = linear(normed, self.draft_head, None, self.draft_head_packed).float()
        if not self.par.enabled:
            idx = logits.argmax(-1)
            return idx if self.draft_ids is None else self.draft_ids[idx]
        start, stop, _ = self.par.vocab_split(self.config.vocab_size)
        if self.draft_ids is None:
            logits[:, stop - start:] = float("-inf")  # padding rows of the last shard
            best, idx = logits.max(-1)
            idx = idx + start
        elif logits.shape[-1]:
            best, idx = logits.max(-1)
            idx = self.draft_ids[idx]
        else:  # none of the draft vocabulary is in this rank's shard
            best = logits.new_full(logits.shape[:1], float("-inf"))
            idx = torch.zeros(logits.shape[:1], dtype=torch.long, device=logits.device)
        # the best of every rank's shard: ties go to the lowest id, as argmax over the whole vocabulary does
        best_all = self.par.all_gather(best.unsqueeze(-1), dim=-1)  # [R, N]
        idx_all = self.par.all_gather(idx.unsqueeze(-1), dim=-1)
        winner = best_all.argmax(-1, keepdim=True)
        return idx_all.gather(-1, winner).squeeze(-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits ``[R, V]`` (under tensor parallelism: on rank 0, None elsewhere)."""
        if self.config.lm_head_divisor != 1.0:  # µP
            hidden = hidden / self.config.lm_head_divisor
        logits = softcapped(linear(hidden, self.lm_head_weight, None, self.lm_head_packed).float(),
                            self.config.logit_softcap)
        if not self.par.enabled:
            return logits
        full = self.par.gather_to_first(logits, dim=-1)
        return None if full is None else full[:, : self.config.vocab_size]


def softcapped(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """Mistral Large 4's final logits ``cap tanh(logits / cap)`` (``ModelConfig.logit_softcap``; 0: as they are).
    Monotonic: greedy choices (the MTP drafts' too) are unchanged."""
    return logits if not cap else torch.tanh(logits / cap) * cap
