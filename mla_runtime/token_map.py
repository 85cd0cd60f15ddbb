"""The draft vocabulary of MTP speculation: the tokens the draft head may propose (``speculative_token_map``).

An MTP draft link ends in the model's full ``[vocab, hidden]`` head, which on DeepSeek-V3 is 129k × 7168
values: as many bytes as a good part of the MoE layer the link runs. Most of those rows are tokens that a
draft almost never needs to propose. Restricting the draft head to the most frequent tokens (a "hot"
vocabulary, as FR-Spec does and SGLang's ``--speculative-token-map`` offers) reads a fraction of the head per
link. It cannot change the output: a draft is only a proposal that the full model verifies, so a token outside
the map is still generated — it is just never drafted.

A map is a JSON list of token ids (in any order, most frequent first by convention). The engine finds it:

- ``speculative_token_map=None`` (default): ``speculative_token_map.json`` in the checkpoint's folder where
  there is one (the demo model ships one), else the whole vocabulary;
- ``"none"``: the whole vocabulary;
- a path: that file.

``mla-runtime token-map`` writes one from text typical of the traffic (counting the tokens of the files given):

    mla-runtime token-map --model PATH --size 32768 --out PATH/speculative_token_map.json corpus/*.txt
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mla_runtime.errors import InvalidParam

MAP_FILE = "speculative_token_map.json"  # a checkpoint's own map, used unless speculative_token_map says otherwise
WHOLE_VOCABULARY = "none"
DEFAULT_SIZE = 32768


def load_token_map(path: str | Path, vocab_size: int) -> list[int]:
    """The sorted, distinct token ids of the map at ``path``; an ``InvalidParam`` naming the file and the problem."""
    def bad(why: str) -> InvalidParam:
        return InvalidParam("speculative_token_map", f"speculative_token_map {path}: {why}")

    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror or e})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"not valid JSON ({e})") from e
    if not isinstance(value, list) or not value:
        raise bad("expected a non-empty JSON list of token ids")
    wrong = [v for v in value if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < vocab_size]
    if wrong:
        raise bad(f"{len(wrong)} entries are not token ids in [0, {vocab_size}), e.g. {wrong[0]!r}")
    return sorted(set(value))


def resolve_token_map(setting: str | None, model_path: str | Path, vocab_size: int) -> tuple[list[int] | None, str]:
    """The draft vocabulary ``setting`` asks for (None: the whole vocabulary) and where it came from."""
    if setting is not None and setting.strip().lower() == WHOLE_VOCABULARY:
        return None, "the whole vocabulary (speculative_token_map 'none')"
    if setting is None:
        own = Path(model_path) / MAP_FILE
        if not own.is_file():
            return None, f"the whole vocabulary (no {MAP_FILE} in the checkpoint)"
        setting = str(own)
    ids = load_token_map(setting, vocab_size)
    return ids, f"{len(ids):,} of {vocab_size:,} tokens from {setting}"


def count_tokens(tokenizer: Any, texts: Iterable[str]) -> collections.Counter[int]:
    """How often each token id occurs in ``texts`` (no special tokens added)."""
    counts: collections.Counter[int] = collections.Counter()
    for text in texts:
        counts.update(tokenizer.encode(text, add_special_tokens=False))
    return counts


def hot_tokens(counts: collections.Counter[int], size: int, always: Iterable[int] = ()) -> list[int]:
    """``always`` (distinct), then the ``size`` most frequent other ids, most frequent first (ties: lower id)."""
    first = list(dict.fromkeys(always))
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t not in set(first)]
    return first + ranked[:size]


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    from mla_runtime.help_format import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=DefaultsHelpFormatter)
    ap.add_argument("files", nargs="+", help="text typical of the traffic (UTF-8)")
    ap.add_argument("--model", required=True, help="checkpoint folder or hub repo id (for its tokenizer)")
    ap.add_argument("--size", type=int, default=DEFAULT_SIZE, help="tokens in the map (the special tokens come on top)")
    ap.add_argument("--out", required=True, help=f"the JSON file to write (the engine reads <model>/{MAP_FILE})")
    args = ap.parse_args(argv)
    from mla_runtime.hub import resolve_model
    from mla_runtime.tokenizer import load_tokenizer

    if args.size < 1:
        ap.error(f"--size must be >= 1, got {args.size}")
    tokenizer = load_tokenizer(resolve_model(args.model))
    if tokenizer is None:
        ap.error(f"--model {args.model}: the checkpoint has no tokenizer")
    counts = count_tokens(tokenizer, (Path(f).read_text(encoding="utf-8", errors="replace") for f in args.files))
    special = [t for t in tokenizer.all_special_ids if t is not None]  # end-of-sequence may be drafted too
    ids = hot_tokens(counts, args.size, special)
    Path(args.out).write_text(json.dumps(ids) + "\n", encoding="utf-8")
    total = sum(counts.values())
    covered = sum(counts[t] for t in ids)
    print(f"{args.out}: {len(ids):,} tokens, covering {covered / max(total, 1):.1%} of the {total:,} tokens counted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
