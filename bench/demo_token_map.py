"""Write the demo model's MTP draft vocabulary (``mla_runtime/demo_model/speculative_token_map.json``).

    python bench/demo_token_map.py --size 1024

It counts the tokens of the demo model's training split (the corpus of ``bench/train_demo_model.py``: the
Python standard library's sources, held-out files excluded) and keeps the ``--size`` most frequent, plus the
special tokens (``mla_runtime.token_map``; ``mla-runtime token-map`` does the same for any checkpoint and text
files). The engine then drafts among those tokens only; see bench/RESULTS_speculative.md for the measured effect.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_model import build_corpus  # noqa: E402

from mla_runtime.token_map import MAP_FILE, count_tokens, hot_tokens  # noqa: E402
from mla_runtime.tokenizer import load_tokenizer  # noqa: E402

DEMO = Path(__file__).resolve().parent.parent / "mla_runtime" / "demo_model"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEMO))
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--max-corpus-mb", type=float, default=60.0, help="as the training scripts' flag")
    ap.add_argument("--out", default=None, help=f"default: <model>/{MAP_FILE}")
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.model)
    train, _ = build_corpus(args.max_corpus_mb)
    counts = count_tokens(tokenizer, (text for _, text in train))
    ids = hot_tokens(counts, args.size, tokenizer.all_special_ids)
    out = Path(args.out or Path(args.model) / MAP_FILE)
    out.write_text(json.dumps(ids) + "\n", encoding="utf-8")
    total = sum(counts.values())
    print(f"{out}: {len(ids)} tokens covering {sum(counts[t] for t in ids) / total:.1%} of the "
          f"{total:,} training tokens")


if __name__ == "__main__":
    main()
