#!/usr/bin/env bash
# The prepared check of the CUDA path, for a run that has a GPU for a few minutes: one command, at most about
# 8 minutes on one GPU, writing bench/RESULTS_gpu.md and printing a summary to paste into a note.
#
#   bash bench/gpu_check.sh            # from the repository root, in the environment the tests use
#
# It runs, each under its own time limit: the kernel tests on CUDA (Triton compiled, not interpreted; the FP8 block
# GEMM and the host tier's pinned-memory test included), bench/bench_kernels.py (decode-kernel GB/s as a fraction of
# the device's copy bandwidth, batch 1-64, context 1k-32k) and bench/gpu_e2e.py (a DeepSeek-V2-Lite-shaped model
# with random weights, decode at batch 1 and 32). Without a GPU it says so in one line and exits 2.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=bench/RESULTS_gpu.md
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU visible to torch (torch.cuda.is_available() is False): nothing checked"
    exit 2
fi
unset TRITON_INTERPRET  # compile the Triton kernels for the device
CHECK=gpu_check
# shellcheck source=bench/check_steps.sh
. bench/check_steps.sh
step kernel_tests 150 python -m pytest -q -p no:cacheprovider tests/test_kernels_decode.py tests/test_kernels_prefill.py \
    tests/test_kernels_store.py tests/test_kernels_compile.py tests/test_fp8_gemm.py tests/test_host_tier.py \
    tests/test_paged_model.py tests/test_kernels_sparse.py tests/test_kernels_grouped.py tests/test_tensor_parallel_cuda.py
step bench_kernels 90 python bench/bench_kernels.py --batch 1 8 32 64 --ctx 1024 4096 16384 32768
step e2e_v2_lite 240 python bench/gpu_e2e.py --layers 27 --batch 1 32
{
    echo "# The CUDA path on a GPU"
    echo
    echo "Written by \`bash bench/gpu_check.sh\` on $(date -u +%Y-%m-%d) ($(python -c 'import torch; print(torch.cuda.get_device_name(0))'),"
    echo "torch $(python -c 'import torch; print(torch.__version__)'), triton $(python -c 'import triton; print(triton.__version__)' 2>/dev/null))."
    echo
    cat "$LOG/status.md"
    echo
    echo "## Kernel tests on CUDA"
    echo
    echo '```'
    tail -n 15 "$LOG/kernel_tests.txt"
    echo '```'
    echo
    echo "## Decode kernel (bench/bench_kernels.py)"
    echo
    grep '^|' "$LOG/bench_kernels.txt" || tail -n 20 "$LOG/bench_kernels.txt"
    echo
    echo "## DeepSeek-V2-Lite shape, random weights, end to end (bench/gpu_e2e.py)"
    echo
    grep -E '^\||random checkpoint|CUDA graphs|greedy tokens|engine ready' "$LOG/e2e_v2_lite.txt" || tail -n 20 "$LOG/e2e_v2_lite.txt"
} >"$OUT"
echo "gpu_check: wrote $OUT"
cat "$OUT"
