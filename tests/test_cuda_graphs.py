"""Decode steps under CUDA graphs, on a CPU through the stand-in (``cuda_graph_mode="stand-in"``): the same runner,
static buffers, padding and bucket choice, each "replay" the step run eagerly on the buffers. What it cannot test here
is the capture itself (``torch.cuda.graph``): that needs a GPU (``bench/gpu_e2e.py`` runs it with graphs on and off).
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.engine import cuda_graphs
from mla_runtime.engine.cuda_graphs import DecodeGraphs, count_host_syncs, default_sizes
from mla_runtime.engine.worker import StepInput
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.layers.moe import Experts
from mla_runtime.serving.config import resolve
from tests.checkpoints import VOCAB, YARN, _v3_config, save_checkpoint

SIZES = [1, 2, 4]  # buckets of the tests: batch 3 pads to 4; batch 6 is larger than the largest and runs eagerly
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_prompts(n: int, seed: int, shared: list[int] | None = None) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": (shared or []) + [rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 40))]}
            for _ in range(n)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def new_llm(path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "4MiB")
    kw.setdefault("attention_backend", "torch")
    return LLM(str(path), dtype="float32", max_model_len=256, block_size=16, max_num_seqs=8, **kw)


def graphs_of(llm: LLM) -> DecodeGraphs:
    graphs = llm.engine.runner.graphs
    assert graphs is not None and llm.engine.worker.graphs is graphs
    return graphs


@pytest.fixture(scope="module")
def v3(tiny_checkpoint):
    return tiny_checkpoint("v3")


@pytest.fixture(scope="module")
def pair(v3):
    """An eager engine and a stand-in one over the same checkpoint, buckets 1, 2, 4."""
    path, _ = v3
    return new_llm(path), new_llm(path, cuda_graph_mode="stand-in", cuda_graph_sizes=SIZES)


def test_default_buckets_and_the_settings():
    assert default_sizes(64) == (1, 2, 4, *range(8, 65, 8))
    assert default_sizes(3) == (1, 2, 4) and default_sizes(1) == (1,)
    assert default_sizes(100)[-1] == 104 and default_sizes(4096)[-1] == 512
    engine, _ = resolve(["--model", "x/y", "--cuda-graph-sizes", "8,1,2", "--enforce-eager",
                         "--cuda-graph-mode", "stand-in"], env={})
    assert (engine.cuda_graph_sizes, engine.enforce_eager, engine.cuda_graph_mode) == ((1, 2, 8), True, "stand-in")
    engine, _ = resolve(["--model", "x/y"], env={})
    assert (engine.cuda_graph_sizes, engine.enforce_eager, engine.cuda_graph_mode) == (None, False, "capture")


def test_the_settings_from_yaml_and_their_errors(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model: {path: x/y}\nengine: {cuda_graph_sizes: [4, 1], enforce_eager: true}\n")
    engine, _ = resolve(["--config", str(path)], env={})
    assert engine.cuda_graph_sizes == (1, 4) and engine.enforce_eager
    path.write_text("model: {path: x/y}\nengine: {cuda_graph_sizes: [0, 1]}\n")
    with pytest.raises(ValueError, match=r"cuda_graph_sizes.*engine\.cuda_graph_sizes / --cuda-graph-sizes"):
        resolve(["--config", str(path)], env={})
    with pytest.raises(ValueError, match="cuda_graph_mode"):
        resolve(["--model", "x/y", "--cuda-graph-mode", "always"], env={})


def test_enforce_eager_means_no_runner_and_a_cpu_captures_nothing(pair, v3):
    eager, _ = pair
    assert eager.engine.runner.graphs is None and eager.engine.worker.graphs is None  # capture mode: CUDA only
    forced = new_llm(v3[0], cuda_graph_mode="stand-in", enforce_eager=True)
    assert forced.engine.runner.graphs is None and forced.engine.worker.graphs is None
    cpu_backend = new_llm(v3[0], cuda_graph_mode="stand-in", attention_backend=None)  # the CPU backend: off
    assert cpu_backend.engine.runner.graphs is None


def test_padding_rows_never_change_real_rows(pair):
    _, llm = pair
    worker, graphs = llm.engine.worker, graphs_of(llm)
    cache = worker.cache
    assert cache is not None and graphs.block_tables.shape[1] == 256 // 16  # fixed width: max_model_len's blocks
    rng = random.Random(5)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (20, 7, 33, 16)]
    tables = [[1, 2, 3], [4], [5, 6, 7], [8, 9]]  # blocks of 16; block 0 (the padding rows' key) is left unused
    worker.execute(StepInput(prompts, [0] * 4, tables, []))  # prefill into the cache
    step = StepInput([[p[-1] + 1] for p in prompts[:3]], [len(p) for p in prompts[:3]], tables[:3], [0, 1, 2])
    before = [layer.kv.clone() for layer in cache.layers]
    with torch.inference_mode():
        padded = graphs.run(step)  # 3 rows in the bucket of 4
    assert padded is not None and padded.shape[0] == 3 and graphs.runs[4] == 1
    # the buffers hold the step's rows, then one padding row: token 0 at position 0, slot -1, one key of block 0
    assert graphs.ids64[:, :4].tolist() == [[p[-1] + 1 for p in prompts[:3]] + [0], [20, 7, 33, 0],
                                            [2 * 16 + 4, 4 * 16 + 7, 7 * 16 + 1, -1]]
    assert graphs.ints32[:, :4].tolist() == [[21, 8, 34, 1], [20, 7, 33, 0]]
    assert graphs.block_tables[3, 0] == cuda_graphs.PAD_BLOCK
    # the padding row wrote nothing: only the three real slots changed, in every layer
    written = torch.zeros(cache.layers[0].kv.shape[:2], dtype=torch.bool)
    for slot in (2 * 16 + 4, 4 * 16 + 7, 7 * 16 + 1):
        written[slot // 16, slot % 16] = True
    for old, layer in zip(before, cache.layers):
        assert torch.equal(old[~written], layer.kv[~written])
    # a fourth real row in the padding row's place leaves the three rows as they were (up to the rounding of the
    # experts' products, whose row counts change with the routing of the fourth row)
    step4 = StepInput(step.token_chunks + [[prompts[3][-1] + 1]], step.context_lens + [16], tables, [0, 1, 2, 3])
    with torch.inference_mode():
        full = graphs.run(step4)
    assert full is not None
    torch.testing.assert_close(full[:3], padded, rtol=1e-6, atol=1e-6)
    # and the eager step of the three rows alone agrees (up to the rounding of a 3-row product against a 4-row one)
    with torch.inference_mode():
        eager = worker.forward(ForwardBatch.build(step.token_chunks, step.context_lens, step.block_tables, 16))
    torch.testing.assert_close(eager, padded, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch,bucket", [(1, 1), (3, 4), (4, 4), (6, None)])
def test_greedy_equals_eager_for_every_bucket(pair, batch, bucket):
    eager, llm = pair
    graphs = graphs_of(llm)
    graphs.runs.clear()
    prompts = make_prompts(batch, seed=batch)
    assert tokens(llm.generate(prompts, GREEDY)) == tokens(eager.generate(prompts, GREEDY))
    if bucket is None:  # larger than the largest bucket: every step eager
        assert not graphs.runs
    else:
        assert graphs.runs[bucket] == GREEDY.max_tokens - 1 and set(graphs.runs) == {bucket}
    llm.engine.pool.check_whole()


def test_greedy_equals_eager_with_prefix_hits_and_preemption(v3):
    path, _ = v3
    rng = random.Random(9)
    shared = [rng.randrange(2, VOCAB) for _ in range(32)]  # two blocks of 16
    prompts = make_prompts(10, seed=11, shared=shared)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tight = dict(kv_cache_memory=18 * 16 * (32 + 16) * 3 * 4)  # 18 blocks of 16 tokens, fp32: preemption
    eager = new_llm(path, **tight)
    llm = new_llm(path, cuda_graph_mode="stand-in", **tight)  # default buckets: 1, 2, 4, 8
    graphs = graphs_of(llm)
    assert graphs.sizes == (1, 2, 4, 8)
    want = tokens(eager.generate(prompts, params))
    assert tokens(llm.generate(prompts, params)) == want
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.stats().prefix_hit_tokens > 0
    assert sum(graphs.runs.values()) > 0
    llm.engine.pool.check_whole()


def test_the_triton_kernels_through_the_buffers_equal_eager(v3):
    path, _ = v3
    prompts = make_prompts(3, seed=2)
    eager = new_llm(path, attention_backend="triton")
    llm = new_llm(path, attention_backend="triton", cuda_graph_mode="stand-in", cuda_graph_sizes=[4])
    assert tokens(llm.generate(prompts, GREEDY)) == tokens(eager.generate(prompts, GREEDY))
    assert graphs_of(llm).runs[4] == GREEDY.max_tokens - 1


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    """The v3 checkpoint's shape with dense MLPs on every layer (no routed experts)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(_v3_config(rope_parameters=YARN, first_k_dense_replace=3)).eval()
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt_dense"))


def test_no_host_sync_inside_the_step(dense_checkpoint, v3):
    with count_host_syncs() as found:
        torch.ones(2).tolist()
        assert bool(torch.ones(1))
    assert [s.split(" at ")[0] for s in found] == ["tolist", "__bool__"] and "__bool__" not in torch.Tensor.__dict__
    llm = new_llm(dense_checkpoint, attention_backend="triton", cuda_graph_mode="stand-in", cuda_graph_sizes=[1, 4])
    graphs = graphs_of(llm)
    graphs.check_syncs = True
    assert graphs.syncs == {}  # the warm-up of every bucket read nothing back
    for batch in (1, 3):
        graphs.runs.clear()
        llm.generate(make_prompts(batch, seed=batch), SamplingParams(max_tokens=3, temperature=0.0))
        assert graphs.runs and graphs.last_syncs == []
    # routed experts: on a CPU they group their pairs on the host (layers/moe.py); on CUDA they group on the device
    # and run as grouped Triton products (mla_kernels.grouped_gemm), which a CPU runs through the interpreter here
    moe = new_llm(v3[0], attention_backend="triton", cuda_graph_mode="stand-in", cuda_graph_sizes=[4])
    assert moe.engine.runner.graphs is not None
    assert moe.engine.runner.graphs.syncs[4] and all("layers/moe.py" in s for s in moe.engine.runner.graphs.syncs[4])
    prompts = make_prompts(3, seed=5)
    want = tokens(moe.generate(prompts, GREEDY))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Experts, "device_grouping", True)
        grouped = new_llm(v3[0], attention_backend="triton", cuda_graph_mode="stand-in", cuda_graph_sizes=[4])
        graphs = graphs_of(grouped)
        assert graphs.syncs == {}
        graphs.check_syncs = True
        assert tokens(grouped.generate(prompts, GREEDY)) == want
        assert graphs.runs[4] and graphs.last_syncs == []


def test_a_capture_failure_logs_and_falls_back_to_eager(pair, v3, monkeypatch, caplog):
    eager, _ = pair
    capture = DecodeGraphs.capture

    def failing(self, size):
        if size == 4:
            raise RuntimeError("simulated capture failure")
        return capture(self, size)

    monkeypatch.setattr(DecodeGraphs, "capture", failing)
    with caplog.at_level(logging.WARNING, logger="mla_runtime"):
        llm = new_llm(v3[0], cuda_graph_mode="stand-in", cuda_graph_sizes=SIZES)
    graphs = graphs_of(llm)
    assert set(graphs.replays) == {1, 2} and "simulated capture failure" in graphs.failures[4]
    assert "decode steps of 4 sequences: no CUDA graph (RuntimeError: simulated capture failure)" in caplog.text
    prompts = make_prompts(3, seed=3)
    assert tokens(llm.generate(prompts, GREEDY)) == tokens(eager.generate(prompts, GREEDY))
    assert not graphs.runs  # batch 3's bucket is 4, which failed: eager
