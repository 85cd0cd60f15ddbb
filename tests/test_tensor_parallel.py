"""Tensor parallelism on CPU (gloo, 2 ranks): one scheduler, shards sharing its block ids."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from mla_runtime import LLM, SamplingParams
from mla_runtime.config import ModelConfig
from mla_runtime.engine.tp_workers import RankDiedError
from mla_runtime.plan import plan_memory
from tests.test_engine import make_prompts, tokens

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
BLOCK = 32
BYTES_PER_TOKEN = (32 + 16) * 3 * 4  # tiny v3: (d_c + d_r) x layers x fp32


def workload():
    """Prompts sharing a 2-block prefix (prefix hits) plus unrelated ones."""
    shared = make_prompts(1, seed=21, lo=64, hi=64)[0]["prompt_token_ids"]
    hits = [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in make_prompts(3, seed=22, lo=3, hi=20)]
    return hits + make_prompts(7, seed=23, lo=20, hi=70)


def run(path, tp: int, layout: str = "replicated", blocks: int = 14):
    per_rank = BYTES_PER_TOKEN // tp if layout == "sharded" else BYTES_PER_TOKEN
    llm = LLM(str(path), dtype="float32", max_model_len=256, block_size=BLOCK, tensor_parallel_size=tp,
              latent_cache_layout=layout, kv_cache_memory=blocks * BLOCK * per_rank, max_num_batched_tokens=128)
    try:
        out = llm.generate(workload()[:1], PARAMS) + llm.generate(workload()[1:], PARAMS)
        stats = llm.engine.stats()
        llm.engine.pool.check_whole()
        return tokens(out), stats, llm.engine
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    path, _ = tiny_checkpoint("v3")
    return run(path, 1)


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_two_ranks_equal_one_rank(tiny_checkpoint, reference, layout):
    path, _ = tiny_checkpoint("v3")
    ref_tokens, ref_stats, _ = reference
    assert ref_stats.num_preemptions > 0 and ref_stats.prefix_hit_tokens > 0  # the workload is real
    got, stats, engine = run(path, 2, layout, blocks=14 if layout == "replicated" else 14)
    assert got == ref_tokens
    assert stats.prefix_hit_tokens > 0
    assert stats.num_preemptions > 0
    # per-rank cache bytes: sharded keeps 1/N of every token's latent on each rank
    assert engine.worker.bytes_per_token == BYTES_PER_TOKEN
    expected_per_rank = BYTES_PER_TOKEN // 2 if layout == "sharded" else BYTES_PER_TOKEN
    assert engine.worker.bytes_per_token_per_rank == expected_per_rank
    assert engine.worker.cache.nbytes() == engine.pool.num_blocks * BLOCK * expected_per_rank


def test_sharded_layout_fits_n_times_the_tokens(tiny_checkpoint):
    path, _ = tiny_checkpoint("v3")
    budget = 40 * BLOCK * BYTES_PER_TOKEN
    engines = {}
    for layout in ("replicated", "sharded"):
        llm = LLM(str(path), dtype="float32", max_model_len=256, block_size=BLOCK, tensor_parallel_size=2,
                  latent_cache_layout=layout, kv_cache_memory=budget)
        engines[layout] = (llm.engine.pool.num_blocks, llm.engine.worker.cache.nbytes())
        llm.shutdown()
    assert engines["sharded"][0] == 2 * engines["replicated"][0] == 80
    assert engines["sharded"][1] == engines["replicated"][1] == budget
    cfg = ModelConfig.from_pretrained("deepseek-v3")
    plans = {layout: plan_memory(cfg, dtype="bfloat16", device_memory_bytes=141 * 2**30, max_seq_len=32768,
                                 max_num_seqs=16, tensor_parallel_size=16, latent_cache_layout=layout)
             for layout in ("replicated", "sharded")}
    assert plans["sharded"].cache_bytes_per_token_per_rank * 16 == plans["replicated"].cache_bytes_per_token_per_rank
    assert plans["sharded"].max_tokens == 16 * plans["replicated"].max_tokens


def test_indivisible_heads_fail_at_start_saying_what_to_change(tiny_checkpoint):
    path, _ = tiny_checkpoint("v3")
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\).*candidates: \[1, 2, 4\]"):
        LLM(str(path), dtype="float32", tensor_parallel_size=3, kv_cache_memory="4MiB", max_model_len=256)


def test_dead_rank_fails_fast(tiny_checkpoint):
    path, _ = tiny_checkpoint("v3")
    llm = LLM(str(path), dtype="float32", max_model_len=256, block_size=BLOCK, tensor_parallel_size=2,
              kv_cache_memory="4MiB")
    try:
        assert len(llm.generate(make_prompts(2, seed=30), PARAMS)) == 2
        worker = llm.engine.tp_group.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(RankDiedError, match="rank 1"):
            llm.generate(make_prompts(2, seed=31), PARAMS)
        assert time.monotonic() - start < 15
    finally:
        llm.shutdown()


def test_an_idle_engine_outlives_the_collective_timeout(tiny_checkpoint, monkeypatch):
    """Workers wait for rank 0's next command on a group without the collectives' deadline: an engine left idle for
    longer than that timeout still serves (a worker giving up after it, a minute by default, would fail the next
    request with a dead rank)."""
    from mla_runtime.engine import tp_workers

    monkeypatch.setattr(tp_workers, "COLLECTIVE_TIMEOUT_S", 3.0)  # passed to the spawned ranks
    path, _ = tiny_checkpoint("v3")
    with LLM(str(path), dtype="float32", max_model_len=256, block_size=BLOCK, tensor_parallel_size=2,
             kv_cache_memory="4MiB") as llm:
        first = tokens(llm.generate(make_prompts(2, seed=30), PARAMS))
        time.sleep(5.0)  # idle past the timeout
        assert tokens(llm.generate(make_prompts(2, seed=30), PARAMS)) == first


TORCHRUN_SCRIPT = """
import json, sys
from mla_runtime import LLM, SamplingParams
if __name__ == "__main__":
    path, prompts = sys.argv[1], json.loads(sys.argv[2])
    with LLM(path, dtype="float32", max_model_len=256, kv_cache_memory="4MiB", block_size=32,
             tensor_parallel_size=2, latent_cache_layout="sharded") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def test_torchrun_starts_every_rank_from_one_script(tiny_checkpoint, tmp_path):
    """``torchrun --nproc-per-node 2 script.py``: rank 0 is the engine, rank 1 serves its steps and exits."""
    import json
    import subprocess
    import sys

    path, _ = tiny_checkpoint("v3")
    prompts = make_prompts(3, seed=40)
    script = tmp_path / "serve.py"
    script.write_text(TORCHRUN_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(script), str(path), json.dumps(prompts)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(lines) == 1  # only rank 0 returns from LLM(); rank 1 exits inside it
    expected = run_single(path, prompts)
    assert json.loads(lines[0].split(" ", 1)[1]) == expected


def run_single(path, prompts) -> list[list[int]]:
    with LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory="4MiB", block_size=32) as llm:
        return tokens(llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))


DEMO = os.path.join(os.path.dirname(__file__), "..", "mla_runtime", "demo_model")
CALIBRATION = "".join(f"def step_{i}(items, count):\n    return [x * {i} for x in items if x > count]\n"
                      for i in range(60))


def run_truncated(tp: int, layout: str, method: str, calibration: str):
    with LLM(DEMO, dtype="float32", max_model_len=256, block_size=32, kv_cache_memory="2MiB",
             tensor_parallel_size=tp, latent_cache_layout=layout, latent_rank=48, latent_projection=method,
             latent_calibration=calibration) as llm:
        outs = llm.generate(["def load(path):\n    with open(path) as f:", "class Counter:\n    def __init__(self"],
                            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0))
        engine = llm.engine
        engine.pool.check_whole()
        widths = (engine.worker.model_config.kv_lora_rank, engine.worker.cache.layers[0].kv.shape[-1],
                  engine.worker.bytes_per_token_per_rank)
        samples = [o.outputs[0] for o in outs]
        return ([c.token_ids for c in samples], [lp[t] for c in samples for t, lp in zip(c.token_ids, c.logprobs)],
                widths)


@pytest.mark.parametrize("layout,method", [("replicated", "pca"), ("sharded", "svd")])
def test_latent_rank_under_two_ranks_equals_one_rank(tmp_path, layout, method):
    """Every rank folds the same basis (computed on rank 0 from the whole kv_b_proj) into its own heads."""
    calibration = tmp_path / "calibration.txt"
    calibration.write_text(CALIBRATION)
    ref_tokens, ref_logp, ref_widths = run_truncated(1, "replicated", method, str(calibration))
    tokens_, logp, widths = run_truncated(2, layout, method, str(calibration))
    assert tokens_ == ref_tokens
    assert logp == pytest.approx(ref_logp, abs=1e-3)
    # the cache holds r + d_r values per token on every rank; the sharded layout keeps half of the tokens
    assert ref_widths == (48, 48 + 16, (48 + 16) * 4 * 4)  # d_r 16, 4 layers, fp32
    assert widths[:2] == (48, 48 + 16)
    assert widths[2] == ref_widths[2] // (2 if layout == "sharded" else 1)


def test_rank_zero_failing_before_truncation_stops_the_workers(tmp_path):
    import multiprocessing

    with pytest.raises(FileNotFoundError):
        LLM(DEMO, dtype="float32", max_model_len=256, kv_cache_memory="2MiB", tensor_parallel_size=2,
            latent_rank=48, latent_projection="pca", latent_calibration=str(tmp_path / "missing.txt"))
    deadline = time.monotonic() + 15
    while any(p.name.startswith("mla-tp-rank") for p in multiprocessing.active_children()):
        assert time.monotonic() < deadline, "a worker rank outlived the failed engine"
        time.sleep(0.1)


def test_speculative_decoding_under_two_ranks(tiny_checkpoint, reference):
    """Every rank computes the logits of all of a speculative step's tokens (the lm_head is vocab-sharded)."""
    path, _ = tiny_checkpoint("v3")
    ref_tokens, _, _ = reference
    llm = LLM(str(path), dtype="float32", max_model_len=256, block_size=BLOCK, tensor_parallel_size=2,
              kv_cache_memory=14 * BLOCK * BYTES_PER_TOKEN, max_num_batched_tokens=128, num_speculative_tokens=3)
    try:
        loop = {"prompt_token_ids": [11, 12, 13, 14] * 8}
        out = llm.generate(workload()[:1], PARAMS) + llm.generate(workload()[1:], PARAMS)
        assert tokens(out) == ref_tokens
        single = run_single_plain(path, loop)
        assert tokens(llm.generate([loop], PARAMS)) == single
        assert llm.engine.stats().num_draft_tokens > 0
        llm.engine.pool.check_whole()
    finally:
        llm.shutdown()


def run_single_plain(path, prompt) -> list[list[int]]:
    with LLM(str(path), dtype="float32", max_model_len=256, block_size=BLOCK, kv_cache_memory="4MiB") as llm:
        return tokens(llm.generate([prompt], PARAMS))


def test_a_rank_slower_to_load_than_the_collective_timeout_still_starts(tiny_checkpoint, monkeypatch, caplog):
    """Rank 0 waits for the other ranks to load their shards up to ``MLA_TP_WAIT_S``, not the collectives' timeout, and
    logs the wait: a worker rank loading 6 s longer than rank 0 under a 3 s collective timeout still starts (a
    real-size shard on a slower disk may load minutes after rank 0's)."""
    from mla_runtime.engine import tp_workers

    monkeypatch.setattr(tp_workers, "COLLECTIVE_TIMEOUT_S", 3.0)  # passed to the spawned ranks
    monkeypatch.setattr(tp_workers, "WAIT_LOG_S", 1.0)
    monkeypatch.setenv("MLA_FAULT_INJECTION", "slow_load:6")
    path, _ = tiny_checkpoint("v3")
    with caplog.at_level(logging.INFO, logger="mla_runtime"):
        with LLM(str(path), dtype="float32", max_model_len=256, block_size=BLOCK, tensor_parallel_size=2,
                 kv_cache_memory="4MiB") as llm:
            assert len(tokens(llm.generate(make_prompts(2, seed=31), PARAMS))[0]) == PARAMS.max_tokens
    waits = [r.getMessage() for r in caplog.records if "to load their shards" in r.getMessage()]
    assert waits and "MLA_TP_WAIT_S" in waits[0]


def test_a_start_that_outwaits_MLA_TP_WAIT_S_fails_naming_it(tiny_checkpoint, monkeypatch):
    """Past ``MLA_TP_WAIT_S`` the start fails, saying what it waited for and which variable bounds it, and the ranks
    are stopped. (The bound, 4 s, leaves a busy machine's ranks time to join before the load it times out.)"""
    monkeypatch.setenv("MLA_TP_WAIT_S", "4")
    monkeypatch.setenv("MLA_FAULT_INJECTION", "slow_load:12")
    path, _ = tiny_checkpoint("v3")
    start = time.monotonic()
    with pytest.raises(RankDiedError, match="did not load their shards within 4 s.*MLA_TP_WAIT_S"):
        LLM(str(path), dtype="float32", max_model_len=256, block_size=BLOCK, tensor_parallel_size=2,
            kv_cache_memory="4MiB")
    assert time.monotonic() - start < 30
    monkeypatch.setenv("MLA_TP_WAIT_S", "soon")
    with pytest.raises(ValueError, match="MLA_TP_WAIT_S='soon'"):
        LLM(str(path), dtype="float32", max_model_len=256, block_size=BLOCK, tensor_parallel_size=2,
            kv_cache_memory="4MiB")
