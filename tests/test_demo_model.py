"""The committed demo checkpoint (``mla_runtime/demo_model``, built by ``bench/train_demo_model.py``).

Checks that it is a real, small MLA model that loads with stock ``transformers``, that its tokenizer is
lossless on arbitrary Unicode, and that it has actually learned Python: its perplexity on a fixed snippet
(written for this test, not taken from the training corpus) is far below both the uniform baseline
(``vocab_size``) and what the same architecture scores with random weights.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

DEMO = Path(__file__).resolve().parent.parent / "mla_runtime" / "demo_model"
MAX_FOLDER_BYTES = 20 * 1024 * 1024
# The trained checkpoint scores 13.6 on SNIPPET (280 tokens; see bench/RESULTS_demo.md); randomly
# initialised models of the same config score ~8,600-8,900 (uniform would be vocab_size = 8192). The
# bound leaves a wide margin for CPU/library numerics while still failing any model that has not
# learned Python.
PPL_BOUND = 30.0

SNIPPET = '''import os
import sys


class Inventory:
    """Keep track of items and their counts."""

    def __init__(self, path=None):
        self.path = path
        self.items = {}

    def add(self, name, count=1):
        if count < 0:
            raise ValueError("count must be positive")
        self.items[name] = self.items.get(name, 0) + count
        return self.items[name]

    def remove(self, name):
        if name not in self.items:
            raise KeyError(name)
        del self.items[name]

    def save(self):
        with open(self.path, "w") as f:
            for name, count in sorted(self.items.items()):
                f.write("%s %d\\n" % (name, count))


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    inventory = Inventory(os.path.join(os.getcwd(), "inventory.txt"))
    for arg in argv:
        inventory.add(arg)
    inventory.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=ids[None, :-1]).logits[0].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, ids[1:]).item())


def test_folder_is_small_and_complete():
    files = {f.name: f.stat().st_size for f in DEMO.iterdir() if f.is_file()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert name in files, f"{name} missing from {DEMO}"
    assert sum(files.values()) <= MAX_FOLDER_BYTES, f"demo_model is {sum(files.values()) / 2**20:.1f} MiB"


def test_loads_with_transformers_as_mla_model(model):
    cfg = model.config
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert cfg.model_type == "deepseek_v3"
    assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (128, 32, 16, 32)
    assert cfg.n_routed_experts == 4 and cfg.num_experts_per_tok == 2 and cfg.first_k_dense_replace == 1
    assert cfg.rope_interleave
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n_params < 20_000_000


def test_config_parses_with_runtime_config():
    from mla_runtime.config import ModelConfig

    cfg = ModelConfig.from_pretrained(DEMO)
    assert cfg.kv_lora_rank == 128 and cfg.moe is not None and cfg.moe.n_routed_experts == 4


def test_tokenizer_round_trips_unicode(tokenizer):
    fixed = [
        "",
        "def f(x):\n\treturn x  # trailing   \r\n",
        "naïve café — “quotes” … Ünïcödé",
        "日本語のテキスト 中文 한국어",
        "emoji 👩‍👩‍👧‍👦 🏳️‍🌈 🤖🐍",
        "عربى עברית RTL \u200f mixed \u200d zero-width",
        "combining e\u0301 a\u0308 \u0000 nul \x7f del \U0010ffff",
        "    indented\n        deeper\n",
        "<|bos|> literal special-looking text <|eos|>",
    ]
    rng = random.Random(0)
    alphabet_ranges = [(0x20, 0x7E), (0xA0, 0x2FFF), (0x3000, 0x9FFF), (0xE000, 0xFFFD), (0x1F300, 0x1FAFF)]
    randoms = []
    for _ in range(200):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(alphabet_ranges)
            chars.append(chr(rng.randint(lo, hi)))
        randoms.append("".join(chars))
    for text in fixed + randoms:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text, repr(text)
    ids = tokenizer("x = 1").input_ids
    assert ids[0] == tokenizer.bos_token_id


def test_trained_perplexity_far_below_uniform_and_random(model, tokenizer):
    from transformers import DeepseekV3ForCausalLM

    ids = torch.tensor(tokenizer(SNIPPET).input_ids)
    assert 150 < len(ids) < 600
    vocab = model.config.vocab_size
    trained = perplexity(model, ids)
    assert trained < PPL_BOUND, f"trained demo model perplexity {trained:.1f} on SNIPPET"
    assert trained < vocab / 100

    torch.manual_seed(0)
    untrained = DeepseekV3ForCausalLM._from_config(model.config, dtype=torch.float32).eval()
    random_ppl = perplexity(untrained, ids)
    assert random_ppl > 10 * PPL_BOUND, f"random-weight perplexity {random_ppl:.1f}: bound not discriminative"


def test_stop_strings_wait_for_min_tokens():
    """A stop string that ends within the text of the first ``min_tokens - 1`` tokens does not end the
    sequence; its next occurrence does (vLLM's semantics)."""
    from mla_runtime import LLM, SamplingParams

    greedy = dict(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(str(DEMO), dtype="float32", max_model_len=256, kv_cache_memory="4MiB") as llm:
        prompt = "def load(path):\n"
        free = llm.generate([prompt], SamplingParams(**greedy))[0].outputs[0]
        decode = llm.engine.tokenizer.decode
        stop = "path"
        assert free.text.count(stop) >= 2, free.text  # the demo model repeats its argument names
        j = next(k for k in range(1, len(free.token_ids) + 1) if stop in decode(free.token_ids[:k]))
        early = llm.generate([prompt], SamplingParams(**greedy, stop=stop))[0].outputs[0]
        assert early.finish_reason == "stop" and len(early.token_ids) == j
        assert early.text == free.text[:free.text.index(stop)]
        late = llm.generate([prompt], SamplingParams(**greedy, stop=stop, min_tokens=j + 1))[0].outputs[0]
        head = decode(free.token_ids[:j])  # stop strings must end after this text
        assert late.finish_reason == "stop" and len(late.token_ids) > j
        assert late.text == free.text[:free.text.index(stop, len(head) - len(stop) + 1)]
        llm.engine.pool.check_whole()
