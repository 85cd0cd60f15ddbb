"""The Triton kernels compile for a real GPU (sm_90, to PTX and cubin with the bundled ptxas), even on a
CPU-only machine where every other kernel test runs in the interpreter — which accepts code (e.g. non-constexpr
globals) that the GPU compiler rejects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

# runs in a fresh interpreter without TRITON_INTERPRET so that @triton.jit builds real JITFunctions
_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mla_kernels import decode, latent_store, linear_attention, prefill

target = GPUTarget("cuda", 90, 32)


def build(fn, types, consts):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, constexprs=consts), target=target, options={"num_warps": 4, "num_stages": 2})
    print("compiled", fn.__name__, types.get("cache_ptr", types.get("q_ptr", "")))


for cache_dt, q_dt, quant in [("*bf16", "*bf16", False), ("*fp8e4nv", "*bf16", True), ("*i8", "*fp16", True)]:
    build(decode._decode_split_kernel,
          dict(q_ptr=q_dt, cache_ptr=cache_dt, scales_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32",
               req_ptr="*i32", out_ptr="*fp32", lse_ptr="*fp32", sm_scale="fp32"),
          dict(BLOCK_SIZE=64, BLOCK_H=16, BLOCK_N=32, BLOCK_DC=512, BLOCK_DR=64, NUM_SPLITS=4, QUANT=quant,
               COMPUTE_FP32=False, DOT_PRECISION="tf32"))
    build(latent_store._store_latent_kernel,
          dict(latent_ptr=q_dt, k_rope_ptr=q_dt, slot_ptr="*i64", cache_ptr=cache_dt, scales_ptr="*fp32"),
          dict(BLOCK_SIZE=64, BLOCK_DC=512, BLOCK_DR=64, QUANT=quant, QMAX=127.0 if cache_dt == "*i8" else 448.0,
               IS_INT8=cache_dt == "*i8"))
    build(latent_store._gather_latent_kernel,
          dict(cache_ptr=cache_dt, scales_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32", cu_ptr="*i64",
               out_ptr="*bf16"),
          dict(BLOCK_SIZE=64, BLOCK_N=32, BLOCK_DC=512, BLOCK_DR=64, QUANT=quant))
build(decode._merge_splits_kernel,
      dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32"),
      dict(NUM_SPLITS=8, BLOCK_S=8, BLOCK_H=16, BLOCK_DC=512))
build(prefill._prefill_kernel,
      dict(qn_ptr="*bf16", qr_ptr="*bf16", kn_ptr="*bf16", kr_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16",
           cu_q_ptr="*i32", cu_k_ptr="*i32", lse_ptr="*fp32", sm_scale="fp32"),
      dict(BLOCK_M=64, BLOCK_N=64, BLOCK_DN=128, BLOCK_DR=64, BLOCK_DV=128, COMPUTE_FP32=False, DOT_PRECISION="tf32"))
build(linear_attention._recurrent_kernel,
      dict(q_ptr="*fp32", k_ptr="*fp32", v_ptr="*fp32", g_ptr="*fp32", beta_ptr="*fp32", state_ptr="*fp32",
           slots_ptr="*i64", out_ptr="*fp32"),
      dict(BLOCK_K=128, BLOCK_V=32))
build(linear_attention._chunked_kernel,
      dict(q_ptr="*fp32", k_ptr="*fp32", v_ptr="*fp32", g_ptr="*fp32", beta_ptr="*fp32", state_ptr="*fp32",
           slots_ptr="*i64", cu_ptr="*i64", out_ptr="*fp32"),
      dict(CHUNK=32, BLOCK_K=128, BLOCK_V=32))
"""


@pytest.mark.skipif(not _PTXAS.exists(), reason="triton's bundled ptxas is not available")
def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled") == 13
