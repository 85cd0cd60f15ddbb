"""A pre-quantised int8 checkpoint loaded as shipped (its matrices served from the mapped files) and with mapping
turned off (every matrix read into the process's own memory), in alternating fresh processes: load seconds and decode
tok/s at batch 1 and 8, to show what serving from the mapping changes.

    python bench/mapped_vs_read.py /tmp/real_size/v2lite-bf16-27-int8 --rounds 2

Results: ``bench/RESULTS_real_size.md`` ("Mapped or read, side by side").
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def worker(path: str, mode: str) -> None:
    import torch

    import mla_runtime.loader as loader
    from mla_runtime import LLM, SamplingParams

    if mode == "read":  # the loader with mapping off: a stored matrix is read like any other tensor
        init = loader._Reader.__init__

        def read_only(self, files, device=None) -> None:
            init(self, files, device)
            self.maps = False

        loader._Reader.__init__ = read_only  # type: ignore[method-assign]
    torch.set_num_threads(2)
    t = time.perf_counter()
    llm = LLM(path, dtype="float32", max_model_len=200, max_num_seqs=8, kv_cache_memory="256MiB",
              enable_prefix_caching=False, num_threads=2)
    load = time.perf_counter() - t
    engine, g, n, tok_s = llm.engine, torch.Generator().manual_seed(0), 0, {}
    top = min(engine.model_config.vocab_size, 30000)
    for batch in (1, 8):
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        for _ in range(batch):
            prompt = torch.randint(100, top, (64,), generator=g).tolist()
            engine.add_request(f"r{n}", {"prompt_token_ids": prompt}, params)
            n += 1
        engine.step()
        engine.step()
        steps = []
        for _ in range(16):
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        while engine.has_unfinished_requests():
            engine.step()
        tok_s[batch] = batch / statistics.median(steps)
    print(f"{mode}: load {load:.1f} s (imports excluded), b1 {tok_s[1]:.2f} tok/s, b8 {tok_s[8]:.2f} tok/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a pre-quantised int8 checkpoint (mla-runtime quantize)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--worker", choices=["mapped", "read"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.path, args.worker)
        return
    for _ in range(args.rounds):
        for mode in ("mapped", "read"):
            subprocess.run([sys.executable, __file__, args.path, "--worker", mode], check=True)


if __name__ == "__main__":
    main()
