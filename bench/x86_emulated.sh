#!/usr/bin/env bash
# Run a Python command of this repository's environment on an emulated x86-64 CPU model: qemu's user-mode emulation
# answers CPUID as that model, so torch, oneDNN, MKL and the compiled kernels probe and dispatch as on such a CPU
# (Haswell-v4: AVX2, FMA and F16C, no AVX-512). Where MLA_CPU_ISA=avx2 caps a wider CPU by setting, this is a CPU
# that has nothing more. It shows which paths such a CPU takes and that they compute correctly, not how fast they
# are. Needs Debian's qemu-user-static (installed here if missing; root).
#
#   bash bench/x86_emulated.sh -m pytest -q tests/test_fast_path.py          # CPU=Haswell-v4 by default
#   CPU=Broadwell-v4 bash bench/x86_emulated.sh -c 'from mla_kernels import cpu_ops; print(cpu_ops.summary())'
#
# qemu 7.2's emulation goes up to AVX2 (no AVX-512), so the models worth naming are AVX2 ones. /proc/cpuinfo stays the
# host's under user-mode emulation, so a check that compares it with CPUID (torch's capabilities) disagrees there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
command -v qemu-x86_64-static >/dev/null || { apt-get update -q; DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user-static; }
cd "$ROOT"
exec qemu-x86_64-static -cpu "${CPU:-Haswell-v4}" "$PYTHON" "$@"
