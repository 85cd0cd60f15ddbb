"""Shared fixtures: tiny random MLA checkpoints, built once per test session with transformers."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # kernels: interpret Triton on CPU (must precede the first triton import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mla_runtime.kernel_plan import KernelPlan, kernel_plan  # noqa: E402
from mla_runtime.options import CPU_GEMM_MODES  # noqa: E402
from tests.checkpoints import VARIANTS, build_hf_model, quantize_fp8_checkpoint, save_checkpoint  # noqa: E402


@pytest.fixture(params=[m for m in CPU_GEMM_MODES if m != "onednn"])
def gemm_mode(request) -> str:
    """Run a test under each CPU product mode (the engine setting ``cpu_gemm``): ``auto`` takes the fast paths that
    pass their probe on this CPU, ``plain`` forces the fallbacks, so every machine also tests what a CPU without the
    fast paths runs. The test hands it to what it builds (``load_model(cpu_gemm=...)``, or the ``plan`` fixture)."""
    return request.param


@pytest.fixture
def plan(gemm_mode) -> KernelPlan:
    """The kernel plan of ``gemm_mode`` on this CPU, which weights made by a test are prepared for (``bind``,
    ``PackedWeight.make``)."""
    return kernel_plan(gemm_mode)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(variant)`` → (checkpoint dir, transformers model)."""
    built: dict[str, tuple] = {}

    def get(variant: str):
        if variant not in built:
            hf = build_hf_model(variant)
            path = save_checkpoint(hf, tmp_path_factory.mktemp(f"ckpt_{variant}"))
            built[variant] = (path, hf)
        return built[variant]

    return get


@pytest.fixture(scope="session")
def sharded_checkpoint(tmp_path_factory, tiny_checkpoint):
    _, hf = tiny_checkpoint("v3")
    return save_checkpoint(hf, tmp_path_factory.mktemp("ckpt_sharded"), max_shard_size="100KB"), hf


@pytest.fixture(scope="session")
def fp8_checkpoint(tmp_path_factory, tiny_checkpoint):
    path, _ = tiny_checkpoint("v3")
    return quantize_fp8_checkpoint(path, tmp_path_factory.mktemp("ckpt_fp8"))


@pytest.fixture(scope="session", params=sorted(VARIANTS))
def variant(request):
    return request.param
