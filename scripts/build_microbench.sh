#!/usr/bin/env bash
# Build the GPU microbenchmarks (csrc/microbench/, docs/benchmarks/cuda.md "How to measure")
# into one executable, OUT/hybrid_ep_microbench, with nvcc for sm_90a (the H100's
# architecture: the PTX they time is sm_90's). Not part of any Python extension; nothing here
# needs a GPU, and the executable's --help and --list run without one.
#
#   bash scripts/build_microbench.sh OUT     # NVCC picks the compiler (default: nvcc on PATH)
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: bash scripts/build_microbench.sh OUT" >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
nvcc=${NVCC:-$(command -v nvcc || true)}
[ -n "$nvcc" ] || { echo "build_microbench: nvcc not found (set NVCC)" >&2; exit 3; }
mkdir -p "$1"
"$nvcc" -std=c++17 -O3 -lineinfo -arch=sm_90a -I "$repo/csrc" "$repo/csrc/microbench/main.cu" \
    -o "$1/hybrid_ep_microbench"
echo "build_microbench: $1/hybrid_ep_microbench (sm_90a, $("$nvcc" --version | tail -1))"
