"""Structured outputs: tokens/s with and without a JSON schema, and the per-token mask time, in one run.

    python bench/bench_structured.py --batch 1 8 --rounds 5 --max-tokens 64

The model is the benchmark checkpoint (``peer_checkpoint.py``: random weights, vocabulary 32,000). It has no
tokenizer, so this script trains a byte-level BPE tokenizer of exactly that vocabulary on the Python standard
library's sources and saves it next to links to the weights (``bench/out/structured/``, reused), so that
llguidance masks a real 32,000-token vocabulary. The random weights write random allowed tokens: the JSON
stays valid, its content is noise, and a value may end before ``max_tokens`` (tokens/s counts the tokens
generated).

For each batch size it alternates rounds without and with the schema (A, B, A, B ... on one engine, so load
changes hit both alike) and prints the medians and the overhead ``1 - B / A``. It also prints, from the
constrained rounds, how long each step's masks took (they are computed during the forward pass) and how long
the step then waited for them; and the per-token mask time of one matcher alone, p50 / p99, measured by
replaying every constrained output token by token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
from peer_checkpoint import CONFIG, build_checkpoint, make_prompts

from mla_runtime import LLM, SamplingParams, StructuredOutputs

OUT = Path(__file__).resolve().parent / "out"
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["id", "kind", "items", "owner"],
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "kind": {"enum": ["file", "directory", "link"]},
        "owner": {"type": "object", "required": ["name", "uid"],
                  "properties": {"name": {"type": "string"}, "uid": {"type": "integer"}}},
        "items": {"type": "array", "items": {"type": "object", "required": ["path", "size"], "properties": {
            "path": {"type": "string"}, "size": {"type": "number", "minimum": 0}, "tags": {
                "type": "array", "items": {"type": "string"}}}}},
    },
}


def checkpoint_with_tokenizer(seed: int) -> Path:
    """The benchmark checkpoint (built or reused) with a trained tokenizer of its vocabulary."""
    weights = build_checkpoint(OUT / "peer_ckpt", seed=seed)
    out = OUT / "structured" / "peer_ckpt_tok"
    if (out / "tokenizer.json").exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        (out / name).unlink(missing_ok=True)
        (out / name).symlink_to(weights.resolve() / name)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=CONFIG["vocab_size"], special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>").save_pretrained(out)
    return out


def one_round(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    return seconds, sum(map(len, tokens)), tokens


def replay_mask_times(llm: LLM, spec: StructuredOutputs, outputs: list[list[int]]) -> list[float]:
    """Seconds of each token's mask for one matcher alone (no batching, no overlap)."""
    state = llm.engine.grammars.new_state(spec)
    words = (llm.engine.model_config.vocab_size + 31) // 32
    bits = torch.zeros(words, dtype=torch.int32)
    times = []
    for tokens in outputs:
        state.matcher.reset()
        for t in tokens:
            t0 = time.perf_counter()
            state.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), words * 4)
            times.append(time.perf_counter() - t0)
            if not state.matcher.consume_token(t):
                break
    return times


def mask_walk(path: Path, tokens: int, walks: int, seed: int) -> list[float]:
    """Per-token mask seconds of one matcher alone, without the model: ``walks`` walks of ``tokens`` tokens through
    the schema's grammar, each token drawn uniformly from the mask (what the random-weights model does)."""
    import random

    from transformers import AutoTokenizer

    from mla_runtime.engine.structured import GrammarCompiler

    vocab = CONFIG["vocab_size"]
    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(str(path)), vocab, [1])
    spec = StructuredOutputs(json=SCHEMA)
    words = (vocab + 31) // 32
    bits = torch.zeros(words, dtype=torch.int32)
    rng, times = random.Random(seed), []
    for _ in range(walks):
        state = compiler.new_state(spec)
        for _ in range(tokens):
            t0 = time.perf_counter()
            state.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), words * 4)
            times.append(time.perf_counter() - t0)
            allowed = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().nonzero()[:, 0]
            if state.finished or not len(allowed):
                break
            state.accept(int(allowed[rng.randrange(len(allowed))]))
    return times


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def bench_batch(llm: LLM, batch: int, args: argparse.Namespace) -> None:
    spec = StructuredOutputs(json=SCHEMA)
    prompts = make_prompts(batch, args.prompt_len, CONFIG["vocab_size"], seed=args.seed)
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                                 structured_outputs=spec)
    one_round(llm, prompts, plain)  # warm-up: both paths (and the schema's compilation)
    one_round(llm, prompts, constrained)
    masks = llm.engine.runner.masks
    masks.mask_seconds.clear()
    masks.wait_seconds.clear()
    rates: dict[str, list[float]] = {"plain": [], "schema": []}
    tokens_per_round: dict[str, list[int]] = {"plain": [], "schema": []}
    outputs: list[list[int]] = []
    for _ in range(args.rounds):
        for name, params in (("plain", plain), ("schema", constrained)):
            seconds, n, toks = one_round(llm, prompts, params)
            rates[name].append(n / seconds)
            print(f"  batch {batch} {name}: {n} tokens in {seconds:.2f} s = {n / seconds:.1f} tokens/s", flush=True)
            tokens_per_round[name].append(n)
            if name == "schema":
                outputs += toks
    a, b = statistics.median(rates["plain"]), statistics.median(rates["schema"])
    step_ms = [s * 1e3 for s, _ in masks.mask_seconds]
    wait_ms = [w * 1e3 for w in masks.wait_seconds]
    token_us = [t * 1e6 for t in replay_mask_times(llm, spec, outputs)]
    print(f"batch {batch}: tokens/s plain {a:.1f}  schema {b:.1f}  overhead {100 * (1 - b / a):+.1f} %  "
          f"(tokens per round: plain {statistics.median(tokens_per_round['plain'])}, "
          f"schema {statistics.median(tokens_per_round['schema'])})")
    print(f"  step masks (computed during the forward): p50 {pct(step_ms, .5):.3f} ms  p99 {pct(step_ms, .99):.3f} ms;"
          f" the step waited for them after its forward: p50 {pct(wait_ms, .5):.3f} ms  p99 {pct(wait_ms, .99):.3f} ms")
    print(f"  per-token mask, one matcher alone ({len(token_us)} tokens): p50 {pct(token_us, .5):.0f} us  "
          f"p99 {pct(token_us, .99):.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--masks-only", action="store_true", help="only the per-token mask time, without the model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = checkpoint_with_tokenizer(args.seed)
    if args.masks_only:
        us = [t * 1e6 for t in mask_walk(path, args.max_tokens, 20, args.seed)]
        print(f"per-token mask, one matcher alone, vocabulary {CONFIG['vocab_size']} ({len(us)} tokens): "
              f"p50 {pct(us, .5):.0f} us  p99 {pct(us, .99):.0f} us  mean {statistics.mean(us):.0f} us")
        return
    print(" ".join(sys.argv), f"| torch threads {args.threads} | dtype {args.dtype}", flush=True)
    with LLM(str(path), dtype=args.dtype, max_model_len=512, kv_cache_memory="256MiB",
             max_num_seqs=max(args.batch), enable_prefix_caching=False) as llm:
        for batch in args.batch:
            bench_batch(llm, batch, args)


if __name__ == "__main__":
    main()
