"""Hybrid models (``kimi_linear``, ``bailing_hybrid``): MLA layers between Kimi Delta Attention layers, against
transformers' own classes on tiny random checkpoints. The gated delta rule's chunked and recurrent forms against a
per-token reference; prefill logits whole and chunked; greedy tokens through ``LLM`` (mixed lengths together, chunked
prefill, preemption: ``tests/test_conformance.py`` runs those cells); prefix hits resumed from state snapshots with
transformers' tokens; every state slot and snapshot free after many requests with aborts, preemption and shared
prefixes; the settings a hybrid does not run with refused by name; the state and snapshot bytes shown beside the
latent bytes; GLM-5-Next's linear-attention layer against transformers'."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.cache.state_cache import StateCache, StateSlots
from mla_runtime.config import ModelConfig
from mla_runtime.errors import InvalidParam
from mla_runtime.families import FAMILIES
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.layers import delta_rule
from mla_runtime.loader import load_model
from mla_runtime.models.hybrid import HybridForCausalLM
from mla_runtime.plan import latent_bytes_per_token
from mla_runtime.serving.metrics import EngineCollector
from tests.checkpoints import VOCAB
from tests.model_utils import PagedRunner, hf_logits

CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, linear_num_heads=2, linear_head_dim=16,
    linear_conv_kernel_dim=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    intermediate_size=96, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    bos_token_id=0, eos_token_id=1, pad_token_id=None, max_position_embeddings=512)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def build():
    """transformers' Kimi Linear (tiny; weights re-randomised so that every tensor matters, forget rates spread)."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.KimiLinearForCausalLM(tf.KimiLinearConfig(**CONFIG))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g) - 2.0)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = build()
    path = tmp_path_factory.mktemp("kimi_linear")
    hf.save_pretrained(path)  # the original layout: q/k/v_conv1d, block_sparse_moe, w1/w2/w3
    return path, hf


def prompts(lens=(5, 17, 40, 1, 70), seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lens]


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


# -- the gated delta rule -------------------------------------------------------------------------------------------
def per_token_reference(q, k, v, g, beta, state):
    """The rule token by token, head by head, in float64 from its definition (``layers/delta_rule.py``)."""
    q, k, v, g, beta, s = (t.double() for t in (q, k, v, g, beta, state))
    s = s.clone()
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            s[h] = g[t, h].exp()[:, None] * s[h]
            u = beta[t, h] * (v[t, h] - s[h].T @ k[t, h])
            s[h] = s[h] + torch.outer(k[t, h], u)
            out[t, h] = s[h].T @ q[t, h]
    return out, s


def rule_inputs(length: int, heads: int = 3, dk: int = 8, dv: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = delta_rule.prepared(torch.randn(length, heads, dk, generator=g), torch.randn(length, heads, dk, generator=g))
    v = torch.randn(length, heads, dv, generator=g)
    gate = -2.0 * torch.rand(length, heads, dk, generator=g)  # per-channel log forget gates
    beta = torch.rand(length, heads, generator=g)
    return q, k, v, gate, beta, torch.randn(heads, dk, dv, generator=g)


@pytest.mark.parametrize("length, chunk", [(1, 32), (31, 32), (77, 32), (77, 5), (64, 64), (50, 1)])
def test_chunked_rule_equals_the_per_token_reference(length, chunk):
    q, k, v, g, beta, s0 = rule_inputs(length, seed=length)
    out, state = delta_rule.chunked(q, k, v, g, beta, s0, chunk)
    ref_out, ref_state = per_token_reference(q, k, v, g, beta, s0)
    assert float((out.double() - ref_out).abs().max()) < 1e-5
    assert float((state.double() - ref_state).abs().max()) < 1e-5


def test_recurrent_step_equals_the_reference_for_each_sequence_of_a_batch():
    seqs = [rule_inputs(1, seed=s) for s in range(4)]
    stacked = [torch.cat([x[i] for x in seqs]) for i in range(5)] + [torch.stack([x[5] for x in seqs])]
    out, states = delta_rule.recurrent_step(*stacked)
    for b, inputs in enumerate(seqs):
        ref_out, ref_state = per_token_reference(*inputs)
        assert float((out[b].double() - ref_out[0]).abs().max()) < 1e-6
        assert float((states[b].double() - ref_state).abs().max()) < 1e-6


def test_a_chunk_size_below_one_is_refused():
    with pytest.raises(ValueError, match="chunk"):
        delta_rule.chunked(*rule_inputs(4), chunk=0)


# -- the model ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [None, 7])
def test_prefill_logits_match_transformers(checkpoint, chunk):
    """Whole prompts and chunks of 7 tokens, all sequences in each step (mixed: some end their prompt while others
    go on), from poisoned slots: each sequence's first step starts from zeros, later ones from its own slot."""
    path, hf = checkpoint
    model = load_model(path, dtype="float32")
    assert isinstance(model, HybridForCausalLM) and model.num_cache_layers == 2
    assert len(model.linear_layers()) == 2 and len(model.attention_layers()) == 2
    ps = prompts()
    runner = PagedRunner(model, len(ps), max(map(len, ps)))
    for p, got in zip(ps, runner.prefill(ps, chunk)):
        ref = hf_logits(hf, p)
        assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-4


def test_decode_rows_and_prefill_chunks_in_one_step_keep_their_own_states(checkpoint):
    """One step of two decodes and a prompt chunk (in shuffled slots) gives each sequence the logits transformers
    gives it alone."""
    path, hf = checkpoint
    model = load_model(path, dtype="float32")
    a, b, c = prompts((9, 12, 20), seed=4)
    runner = PagedRunner(model, 3, 32)
    runner.step({0: a[:-1], 1: b[:-1], 2: c[:10]})
    out = runner.step({0: a[-1:], 1: b[-1:], 2: c[10:]})
    for s, p in ((0, a), (1, b)):
        ref = hf_logits(hf, p)[-1]
        assert float((out[s][-1] - ref).abs().max() / ref.abs().max()) <= 1e-4
    ref = hf_logits(hf, c)[10:]
    assert float((out[2] - ref).abs().max() / ref.abs().max()) <= 1e-4


def test_greedy_tokens_match_transformers(checkpoint):
    path, hf = checkpoint
    ps = prompts()
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="1MiB", block_size=16,
              max_num_batched_tokens=24)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    finally:
        llm.shutdown()
    for p, out in zip(ps, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, p, GREEDY.max_tokens)


def test_many_requests_with_aborts_leave_every_state_slot_free(checkpoint):
    """Prompts sharing prefixes (hits resume from state snapshots), aborts at any stage, preemption, two snapshots
    for four slots (evicted, least recently used first): every slot and snapshot free at the end, and every snapshot
    gone with the cached blocks it belongs to."""
    path, _ = checkpoint
    cfg = ModelConfig.from_pretrained(path)
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory=str(10 * 16 * 2 * 40 * 4),
              block_size=16, max_num_seqs=4, max_num_batched_tokens=32,
              state_snapshot_memory=2 * cfg.state_bytes_per_sequence + 100)
    engine = llm.engine
    slots, snapshots = engine.scheduler.states, engine.scheduler.snapshots
    assert slots is not None and slots.num_slots == 4 and snapshots is not None and snapshots.num_snapshots == 2
    rng = random.Random(3)
    heads = prompts((20, 40), seed=6)
    ps = [rng.choice(heads + [[]]) + p for p in prompts(tuple(rng.randint(1, 60) for _ in range(24)), seed=5)]
    try:
        for i, p in enumerate(ps):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=rng.randint(1, 20)))
        step = 0
        while engine.has_unfinished_requests():
            engine.step()
            step += 1
            running = engine.scheduler.running
            taken = [s.state_slot for s in running]
            assert None not in taken and len(set(taken)) == len(taken) == slots.num_slots - slots.num_free
            if step % 3 == 0 and engine.requests:  # abort one at any stage: queued, prefilling, decoding
                engine.abort(rng.choice(sorted(engine.requests)))
        assert step > len(ps) // 4 and engine.scheduler.num_preemptions > 0  # the small cache preempted some
        assert slots.num_free == slots.num_slots
        engine.pool.check_whole()
        snapshots.check_whole()
        assert all(s.state_slot is None and s.state_restore is None and not s.state_snapshots
                   for s in engine.scheduler.waiting)
        assert engine.stats().prefix_hit_tokens > 0 and snapshots.num_evictions > 0
        engine.pool.watermark = 1e-9
        engine.pool.relieve_pressure()  # every idle cached block evicted: their snapshots go with them
        assert engine.pool.num_cached_blocks == 0 and snapshots.num_committed == 0
    finally:
        llm.shutdown()


def test_engine_info_and_prefix_caching(checkpoint):
    path, _ = checkpoint
    cfg = ModelConfig.from_pretrained(path)
    llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="1MiB", block_size=16, max_num_seqs=3)
    try:
        info = llm.engine.info()
        # per linear layer: a 2 x 16 x 16 recurrent state and 3 taps of 96 channels, float32
        assert info.state_bytes_per_sequence == cfg.state_bytes_per_sequence == 2 * 4 * (2 * 16 * 16 + 96 * 3)
        assert info.state_bytes == 3 * info.state_bytes_per_sequence
        assert info.cache_bytes_per_token == latent_bytes_per_token(cfg, "float32", "float32") == 2 * 40 * 4
        # one state snapshot per slot by default: the prefix cache resumes the linear layers from them
        assert info.prefix_caching and llm.engine.pool.enable_prefix_caching
        assert (info.state_snapshots, info.state_snapshot_bytes) == (3, info.state_bytes)
        metrics = {(m.name, tuple(s.labels.items())): s.value
                   for m in EngineCollector(llm.engine.stats, info, "tiny").collect() for s in m.samples}
        assert metrics[("mla_state_cache_bytes_per_sequence", ())] == info.state_bytes_per_sequence
        assert metrics[("mla_latent_cache_bytes_per_token", ())] == info.cache_bytes_per_token
        assert metrics[("mla_memory_bytes", (("part", "state_cache"),))] == info.state_bytes
        assert metrics[("mla_memory_bytes", (("part", "state_snapshots"),))] == info.state_snapshot_bytes
        p = prompts((40,), seed=9)[0]
        first = llm.generate([{"prompt_token_ids": p}], GREEDY)[0]
        again = llm.generate([{"prompt_token_ids": p}], GREEDY)[0]
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert llm.engine.stats().prefix_hit_tokens == 32  # up to the snapshot at the last full block
    finally:
        llm.shutdown()
    for settings in ({"state_snapshot_memory": 0}, {"enable_prefix_caching": False}):
        llm = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="1MiB", block_size=16, **settings)
        try:
            info = llm.engine.info()
            assert not info.prefix_caching and info.state_snapshots == info.state_snapshot_bytes == 0
        finally:
            llm.shutdown()
    with pytest.raises(InvalidParam, match="state_snapshot_memory"):
        LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory="1MiB", state_snapshot_memory=100)


def test_prefix_hits_give_the_tokens_of_transformers(checkpoint):
    """A shared system prompt (several block boundaries long) and a second turn on a first one's answer: the repeats
    resume from the state snapshots (hits counted, only at snapshot boundaries) with transformers' greedy tokens."""
    path, hf = checkpoint
    system = prompts((37,), seed=20)[0]
    first = [system + tail for tail in prompts((3, 20), seed=120)]
    llm = LLM(str(path), dtype="float32", max_model_len=160, kv_cache_memory="1MiB", block_size=16,
              max_num_batched_tokens=24, max_num_seqs=4)
    try:
        engine = llm.engine
        outs = llm.generate([{"prompt_token_ids": first[0]}], GREEDY)
        assert engine.stats().prefix_hit_tokens == 0 and engine.scheduler.snapshots is not None
        answer = list(outs[0].outputs[0].token_ids)
        turns = [first[1], first[0] + answer + prompts((9,), seed=220)[0], system + prompts((30,), seed=320)[0]]
        again = llm.generate([{"prompt_token_ids": p} for p in turns], GREEDY)
        # each resumes after the first prompt's two full blocks (its snapshot), not after the system prompt's 37
        assert engine.stats().prefix_hit_tokens == 3 * 32
        for p, out in zip(turns, again):
            assert list(out.outputs[0].token_ids) == hf_greedy(hf, p, GREEDY.max_tokens)
        engine.scheduler.snapshots.check_whole()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("settings, name", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"num_speculative_tokens": 2}, "num_speculative_tokens"),
    ({"latent_rank": 16}, "latent_rank"),
    ({"kv_cache_dir": "unused-dir"}, "kv_cache_dir"),
    ({"kv_cache_host_bytes": "1MiB"}, "kv_cache_host_bytes"),
])
def test_settings_a_hybrid_does_not_run_with_are_refused_by_name(checkpoint, settings, name):
    path, _ = checkpoint
    with pytest.raises(InvalidParam, match=name) as e:
        LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory="1MiB", **settings)
    assert e.value.param == name


def _config(**changes: Any) -> dict[str, Any]:
    import transformers

    return {**transformers.KimiLinearConfig(**CONFIG).to_dict(), **changes}


def test_config_fields_and_names(checkpoint):
    path, _ = checkpoint
    cfg = ModelConfig.from_pretrained(path)
    lin = cfg.linear_attention
    assert lin is not None and lin.layers == (True, False, True, False)
    assert (lin.num_heads, lin.head_dim, lin.conv_kernel, cfg.num_attention_layers) == (2, 16, 4, 2)
    assert cfg.rope.kind == "none" and cfg.latent_eps == 1e-6 and cfg.q_lora_rank is None
    assert cfg.moe is not None and cfg.moe.moe_layers == (False, True, True, True)
    assert (cfg.moe.n_routed_experts, cfg.moe.scoring_func, cfg.moe.topk_method) == (4, "sigmoid", "noaux_tc")
    rename = FAMILIES["kimi_linear"].rename
    assert rename("model.layers.3.block_sparse_moe.experts.2.w1.weight") == \
        "model.layers.3.mlp.experts.2.gate_proj.weight"
    assert rename("model.layers.0.self_attn.A_log") == "model.layers.0.self_attn.forget_gate.A_log"
    assert rename("model.layers.0.self_attn.q_conv1d.weight") == "model.layers.0.self_attn.q_conv1d.weight"
    original = {k: v for k, v in _config().items() if k not in ("layer_types", "linear_num_heads")}
    original["linear_attn_config"] = {"full_attn_layers": [2, 4], "kda_layers": [1, 3], "num_heads": 2}
    assert ModelConfig.from_dict(original).linear_attention == lin  # the original config's 1-indexed lists


@pytest.mark.parametrize("changes, message", [
    ({"layer_types": ["linear_attention"] * 4}, "at least one full-attention"),
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]},
     "sliding_attention"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types lists 3"),
    ({"mlp_layer_types": ["dense", "sparse", "other", "sparse"]}, "mlp_layer_types"),
])
def test_bad_layer_schedules_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(_config(**changes))


def test_state_slots_and_state_batches_refuse_misuse():
    slots = StateSlots(2)
    a, b = slots.take(), slots.take()
    assert {a, b} == {0, 1} and slots.num_free == 0
    with pytest.raises(RuntimeError, match="no free state slot"):
        slots.take()
    slots.give_back(a)
    with pytest.raises(ValueError, match="not taken"):
        slots.give_back(a)
    with pytest.raises(ValueError, match="one distinct slot per sequence"):
        ForwardBatch.build([[2], [3]], [0, 0], [[0], [1]], 16, state_slots=[1, 1])
    cfg = ModelConfig.from_dict(_config())
    assert cfg.linear_attention is not None
    assert StateCache(cfg.linear_attention, 5).bytes_per_slot == cfg.state_bytes_per_sequence


# -- Ling's hybrid (bailing_hybrid) ---------------------------------------------------------------------------------
BAILING: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, head_dim=16, num_local_experts=8,
    num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32, intermediate_size=96,
    layer_group_size=2, first_k_dense_replace=1, bos_token_id=0, eos_token_id=1, pad_token_id=None,
    max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def build_bailing(**changes: Any):
    """transformers' Ling hybrid (tiny): every matrix at 1/sqrt(fan_in), norms near 1, spread forget rates."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.BailingHybridForCausalLM(tf.BailingHybridConfig(**{**BAILING, **changes}))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("safe_gate", [True, False])
def test_bailing_hybrid_logits_and_greedy_tokens_match_transformers(tmp_path, safe_gate):
    hf = build_bailing(kda_safe_gate=safe_gate)
    hf.save_pretrained(tmp_path)  # Ling's layout: word_embeddings, attention.dense, gate.expert_bias
    model = load_model(tmp_path, dtype="float32")
    assert isinstance(model, HybridForCausalLM) and model.num_cache_layers == 2
    assert all(a.g_proj is not None for a in model.attention_layers())  # the per-head output gate
    ps = prompts((5, 17, 40, 1), seed=2)
    runner = PagedRunner(model, len(ps), max(map(len, ps)))
    for p, got in zip(ps, runner.prefill(ps, 7)):
        ref = hf_logits(hf, p)
        assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-4
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, kv_cache_memory="1MiB", block_size=16)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    finally:
        llm.shutdown()
    for p, out in zip(ps, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, p, GREEDY.max_tokens)


def test_bailing_hybrid_config_and_names():
    import transformers

    raw = transformers.BailingHybridConfig(**BAILING).to_dict()
    cfg = ModelConfig.from_dict(raw)
    lin = cfg.linear_attention
    assert lin is not None and lin.layers == (True, False, True, False) and not lin.low_rank_gates
    assert (lin.num_heads, lin.head_dim, lin.gate_lower_bound) == (4, 16, -5.0)
    assert cfg.attention_head_gate and cfg.rope.kind == "default" and cfg.rope.interleave
    assert cfg.moe is not None and cfg.moe.moe_layers == (False, True, True, True) and cfg.moe.n_group == 2
    assert ModelConfig.from_dict({**raw, "kda_safe_gate": False}).linear_attention.gate_lower_bound is None
    default = {k: v for k, v in raw.items() if k != "layer_types"}
    assert ModelConfig.from_dict({**default, "layer_group_size": 4}).linear_attention.layers == (True,) * 3 + (False,)
    rename = FAMILIES["bailing_hybrid"].rename
    assert rename("model.word_embeddings.weight") == "model.embed_tokens.weight"
    assert rename("model.layers.1.attention.dense.weight") == "model.layers.1.self_attn.o_proj.weight"
    assert rename("model.layers.1.mlp.gate.expert_bias") == "model.layers.1.mlp.gate.e_score_correction_bias"
    assert rename("model.layers.0.attention.f_proj.weight") == "model.layers.0.self_attn.forget_gate.f_proj.weight"
    assert rename("model.layers.0.attention.g_proj.weight") == "model.layers.0.self_attn.g_proj.weight"
    with pytest.raises(ValueError, match="kda_lower_bound"):
        ModelConfig.from_dict({**raw, "kda_lower_bound": 1.0})


def test_the_planner_counts_the_state_slots_beside_the_latent_cache(checkpoint):
    from mla_runtime.load_check import load_requirement
    from mla_runtime.plan import plan_memory
    from mla_runtime.plan_cli import format_report

    path, _ = checkpoint
    cfg = ModelConfig.from_pretrained(path)
    plans = {n: plan_memory(cfg, dtype="float32", device_memory_bytes=2**30, max_seq_len=128, max_num_seqs=n,
                            state_snapshots=0) for n in (1, 9)}
    assert plans[9].state_bytes == 9 * cfg.state_bytes_per_sequence > 0
    assert plans[1].weight_bytes == plans[9].weight_bytes > 0
    budgets = {n: p.cache_budget_bytes + p.activation_bytes for n, p in plans.items()}
    assert budgets[1] - budgets[9] == 8 * cfg.state_bytes_per_sequence  # the activations reserve moves with seqs too
    assert "state cache (hybrid)" in format_report(plans[9], cfg)
    default = plan_memory(cfg, dtype="float32", device_memory_bytes=2**30, max_seq_len=128, max_num_seqs=9)
    assert default.state_snapshots == 9  # the engine's default: one prefix-cache snapshot per sequence
    assert plans[9].cache_budget_bytes - default.cache_budget_bytes == default.state_snapshot_bytes > 0
    assert "state snapshots (hybrid)" in format_report(default, cfg)
    need = {n: load_requirement(cfg, dtype="float32", device="cpu", max_model_len=128, max_num_seqs=n,
                                kv_cache_memory=2**20).cache_bytes for n in (1, 9)}
    assert need[9] - need[1] == 8 * cfg.state_bytes_per_sequence
    snapshots = load_requirement(cfg, dtype="float32", device="cpu", max_model_len=128, max_num_seqs=1,
                                 kv_cache_memory=2**20, state_snapshots=3).cache_bytes
    assert snapshots - need[1] == 3 * cfg.state_bytes_per_sequence  # prefix caching's state snapshots


def test_the_scheduler_admits_a_sequence_only_with_a_free_state_slot():
    from mla_runtime.engine.block_pool import BlockPool
    from mla_runtime.engine.scheduler import Scheduler
    from mla_runtime.engine.sequence import Sequence

    slots = StateSlots(2)
    scheduler = Scheduler(BlockPool(64, 16, False), max_num_seqs=8, max_num_batched_tokens=256, states=slots)
    seqs = [Sequence(i, f"r{i}", 0, [5] * 10, SamplingParams(max_tokens=4)) for i in range(3)]
    for s in seqs:
        scheduler.add(s)
    plan = scheduler.schedule()
    assert [s.seq_id for s in plan.seqs] == [0, 1] and slots.num_free == 0  # the third waits for a slot
    assert {s.state_slot for s in plan.seqs} == {0, 1} and seqs[2].state_slot is None
    scheduler.on_step_done(plan)
    seqs[1].append_token(7)  # sampled: sequence 1 decodes next
    scheduler.finish(seqs[0], "stop")
    assert seqs[0].state_slot is None and slots.num_free == 1
    plan = scheduler.schedule()
    assert [s.seq_id for s in plan.seqs] == [1, 2] and seqs[2].state_slot == 0
    scheduler.finish(seqs[1], "abort")
    scheduler.finish(seqs[2], "abort")
    assert slots.num_free == 2


def test_state_snapshots_pin_evict_and_bound_the_pool_s_prefix_hits():
    from mla_runtime.cache.state_cache import StateSnapshots
    from mla_runtime.engine.block_pool import BlockPool, block_hash

    snaps = StateSnapshots(2)
    a, b = snaps.reserve(), snaps.reserve()
    assert a is not None and b is not None and snaps.reserve() is None  # both pending
    assert snaps.commit(a, 10) and not snaps.commit(b, 10)  # a second snapshot of one hash is given back
    assert snaps.has(10) and snaps.num_free == 2 and snaps.num_committed == 1
    pinned = snaps.acquire(10)
    c = snaps.reserve()
    assert pinned == a and c is not None and snaps.reserve() is None  # the pinned one is never evicted
    snaps.commit(c, 11)
    snaps.forget(10)  # forgotten while pinned: freed at its release
    assert not snaps.has(10) and snaps.num_free == 1
    snaps.release(pinned)
    assert snaps.num_free == 2
    d, e = snaps.reserve(), snaps.reserve()  # the second evicts the idle snapshot of hash 11
    assert snaps.num_evictions == 1 and not snaps.has(11)
    assert d is not None and e is not None
    snaps.discard(d)
    with pytest.raises(AssertionError, match="1 pending"):
        snaps.check_whole()
    snaps.discard(e)
    snaps.check_whole()

    pool = BlockPool(8, 16)
    pool.attach_states(snaps)
    tokens = list(range(2, 50))
    hashes = [block_hash(None, tokens[:16])]
    hashes += [block_hash(hashes[0], tokens[16:32]), block_hash(None, [1] * 16)]
    blocks = pool.allocate(2)
    for blk, h in zip(blocks, hashes):
        pool.register(blk, h)
    pool.free(blocks)
    assert pool.lookup(hashes[:2], 40) == []  # cached blocks, no snapshot: no hit
    s = snaps.reserve()
    assert s is not None
    snaps.commit(s, hashes[0])
    assert pool.lookup(hashes[:2], 40) == blocks[:1] and pool.num_indexed(hashes) == 2  # up to the snapshot
    pool.free(blocks[:1])
    pool.watermark = 1e-9
    pool.relieve_pressure()  # the block goes, its snapshot with it
    assert not snaps.has(hashes[0]) and snaps.num_committed == 0


# -- GLM-5-Next's linear-attention layer (KDA with low-rank gates, A_log [H], bounded forget gate) ---------------------
def test_glm5_next_linear_layer_and_its_state_snapshots_match_transformers():
    """``KimiDeltaAttention`` with ``flat_a_log`` holding transformers' ``Glm5NextTextLinearAttention`` weights: one
    prompt whole, and again in two steps whose first also snapshots its states after 9 tokens (the prefix-cache cut);
    a third run resumed from the snapshot gives the whole prompt's outputs after the cut."""
    from types import SimpleNamespace

    import transformers as tf
    from transformers.models.glm5_next import modeling_glm5_next as glm

    from mla_runtime.config import LinearAttentionConfig
    from mla_runtime.layers.kda import KimiDeltaAttention

    config = tf.Glm5NextTextConfig(hidden_size=48, linear_num_heads=3, linear_head_dim=8, linear_conv_kernel_dim=4,
                                   num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"])
    torch.manual_seed(0)
    hf = glm.Glm5NextTextLinearAttention(config, 0).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(0.5 * torch.randn(p.shape) if name.endswith(("A_log", "dt_bias")) else
                    torch.randn(p.shape) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1) + (p.dim() == 1) * 1.0)
    lin = LinearAttentionConfig(layers=(True, False), num_heads=3, head_dim=8, conv_kernel=4,
                                gate_lower_bound=config.linear_lower_bound, flat_a_log=True)
    cfg = SimpleNamespace(linear_attention=lin, hidden_size=48, rms_norm_eps=config.rms_norm_eps)
    ours = KimiDeltaAttention(cfg, torch.float32, 0)  # type: ignore[arg-type]
    missing = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not missing.missing_keys and not missing.unexpected_keys
    x = torch.randn(1, 23, 48)
    with torch.no_grad():
        ref = hf(x)[0]
    states = StateCache(lin, 2, num_snapshots=2)
    layer_state = states.layers[0]
    row, decode_row = states.snapshot_row(0), states.snapshot_row(1)

    def run(start: int, end: int, slot: int, snapshots=()) -> torch.Tensor:
        batch = ForwardBatch.build([[2] * (end - start)], [start], [[0, 1]], 16, state_slots=[slot],
                                   state_snapshots=snapshots)
        return ours(x[0, start:end], batch, layer_state)

    whole = run(0, 23, 0)
    first = run(0, 14, 1, [(0, 9, row)])  # a prefill chunk cut after 9 tokens
    one = run(14, 15, 1, [(0, 1, decode_row)])  # a one-token step (a decode row) snapshotting after it
    rest = run(15, 23, 1)
    states.copy_row(row, 1)  # prefix hits after 9 and 15 tokens
    resumed = run(9, 23, 1)
    states.copy_row(decode_row, 0)
    resumed_later = run(15, 23, 0)
    for got, want in ((whole, ref), (torch.cat([first, one, rest]), ref), (resumed, ref[9:]),
                      (resumed_later, ref[15:])):
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
