"""``mla-runtime``: one command, one subcommand per tool.

    mla-runtime serve [--model PATH|ORG/NAME] [--port 8000] ...   # the HTTP server (same flags as server.py)
    mla-runtime plan --model deepseek-v3 --device-memory 141GiB    # the memory planner
    mla-runtime sweep --model PATH --eval-text held_out.txt        # latent rank × cache dtype sweep
    mla-runtime bench [--model PATH]                               # offline throughput
    mla-runtime hash PATH                                          # write PATH/SHA256SUMS (--verify-weights)
    mla-runtime warm --kv-cache-dir DIR --prompts prompts.txt      # precompute prefixes into the disk tier
    mla-runtime token-map --model PATH --out MAP.json corpus.txt   # the draft vocabulary of MTP speculation
    mla-runtime quantize --model SRC --quantization int4 --out DIR # a pre-quantised (compressed-tensors) copy
    mla-runtime rollout status|set-weight W|promote|rollback --url URL  # a running deployment's model versions

Each subcommand owns its flags (``mla-runtime SUBCOMMAND --help``); its module is imported only when it
runs, so ``plan`` does not import the server, and ``serve --help`` imports neither the server nor torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

# subcommand → (module with main(argv, prog), one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("mla_runtime.serving.server", "serve a checkpoint over HTTP (/generate, /v1/*, /metrics)"),
    "plan": ("mla_runtime.plan_cli", "split one device's memory into weights, activations and latent cache"),
    "sweep": ("mla_runtime.sweep", "latent rank × cache dtype: quality, bytes per token, capacity, speed"),
    "bench": ("mla_runtime.benchmark", "offline throughput of LLM.generate on a checkpoint"),
    "hash": ("mla_runtime.checksums", "write a checkpoint's sha256 manifest (SHA256SUMS) for --verify-weights"),
    "warm": ("mla_runtime.warm", "precompute the prefixes of common prompts into the disk tier (--kv-cache-dir)"),
    "token-map": ("mla_runtime.token_map", "count a corpus's tokens into the draft vocabulary of MTP speculation"),
    "quantize": ("mla_runtime.compressed", "write a checkpoint pre-quantised to int8/int4 (compressed-tensors)"),
    "rollout": ("mla_runtime.serving.rollout", "canary weight, promote, rollback of a running replicated server"),
}


def _version() -> str:
    try:
        return version("mla-runtime")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mla-runtime", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="An inference runtime for multi-head latent attention models (DeepSeek-V2/V3, Kimi-K2).",
        epilog="subcommands:\n" + "\n".join(f"  {name:<10}{summary}" for name, (_, summary) in COMMANDS.items())
        + "\n\nmla-runtime SUBCOMMAND --help lists the subcommand's flags and their defaults.")
    parser.add_argument("--version", action="version", version=f"mla-runtime {_version()}")
    parser.add_argument("command", choices=list(COMMANDS), metavar="SUBCOMMAND", help=", ".join(COMMANDS))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the subcommand's flags")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = f"mla-runtime {args.command}"
    if args.command == "serve":  # --help and flag errors before the server (and torch) is imported
        from mla_runtime.serving.config import build_parser as serve_parser

        serve_parser(prog).parse_args(args.args)
    module = importlib.import_module(COMMANDS[args.command][0])
    return module.main(args.args, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
