"""The disk tier of the prefix cache: files that round-trip every cache dtype, keys that never return a foreign
prefix, corrupt files read as misses, the directory's bound; restarts, two processes sharing a directory, the
server's shutdown flush, tensor parallelism and ``mla-runtime warm``."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.cache.disk_tier import DiskTier
from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.cli import main
from mla_runtime.engine.block_pool import block_hash
from tests.checkpoints import VOCAB
from tests.test_server import Live, text_checkpoint, wait_ready  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)
PROMPT = {"prompt_token_ids": [random.Random(5).randrange(2, VOCAB) for _ in range(200)]}
FULL = (200 - 1) // BLOCK * BLOCK  # the prompt's tokens a cache can serve (one is always computed)


def new_llm(path, cache_dir, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "8MiB")
    return LLM(str(path), dtype="float32", max_model_len=256, block_size=BLOCK, kv_cache_dir=str(cache_dir), **kw)


def files(d: Path) -> list[Path]:
    return sorted(d.rglob("*.blk"))


# -- the files ---------------------------------------------------------------------------------------
def tier_over(d: Path, dtype: torch.dtype, fingerprint: str = "a" * 64, seed: int = 0, **kw) -> DiskTier:
    cache = LatentCache(num_layers=2, num_blocks=8, block_size=BLOCK, latent_dim=24, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        layer.kv.copy_((torch.randn(layer.kv.shape, generator=g) * 40).to(dtype))
        if layer.scales is not None:
            layer.scales.copy_(torch.rand(layer.scales.shape, generator=g))
    return DiskTier(d, fingerprint, cache, BLOCK, **kw)


def chain(n: int, seed: int = 0) -> list[int]:
    rng, hashes, parent = random.Random(seed), [], None
    for _ in range(n):
        parent = block_hash(parent, [rng.randrange(VOCAB) for _ in range(BLOCK)])
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_blocks_round_trip_bit_exactly_and_foreign_keys_miss(tmp_path, dtype):
    writer = tier_over(tmp_path, dtype)
    hashes = chain(4)
    for h, b in zip(hashes, [3, 1, 0, 2]):
        assert writer.store(h, b)
    assert writer.flush(30)
    writer.close()
    reader = tier_over(tmp_path, dtype, seed=1)
    assert reader.lookup(hashes) == 4 and reader.lookup(chain(2, seed=9)) == 0
    assert reader.load(hashes, [4, 5, 6, 7]) == 4
    for src, dst in zip([3, 1, 0, 2], [4, 5, 6, 7]):
        for w, r in zip(writer.cache.layers, reader.cache.layers):
            assert torch.equal(w.kv[src].view(torch.uint8), r.kv[dst].view(torch.uint8))
            if w.scales is not None:
                assert r.scales is not None and torch.equal(w.scales[src], r.scales[dst])
    per_block = writer.cache.nbytes() // writer.cache.num_blocks  # exactly the cache's bytes of one block
    assert writer.payload_bytes == per_block and reader.stats().bytes_read == 4 * writer.file_bytes()
    assert all(f.stat().st_size == writer.file_bytes() for f in files(tmp_path))
    # another model, dtype or layout has another fingerprint: its names differ, nothing is read
    assert tier_over(tmp_path, dtype, fingerprint="b" * 64).lookup(hashes) == 0


def test_close_writes_what_is_queued_and_waits_for_its_threads(tmp_path):
    """A closed tier has written its queue and its threads have ended: none is left inside a torch call when the
    interpreter exits (which can abort the process)."""
    tier = tier_over(tmp_path, torch.float32)
    for block, h in enumerate(chain(4)):
        assert tier.store(h, block)
    tier.close(30)
    assert not tier._writer.is_alive() and not tier._reader.is_alive()
    assert len(files(tmp_path)) == 4
    tier.close(30)  # a second close is a no-op


def test_corrupt_truncated_and_foreign_files_are_misses_deleted_and_counted(tmp_path):
    writer = tier_over(tmp_path, torch.float32)
    hashes = chain(4)
    for b, h in enumerate(hashes):
        writer.store(h, b)
    writer.close(30)
    paths = [writer.path(writer.key(h)) for h in hashes]
    data = bytearray(paths[1].read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit in the latents
    paths[1].write_bytes(bytes(data))
    reader = tier_over(tmp_path, torch.float32, seed=1)
    assert reader.lookup(hashes) == 4 and reader.load(hashes, [4, 5, 6, 7]) == 1
    assert reader.stats().corrupt_files == 1 and not paths[1].exists()
    paths[0].write_bytes(paths[0].read_bytes()[:-100])  # truncated
    assert reader.load(hashes, [4, 5]) == 0 and not paths[0].exists()
    shutil.copy(paths[3], paths[2])  # a whole, valid file under another block's name
    assert reader.load(hashes[2:], [4]) == 0 and not paths[2].exists()
    assert reader.stats().corrupt_files == 3
    assert reader.load(hashes[3:], [4]) == 1  # the good one still loads


def test_prefetch_reads_ahead_into_staging(tmp_path):
    writer = tier_over(tmp_path, torch.bfloat16)
    hashes = chain(3)
    for b, h in enumerate(hashes):
        writer.store(h, b)
    writer.close(30)
    reader = tier_over(tmp_path, torch.bfloat16, seed=1)
    reader.prefetch(hashes)
    deadline = time.monotonic() + 60
    while reader.stats().bytes_read < 3 * reader.file_bytes():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for f in files(tmp_path):
        f.unlink()  # the staged copies are what a load now takes
    assert reader.lookup(hashes) == 3 and reader.load(hashes, [5, 6, 7]) == 3
    assert torch.equal(reader.cache.layers[1].kv[7], writer.cache.layers[1].kv[2])
    assert reader.stats().bytes_read == 3 * reader.file_bytes()  # each file read once


def test_eviction_keeps_the_directory_under_its_bound(tmp_path):
    probe = tier_over(tmp_path / "probe", torch.float32)
    bound = 5 * probe.file_bytes() + 10
    tier = tier_over(tmp_path / "dir", torch.float32, capacity_bytes=bound)
    hashes = chain(16)
    for i, h in enumerate(hashes):
        tier.store(h, i % 8)
        assert tier.flush(30)
        assert sum(f.stat().st_size for f in files(tmp_path / "dir")) <= bound
    st = tier.stats()
    assert st.blocks_written == 16 and st.evictions >= 11 and st.usage_bytes <= bound
    assert tier.lookup(hashes[-1:]) == 1 and tier.lookup(hashes[:1]) == 0  # least recently used went first
    assert tier.capacity_tokens() == 5 * BLOCK


# -- the engine --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v3(tiny_checkpoint):
    return tiny_checkpoint("v3")[0]


@pytest.fixture(scope="module")
def written(v3, tmp_path_factory):
    """A directory the prompt was computed into (flushed at shutdown), the cold output and a device-cache hit's."""
    d = tmp_path_factory.mktemp("kv")
    llm = new_llm(v3, d)
    cold = llm.generate([PROMPT], GREEDY)[0]
    hit = llm.generate([PROMPT], GREEDY)[0]
    assert (cold.num_cached_tokens, hit.num_cached_tokens) == (0, FULL)
    llm.shutdown()
    assert len(files(d)) == 200 // BLOCK  # every full block, though none was evicted
    return d, cold, hit


def test_restart_serves_the_prefix_from_disk_with_identical_output(v3, written, tmp_path):
    d, cold, hit = written
    shutil.copytree(d, tmp_path / "kv")
    llm = new_llm(v3, tmp_path / "kv")
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.num_cached_tokens == FULL
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    # the restored latents are the computed bytes: logprobs equal a device-cache hit's exactly (and the cold run's
    # up to the rounding of attending over a cached prefix instead of within one chunk)
    assert out.outputs[0].logprobs == hit.outputs[0].logprobs
    for a, b in zip(out.outputs[0].logprobs, cold.outputs[0].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    s = llm.engine.stats()
    assert (s.prefix_disk_hit_tokens, s.prefix_device_hit_tokens, s.prefix_hit_tokens) == (FULL, 0, FULL)
    assert s.disk is not None and s.disk.bytes_read >= FULL // BLOCK * llm.engine.worker.disk_tier.file_bytes()
    assert s.disk.corrupt_files == 0
    llm.engine.pool.check_whole()
    llm.shutdown()


@pytest.mark.parametrize("change", [{"latent_rank": 16}, {"kv_cache_dtype": "int8"}])
def test_a_changed_latent_rank_or_cache_dtype_gets_no_hits(v3, written, tmp_path, change):
    d, cold, _ = written
    shutil.copytree(d, tmp_path / "kv")
    llm = new_llm(v3, tmp_path / "kv", **change)
    first = llm.generate([PROMPT], GREEDY)[0]
    s = llm.engine.stats()
    assert first.num_cached_tokens == 0 and s.prefix_disk_query_tokens == FULL and s.prefix_disk_hit_tokens == 0
    llm.shutdown()
    again = new_llm(v3, tmp_path / "kv", **change)  # its own files: written under its own key, found again
    out = again.generate([PROMPT], GREEDY)[0]
    assert out.num_cached_tokens == FULL and out.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.engine.stats().disk.corrupt_files == 0
    again.shutdown()


def test_a_corrupt_file_gives_no_hits_and_the_same_output(v3, written, tmp_path):
    d, cold, _ = written
    shutil.copytree(d, tmp_path / "kv")
    llm = new_llm(v3, tmp_path / "kv", kv_cache_write_through=True)
    tier = llm.engine.worker.disk_tier
    first = tier.path(tier.key(block_hash(None, PROMPT["prompt_token_ids"][:BLOCK])))
    data = bytearray(first.read_bytes())
    data[-20] ^= 0xFF
    first.write_bytes(bytes(data))
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == cold.outputs[0].token_ids
    assert llm.engine.stats().disk.corrupt_files == 1
    llm.shutdown()
    assert first.exists()  # rewritten whole by the write-through
    again = new_llm(v3, tmp_path / "kv")
    assert again.generate([PROMPT], GREEDY)[0].num_cached_tokens == FULL
    again.shutdown()


def test_a_block_evicted_from_the_device_pool_is_written_before_reuse(v3, tmp_path):
    prompts = [{"prompt_token_ids": [random.Random(s).randrange(2, VOCAB) for _ in range(120)]} for s in range(8)]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    small = new_llm(v3, tmp_path, kv_cache_memory=20 * BLOCK * (32 + 16) * 3 * 4)  # 20 blocks, fp32
    ref = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    s = small.engine.stats()
    assert s.num_evictions > 0 and s.disk is not None
    assert small.engine.worker.disk_tier.flush(30)  # the writer only: no shutdown flush
    assert 0 < len(files(tmp_path)) <= s.num_evictions
    resident = set(h for h, _ in small.engine.pool.cached_blocks())
    gone = [i for i, p in enumerate(prompts) if not resident & set(chain_of(p["prompt_token_ids"]))]
    assert gone  # prompts whose every block left the device pool
    other = new_llm(v3, tmp_path)
    outs = other.generate([prompts[gone[0]]], params)
    assert outs[0].num_cached_tokens == 112 and outs[0].outputs[0].token_ids == ref[gone[0]]
    small.shutdown()
    other.shutdown()


def chain_of(ids: list[int]) -> list[int]:
    hashes, parent = [], None
    for k in range((len(ids) - 1) // BLOCK):
        parent = block_hash(parent, ids[k * BLOCK:(k + 1) * BLOCK])
        hashes.append(parent)
    return hashes


# -- two processes -------------------------------------------------------------------------------------
SHARER = r"""
import json, random, sys, time
from pathlib import Path
from mla_runtime import LLM, SamplingParams
ckpt, d, me, other = sys.argv[1:5]
def prompt(seed):
    return {"prompt_token_ids": [random.Random(seed).randrange(2, 256) for _ in range(150)]}
mine = [prompt(int(me) * 10 + i) for i in range(3)] + [prompt(99)]  # the last one both write at once
theirs = [prompt(int(other) * 10 + i) for i in range(3)]
llm = LLM(ckpt, dtype="float32", max_model_len=256, block_size=16, kv_cache_memory="8MiB", kv_cache_dir=d,
          kv_cache_write_through=True, cpu_gemm="plain")
p = SamplingParams(max_tokens=4, temperature=0.0)
own = llm.generate(mine, p)
assert llm.engine.worker.disk_tier.flush(60)
Path(d, f"done{me}").touch()
deadline = time.monotonic() + 300
while not Path(d, f"done{other}").exists():
    assert time.monotonic() < deadline, "the other process never finished writing"
    time.sleep(0.05)
got = llm.generate(theirs, p)
s = llm.engine.stats()
llm.shutdown()
print(json.dumps({"own": [o.outputs[0].token_ids for o in own], "theirs": [o.outputs[0].token_ids for o in got],
                  "cached": [o.num_cached_tokens for o in got], "corrupt": s.disk.corrupt_files}))
"""


def test_two_processes_sharing_a_directory_both_hit(v3, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", SHARER, str(v3), str(tmp_path), me, other], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for me, other in (("1", "2"), ("2", "1"))]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for me, other in ((0, 1), (1, 0)):
        assert results[me]["cached"] == [144, 144, 144]  # every full block of the other's prompts
        assert results[me]["theirs"] == results[other]["own"][:3]  # the other's latents give its own tokens
        assert results[me]["corrupt"] == 0
    assert results[0]["own"][3] == results[1]["own"][3]
    assert not list(tmp_path.rglob("*.tmp"))
    sizes = {f.stat().st_size for f in files(tmp_path)}
    assert len(sizes) == 1 and all(f.read_bytes()[-8:] == b"MLAKVEND" for f in files(tmp_path))  # every file whole


# -- the server, tensor parallelism, warm ----------------------------------------------------------------
def test_server_flushes_at_shutdown_and_reports_disk_hits_after_a_restart(text_checkpoint, tmp_path):  # noqa: F811
    body = {"prompt": [random.Random(3).randrange(2, 300) for _ in range(120)], "max_tokens": 6, "temperature": 0}
    engine = {"kv_cache_dir": str(tmp_path)}
    first = Live(text_checkpoint, engine=engine, wait=False)
    wait_ready(first.base, timeout=600)  # the first engine of a process times its CPU products once
    cold = httpx.post(first.base + "/generate", json=body, timeout=60).json()
    first.stop()  # a graceful stop: the resident blocks go to disk
    assert len(files(tmp_path)) == 120 // BLOCK
    second = Live(text_checkpoint, engine=engine)
    try:
        warm = httpx.post(second.base + "/generate", json=body, timeout=60).json()
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 112
        assert warm["token_ids"] == cold["token_ids"]
        m = second.metrics()
        assert m[("mla_kv_tier_hits_tokens_total", ("tier", "disk"))] == 112
        assert m[("mla_kv_tier_misses_tokens_total", ("tier", "disk"))] == 0
        assert m[("mla_kv_tier_read_bytes_total", ("tier", "disk"))] > 0
        assert m[("mla_kv_tier_corrupt_files_total", ("tier", "disk"))] == 0
        assert m[("mla_kv_tier_capacity_tokens", ("tier", "disk"))] > 0
        for name in ("written_bytes_total", "write_queue_depth", "evictions_total", "write_drops_total", "usage_bytes"):
            assert (f"mla_kv_tier_{name}", ("tier", "disk")) in m, name
        assert ("mla_kv_tier_hits_tokens_total", ("tier", "device")) in m
    finally:
        second.stop()


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_tensor_parallel_ranks_restart_from_disk(v3, tmp_path, layout):
    kw = dict(tensor_parallel_size=2, latent_cache_layout=layout, max_num_batched_tokens=128)
    llm = LLM(str(v3), dtype="float32", max_model_len=256, block_size=32, kv_cache_memory="8MiB",
              kv_cache_dir=str(tmp_path), **kw)
    cold = llm.generate([PROMPT], GREEDY)[0]
    llm.shutdown()
    names = {f.name.split(".", 1)[1] for f in files(tmp_path)}
    assert names == ({"r0.blk", "r1.blk"} if layout == "sharded" else {"blk"})  # only rank 0 writes replicated
    again = LLM(str(v3), dtype="float32", max_model_len=256, block_size=32, kv_cache_memory="8MiB",
                kv_cache_dir=str(tmp_path), **kw)
    try:
        out = again.generate([PROMPT], GREEDY)[0]
        assert out.num_cached_tokens == 192 and out.outputs[0].token_ids == cold.outputs[0].token_ids
        again.engine.pool.check_whole()
    finally:
        again.shutdown()


def test_warm_precomputes_prompts_that_a_later_engine_finds(v3, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    ids = PROMPT["prompt_token_ids"]
    prompts.write_text(json.dumps({"prompt_token_ids": ids[:100]}) + "\n\n" + json.dumps({"prompt_token_ids": ids})
                       + "\n")
    d = tmp_path / "kv"
    assert main(["warm", "--model", str(v3), "--kv-cache-dir", str(d), "--prompts", str(prompts), "--dtype",
                 "float32", "--block-size", "16", "--max-model-len", "256", "--kv-cache-memory", "8MiB"]) == 0
    out = capsys.readouterr().out
    assert "warmed 2 prompts (300 tokens" in out
    assert len(files(d)) == 200 // BLOCK
    llm = new_llm(v3, d)
    assert llm.generate([PROMPT], GREEDY)[0].num_cached_tokens == FULL
    llm.shutdown()
    assert main(["warm", "--model", str(v3), "--prompts", str(prompts)]) == 2
    assert "--kv-cache-dir is required" in capsys.readouterr().err


def test_settings_that_need_a_directory_name_the_field_and_the_planner_gives_the_capacity(capsys):
    from mla_runtime.config import ModelConfig
    from mla_runtime.engine.config import EngineConfig
    from mla_runtime.plan import plan_memory

    for kw, field in (({"kv_cache_write_through": True}, "kv_cache_write_through"),
                      ({"kv_cache_disk_bytes": "1GiB"}, "kv_cache_disk_bytes"),
                      ({"kv_cache_dir": "d", "enable_prefix_caching": False}, "enable_prefix_caching"),
                      ({"kv_cache_dir": "d", "kv_cache_disk_bytes": "lots"}, "byte size")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(model="m", **kw)
    assert EngineConfig(model="m", kv_cache_dir=Path("d"), kv_cache_disk_bytes="2KiB").kv_cache_disk_bytes == 2048
    plan = plan_memory(ModelConfig.from_pretrained("deepseek-v3"), dtype="bfloat16", device_memory_bytes=141 * 2**30,
                       max_seq_len=32768, max_num_seqs=16, tensor_parallel_size=16, disk_bytes=10**12)
    assert plan.disk_file_bytes - 70_272 * 64 in range(200, 400)  # the latents of a block plus one header
    assert plan.disk_capacity_tokens == 10**12 // plan.disk_file_bytes * 64 > 14_000_000
    assert main(["plan", "--model", "deepseek-v3", "--device-memory", "141GiB", "--tensor-parallel-size", "16",
                 "--max-num-seqs", "16", "--max-seq-len", "32768", "--kv-cache-disk-bytes", "1TB"]) == 0
    assert f"disk tier: tokens that fit {plan.disk_capacity_tokens:,}" in " ".join(capsys.readouterr().out.split())
