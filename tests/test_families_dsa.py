"""The sparse-attention (DSA) models (``deepseek_v32``, ``glm_moe_dsa``) equal transformers' own classes on tiny random
checkpoints, with ``index_topk`` below the prompts' lengths (each query attends to a selection of its keys) and above
them (dense): prefill logits (fp32, relative error <= 1e-4), greedy tokens through ``LLM`` on one and two
tensor-parallel ranks, chunked prefill, prefix caching and int8 weights."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.config import ModelConfig
from mla_runtime.layers.quantization import finish_quantization
from mla_runtime.loader import load_model
from mla_runtime.plan import latent_bytes_per_token
from tests.checkpoints import VOCAB, dequantized_reference, quantize_fp8_checkpoint
from tests.model_utils import PagedRunner, hf_logits
from tests.test_engine import hf_greedy

FAMILIES = ["deepseek_v32", "glm_moe_dsa"]
TOPK = 12  # below most prompts' lengths: the indexer's choice matters
TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=4, topk_group=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
    v_head_dim=24, max_position_embeddings=512, routed_scaling_factor=2.5, first_k_dense_replace=1,
    index_topk=TOPK, index_n_heads=8, index_head_dim=32, bos_token_id=0, eos_token_id=1, pad_token_id=None)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def build(family: str, **changes: Any):
    """transformers' model of ``family`` (tiny, weights re-randomised so that every tensor matters)."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "deepseek_v32":
        model = tf.DeepseekV32ForCausalLM(tf.DeepseekV32Config(**{**TEXT, **changes}))
    else:  # the middle layer reuses the first one's selection
        model = tf.GlmMoeDsaForCausalLM(tf.GlmMoeDsaConfig(**{**TEXT, "indexer_types": ["full", "shared", "full"],
                                                              **changes}))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "mlp.gate.weight" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "indexer" in name:  # scores spread wide: no near-ties between the kept and the dropped keys
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(family, **changes)`` → (checkpoint dir, transformers model), built once per module."""
    built: dict[str, tuple] = {}

    def get(family: str, **changes: Any):
        key = f"{family}-{sorted(changes.items())}"
        if key not in built:
            hf = build(family, **changes)
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            built[key] = (path, hf)
        return built[key]

    return get


def prompts(lens=(5, 17, 40, 1), seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lens]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def prefill(model, ps: list[list[int]], chunk: int | None = None) -> list[torch.Tensor]:
    return PagedRunner(model, len(ps), max(map(len, ps))).prefill(ps, chunk)


@pytest.mark.parametrize("family", FAMILIES)
def test_config(checkpoint, family):
    path, _ = checkpoint(family)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.model_type == family and cfg.indexer is not None
    assert (cfg.indexer.n_heads, cfg.indexer.head_dim, cfg.indexer.topk) == (8, 32, TOPK)
    assert cfg.indexer.rope_interleave == (family == "glm_moe_dsa")
    assert [cfg.indexer.is_shared(i) for i in range(3)] == [False, family == "glm_moe_dsa", False]
    # the cache keeps [c ; k_r] and the indexer's key: (32 + 16 + 32) fp32 values x 3 layers
    assert latent_bytes_per_token(cfg, "auto", "float32") == (32 + 16 + 32) * 4 * 3


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(checkpoint, family):
    path, hf = checkpoint(family)
    ps = prompts()
    model = load_model(path, dtype="float32")
    for p, got in zip(ps, prefill(model, ps)):
        assert rel_err(got, hf_logits(hf, p)) <= 1e-4
    for p, got in zip(ps, prefill(model, ps, chunk=7)):  # chunked: later chunks select among cached keys
        assert rel_err(got, hf_logits(hf, p)) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("gather_cost", [0, 1 << 30], ids=["gathered", "masked-dense"])
def test_both_cpu_prefill_forms_match_transformers(checkpoint, family, gather_cost, monkeypatch):
    """The CPU backend's two forms of sparse prefill, forced: each row's selection gathered and attended absorbed,
    or keys and values rebuilt for the whole sequence and dense attention masked to the selection."""
    from mla_runtime.attention import cpu

    monkeypatch.setattr(cpu, "GATHER_COST", gather_cost)
    dense_calls = []
    real = cpu.selected_prefill_attention
    monkeypatch.setattr(cpu, "selected_prefill_attention", lambda *a: dense_calls.append(1) or real(*a))
    path, hf = checkpoint(family)
    ps = prompts()
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="4MiB", block_size=16,
              max_num_batched_tokens=16)  # chunks: later ones select among cached keys
    try:
        assert llm.engine.info().attention_backend == "cpu"
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    finally:
        llm.shutdown()
    assert bool(dense_calls) == bool(gather_cost)
    for p, out in zip(ps, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, p, GREEDY.max_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers(checkpoint, family):
    path, hf = checkpoint(family)
    ps = prompts()
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="4MiB", block_size=16)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
        again = llm.generate([{"prompt_token_ids": p} for p in ps[1:3]], GREEDY)  # prefix cache hits
    finally:
        llm.shutdown()
    for p, out in zip(ps, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, p, GREEDY.max_tokens)
    assert [list(o.outputs[0].token_ids) for o in again] == [list(o.outputs[0].token_ids) for o in outs[1:3]]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_each_attention_backend_matches_transformers(checkpoint, backend):
    """The CUDA backend's kernels (Triton, interpreted on a CPU) and the torch reference path: the indexer's scores
    and top-k over the paged keys, and the sparse absorbed attention, in chunks."""
    path, hf = checkpoint("glm_moe_dsa")
    ps = prompts((21, 30), seed=6)
    for p, got in zip(ps, prefill(load_model(path, dtype="float32", backend=backend), ps, chunk=16)):
        assert rel_err(got, hf_logits(hf, p)) <= 1e-4


def test_dense_while_every_query_sees_at_most_topk(checkpoint):
    """index_topk above every sequence's length: the selection is every key, as in the reference."""
    path, hf = checkpoint("deepseek_v32", index_topk=256)
    ps = prompts((30, 9), seed=2)
    for p, got in zip(ps, prefill(load_model(path, dtype="float32"), ps)):
        assert rel_err(got, hf_logits(hf, p)) <= 1e-4


@pytest.mark.parametrize("family,layout", [("deepseek_v32", "replicated"), ("deepseek_v32", "sharded"),
                                           ("glm_moe_dsa", "sharded")])
def test_two_ranks_equal_transformers(checkpoint, family, layout):
    """Both tensor-parallel layouts: every rank holds every indexer key (replicated), or each rank its own tokens'
    and the ranks' candidates are merged into the global top-k (sharded)."""
    path, hf = checkpoint(family)
    p = prompts((29,), seed=3)[0]
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory="2MiB", block_size=32,
              tensor_parallel_size=2, latent_cache_layout=layout)
    try:
        out = llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0]
    finally:
        llm.shutdown()
    assert list(out.token_ids) == hf_greedy(hf, p, GREEDY.max_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_weights_close_to_float32(checkpoint, family):
    path, _ = checkpoint(family)
    ps = prompts((21, 40, 9), seed=5)
    ref = torch.cat(prefill(load_model(path, dtype="float32"), ps))
    model = load_model(path, dtype="float32", quantization="int8")
    finish_quantization(model, "int8")
    got = torch.cat(prefill(model, ps))
    assert rel_err(got, ref) > 0  # quantised, not the float32 weights
    # a near-tie of the router or of the indexer's ranking can pick another expert or key: measured 0.84-0.9
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_fp8_checkpoint_equals_its_dequantised_weights(checkpoint, tmp_path):
    """DeepSeek-V3.2 ships FP8 blocks: the products stay in them, and the model equals transformers holding the
    same weights dequantised."""
    path, _ = checkpoint("deepseek_v32")
    fp8 = quantize_fp8_checkpoint(path, tmp_path / "fp8", block=16)
    ref = dequantized_reference(fp8, tmp_path / "ref")
    ps = prompts((33, 8), seed=9)
    for p, got in zip(ps, prefill(load_model(fp8, dtype="float32"), ps)):
        assert rel_err(got, hf_logits(ref, p)) <= 1e-4


def test_long_prompts_through_preemption_prefix_cache_and_disk_restart(checkpoint, tmp_path):
    """Prompts far longer than index_topk give the same tokens with room to spare, when a small cache preempts them,
    when their prefixes come from the device cache, and from the disk tier after a restart: the indexer keys travel
    with the latents."""
    path, hf = checkpoint("deepseek_v32")
    ps = prompts((150, 120, 90, 140), seed=11)
    reqs = [{"prompt_token_ids": p} for p in ps]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kw: dict[str, Any] = dict(dtype="float32", max_model_len=256, block_size=16)
    roomy = LLM(str(path), kv_cache_memory="4MiB", **kw)
    try:
        want = [list(o.outputs[0].token_ids) for o in roomy.generate(reqs, params)]
    finally:
        roomy.shutdown()
    assert want[0] == hf_greedy(hf, ps[0], 12)
    per_block = 16 * latent_bytes_per_token(ModelConfig.from_pretrained(path), "auto", "float32")
    small = LLM(str(path), kv_cache_memory=str(24 * per_block), **kw)  # 24 blocks: two prompts at a time
    try:
        assert [list(o.outputs[0].token_ids) for o in small.generate(reqs, params)] == want
        assert small.engine.scheduler.num_preemptions > 0
        small.engine.pool.check_whole()
    finally:
        small.shutdown()
    disk = LLM(str(path), kv_cache_memory="4MiB", kv_cache_dir=str(tmp_path), **kw)
    try:
        assert [list(o.outputs[0].token_ids) for o in disk.generate(reqs, params)] == want
        again = disk.generate(reqs[:1], params)[0]  # from the device cache
        assert again.num_cached_tokens == 144 and list(again.outputs[0].token_ids) == want[0]
    finally:
        disk.shutdown()
    restarted = LLM(str(path), kv_cache_memory="4MiB", kv_cache_dir=str(tmp_path), **kw)
    try:
        outs = restarted.generate(reqs, params)
        assert [o.num_cached_tokens for o in outs] == [144, 112, 80, 128]  # every whole block, from disk
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    finally:
        restarted.shutdown()


def test_mtp_drafts_keep_the_greedy_tokens(checkpoint, tmp_path):
    """DeepSeek-V3.2's MTP layer (an indexer of its own, its keys in the MTP layer's cache) drafts, and the sparse
    verification of the drafts keeps plain greedy decoding's tokens."""
    import shutil

    from safetensors.torch import load_file, save_file
    from torch import nn
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32DecoderLayer, DeepseekV32RMSNorm

    path, hf = checkpoint("deepseek_v32")
    cfg, n = hf.config, hf.config.num_hidden_layers
    torch.manual_seed(3)
    layer = DeepseekV32DecoderLayer(cfg, n - 1)  # a MoE block, like the last layer
    h = cfg.hidden_size
    layer.enorm, layer.hnorm = DeepseekV32RMSNorm(h), DeepseekV32RMSNorm(h)
    layer.eh_proj = nn.Linear(2 * h, h, bias=False)
    layer.shared_head = nn.Module()
    layer.shared_head.norm = DeepseekV32RMSNorm(h)
    mtp = tmp_path / "mtp"
    shutil.copytree(path, mtp)
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update({f"model.layers.{n}.{k}": v.detach().clone().contiguous() for k, v in layer.state_dict().items()})
    save_file(tensors, str(mtp / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((mtp / "config.json").read_text())
    (mtp / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    reqs = [{"prompt_token_ids": p} for p in prompts((40, 25, 9), seed=4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    for method in (None, "mtp"):
        spec: dict[str, Any] = {} if method is None else {"speculative_method": method, "num_speculative_tokens": 2}
        llm = LLM(str(mtp), dtype="float32", max_model_len=128, kv_cache_memory="4MiB", block_size=16, **spec)
        try:
            outs[method] = [list(o.outputs[0].token_ids) for o in llm.generate(reqs, params)]
            if method:
                assert llm.engine.stats().num_draft_tokens > 0
                assert llm.engine.worker.model.mtp[0].self_attn.indexer is not None
        finally:
            llm.shutdown()
    assert outs["mtp"] == outs[None]


@pytest.mark.parametrize("cache_dtype, agree", [(torch.float8_e4m3fn, 0.7), (torch.bfloat16, 0.95)])
def test_quantised_and_bf16_caches_stay_close(checkpoint, cache_dtype, agree):
    """An fp8 latent cache keeps the indexer keys in fp8 with a scale per 128 values; a bf16 one in bf16. The top-k
    is discrete: a rounding that reorders two keys at its edge swaps a key in or out, so a sparse model strays further
    from its float32 run than a dense one (measured top-1 agreement, sparse / dense: fp8 0.77 / 0.97, bf16 0.99 / 1)."""
    path, _ = checkpoint("deepseek_v32")
    model = load_model(path, dtype="float32")
    ps = prompts((40, 33), seed=13)
    ref = torch.cat(prefill(model, ps))
    runner = PagedRunner(model, len(ps), 40, cache_dtype=cache_dtype)
    assert runner.cache.layers[0].index is not None and runner.cache.layers[0].index.dtype == cache_dtype
    assert (runner.cache.layers[0].index_scales is not None) == (cache_dtype == torch.float8_e4m3fn)
    got = torch.cat(runner.prefill(ps))
    assert rel_err(got, ref) > 0
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= agree


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_two_ranks_restart_from_disk(checkpoint, tmp_path, layout):
    """Blocks read back from the disk tier carry their indexer keys to every rank: rank 0 broadcasts them (replicated)
    or each rank reads its own shard's (sharded)."""
    path, hf = checkpoint("deepseek_v32")
    p = prompts((100,), seed=12)[0]
    kw: dict[str, Any] = dict(dtype="float32", max_model_len=128, block_size=32, kv_cache_memory="4MiB",
                              kv_cache_dir=str(tmp_path), tensor_parallel_size=2, latent_cache_layout=layout)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = LLM(str(path), **kw)
    try:
        cold = first.generate([{"prompt_token_ids": p}], params)[0]
    finally:
        first.shutdown()
    again = LLM(str(path), **kw)
    try:
        out = again.generate([{"prompt_token_ids": p}], params)[0]
    finally:
        again.shutdown()
    assert out.num_cached_tokens == 96 and out.outputs[0].token_ids == cold.outputs[0].token_ids
    assert list(cold.outputs[0].token_ids) == hf_greedy(hf, p, 6)


def test_latent_rank_truncates_the_latent_and_keeps_the_indexer_width(checkpoint):
    """The sweep's latent rank applies to the latent alone: a truncated sparse model caches ``r + d_r`` latent values
    and the indexer's full-width keys per token, and at full rank it reproduces the model (sparse selections
    included: the prompts are longer than the top-k)."""
    from mla_runtime.latent_rank import truncate_latent_rank

    path, _ = checkpoint("deepseek_v32")
    ps = prompts((40, 25), seed=3)
    ref = prefill(load_model(path, dtype="float32"), ps, chunk=16)
    full = truncate_latent_rank(load_model(path, dtype="float32"), TEXT["kv_lora_rank"], "svd", calibration=ps)
    for got, want in zip(prefill(full, ps, chunk=16), ref):
        assert rel_err(got, want) <= 1e-4
    llm = LLM(str(path), dtype="float32", max_model_len=128, block_size=16, kv_cache_memory="1MiB", latent_rank=12)
    worker = llm.engine.worker
    layer = worker.cache.layers[0]
    assert layer.kv.shape[-1] == 12 + TEXT["qk_rope_head_dim"]
    assert layer.index is not None and layer.index.shape[-1] == TEXT["index_head_dim"]
    assert worker.bytes_per_token == worker.cache.bytes_per_token() == 3 * 4 * (12 + 16 + TEXT["index_head_dim"])
    out = llm.generate([{"prompt_token_ids": ps[0]}], GREEDY)
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens
    llm.engine.pool.check_whole()


def test_structured_outputs_constrain_a_sparse_model(checkpoint):
    """A JSON schema constrains a sparse model's output as any other's: the grammar masks the logits whatever keys
    the indexer selected (the prompt is longer than the top-k)."""
    import shutil
    from pathlib import Path

    import jsonschema

    from mla_runtime import StructuredOutputs

    demo = Path(__file__).resolve().parent.parent / "mla_runtime" / "demo_model"
    path, _ = checkpoint("deepseek_v32", vocab_size=8192)  # the demo tokenizer's vocabulary
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, path / name)
    schema = {"type": "object", "required": ["mode", "level"], "additionalProperties": False,
              "properties": {"mode": {"enum": ["read", "write", "append"]}, "level": {"enum": ["low", "high"]}}}
    with LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory="4MiB") as llm:
        prompt = "def load(path):\n    return open(path).read()\n" * 3
        assert len(llm.engine.tokenizer.encode(prompt)) > TOPK
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=48,
                                                    structured_outputs=StructuredOutputs(json=schema)))
        llm.engine.pool.check_whole()
    jsonschema.validate(json.loads(out[0].outputs[0].text), schema)
