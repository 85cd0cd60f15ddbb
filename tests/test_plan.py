"""The memory planner: bytes per token, parameter counts, capacity arithmetic, the CLI."""

import json

import pytest
import torch

from mla_runtime.config import PRESET_DIR, ModelConfig
from mla_runtime.plan import (
    ACTIVATION_OVERHEAD_BYTES,
    activation_reserve_bytes,
    default_max_num_batched_tokens,
    latent_bytes_per_token,
    main,
    mha_bytes_per_token,
    parameter_breakdown,
    parameter_count,
    parse_bytes,
    plan_memory,
    resolve_cache_dtype,
    weight_bytes,
)

V3 = ModelConfig.from_pretrained("deepseek-v3")
V2_LITE = ModelConfig.from_pretrained("deepseek-v2-lite")
TINY_V3 = ModelConfig.from_pretrained("tiny-deepseek-v3")


# -- cache dtypes and bytes per token ---------------------------------------------------------------
@pytest.mark.parametrize("name,dtype,quantized", [
    ("bf16", torch.bfloat16, False), ("bfloat16", torch.bfloat16, False), ("fp16", torch.float16, False),
    ("float32", torch.float32, False), ("fp8", torch.float8_e4m3fn, True),
    ("fp8_e4m3", torch.float8_e4m3fn, True), ("int8", torch.int8, True), ("auto", torch.float16, False),
])
def test_cache_dtype_names(name, dtype, quantized):
    cache = resolve_cache_dtype(name, torch.float16)
    assert (cache.dtype, cache.quantized) == (dtype, quantized)
    assert cache.scale_bytes == (8 if quantized else 0)


def test_bad_cache_dtype_names_the_field():
    with pytest.raises(ValueError, match="cache_dtype.*'fp4'"):
        resolve_cache_dtype("fp4", torch.bfloat16)


def test_deepseek_v3_bytes_per_token():
    assert latent_bytes_per_token(V3, "bf16") == 576 * 61 * 2 == 70_272
    assert latent_bytes_per_token(V3) == 70_272  # auto = the checkpoint's bfloat16
    assert latent_bytes_per_token(V3, "fp8") == (576 + 8) * 61
    assert latent_bytes_per_token(V3, "int8") == (576 + 8) * 61
    assert latent_bytes_per_token(V3, "auto", model_dtype="float32") == 576 * 61 * 4
    assert mha_bytes_per_token(V3, "bf16") == 128 * (192 + 128) * 61 * 2 == 4_997_120


def test_deepseek_v2_lite_bytes_per_token():
    assert (V2_LITE.d_c, V2_LITE.d_r, V2_LITE.num_hidden_layers) == (512, 64, 27)
    assert latent_bytes_per_token(V2_LITE, "bf16") == 576 * 27 * 2 == 31_104


# -- parameters ------------------------------------------------------------------------------------
def _hf_model(name: str) -> torch.nn.Module:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    raw = json.loads((PRESET_DIR / f"{name}.json").read_text())
    kwargs = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    if "v2" in name:
        return DeepseekV2ForCausalLM(DeepseekV2Config(**kwargs))
    return DeepseekV3ForCausalLM(DeepseekV3Config(**kwargs))


@pytest.mark.parametrize("name", ["tiny-deepseek-v2", "tiny-deepseek-v3"])
def test_parameter_count_matches_transformers(name):
    torch.manual_seed(0)
    model = _hf_model(name)
    # transformers keeps noaux_tc's e_score_correction_bias as a buffer; the checkpoint stores it.
    expected = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    cfg = ModelConfig.from_pretrained(name)
    assert parameter_count(cfg) == expected
    assert weight_bytes(cfg, "float32") == 4 * expected
    assert weight_bytes(cfg, "bf16") == 2 * expected


def test_tensor_parallel_shards_all_but_replicated_tensors():
    model = _hf_model("tiny-deepseek-v3")
    replicated = ("q_a_proj", "kv_a_proj_with_mqa", "norm", "mlp.gate.")  # norms incl. *_layernorm, router
    rep = sum(p.numel() for n, p in model.named_parameters() if any(r in n for r in replicated))
    rep += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    total = parameter_count(TINY_V3)
    assert parameter_count(TINY_V3, tensor_parallel_size=2) == rep + (total - rep) // 2
    assert parameter_count(TINY_V3, tensor_parallel_size=4) == rep + (total - rep) // 4


def test_published_model_sizes():
    assert parameter_count(V3) == 671_026_419_200  # 671B main model; the MTP layer is not counted
    assert weight_bytes(V3, "bfloat16") == 2 * 671_026_419_200
    assert parameter_count(V2_LITE) == pytest.approx(15.7e9, rel=0.01)
    assert parameter_count(ModelConfig.from_pretrained("deepseek-v2")) == pytest.approx(236e9, rel=0.01)
    assert parameter_count(ModelConfig.from_pretrained("kimi-k2")) == pytest.approx(1.03e12, rel=0.01)
    assert sum(parameter_breakdown(V3).values()) == parameter_count(V3)


# -- activations -------------------------------------------------------------------------------------
def test_activation_reserve_formula_tiny_v3():
    # d=64, 4 heads, d_n=d_r=16, d_v=24, d_c=32, I=128, I_e=32, k=2, 1 shared, 4 experts, vocab 256, fp32
    widest = max(4 * (2 * 32 + 2 * 24), 4 * (2 * 32 + 16), 3 * 128, 3 * (2 * 32 + 32) + 2 * 64)
    per_token = 4 * (2 * 64 + widest) + 8 * 4
    got = activation_reserve_bytes(TINY_V3, dtype="float32", max_num_batched_tokens=100, max_num_seqs=8)
    assert got == 100 * per_token + 2 * 4 * 8 * 256 + ACTIVATION_OVERHEAD_BYTES


def test_default_batched_tokens():
    assert default_max_num_batched_tokens(163_840, 256) == 8192
    assert default_max_num_batched_tokens(1024, 8) == 2048  # a burst of short prompts: 2,048 per step
    assert default_max_num_batched_tokens(128, 8) == 1024  # never more than can be in flight
    assert default_max_num_batched_tokens(16, 4096) == 4096  # one token for every sequence


# -- capacity ----------------------------------------------------------------------------------------
def _tiny_plan(extra_blocks: int, **kw):
    """A plan whose device memory holds the weights, the reserve and exactly ``extra_blocks`` blocks + 99 B."""
    args = dict(dtype="float32", max_seq_len=256, max_num_seqs=4, block_size=16, memory_utilization=1.0)
    args.update(kw)
    tp = args.get("tensor_parallel_size", 1)
    weights = weight_bytes(TINY_V3, "float32", tp)
    acts = activation_reserve_bytes(TINY_V3, dtype="float32", max_num_seqs=args["max_num_seqs"],
                                    max_num_batched_tokens=default_max_num_batched_tokens(256, args["max_num_seqs"]),
                                    tensor_parallel_size=tp)
    block = latent_bytes_per_token(TINY_V3, args.get("cache_dtype", "auto"), "float32") * args["block_size"]
    return plan_memory(TINY_V3, device_memory_bytes=weights + acts + extra_blocks * block + 99, **args)


def test_capacity_arithmetic():
    plan = _tiny_plan(40)
    assert plan.latent_bytes_per_token == (32 + 16) * 3 * 4
    assert plan.cache_budget_bytes == plan.usable_bytes - plan.weight_bytes - plan.activation_bytes
    assert plan.num_blocks == plan.cache_budget_bytes // (plan.latent_bytes_per_token * plan.block_size) == 40
    assert plan.max_tokens == 40 * 16
    assert plan.blocks_per_sequence == 256 // 16
    assert plan.max_sequences == 40 // 16 == 2
    assert not plan.fits  # 4 sequences of 256 tokens need 64 blocks
    assert _tiny_plan(64).fits
    assert plan.absorption_ratio == plan.mha_bytes_per_token / plan.latent_bytes_per_token
    assert plan.mha_bytes_per_token == 4 * (32 + 24) * 3 * 4


def test_capacity_with_quantised_cache_and_utilization():
    plan = plan_memory(TINY_V3, dtype="float32", cache_dtype="int8", device_memory_bytes=parse_bytes("1GiB"),
                       memory_utilization=0.5, max_seq_len=100, max_num_seqs=3, block_size=64)
    assert plan.usable_bytes == 2**29
    assert plan.latent_bytes_per_token == (48 + 8) * 3
    assert plan.num_blocks == plan.cache_budget_bytes // ((48 + 8) * 3 * 64)
    assert plan.max_sequences == plan.num_blocks // 2  # 100 tokens take 2 blocks of 64


def test_deepseek_v3_plan_numbers():
    plan = plan_memory(V3, dtype="bfloat16", device_memory_bytes=parse_bytes("141GiB"), max_seq_len=32768,
                       max_num_seqs=16, tensor_parallel_size=16)
    assert plan.latent_bytes_per_token == 70_272
    assert plan.mha_bytes_per_token == 4_997_120
    assert plan.absorption_ratio == pytest.approx(71.11, abs=0.01)
    assert plan.total_weight_bytes == 2 * 671_026_419_200
    assert plan.weight_bytes < plan.total_weight_bytes // 15
    assert plan.num_blocks == plan.cache_budget_bytes // (70_272 * 64)


def test_sharded_layout_divides_per_rank_bytes_by_tp():
    replicated = _tiny_plan(40, tensor_parallel_size=4)
    sharded = _tiny_plan(40, tensor_parallel_size=4, latent_cache_layout="sharded")
    assert replicated.cache_bytes_per_token_per_rank == replicated.latent_bytes_per_token
    assert sharded.cache_bytes_per_token_per_rank == sharded.latent_bytes_per_token / 4
    assert sharded.num_blocks == replicated.num_blocks == 40
    assert sharded.max_tokens == 4 * replicated.max_tokens
    assert sharded.max_sequences == 4 * 40 // 16
    v3 = plan_memory(V3, dtype="bf16", device_memory_bytes=parse_bytes("141GiB"), max_seq_len=4096,
                     max_num_seqs=8, tensor_parallel_size=16, latent_cache_layout="sharded")
    assert v3.cache_bytes_per_token_per_rank == 70_272 / 16 == 4392


def test_weights_too_big_says_by_how_much():
    usable = int(parse_bytes("80GiB") * 0.92)
    short = 2 * 671_026_419_200 - usable
    with pytest.raises(ValueError, match=rf"short by {short:,} B") as err:
        plan_memory(V3, dtype="bfloat16", device_memory_bytes=parse_bytes("80GiB"), max_seq_len=4096,
                    max_num_seqs=8)
    msg = str(err.value)
    assert "more device memory" in msg and "tensor_parallel_size >= 32" in msg and "dtype" in msg


def test_activations_too_big_names_batched_tokens():
    device = weight_bytes(TINY_V3, "float32") + ACTIVATION_OVERHEAD_BYTES
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        plan_memory(TINY_V3, dtype="float32", device_memory_bytes=device, memory_utilization=1.0,
                    max_seq_len=64, max_num_seqs=1)


@pytest.mark.parametrize("kw,field", [
    ({"memory_utilization": 1.5}, "memory_utilization"),
    ({"tensor_parallel_size": 3}, "tensor_parallel_size"),
    ({"latent_cache_layout": "striped"}, "latent_cache_layout"),
    ({"max_seq_len": 0}, "max_seq_len"),
    ({"block_size": 0}, "block_size"),
    ({"dtype": "fp8"}, "dtype"),
])
def test_bad_arguments_name_the_field(kw, field):
    args = dict(dtype="float32", device_memory_bytes=2**30, max_seq_len=64, max_num_seqs=1) | kw
    with pytest.raises(ValueError, match=field):
        plan_memory(TINY_V3, **args)


# -- parse_bytes and the CLI ---------------------------------------------------------------------------
@pytest.mark.parametrize("text,expected", [
    ("80GiB", 80 * 2**30), ("2GB", 2 * 10**9), ("512MiB", 512 * 2**20), ("1.5e9", 1_500_000_000),
    ("1.5GiB", 3 * 2**29), ("100", 100), (" 4 kib ", 4096), ("1.1GB", 1_100_000_000), (12345, 12345),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80 parsecs", "GiB", "", "-1GiB", "8G", "1e9e9"])
def test_parse_bytes_rejects_and_names_the_string(text):
    with pytest.raises(ValueError, match=repr(text).replace("'", ".")):
        parse_bytes(text)


def test_cli_report_deepseek_v3(capsys):
    rc = main(["--model", "deepseek-v3", "--max-seq-len", "32768", "--max-num-seqs", "16",
               "--device-memory", "141GiB", "--tensor-parallel-size", "16"])
    out = capsys.readouterr().out
    assert rc == 0
    latent_line = next(line for line in out.splitlines() if "latent cache per token" in line)
    assert "70,272" in latent_line
    assert "4,997,120" in out and "71.11x" in out and "FITS" in out
    assert f"{2 * 671_026_419_200:,}" in out


def test_cli_weights_too_big_still_reports_per_token_cost(capsys):
    rc = main(["--model", "deepseek-v3", "--max-seq-len", "4096", "--max-num-seqs", "8",
               "--device-memory", "80GiB", "--cache-dtype", "fp8"])
    captured = capsys.readouterr()
    assert rc == 2
    assert f"{(576 + 8) * 61:,}" in captured.out
    assert "do not fit" in captured.err and "tensor_parallel_size" in captured.err


@pytest.mark.parametrize("cache_dtype", ["auto", "bf16", "fp8", "int8"])
def test_planner_bytes_equal_what_the_cache_allocates(cache_dtype):
    from mla_runtime.cache.latent_cache import LatentCache

    cache = resolve_cache_dtype(cache_dtype, torch.float32)
    allocated = LatentCache(TINY_V3.num_hidden_layers, num_blocks=3, block_size=16,
                            latent_dim=TINY_V3.latent_dim, dtype=cache.dtype)
    assert allocated.bytes_per_token() == latent_bytes_per_token(TINY_V3, cache_dtype, "float32")
    assert allocated.nbytes() == 3 * 16 * latent_bytes_per_token(TINY_V3, cache_dtype, "float32")
