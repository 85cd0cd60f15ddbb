"""The gated delta rule's prefill (a linear-attention layer's prompt) on CPU: the compiled operator's chunked (WY)
form, blocks of 16, 32 and 64 tokens, against its token-after-token loop (``block=0``), on one sequence with
Kimi-Linear-like heads (32 heads of 128 x 128 by default), every variant this CPU runs; on CUDA the Triton kernels.

    python bench/bench_delta_rule.py                                     # 4096 tokens, 32 heads of 128 x 128
    python bench/bench_delta_rule.py --tokens 300 --heads 2 --repeats 1  # a quick check
    python bench/bench_delta_rule.py --torch                             # and the float32 torch reference (slow)

Each form runs once to warm up, then ``--repeats`` times; the median is printed as a markdown table with the CPU's
model name and torch's thread count, and each form's largest difference from the first one's outputs and state.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from bench_hybrid_ttft import cpu_model

from mla_kernels import cpu_kernels
from mla_runtime.layers import delta_rule

Run = Callable[[torch.Tensor], torch.Tensor]  # the state (updated in place) -> the outputs


def inputs(tokens: int, heads: int, dk: int, dv: int, device: str) -> tuple[torch.Tensor, ...]:
    """One prompt's prepared q, k, its v, log gates (as KDA's: <= 0, mostly small), beta and a nonzero state."""
    g = torch.Generator().manual_seed(0)
    q, k = delta_rule.prepared(torch.randn(tokens, heads, dk, generator=g), torch.randn(tokens, heads, dk, generator=g))
    v = torch.randn(tokens, heads, dv, generator=g)
    gate = -torch.nn.functional.softplus(torch.randn(tokens, heads, dk, generator=g) - 2.0)
    beta = torch.rand(tokens, heads, generator=g)
    state = 0.1 * torch.randn(1, heads, dk, dv, generator=g)
    return tuple(t.to(device) for t in (q, k, v, gate, beta, state))


def forms(args: argparse.Namespace, data: tuple[torch.Tensor, ...]) -> dict[str, Run]:
    q, k, v, gate, beta, _ = data
    slots = torch.zeros(1, dtype=torch.long, device=q.device)
    cu = torch.tensor([0, q.shape[0]], device=q.device)
    out: dict[str, Run] = {}
    if q.device.type == "cuda":
        from mla_kernels import linear_attention

        out["triton chunked (WY)"] = lambda s: linear_attention.chunked(q, k, v, gate, beta, s, slots, cu)
    elif cpu_kernels.failure("delta") is None:
        for variant in cpu_kernels.delta_variants():
            for block in (0, 16, 32, 64):
                name = f"compiled {variant}, " + (f"WY blocks of {block}" if block else "token after token")
                out[name] = (lambda s, variant=variant, block=block: cpu_kernels.delta_rule_prefill(
                    q, k, v, gate, beta, s, slots, cu, variant=variant, block=block))
    else:
        print(f"the compiled operators do not run here: {cpu_kernels.failure('delta')}")
    if args.torch:
        def reference(s: torch.Tensor) -> torch.Tensor:
            o, s[0] = delta_rule.chunked(q, k, v, gate, beta, s[0])
            return o

        out["torch chunked (WY) reference"] = reference
    return out


def timed(run: Run, state: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The median seconds of ``repeats`` runs (after one to warm up), the outputs and the state after one run."""
    s = state.clone()
    out = run(s)
    times = []
    for _ in range(repeats):
        again = state.clone()
        if state.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run(again)
        if state.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out, s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch", action="store_true", help="also time the float32 torch reference")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    data = inputs(args.tokens, args.heads, args.dk, args.dv, args.device)
    where = (torch.cuda.get_device_name() if args.device == "cuda"
             else f"{cpu_model()}, {torch.get_num_threads()} threads")
    print(f"{args.tokens} tokens, {args.heads} heads of {args.dk} x {args.dv}, {where}\n")
    print("| form | ms | tokens/s | largest difference (outputs, state) |")
    print("|---|---|---|---|")
    first: tuple[torch.Tensor, torch.Tensor] | None = None
    for name, run in forms(args, data).items():
        seconds, out, state = timed(run, data[5], args.repeats)
        first = first or (out, state)
        diff = f"{float((out - first[0]).abs().max()):.1e}, {float((state - first[1]).abs().max()):.1e}"
        print(f"| {name} | {1e3 * seconds:.1f} | {args.tokens / seconds:.0f} | {diff} |", flush=True)


if __name__ == "__main__":
    main()
