"""Tensor parallelism on GPUs: one GPU per rank, NCCL for the tensors and gloo for rank 0's step messages.

The device and backend choices are checked on any machine; the ranks themselves run only where there are at least two
CUDA GPUs (``bench/gpu_check.sh`` runs this file on a GPU machine)."""

from __future__ import annotations

import pytest
import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.tp_workers import collective_backend
from mla_runtime.engine.worker import rank_device
from tests.test_engine import make_prompts, tokens

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def fake_gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_each_rank_takes_its_own_gpu(monkeypatch):
    fake_gpus(monkeypatch, 4)
    assert [rank_device(None, 4, r) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    assert rank_device(None, 1, 0) == torch.device("cuda")
    assert rank_device("cuda:3", 2, 1) == torch.device("cuda", 3)  # a device named whole is kept
    assert rank_device("cpu", 2, 1) == torch.device("cpu")
    assert collective_backend(EngineConfig(model="m", tensor_parallel_size=4), 4) == "cpu:gloo,cuda:nccl"
    assert collective_backend(EngineConfig(model="m", tensor_parallel_size=4, device="cpu"), 4) == "gloo"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device(None, 4, 3) == torch.device("cuda", 1)  # torchrun: the rank on this machine picks the GPU


def test_fewer_gpus_than_ranks_run_on_cpus(monkeypatch):
    fake_gpus(monkeypatch, 1)
    assert rank_device(None, 2, 1) == torch.device("cpu")
    assert collective_backend(EngineConfig(model="m", tensor_parallel_size=2), 2) == "gloo"
    fake_gpus(monkeypatch, 0)
    assert rank_device(None, 1, 0) == torch.device("cpu")


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs for NCCL tensor parallelism, this machine has {GPUS}")
@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_two_gpus_equal_one(tiny_checkpoint, layout):
    path, _ = tiny_checkpoint("v3")
    prompts = make_prompts(4, seed=3)
    kw = dict(dtype="float32", max_model_len=256, kv_cache_memory="64MiB", block_size=32)
    one = LLM(str(path), **kw)
    try:
        want = tokens(one.generate(prompts, GREEDY))
    finally:
        one.shutdown()
    two = LLM(str(path), tensor_parallel_size=2, latent_cache_layout=layout, **kw)
    try:
        assert two.engine.worker.device == torch.device("cuda", 0)
        assert tokens(two.generate(prompts, GREEDY)) == want
    finally:
        two.shutdown()
