"""The host-RAM tier of the prefix cache: slots that round-trip every cache dtype bit-exactly, LRU eviction that spills
to the disk tier (or drops, with none), the spill of every slot at close; the engine serving an evicted prefix from
host RAM with identical output, a restart through host and disk, per-tier counts and metrics, the pinned-memory path
on CUDA, and settings errors that name the field. On a CPU the tier is on only when asked for
(``kv_cache_host_bytes``): that is how these tests run it."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.cache.disk_tier import DiskTier
from mla_runtime.cache.host_tier import HostTier
from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.engine.config import EngineConfig
from mla_runtime.errors import InvalidParam
from mla_runtime.serving.metrics import _tier_metrics
from tests.checkpoints import VOCAB
from tests.test_disk_tier import BLOCK, FULL, GREEDY, PROMPT, chain, chain_of, files

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn]


# -- the slots -----------------------------------------------------------------------------------------
def filled_cache(dtype: torch.dtype, seed: int = 0, device: str = "cpu", num_blocks: int = 8) -> LatentCache:
    cache = LatentCache(num_layers=2, num_blocks=num_blocks, block_size=BLOCK, latent_dim=24, dtype=dtype,
                        device=device)
    g = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        layer.kv.copy_((torch.randn(layer.kv.shape, generator=g) * 40).to(dtype))
        if layer.scales is not None:
            layer.scales.copy_(torch.rand(layer.scales.shape, generator=g))
    return cache


def block_copy(cache: LatentCache, block: int) -> list[torch.Tensor]:
    """``block``'s bytes in every layer (latents and scales), on the host."""
    return [v.cpu().clone() for v in cache.block_views(block)]


def assert_block(cache: LatentCache, block: int, expected: list[torch.Tensor]) -> None:
    got = block_copy(cache, block)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


def scramble(cache: LatentCache, seed: int) -> None:
    """Overwrite every block with other values (so that a load must bring the bytes back)."""
    other = filled_cache(cache.dtype, seed, str(cache.layers[0].kv.device), cache.num_blocks)
    for mine, theirs in zip(cache.layers, other.layers):
        mine.kv.copy_(theirs.kv)
        if mine.scales is not None:
            assert theirs.scales is not None
            mine.scales.copy_(theirs.scales)


@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_round_trip_through_host_slots_bit_exactly(dtype):
    cache = filled_cache(dtype)
    tier = HostTier(cache, capacity_bytes=4 * cache.block_bytes() + 100, block_size=BLOCK)
    assert (tier.num_slots, tier.capacity_tokens()) == (4, 4 * BLOCK)
    hashes = chain(3)
    saved = [block_copy(cache, b) for b in (5, 2, 7)]
    for h, b in zip(hashes, [5, 2, 7]):
        assert tier.store(h, b)
    assert tier.store(hashes[0], 5)  # already here: a touch, no copy
    scramble(cache, seed=1)
    assert tier.lookup(hashes) == 3 and tier.lookup(chain(2, seed=9)) == 0 and tier.lookup(hashes[1:]) == 2
    assert tier.load(hashes, [0, 1, 3]) == 3
    for b, expected in zip([0, 1, 3], saved):
        assert_block(cache, b, expected)
    s = tier.stats()
    n = cache.block_bytes()
    assert (s.hits_blocks, s.bytes_stored, s.bytes_loaded, s.blocks, s.usage_bytes, s.capacity_bytes) == (
        3, 3 * n, 3 * n, 3, 3 * n, 4 * n)
    assert (s.evictions, s.spills) == (0, 0)


def test_lru_eviction_spills_to_the_disk_tier_and_the_spilled_blocks_load_back_exactly(tmp_path):
    cache = filled_cache(torch.int8)
    disk = DiskTier(tmp_path, "a" * 64, cache, BLOCK)
    tier = HostTier(cache, 2 * cache.block_bytes(), BLOCK, lower=disk)
    hashes = chain(4)
    saved = [block_copy(cache, b) for b in range(4)]
    for b, h in enumerate(hashes[:2]):
        tier.store(h, b)
    tier.store(hashes[0], 0)  # touched: block 1 is now the least recently used
    tier.store(hashes[2], 2)  # evicts hashes[1] to disk
    tier.store(hashes[3], 3)  # evicts hashes[0]
    assert disk.flush(30)
    assert sorted(files(tmp_path)) == sorted(disk.path(disk.key(h)) for h in hashes[:2])
    s = tier.stats()
    assert (s.evictions, s.spills, s.blocks) == (2, 2, 2)
    scramble(cache, seed=3)
    assert tier.lookup(hashes) == 4  # two on disk, two in host RAM
    assert tier.load(hashes, [4, 5, 6, 7]) == 4
    for b, expected in zip([4, 5, 6, 7], saved):
        assert_block(cache, b, expected)
    assert tier.stats().hits_blocks == 2 and disk.stats().bytes_read == 2 * disk.file_bytes()
    for h, b in zip(hashes, [4, 5, 6, 7]):  # all four through the two slots again
        tier.store(h, b)
    assert disk.flush(30) and disk.stats().blocks_written == 4  # each block written once, though evicted again
    tier.close(30)


def test_without_a_disk_tier_eviction_drops_the_least_recently_used_block():
    cache = filled_cache(torch.float32)
    tier = HostTier(cache, 2 * cache.block_bytes(), BLOCK)
    hashes = chain(3)
    saved = block_copy(cache, 2)
    for b, h in enumerate(hashes):
        tier.store(h, b)
    assert tier.lookup(hashes) == 0 and tier.lookup(hashes[1:]) == 2
    assert tier.load(hashes, [6, 7]) == 0  # the first block is gone: nothing loads
    assert tier.load(hashes[2:], [6]) == 1
    assert_block(cache, 6, saved)
    s = tier.stats()
    assert (s.evictions, s.spills, s.blocks) == (1, 0, 2)
    assert not tier.persistent
    tier.close(0)
    assert tier.stats().blocks == 0 and not tier.store(hashes[0], 0)


@pytest.mark.parametrize("write_through", [False, True])
def test_close_spills_every_slot_to_disk_once(tmp_path, write_through):
    cache = filled_cache(torch.bfloat16)
    tier = HostTier(cache, 8 * cache.block_bytes(), BLOCK, lower=DiskTier(tmp_path, "a" * 64, cache, BLOCK),
                    write_through=write_through)
    hashes = chain(3)
    saved = [block_copy(cache, b) for b in range(3)]
    for b, h in enumerate(hashes):
        tier.store(h, b)
    assert tier.flush(30)
    assert len(files(tmp_path)) == (3 if write_through else 0)  # write-through: on disk at once
    tier.close(30)
    assert len(files(tmp_path)) == 3
    assert tier.stats().spills == (0 if write_through else 3)
    reader = DiskTier(tmp_path, "a" * 64, filled_cache(torch.bfloat16, seed=5), BLOCK)
    assert reader.load(hashes, [3, 4, 5]) == 3
    for b, expected in zip([3, 4, 5], saved):
        assert_block(reader.cache, b, expected)
    reader.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: the pinned-memory and CUDA-event path needs CUDA")
def test_cuda_slots_are_pinned_and_stream_ordered(tmp_path):
    cache = filled_cache(torch.bfloat16, device="cuda")
    disk = DiskTier(tmp_path, "a" * 64, cache, BLOCK)
    tier = HostTier(cache, 2 * cache.block_bytes(), BLOCK, lower=disk)
    assert tier.on_cuda and tier.slots.is_pinned()
    hashes = chain(3)
    saved = [block_copy(cache, b) for b in range(3)]
    for b, h in enumerate(hashes):
        tier.store(h, b)
        cache.layers[0].kv[b].fill_(7)  # reuses the device block at once: queued after the copy out
    assert all(e is not None for e in tier._events)
    assert disk.flush(30) and len(files(tmp_path)) == 1  # the evicted slot, read after its event
    assert tier.load(hashes, [4, 5, 6]) == 3  # one from disk, two from pinned slots (non-blocking)
    for b, expected in zip([4, 5, 6], saved):
        assert_block(cache, b, expected)
    tier.close(30)
    assert len(files(tmp_path)) == 3


# -- the engine --------------------------------------------------------------------------------------
def small_llm(path, **kw) -> LLM:
    """An engine of 20 device blocks (fp32) with a host tier of 1 MiB (about 100 blocks)."""
    kw.setdefault("kv_cache_memory", 20 * BLOCK * (32 + 16) * 3 * 4)
    kw.setdefault("kv_cache_host_bytes", "1MiB")
    return LLM(str(path), dtype="float32", max_model_len=256, block_size=BLOCK, **kw)


OTHERS = [{"prompt_token_ids": [random.Random(s).randrange(2, VOCAB) for _ in range(200)]} for s in (11, 12, 13)]


def evict_prompt(llm: LLM) -> None:
    """Run other prompts until no block of ``PROMPT`` is left in the device pool."""
    for other in OTHERS:
        llm.generate([other], SamplingParams(max_tokens=2, temperature=0.0))
    resident = {h for h, _ in llm.engine.pool.cached_blocks()}
    assert not resident & set(chain_of(PROMPT["prompt_token_ids"]))


@pytest.fixture(scope="module")
def v3(tiny_checkpoint):
    return tiny_checkpoint("v3")[0]


def test_a_prefix_evicted_from_the_device_pool_comes_back_from_host_ram(v3, caplog):
    caplog.set_level(logging.INFO, logger="mla_runtime")
    llm = small_llm(v3)
    block = llm.engine.worker.cache.block_bytes()
    slots = 2**20 // block
    assert f"host tier: capacity {slots * block:,} B = {slots * BLOCK} tokens" in caplog.text
    assert "pageable memory), host RAM only: nothing survives a restart" in caplog.text
    assert llm.engine.worker.disk_tier is None and llm.engine.worker.host_tier is not None
    cold = llm.generate([PROMPT], GREEDY)[0]
    hit = llm.generate([PROMPT], GREEDY)[0]  # from the device pool
    evict_prompt(llm)
    before = llm.engine.stats()
    out = llm.generate([PROMPT], GREEDY)[0]
    s = llm.engine.stats()
    assert out.num_cached_tokens == FULL
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    assert out.outputs[0].logprobs == hit.outputs[0].logprobs  # the restored latents are the computed bytes
    for a, b in zip(out.outputs[0].logprobs, cold.outputs[0].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert s.prefix_host_hit_tokens - before.prefix_host_hit_tokens == FULL
    assert s.prefix_device_hit_tokens == before.prefix_device_hit_tokens and s.prefix_disk_hit_tokens == 0
    assert s.host is not None and s.host.hits_blocks == FULL // BLOCK and s.host.evictions == 0
    assert s.host.bytes_loaded == FULL // BLOCK * llm.engine.worker.cache.block_bytes()
    info = llm.engine.info()
    assert info.host_capacity_bytes == s.host.capacity_bytes and info.host_capacity_tokens >= 100 * BLOCK
    metrics = {(sample.name, sample.labels["tier"]): sample.value for m in _tier_metrics(s, info)
               for sample in m.samples}
    assert metrics[("mla_kv_tier_hits_tokens_total", "host")] == s.prefix_host_hit_tokens
    assert metrics[("mla_kv_tier_misses_tokens_total", "host")] == s.prefix_host_query_tokens - FULL
    assert metrics[("mla_kv_tier_capacity_tokens", "host")] == info.host_capacity_tokens
    assert metrics[("mla_kv_tier_read_bytes_total", "host")] == s.host.bytes_loaded
    assert metrics[("mla_kv_tier_written_bytes_total", "host")] == s.host.bytes_stored > 0
    assert metrics[("mla_kv_tier_usage_bytes", "host")] == s.host.usage_bytes > 0
    assert ("mla_kv_tier_evictions_total", "host") in metrics
    assert ("mla_kv_tier_hits_tokens_total", "disk") not in metrics
    llm.engine.pool.check_whole()
    llm.shutdown()


def test_a_clean_shutdown_spills_host_ram_to_disk_and_a_restart_hits(v3, tmp_path):
    llm = small_llm(v3, kv_cache_dir=str(tmp_path))
    cold = llm.generate([PROMPT], GREEDY)[0]
    evict_prompt(llm)
    assert llm.engine.worker.disk_tier.flush(30) and files(tmp_path) == []  # evicted blocks sit in host RAM
    assert llm.engine.stats().host.blocks >= FULL // BLOCK
    llm.shutdown()
    assert len(files(tmp_path)) == 4 * (200 // BLOCK)  # the host's blocks and the device's resident ones
    again = small_llm(v3, kv_cache_dir=str(tmp_path))
    try:
        out = again.generate([PROMPT], GREEDY)[0]
        s = again.engine.stats()
        assert out.num_cached_tokens == FULL and out.outputs[0].token_ids == cold.outputs[0].token_ids
        assert (s.prefix_disk_hit_tokens, s.prefix_host_hit_tokens, s.prefix_disk_query_tokens) == (FULL, 0, FULL)
        again.engine.pool.check_whole()
    finally:
        again.shutdown()


# -- settings ----------------------------------------------------------------------------------------
def test_host_tier_settings_name_the_field(v3, capsys):
    from mla_runtime.cli import main
    from mla_runtime.config import ModelConfig
    from mla_runtime.plan import plan_memory
    from mla_runtime.serving.config import resolve

    for value in ("lots", -1, 1.5):
        with pytest.raises(InvalidParam, match="kv_cache_host_bytes") as e:
            EngineConfig(model="m", kv_cache_host_bytes=value)
        assert e.value.param == "kv_cache_host_bytes"
    with pytest.raises(InvalidParam, match="enable_prefix_caching"):
        EngineConfig(model="m", kv_cache_host_bytes="1GiB", enable_prefix_caching=False)
    assert EngineConfig(model="m", kv_cache_host_bytes=0, enable_prefix_caching=False).kv_cache_host_bytes == 0
    engine, _ = resolve(["--model", str(v3), "--kv-cache-host-bytes", "2KiB"], env={})
    assert engine.kv_cache_host_bytes == 2048 and engine.kv_cache_dir is None  # no directory needed
    with pytest.raises(InvalidParam, match="holds no cache block"):
        small_llm(v3, kv_cache_host_bytes=100)
    plan = plan_memory(ModelConfig.from_pretrained("deepseek-v3"), dtype="bfloat16", device_memory_bytes=141 * 2**30,
                       max_seq_len=32768, max_num_seqs=16, tensor_parallel_size=16, host_bytes=2**40)
    assert plan.host_capacity_tokens == 2**40 // (70_272 * 64) * 64
    assert main(["plan", "--model", "deepseek-v3", "--device-memory", "141GiB", "--tensor-parallel-size", "16",
                 "--max-num-seqs", "16", "--max-seq-len", "32768", "--kv-cache-host-bytes", "1TiB"]) == 0
    assert f"host tier: tokens that fit {plan.host_capacity_tokens:,}" in " ".join(capsys.readouterr().out.split())


def test_the_tier_is_off_by_default_on_a_cpu(v3):
    llm = LLM(str(v3), dtype="float32", max_model_len=256, block_size=BLOCK, kv_cache_memory="1MiB")
    try:
        assert llm.engine.worker.host_tier is None and llm.engine.stats().host is None
        assert llm.engine.info().host_capacity_bytes == 0
    finally:
        llm.shutdown()


def test_payload_layout_is_the_disk_files(tmp_path: Path):
    """The host tier and the disk tier share one payload layout: a slot's bytes are a file's payload."""
    cache = filled_cache(torch.float8_e4m3fn)
    disk = DiskTier(tmp_path, "a" * 64, cache, BLOCK)
    tier = HostTier(cache, cache.block_bytes(), BLOCK, lower=disk)
    tier.store(chain(1)[0], 3)
    assert torch.equal(tier.slots[0], disk._snapshot(3)) and tier.payload_bytes == disk.payload_bytes
    tier.close(30)
