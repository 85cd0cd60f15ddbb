"""GGUF block types on the CPU: the compiled kernels that read the stored blocks against the product that widens the
weight per call (the fallback), one matrix per type.

    python bench/bench_ggml.py                      # [4096, 4096], 1 and 8 rows, every type the kernels read
    python bench/bench_ggml.py --shape 4096x1024 --rows 1 64 --types Q4_K Q6_K

For each type, row count and variant it prints the best of ``--repeats`` calls in milliseconds (Q4_K also repacked
eight rows at a time, ``Q4_K_R8``, as a load holds it where the kernels run), beside the widened product
(``GgufWeight`` bound to ``cpu_gemm=plain``: the ``gguf`` package's dequantisers a block of rows at a time, then
oneDNN's float32 product), and the ratio. The weights are random valid blocks (their values do not change the
time) and stay hot across calls, so the kernels' times are those of a matrix in cache, not of one streamed from
memory. Set ``MLA_CPU_ISA=avx2`` to see what an AVX2 CPU runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from mla_kernels import cpu_kernels
from mla_kernels.cpu_check import GGML_TYPES
from mla_runtime.kernel_plan import kernel_plan
from mla_runtime.layers.gguf_weight import GgufWeight, row_bytes


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def random_blocks(type_name: str, n: int, k: int) -> torch.Tensor:
    """Random bytes with every float16 field a small positive value: valid blocks of ``type_name``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    data = np.random.default_rng(0).integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for offset in GGML_TYPES[type_name]:
        data[..., offset:offset + 2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    return torch.from_numpy(data.reshape(n, row_bytes(type_name, k)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4096x4096", help="N x K")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--types", nargs="+", default=list(GGML_TYPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from gguf import GGMLQuantizationType

    n, k = (int(v) for v in args.shape.split("x"))
    why = cpu_kernels.failure("ggml")
    if why is not None:
        raise SystemExit(f"the ggml-type kernels do not run here: {why}")
    print(f"[{n}, {k}], {torch.get_num_threads()} threads; ms, best of {args.repeats}")
    for type_name in args.types:
        data = random_blocks(type_name, n, k)
        widened = GgufWeight([(type_name, data)], k, torch.float32).bind(kernel_plan("plain"))
        forms = [(type_name, data, int(GGMLQuantizationType[type_name]))]
        if type_name == "Q4_K" and n % 8 == 0:  # also as a load repacks it
            forms.append(("Q4_K_R8", cpu_kernels.ggml_repack(data, k), cpu_kernels.Q4_K_R8))
        for rows in args.rows:
            x = torch.randn(rows, k)
            slow = best_ms(lambda w=widened, x=x: w.matmul(x, None), max(1, args.repeats // 2))
            for name, stored, number in forms:
                cells = []
                for variant in cpu_kernels.variants("ggml"):
                    t = best_ms(lambda x=x, d=stored, v=variant, t=number: cpu_kernels.ggml_linear(x, d, t, variant=v),
                                args.repeats)
                    cells.append(f"{variant} {t:7.3f} ({slow / t:5.0f}x)")
                print(f"{name:7} {rows:3} rows: widened {slow:8.2f}   " + "   ".join(cells))


if __name__ == "__main__":
    main()
