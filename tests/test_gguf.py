"""GGUF files (llama.cpp's format), written at test time from tiny transformers models with the ``gguf`` package: the
config and tokenizer read back, every weight as the package dequantises it, greedy tokens equal to transformers on
the dequantised weights, split files, and the refusals (unsupported types, a missing or non-GGUF file)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mla_kernels import cpu_kernels, cpu_tables
from mla_runtime import LLM, SamplingParams
from mla_runtime.config import ModelConfig
from mla_runtime.gguf_meta import BLOCK_NAMES, GgufError, open_gguf
from mla_runtime.gguf_reader import STORED_Q4_0, GgufTensors
from mla_runtime.hub import ModelNotFoundError, resolve_model
from mla_runtime.layers.gguf_weight import KERNEL_TYPES, TORCH_BLOCKS, GgufWeight, dequantize_rows, int4_from_q4_0
from mla_runtime.layers.int4 import Int4Weight
from mla_runtime.layers.quantization import quantized_weights
from mla_runtime.loader import load_model
from mla_runtime.tokenizer import load_tokenizer
from tests.checkpoints import YARN, _randomise, _v2_config, _v3_config
from tests.gguf_files import (
    OWN_QUANTISERS,
    TypePick,
    dequantized,
    kquant_bytes,
    products_in,
    q8_rounded,
    reference_model,
    write_gguf,
)
from tests.layer_kernel import decode_in_layer_kernel

# llama.cpp stores only YaRN's mscale_all_dim for this architecture and applies no magnitude of its own to the rotary
# tables: a GGUF stands for DeepSeek's configs, whose mscale equals it
YARN_GGUF = {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 2, 7, 11, 3], list(range(3, 40))]


SHORT_FACTOR = [1.0 + 0.125 * i for i in range(8)]  # float32 values, as the file stores them


def tiny(family: str, seed: int = 0, **overrides):
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, MiniCPM3Config, MiniCPM3ForCausalLM

    torch.manual_seed(seed)
    if family == "minicpm3":  # the µP scales llama.cpp fixes for the architecture; LongRoPE within its length
        kw: dict = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512, kv_lora_rank=64,
                        q_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, scale_emb=12,
                        scale_depth=1.4, dim_model_base=256, tie_word_embeddings=True, bos_token_id=0,
                        eos_token_id=None, pad_token_id=None,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT_FACTOR,
                                         "long_factor": [4.0] * 8, "factor": 1.0,
                                         "original_max_position_embeddings": 512})
        model = MiniCPM3ForCausalLM(MiniCPM3Config(**{**kw, **overrides}))
        _randomise(model, seed + 1)
        return model.eval()
    overrides.setdefault("rope_parameters", YARN_GGUF)
    if family == "v3":
        model = DeepseekV3ForCausalLM(_v3_config(**overrides))
    else:
        model = DeepseekV2ForCausalLM(_v2_config(**overrides))
    _randomise(model, seed + 1)
    return model.eval()


def by_kind(types: dict[str, str], default: str = "F32") -> TypePick:
    """Each tensor the type ``types`` gives its llama.cpp kind (``attn_q_a``, ``token_embd``...), where its rows are
    whole blocks of it; else ``default``, and F32 for vectors."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def pick(name: str, shape: tuple[int, ...]) -> str:
        parts = name.split(".")
        kind = parts[2] if parts[0] == "blk" else parts[0]
        chosen = types.get(kind, default)
        block = GGML_QUANT_SIZES[GGMLQuantizationType[chosen]][0]
        return chosen if len(shape) >= 2 and shape[-1] % block == 0 else "F32"
    return pick


MIXED = {"token_embd": "Q6_K", "output": "Q6_K", "attn_q_a": "Q4_K", "attn_kv_a_mqa": "Q5_K",
         "ffn_gate_exps": "Q2_K", "ffn_up_exps": "Q3_K", "ffn_down_exps": "Q4_0", "ffn_gate": "Q5_0", "ffn_up": "Q4_1",
         "ffn_gate_shexp": "Q5_1", "ffn_up_shexp": "F16", "ffn_gate_inp": "F32"}

# name -> (model, the type of each tensor, kv_b_proj split into attn_k_b / attn_v_b)
CASES = {
    "v2_f32": (lambda: tiny("v2"), products_in("F32"), False),
    "v3_f16_split_kv_b": (lambda: tiny("v3"), products_in("F16"), True),
    "v2_q8_0_split_kv_b": (lambda: tiny("v2", topk_method="greedy", n_group=1, topk_group=1, q_lora_rank=64,
                                        v_head_dim=24), products_in("Q8_0"), True),
    "v3_q4_0_tied": (lambda: tiny("v3", q_lora_rank=None, tie_word_embeddings=True), products_in("Q4_0"), False),
    "v3_mixed_kquants": (lambda: tiny("v3", hidden_size=256, q_lora_rank=64), by_kind(MIXED, "Q8_0"), True),
    "minicpm3_q8_0": (lambda: tiny("minicpm3"), products_in("Q8_0"), False),
    # Q4_K_M's absorbed factors (attn_k_b Q5_0, attn_v_b Q4_K), wide enough for whole runs: decoded as runs
    "v2_runs_kv_b": (lambda: tiny("v2", qk_nope_head_dim=32, kv_lora_rank=256, v_head_dim=32),
                     by_kind({"attn_k_b": "Q5_0", "attn_v_b": "Q4_K"}, "Q8_0"), True),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Each case written once: (transformers model, GGUF path, stored tensors)."""
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            make, pick, split = CASES[case]
            model = make()
            path, stored = write_gguf(model, tmp_path_factory.mktemp(case) / "model.gguf", pick, split)
            cache[case] = (model, path, stored)
        return cache[case]
    return get


def test_the_name_table_is_the_gguf_packages():
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, 4)
    for kind, hf in BLOCK_NAMES.items():
        assert names.get_name(f"model.layers.2.{hf}.weight", try_suffixes=(".weight",)) == f"blk.2.{kind}.weight"


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_config_reads_back(written, case):
    model, path, _ = written(case)
    source = ModelConfig.from_dict(model.config.to_dict())
    got = ModelConfig.from_pretrained(path)
    for field in ("family", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "max_position_embeddings", "tie_word_embeddings", "moe", "rope"):
        assert getattr(got, field) == getattr(source, field), field
    assert got.rms_norm_eps == pytest.approx(source.rms_norm_eps)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_tensor_is_what_the_package_dequantises(written, case):
    """Each Hugging Face tensor read from the file equals the reference model's (the ``gguf`` package's
    dequantisation); each product matrix kept as stored dequantises to it too."""
    model, path, stored = written(case)
    ref = reference_model(model, stored).state_dict()
    reader = GgufTensors(open_gguf(path))
    for name in reader.files:
        if ".mlp.experts." in name and name.split(".")[5].isdigit():
            e, w = int(name.split(".")[5]), name.split(".")[6]
            layer = name.split(".")[2]
            key = f"model.layers.{layer}.mlp.experts.{'down_proj' if w == 'down_proj' else 'gate_up_proj'}"
            half = ref[key].shape[1] // 2
            want = ref[key][e] if w == "down_proj" else ref[key][e][:half] if w == "gate_proj" else ref[key][e][half:]
        else:
            want = ref[name]
        assert torch.equal(reader.get(name).float(), want.float()), name
        kind = reader.stored_kind([name])
        if kind is not None and want.dim() == 2 and "kv_b_proj" not in name:  # kv_b_proj loads widened
            matrix = reader.matrix(name, None, torch.float32, torch.device("cpu"), kind)
            assert isinstance(matrix, Int4Weight if kind == STORED_Q4_0 else GgufWeight)
            assert torch.equal(matrix.dequantize(), want.float()), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_transformers_on_the_dequantised_weights(written, case):
    model, path, stored = written(case)
    ref = reference_model(model, stored)
    want = [ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
            for p in PROMPTS]
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    assert got == want


@pytest.mark.parametrize("case", ["v3_mixed_kquants", "v2_q8_0_split_kv_b"])
def test_the_widened_products_under_cpu_gemm_plain_give_transformers_tokens(written, case):
    """Under ``cpu_gemm=plain`` no compiled kernel reads the blocks: every product widens the stored weight (Q4_K kept
    as stored, not repacked), and the greedy tokens still equal transformers' on the dequantised weights, batched."""
    model, path, stored = written(case)
    ref = reference_model(model, stored)
    want = [ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
            for p in PROMPTS]
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB", cpu_gemm="plain")
    weights = [w for w in quantized_weights(llm.engine.worker.model) if isinstance(w, GgufWeight)]
    assert weights and not any("Q4_K_R8" in w.types for w in weights)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    assert got == want


def test_stored_types_load_as_stored(written):
    """Q4_0 matrices become int4 ones (the bytes moved), the other block types stay in them (Q4_K repacked eight rows
    at a time where the compiled kernels read it); a matrix stacked from tensors of two types (an expert's gate Q2_K
    and up Q3_K) keeps both."""
    _, path, _ = written("v3_mixed_kquants")
    model = load_model(path, dtype="float32")
    weights = quantized_weights(model)
    types = {t for w in weights if isinstance(w, GgufWeight) for t in w.types}
    q4_k = "Q4_K_R8" if all(w.kernel for w in weights if isinstance(w, GgufWeight)) else "Q4_K"
    assert {"Q2_K", "Q3_K", q4_k, "Q5_K", "Q6_K", "Q4_1", "Q5_0", "Q5_1", "Q8_0"} <= types
    assert any(isinstance(w, GgufWeight) and w.types == ["Q2_K", "Q3_K"] for w in weights)
    assert any(isinstance(w, Int4Weight) for w in weights)
    embedding = model.model.embed_tokens
    assert isinstance(embedding.stored, GgufWeight) and embedding.stored.types == ["Q6_K"]  # not widened at load
    assert embedding.weight.untyped_storage().nbytes() <= 4  # the float table is a released stand-in
    ids = torch.tensor([[5, 0, 5], [model.config.vocab_size - 1, 17, 2]])
    assert torch.equal(embedding(ids), embedding.stored.dequantize()[ids])


def test_an_embedding_looks_up_the_rows_of_any_stored_format():
    """A lookup widens the rows it reads to the values the whole matrix widened holds: a GGUF matrix of two parts of
    different types, and a Q4_0 matrix moved into the int4 format; repeated and unordered ids."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    torch.manual_seed(4)
    w = torch.randn(40, 256) * 0.1
    parts = [_stored_rows("Q8_0", 24, 256, 5), _stored_rows("Q4_K", 16, 256, 6)]
    if cpu_kernels.failure("ggml") is None:  # Q4_K repacked for the kernels: its rows turned back into Q4_K's
        parts.append(("Q4_K_R8", cpu_kernels.ggml_repack(_stored_rows("Q4_K", 16, 256, 7)[1], 256)))
    q4_0 = int4_from_q4_0(torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q4_0)), 256, torch.float32)
    ids = torch.tensor([39, 3, 24, 3, 23, 0] + ([50, 41, 55] if len(parts) == 3 else []))
    for matrix in (GgufWeight(parts, 256, torch.float32), q4_0):
        ids = ids % matrix.shape[0]
        assert torch.equal(matrix.gather_rows(ids), matrix.dequantize()[ids])
        assert matrix.gather_rows(ids[:0]).shape == (0, 256)  # an empty step looks nothing up


def test_q4_0_is_the_int4_format(written):
    """A Q4_0 matrix moved into the int4 format holds the bytes ``quantization="int4"`` makes from the same float32
    matrix (both are ggml's Q4_0 rule)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    torch.manual_seed(3)
    w = torch.randn(24, 96) * 0.1
    stored = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q4_0))
    moved = int4_from_q4_0(stored, 96, torch.float32)
    ours = Int4Weight.quantize(w)
    assert torch.equal(moved.packed, ours.packed) and torch.equal(moved.scales, ours.scales)
    assert torch.equal(moved.dequantize(), dequantized("Q4_0", stored.numpy()))


@pytest.mark.parametrize("type_name, tolerance", [("Q6_K", 0.03), ("Q4_K", 0.12)])
def test_the_test_k_quantisers_follow_the_block_layout(type_name, tolerance):
    """The tests' Q4_K / Q6_K quantisers, read back by the ``gguf`` package's dequantiser, give the float values to
    within their rounding (a byte out of place would give noise as large as the values)."""
    x = (np.random.default_rng(0).standard_normal((6, 512)) * 0.08).astype(np.float32)
    x[0, :256] = 0.0  # an all-zero super-block
    data = OWN_QUANTISERS[type_name](x)
    assert data.shape == (6, 512 // 256 * {"Q6_K": 210, "Q4_K": 144}[type_name])
    back = dequantized(type_name, data).numpy().reshape(x.shape)
    assert np.all(back[0, :256] == 0)
    assert np.sqrt(np.mean((back - x) ** 2)) < tolerance * np.sqrt(np.mean(x ** 2))


@pytest.mark.parametrize("type_name", sorted(TORCH_BLOCKS))
def test_the_torch_dequantisers_equal_the_packages(type_name):
    """The torch dequantisers give the ``gguf`` package's values, on quantised weights and on
    random bytes (every bit of every field read where the package reads it)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    x = (np.random.default_rng(0).standard_normal((16, 512)) * 0.08).astype(np.float32)
    quantised = OWN_QUANTISERS[type_name](x) if type_name in OWN_QUANTISERS else \
        quantize(x, GGMLQuantizationType[type_name])
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    noise = np.random.default_rng(1).integers(0, 256, (16, 512 // block, size), dtype=np.uint8)
    for d in (0, 2) if type_name == "Q4_K" else (0,) if type_name == "Q8_0" else (208,):
        noise[..., d:d + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite scales
    for data in (quantised, noise.reshape(16, -1)):
        size_bytes, widen = TORCH_BLOCKS[type_name]
        got = widen(torch.from_numpy(np.ascontiguousarray(data)).reshape(-1, size_bytes)).reshape(16, 512)
        assert torch.equal(got, dequantized(type_name, data).reshape(16, 512))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1", "Q5_0", "F16"])
def test_a_gguf_weight_multiplies_as_its_dequantised_matrix(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    torch.manual_seed(0)
    w = torch.randn(40, 64)
    data = quantize(w.numpy(), GGMLQuantizationType[type_name])
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(40, -1))
    weight = GgufWeight([(type_name, raw[:16]), (type_name, raw[16:])], 64, torch.float32)
    full = dequantized(type_name, data)
    assert torch.equal(dequantize_rows(type_name, raw, 64), full)
    assert torch.equal(weight.dequantize(), full)
    x = torch.randn(3, 64)
    kernel = weight.kernel and type_name in KERNEL_TYPES  # the compiled kernel rounds the rows to int8 first
    torch.testing.assert_close(weight.matmul(x, None), (q8_rounded(x) if kernel else x) @ full.T)
    picked = weight.select_rows(torch.tensor([30, 2, 17]))
    assert torch.equal(picked.dequantize(), full[[30, 2, 17]])
    assert weight.nbytes == raw.numel()
    with pytest.raises(ValueError, match="uint8"):
        GgufWeight([(type_name, raw[:, :-2])], 64, torch.float32)


def _stored_rows(type_name: str, rows: int, k: int, seed: int) -> tuple[str, torch.Tensor]:
    """(type, uint8 rows) of a random ``[rows, k]`` matrix stored as ``type_name``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if type_name in OWN_QUANTISERS:
        return type_name, torch.from_numpy(OWN_QUANTISERS[type_name](w.numpy())).reshape(rows, -1)
    if type_name.endswith("_K"):  # valid blocks of random quants
        return type_name, torch.from_numpy(kquant_bytes(type_name, rows, k, seed))
    return type_name, torch.from_numpy(np.ascontiguousarray(quantize(w.numpy(), GGMLQuantizationType[type_name])))


@pytest.mark.skipif(cpu_kernels.failure("ggml") is not None, reason="the compiled GGUF kernels do not run here")
def test_the_one_row_mlp_kernel_reads_stored_blocks():
    """A MoE layer's experts in ggml block types, each gate_up stacked from two types, go into the compiled one-row
    MLP kernel's table as stored (no float copy) and give what their products give one by one."""
    d, inter = 256, 256
    types = [("Q4_K", "Q6_K", "Q5_0"), ("Q8_0", "Q8_0", "Q8_0"), ("Q2_K", "Q3_K", "Q5_K")]
    mlps = [(GgufWeight([_stored_rows(a, inter, d, 3 * e), _stored_rows(b, inter, d, 3 * e + 1)], d, torch.float32),
             GgufWeight([_stored_rows(c, d, inter, 3 * e + 2)], inter, torch.float32))
            for e, (a, b, c) in enumerate(types)]
    table = cpu_tables.GatedMLPTable([(g.row_operand(), w.row_operand()) for g, w in mlps])
    assert table.table.kinds() == ["ggml"] * 6
    x = torch.randn(1, d)

    def one(gate_up: GgufWeight, down: GgufWeight) -> torch.Tensor:
        gate, up = gate_up.matmul(x, None).chunk(2, dim=-1)
        return down.matmul(gate / (1 + torch.exp(-gate)) * up, None)
    # the kernel adds each expert's output with one rounding (a fused multiply-add): float32 rounding apart
    torch.testing.assert_close(table(x, [0, 2], [0.3, 0.7]), one(*mlps[0]) * 0.3 + one(*mlps[2]) * 0.7,
                               rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="ggml_parts: no kernel reads ggml type 2"):  # Q4_0: the int4 kernels'
        cpu_kernels.ggml_parts([mlps[0][0].parts[0][1]], [2], d)
    with pytest.raises(ValueError, match="must be CPU uint8 rows"):
        cpu_kernels.ggml_parts([mlps[0][0].parts[0][1][:, :-1]], [12], d)


@pytest.mark.skipif(cpu_kernels.failure("ggml") is not None, reason="the compiled GGUF kernels do not run here")
def test_decode_steps_run_the_whole_layer_kernel_on_stored_blocks(written, monkeypatch):
    """Every layer of a file of nine block types decodes in the compiled whole-layer kernel (one call a layer), and a
    batch's tokens are each prompt's tokens alone."""
    assert "ggml" in decode_in_layer_kernel(written("v3_mixed_kquants")[1], monkeypatch)


@pytest.mark.skipif(cpu_kernels.failure("ggml") is not None, reason="the compiled GGUF kernels do not run here")
def test_the_decode_reads_the_absorbed_factors_as_runs(written, monkeypatch):
    """A file whose attn_k_b and attn_v_b run in 32-value blocks (Q5_0, Q4_K) decodes on the factors as runs (uint8,
    1.25 bytes a value, the same values: the greedy test above holds for this case), in the whole-layer kernel, and a
    batch's tokens are each prompt's alone; a file whose factors are floats keeps float factors."""
    from mla_runtime.layers.mla import MLAttention

    def attentions(path):
        llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
        return [m for m in llm.engine.worker.model.modules() if isinstance(m, MLAttention)]
    runs = attentions(written("v2_runs_kv_b")[1])
    assert runs and all(a.factor_runs is not None and a.factor_runs.runs is not None for a in runs)
    uk, uv = runs[0].factor_runs.runs
    assert uk.dtype == torch.uint8 and uk.shape == (4, 32 + 8, 256) and uv.shape == (4, 256 + 64, 32)
    assert all(a.factor_runs is None for a in attentions(written("v3_f16_split_kv_b")[1]))
    decode_in_layer_kernel(written("v2_runs_kv_b")[1], monkeypatch)


def test_split_files_load_from_the_first_part_or_the_folder(written, tmp_path):
    model, single, _ = written("v2_f32")
    first, _ = write_gguf(model, tmp_path / "split.gguf", products_in("F32"), split_tensors=12)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) > 2 and first == parts[0]
    want = [o.outputs[0].token_ids for o in LLM(str(single), dtype="float32", kv_cache_memory="8MiB")
            .generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    for path in (first, tmp_path):
        got = [o.outputs[0].token_ids for o in LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
               .generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
        assert got == want
    with pytest.raises(GgufError, match="pass its first part"):
        ModelConfig.from_pretrained(parts[1])
    parts[-1].unlink()
    with pytest.raises(GgufError, match=f"missing {parts[-1].name}"):
        ModelConfig.from_pretrained(first)


def _train_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from mla_runtime.gguf_meta import DEEPSEEK_V3_SPLITS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in DEEPSEEK_V3_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["The quick brown fox jumps over the lazy dog. 12345 hello world!",
            "Multi-head latent attention caches one latent per token, 漢字 and かな too."] * 40
    tok.train_from_iterator(text, trainer)
    return tok


def test_the_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    source = _train_tokenizer()
    model = json.loads(source.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    # the last merge's parts are no tokens (as a converter's placeholder vocabulary writes): it is left out
    meta = {"tokens": tokens, "types": [3, 3] + [1] * (len(tokens) - 2), "bos": 0, "eos": 1,
            "merges": [" ".join(m) for m in model["merges"]] + ["<zq qz>"], "chat_template": template}
    path, _ = write_gguf(tiny("v3", vocab_size=len(tokens), bos_token_id=0, eos_token_id=1), tmp_path / "t.gguf",
                         tokenizer=meta)
    tokenizer = load_tokenizer(path)
    for text in ("The quick brown fox, 12345!", "latent attention 漢字かな", "  spaces\nand lines"):
        assert tokenizer.encode(text, add_special_tokens=False) == source.encode(text).ids
        assert tokenizer.decode(source.encode(text).ids) == text
    assert tokenizer.bos_token_id == 0 and tokenizer.eos_token_id == 1
    assert tokenizer.encode("hello") == [0, *source.encode("hello").ids]  # tokenizer.ggml.add_bos_token
    assert tokenizer.encode("<｜end▁of▁sentence｜>", add_special_tokens=False) == [1]  # a control token, whole
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True,
                                        add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
    assert tokenizer.decode(ids, skip_special_tokens=True).endswith("<user>hello<assistant>")
    out = LLM(str(path), dtype="float32", kv_cache_memory="8MiB").generate(["hello world"], PARAMS)[0]
    assert len(out.outputs[0].token_ids) == 8 and isinstance(out.outputs[0].text, str)


def _one_tensor_file(path: Path, type_name: str, arch: str = "deepseek2") -> Path:
    """A GGUF of the tiny V2 whose ``blk.1.attn_output`` is of ``type_name`` (random blocks), the rest F32."""
    def pick(name: str, shape: tuple[int, ...]) -> str:
        return type_name if name == "blk.1.attn_output.weight" else "F32"
    return write_gguf(tiny("v2"), path, pick, arch=arch)[0]


@pytest.mark.parametrize("type_name", ["IQ4_NL", "IQ2_XXS", "TQ2_0"])
def test_an_unsupported_type_is_refused_naming_the_tensor(tmp_path, type_name):
    path = _one_tensor_file(tmp_path / "m.gguf", type_name)
    with pytest.raises(GgufError, match=f"blk.1.attn_output.weight is {type_name}.*Q8_0"):
        load_model(path, dtype="float32")
    with pytest.raises(GgufError, match=f"blk.1.attn_output.weight is {type_name}"):
        LLM(str(path), dtype="float32", kv_cache_memory="8MiB")


def test_another_architecture_is_refused(tmp_path):
    path = _one_tensor_file(tmp_path / "m.gguf", "F32", arch="llama")
    with pytest.raises(GgufError, match="architecture 'llama' is not supported"):
        ModelConfig.from_pretrained(path)


def test_a_missing_or_foreign_file_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "absent.gguf"))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(GgufError, match="not a GGUF file"):
        LLM(str(fake), kv_cache_memory="8MiB")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"safetensors-ish bytes")
    with pytest.raises(ModelNotFoundError, match="not a .gguf file"):
        resolve_model(str(other))


@pytest.mark.parametrize("case", ["v3_mixed_kquants", "v2_runs_kv_b"])
def test_the_planner_counts_the_stored_blocks(written, case):
    """The planner's bytes of a GGUF model's products are the file's blocks: what the loaded model holds (with the
    absorbed factors as runs where the file's types allow them)."""
    from mla_runtime.footprint import weight_footprint
    from tests.test_plan import CPU, _resident_bytes

    _, path, _ = written(case)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.factor_runs == (case == "v2_runs_kv_b")
    planned = weight_footprint(cfg, "float32", cpu=CPU())
    loaded = load_model(path, dtype="float32")
    assert planned.format == "gguf (file blocks)"
    assert planned.quantized_bytes == sum(w.nbytes for w in quantized_weights(loaded))
    # kv_b_proj in one layout, the embedding as stored; the compiled kernels' parts tables (a few int64 a matrix) are
    # not counted
    tables = sum(w.operand.nbytes for w in quantized_weights(loaded)
                 if isinstance(w, GgufWeight) and w.operand is not None)
    assert planned.total + tables == _resident_bytes(loaded)
    float_products = weight_footprint(cfg.with_overrides(stored_bits=()), "float32")
    assert planned.total < float_products.total


def test_hash_and_verify_a_gguf_file(written, tmp_path):
    import shutil

    from mla_runtime import checksums

    _, source, _ = written("v2_f32")
    path = tmp_path / "model.gguf"
    shutil.copyfile(source, path)
    assert checksums.main([str(path)]) == 0
    assert (tmp_path / checksums.MANIFEST).read_text().endswith("  model.gguf\n")
    fingerprint = checksums.verify(path)
    assert checksums.manifest_fingerprint(path) == fingerprint
    with open(path, "r+b") as f:  # a flipped byte in the last tensor
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(checksums.WeightsMismatch, match="model.gguf does not match"):
        checksums.verify(path)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K"])
def test_two_ranks_read_their_slices_and_equal_one_rank(tmp_path, type_name):
    """Under tensor parallelism each rank loads its part of every matrix from the file: rows, or columns on block
    boundaries (o_proj, down_proj: 64 of 128 columns each), or columns that cut Q8_0's blocks (the shared expert's
    down_proj: 16 of 32 columns each) widened; Q4_K's rows (whole super-blocks of the hidden size) repacked by each
    rank where the kernels read them; the tokens are one rank's."""
    model = tiny("v2", intermediate_size=128, v_head_dim=32, n_shared_experts=1)
    path, _ = write_gguf(model, tmp_path / "m.gguf", products_in(type_name), split_kv_b=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = [o.outputs[0].token_ids for o in LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
            .generate(prompts, PARAMS)]
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    finally:
        llm.shutdown()
    assert got == want


def test_serve_takes_a_gguf_file(written):
    from mla_runtime.serving.config import resolve

    _, path, _ = written("v2_f32")
    engine, _ = resolve(["--model", str(path)], env={})
    assert engine.model == str(path)
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        resolve(["--model", str(path.with_name("absent.gguf"))], env={})


@pytest.mark.parametrize("case", ["v3_f16_split_kv_b", "v2_q8_0_split_kv_b"])
def test_dtype_auto_serves(written, case):
    """``dtype="auto"``: the file's float type (float16 here, float32 where every matrix is quantised), or what this
    CPU prefers for it."""
    _, path, _ = written(case)
    assert ModelConfig.from_pretrained(path).torch_dtype == ("float16" if "f16" in case else "float32")
    out = LLM(str(path), kv_cache_memory="8MiB").generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS)
    assert len(out[0].outputs[0].token_ids) == 8


DEMO = Path(__file__).resolve().parent.parent / "mla_runtime" / "demo_model"


def _demo_tokenizer_metadata() -> dict:
    """The demo model's tokenizer as llama.cpp's converter stores a byte-level BPE: tokens by id, merges as
    ``"a b"``, its added tokens marked control, the chat template."""
    spec = json.loads((DEMO / "tokenizer.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in spec["added_tokens"]})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {"tokens": tokens, "types": [3 if i in special else 1 for i in range(len(tokens))], "merges": merges,
            "bos": 0, "eos": 1, "pre": "gpt-2", "chat_template": (DEMO / "chat_template.jinja").read_text()}


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    out = tmp_path_factory.mktemp("demo") / "demo-BF16.gguf"
    return write_gguf(model, out, products_in("BF16", "F32"), split_kv_b=True, tokenizer=_demo_tokenizer_metadata())[0]


def test_the_demo_model_as_a_gguf_file_answers_as_its_checkpoint(demo_gguf):
    """The demo checkpoint written as llama.cpp would (bfloat16 matrices, its tokenizer and chat template in the
    metadata) tokenises, templates and answers exactly as the checkpoint folder does."""
    from mla_runtime.tokenizer import apply_chat_template

    want_tok, got_tok = load_tokenizer(DEMO), load_tokenizer(demo_gguf)
    for text in ("def fibonacci(n):\n    return n", "  indented\tand <|eos|> special", "ünïcödé 漢字 123456"):
        assert got_tok.encode(text) == want_tok.encode(text)
        ids = want_tok.encode(text)
        assert got_tok.decode(ids, skip_special_tokens=True) == want_tok.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "Write a loop."}]
    assert apply_chat_template(got_tok, chat) == apply_chat_template(want_tok, chat)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    want = LLM(str(DEMO), dtype="float32", kv_cache_memory="16MiB").generate(["def fibonacci(n):"], params)
    got = LLM(str(demo_gguf), dtype="float32", kv_cache_memory="16MiB").generate(["def fibonacci(n):"], params)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert got[0].outputs[0].text == want[0].outputs[0].text


def test_quantize_writes_a_gguf_file_in_our_formats(demo_gguf, written, tmp_path):
    """``mla-runtime quantize`` takes a GGUF file: its matrices (block types widened to float32 first) quantised as
    loading quantises them, the config and the tokenizer with its chat template from the metadata."""
    from mla_runtime.compressed import main as quantize_main
    from mla_runtime.layers.quantization import Int8Weight
    from mla_runtime.tokenizer import apply_chat_template

    out = tmp_path / "demo-int8"
    assert quantize_main(["--model", str(demo_gguf), "--quantization", "int8", "--out", str(out)]) == 0
    want_tok, got_tok = load_tokenizer(demo_gguf), load_tokenizer(out)
    chat = [{"role": "user", "content": "Write a loop."}]
    assert apply_chat_template(got_tok, chat) == apply_chat_template(want_tok, chat)
    assert got_tok.encode("def fibonacci(n):") == want_tok.encode("def fibonacci(n):")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = LLM(str(demo_gguf), dtype="float32", quantization="int8", kv_cache_memory="16MiB").generate(["f"], params)
    got = LLM(str(out), dtype="float32", kv_cache_memory="16MiB").generate(["f"], params)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    _, path, _ = written("v3_mixed_kquants")  # K-quant blocks: int8 of the values they stand for
    quantize_main(["--model", str(path), "--quantization", "int8", "--out", str(tmp_path / "kq")])
    stored, copy = load_model(path, dtype="float32"), load_model(tmp_path / "kq", dtype="float32")
    a = stored.model.layers[1].mlp.experts.gate_up_packed[0]  # an expert's gate Q2_K beside its up Q3_K
    b = copy.model.layers[1].mlp.experts.gate_up_packed[0]
    assert isinstance(a, GgufWeight) and a.types == ["Q2_K", "Q3_K"] and isinstance(b, Int8Weight)
    assert torch.equal(b.dequantize(), Int8Weight.quantize(a.dequantize()).dequantize())


@pytest.mark.parametrize("pre, pieces", [
    # DeepSeek-V2's splits run in turn: its ASCII-punctuation one (whose ":-~" takes in the Latin letters) cuts "mega"
    # from a run of letters it did not start
    ("deepseek-llm", ["Hello", ",", "Ġworld", "!", "Ċ", "12345", "Ġ", "æ¼¢åŃĹ", "ĠÎ©", "mega"]),
    ("deepseek-coder", ["Hello", ",", "Ġworld", "!", "Ċ", "1", "2", "3", "4", "5", "Ġ", "æ¼¢åŃĹ", "ĠÎ©mega"]),
    ("gpt-2", ["Hello", ",", "Ġworld", "!", "Ċ", "12345", "Ġæ¼¢åŃĹ", "ĠÎ©mega"]),
])
def test_the_pre_tokenizer_is_the_one_the_file_names(tmp_path, pre, pieces):
    """``tokenizer.ggml.pre`` picks the splits of DeepSeek-V2's (``deepseek-llm``) or DeepSeek-Coder's vocabulary,
    GPT-2's otherwise (``deepseek-v3``'s: the tokenizer test above)."""
    source = _train_tokenizer()
    model = json.loads(source.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    meta = {"tokens": tokens, "types": [3, 3] + [1] * (len(tokens) - 2), "bos": 0, "eos": 1, "pre": pre,
            "merges": [" ".join(m) for m in model["merges"]]}
    path, _ = write_gguf(tiny("v2", vocab_size=len(tokens)), tmp_path / "t.gguf", tokenizer=meta)
    split = load_tokenizer(path).backend_tokenizer.pre_tokenizer.pre_tokenize_str
    assert [w for w, _ in split("Hello, world!\n12345 漢字 Ωmega")] == pieces


def test_a_sentencepiece_vocabulary_takes_transformers_gguf_tokenizer(tmp_path):
    """MiniCPM3's files carry a SentencePiece vocabulary (``tokenizer.ggml.model`` ``llama``): pieces by score, byte
    fallback tokens, BOS added."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "llo", "▁hello", "▁w", "or", "▁world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces
    meta = {"model": "llama", "tokens": tokens, "types": [2, 3, 3] + [6] * 256 + [1] * len(pieces), "bos": 1,
            "eos": 2, "scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))]}
    path, _ = write_gguf(tiny("minicpm3", vocab_size=len(tokens)), tmp_path / "spm.gguf", tokenizer=meta)
    tokenizer = load_tokenizer(path)
    ids = tokenizer.encode("hello world")
    assert ids[0] == 1 and tokenizer.convert_ids_to_tokens(ids[1:2]) == ["▁h"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world"
    out = LLM(str(path), dtype="float32", kv_cache_memory="8MiB").generate(["hello world"], PARAMS)[0]
    assert len(out.outputs[0].token_ids) == 8


def test_bad_files_are_refused_by_name(written, tmp_path):
    """Two models in one folder, missing metadata, and metadata that does not match the tensors each get an error
    naming the problem."""
    import shutil

    import gguf

    from mla_runtime.gguf_meta import config_dict
    from mla_runtime.loader import CheckpointError, load_weights
    from mla_runtime.models.deepseek import DeepseekForCausalLM
    from mla_runtime.resolved_config import ResolvedConfig

    _, path, _ = written("v2_f32")
    folder = tmp_path / "two"
    folder.mkdir()
    shutil.copyfile(path, folder / "a.gguf")
    shutil.copyfile(path, folder / "b.gguf")
    with pytest.raises(GgufError, match="holds 2 GGUF models"):
        ModelConfig.from_pretrained(folder)
    bare = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "deepseek2")
    bare.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    bare.write_header_to_file()
    bare.write_kv_data_to_file()
    bare.write_tensors_to_file()
    bare.close()
    with pytest.raises(GgufError, match="metadata deepseek2.block_count is missing"):
        ModelConfig.from_pretrained(tmp_path / "bare.gguf")
    wrong, _ = write_gguf(tiny("v2", num_attention_heads=8), tmp_path / "wrong.gguf")  # tensors of 8 heads ...
    config = config_dict(wrong)
    config["num_attention_heads"] = 4  # ... read as 4: every attention tensor is named, with both shapes
    with torch.device("meta"):
        model = DeepseekForCausalLM(ResolvedConfig(ModelConfig.from_dict(config), torch.float32))
    with pytest.raises(CheckpointError, match=r"shape mismatch: model\.layers\.0\.self_attn\.q_proj\.weight: "
                                              r"checkpoint \[256, 64\], config expects \[128, 64\]"):
        load_weights(model, wrong, device=torch.device("cpu"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="releasing a map's pages (madvise) is Linux's")
def test_bytes_copied_out_of_the_map_leave_the_process(tmp_path):
    """``release_pages`` drops a view's pages of the file's private map from the process's resident memory (a q4_0
    file's matrices are copied into the int4 format, and would otherwise be resident twice), and the view still
    reads the file's bytes afterwards."""
    from mla_runtime.gguf_reader import release_pages

    path = tmp_path / "blob"
    want = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    want.tofile(path)
    view = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c")).reshape(1024, -1)
    before = _rss_file()
    assert int(view.sum()) == int(want.sum())  # every page read
    touched = _rss_file()
    release_pages(view[128:])  # all but the first eighth
    after = _rss_file()
    assert touched - before > 60 << 20 and touched - after > 50 << 20, (before, touched, after)
    assert torch.equal(view[100:200], torch.from_numpy(want.reshape(1024, -1)[100:200]))


def _rss_file() -> int:
    """The process's resident file-backed bytes (``RssFile``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(cpu_kernels.failure("ggml") is not None, reason="the compiled GGUF kernels do not run here")
def test_a_prompts_experts_run_as_compiled_calls_over_all_their_pairs(written, monkeypatch):
    """Routed experts all in ggml block types (here Q8_0): a prompt's MoE runs as compiled calls over many (token,
    expert) pairs at once (``Experts._in_one_call``, about ``PAIRS_PER_CALL`` each), and a batch's tokens are each
    prompt's alone (the greedy test above: transformers'). Experts partly in the int4 format (a Q4_0 down) run
    expert by expert."""
    from mla_runtime.layers.moe import PAIRS_PER_CALL, Experts

    calls: list[int] = []
    real = cpu_tables.GatedMLPTable.mlps_rows
    monkeypatch.setattr(cpu_tables.GatedMLPTable, "mlps_rows",
                        lambda self, x, ids, rows: calls.append(sum(map(len, rows))) or real(self, x, ids, rows))
    llm = LLM(str(written("v2_q8_0_split_kv_b")[1]), dtype="float32", kv_cache_memory="8MiB")
    prompts = [list(range(3, 100)), [5, 9, 2, 7, 11, 3], list(range(40, 77))]
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)]
    assert batched == [llm.generate([{"prompt_token_ids": p}], PARAMS)[0].outputs[0].token_ids for p in prompts]
    assert calls and max(calls) >= PAIRS_PER_CALL and max(calls) < 2 * PAIRS_PER_CALL
    def tables(case: str) -> list[cpu_tables.GatedMLPTable | None]:
        return [m.ggml_table() for m in load_model(written(case)[1], dtype="float32").modules()
                if isinstance(m, Experts)]
    assert all(t is not None for t in tables("v2_q8_0_split_kv_b"))
    assert tables("v3_mixed_kquants") and all(t is None for t in tables("v3_mixed_kquants"))
