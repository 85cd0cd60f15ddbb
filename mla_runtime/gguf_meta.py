"""GGUF files (llama.cpp's format) as a checkpoint: where they are, the model config and the tokenizer their metadata
describe, and each tensor's name in the Hugging Face layout the loader reads. Read by ``gguf_file`` (the header
parsed from the file's bytes, the file mapped with ``np.memmap``): nothing here reads a weight.

- **Files**: ``PATH.gguf``; the first part of a split model (``NAME-00001-of-0000N.gguf``, the others beside it); or
  a folder with no ``config.json`` that holds one GGUF or the parts of one split model.
- **Config** (``config_dict``): architecture ``deepseek2`` (DeepSeek-V2/V3, Kimi-K2 and the other llama.cpp files of
  that layout) or ``minicpm3`` (``_minicpm3``: the µP scales llama.cpp fixes for it, LongRoPE from its factor
  tensors), turned into a ``config.json``-style dict: ``deepseek_v3`` where the router is a sigmoid or has a
  correction bias (``exp_probs_b``), else ``deepseek_v2``. The attention's widths come from ``attention.key_length_mla``
  / ``value_length_mla`` where present (files written since llama.cpp stores the MQA form's widths in ``key_length``),
  else ``key_length`` / ``value_length``; YaRN's ``mscale_all_dim`` from ``rope.scaling.yarn_log_multiplier`` / 0.1
  (how llama.cpp stores it for this architecture), with ``mscale`` equal to it (llama.cpp's rotary tables carry no
  magnitude of their own). The lm_head is tied where the file has no ``output.weight``. Multi-token-prediction
  layers are not read (llama.cpp's converter leaves them out).
- **Tokenizer** (``load_gguf_tokenizer``): a byte-level BPE (``tokenizer.ggml.model`` ``gpt2``, what llama.cpp writes
  for DeepSeek's models; another model, MiniCPM3's SentencePiece ``llama``, goes to transformers' GGUF tokenizer) built
  with ``tokenizers`` from ``tokenizer.ggml.tokens``/``merges``/``token_type``, the special
  tokens as the file spells them (``<｜begin▁of▁sentence｜>``), BOS/EOS and whether to add them, and
  ``tokenizer.chat_template``; the splits of the DeepSeek vocabulary ``tokenizer.ggml.pre`` names (``deepseek-v3``,
  ``deepseek-llm``: V2's, ``deepseek-coder``), else GPT-2's.
- **Names** (``hf_names``): llama.cpp's tensor names mapped back (``BLOCK_NAMES``); ``attn_kv_b``, or where the file
  splits it the pair ``attn_k_b`` (each head's ``W_UK`` transposed) and ``attn_v_b``, is ``kv_b_proj``; each expert of
  a stacked ``ffn_*_exps`` tensor is one ``experts.{e}.*_proj.weight``.
- **Types** (``check_types``): F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K..Q6_K load; any other type
  (the IQ types, ternary, MXFP4...) is refused before a weight is read, naming the tensor and its type.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mla_runtime.gguf_file import GgufFormatError, GgufHeader, type_name

GGUF_MAGIC = b"GGUF"
SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")
ARCHITECTURES = ("deepseek2", "minicpm3")
# MiniCPM3's µP scales: its GGUF stores none, llama.cpp's graph for the architecture fixes these (MiniCPM3-4B's)
MINICPM3_SCALES = {"scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 256}
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # MiniCPM3's LongRoPE: config, not weights
# the ggml types the loader reads: float ones as they are, Q4_0 into the int4 format, the others as stored
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")

# llama.cpp's per-block names (``blk.N.<name>.weight``) -> the Hugging Face names under ``model.layers.N.``
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
SPLIT_KV_B = ("attn_k_b", "attn_v_b")  # llama.cpp's split of kv_b_proj: [H, d_c, d_n] (per head W_UKᵀ), [H, d_v, d_c]
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# the DeepSeek-V3 vocabulary's pre-tokenizer (its tokenizer.json's splits; llama.cpp's "deepseek-v3")
DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# DeepSeek-LLM's and DeepSeek-V2's (llama.cpp's "deepseek-llm"), and DeepSeek-Coder's ("deepseek-coder")
DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    # letters: the code points are spelled out where Unicode normalisation would turn one into another
    # (U+1F7D, U+1FBE, U+1FD3, U+1FDB, U+2126, U+212A)
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝ"
    "Ὗ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭ"
    "Ꚁ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)
DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
PRE_TOKENIZER_SPLITS = {"deepseek-v3": DEEPSEEK_V3_SPLITS, "deepseek-llm": DEEPSEEK_LLM_SPLITS,
                        "deepseek-coder": DEEPSEEK_CODER_SPLITS}


class GgufError(ValueError):
    """A GGUF file the runtime cannot load: says which file or tensor and why."""


def split_parts(path: Path) -> list[Path]:
    """``path`` alone, or every part of the split model whose first part it is (all must exist)."""
    m = SPLIT_RE.match(path.name)
    if m is None:
        return [path]
    if int(m["part"]) != 1:
        raise GgufError(f"{path}: part {int(m['part'])} of a split GGUF; pass its first part "
                        f"({m['stem']}-00001-of-{m['count']}.gguf) or the folder")
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GgufError(f"{path}: split GGUF of {count} parts, missing {', '.join(missing)}")
    return parts


def gguf_files(path: str | Path) -> list[Path] | None:
    """The GGUF file(s) ``path`` names (a ``.gguf`` file, or a folder holding one GGUF or one split model and no
    ``config.json``), or None where ``path`` is not a GGUF checkpoint."""
    p = Path(path).expanduser()
    if p.is_file():
        return split_parts(p) if p.suffix == ".gguf" or is_gguf_file(p) else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(p.glob("*.gguf"))
    if not found:
        return None
    firsts = [f for f in found if (m := SPLIT_RE.match(f.name)) is None or int(m["part"]) == 1]
    if len(firsts) != 1:
        raise GgufError(f"{p}: holds {len(firsts)} GGUF models ({', '.join(f.name for f in firsts[:4])}); pass "
                        f"the file to load")
    return split_parts(firsts[0])


def is_gguf_file(path: Path) -> bool:
    """Whether the file starts with GGUF's magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the files: its ggml type's name, its shape in torch order (rows last-but-one) and its bytes (a
    view of its file's copy-on-write map)."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray


class GgufModel:
    """The parts of one GGUF model (``gguf_file.GgufHeader``: copy-on-write maps): the first part's metadata, every
    part's tensors."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self.headers = []
        for f in files:
            if not is_gguf_file(f):
                raise GgufError(f"{f}: not a GGUF file (it does not start with the bytes 'GGUF')")
            try:
                self.headers.append(GgufHeader(f))
            except (GgufFormatError, OSError) as e:
                raise GgufError(f"{f}: unreadable GGUF ({e})") from e
        self.tensors: dict[str, GgufTensor] = {}
        for header in self.headers:
            for t in header.tensors:
                self.tensors[t.name] = GgufTensor(t.name, type_name(t.type_id), tuple(reversed(t.dims)), t.data)

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value of the first part (strings decoded, arrays as lists), or ``default``."""
        return self.headers[0].values.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.value("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.value(f"{self.architecture}.{key}", default)


@functools.lru_cache(maxsize=4)
def _open(files: tuple[Path, ...], stamps: tuple[float, ...]) -> GgufModel:
    return GgufModel(list(files))


def open_gguf(path: str | Path) -> GgufModel:
    """The GGUF model at ``path`` (``gguf_files``), opened once per set of files and their modification times."""
    files = gguf_files(path)
    if files is None:
        raise GgufError(f"{path}: not a GGUF file or a folder holding one")
    return _open(tuple(files), tuple(f.stat().st_mtime for f in files))


def _required(g: GgufModel, key: str) -> Any:
    value = g.arch_value(key)
    if value is None:
        raise GgufError(f"{g.files[0]}: metadata {g.architecture}.{key} is missing")
    return value


def config_dict(path: str | Path) -> dict[str, Any]:
    """The ``config.json``-style dict of the GGUF model at ``path`` (module docstring)."""
    g = open_gguf(path)
    if g.architecture not in ARCHITECTURES:
        raise GgufError(f"{g.files[0]}: architecture {g.architecture!r} is not supported (GGUF files of "
                        f"{', '.join(ARCHITECTURES)} load)")
    layers, heads = int(_required(g, "block_count")), int(_required(g, "attention.head_count"))
    rope_dim = int(_required(g, "rope.dimension_count"))
    key_len = int(g.arch_value("attention.key_length_mla") or _required(g, "attention.key_length"))
    # MiniCPM3's files store no value length: llama.cpp's default, hidden size / heads (as MiniCPM3's own default)
    value_len = int(g.arch_value("attention.value_length_mla") or g.arch_value("attention.value_length")
                    or int(_required(g, "embedding_length")) // heads)
    vocab = g.arch_value("vocab_size") or len(g.value("tokenizer.ggml.tokens") or []) or \
        g.tensors["token_embd.weight"].shape[0]
    q_lora = g.arch_value("attention.q_lora_rank")
    raw: dict[str, Any] = {
        "vocab_size": int(vocab), "hidden_size": int(_required(g, "embedding_length")),
        "intermediate_size": int(g.arch_value("feed_forward_length") or 0), "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "kv_lora_rank": int(_required(g, "attention.kv_lora_rank")), "q_lora_rank": int(q_lora) if q_lora else None,
        "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": key_len - rope_dim, "v_head_dim": value_len,
        "max_position_embeddings": int(g.arch_value("context_length") or 4096),
        "rms_norm_eps": float(g.arch_value("attention.layer_norm_rms_epsilon") or 1e-6),
        "rope_theta": float(g.arch_value("rope.freq_base") or 10000.0),
        "tie_word_embeddings": "output.weight" not in g.tensors, "torch_dtype": _float_dtype(g),
        "bos_token_id": g.value("tokenizer.ggml.bos_token_id"), "eos_token_id": g.value("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu", "attention_bias": False, "num_nextn_predict_layers": 0,
    }
    raw["gguf_stored_bits"] = stored_bits(g)
    raw["gguf_repacked_bits"] = stored_bits(g, repacked=True)
    raw["gguf_factor_runs"] = factor_runs(g, layers)
    if g.architecture == "minicpm3":
        return {**raw, **_minicpm3(g, raw)}
    raw.update(_moe(g, layers))
    scaling = _rope_scaling(g)
    if scaling is not None:
        raw["rope_scaling"] = scaling
    return raw


def _minicpm3(g: GgufModel, raw: dict[str, Any]) -> dict[str, Any]:
    """MiniCPM3's fields: dense, its µP scales (``MINICPM3_SCALES``), and LongRoPE from ``rope_factors_short`` /
    ``_long`` within the file's context length (where llama.cpp uses the short factors)."""
    out: dict[str, Any] = {"model_type": "minicpm3", "architectures": ["MiniCPM3ForCausalLM"], **MINICPM3_SCALES}
    if all(n in g.tensors for n in ROPE_FACTORS):
        long, short = (g.tensors[n].data.view(np.float32).reshape(-1).tolist()
                       for n in ROPE_FACTORS)
        out["rope_scaling"] = {"rope_type": "longrope", "type": "longrope", "long_factor": long, "short_factor": short,
                               "original_max_position_embeddings": raw["max_position_embeddings"]}
    return out


def _moe(g: GgufModel, layers: int) -> dict[str, Any]:
    """The MoE fields (a model without experts: every layer dense) and the family they make."""
    experts = int(g.arch_value("expert_count") or 0)
    sigmoid = int(g.arch_value("expert_gating_func") or 1) == 2  # llama.cpp: 1 softmax, 2 sigmoid
    bias = any(n.endswith(".exp_probs_b.bias") for n in g.tensors)
    v3 = sigmoid or bias
    out: dict[str, Any] = {"model_type": "deepseek_v3" if v3 else "deepseek_v2",
                           "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"]}
    if v3:
        out["rope_interleave"] = True  # DeepSeek's weights, as its checkpoints and llama.cpp keep them
    if not experts:
        return {**out, "first_k_dense_replace": layers, "n_routed_experts": None}
    groups = int(g.arch_value("expert_group_count") or 1)
    used_groups = int(g.arch_value("expert_group_used_count") or 1)
    out.update({
        "n_routed_experts": experts, "num_experts_per_tok": int(_required(g, "expert_used_count")),
        "moe_intermediate_size": int(_required(g, "expert_feed_forward_length")),
        "n_shared_experts": int(g.arch_value("expert_shared_count") or 0),
        "first_k_dense_replace": int(g.arch_value("leading_dense_block_count") or 0),
        "routed_scaling_factor": float(g.arch_value("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(g.arch_value("expert_weights_norm") or False),
        "n_group": groups, "topk_group": used_groups, "moe_layer_freq": 1,
        "scoring_func": "sigmoid" if sigmoid else "softmax",
        "topk_method": "noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy"),
    })
    return out


def _rope_scaling(g: GgufModel) -> dict[str, Any] | None:
    kind = g.arch_value("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise GgufError(f"{g.files[0]}: rope scaling {kind!r} is not supported for {g.architecture} (yarn is)")
    # stored as a float32: 0.1 x 0.707 reads back 0.0706999972..., which is 0.707 again at six decimals
    mscale = round(float(g.arch_value("rope.scaling.yarn_log_multiplier") or 0.0) / 0.1, 6)
    return {"type": "yarn", "rope_type": "yarn", "factor": float(_required(g, "rope.scaling.factor")),
            "original_max_position_embeddings": int(_required(g, "rope.scaling.original_context_length")),
            "beta_fast": float(g.arch_value("rope.scaling.yarn_beta_fast") or 32.0),
            "beta_slow": float(g.arch_value("rope.scaling.yarn_beta_slow") or 1.0),
            "mscale": mscale, "mscale_all_dim": mscale}


def _float_dtype(g: GgufModel) -> str:
    """The model dtype ``"auto"`` means: the float type most of the file's float matrices have (float32 where the
    matrices are all quantised: llama.cpp's activations are float32)."""
    counts = {"F32": 0, "F16": 0, "BF16": 0}
    for t in g.tensors.values():
        if len(t.shape) >= 2 and t.type_name in counts:
            counts[t.type_name] += 1
    best = max(counts, key=lambda k: (counts[k], k == "F32"))
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[best] if counts[best] else "float32"


# the model's product parameters each llama.cpp kind fills (``{i}``: the layer)
PRODUCT_PARAMS = {
    "attn_q": "model.layers.{i}.self_attn.q_proj.weight", "attn_q_a": "model.layers.{i}.self_attn.q_a_proj.weight",
    "attn_q_b": "model.layers.{i}.self_attn.q_b_proj.weight",
    "attn_kv_a_mqa": "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",
    "attn_output": "model.layers.{i}.self_attn.o_proj.weight",
    "ffn_gate": "model.layers.{i}.mlp.gate_up_proj", "ffn_up": "model.layers.{i}.mlp.gate_up_proj",
    "ffn_down": "model.layers.{i}.mlp.down_proj",
    "ffn_gate_shexp": "model.layers.{i}.mlp.shared_experts.gate_up_proj",
    "ffn_up_shexp": "model.layers.{i}.mlp.shared_experts.gate_up_proj",
    "ffn_down_shexp": "model.layers.{i}.mlp.shared_experts.down_proj",
    "ffn_gate_exps": "model.layers.{i}.mlp.experts.gate_up_proj",
    "ffn_up_exps": "model.layers.{i}.mlp.experts.gate_up_proj",
    "ffn_down_exps": "model.layers.{i}.mlp.experts.down_proj",
}


# the tensors outside the blocks that load as stored: the head, and an untied embedding (``layers.embedding``)
TOP_STORED = {"output.weight": "lm_head", "token_embd.weight": "model.embed_tokens.weight"}


R8_BYTES = 148  # a repacked Q4_K row's bytes a super-block: 144, its 12 bytes of 6-bit scales as 16 (GgufWeight)


def repacks(type_name: str, rows: int) -> bool:
    """Whether the compiled CPU kernels hold a product's part of ``rows`` rows in ``type_name`` repacked
    (``GgufWeight.repack``, Q4_K_R8): Q4_K in whole groups of eight rows. The one rule the load and the planner
    share."""
    return type_name == "Q4_K" and rows % 8 == 0

RUN = 32  # values of a run: one scale and one offset (gguf_weight.run_scales, layers.factor_runs)
RUN_BLOCKS = ("Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1")  # 32-value blocks: a float16 scale (and minimum) each
RUN_SUPERS = ("Q4_K", "Q5_K")  # super-blocks of eight 32-value sub-blocks: d sc and -dmin m each


def factor_runs(g: GgufModel, layers: int) -> bool:
    """Whether every layer splits ``kv_b_proj`` into ``attn_k_b`` and ``attn_v_b`` in types of 32-value runs along
    whole runs (``layers.factor_runs``: the compiled decode then reads the absorbed factors as runs); the planner
    counts them so."""
    for i in range(layers):
        k_b, v_b = g.tensors.get(f"blk.{i}.attn_k_b.weight"), g.tensors.get(f"blk.{i}.attn_v_b.weight")
        if k_b is None or v_b is None or not {k_b.type_name, v_b.type_name} <= set(RUN_BLOCKS + RUN_SUPERS):
            return False
        if k_b.shape[-1] % RUN or v_b.shape[-1] % RUN:
            return False
    return layers > 0


def stored_bits(g: GgufModel, repacked: bool = False) -> dict[str, float]:
    """The bits per weight of each product parameter (and untied embedding) the file stores quantised: its tensors'
    bytes over their values (a float tensor stacked with a quantised one stays in its type too); one stored in float
    types alone is left out, as it loads in the model's format. (On more than one rank the embedding loads widened:
    ``footprint.weight_footprint`` leaves it out there.) ``repacked``: as the compiled CPU kernels hold them, a Q4_K
    product of whole groups of eight rows in 148 bytes a super-block (``GgufWeight.repack``; not the embedding)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    sizes: dict[str, list[int]] = {}
    quantised: set[str] = set()
    for name, t in g.tensors.items():
        m = _BLOCK_RE.match(name)
        template = TOP_STORED.get(name) if name in TOP_STORED else PRODUCT_PARAMS.get(m[2]) if m else None
        if name == "token_embd.weight" and "output.weight" not in g.tensors:
            continue  # a tied table is the head's weight too, and loads in the model's format
        if template is None or t.type_name not in SUPPORTED_TYPES:
            continue
        param = template.format(i=m[1] if m else "")
        if t.type_name not in FLOAT_TYPES:
            quantised.add(param)
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[t.type_name]]
        if repacked and len(t.shape) > 1 and repacks(t.type_name, t.shape[-2]) \
                and name != "token_embd.weight":  # an embedding is looked up, not repacked
            size = R8_BYTES
        values = 1
        for d in t.shape:
            values *= d
        total = sizes.setdefault(param, [0, 0])
        total[0] += values // block * size
        total[1] += values
    return {p: 8 * b / n for p, (b, n) in sizes.items() if p in quantised and n}


# -- names ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """Where a Hugging Face tensor comes from: one GGUF tensor (``expert``: its slice along the first dimension), or
    for a split ``kv_b_proj`` the two tensors ``attn_k_b`` and ``attn_v_b``."""

    tensors: tuple[str, ...]
    expert: int | None = None


def hf_names(g: GgufModel) -> dict[str, Source]:
    """Every Hugging Face tensor name the GGUF model holds -> its source (module docstring); tensors of layers past
    ``block_count`` (multi-token prediction) are left out."""
    layers = int(g.arch_value("block_count") or 0)
    out: dict[str, Source] = {}
    split: dict[int, set[str]] = {}
    for name, t in g.tensors.items():
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = Source((name,))
            continue
        if name in ROPE_FACTORS:  # read into the config
            continue
        m = _BLOCK_RE.match(name)
        if m is None:
            out[name] = Source((name,))  # unknown: the loader reports it as unexpected
            continue
        i, kind, suffix = int(m[1]), m[2], m[3]
        p = f"model.layers.{i}"
        if i >= layers:
            continue
        if kind in EXPERT_NAMES:
            for e in range(t.shape[0]):
                out[f"{p}.mlp.experts.{e}.{EXPERT_NAMES[kind]}.weight"] = Source((name,), e)
        elif kind == "exp_probs_b":
            out[f"{p}.mlp.gate.e_score_correction_bias"] = Source((name,))
        elif kind in SPLIT_KV_B:
            split.setdefault(i, set()).add(kind)
        elif kind in BLOCK_NAMES:
            out[f"{p}.{BLOCK_NAMES[kind]}.{suffix}"] = Source((name,))
        else:
            out[name] = Source((name,))
    for i, kinds in split.items():
        kv_b = f"model.layers.{i}.self_attn.kv_b_proj.weight"
        if kv_b not in out:  # a file with both keeps attn_kv_b
            if kinds != set(SPLIT_KV_B):
                raise GgufError(f"{g.files[0]}: layer {i} has {sorted(kinds)} without its partner and no attn_kv_b")
            out[kv_b] = Source(tuple(f"blk.{i}.{k}.weight" for k in SPLIT_KV_B))
    return out


def check_types(g: GgufModel, names: dict[str, Source]) -> None:
    """Refuse, before any weight is read, a tensor of a type the runtime does not load (``SUPPORTED_TYPES``)."""
    for source in names.values():
        for name in source.tensors:
            t = g.tensors[name]
            if t.type_name not in SUPPORTED_TYPES:
                raise GgufError(f"{g.files[0]}: tensor {name} is {t.type_name}, a type the runtime does not load "
                                f"(these do: {', '.join(SUPPORTED_TYPES)}); requantise it with llama-quantize")


# -- tokenizer -------------------------------------------------------------------------------------------------
def load_gguf_tokenizer(path: str | Path) -> Any | None:
    """The tokenizer of the GGUF model at ``path`` (module docstring), or None where the file has no vocabulary."""
    g = open_gguf(path)
    tokens = g.value("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    from transformers import PreTrainedTokenizerFast

    kind = g.value("tokenizer.ggml.model")
    if kind != "gpt2":  # a SentencePiece vocabulary (MiniCPM3's "llama"...): transformers' own GGUF tokenizer
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(g.files[0].parent), gguf_file=g.files[0].name,
                                                           local_files_only=True)
        except (ValueError, KeyError, OSError) as e:
            raise GgufError(f"{g.files[0]}: its tokenizer (tokenizer.ggml.model {kind!r}) could not be built: "
                            f"{e}") from e

    backend = _byte_level_bpe(g, tokens)
    named = {}
    for role in ("bos", "eos", "padding", "unknown"):
        index = g.value(f"tokenizer.ggml.{role}_token_id")
        if index is not None and 0 <= int(index) < len(tokens):
            named[{"padding": "pad", "unknown": "unk"}.get(role, role) + "_token"] = tokens[int(index)]
    template = g.value("tokenizer.chat_template")
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **named)


def _byte_level_bpe(g: GgufModel, tokens: list[str]) -> Any:
    """The ``tokenizers`` BPE of the vocabulary and merges: the tokens the file marks as control (3) special and
    user-defined (4) added, both matched whole; BOS (EOS) prepended (appended) where the file asks for it."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in g.value("tokenizer.ggml.merges") or []]
    # a merge whose parts or result are not tokens never yields a token (llama.cpp falls back to the bytes): the BPE
    # model cannot hold one, so it is left out
    merges = [m for m in merges if len(m) == 2 and m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    splits = PRE_TOKENIZER_SPLITS.get(str(g.value("tokenizer.ggml.pre")))
    if splits is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:  # GPT-2's splits
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    types = g.value("tokenizer.ggml.token_type") or []
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == 3])
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t, kind in zip(tokens, types) if kind == 4])
    ends = []
    for role, add in (("bos", "tokenizer.ggml.add_bos_token"), ("eos", "tokenizer.ggml.add_eos_token")):
        index = g.value(f"tokenizer.ggml.{role}_token_id")
        if g.value(add) and index is not None:
            ends.append((role, tokens[int(index)], int(index)))
    if ends:
        single = " ".join([f"{t}:0" for r, t, _ in ends if r == "bos"] + ["$A:0"]
                          + [f"{t}:0" for r, t, _ in ends if r == "eos"])
        tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=[
            (t, i) for _, t, i in ends])
    return tokenizer
