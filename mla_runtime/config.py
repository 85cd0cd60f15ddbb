"""Model configuration read from a Hugging Face ``config.json``.

Covers every MLA family ``families.py`` has an adapter for: each ``config.json`` is first rewritten by its family's
adapter onto DeepSeek-V2's and V3's field names, plus the named variations of the one model (µP scaling, a per-layer
MoE schedule, router bias, query scaling, ...) that this module parses. Notation used throughout:
``d_c = kv_lora_rank``, ``d_r = qk_rope_head_dim``, ``d_n = qk_nope_head_dim``, ``d_v = v_head_dim``, ``n_h`` heads.

Every field is validated when the config is built; a bad value raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_runtime.families import ARCHITECTURES, FAMILIES, family_of

MLA_ARCHITECTURES = ARCHITECTURES
MLA_MODEL_TYPES = {name: f.layout for name, f in FAMILIES.items()}
PRESET_DIR = Path(__file__).resolve().parent / "model_configs"


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention-magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not extending)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of the ``d_r`` decoupled dims. ``kind`` is ``"default"``, ``"yarn"`` or ``"longrope"`` (its
    ``short_factor`` divides each frequency; within ``original_max_position_embeddings`` only: ``_parse_longrope``),
    or ``"none"``: no rotation (every frequency 0, so cos 1 and sin 0), for MLA whose shared ``d_r`` key dims carry
    no position (Kimi Linear)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    interleave: bool = True
    short_factor: tuple[float, ...] | None = None  # longrope: one divisor per frequency (d_r / 2 of them)
    # Mistral Large 4 (LeRoPE): each inverse frequency times ``exp(alpha)``, ``alpha [d_r / 2]`` a learned checkpoint
    # tensor (``model.rotary_emb.alpha``, float32), the same for every layer and the indexer
    learned_frequency_scale: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("default", "yarn", "longrope", "none"):
            raise ValueError(f"rope_scaling.type: unsupported RoPE type {self.kind!r} (use 'default', 'yarn', "
                             f"'longrope' or 'none')")
        if self.kind == "longrope" and not self.short_factor:
            raise ValueError("rope_scaling.short_factor is required for longrope")
        if self.theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.theta}")
        if self.kind == "yarn":
            if self.factor <= 0:
                raise ValueError(f"rope_scaling.factor must be positive, got {self.factor}")
            if not self.original_max_position_embeddings:
                raise ValueError("rope_scaling.original_max_position_embeddings is required for YaRN")

    @property
    def cos_sin_scale(self) -> float:
        """Factor on cos/sin (YaRN's or LongRoPE's attention factor; 1 for default RoPE)."""
        if self.kind == "longrope":  # LongRoPE's default: sqrt(1 + ln(factor) / ln(original length)) when extending
            if self.attention_factor is not None:
                return self.attention_factor
            orig = self.original_max_position_embeddings or 1
            return math.sqrt(1 + math.log(self.factor) / math.log(orig)) if self.factor > 1 and orig > 1 else 1.0
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """``m`` in the softmax scale ``(d_n + d_r)^-1/2 * m^2``."""
        if self.kind == "yarn" and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale_all_dim)
        return 1.0


@dataclass(frozen=True)
class MoEConfig:
    """Routed + shared experts. V2 routes by softmax, V3/Kimi-K2 by sigmoid with a correction bias."""

    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # a per-layer schedule (True: MoE) where the checkpoint lists one (``mlp_layer_types``); it replaces
    # ``first_k_dense_replace``/``moe_layer_freq``. Layers past it (MTP) are of its last layer's kind.
    moe_layers: tuple[bool, ...] | None = None
    # noaux_tc's learned ``e_score_correction_bias``: "required" in the checkpoint, "optional" (zeros where the
    # checkpoint has none: A.X-K1 routes without one) or "none" (Mistral 4's grouped softmax routing has none)
    correction_bias: str = "required"
    # LongCat-Flash's zero-computation experts: ids ``n_routed_experts .. router_experts - 1`` of the router return
    # their input (times their weight) and hold no weights
    zero_experts: int = 0

    @property
    def router_experts(self) -> int:
        """The experts the router scores: the routed experts, then the zero (identity) experts."""
        return self.n_routed_experts + self.zero_experts

    def __post_init__(self) -> None:
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
                     "topk_group", "moe_layer_freq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.zero_experts < 0:
            raise ValueError(f"zero_expert_num must be >= 0, got {self.zero_experts}")
        if self.first_k_dense_replace < 0:
            raise ValueError(f"first_k_dense_replace must be >= 0, got {self.first_k_dense_replace}")
        if self.router_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts ({self.router_experts}) must be divisible by n_group ({self.n_group})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must not exceed n_group ({self.n_group})")
        if self.num_experts_per_tok > self.router_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                             f"({self.router_experts})")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"topk_method: unsupported value {self.topk_method!r}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func: unsupported value {self.scoring_func!r}")
        if self.correction_bias not in ("required", "optional", "none"):
            raise ValueError(f"correction_bias: 'required', 'optional' or 'none', got {self.correction_bias!r}")
        per_group = self.router_experts // self.n_group
        if self.topk_method == "noaux_tc" and per_group < 2 and self.n_group > 1:
            raise ValueError(f"topk_method 'noaux_tc' scores a group by its top-2 experts: n_routed_experts / "
                             f"n_group must be >= 2, got {per_group}")
        if self.topk_group * per_group < self.num_experts_per_tok:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in the "
                             f"topk_group ({self.topk_group}) kept groups ({self.topk_group * per_group})")


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): per layer ``n_heads`` queries of
    ``head_dim`` (from the query's low-rank ``q_resid``) and one key of ``head_dim`` per token (from the hidden state,
    LayerNorm'd), cached beside the latent. Each query attends only to the ``topk`` earlier tokens of highest
    ``score[s, t] = sum_h w[s, h] n_heads^-1/2 relu(head_dim^-1/2 q[s, h] . k[t])``; all of them while there are at
    most ``topk``. RoPE rotates the first ``qk_rope_head_dim`` dims of q and k, in halves (``rope_interleave`` False:
    DeepSeek-V3.2) or interleaved pairs (GLM-5). ``shared``: the layers that reuse the previous layer's selection
    instead of running an indexer of their own (GLM-5's ``indexer_types``). ``query_source``: where the queries come
    from: ``"q_resid"`` (DeepSeek-V3.2, GLM-5) or ``"hidden"`` (Mistral Large 4, whose attention has no Q-LoRA:
    ``wq_b(LayerNorm(h))``, the LayerNorm ``q_input_norm`` with weight and bias). ``query_log_scaling``: the queries
    of head ``i`` at position ``p`` times ``scale_i ln(1 + p) + bias_i`` (learned per layer, ``softmax_scaling``)."""

    n_heads: int
    head_dim: int
    topk: int
    rope_interleave: bool = False
    shared: tuple[bool, ...] | None = None
    query_source: str = "q_resid"
    query_log_scaling: bool = False

    def __post_init__(self) -> None:
        for name in ("n_heads", "head_dim", "topk"):  # the config.json names are index_<name>
            if getattr(self, name) < 1:
                raise ValueError(f"index_{name} must be >= 1, got {getattr(self, name)}")
        if self.query_source not in ("q_resid", "hidden"):
            raise ValueError(f"index_query_source: 'q_resid' or 'hidden', got {self.query_source!r}")
        if self.shared is not None and self.shared[:1] == (True,):
            raise ValueError("indexer_types: the first layer must be 'full' (a 'shared' layer reuses the previous "
                             "layer's selection)")

    def is_shared(self, layer: int) -> bool:
        """Whether ``layer`` reuses the previous layer's selection (layers past the schedule, MTP: their own)."""
        return self.shared is not None and layer < len(self.shared) and self.shared[layer]


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The linear-attention (Kimi Delta Attention) layers of a hybrid model: ``layers[i]`` True: layer ``i`` is one
    (the others are MLA layers). Each has ``num_heads`` heads of ``head_dim`` (keys and values alike) and a short
    causal convolution of ``conv_kernel`` taps over its queries, keys and values. It caches no token: each sequence
    carries, per such layer, a recurrent state ``[num_heads, head_dim, head_dim]`` and the convolution's last
    ``conv_kernel - 1`` inputs (``cache/state_cache.py``). Variations: the forget gate's and the output gate's
    projections low-rank (``low_rank_gates``: Kimi Linear's ``f_a``/``f_b`` and ``g_a``/``g_b``) or full (Ling's
    ``f_proj``, ``g_proj``); the forget gate ``-exp(A) softplus(x)`` (``gate_lower_bound`` None) or bounded,
    ``lower_bound * sigmoid(exp(A) x)`` (Ling's safe gate); the forget rates ``A_log`` stored ``[1, 1, H, 1]``
    (Kimi Linear) or ``[H]`` (``flat_a_log``: Ling's, and GLM-5-Next's beside low-rank gates)."""

    layers: tuple[bool, ...]
    num_heads: int
    head_dim: int
    conv_kernel: int
    low_rank_gates: bool = True
    gate_lower_bound: float | None = None
    flat_a_log: bool = False

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "conv_kernel"):
            if getattr(self, name) < 1:
                raise ValueError(f"linear attention: {name} must be >= 1, got {getattr(self, name)}")
        if self.gate_lower_bound is not None and self.gate_lower_bound >= 0:
            raise ValueError(f"kda_lower_bound must be negative (a log forget gate), got {self.gate_lower_bound}")
        if all(self.layers):
            raise ValueError("layer_types: every layer is a linear-attention layer; mla-runtime serves hybrids with at "
                             "least one full-attention (MLA) layer")

    @property
    def num_layers(self) -> int:
        return sum(self.layers)

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution: the queries', keys' and values' ``num_heads * head_dim`` each."""
        return 3 * self.num_heads * self.head_dim

    def state_bytes(self) -> int:
        """Bytes of one sequence's state over every linear layer (float32 recurrent and convolution states)."""
        per_layer = self.num_heads * self.head_dim * self.head_dim + self.conv_channels * (self.conv_kernel - 1)
        return 4 * per_layer * self.num_layers


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to know about an MLA checkpoint."""

    family: str  # "deepseek_v2" | "deepseek_v3" (Kimi-K2 is deepseek_v3)
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    moe: MoEConfig | None = None
    fp8_block_size: tuple[int, int] | None = None  # set for FP8 block-quantised checkpoints
    stored_quantization: str | None = None  # "int8"/"int4"/"w8a8"/"mxfp4"/"nvfp4": a pre-quantised checkpoint
    stored_layout: Int4Layout | None = None  # how a pre-quantised int4 checkpoint stores its matrices
    stored_float_head: bool = False  # a pre-quantised checkpoint whose (untied) lm_head is stored unquantised
    # a ModelOpt checkpoint (``modelopt``): its ``exclude_modules`` patterns, the modules it stores unquantised, which
    # stay in the model dtype; None: any other checkpoint
    stored_exclude: tuple[str, ...] | None = None
    num_nextn_predict_layers: int = 0
    # µP (MiniCPM3): the embeddings are multiplied by ``embedding_scale``, each residual branch (attention, MLP) by
    # ``residual_scale`` before it is added, and the final hidden state divided by ``lm_head_divisor`` before lm_head
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    lm_head_divisor: float = 1.0
    latent_norm_eps: float | None = None  # eps of q_a_layernorm and kv_a_layernorm (None: rms_norm_eps)
    moe_output_norm: bool = False  # A.X-K1: an RMSNorm (``post_mlp_layernorm``) on each MoE layer's output
    # Mistral 4 (Llama-4 scaling): the queries at position p times 1 + beta * ln(1 + floor(p / L)), L the RoPE's
    # original_max_position_embeddings (so 1 below L); 0: none
    query_scale_beta: float = 0.0
    indexer: IndexerConfig | None = None  # DeepSeek Sparse Attention (None: every query attends to every token)
    # LongCat-Flash: each layer holds this many (attention, dense MLP) blocks, each attention a cache layer of its own,
    # and a MoE beside them (``models.deepseek.LongcatDecoderLayer``); 1: DeepSeek's one attention and one MLP or MoE
    attention_blocks_per_layer: int = 1
    # LongCat-Flash's MLA: the queries times ``query_lora_scale`` and the normed latent ``c`` times ``latent_scale``
    # (both folded into q_a_layernorm's and kv_a_layernorm's weights at load, so the cache holds the scaled latent)
    query_lora_scale: float = 1.0
    latent_scale: float = 1.0
    # A.X-K2's attention: no q_b_proj; one projection ``q_gate_proj`` of ``[q_resid ; q_a_proj(h)]`` gives each head's
    # query and a gate, and the head's attention output is multiplied by sigmoid(gate) before o_proj
    query_gate: bool = False
    # A.X-K2: the rank of a low-rank sigmoid gate on every layer's input norm and on a MoE layer's post-attention norm
    # (``layers.norm.GatedRMSNorm``); 0: plain RMSNorms
    gated_norm_rank: int = 0
    # Mistral Large 4's NoPE layers: ``rope_layers[i]`` False: layer ``i`` rotates nothing (its queries' and keys'
    # d_r rope dims are nope dims; ``layers.mla`` keeps its cache row d_c + d_r wide with zeros as k_r); None: every
    # layer rotates. Layers past the schedule (MTP) rotate.
    rope_layers: tuple[bool, ...] | None = None
    # Mistral Large 4: the attention's queries of head ``i`` at position ``p`` times ``scale_i ln(1 + p) + bias_i``
    # (learned per layer: ``self_attn.softmax_scaling``)
    query_log_scaling: bool = False
    # Mistral Large 4: the final logits are ``cap tanh(logits / cap)``; 0: as they are
    logit_softcap: float = 0.0
    # a hybrid model's linear-attention layers (Kimi Linear); None: every layer is an MLA layer
    linear_attention: LinearAttentionConfig | None = None
    # Ling's MLA: each head's attention output times ``sigmoid(g_proj(x))`` (one gate per head, from the layer's
    # input) before o_proj
    attention_head_gate: bool = False
    # a GGUF file: the bits per weight of each product parameter (by model name) it stores quantised, which load as
    # stored (``gguf_meta.stored_bits``); the planner counts them so
    stored_bits: tuple[tuple[str, float], ...] = ()
    # ... and as the compiled CPU kernels hold them (Q4_K repacked: ``gguf_meta.stored_bits``)
    repacked_bits: tuple[tuple[str, float], ...] = ()
    # a GGUF file whose absorbed factors the compiled decode reads as runs (``gguf_meta.factor_runs``)
    factor_runs: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
            nope_ok = name == "qk_rope_head_dim" and self.family == "glm5_next"  # its MLA layers carry no RoPE
            if getattr(self, name) < 1 and not (nope_ok and getattr(self, name) == 0):
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.qk_nope_head_dim < 0:
            raise ValueError(f"qk_nope_head_dim must be >= 0, got {self.qk_nope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be null or >= 1, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {self.hidden_act!r}")
        if self.moe is not None and self.moe.moe_layers is not None \
                and len(self.moe.moe_layers) != self.num_hidden_layers:
            raise ValueError(f"mlp_layer_types lists {len(self.moe.moe_layers)} layers, the model has "
                             f"{self.num_hidden_layers}")
        short = self.rope.short_factor
        if short is not None and len(short) != self.qk_rope_head_dim // 2:
            raise ValueError(f"rope_scaling.short_factor has {len(short)} values, qk_rope_head_dim / 2 = "
                             f"{self.qk_rope_head_dim // 2} expected")
        if self.query_scale_beta and not self.rope.original_max_position_embeddings:
            raise ValueError("query_scale_beta needs the RoPE's original_max_position_embeddings")
        if min(self.embedding_scale, self.residual_scale, self.lm_head_divisor) <= 0:
            raise ValueError("embedding_scale, residual_scale and lm_head_divisor must be positive")
        idx = self.indexer
        if idx is not None:
            if self.q_lora_rank is None and idx.query_source == "q_resid":
                raise ValueError("index_n_heads: the sparse-attention indexer reads the query's low-rank q_resid; "
                                 "this config has no q_lora_rank")
            if idx.head_dim < self.qk_rope_head_dim:
                raise ValueError(f"index_head_dim ({idx.head_dim}) must be >= qk_rope_head_dim "
                                 f"({self.qk_rope_head_dim}): the indexer rotates that many of its dims")
            if idx.shared is not None and len(idx.shared) != self.num_hidden_layers:
                raise ValueError(f"indexer_types lists {len(idx.shared)} layers, the model has "
                                 f"{self.num_hidden_layers}")
        has_dense = any(self.dense_mlps(i) for i in range(self.num_hidden_layers))
        if has_dense and self.intermediate_size < 1:
            raise ValueError("intermediate_size must be >= 1: the model has dense MLP layers")
        if self.attention_blocks_per_layer < 1:
            raise ValueError(f"attention_blocks_per_layer must be >= 1, got {self.attention_blocks_per_layer}")
        if self.attention_blocks_per_layer > 1 and (self.moe is None or not all(
                self.is_moe_layer(i) for i in range(self.num_hidden_layers))):
            raise ValueError("attention_blocks_per_layer > 1 needs a MoE on every layer (the layer's shortcut MoE)")
        if min(self.query_lora_scale, self.latent_scale) <= 0:
            raise ValueError("query_lora_scale and latent_scale must be positive")
        if self.query_lora_scale != 1.0 and self.q_lora_rank is None:
            raise ValueError("query_lora_scale needs a q_lora_rank (it scales q_a_layernorm)")
        if self.query_gate and self.q_lora_rank is None:
            raise ValueError("query_gate needs a q_lora_rank (its projection reads the query's low-rank state)")
        if self.gated_norm_rank < 0:
            raise ValueError(f"gated_norm_rank must be >= 0, got {self.gated_norm_rank}")
        if self.rope_layers is not None and len(self.rope_layers) != self.num_hidden_layers:
            raise ValueError(f"no_rope_layers lists {len(self.rope_layers)} layers, the model has "
                             f"{self.num_hidden_layers}")
        if self.logit_softcap < 0:
            raise ValueError(f"final_logit_softcapping must be >= 0, got {self.logit_softcap}")
        self._check_hybrid()

    def _check_hybrid(self) -> None:
        """A hybrid's layer schedule covers the model; an attention has one output gate."""
        lin = self.linear_attention
        if lin is not None and len(lin.layers) != self.num_hidden_layers:
            raise ValueError(f"layer_types lists {len(lin.layers)} layers, the model has {self.num_hidden_layers}")
        if self.attention_head_gate and self.query_gate:
            raise ValueError("attention_head_gate and query_gate: an attention has one output gate")

    # -- the notation of the MLA math ----------------------------------------------------------
    @property
    def d_c(self) -> int:
        return self.kv_lora_rank

    @property
    def d_r(self) -> int:
        return self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: ``d_c + d_r``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def index_dim(self) -> int:
        """Values of the indexer's key cached per token per layer (0 without sparse attention)."""
        return 0 if self.indexer is None else self.indexer.head_dim

    @property
    def num_attention_layers(self) -> int:
        """Attention blocks of the decoder, each a layer of the latent cache: ``attention_blocks_per_layer`` a layer;
        a hybrid's MLA layers only (its linear-attention layers cache no token)."""
        linear = 0 if self.linear_attention is None else self.linear_attention.num_layers
        return (self.num_hidden_layers - linear) * self.attention_blocks_per_layer

    def is_linear_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is a linear-attention layer of a hybrid model."""
        lin = self.linear_attention
        return lin is not None and layer < len(lin.layers) and lin.layers[layer]

    @property
    def state_bytes_per_sequence(self) -> int:
        """Bytes of a running sequence's recurrent and convolution states (0 without linear-attention layers)."""
        return 0 if self.linear_attention is None else self.linear_attention.state_bytes()

    def dense_mlps(self, layer: int) -> int:
        """Dense MLPs of ``layer``: one per attention block in a LongCat layer, else one where it is not a MoE."""
        if self.attention_blocks_per_layer > 1:
            return self.attention_blocks_per_layer
        return int(not self.is_moe_layer(layer))

    def uses_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates its queries and keys (``rope_layers``; layers past it, MTP: they do)."""
        return self.rope_layers is None or layer >= len(self.rope_layers) or self.rope_layers[layer]

    def layer_nope_dim(self, layer: int) -> int:
        """``d_n`` of ``layer``: a NoPE layer's queries and keys have ``d_n + d_r`` dims without position."""
        return self.qk_nope_head_dim + (0 if self.uses_rope(layer) else self.qk_rope_head_dim)

    @property
    def latent_eps(self) -> float:
        """The eps of ``q_a_layernorm`` and ``kv_a_layernorm``."""
        return self.rms_norm_eps if self.latent_norm_eps is None else self.latent_norm_eps

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.rope.softmax_mscale ** 2

    def is_moe_layer(self, layer: int) -> bool:
        m = self.moe
        if m is not None and m.moe_layers is not None:
            return m.moe_layers[min(layer, len(m.moe_layers) - 1)]
        return m is not None and layer >= m.first_k_dense_replace and layer % m.moe_layer_freq == 0

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """A ``config.json``'s dict, rewritten first by its family's adapter (``families``)."""
        return _parse(family_of(raw).normalise(raw))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json``; ``path`` may also be a preset name in ``model_configs/``."""
        return cls.from_dict(load_config_dict(path))

    def with_overrides(self, **changes: Any) -> ModelConfig:
        from dataclasses import replace

        return replace(self, **changes)


def resolve_model_path(path: str | Path) -> Path:
    """A checkpoint directory, a ``config.json`` file, or a preset name (``deepseek-v3``)."""
    p = Path(path)
    if p.is_dir():
        return p / "config.json"
    if p.is_file():
        return p
    preset = PRESET_DIR / f"{path}.json"
    if preset.is_file():
        return preset
    presets = sorted(q.stem for q in PRESET_DIR.glob("*.json"))
    raise ValueError(f"model: {str(path)!r} is neither a checkpoint directory, a config.json, nor a preset "
                     f"(presets: {', '.join(presets)})")


def load_config_dict(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint folder (or the file, or a preset), or the one a GGUF model's metadata
    describes (``gguf_meta.config_dict``)."""
    from mla_runtime.gguf_meta import config_dict, gguf_files

    if gguf_files(path) is not None:
        return config_dict(path)
    cfg_file = resolve_model_path(path)
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from e
    return _with_modelopt_config(raw, cfg_file.parent / MODELOPT_FILE)


def _with_modelopt_config(raw: dict[str, Any], quant_file: Path) -> dict[str, Any]:
    """``raw`` with a ModelOpt export's ``hf_quant_config.json`` (beside config.json; its producer ``modelopt``) as its
    ``quantization_config`` where config.json has none: NVIDIA's published checkpoints describe their quantisation
    there alone."""
    if raw.get("quantization_config") or not quant_file.is_file():
        return raw
    try:
        q = json.loads(quant_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{quant_file}: not valid JSON ({e})") from e
    producer = q.get("producer") if isinstance(q, dict) else None
    if not isinstance(producer, dict) or str(producer.get("name", "")).lower() != MODELOPT_METHOD:
        return raw
    return {**raw, "quantization_config": {"quant_method": MODELOPT_METHOD, **q}}


def _required(raw: dict[str, Any], name: str) -> Any:
    if raw.get(name) is None:
        raise ValueError(f"config field {name!r} is required for an MLA model but is missing")
    return raw[name]


def _family(raw: dict[str, Any]) -> str:
    """The layout (``deepseek_v2`` / ``deepseek_v3``) of an already normalised config (``families.family_of``)."""
    return family_of(raw).layout


def _parse_rope(raw: dict[str, Any], family: str) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "deepseek_yarn":
        kind = "yarn"
    interleave = True if family == "deepseek_v2" else bool(raw.get("rope_interleave", True))
    if kind == "none":
        return RopeConfig(kind="none", interleave=False)
    if kind == "default":
        return RopeConfig(theta=float(theta), interleave=interleave,
                          learned_frequency_scale=bool(raw.get("rope_learned_frequency_scale", False)))
    if kind == "longrope":
        return _parse_longrope(raw, params, float(theta), interleave)
    factor = params.get("factor")
    orig = params.get("original_max_position_embeddings")
    if factor is None and orig:
        factor = _required(raw, "max_position_embeddings") / orig
    return RopeConfig(
        theta=float(theta), kind=kind, factor=float(factor if factor is not None else 1.0),
        original_max_position_embeddings=orig,
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
        interleave=interleave, learned_frequency_scale=bool(raw.get("rope_learned_frequency_scale", False)))


def _parse_longrope(raw: dict[str, Any], params: dict[str, Any], theta: float, interleave: bool) -> RopeConfig:
    """LongRoPE within its original length, where ``short_factor`` divides each frequency. Past that length the
    reference switches every position of the sequence to ``long_factor`` (re-rotating what is cached), which the
    runtime does not implement: such a config is refused."""
    orig = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    if not orig or not params.get("short_factor"):
        raise ValueError("rope_scaling: longrope needs original_max_position_embeddings and short_factor")
    max_pos = int(_required(raw, "max_position_embeddings"))
    if max_pos > orig:
        raise ValueError(f"rope_scaling: longrope past original_max_position_embeddings ({orig}; "
                         f"max_position_embeddings is {max_pos}) is not supported: there the reference re-rotates "
                         f"the whole sequence with long_factor. Set max_position_embeddings to {orig} to run within it")
    factor = params.get("factor") or max_pos / orig
    return RopeConfig(theta=theta, kind="longrope", factor=float(factor), original_max_position_embeddings=int(orig),
                      attention_factor=params.get("attention_factor"), interleave=interleave,
                      short_factor=tuple(float(f) for f in params["short_factor"]))


def _parse_moe(raw: dict[str, Any], family: str) -> MoEConfig | None:
    n_routed = raw.get("n_routed_experts")
    if not n_routed:
        return None
    v3 = family == "deepseek_v3"
    return MoEConfig(
        n_routed_experts=int(n_routed),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        num_experts_per_tok=int(_required(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(_required(raw, "moe_intermediate_size")),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        topk_method=raw.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
        scoring_func=raw.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        # DeepSeek-V2 normalises only a choice of several experts; the V3 families also a single expert's weight
        norm_topk_prob=bool(raw.get("norm_topk_prob", v3)) and (v3 or int(raw["num_experts_per_tok"]) > 1),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
        moe_layers=None if raw.get("moe_layers") is None else tuple(bool(b) for b in raw["moe_layers"]),
        correction_bias=str(raw.get("correction_bias") or "required"),
        zero_experts=int(raw.get("zero_experts") or 0),
    )


# -- pre-quantised checkpoints: the schemes the runtime runs as stored (``compressed``, ``stored_int4``) -------------
INT4_GROUP = 32
INT4_GROUPS = (32, 64, 128)  # the int4 group widths a checkpoint may store
SCHEMES = {"int8": ("int-quantized", 8, "channel", None), "int4": ("pack-quantized", 4, "group", INT4_GROUP)}
# w8a8: int8 weights as "int8" stores them, with input activations (W8A8_ACTIVATIONS); written as "int8" is.
# mxfp4 / nvfp4: E2M1 values, two a byte, with UE8M0 scales per 32 / E4M3 scales per 16 and a global scale
FP4_SCHEMES = {"mxfp4": ("mxfp4-pack-quantized", 4, "group", 32),
               "nvfp4": ("nvfp4-pack-quantized", 4, "tensor_group", 16)}
# w4a16: int4 weights in asymmetric groups of W4A16_GROUP with zero points (llm-compressor's W4A16_ASYM), written
# as "int4" is; a checkpoint of it loads as stored as "int4" (Int4Layout: compressed-tensors, 128, asymmetric)
W4A16_GROUP = 128
STORED_FORMATS = {**SCHEMES, "w4a16": ("pack-quantized", 4, "group", W4A16_GROUP), "w8a8": SCHEMES["int8"],
                  **FP4_SCHEMES}
# the input activations a W8A8 int8 scheme quantises: int8, symmetric, one scale per token computed when it runs
W8A8_ACTIVATIONS = {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
W8A8_METHOD = "w8a8_int8"  # SGLang's quant_method for int8 weights [N, K] with scales [N, 1] and W8A8_ACTIVATIONS
INT4_METHODS = ("compressed-tensors", "awq", "gptq")  # the quant_method values of int4 checkpoints loaded as stored
MODELOPT_METHOD = "modelopt"  # NVIDIA ModelOpt's export (hf_quant_config.json, or config.json's quantization_config)
MODELOPT_ALGOS = {"NVFP4": "nvfp4", "FP8": "fp8"}  # ModelOpt's quant_algo -> the runtime format its weights load as
MODELOPT_FP8_BLOCK = (1, 128)  # a ModelOpt FP8 tensor's one scale, held per row and 128 values (layers.fp8 blocks)
MODELOPT_FILE = "hf_quant_config.json"  # where a ModelOpt export writes its quantization config
MODELOPT_GROUP = 16  # NVFP4's group size, the only one ModelOpt writes


class UnsupportedScheme(ValueError):
    """A pre-quantised checkpoint whose scheme the runtime cannot run as stored."""


@dataclass(frozen=True)
class Int4Layout:
    """How a pre-quantised int4 checkpoint stores a matrix: ``method`` (``compressed-tensors``' pack-quantized, AWQ's
    GEMM layout, GPTQ's), a scale per ``group`` values of a row, zero points unless ``symmetric``, GPTQ's
    ``zero_offset`` (1 in its original ``gptq`` format, whose stored zeros are one less than they mean)."""

    method: str
    group: int
    symmetric: bool
    zero_offset: int = 0


@dataclass(frozen=True)
class StoredScheme:
    """What a pre-quantised checkpoint stores: ``quantization`` (``int8``/``int4``), its format name and, for int4,
    its ``layout``."""

    quantization: str
    format: str
    layout: Int4Layout | None = None
    float_head: bool = False  # the checkpoint leaves lm_head unquantised
    exclude: tuple[str, ...] | None = None  # ModelOpt's exclude_modules (ModelConfig.stored_exclude)


def _int4_group(where: str, group: Any) -> int:
    if group not in INT4_GROUPS:
        raise UnsupportedScheme(f"{where}: group_size={group} is not supported for 4-bit weights (supported: "
                                f"{', '.join(map(str, INT4_GROUPS))})")
    return int(group)


def _weights_scheme(name: str, w: dict[str, Any]) -> tuple[str, Int4Layout | None]:
    """The runtime format of one compressed-tensors weight scheme."""
    kind = (w.get("type"), w.get("num_bits"), w.get("strategy"), w.get("group_size"), w.get("symmetric", True))
    where = f"quantization_config.config_groups.{name}.weights"
    if kind[:3] == ("int", 8, "channel") and kind[4]:
        return "int8", None
    if kind[:3] == ("int", 4, "group"):
        return "int4", Int4Layout("compressed-tensors", _int4_group(where, kind[3]), bool(kind[4]))
    for fp4, (_, bits, strategy, size) in FP4_SCHEMES.items():
        if kind[:4] == ("float", bits, strategy, size) and kind[4]:
            return fp4, None
    raise UnsupportedScheme(
        f"{where}: type={kind[0]} num_bits={kind[1]} strategy={kind[2]} group_size={kind[3]} symmetric={kind[4]} is "
        f"not supported (supported: int 8-bit symmetric channel, int 4-bit group of "
        f"{', '.join(map(str, INT4_GROUPS))}, symmetric or with zero points, or float 4-bit symmetric groups of 32 "
        f"(MXFP4) or 16 (NVFP4))")


def _with_activations(name: str, acts: dict[str, Any] | None, quantization: str) -> str:
    """``quantization`` of a config group whose weights it names, given its ``input_activations``: none keeps it,
    W8A8_ACTIVATIONS with int8 per-channel weights makes it ``w8a8``, FP4 activations beside FP4 weights are not
    applied (the products take the model dtype's rows), anything else is ``UnsupportedScheme``."""
    if not acts:
        return quantization
    if quantization in FP4_SCHEMES and acts.get("type") == "float" and acts.get("num_bits") == 4:
        return quantization
    got = {key: acts.get(key, True if key == "symmetric" else None) for key in W8A8_ACTIVATIONS}
    if quantization != "int8" or got != W8A8_ACTIVATIONS:
        raise UnsupportedScheme(
            f"quantization_config.config_groups.{name}.input_activations: {got} with {quantization} weights is not "
            f"supported (activations are run quantised only as dynamic int8 per token, symmetric, beside int8 "
            f"per-channel weights: W8A8 int8)")
    return "w8a8"


def parse_quantization_config(q: dict[str, Any]) -> StoredScheme:
    """The runtime format of a compressed-tensors ``quantization_config``, or ``UnsupportedScheme`` naming what is
    not supported."""
    fmt = q.get("format")
    groups = q.get("config_groups") or {}
    if not groups:
        raise UnsupportedScheme("quantization_config (compressed-tensors): no config_groups")
    found = set()
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise UnsupportedScheme(f"quantization_config.config_groups.{name}: a scheme object expected")
        if group.get("output_activations"):
            raise UnsupportedScheme(f"quantization_config.config_groups.{name}.output_activations: output "
                                    f"quantisation is not supported")
        scheme, layout = _weights_scheme(name, group.get("weights") or {})
        found.add((_with_activations(name, group.get("input_activations"), scheme), layout))
    if len(found) != 1:
        raise UnsupportedScheme(f"quantization_config: config_groups mix {sorted(map(str, found))}; one scheme is "
                                f"supported")
    quantization, layout = found.pop()
    stored = STORED_FORMATS[quantization][0]
    if fmt not in (stored, "naive-quantized" if stored == "int-quantized" else None):
        raise UnsupportedScheme(f"quantization_config.format {fmt!r} is not supported for {quantization} weights "
                                f"(use {stored!r})")
    ignored = [str(i) for i in q.get("ignore") or ()]
    head = any(i == "lm_head" or (i.startswith("re:") and re.fullmatch(i[3:], "lm_head")) for i in ignored)
    return StoredScheme(quantization, str(fmt), layout, head)


def _first(q: dict[str, Any], *keys: str) -> Any:
    return next((q[k] for k in keys if q.get(k) is not None), None)


def parse_awq_gptq_config(q: dict[str, Any]) -> StoredScheme:
    """The int4 layout of an AWQ (``quant_method: awq``, GEMM version) or GPTQ (``quant_method: gptq``)
    ``quantization_config``, or ``UnsupportedScheme`` naming the parameter the runtime cannot run as stored."""
    method = str(q.get("quant_method"))
    where = f"quantization_config ({method})"
    bits = _first(q, "bits", "w_bit")
    if bits != 4:
        raise UnsupportedScheme(f"{where}: bits={bits} is not supported (4-bit weights are)")
    group = _int4_group(where, _first(q, "group_size", "q_group_size"))
    if method == "awq":
        version = str(q.get("version") or "gemm").lower()
        if version != "gemm":
            raise UnsupportedScheme(f"{where}: version={version!r} is not supported (AWQ's 'gemm' layout is)")
        if not q.get("zero_point", True):
            raise UnsupportedScheme(f"{where}: zero_point=false is not supported (AWQ with zero points is)")
        return StoredScheme("int4", "awq", Int4Layout("awq", group, False), True)
    fmt = str(q.get("checkpoint_format") or "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedScheme(f"{where}: checkpoint_format={fmt!r} is not supported ('gptq' and 'gptq_v2' are)")
    pack = q.get("pack_dtype", "int32")
    if str(pack).removeprefix("torch.") != "int32":
        raise UnsupportedScheme(f"{where}: pack_dtype={pack!r} is not supported (int32 is)")
    layout = Int4Layout("gptq", group, bool(q.get("sym", True)), 1 if fmt == "gptq" else 0)
    return StoredScheme("int4", fmt, layout, not q.get("lm_head", False))


def modelopt_excluded(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether the module ``name`` (a checkpoint name less its ``.weight``) matches one of ModelOpt's
    ``exclude_modules`` (shell wildcards: ``model.layers.*.self_attn*``, ``*.mlp.gate``, ``lm_head``)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def parse_modelopt_config(q: dict[str, Any]) -> StoredScheme:
    """The runtime format of a ModelOpt checkpoint's quantization config, in either of the forms its exports write:
    ``hf_quant_config.json``'s ``{"quantization": {"quant_algo", "group_size", "exclude_modules",
    "kv_cache_quant_algo"}}`` (folded into ``quantization_config`` by ``load_config_dict``) or config.json's flat
    ``{"quant_algo", "ignore", "kv_cache_scheme", ...}``; ``UnsupportedScheme`` naming an algorithm (or a group size)
    the runtime cannot run as stored. A KV cache algorithm is not applied: the cache's dtype is the runtime's own."""
    nested = q.get("quantization")
    body = nested if isinstance(nested, dict) else q
    algo = str(body.get("quant_algo") or "").upper()
    where = "quantization_config (modelopt)"
    if algo not in MODELOPT_ALGOS:
        raise UnsupportedScheme(f"{where}: quant_algo={algo or None!r} is not supported (supported: "
                                f"{', '.join(MODELOPT_ALGOS)})")
    group = body.get("group_size")
    if algo == "NVFP4" and group is not None and int(group) != MODELOPT_GROUP:
        raise UnsupportedScheme(f"{where}: group_size={group} is not supported for {algo} (groups of "
                                f"{MODELOPT_GROUP} are)")
    exclude = body.get("exclude_modules", body.get("ignore")) or []
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise UnsupportedScheme(f"{where}: exclude_modules must be a list of module names, got {exclude!r}")
    patterns = tuple(exclude)
    return StoredScheme(MODELOPT_ALGOS[algo], MODELOPT_METHOD, None, modelopt_excluded("lm_head", patterns), patterns)


def _stored_scheme(raw: dict[str, Any]) -> StoredScheme | None:
    """The scheme of a pre-quantised checkpoint (compressed-tensors, AWQ, GPTQ), None for any other."""
    q = raw.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return parse_quantization_config(q)
    if method in ("awq", "gptq"):
        return parse_awq_gptq_config(q)
    if method == W8A8_METHOD:  # SGLang's W8A8 int8: every matrix it stores carries its weight_scale
        return StoredScheme("w8a8", W8A8_METHOD)
    if str(method).lower().startswith(MODELOPT_METHOD):  # modelopt, modelopt_fp4
        return parse_modelopt_config(q)
    return None


def _parse_fp8(raw: dict[str, Any]) -> tuple[int, int] | None:
    q = raw.get("quantization_config")
    if not q or q.get("quant_method") in (*INT4_METHODS, W8A8_METHOD) \
            or str(q.get("quant_method")).lower().startswith(MODELOPT_METHOD):
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method: block 'fp8', 'compressed-tensors' (int8, int4, W8A8, "
                         f"MXFP4, NVFP4), 'awq' and 'gptq' (int4), {W8A8_METHOD!r} and 'modelopt' (NVFP4, FP8) are "
                         f"supported, got {method!r}")
    block = q.get("weight_block_size") or [128, 128]
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"quantization_config.weight_block_size must be two positive ints, got {block}")
    return int(block[0]), int(block[1])


def _parse(raw: dict[str, Any]) -> ModelConfig:
    family = _family(raw)
    if raw.get("kv_lora_rank") is None:
        raise ValueError("config field 'kv_lora_rank' is missing: this is not a multi-head latent attention "
                         "config (MLA caches a kv_lora_rank-wide latent per token)")
    moe = _parse_moe(raw, family)
    if family == "deepseek_v3" and moe is not None and moe.scoring_func == "sigmoid" \
            and moe.topk_method not in ("noaux_tc", "greedy"):
        raise ValueError(f"topk_method {moe.topk_method!r} is not valid with sigmoid scoring (use 'noaux_tc')")
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    stored = _stored_scheme(raw)
    return ModelConfig(
        family=family,
        model_type=str(raw.get("model_type", family)),
        vocab_size=int(_required(raw, "vocab_size")),
        hidden_size=int(_required(raw, "hidden_size")),
        intermediate_size=int(raw.get("intermediate_size") or 0),
        num_hidden_layers=int(_required(raw, "num_hidden_layers")),
        num_attention_heads=int(_required(raw, "num_attention_heads")),
        kv_lora_rank=int(raw["kv_lora_rank"]),
        q_lora_rank=None if raw.get("q_lora_rank") is None else int(raw["q_lora_rank"]),
        qk_nope_head_dim=int(_required(raw, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_required(raw, "qk_rope_head_dim")),
        v_head_dim=int(_required(raw, "v_head_dim")),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
        rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
        hidden_act=str(raw.get("hidden_act") or "silu"),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        torch_dtype=str(dtype),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        rope=_parse_rope(raw, family),
        moe=moe,
        fp8_block_size=_parse_fp8(raw),
        stored_quantization=None if stored is None else stored.quantization,
        stored_layout=None if stored is None else stored.layout,
        stored_float_head=stored is not None and stored.float_head,
        stored_exclude=None if stored is None else stored.exclude,
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        embedding_scale=float(raw.get("embedding_scale", 1.0)),
        residual_scale=float(raw.get("residual_scale", 1.0)),
        lm_head_divisor=float(raw.get("lm_head_divisor", 1.0)),
        latent_norm_eps=None if raw.get("latent_norm_eps") is None else float(raw["latent_norm_eps"]),
        moe_output_norm=bool(raw.get("moe_output_norm", False)),
        query_scale_beta=float(raw.get("query_scale_beta") or 0.0),
        indexer=_parse_indexer(raw),
        attention_blocks_per_layer=int(raw.get("attention_blocks_per_layer") or 1),
        query_lora_scale=float(raw.get("query_lora_scale") or 1.0),
        latent_scale=float(raw.get("latent_scale") or 1.0),
        query_gate=bool(raw.get("query_gate", False)),
        gated_norm_rank=int(raw.get("gated_norm_rank") or 0),
        rope_layers=None if raw.get("rope_layers") is None else tuple(bool(b) for b in raw["rope_layers"]),
        query_log_scaling=bool(raw.get("query_log_scaling", False)),
        logit_softcap=float(raw.get("logit_softcap") or 0.0),
        linear_attention=_parse_linear_attention(raw),
        attention_head_gate=bool(raw.get("attention_head_gate", False)),
        **_gguf_fields(raw),
    )


def _gguf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """A GGUF file's own fields (``gguf_meta.config_dict``): its stored products' bits, and whether the decode reads
    its absorbed factors as runs."""
    return {"stored_bits": tuple(sorted((str(k), float(v)) for k, v in (raw.get("gguf_stored_bits") or {}).items())),
            "repacked_bits": tuple(sorted((str(k), float(v))
                                          for k, v in (raw.get("gguf_repacked_bits") or {}).items())),
            "factor_runs": bool(raw.get("gguf_factor_runs", False))}


def _parse_linear_attention(raw: dict[str, Any]) -> LinearAttentionConfig | None:
    """A hybrid's linear-attention layers, from a normalised config's ``linear_layers`` (None: not a hybrid)."""
    layers = raw.get("linear_layers")
    if layers is None:
        return None
    return LinearAttentionConfig(layers=tuple(bool(b) for b in layers),
                                 num_heads=int(_required(raw, "linear_num_heads")),
                                 head_dim=int(_required(raw, "linear_head_dim")),
                                 conv_kernel=int(_required(raw, "linear_conv_kernel")),
                                 low_rank_gates=bool(raw.get("linear_low_rank_gates", True)),
                                 gate_lower_bound=None if raw.get("linear_gate_lower_bound") is None
                                 else float(raw["linear_gate_lower_bound"]),
                                 flat_a_log=bool(raw.get("linear_flat_a_log", not raw.get("linear_low_rank_gates",
                                                                                           True))))


def _parse_indexer(raw: dict[str, Any]) -> IndexerConfig | None:
    """The sparse-attention indexer of a normalised config: present where ``index_topk`` is set."""
    if raw.get("index_topk") is None:
        return None
    kinds = raw.get("indexer_types")
    if kinds is not None:
        unknown = sorted(set(kinds) - {"full", "shared"})
        if unknown:
            raise ValueError(f"indexer_types {unknown} are not supported (use 'full' or 'shared')")
    return IndexerConfig(n_heads=int(_required(raw, "index_n_heads")), head_dim=int(_required(raw, "index_head_dim")),
                         topk=int(raw["index_topk"]), rope_interleave=bool(raw.get("index_rope_interleave", False)),
                         shared=None if kinds is None else tuple(k == "shared" for k in kinds),
                         query_source=str(raw.get("index_query_source") or "q_resid"),
                         query_log_scaling=bool(raw.get("index_query_log_scaling", False)))
