"""Offline throughput: N prompts of seeded random lengths through ``LLM.generate``, against transformers'
``generate`` on the same checkpoint and prompts, measured in the same run (``mla_runtime/benchmark.py``,
also ``mla-runtime bench``).

    python bench/bench_throughput.py                                  # 32 prompts, 16-256 tokens, 64 out
    python bench/bench_throughput.py --num-prompts 64 --max-tokens 128 --dtype bfloat16 --hf-batch 16

The checkpoint is the peer-comparison model of ``bench/peer_checkpoint.py`` unless ``--checkpoint`` names
another ``config.json`` + safetensors directory; ``--skip-transformers`` times mla-runtime alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peer_checkpoint import build_checkpoint  # noqa: E402

from mla_runtime.benchmark import build_parser, run  # noqa: E402


def main() -> int:
    ap = build_parser("bench/bench_throughput.py", __doc__)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.set_defaults(dtype="float32")
    args = ap.parse_args()
    args.compare_transformers = not args.skip_transformers
    if args.model is None:
        args.model = str(build_checkpoint(HERE / "out" / "peer_ckpt"))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
