"""Multi-token-prediction (MTP) speculative decoding: the checkpoint's MTP layer loads, computes what the
DeepSeek-V3 description says (against an fp32 reference), and drafts tokens that the main model verifies
without changing the output."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.cache.latent_cache import LatentCache
from mla_runtime.cli import main as cli_main
from mla_runtime.errors import InvalidParam
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.loader import load_model
from mla_runtime.token_map import MAP_FILE, count_tokens, load_token_map, resolve_token_map
from mla_runtime.tokenizer import load_tokenizer
from tests.checkpoints import VOCAB, add_mtp_layer, mtp_reference, quantize_fp8_checkpoint
from tests.test_engine import assert_clean, make_prompts, new_llm

DEMO = Path(__file__).resolve().parent.parent / "mla_runtime" / "demo_model"


@pytest.fixture(scope="module")
def mtp_checkpoint(tiny_checkpoint, tmp_path_factory):
    """(path, transformers model, its MTP layer): the tiny V3 checkpoint plus a random MTP layer."""
    path, hf = tiny_checkpoint("v3")
    dst = tmp_path_factory.mktemp("ckpt_mtp")
    return dst, hf, add_mtp_layer(path, dst, hf)


def paged(model, blocks: int, block_size: int = 16):
    cache = LatentCache(model.num_cache_layers, blocks, block_size, model.config.latent_dim, model.dtype)
    for layer in cache.layers:  # any read of an unwritten slot shows up as NaN
        layer.kv.fill_(float("nan"))
    table = list(range(blocks))
    random.Random(3).shuffle(table)
    return cache, table


@torch.no_grad()
def runtime_mtp_logits(model, ids: list[int], chain: list[int], split: int) -> torch.Tensor:
    """The runtime's MTP logits for positions ``0 .. n-2`` of ``ids`` (main model and MTP layer in two chunks
    split at ``split``, through the paged cache), then one chained link per token of ``chain``."""
    cache, table = paged(model, 4)
    rows, bs = [], 16
    for start, stop in ((0, split), (split, len(ids) - 1)):
        hidden = model(ForwardBatch.build([ids[start:stop]], [start], [table], bs), cache)
        out = model.mtp_forward(ForwardBatch.build([ids[start + 1:stop + 1]], [start], [table], bs), cache, hidden)
        rows.append(out)
    last = rows[-1][-1:]
    for j, token in enumerate(chain):
        last = model.mtp_forward(ForwardBatch.build([[token]], [len(ids) - 1 + j], [table], bs), cache, last)
        rows.append(last)
    out = torch.cat(rows)
    return model.compute_logits(model.mtp[0].shared_head.norm(out))


def test_mtp_forward_matches_the_fp32_reference(mtp_checkpoint):
    path, hf, layer = mtp_checkpoint
    model = load_model(path, dtype="float32", num_mtp_layers=1)
    ids = [random.Random(1).randrange(2, VOCAB) for _ in range(29)]
    ref_plain = mtp_reference(hf, layer, ids, [])
    chain = [int(ref_plain[-1].argmax()), 17, 99]  # the first link continues from its own greedy draft
    ref = mtp_reference(hf, layer, ids, chain)
    got = runtime_mtp_logits(model, ids, chain, split=11)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-4)
    assert int(got[-1].argmax()) == int(ref[-1].argmax())


def test_fp8_mtp_layer_loads_dequantised(mtp_checkpoint, tmp_path):
    """FP8 block weights of the MTP layer are dequantised like any layer's."""
    from tests.checkpoints import dequantized_state_dict

    path, _, _ = mtp_checkpoint
    fp8 = quantize_fp8_checkpoint(path, tmp_path / "fp8", block=16)
    model = load_model(fp8, dtype="float32", num_mtp_layers=1)
    want = dequantized_state_dict(fp8)
    name = f"model.layers.{model.config.num_hidden_layers}.self_attn.kv_b_proj.weight"
    assert want[name].dtype == torch.float32
    torch.testing.assert_close(model.mtp[0].self_attn.kv_b_proj.weight, want[name])
    torch.testing.assert_close(model.mtp[0].eh_proj.weight,
                               want[f"model.layers.{model.config.num_hidden_layers}.eh_proj.weight"])


def test_without_an_mtp_layer_asking_for_mtp_names_the_field(tiny_checkpoint, mtp_checkpoint):
    path, _ = tiny_checkpoint("v3")
    with pytest.raises(InvalidParam, match="speculative_method") as e:
        new_llm(path, speculative_method="mtp")
    assert e.value.param == "speculative_method"
    with pytest.raises(InvalidParam, match="speculative_method"):
        new_llm(path, speculative_method="medusa")
    # the MTP checkpoint still loads and runs without MTP (its layer is skipped) and plain output is unchanged
    mtp_path, _, _ = mtp_checkpoint
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = make_prompts(2, seed=4)
    assert [o.outputs[0].token_ids for o in new_llm(mtp_path).generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in new_llm(path).generate(prompts, params)]


def generate(path, params, prompts, **kw):
    llm = new_llm(path, **kw)
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert_clean(llm)
    return [o.outputs[0].token_ids for o in outs], stats, llm


@pytest.mark.parametrize("k, extra", [
    (1, {}),
    (3, {"enable_prefix_caching": False, "max_num_batched_tokens": 24}),  # chunked prefill
    (2, {"latent_rank": 24}),
])
def test_mtp_greedy_equals_plain_greedy(mtp_checkpoint, k, extra):
    path, _, _ = mtp_checkpoint
    prompts = make_prompts(5, seed=6, lo=5, hi=60)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, plain_stats, _ = generate(path, params, prompts, **extra)
    spec, stats, llm = generate(path, params, prompts, speculative_method="mtp", num_speculative_tokens=k, **extra)
    assert spec == plain
    assert stats.num_draft_tokens > 0
    assert stats.num_computed_tokens == plain_stats.num_computed_tokens


def test_mtp_drafts_are_the_reference_chain(mtp_checkpoint):
    """After a prompt's prefill the drafts the engine holds are the reference's greedy chain."""
    path, hf, layer = mtp_checkpoint
    ids = [random.Random(2).randrange(2, VOCAB) for _ in range(21)]
    llm = new_llm(path, speculative_method="mtp", num_speculative_tokens=3)
    llm.engine.add_request("r", {"prompt_token_ids": ids}, SamplingParams(max_tokens=8, temperature=0.0))
    llm.engine.step()  # the prefill: samples one token, then the MTP layer drafts three
    seq = llm.engine.requests["r"].seqs[0]
    full = ids + seq.output_token_ids
    chain: list[int] = []
    for _ in range(3):
        chain.append(int(mtp_reference(hf, layer, full, chain)[-1].argmax()))
    assert seq.mtp_draft_ids == chain
    llm.engine.abort("r")
    assert_clean(llm)


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_mtp_under_two_ranks(mtp_checkpoint, layout):
    """Each rank holds its shard of the MTP layer (heads, experts; the greedy draft is reduced over the
    vocabulary shards): the drafts are the reference chain and the output is plain decoding's."""
    path, hf, layer = mtp_checkpoint
    ids = [random.Random(2).randrange(2, VOCAB) for _ in range(45)]
    prompts = [{"prompt_token_ids": ids}] + make_prompts(3, seed=9, lo=5, hi=70)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in new_llm(path, block_size=32).generate(prompts, params)]
    llm = LLM(str(path), dtype="float32", max_model_len=256, block_size=32, tensor_parallel_size=2,
              latent_cache_layout=layout, kv_cache_memory="8MiB", speculative_method="mtp",
              num_speculative_tokens=2)
    try:
        llm.engine.add_request("r", {"prompt_token_ids": ids}, SamplingParams(max_tokens=4, temperature=0.0))
        llm.engine.step()
        seq = llm.engine.requests["r"].seqs[0]
        chain: list[int] = []
        for _ in range(2):
            chain.append(int(mtp_reference(hf, layer, ids + seq.output_token_ids, chain)[-1].argmax()))
        assert seq.mtp_draft_ids == chain
        llm.engine.abort("r")
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
        assert llm.engine.stats().num_draft_tokens > 0
        llm.engine.pool.check_whole()
    finally:
        llm.shutdown()


def test_mtp_under_preemption_and_prefix_hits(mtp_checkpoint):
    path, _, _ = mtp_checkpoint
    prompts = [{"prompt_token_ids": p["prompt_token_ids"] * 3} for p in make_prompts(8, seed=8, lo=10, hi=20)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = new_llm(path).generate(prompts, params)
    # 22 blocks: preemptions; the watermark policy off, so that the finished prompts' blocks stay cached
    small = new_llm(path, kv_cache_memory=22 * 16 * (32 + 16) * 4 * 4, speculative_method="mtp",
                    num_speculative_tokens=3, cache_watermark=1.0)
    spec = small.generate(prompts, params) + small.generate(prompts[:2], params)  # the second run hits the cache
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.stats().prefix_hit_tokens > 0 and small.engine.stats().num_draft_tokens > 0
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain + plain[:2]]
    assert_clean(small)


def demo_llm(**kw) -> LLM:
    return LLM(str(DEMO), dtype="float32", max_model_len=256, kv_cache_memory="4MiB", **kw)


def test_demo_model_drafts_with_its_mtp_head():
    """The committed demo model carries a trained MTP head: greedy text is plain decoding's in fewer steps,
    seeded sampling is reproducible, and the counters see accepted drafts at each position."""
    prompts = ["def load(path):\n", "class Parser:\n    def __init__(self, text):\n"]
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    with demo_llm() as llm:
        plain = [o.outputs[0].text for o in llm.generate(prompts, greedy)]
    with demo_llm(speculative_method="mtp", num_speculative_tokens=2) as llm:
        assert [o.outputs[0].text for o in llm.generate(prompts, greedy)] == plain
        stats = llm.engine.stats()
        assert stats.speculative_method == "mtp" and stats.num_accepted_tokens > 0
        assert stats.drafts_by_position[0] >= stats.drafts_by_position[1] > 0
        assert stats.accepted_by_position[0] >= stats.accepted_by_position[1]
        assert sum(stats.accepted_by_position) == stats.num_accepted_tokens
        sampled = SamplingParams(max_tokens=32, temperature=0.8, seed=5, ignore_eos=True)
        first, again = llm.generate(prompts, sampled), llm.generate(prompts, sampled)
        assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
        assert all(len(o.outputs[0].token_ids) == 32 for o in first)
        assert_clean(llm)


def test_served_with_mtp_streams_the_same_text():
    import httpx

    from tests.test_server import Live

    prompt = {"prompt": "def load(path):\n", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    texts = []
    for engine in ({}, {"speculative_method": "mtp", "num_speculative_tokens": 2}):
        live = Live(DEMO, engine={"max_model_len": 256, "kv_cache_memory": "4MiB", "dtype": "float32", **engine})
        try:
            texts.append(httpx.post(live.base + "/generate", json=prompt, timeout=60).json()["text"])
            m = live.metrics()
        finally:
            live.stop()
    assert texts[0] == texts[1]
    assert m[("mla_spec_draft_tokens_total", ("method", "mtp"))] > 0
    assert ("mla_spec_position_accepted_total", ("method", "mtp"), ("position", "2")) in m


# ------------------------------------------------------------------------------------------ draft vocabulary
def reference_chain(hf, layer, full: list[int], k: int, allowed: list[int] | None) -> list[int]:
    """The reference's greedy chain of ``k`` drafts after ``full``, choosing among ``allowed`` (None: all)."""
    chain: list[int] = []
    for _ in range(k):
        logits = mtp_reference(hf, layer, full, chain)[-1]
        chain.append(int(logits.argmax()) if allowed is None else allowed[int(logits[allowed].argmax())])
    return chain


def write_map(path: Path, ids: list[int]) -> Path:
    path.write_text(json.dumps(ids), encoding="utf-8")
    return path


def test_a_draft_vocabulary_restricts_the_drafts_not_the_output(mtp_checkpoint, tmp_path):
    """Drafts come from the map's tokens only (the reference chain restricted to them), and the output stays
    plain decoding's, tokens outside the map included."""
    path, hf, layer = mtp_checkpoint
    allowed = sorted(random.Random(4).sample(range(VOCAB), VOCAB // 3))
    token_map = write_map(tmp_path / "map.json", list(reversed(allowed)))  # any order
    ids = [random.Random(2).randrange(2, VOCAB) for _ in range(21)]
    llm = new_llm(path, speculative_method="mtp", num_speculative_tokens=3, speculative_token_map=str(token_map))
    llm.engine.add_request("r", {"prompt_token_ids": ids}, SamplingParams(max_tokens=8, temperature=0.0))
    llm.engine.step()
    seq = llm.engine.requests["r"].seqs[0]
    expected = reference_chain(hf, layer, ids + seq.output_token_ids, 3, allowed)
    assert seq.mtp_draft_ids == expected
    assert expected != reference_chain(hf, layer, ids + seq.output_token_ids, 3, None)  # the map mattered
    llm.engine.abort("r")
    prompts = make_prompts(5, seed=6, lo=5, hi=60)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, _, _ = generate(path, params, prompts)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert out == plain
    assert any(t not in allowed for o in out for t in o)
    assert llm.engine.stats().num_draft_tokens > 0
    assert_clean(llm)


def test_a_draft_vocabulary_under_two_ranks(mtp_checkpoint, tmp_path):
    """Each rank drafts from the map's ids in its vocabulary shard; a rank whose shard holds none of them
    still takes part in the reduction."""
    path, hf, layer = mtp_checkpoint
    allowed = list(range(3, VOCAB // 2, 3))  # rank 0's shard only
    token_map = write_map(tmp_path / "map.json", allowed)
    ids = [random.Random(5).randrange(2, VOCAB) for _ in range(30)]
    llm = LLM(str(path), dtype="float32", max_model_len=256, block_size=32, tensor_parallel_size=2,
              latent_cache_layout="sharded", kv_cache_memory="8MiB", speculative_method="mtp",
              num_speculative_tokens=2, speculative_token_map=str(token_map))
    try:
        llm.engine.add_request("r", {"prompt_token_ids": ids}, SamplingParams(max_tokens=4, temperature=0.0))
        llm.engine.step()
        seq = llm.engine.requests["r"].seqs[0]
        assert seq.mtp_draft_ids == reference_chain(hf, layer, ids + seq.output_token_ids, 2, allowed)
        llm.engine.abort("r")
        llm.engine.pool.check_whole()
    finally:
        llm.shutdown()


def test_int8_weights_draft_from_the_vocabulary_too(mtp_checkpoint, tmp_path):
    path, _, _ = mtp_checkpoint
    token_map = write_map(tmp_path / "map.json", list(range(0, VOCAB, 2)))
    prompts = make_prompts(3, seed=7, lo=5, hi=40)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain, _, _ = generate(path, params, prompts, quantization="int8")
    spec, stats, llm = generate(path, params, prompts, quantization="int8", speculative_method="mtp",
                                num_speculative_tokens=2, speculative_token_map=str(token_map))
    assert spec == plain and stats.num_draft_tokens > 0
    model = llm.engine.worker.model
    assert model.draft_head_packed is not None and model.draft_head_packed.quantized


def test_the_checkpoint_map_is_found_and_can_be_switched_off(tmp_path):
    (tmp_path / MAP_FILE).write_text("[5, 1, 5, 3]", encoding="utf-8")
    assert resolve_token_map(None, tmp_path, 10)[0] == [1, 3, 5]
    assert resolve_token_map("none", tmp_path, 10)[0] is None
    assert resolve_token_map(None, tmp_path / "elsewhere", 10)[0] is None
    own = write_map(tmp_path / "own.json", [9])
    ids, source = resolve_token_map(str(own), tmp_path, 10)
    assert ids == [9] and "1 of 10 tokens" in source


@pytest.mark.parametrize("text, problem", [
    ("[1, 2", "not valid JSON"),
    ("{}", "non-empty JSON list"),
    ("[]", "non-empty JSON list"),
    ("[1, 10]", "not token ids in [0, 10)"),
    ('[1, "2"]', "not token ids"),
    ("[true]", "not token ids"),
])
def test_a_bad_map_is_an_error_naming_the_file(tmp_path, text, problem):
    bad = tmp_path / "bad.json"
    bad.write_text(text, encoding="utf-8")
    with pytest.raises(InvalidParam, match="speculative_token_map") as e:
        load_token_map(bad, 10)
    assert problem in str(e.value) and str(bad) in str(e.value)
    with pytest.raises(InvalidParam, match="cannot be read"):
        load_token_map(tmp_path / "missing.json", 10)


def test_the_demo_model_ships_a_map_and_the_token_map_command_writes_one(tmp_path, capsys):
    ids = load_token_map(DEMO / MAP_FILE, 8192)
    assert 256 <= len(ids) < 8192 and 1 in ids  # the end-of-sequence token may be drafted
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 20, encoding="utf-8")
    out = tmp_path / "map.json"
    assert cli_main(["token-map", "--model", str(DEMO), "--size", "4", "--out", str(out), str(corpus)]) == 0
    written = json.loads(out.read_text())
    tokenizer = load_tokenizer(DEMO)
    counts = count_tokens(tokenizer, [corpus.read_text()])
    top = sorted(counts, key=lambda t: (-counts[t], t))[:4]
    assert written == [*dict.fromkeys(tokenizer.all_special_ids), *top]
    assert "covering" in capsys.readouterr().out
