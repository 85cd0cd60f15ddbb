"""The memory planner: bytes per token, parameter counts, capacity arithmetic, the CLI."""

import json
import re

import pytest
import torch

from mla_runtime.config import PRESET_DIR, ModelConfig
from mla_runtime.options import parse_bytes
from mla_runtime.plan import (
    ACTIVATION_OVERHEAD_BYTES,
    activation_reserve_bytes,
    default_max_num_batched_tokens,
    latent_bytes_per_token,
    mha_bytes_per_token,
    parameter_breakdown,
    parameter_count,
    plan_memory,
    quantized_parameters,
    resolve_cache_dtype,
    weight_bytes,
)
from mla_runtime.plan_cli import main

V3 = ModelConfig.from_pretrained("deepseek-v3")  # the FP8 checkpoint: its products load as FP8 blocks
V3_BF16 = V3.with_overrides(fp8_block_size=None)  # the same model from a bfloat16 checkpoint
V2_LITE = ModelConfig.from_pretrained("deepseek-v2-lite")
TINY_V3 = ModelConfig.from_pretrained("tiny-deepseek-v3")


def _absorbed_elements(cfg: ModelConfig, tp: int = 1) -> int:
    """Values of the attention's absorbed-factor copies (w_uk, w_uv_t): as many as kv_b_proj, every layer."""
    heads = cfg.num_attention_heads // tp
    return cfg.num_hidden_layers * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank


def _router_elements(cfg: ModelConfig) -> int:
    """Values of the MoE routers and their correction biases (kept in float32)."""
    m = cfg.moe
    assert m is not None
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    bias = m.n_routed_experts if m.topk_method == "noaux_tc" else 0
    return moe_layers * (m.n_routed_experts * cfg.hidden_size + bias)


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
    # loaded: every parameter, the absorbed factors' copies, the routers in float32 (no device: no CPU copies)
    assert weight_bytes(cfg, "float32") == 4 * (expected + _absorbed_elements(cfg))
    assert weight_bytes(cfg, "bf16") == 2 * (expected + _absorbed_elements(cfg) + _router_elements(cfg))


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
    assert weight_bytes(V3_BF16, "bfloat16") == 2 * (671_026_419_200 + _absorbed_elements(V3) + _router_elements(V3))
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
    plan = plan_memory(V3_BF16, dtype="bfloat16", device_memory_bytes=parse_bytes("141GiB"), max_seq_len=32768,
                       max_num_seqs=16, tensor_parallel_size=16)
    assert plan.latent_bytes_per_token == 70_272
    assert plan.mha_bytes_per_token == 4_997_120
    assert plan.absorption_ratio == pytest.approx(71.11, abs=0.01)
    assert plan.total_weight_bytes == weight_bytes(V3_BF16, "bfloat16")
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
    short = weight_bytes(V3_BF16, "bfloat16") - usable
    with pytest.raises(ValueError, match=rf"short by {short:,} B") as err:
        plan_memory(V3_BF16, dtype="bfloat16", device_memory_bytes=parse_bytes("80GiB"), max_seq_len=4096,
                    max_num_seqs=8)
    msg = str(err.value)
    assert "more device memory" in msg and "tensor_parallel_size >= 32" in msg
    assert 'quantization="int8" with tensor_parallel_size >= 16' in msg  # half the bytes: half the ranks
    assert 'quantization="int4" with tensor_parallel_size >= 8' in msg
    with pytest.raises(ValueError, match=r"dtype='bfloat16' halves"):
        plan_memory(V3_BF16, dtype="float32", device_memory_bytes=parse_bytes("80GiB"), max_seq_len=4096,
                    max_num_seqs=8)


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
    assert "weights fp8 (checkpoint blocks)" in out  # the preset is DeepSeek-V3's FP8 checkpoint
    assert f"(total {weight_bytes(V3, 'bfloat16'):,} B)" in out


def test_cli_says_what_to_change_when_the_sequences_do_not_fit(capsys):
    """With no sequence flags the planner asks for 256 sequences of the whole context, which a DeepSeek-V3 node does
    not hold: the report then names the settings that fit, and each of them, followed, fits."""
    base = ["--model", "deepseek-v3", "--device-memory", "141GiB", "--tensor-parallel-size", "8"]
    assert main(base) == 1
    hint = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("to fit:"))
    seqs = re.search(r"--max-num-seqs ([\d,]+)", hint).group(1).replace(",", "")
    length = re.search(r"--max-seq-len ([\d,]+)", hint).group(1).replace(",", "")
    assert int(seqs) >= 1 and int(length) >= 64
    assert main([*base, "--max-num-seqs", seqs]) == 0
    assert main([*base, "--max-seq-len", length]) == 0


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


# -- weights as loaded: the planner's bytes against what a loaded model holds --------------------------------
def _resident_bytes(model: torch.nn.Module) -> int:
    """Bytes a loaded model's tensors hold: every tensor its modules keep (parameters, buffers, absorbed copies or
    runs, packed layouts, quantised matrices and their scales), each storage once. Left out: RoPE buffers, the
    1-element stand-ins of released weights and the routers' settings for the compiled MoE call (``route``: a
    few integers, made with the layers' compiled tables when the weights are prepared): the planner does not count
    them. oneDNN's blocked copies are opaque
    tensors: counted at their logical size (numel x element size; any padding of the blocked layout is not
    visible). A storage the runtime did not allocate (a mapped checkpoint file, whose matrices run as stored)
    counts the bytes its views cover: the pages nothing reads never become resident."""
    from mla_runtime.layers.cpu_gemm import PackedWeight
    from mla_runtime.layers.factor_runs import FactorRuns
    from mla_runtime.layers.rotary import RotaryEmbedding

    found: dict[object, int] = {}
    mapped: dict[int, set[tuple[int, int]]] = {}  # a mapped file's storage -> the byte ranges its views cover

    def visit(value: object) -> None:
        if isinstance(value, torch.Tensor):
            if value.layout == torch._mkldnn:  # an opaque oneDNN tensor (no storage to read)
                found[("opaque", id(value))] = value.numel() * value.element_size()
            elif not value.is_meta and value.numel() and not (value.dim() and 0 in value.stride()):  # not released
                storage = value.untyped_storage()
                if storage.resizable():
                    found[storage.data_ptr()] = max(found.get(storage.data_ptr(), 0), storage.nbytes())
                else:
                    start = value.data_ptr()
                    mapped.setdefault(storage.data_ptr(), set()).add((start, start + value.nbytes))
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, FactorRuns):  # a GGUF file's absorbed factors as runs
            visit(vars(value))
        elif isinstance(value, PackedWeight):
            for cls in type(value).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    visit(getattr(value, slot, None))

    for module in model.modules():
        if not isinstance(module, RotaryEmbedding):
            visit({k: v for k, v in vars(module).items() if k not in ("_modules", "route")})
    for ranges in mapped.values():
        end = 0
        for a, b in sorted(ranges):
            found[("mapped", a)] = max(0, b - max(a, end))
            end = max(end, b)
    return sum(found.values())


@pytest.mark.parametrize("quantization", [None, "int8", "int4", "bf16"])
@pytest.mark.parametrize("variant", ["v3", "v2_group", "v3_noq_halfsplit"])
def test_weight_bytes_equal_what_a_loaded_model_holds(tiny_checkpoint, variant, quantization, gemm_mode):
    """The planner's per-part bytes against a model loaded in each format: exact. Under cpu_gemm=plain the CPU
    keeps no second layout, so the count for no particular machine (``cpu=None``) must match; under auto, the
    count for this CPU (its probes: oneDNN's blocked copies, int8's float32 row scales, bfloat16 absorbed copies)."""
    from mla_runtime.layers.quantization import finish_quantization, quantized_weights
    from mla_runtime.loader import load_model
    from mla_runtime.plan import weight_footprint

    path, _ = tiny_checkpoint(variant)
    cfg = ModelConfig.from_pretrained(path)
    model = load_model(path, dtype="float32", quantization=quantization, cpu_gemm=gemm_mode)
    if quantization is not None:
        finish_quantization(model, quantization)
    planned = weight_footprint(cfg, "float32", 1, quantization, cpu=CPU() if gemm_mode == "auto" else None)
    assert planned.quantized_bytes == sum(w.nbytes for w in quantized_weights(model))
    assert planned.total == _resident_bytes(model)
    if quantization is not None:
        assert planned.format == quantization and planned.quantized_bytes > 0
        elements, _ = quantized_parameters(cfg)
        assert sum(w.shape.numel() for w in quantized_weights(model)) == elements


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_pre_quantised_checkpoint_counts_in_its_stored_format(tiny_checkpoint, tmp_path, scheme):
    """A compressed-tensors checkpoint (``mla-runtime quantize``) loads as stored: the planner counts its format
    without being asked for one, and suggests no other (its format is fixed)."""
    pytest.importorskip("compressed_tensors")
    from mla_runtime.compressed import main as quantize_main
    from mla_runtime.layers.quantization import finish_quantization
    from mla_runtime.loader import load_model
    from mla_runtime.plan import smaller_formats, weight_footprint

    src, _ = tiny_checkpoint("v3")
    assert quantize_main(["--model", str(src), "--quantization", scheme, "--out", str(tmp_path / scheme)]) == 0
    cfg = ModelConfig.from_pretrained(tmp_path / scheme)
    model = load_model(tmp_path / scheme, dtype="float32")
    finish_quantization(model, scheme)
    planned = weight_footprint(cfg, "float32", cpu=CPU())
    assert planned.format == scheme and planned == weight_footprint(cfg, "float32", 1, scheme, cpu=CPU())
    assert planned.total == _resident_bytes(model)
    assert smaller_formats(cfg, None) == []


@pytest.mark.parametrize("tp,layout", [(2, "replicated"), (4, "sharded")])
def test_weight_bytes_per_rank_equal_a_loaded_shard(tiny_checkpoint, tp, layout):
    """One rank's shard (the last rank: its vocabulary part is the padded one), int8 on this CPU: exact; at four ranks
    a rank has one head, whose ``w_uk`` is a view of ``kv_b_proj`` where it keeps the model dtype."""
    from mla_runtime.layers.quantization import finish_quantization
    from mla_runtime.loader import load_model
    from mla_runtime.parallel import ParallelContext

    path, _ = tiny_checkpoint("v3")
    cfg = ModelConfig.from_pretrained(path)
    for quantization in (None, "int8"):
        model = load_model(path, dtype="float32", quantization=quantization, par=ParallelContext(tp - 1, tp, layout))
        if quantization:
            finish_quantization(model, quantization)
        assert weight_bytes(cfg, "float32", tp, quantization, cpu=CPU(),
                            latent_cache_layout=layout) == _resident_bytes(model)


def _deepseek_fp8_checkpoint(src, dst, block: int = 128):
    """``src`` rewritten as DeepSeek's FP8 checkpoints store it: every projection of every layer (kv_a_proj_with_mqa
    and kv_b_proj included) in float8_e4m3fn with a float32 ``weight_scale_inv`` per ``block x block`` tile; the
    embedding, norms, routers and lm_head as they were."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not (t.dim() == 2 and ".layers." in name and "_proj" in name):
            out[name] = t
            continue
        rows, cols = t.shape
        scale = torch.empty(-(-rows // block), -(-cols // block))
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                tile = t[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
                scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
                q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
        out[name], out[name[: -len("weight")] + "weight_scale_inv"] = q, scale
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_fp8_checkpoint_weight_bytes_equal_what_the_model_holds(tmp_path, gemm_mode):
    """An FP8 checkpoint loaded without ``quantization`` keeps its products as stored: N x K bytes and a float32 scale
    per 128 x 128 block; kv_b_proj, the lm_head and the embedding in the model dtype. Dimensions whole blocks (128),
    so that every product keeps its blocks, as DeepSeek-V3's do."""
    from transformers import DeepseekV3ForCausalLM

    from mla_runtime.layers.quantization import quantized_weights
    from mla_runtime.loader import load_model
    from mla_runtime.plan import weight_footprint
    from tests.checkpoints import _v3_config, save_checkpoint

    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(_v3_config(intermediate_size=128, moe_intermediate_size=128, q_lora_rank=128))
    path = _deepseek_fp8_checkpoint(save_checkpoint(hf, tmp_path / "bf16"), tmp_path / "fp8")
    cfg = ModelConfig.from_pretrained(path)
    model = load_model(path, dtype="float32", cpu_gemm=gemm_mode)
    planned = weight_footprint(cfg, "float32", cpu=CPU() if gemm_mode == "auto" else None)
    assert planned.format == "fp8 (checkpoint blocks)"
    weights = quantized_weights(model)
    assert {w.scheme for w in weights} == {"fp8"}
    assert planned.quantized_bytes == sum(w.nbytes for w in weights)
    assert planned.total == _resident_bytes(model)
    # each checkpoint tensor is at most 128 x 128: one scale each. Per layer q_a, kv_a (stacked), q_b, o_proj; the dense
    # layer's gate, up, down; each MoE layer's shared and 8 routed experts' gate, up, down
    scales = 3 * 4 + 3 + 2 * (1 + 8) * 3
    assert planned.quantized_bytes == sum(w.shape.numel() for w in weights) + 4 * scales


def test_int4_and_fp8_byte_formulas():
    """int4: half a byte a value and a float16 scale per 32 values of a row (``K`` padded to whole groups); fp8: a byte
    a value and a float32 scale per 128 x 128 block of each checkpoint part. The formats' ``stored_bytes`` (what the
    planner counts) checked against their own ``nbytes``."""
    from mla_runtime.footprint import inventory
    from mla_runtime.layers.fp8 import DEFAULT_BLOCK, Fp8Weight
    from mla_runtime.layers.int4 import GROUP, Int4Weight
    from mla_runtime.layers.quantization import Int8Weight

    for n, k in ((96, 64), (40, 100), (256, 7168)):
        kp = -(-k // 32) * 32
        assert Int4Weight.stored_bytes(n, k) == n * kp // 2 + 2 * n * kp // 32
        assert Int8Weight.stored_bytes(n, k) == n * k + 2 * n
        assert Fp8Weight.stored_bytes(n, k) == n * k + 4 * -(-n // 128) * -(-k // 128)
        w = torch.randn(n, k)
        assert GROUP == 32 and Int4Weight.quantize(w).nbytes == Int4Weight.stored_bytes(n, k)
        assert Int8Weight.quantize(w).nbytes == Int8Weight.stored_bytes(n, k)
        assert DEFAULT_BLOCK == (128, 128)
        assert Fp8Weight.quantize(w).nbytes == Fp8Weight.stored_bytes(n, k)
    # two checkpoint parts stacked (gate and up): each has its own scale rows
    assert sum(Fp8Weight.stored_bytes(rows, 256) for rows in (64, 64)) == 128 * 256 + 4 * 2 * 2
    parts = {p.name.rsplit(".", 2)[-2]: p.parts for p in inventory(TINY_V3).params if p.name.endswith("gate_up_proj")}
    moe = TINY_V3.moe
    assert moe is not None
    shared = moe.n_shared_experts * moe.moe_intermediate_size
    assert parts == {"mlp": (TINY_V3.intermediate_size,) * 2, "shared_experts": (shared,) * 2,
                     "experts": (moe.moe_intermediate_size,) * 2}


def test_deepseek_v3_fp8_fits_eight_h200():
    """DeepSeek-V3 as published (FP8 blocks) on 8 ranks of 141 GiB: about 84 GB of weights per rank (what vLLM and
    SGLang need for it), with room left for the latent cache."""
    plan = plan_memory(V3, dtype="auto", device_memory_bytes=parse_bytes("141GiB"), max_seq_len=32768,
                       max_num_seqs=16, tensor_parallel_size=8)
    assert plan.weights is not None and plan.weights.format == "fp8 (checkpoint blocks)"
    assert plan.dtype == torch.bfloat16
    assert 82e9 < plan.weight_bytes < 88e9
    assert plan.fits and plan.max_tokens > 500_000
    # the FP8 products: one byte a value plus a float32 scale per 128 x 128 block
    elements, _ = quantized_parameters(V3, 8)
    head = -(-V3.vocab_size // 8) * V3.hidden_size
    assert elements - head < plan.weights.quantized_bytes < 1.001 * (elements - head)
    # dequantised to bfloat16 the same model needs 16 ranks
    with pytest.raises(ValueError, match=r"tensor_parallel_size >= 16"):
        plan_memory(V3_BF16, dtype="bfloat16", device_memory_bytes=parse_bytes("141GiB"), max_seq_len=32768,
                    max_num_seqs=16, tensor_parallel_size=8)


def test_cli_deepseek_v3_fp8_on_eight_ranks_and_quantization_choices(capsys):
    argv = ["--model", "deepseek-v3", "--tensor-parallel-size", "8", "--device-memory", "141GiB",
            "--max-seq-len", "32768", "--max-num-seqs", "16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "weights fp8 (checkpoint blocks)" in out and "FITS" in out
    assert f"{weight_bytes(V3, 'bfloat16', 8):,}" in out
    for q in ("int8", "int4", "fp8"):
        assert main([*argv, "--quantization", q]) == 0
        out = capsys.readouterr().out
        assert f"weights {q}," in out and f"{weight_bytes(V3, 'bfloat16', 8, q):,}" in out
    assert weight_bytes(V3, "bfloat16", 8, "int4") < 0.6 * weight_bytes(V3, "bfloat16", 8, "int8")
    # four ranks: the FP8 weights miss; the message names what fits
    assert main([*argv[:3], "4", *argv[4:]]) == 2
    err = capsys.readouterr().err
    assert "do not fit" in err and "tensor_parallel_size >= 8" in err and 'quantization="int4" (' in err


def CPU(dtype: torch.dtype = torch.float32):  # noqa: N802
    """This machine's probed layouts for ``dtype`` weights, as the Worker passes them to the planner."""
    from mla_runtime.kernel_plan import kernel_plan

    return kernel_plan().layouts(dtype)


def test_cpu_device_counts_the_packed_copies():
    """Without a CPU's probed layouts the planner counts no CPU-only copy; with them, those this machine's probes
    choose."""
    from mla_runtime.kernel_plan import kernel_plan
    from mla_runtime.plan import weight_footprint

    plain = weight_footprint(V2_LITE, "float32")
    cpu = weight_footprint(V2_LITE, "float32", cpu=CPU())
    assert plain.packed_bytes == 0
    with pytest.raises(ValueError, match="layouts probed for torch.float32"):
        weight_footprint(V2_LITE, "bfloat16", cpu=CPU())
    extra = kernel_plan().choice(torch.float32).extra_bytes_per_element
    assert (cpu.packed_bytes > 0) == (extra > 0)
    if extra:  # every float matrix (not the embedding, norms or routers) once more, q_a/kv_a stacked: twice more
        assert cpu.packed_bytes > extra * (parameter_count(V2_LITE) - 2 * V2_LITE.vocab_size * V2_LITE.hidden_size)


def test_a_cpu_plan_counts_the_latent_cache_a_cpu_load_keeps(tiny_checkpoint):
    """``--device cpu`` plans the cache dtype a load on this CPU keeps for ``kv_cache_dtype`` "auto": a bfloat16
    checkpoint that ``dtype`` "auto" runs over its own bfloat16 weights in a float32 model caches bfloat16 latents (the
    compiled decode reads them), else the model's dtype; the engine's bytes per token are the plan's."""
    from mla_runtime.plan_cli import _probed_cpu

    cpu, quantization = _probed_cpu("auto", V2_LITE, None)
    plan = plan_memory(V2_LITE, dtype="auto", device_memory_bytes=parse_bytes("256GiB"), max_seq_len=4096,
                       max_num_seqs=4, quantization=quantization, cpu=cpu)
    assert V2_LITE.torch_dtype == "bfloat16"
    want = torch.bfloat16 if quantization == "bf16" else cpu.dtype
    assert plan.cache_dtype.dtype == want
    assert plan.latent_bytes_per_token == V2_LITE.latent_dim * want.itemsize * V2_LITE.num_hidden_layers
    explicit = plan_memory(V2_LITE, dtype="float32", device_memory_bytes=parse_bytes("256GiB"), max_seq_len=4096,
                           max_num_seqs=4, quantization="bf16", cpu=CPU())
    assert explicit.cache_dtype.dtype == torch.float32  # an explicit dtype: the model's


# -- the load's memory check -----------------------------------------------------------------------------------
def test_load_requirement_parts(tiny_checkpoint):
    from mla_runtime.load_check import LOAD_MARGIN_CPU_BYTES, load_requirement

    cfg = ModelConfig.from_pretrained(tiny_checkpoint("v3")[0])
    need = load_requirement(cfg, dtype="float32", device="cpu", max_model_len=100, block_size=16, max_num_seqs=4,
                            cpu=CPU())
    assert need.weight_bytes == weight_bytes(cfg, "float32", cpu=CPU())
    # the largest tensor read: the embedding (256 x 64), converted to float32
    assert need.transient_bytes == 4 * 256 * 64 + LOAD_MARGIN_CPU_BYTES
    assert need.cache_bytes == 7 * 16 * latent_bytes_per_token(cfg, "auto", "float32")  # 100 tokens: 7 blocks
    assert need.activation_bytes == activation_reserve_bytes(cfg, dtype="float32", max_num_batched_tokens=400,
                                                             max_num_seqs=4)
    assert need.total == need.weight_bytes + need.transient_bytes + need.activation_bytes + need.cache_bytes
    explicit = load_requirement(cfg, dtype="float32", device="cpu", max_model_len=100, kv_cache_memory=12345)
    assert explicit.cache_bytes == 12345  # kv_cache_memory is the cache the engine takes
    gpu = load_requirement(cfg, dtype="float32", device="cuda", max_model_len=100, block_size=16, max_num_seqs=4)
    assert gpu.transient_bytes == 4 * 256 * 64  # no CPU margin, no CPU copies
    assert gpu.weight_bytes == weight_bytes(cfg, "float32")


def test_load_check_names_the_settings_that_fit():
    from mla_runtime.errors import InsufficientMemory
    from mla_runtime.load_check import check_load_memory

    settings = dict(dtype="bfloat16", device="cuda", max_model_len=4096, max_num_seqs=4)
    with pytest.raises(InsufficientMemory) as err:
        check_load_memory(V2_LITE, 24 * 2**30, settings, "cuda:0")
    msg = str(err.value)
    assert isinstance(err.value, ValueError) and err.value.available == 24 * 2**30
    assert "not enough memory to load the model on cuda:0" in msg and "24.00 GiB" in msg
    assert f"{err.value.needed / 2**30:,.2f} GiB" in msg and "weights 29." in msg
    assert 'quantization="int8" needs 1' in msg and 'quantization="int4" needs 1' in msg
    assert "tensor_parallel_size=2 needs" in msg
    assert check_load_memory(V2_LITE, 24 * 2**30, {**settings, "quantization": "int8"}).total < 24 * 2**30
    # the weights fit but the context does not: a max_model_len that fits
    long = {**settings, "quantization": "int4", "max_model_len": 163840}
    with pytest.raises(InsufficientMemory, match=r"max_model_len <= [0-9,]+") as err:
        check_load_memory(V2_LITE, 14 * 2**30, long, "cuda:0")
    tokens = int(str(err.value).split("max_model_len <= ")[1].split(" ")[0].replace(",", ""))
    assert 16_384 < tokens < 163_840 and tokens % 64 == 0
    assert check_load_memory(V2_LITE, 14 * 2**30, {**long, "max_model_len": tokens}).total <= 14 * 2**30
    with pytest.raises(InsufficientMemory):
        check_load_memory(V2_LITE, 14 * 2**30, {**long, "max_model_len": tokens + 64})


def test_worker_refuses_a_model_too_large_before_reading_a_weight(tiny_checkpoint, monkeypatch):
    from mla_runtime.engine import worker as worker_module
    from mla_runtime.engine.config import EngineConfig
    from mla_runtime.errors import InsufficientMemory

    path, _ = tiny_checkpoint("v3")

    def no_load(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(worker_module, "load_resolved", no_load)
    monkeypatch.setattr(worker_module.checksums, "verify", no_load)
    monkeypatch.setattr(worker_module.checksums, "manifest_fingerprint", no_load)
    monkeypatch.setattr(worker_module, "available_host_memory", lambda: 512 * 2**20)
    for kv_cache_memory in (None, "1GiB"):
        worker = worker_module.Worker(EngineConfig(model=str(path), dtype="float32", max_model_len=256,
                                                   kv_cache_memory=kv_cache_memory, device="cpu"))
        with pytest.raises(InsufficientMemory, match=r"it needs [0-9.]+ GiB .* but 512.00 MiB") as err:
            worker.load()
        assert ("latent cache 1.00 GiB (kv_cache_memory)" in str(err.value)) == (kv_cache_memory is not None)
        assert "load peak 1.00 GiB" in str(err.value)
    # enough memory: the check passes and the load goes on
    monkeypatch.setattr(worker_module, "available_host_memory", lambda: 64 * 2**30)
    with pytest.raises(AssertionError, match="a weight was read"):
        worker_module.Worker(EngineConfig(model=str(path), dtype="float32", max_model_len=256, device="cpu")).load()


def test_a_load_that_fits_only_without_second_layouts_goes_ahead_without_them(tiny_checkpoint, monkeypatch, caplog):
    """Where a CPU load would not fit with the products' second layouts (oneDNN's blocked copies) but fits without
    them, the engine loads every matrix in its one plain layout, says so in its log and ``EngineInfo``, counts the
    weights' bytes as they are, and gives the tokens it gives with the copies."""
    from mla_runtime import LLM, SamplingParams
    from mla_runtime.engine import worker as worker_module
    from mla_runtime.engine.config import EngineConfig
    from mla_runtime.errors import InsufficientMemory
    from mla_runtime.layers.cpu_gemm import PackedWeight

    path, _ = tiny_checkpoint("v3")
    settings = dict(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory="4MiB", device="cpu")
    worker = worker_module.Worker(EngineConfig(**settings))
    assert worker.cpu is not None and not worker.cpu.one_layout
    if worker.cpu.extra_bytes_per_element == 0:
        pytest.skip("this CPU's float32 products keep no second layout (oneDNN's float32 path is not taken)")
    lean = worker.cpu.with_one_layout()
    assert lean is not None
    saved = worker.weight_bytes - weight_bytes(worker.checkpoint_config, torch.float32, cpu=lean)
    assert saved > 0 and lean.extra_bytes_per_element == 0 and lean.one_layout
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 2, 7, 11, 3]}, {"prompt_token_ids": [4, 8, 15, 16]}]
    with_copies = [o.outputs[0].token_ids for o in LLM(**settings).generate(prompts, params)]
    monkeypatch.setattr(worker_module, "available_host_memory", lambda: 1)
    with pytest.raises(InsufficientMemory) as err:
        worker.check_memory()
    between = err.value.needed - saved // 2  # fits without the copies, not with them
    monkeypatch.setattr(worker_module, "available_host_memory", lambda: between)
    caplog.set_level("WARNING", logger="mla_runtime")
    llm = LLM(**settings)
    assert "the weights keep one layout each" in caplog.text
    packed = [m for m in llm.engine.worker.model.modules() for m in vars(m).values() if isinstance(m, PackedWeight)]
    assert packed and all(p.blocked is None and p.amx is None for p in packed)
    assert llm.engine.worker.gemm_info["layouts"].startswith("one per weight")
    assert llm.engine.worker.weight_bytes == weight_bytes(worker.checkpoint_config, torch.float32, cpu=lean)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == with_copies


def test_the_cpu_plan_leaves_out_second_layouts_where_only_that_fits(monkeypatch, capsys):
    """``plan --device cpu`` plans as the engine loads: where the weights fit only without their second layouts
    (a bfloat16 DeepSeek-V2-Lite under ``auto``: 58.8 GiB with oneDNN's blocked copies, 29.9 GiB without), it plans
    them without and says so; where neither fits, it refuses."""
    from mla_runtime import plan_cli as plan_module
    from mla_runtime.kernel_plan import CpuLayouts

    bf16w = CpuLayouts(torch.float32, 4, True, True)  # a float32 model with bfloat16 weights on an AVX512-BF16 CPU
    monkeypatch.setattr(plan_module, "_probed_cpu", lambda *a: (bf16w, "bf16"))
    args = ["--model", "deepseek-v2-lite", "--device", "cpu", "--max-num-seqs", "4", "--max-seq-len", "4096"]
    assert plan_module.main([*args, "--device-memory", "80GiB"]) == 0
    assert "one layout" not in capsys.readouterr().out
    assert plan_module.main([*args, "--device-memory", "48GiB"]) == 0
    out = capsys.readouterr().out
    assert "each weight in one layout" in out and "29.86 GiB" in out
    assert plan_module.main([*args, "--device-memory", "24GiB"]) == 2
