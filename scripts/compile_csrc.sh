#!/usr/bin/env bash
# Compile every CUDA source under csrc/ with nvcc (object files only, nothing runs), so a
# syntax or template error fails CI on machines without a GPU. Skips when nvcc is absent.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
nvcc=${NVCC:-$(command -v nvcc || true)}
if [ -z "$nvcc" ]; then echo "compile_csrc: nvcc not found, CUDA compile check skipped"; exit 0; fi
mapfile -t sources < <(cd "$repo" && find csrc -name '*.cu' | sort)
if [ "${#sources[@]}" -eq 0 ]; then echo "compile_csrc: no CUDA sources under csrc/ yet, nothing to compile"; exit 0; fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
archs=${HYBRID_EP_CUDA_ARCHS:-90a}
flags=(-std=c++17 -O1 --expt-relaxed-constexpr -I "$repo/csrc")
for a in ${archs//;/ }; do flags+=("-gencode=arch=compute_$a,code=sm_$a"); done
for src in "${sources[@]}"; do
    echo "compile_csrc: $src"
    "$nvcc" "${flags[@]}" -c "$repo/$src" -o "$out/$(basename "$src").o"
done
echo "compile_csrc: ${#sources[@]} file(s) compiled with $("$nvcc" --version | tail -1)"
