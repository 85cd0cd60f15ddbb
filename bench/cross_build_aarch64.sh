#!/usr/bin/env bash
# Compile the typed CPU operators that aarch64 builds (mla_kernels.cpu_ops.PORTABLE_SOURCES: the indexer, the
# linear-attention layers' delta rule and convolution, the instruction-set cap) for aarch64 on an x86-64 machine,
# against this environment's torch headers: a check that they build there, not that they run. The cross compiler is
# zig's clang (pip's ziglang, in a throwaway environment); its sysroot has no omp.h, so the host GCC's (declarations
# only) is borrowed.
#
#   bash bench/cross_build_aarch64.sh        # prints one line per source, exits non-zero if one fails
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
PYTHON="${PYTHON:-python}"
OUT="${OUT:-$(mktemp -d)}"
[ -x "$OUT/zig/bin/python" ] || { python3 -m venv "$OUT/zig" && "$OUT/zig/bin/pip" install -q ziglang; }
omp="$(find /usr/lib/gcc -name omp.h 2>/dev/null | head -1)"
[ -n "$omp" ] || { echo "cross_build_aarch64: no omp.h under /usr/lib/gcc (install gcc)" >&2; exit 2; }
mkdir -p "$OUT/include" && cp "$omp" "$OUT/include/"
read -r -a includes <<< "$("$PYTHON" -c "import sysconfig, torch.utils.cpp_extension as c; \
print(' '.join('-I' + p for p in [*c.include_paths(), sysconfig.get_paths()['include']]))")"
sources="$("$PYTHON" -c "from mla_kernels import cpu_ops; print(' '.join(str(s) for s in cpu_ops.PORTABLE_SOURCES))")"
status=0
for src in $sources; do
  obj="$OUT/$(basename "$src" .cpp).o"
  if "$OUT/zig/bin/python" -m ziglang c++ -target aarch64-linux-gnu -std=c++17 -O2 -fopenmp -c "${includes[@]}" \
      -I"$OUT/include" -DTORCH_EXTENSION_NAME=mla_kernels_ops -Wno-c++20-extensions -Wno-ignored-attributes \
      -x c++ "$src" -o "$obj" 2> "$obj.log"; then  # .c sources are C++ here, as the extension builder's g++ takes them
    echo "aarch64: ${src#"$ROOT"/} builds ($(file -b "$obj" | cut -d, -f1-2))"
  else
    echo "aarch64: ${src#"$ROOT"/} FAILS: $(grep -m1 -i error "$obj.log")"; status=1
  fi
done
exit $status
