"""The conformance matrix (``tests/conformance.py``) within the suite's budget: a fixed core (every sparse family and
a dense one, batched, on their fixed configurations: the sparse ones meet exact ties of the indexer's scores, which
must go to the lowest position whatever the batch; int8 weights batched and alone, equal only where no product's
rounding depends on the rows beside it; MTP verification on a sparse family; a hybrid, whose linear-attention states
must stay each sequence's own when batched, chunked and preempted; GLM-5-Next's pooled indexer and hyper-connections
over its state slots; DeepSeek-V4 batched on two ranks; Hunyuan V4's shared selections, sinks and output gate, and
dots3-note's sliding and indexed layers, batched, chunked and preempted, and on two ranks; a checkpoint stored in
NVFP4, written by ``mla-runtime quantize``, batched and alone), plus cells drawn from a
seed that the run prints (``$MLA_CONFORMANCE_SEED`` replays one; ``$MLA_CONFORMANCE_DRAWS`` sets how many). ``python
bench/conformance.py`` runs the whole matrix."""

from __future__ import annotations

import os
import random
import time

import pytest

from tests import conformance as C

CORE = [("deepseek_v32", "batched"), ("glm_moe_dsa", "batched"), ("axk2", "batched"),
        ("mistral_large4", "batched"), ("deepseek_v3", "batched"), ("deepseek_v32", "chunked"),
        ("deepseek_v32", "int8"), ("glm_moe_dsa", "mtp"), ("kimi_linear", "batched"), ("kimi_linear", "chunked"),
        ("kimi_linear", "preemption"), ("bailing_hybrid", "chunked"),
        ("deepseek_v4", "chunked-preemption"), ("deepseek_v4", "tp2-replicated"), ("glm5_next", "batched"),
        ("glm5_next", "chunked-preemption"),
        ("glm5_next", "prefix-cache"), ("hy_v4", "chunked-preemption"), ("hy_v4", "tp2-replicated"),
        ("dots3_note", "chunked-preemption"), ("dots3_note", "tp2-replicated"), ("deepseek_v2", "stored-nvfp4")]
SEED = int(os.environ.get("MLA_CONFORMANCE_SEED") or time.time_ns() % 1_000_000)
DRAWS = C.sample(random.Random(SEED), int(os.environ.get("MLA_CONFORMANCE_DRAWS") or 3))


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    built: dict[tuple[str, int | None], C.Family] = {}
    root = tmp_path_factory.mktemp("conformance")

    def get(model_type: str, seed: int | None) -> C.Family:
        if (model_type, seed) not in built:
            built[(model_type, seed)] = C.Family(model_type, seed, root)
        return built[(model_type, seed)]

    return get


def check(result: C.Result, replay: str) -> None:
    print(result.line())
    assert result.ok, f"{result.line()}\nreplay: python bench/conformance.py --replay {replay}"
    assert result.equal + len(result.accepted) == len(C.prompt_lens(result.model_type))


@pytest.mark.parametrize(("model_type", "cell"), CORE, ids=[f"{m}-{c}" for m, c in CORE])
def test_fixed_core_equals_transformers(families, model_type, cell):
    check(C.run_cell(families(model_type, None), C.CELLS[cell]), f"{model_type}:fixed:{cell}")


@pytest.mark.parametrize(("model_type", "config_seed", "cell"), DRAWS,
                         ids=[f"draw{i}-seed{SEED}-{m}-{s}-{c}" for i, (m, s, c) in enumerate(DRAWS)])
def test_drawn_cell_equals_transformers(families, model_type, config_seed, cell):
    print(f"conformance draw seed {SEED} ($MLA_CONFORMANCE_SEED replays it): {model_type} config seed "
          f"{config_seed}, cell {cell}")
    check(C.run_cell(families(model_type, config_seed), C.CELLS[cell]), f"{model_type}:{config_seed}:{cell}")


def test_a_divergence_is_accepted_only_at_a_named_near_tie():
    ref = C.Reference(tokens=[5, 6, 7], logit_gaps=[0.2, 0.3, 5e-5], score_gaps=[0.1, 0.1, 0.1])
    assert C.explain(ref, [5, 6, 7]) == (True, "equal")
    ok, why = C.explain(ref, [5, 9, 7])
    assert not ok and "token 1" in why and "3.00e-01" in why
    ok, why = C.explain(ref, [5, 6, 8])
    assert ok and why.startswith("near-tie of the logits") and "token 2" in why
    tied = C.Reference(tokens=[5, 6, 7], logit_gaps=[0.2, 0.3, 0.3], score_gaps=[0.1, 2e-6, 0.1])
    ok, why = C.explain(tied, [5, 6, 8])
    assert ok and why.startswith("near-tie of an indexer selection")
    assert not C.explain(ref, [5, 6])[0]
    assert not C.explain(tied, [5, 6, 8], score_tie=1e-6)[0]  # bounds of the caller's (the int8 cell's)


def test_drawn_configurations_vary_the_shapes():
    """The seeded configurations reach the shapes that fixed ones share by accident (a RoPE width equal to the
    indexer's, or half of it; one routed expert per token; no dense first layer)."""
    seen = [C.text_config("deepseek_v32", random.Random(s)) for s in range(60)]
    ratios = {c["index_head_dim"] // c["qk_rope_head_dim"] for c in seen}
    assert {1, 2} <= ratios
    assert {c["num_experts_per_tok"] for c in seen} >= {1, 2, 3}
    assert {c["first_k_dense_replace"] for c in seen} == {0, 1}
    assert len({(c["num_attention_heads"], c["kv_lora_rank"], c["index_topk"]) for c in seen}) > 20
