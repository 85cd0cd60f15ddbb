"""DeepSeek-V4 through the engine: ``LLM`` and the HTTP server load a tiny ``deepseek_v4`` checkpoint built by
transformers' classes and serve it over state slots. Requests admitted, chunked, preempted and aborted at every stage
leave every slot, every slot's state and every block free; the start-up facts (bytes per token of the compressed
entries, fixed bytes per sequence, the state snapshots' budget) are the planner's; the settings V4 does not run with
are refused by name; two ranks serve it, their greedy tokens one rank's and transformers'. Greedy tokens against
transformers: ``tests/test_conformance.py`` (``deepseek_v4`` cells); prefix hits against a cold engine and
transformers: ``tests/test_v4_prefix_cache.py``."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.errors import InvalidParam
from mla_runtime.models.deepseek_v4 import V4Config, load_deepseek_v4, state_bytes
from mla_runtime.models.v4_sizes import cache_kinds
from mla_runtime.serving.metrics import EngineCollector
from mla_runtime.v4_plan import plan_v4
from tests.test_families_v4 import CONFIG, build, prompts

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("deepseek_v4_serving")
    build().save_pretrained(path)
    return path


def test_aborts_preemption_and_chunks_free_every_slot_state_and_block(checkpoint: Path) -> None:
    per_token = cache_kinds(V4Config.from_raw({**CONFIG, "model_type": "deepseek_v4"}), 4).block_bytes_per_token
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=64, block_size=16, max_num_seqs=3,
              max_num_batched_tokens=24, kv_cache_memory=str(per_token * 16 * 5))
    engine = llm.engine
    slots, states = engine.scheduler.states, engine.worker.states
    assert slots is not None and slots.num_slots == 3 and states is not None
    rng = random.Random(4)
    try:
        for i in range(6):
            p = [rng.randrange(2, CONFIG["vocab_size"]) for _ in range(rng.randint(20, 44))]
            engine.add_request(f"r{i}", {"prompt_token_ids": p},
                               SamplingParams(max_tokens=rng.randint(4, 8), ignore_eos=True))
        step = 0
        while engine.has_unfinished_requests():
            engine.step()
            step += 1
            taken = [s.state_slot for s in engine.scheduler.running]
            assert None not in taken and len(set(taken)) == len(taken) == slots.num_slots - slots.num_free
            # a slot holds a state only while its sequence runs
            assert {i for i, st in enumerate(states.slots) if st is not None} <= set(taken)
            if step % 5 == 0 and engine.requests:  # abort one at any stage: queued, prefilling, decoding
                engine.abort(rng.choice(sorted(engine.requests)))
        assert engine.scheduler.num_preemptions > 0  # the small cache preempted some
        assert slots.num_free == slots.num_slots and states.nbytes() == 0
        engine.pool.check_whole()
    finally:
        llm.shutdown()


def test_engine_info_is_the_planners_and_prefix_caching_takes_sized_snapshots(checkpoint: Path) -> None:
    cfg = V4Config.from_raw({**CONFIG, "model_type": "deepseek_v4"})
    kinds = cache_kinds(cfg, 4)
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=96, block_size=16, max_num_seqs=2,
              kv_cache_memory="64KiB")
    try:
        info = llm.engine.info()
        assert info.family == "deepseek_v4" and info.layers == 4 and info.d_c + info.d_r == 32
        assert info.cache_bytes_per_token == kinds.block_bytes_per_token
        assert info.state_bytes_per_sequence == kinds.fixed_bytes
        assert info.state_bytes == 2 * kinds.fixed_bytes  # the slots' fixed part, set aside
        # prefix caching on: by default room for one snapshot of max_model_len tokens per slot, each snapshot as
        # large as the whole state at its prefix's end; as many ids as snapshots of one block fit
        assert info.prefix_caching and llm.engine.pool.enable_prefix_caching
        assert info.state_snapshot_bytes == 2 * state_bytes(cfg, 96, 4)
        assert info.state_snapshots == info.state_snapshot_bytes // state_bytes(cfg, 16, 4)
        metrics = {(m.name, tuple(x.labels.items())): x.value
                   for m in EngineCollector(llm.engine.stats, info, "tiny").collect() for x in m.samples}
        assert metrics[("mla_memory_bytes", (("part", "state_snapshots"),))] == info.state_snapshot_bytes
    finally:
        llm.shutdown()
    for settings in ({"state_snapshot_memory": 0}, {"enable_prefix_caching": False}):
        llm = LLM(str(checkpoint), dtype="float32", max_model_len=96, kv_cache_memory="64KiB", **settings)
        try:
            info = llm.engine.info()
            assert not info.prefix_caching and info.state_snapshots == info.state_snapshot_bytes == 0
            assert llm.engine.scheduler.snapshots is None and not llm.engine.pool.enable_prefix_caching
        finally:
            llm.shutdown()
    with pytest.raises(InvalidParam, match="state_snapshot_memory") as e:
        LLM(str(checkpoint), dtype="float32", max_model_len=96, block_size=16, kv_cache_memory="64KiB",
            state_snapshot_memory=1000)
    assert f"{state_bytes(cfg, 16, 4):,} B" in str(e.value)


@pytest.mark.parametrize("settings, name", [
    ({"num_speculative_tokens": 2}, "num_speculative_tokens"),
    ({"tensor_parallel_size": 2, "latent_cache_layout": "sharded", "block_size": 32}, "latent_cache_layout"),
    ({"kv_cache_dir": "unused-dir", "tensor_parallel_size": 2}, "kv_cache_dir"),  # the tiers: on one rank
    ({"latent_rank": 16}, "latent_rank"),
    ({"quantization": "int8"}, "quantization"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ({"dtype": "float16"}, "dtype"),
    ({"kv_cache_host_bytes": "1MiB", "tensor_parallel_size": 2}, "kv_cache_host_bytes"),
])
def test_settings_v4_does_not_run_with_are_refused_by_name(checkpoint: Path, settings: dict, name: str) -> None:
    with pytest.raises(InvalidParam, match=name) as e:
        LLM(str(checkpoint), max_model_len=64, kv_cache_memory="1MiB", **settings)
    assert e.value.param == name and "deepseek_v4" in str(e.value)


def test_the_server_serves_deepseek_v4(checkpoint: Path) -> None:
    from tests.test_server import Live, wait_idle

    live = Live(checkpoint, engine={"max_model_len": 96, "kv_cache_memory": "64KiB", "max_num_seqs": 2})
    try:
        p = list(range(2, 40))
        r = httpx.post(live.base + "/generate", json={"prompt": p, "max_tokens": 4, "temperature": 0,
                                                      "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        ref = LLM(str(checkpoint), dtype="float32", max_model_len=96, kv_cache_memory="64KiB")
        try:
            assert r.json()["token_ids"] == ref.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids
        finally:
            ref.shutdown()
        after = wait_idle(live)
        assert after[("mla_running_sequences",)] == 0 and after[("mla_latent_cache_blocks_used",)] == 0
    finally:
        live.stop()


def test_two_ranks_serve_deepseek_v4(checkpoint: Path) -> None:
    """``tensor_parallel_size=2``: a batch of prompts past the window and several compressed entries of each kind,
    fewer slots than prompts (a slot given back is taken again), then a prompt again (resumed on every rank from its
    state snapshot); each rank holds half the heads, output groups, experts and vocabulary, and the whole state of
    every sequence; the greedy tokens are one rank's and transformers'."""
    ps = [p for p in prompts() if len(p) > 40] + [prompts()[3]]  # 45, 70 and 19 tokens
    one = load_deepseek_v4(checkpoint)
    want = [one.generate_greedy(p, GREEDY.max_tokens) for p in ps]
    hf = build()
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, min_new_tokens=4)[0, len(p):].tolist()
               for p in ps]
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=96, kv_cache_memory="64KiB", max_num_seqs=2,
              max_num_batched_tokens=32, tensor_parallel_size=2)
    try:
        got = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
        w = llm.engine.worker
        attn, moe = w.own_model.model.layers[1].self_attn, w.own_model.model.layers[1].mlp
        assert (attn.heads, attn.groups, moe.experts.sizes[0]) == (2, 1, 2)
        held = sum(t.numel() * t.element_size() for t in (*w.own_model.parameters(), *w.own_model.buffers()))
        plan = plan_v4({**CONFIG, "model_type": "deepseek_v4"}, dtype="float32", device_memory_bytes=2**30, ranks=2)
        assert w.weight_bytes == held == plan.weight_bytes_per_rank < plan.weight_bytes
        again = llm.generate([{"prompt_token_ids": ps[1]}], GREEDY)[0]
        assert again.num_cached_tokens > 0 and list(again.outputs[0].token_ids) == want[1]
        # the slot given back after the last step reaches the other rank with the next one
        released, _ = w.take_state_releases()
        assert released and w.states.nbytes() == 0 and w.take_state_releases() == ([], [])
    finally:
        llm.shutdown()
    assert got == want == ref


def test_a_rank_count_that_does_not_split_v4_is_refused_by_name(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads \(4\).*candidates: \[1, 2\]"):
        LLM(str(checkpoint), max_model_len=64, kv_cache_memory="1MiB", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="o_groups"):
        plan_v4({**CONFIG, "model_type": "deepseek_v4"}, device_memory_bytes=2**30, ranks=4)
