#!/usr/bin/env bash
# Build the racecheck probe (csrc/tools/racecheck_probe.cu, docs/benchmarks/racecheck.md) into
# OUT/racecheck_probe with nvcc for sm_90a, with line information so racecheck names its source
# lines. In no Python extension; nothing here needs a GPU, and the program's --help and --list
# run without one.
#
#   bash scripts/build_racecheck_probe.sh OUT     # NVCC picks the compiler (default: nvcc on PATH)
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: bash scripts/build_racecheck_probe.sh OUT" >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
nvcc=${NVCC:-$(command -v nvcc || true)}
[ -n "$nvcc" ] || { echo "build_racecheck_probe: nvcc not found (set NVCC)" >&2; exit 3; }
mkdir -p "$1"
"$nvcc" -std=c++17 -O3 -lineinfo -arch=sm_90a -Werror all-warnings -I "$repo/csrc" \
    "$repo/csrc/tools/racecheck_probe.cu" -o "$1/racecheck_probe"
echo "build_racecheck_probe: $1/racecheck_probe (sm_90a, $("$nvcc" --version | tail -1))"
