"""DeepSeek-V4 (``deepseek_v4``) against transformers' own classes on a tiny random checkpoint with all three layer
kinds (sliding, CSA, HCA): prompts past the sliding window and past several compressed entries of each compressor
(CSA's past the indexer's top-k). Prefill logits whole; greedy tokens one prompt at a time, in chunks, and as a
mixed stream of steps (prompts of different lengths admitted while others decode, chunked prefill, a sequence
preempted and recomputed); the released checkpoint layout and transformers' in-memory names both load; the config's
refusals name what they refuse."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from mla_runtime.cache.state_cache import StateSlots
from mla_runtime.families import family_of
from mla_runtime.forward_batch import ForwardBatch
from mla_runtime.models.deepseek_v4 import DeepseekV4ForCausalLM, V4Config, V4StateCache, load_deepseek_v4
from mla_runtime.models.deepseek_v4 import state_bytes as v4_state_bytes
from tests.checkpoints import VOCAB

WINDOW, CSA_RATE, HCA_RATE, TOPK = 8, 4, 16, 3
CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
    partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=WINDOW,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": CSA_RATE, "heavily_compressed_attention": HCA_RATE},
    index_n_heads=8, index_head_dim=16, index_topk=TOPK, hc_mult=3, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], swiglu_limit=0.3,
    bos_token_id=0, eos_token_id=1, max_position_embeddings=512)
PROMPT_LENS = (45, 70, 3, 19, 33)  # past the window; past TOPK CSA entries; several HCA entries (70 + new)
NEW_TOKENS = 12


def build(**changes: Any) -> Any:
    """transformers' DeepSeek-V4 (tiny; ``CONFIG`` with ``changes``), weights re-randomised so that every tensor
    matters: sinks, window biases, hyper-connection mixes and routing tables spread."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.DeepseekV4ForCausalLM(tf.DeepseekV4Config(**{**CONFIG, **changes}))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("scale"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith((".fn", "hc_fn")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, DeepseekV4ForCausalLM]:
    hf = build()
    path = tmp_path_factory.mktemp("deepseek_v4")
    hf.save_pretrained(path)
    return hf, load_deepseek_v4(path)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(pair: tuple[Any, DeepseekV4ForCausalLM]) -> list[list[int]]:
    hf, _ = pair
    out = []
    for p in prompts():
        with torch.no_grad():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
        out.append(ids[0, len(p):].tolist())
    return out


def test_prompts_reach_every_kind_of_entry() -> None:
    longest = max(PROMPT_LENS)
    assert longest > WINDOW and longest // CSA_RATE > 2 * TOPK and longest // HCA_RATE >= 4
    assert set(CONFIG["layer_types"]) == {"sliding_attention", "compressed_sparse_attention",
                                          "heavily_compressed_attention"}


def test_prefill_logits_match(pair: tuple[Any, DeepseekV4ForCausalLM]) -> None:
    hf, ours = pair
    for p in prompts():
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        mine = ours.compute_logits(ours(torch.tensor(p), ours.new_state()))
        assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (len(p), (mine - ref).abs().max().item())


def test_greedy_one_at_a_time_and_chunked(pair: tuple[Any, DeepseekV4ForCausalLM],
                                          reference: list[list[int]]) -> None:
    _, ours = pair
    for p, ref in zip(prompts(), reference):
        assert ours.generate_greedy(p, NEW_TOKENS) == ref, len(p)
        for chunk in (1, 5, 16):
            assert ours.generate_greedy(p, NEW_TOKENS, chunk=chunk) == ref, (len(p), chunk)


class Seq:
    def __init__(self, model: DeepseekV4ForCausalLM, prompt: list[int]) -> None:
        self.model, self.tokens, self.prompt_len = model, list(prompt), len(prompt)
        self.state, self.fed = model.new_state(), 0

    @property
    def out(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def preempt(self) -> None:
        """Give everything back; the next steps recompute the prompt and the tokens so far."""
        self.state, self.fed = self.model.new_state(), 0


def run_stream(model: DeepseekV4ForCausalLM, budget: int, preempt_at: int | None) -> list[list[int]]:
    """Steps of at most ``budget`` tokens: one prompt admitted per step, decodes first, prompts in chunks; at step
    ``preempt_at`` the second sequence is preempted."""
    waiting = [Seq(model, p) for p in prompts()]
    running: list[Seq] = []
    done: list[Seq] = []
    step = 0
    while waiting or running:
        if waiting:
            running.append(waiting.pop(0))
        if step == preempt_at and len(running) > 1:
            running[1].preempt()
        running.sort(key=lambda s: len(s.tokens) - s.fed)  # decodes (one new token) first
        batch, fed, left = [], [], budget
        for s in running:
            n = min(len(s.tokens) - s.fed, left)
            if n:
                batch.append((torch.tensor(s.tokens[s.fed:s.fed + n]), s.state))
                fed.append((s, n))
                left -= n
        for (s, n), logits in zip(fed, model.step(batch)):
            s.fed += n
            if s.fed == len(s.tokens):
                s.tokens.append(int(logits.argmax()))
        done += [s for s in running if len(s.out) == NEW_TOKENS]
        running = [s for s in running if len(s.out) < NEW_TOKENS]
        step += 1
    order = {id(s.state): i for i, s in enumerate(done)}
    assert len(order) == len(PROMPT_LENS)
    by_prompt = {tuple(s.tokens[:s.prompt_len]): s.out for s in done}
    return [by_prompt[tuple(p)] for p in prompts()]


@pytest.mark.parametrize("budget,preempt_at", [(16, None), (7, 3), (64, 6)])
def test_mixed_steps_give_each_sequence_its_tokens(pair: tuple[Any, DeepseekV4ForCausalLM],
                                                   reference: list[list[int]], budget: int,
                                                   preempt_at: int | None) -> None:
    _, ours = pair
    assert run_stream(ours, budget, preempt_at) == reference


def test_bfloat16_matches_transformers_bfloat16(tmp_path: Path) -> None:
    """In bfloat16 the model rounds where the reference does (float32 norms, gates, hyper-connections, sinks and
    router bias; cos/sin tables in bfloat16): logits and greedy tokens equal transformers' in bfloat16."""
    import transformers as tf

    build().save_pretrained(tmp_path)
    hf = tf.DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ours = load_deepseek_v4(tmp_path, torch.bfloat16)
    for p in prompts()[:2]:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
            want = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, len(p):]
        mine = ours.compute_logits(ours(torch.tensor(p), ours.new_state()))
        assert torch.allclose(mine, ref, atol=2e-2), (len(p), (mine - ref).abs().max().item())
        assert ours.generate_greedy(p, 6, chunk=9) == want.tolist()


def test_yarn_on_the_compressed_layers(tmp_path: Path) -> None:
    """A flat YaRN ``rope_parameters`` applies to the compressed layers only (without YaRN's cos/sin factor), past
    its original context."""
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32}
    hf = build(rope_parameters=yarn)
    hf.save_pretrained(tmp_path)
    ours = load_deepseek_v4(tmp_path)
    assert ours.config.compress_rope.kind == "yarn" and ours.config.main_rope.kind == "default"
    p = prompts()[1]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0].float()
    mine = ours.compute_logits(ours(torch.tensor(p), ours.new_state()))
    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (mine - ref).abs().max().item()


def run_engine_steps(model: DeepseekV4ForCausalLM, budget: int, num_slots: int, preempt_at: int) -> list[list[int]]:
    """As the engine steps: a sequence is admitted only with a free state slot, each step is one ``ForwardBatch``
    (decodes first, then chunks) carrying every sequence's slot; a slot goes back on finish and on preemption (the
    second running sequence at step ``preempt_at``, which later recomputes from its first token in whatever slot is
    free)."""
    slots, states = StateSlots(num_slots), V4StateCache(model.config, num_slots)
    waiting, running, outs, step = [Seq(model, p) for p in prompts()], [], {}, 0
    held: dict[int, int] = {}  # id(seq) -> its slot
    while waiting or running:
        while waiting and slots.num_free:
            s = waiting.pop(0)
            held[id(s)] = slots.take()
            running.append(s)
        if step == preempt_at and len(running) > 1:
            victim = running.pop(1)
            slots.give_back(held.pop(id(victim)))
            victim.fed = 0
            waiting.insert(0, victim)
        running.sort(key=lambda s: len(s.tokens) - s.fed)
        chunks, fed, left = [], [], budget
        for s in running:
            n = min(len(s.tokens) - s.fed, left)
            if n:
                chunks.append(s.tokens[s.fed:s.fed + n])
                fed.append(s)
                left -= n
        batch = ForwardBatch.build(chunks, [s.fed for s in fed], [[0] * (1 + (s.fed + len(c)) // 16)
                                                                 for s, c in zip(fed, chunks)], 16,
                                   state_slots=[held[id(s)] for s in fed])
        logits = model.compute_logits(model.forward_batch(batch, states)[batch.logits_indices])
        for s, c, row in zip(fed, chunks, logits):
            s.fed += len(c)
            if s.fed == len(s.tokens):
                s.tokens.append(int(row.argmax()))
        for s in [s for s in running if len(s.out) == NEW_TOKENS]:
            slots.give_back(held.pop(id(s)))
            outs[tuple(s.tokens[:s.prompt_len])] = s.out
        running = [s for s in running if len(s.out) < NEW_TOKENS]
        step += 1
    assert slots.num_free == num_slots and not held
    return [outs[tuple(p)] for p in prompts()]


@pytest.mark.parametrize("budget,num_slots,preempt_at", [(16, 2, 4), (40, 3, 2)])
def test_engine_steps_over_state_slots(pair: tuple[Any, DeepseekV4ForCausalLM], reference: list[list[int]],
                                       budget: int, num_slots: int, preempt_at: int) -> None:
    _, ours = pair
    assert run_engine_steps(ours, budget, num_slots, preempt_at) == reference


def test_a_step_that_does_not_continue_its_slot_is_refused(pair: tuple[Any, DeepseekV4ForCausalLM]) -> None:
    _, ours = pair
    states = V4StateCache(ours.config, 2)
    first = ForwardBatch.build([[5, 6, 7]], [0], [[0]], 16, state_slots=[1])
    ours.forward_batch(first, states)
    with pytest.raises(RuntimeError, match="slot 1 holds 3 tokens"):
        ours.forward_batch(ForwardBatch.build([[8]], [5], [[0]], 16, state_slots=[1]), states)
    with pytest.raises(ValueError, match="state_slots"):
        ours.forward_batch(ForwardBatch.build([[8]], [3], [[0]], 16), states)


def test_transformers_names_load(pair: tuple[Any, DeepseekV4ForCausalLM]) -> None:
    """A checkpoint written with transformers' in-memory names (no conversion) loads to the same model."""
    from safetensors.torch import save_file

    hf, ours = pair
    with tempfile.TemporaryDirectory() as d:
        hf.config.save_pretrained(d)
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(Path(d) / "model.safetensors"))
        again = load_deepseek_v4(d)
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_state_is_bounded_by_the_window_and_entries(pair: tuple[Any, DeepseekV4ForCausalLM]) -> None:
    _, ours = pair
    st = ours.new_state()
    ours(torch.tensor(prompts()[1]), st)
    assert all(layer.window is not None and layer.window.shape[0] == WINDOW - 1 for layer in st.layers)
    assert st.layers[1].compressor.count == PROMPT_LENS[1] // CSA_RATE
    assert st.layers[2].compressor.count == PROMPT_LENS[1] // HCA_RATE
    assert st.nbytes() == v4_state_bytes(ours.config, PROMPT_LENS[1])
    short = ours.new_state()
    ours(torch.tensor(prompts()[2]), short)  # shorter than a CSA window: no overlapping half yet
    assert short.nbytes() == v4_state_bytes(ours.config, PROMPT_LENS[2])


@pytest.mark.parametrize("change,named", [
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(layer_types=["full_attention"] * 4), "layer_types"),
    (dict(mlp_layer_types=["dense"] * 4), "mlp_layer_types"),
    (dict(o_groups=3), "o_groups"),
    (dict(rope_parameters={"rope_type": "longrope"}), "rope_type"),
    (dict(sliding_window=0), "sliding_window 0"),
    (dict(compress_rates={"compressed_sparse_attention": 0, "heavily_compressed_attention": 16}),
     "compressed_sparse_attention"),
])
def test_config_refusals_name_the_setting(change: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        V4Config.from_raw({**CONFIG, "model_type": "deepseek_v4", **change})


def test_the_mla_loader_names_the_v4_model() -> None:
    """``ModelConfig`` (DeepSeek's MLA decoder) does not describe V4: its adapter lookup names V4's own model."""
    with pytest.raises(ValueError, match="deepseek_v4.*own model"):
        family_of({**CONFIG, "model_type": "deepseek_v4"})
