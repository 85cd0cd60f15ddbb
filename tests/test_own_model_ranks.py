"""Hunyuan V4, dots3-note and GLM-5-Next (models of their own, over per-sequence state slots) through the engine, on
the conformance matrix's tiny checkpoints (``tests/conformance.py``, built by transformers' classes):

- two ranks (``tensor_parallel_size=2``): a batch of prompts of mixed lengths (past dots3-note's sliding window and
  past the indexers' top-k several times) gives one rank's greedy tokens; each rank holds and reads from the files
  only its shard (``models/v4_shards.py``), the state-holding parts whole. Against transformers: the conformance
  cells ``hy_v4 tp2-replicated`` and ``dots3_note tp2-replicated``;
- prefix hits: a sequence restored from a state snapshot keeps its own copy of the prefix's rows, so it holds fresh
  blocks for them (``Worker.own_prefix_copies``): two hits of one prefix running together share no block, their
  tokens are a cold engine's, and every block, slot and snapshot pin is free again after them; a snapshot the prefix
  cache forgets drops its rows at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mla_runtime import LLM, SamplingParams
from mla_runtime.models.dots3_note import load_dots3_note
from mla_runtime.models.hy_v4 import load_hy_v4
from mla_runtime.models.own_checkpoint import read_checkpoint
from mla_runtime.parallel import ParallelContext
from tests import conformance as C

pytest.importorskip("transformers")
LOADERS = {"hy_v4": load_hy_v4, "dots3_note": load_dots3_note}
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for model_type in ("hy_v4", "dots3_note", "glm5_next"):
        out[model_type] = tmp_path_factory.mktemp(model_type)
        C.build(model_type).save_pretrained(out[model_type])
    return out


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    st, out = model.new_state(), []
    logits = model(prompt, st)[-1]
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model([out[-1]], st)[-1]
    return out


def _held(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


@pytest.mark.parametrize("model_type", ["hy_v4", "dots3_note"])
def test_two_ranks_give_one_ranks_tokens_each_holding_its_shard(checkpoints: dict[str, Path], model_type: str
                                                                ) -> None:
    path, load = checkpoints[model_type], LOADERS[model_type]
    one = load(path)
    ps = C.prompts(C.V4_PROMPT_LENS)  # 1, 9, 17, 40 and 70 tokens
    want = [_greedy(one, p, GREEDY.max_tokens) for p in ps]
    llm = LLM(str(path), dtype="float32", max_model_len=96, kv_cache_memory="1MiB", max_num_seqs=3,
              max_num_batched_tokens=32, tensor_parallel_size=2)
    try:
        got = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
        w = llm.engine.worker
        assert w.weight_bytes == _held(w.own_model) < _held(one)
    finally:
        llm.shutdown()
    assert got == want
    whole = one.state_dict()
    parts = [load(path, par=ParallelContext(r, 2)).state_dict() for r in (0, 1)]
    attn, moe = "model.layers.1.self_attn.", "model.layers.1.mlp."
    for name, dim in ((attn + "q_b_proj.weight", 0), (attn + "kv_b_proj.weight", 0), (attn + "o_proj.weight", 1),
                      (moe + "experts.gate_up_proj", 0), (moe + "shared_experts.down_proj.weight", 1),
                      ("model.embed_tokens.weight", 0), ("lm_head.weight", 0)):
        assert torch.equal(torch.cat([parts[0][name], parts[1][name]], dim), whole[name]), name
    for name in (attn + "kv_a_proj_with_mqa.weight", "model.layers.0.self_attn.indexer.wk.weight", moe + "gate.weight"):
        assert torch.equal(parts[1][name], whole[name]), name  # what makes the state: whole on every rank


def test_a_rank_reads_only_its_slice_of_the_files(checkpoints: dict[str, Path]) -> None:
    def part(name: str, shape: list[int]) -> tuple[int, int, int] | None:
        return {"o_proj": (1, 8, 16), "q_b_proj": (0, 24, 48)}.get(name.split(".")[-2])

    _, _, tensors = read_checkpoint(checkpoints["hy_v4"], ("hy_v4",), keep=lambda n: "layers.2." in n, part=part)
    _, _, whole = read_checkpoint(checkpoints["hy_v4"], ("hy_v4",))
    for name, (dim, start, stop) in (("o_proj", (1, 8, 16)), ("q_b_proj", (0, 24, 48))):
        t = tensors[f"model.layers.2.self_attn.{name}.weight"]
        assert torch.equal(t, whole[f"model.layers.2.self_attn.{name}.weight"].narrow(dim, start, stop - start))
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # its own values only
    assert all(".layers.2." in n for n in tensors)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 cannot split this hy_v4 model: "
                                         r"num_attention_heads \(2\).*candidates: \[1, 2\]"):
        LLM(str(checkpoints["hy_v4"]), max_model_len=64, kv_cache_memory="1MiB", tensor_parallel_size=3)


@pytest.mark.parametrize("model_type", ["glm5_next", "hy_v4", "dots3_note"])
def test_prefix_hits_hold_blocks_of_their_own_and_give_every_block_back(checkpoints: dict[str, Path],
                                                                        model_type: str) -> None:
    path = checkpoints[model_type]
    ps = C.prompts((40, 45, 50), shared_prefix=36)  # a prefix of two whole blocks, with a snapshot at its end
    kw: dict[str, Any] = dict(dtype="float32", max_model_len=96, block_size=16, kv_cache_memory="1MiB", max_num_seqs=3)
    cold = LLM(str(path), enable_prefix_caching=False, **kw)
    try:
        want = [list(o.outputs[0].token_ids) for o in cold.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    finally:
        cold.shutdown()
    llm = LLM(str(path), **kw)
    engine = llm.engine
    try:
        free = engine.pool.num_free_blocks
        got = [list(llm.generate([{"prompt_token_ids": ps[0]}], GREEDY)[0].outputs[0].token_ids)]
        for i in (1, 2):
            engine.add_request(f"hit{i}", {"prompt_token_ids": ps[i]}, GREEDY)
        engine.step()
        hits = engine.scheduler.running
        assert len(hits) == 2 and all(s.num_cached_prompt_tokens == 32 for s in hits)
        tables = [set(s.block_table) for s in hits]
        assert not tables[0] & tables[1]  # each holds its own copy of the prefix's rows, and blocks for them
        assert free - engine.pool.num_free_blocks == sum(len(t) for t in tables)
        outs: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = list(out.outputs[0].token_ids)
        got += [outs["hit1"], outs["hit2"]]
        assert engine.pool.num_free_blocks == free and engine.scheduler.states.num_free == 3
        snapshots, states = engine.scheduler.snapshots, engine.worker.states
        snapshots.check_whole()
        assert len([s for s in states.snapshots if s is not None]) == snapshots.num_committed > 0
        engine.pool.free(engine.pool.allocate(free))  # every cached block evicted: their hashes and snapshots go
        assert snapshots.num_committed == 0 and all(s is None for s in states.snapshots)  # the rows with them
    finally:
        llm.shutdown()
    assert got == want
