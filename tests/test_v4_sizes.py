"""DeepSeek-V4's cache arithmetic (``models/v4_sizes.py``, ``v4_plan.py``): the bytes per token of each cache kind
by exact formulas on the presets' shapes, their agreement with the bytes a sequence's state really holds, the
published "KV per sequence at 1 M tokens" figures (about 9.6 GiB in bfloat16 for V4-Pro's layer mix, about 84 GiB
for a V3.2-style stack), and ``mla-runtime plan`` on the presets: V4-Flash on one 8 x H200 node."""

from __future__ import annotations

import json

import pytest
import torch

from mla_runtime.config import PRESET_DIR
from mla_runtime.models.deepseek_v4 import DeepseekV4ForCausalLM, V4Config, state_bytes
from mla_runtime.models.v4_sizes import cache_kinds, default_snapshot_bytes
from mla_runtime.plan_cli import main
from mla_runtime.v4_plan import plan_v4, v32_style_bytes

M = 2**20  # "1 M tokens"
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def preset(name: str) -> dict:
    return json.loads((PRESET_DIR / f"{name}.json").read_text())


def test_the_flash_preset_is_transformers_default_shape() -> None:
    import transformers

    ref = transformers.DeepseekV4Config().to_dict()
    raw = preset("deepseek-v4-flash")
    assert {k: ref[k] for k in raw if k not in ("architectures", "dtype")} == {
        k: v for k, v in raw.items() if k not in ("architectures", "dtype")}
    cfg = V4Config.from_raw(raw)
    assert (cfg.layer_types.count(CSA), cfg.layer_types.count(HCA)) == (20, 23)


def test_the_pro_preset_is_near_the_published_size() -> None:
    cfg = V4Config.from_raw(preset("deepseek-v4-pro"))
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.n_routed_experts
    assert abs(total / 1.6e12 - 1) < 0.02 and abs(active / 49e9 - 1) < 0.02  # published: 1.6 T, 49 B active


def test_bytes_per_token_of_each_kind_on_the_flash_shape() -> None:
    k = cache_kinds(V4Config.from_raw(preset("deepseek-v4-flash")), 2)
    assert (k.csa_layers, k.hca_layers, k.sliding_layers, k.csa_rate, k.hca_rate) == (20, 23, 0, 4, 128)
    assert k.csa_entry_bytes / k.csa_rate == 20 * 512 * 2 / 4 == 5120
    assert k.index_key_bytes / k.csa_rate == 20 * 128 * 2 / 4 == 1280
    assert k.hca_entry_bytes / k.hca_rate == 23 * 512 * 2 / 128 == 184
    assert k.bytes_per_token == k.block_bytes_per_token == 6584
    assert k.window_bytes == 43 * 127 * 512 * 2
    # per CSA layer: < 4 tokens of kv and gate, 2 x 512 (2 x 128) wide, and the previous window's half with its
    # float32 gates; per HCA layer: < 128 tokens of kv and gate, 512 wide
    csa = (2 * 3 * 1024 * 2 + 4 * 512 * 6) + (2 * 3 * 256 * 2 + 4 * 128 * 6)
    assert k.partial_bytes == 20 * csa + 23 * 2 * 127 * 512 * 2 == 6_596_608


@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v4-pro"])
def test_the_kinds_add_up_to_a_sequences_state(name: str) -> None:
    cfg = V4Config.from_raw(preset(name))
    k = cache_kinds(cfg, 2)
    for tokens in (127, 511, 4095, M - 1):  # every compressor's window one token short: the largest partial state
        assert k.sequence_bytes(tokens) == state_bytes(cfg, tokens, 2)
    for tokens in (1, 4, 128, 1000, M):
        assert k.entries_bytes(tokens) <= state_bytes(cfg, tokens, 2) <= k.sequence_bytes(tokens)


def test_kv_per_sequence_at_one_million_tokens() -> None:
    pro = cache_kinds(V4Config.from_raw(preset("deepseek-v4-pro")), 2)
    # the preset's layer mix (transformers' rule: 2 HCA, then CSA/HCA in turn): 29 CSA, 32 HCA
    assert pro.entries_bytes(M) == M // 4 * 29 * (512 + 128) * 2 + M // 128 * 32 * 512 * 2
    assert round(pro.sequence_bytes(M) / 2**30, 2) == 9.33
    # the published figure's mix: 30 CSA, 31 HCA layers
    mix = [HCA, HCA] + [CSA, HCA] * 29 + [CSA]
    published = cache_kinds(V4Config.from_raw({**preset("deepseek-v4-pro"), "layer_types": mix}), 2)
    assert (published.csa_layers, published.hca_layers) == (30, 31)
    assert round(published.entries_bytes(M) / 2**30, 1) == 9.6
    assert v32_style_bytes(61, M) == 61 * (512 + 64 + 128) * 2 * M and round(v32_style_bytes(61, M) / 2**30) == 84


def test_plan_says_flash_fits_one_8_x_h200_node(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--device-memory", "141GiB", "--tensor-parallel-size", "8", "--max-seq-len", str(M)]
    assert main(["--model", "deepseek-v4-flash", "--max-num-seqs", "8", *args]) == 0
    out = capsys.readouterr().out
    plan = plan_v4(preset("deepseek-v4-flash"), device_memory_bytes=141 * 2**30, ranks=8, max_seq_len=M)
    assert round(plan.parameter_count / 1e9) == 284  # published: 284 B parameters
    assert plan.weights_fit and plan.sequence_bytes == cache_kinds(V4Config.from_raw(
        preset("deepseek-v4-flash")), 2).sequence_bytes(M)
    assert plan.sequences_per_rank == plan.cache_budget_bytes // plan.sequence_bytes and plan.sequences_per_rank > 0
    # a rank's weights are its shard (the KV head, compressors and indexer whole on every rank), and every rank holds
    # every sequence's state: the node holds one rank's sequences
    assert plan.weight_bytes // 8 < plan.weight_bytes_per_rank < plan.weight_bytes // 8 * 1.05
    assert plan.max_sequences == plan.sequences_per_rank and "every rank holds every sequence's cache" in out
    assert f"FITS ({plan.max_sequences:,} fit)" in out and "5,120.00 B/token" in out and "184.00 B/token" in out
    # prefix caching's snapshots, as serving sets them aside: one 8,192-token state per sequence slot of a rank
    assert plan.reserved_bytes == default_snapshot_bytes(V4Config.from_raw(preset("deepseek-v4-flash")), 1, M, 2)
    assert plan.reserved_bytes == state_bytes(V4Config.from_raw(preset("deepseek-v4-flash")), 8192, 2)
    assert "state snapshots per rank (prefix caching)" in out
    assert main(["--model", "deepseek-v4-flash", "--max-num-seqs", str(plan.max_sequences + 1), *args]) == 1
    assert main(["--model", "deepseek-v4-pro", "--max-num-seqs", "1", *args]) == 2  # bfloat16 weights: 2.9 TiB
    assert "DO NOT FIT" in capsys.readouterr().out
