#!/usr/bin/env bash
# Compile every CUDA/C++ source under csrc/ (object files only, nothing runs), so a syntax or
# template error fails CI on machines without a GPU. Kernels (.cu) need only nvcc; the
# bindings and transport (.cpp) also need pybind11 and Python headers, taken from $PYTHON's
# torch. Skips when nvcc is absent.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
nvcc=${NVCC:-$(command -v nvcc || true)}
if [ -z "$nvcc" ]; then echo "compile_csrc: nvcc not found, CUDA compile check skipped"; exit 0; fi
mapfile -t sources < <(cd "$repo" && find csrc \( -name '*.cu' -o -name '*.cpp' \) | sort)
if [ "${#sources[@]}" -eq 0 ]; then echo "compile_csrc: no sources under csrc/, nothing to compile"; exit 0; fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
if [ -z "${HYBRID_EP_CUDA_ARCHS:-}" ]; then
    archs="90a"
    if "$nvcc" --list-gpu-code 2>/dev/null | grep -qw sm_100; then archs="90a;100a"; fi
else
    archs=$HYBRID_EP_CUDA_ARCHS
fi
flags=(-std=c++17 -O3 --expt-relaxed-constexpr -I "$repo/csrc")
for a in ${archs//;/ }; do flags+=("-gencode=arch=compute_$a,code=sm_$a"); done
py=${PYTHON:-python3}
host_includes=$("$py" -c 'import sysconfig; from torch.utils import cpp_extension as c
print(" ".join("-I" + p for p in c.include_paths() + [sysconfig.get_paths()["include"]]))' 2>/dev/null || true)
compiled=0
for src in "${sources[@]}"; do
    obj="$out/$(echo "$src" | tr / _).o"
    if [[ "$src" == *.cpp ]]; then
        if [ -z "$host_includes" ]; then
            echo "compile_csrc: $src skipped (no Python with torch for the pybind11 headers; set PYTHON)"; continue
        fi
        echo "compile_csrc: $src"
        # shellcheck disable=SC2086
        "$nvcc" -std=c++17 -O2 -I "$repo/csrc" $host_includes -x c++ -c "$repo/$src" -o "$obj"
    else
        echo "compile_csrc: $src (sm ${archs//;/, sm })"
        "$nvcc" "${flags[@]}" -c "$repo/$src" -o "$obj"
    fi
    compiled=$((compiled + 1))
done
echo "compile_csrc: $compiled file(s) compiled with $("$nvcc" --version | tail -1)"
