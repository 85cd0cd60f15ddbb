"""The whole conformance matrix (``tests/conformance.py``): every supported model_type, in its fixed configuration and
in configurations drawn from seeds, under every cell (batching, chunked prefill, prefix caching, preemption, each
attention backend, two tensor-parallel layouts, int8 weights, prompt lookup, MTP, checkpoints stored in the
compressed-tensors, GGUF and ModelOpt formats), against transformers run one prompt at a time. Writes a report with
the machine and the time it took; exits 1 when a cell fails.

    python bench/conformance.py                                  # everything, fixed configs + seeds 1 and 2
    python bench/conformance.py --families deepseek_v32 axk2 --cells batched chunked --seeds 7
    python bench/conformance.py --replay deepseek_v32:1234:prefix-cache   # one cell the suite drew, by its seed
    python bench/conformance.py --families mistral_large4 --cells stored-nvfp4 --batch-invariant on
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton cell on CPU (before the first triton import)

from tests import conformance as C  # noqa: E402


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        lscpu = ""
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    model = fields.get("Model name", platform.processor()).strip()
    flags = [f for f in fields.get("Flags", "").split() if f.startswith(("avx", "amx", "fma", "f16c"))]
    return f"{model}, {os.cpu_count()} CPUs, {platform.machine()}; ISA flags: {' '.join(flags) or 'n/a'}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="*", default=list(C.MODEL_TYPES), choices=C.MODEL_TYPES)
    ap.add_argument("--cells", nargs="*", default=list(C.CELLS), choices=list(C.CELLS))
    ap.add_argument("--seeds", nargs="*", type=int, default=[1, 2],
                    help="configuration seeds besides the fixed configuration")
    ap.add_argument("--no-fixed", action="store_true", help="only the seeded configurations")
    ap.add_argument("--replay", help="model_type:seed:cell (seed 'fixed' for the fixed configuration)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "conformance.md")
    ap.add_argument("--batch-invariant", choices=("auto", "on", "off"),
                    help="the engine's batch_invariant in every cell (default: each cell's own, auto)")
    args = ap.parse_args()

    if args.replay:
        model_type, seed_text, cell = args.replay.split(":")
        plan = [(model_type, None if seed_text == "fixed" else int(seed_text), [cell])]
    else:
        configs: list[int | None] = ([] if args.no_fixed else [None]) + list(args.seeds)
        plan = [(f, s, args.cells) for f in args.families for s in configs]

    root = Path(tempfile.mkdtemp(prefix="mla-conformance-"))
    start = time.perf_counter()
    results: list[C.Result] = []
    skipped = 0
    try:
        for model_type, seed, cells in plan:
            try:
                family = C.Family(model_type, seed, root)
            except Exception as e:  # noqa: BLE001 - a configuration that cannot be built fails its cells, named
                for name in cells:
                    results.append(C.Result(model_type, seed, name, 0, [], [f"building: {type(e).__name__}: {e}"],
                                            0.0))
                    print(results[-1].line(), flush=True)
                continue
            for name in cells:
                cell = C.CELLS[name]
                if args.batch_invariant:
                    cell = dataclasses.replace(cell, llm={**cell.llm, "batch_invariant": args.batch_invariant})
                if not C.applicable(family, cell):
                    skipped += 1
                    continue
                try:
                    result = C.run_cell(family, cell)
                except Exception as e:  # noqa: BLE001 - a cell that cannot run is a failed cell, named
                    result = C.Result(model_type, seed, name, 0, [], [f"{type(e).__name__}: {e}"], 0.0)
                results.append(result)
                print(result.line(), flush=True)
    finally:
        C.cleanup(root)
    took = time.perf_counter() - start
    failed = [r for r in results if not r.ok]
    prompts = sum(r.equal + len(r.accepted) + len(r.failed) for r in results)
    equal = sum(r.equal for r in results)
    summary = (f"{len(results)} cells ({skipped} not applicable), {prompts} prompts: {equal} equal, "
               f"{sum(len(r.accepted) for r in results)} at named near-ties, {sum(len(r.failed) for r in results)} "
               f"failed; {took / 60:.1f} min")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python bench/conformance.py", *sys.argv[1:]])
    lines = ["# Conformance matrix", "", f"- {time.strftime('%Y-%m-%d')}: `{command}`", f"- Machine: {machine()}",
             f"- {summary}", "",
             "| model_type | config | cell | equal | notes |", "|---|---|---|---:|---|"]
    for r in results:
        total = r.equal + len(r.accepted) + len(r.failed)
        notes = "; ".join([f"near-tie: {a}" for a in r.accepted] + [f"**failed**: {f}" for f in r.failed])
        lines.append(f"| {r.model_type} | {'fixed' if r.seed is None else r.seed} | {r.cell} | {r.equal}/{total} | "
                     f"{notes} |")
    args.out.write_text("\n".join(lines) + "\n")
    print(summary)
    print(f"report: {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
