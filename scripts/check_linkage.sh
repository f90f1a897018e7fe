#!/usr/bin/env bash
# Check that built extensions load on the GPU machine as they are: each FILE may need only
# libraries whose names match PATTERN (an extended regular expression; what torch, the CUDA
# runtime and the driver provide there) and has no run path (no path of the machine that built
# it). With --own PREFIX, no C++ function whose name starts with PREFIX may be left undefined
# (a build that leaves some of its own sources out links, then fails to import). Prints each
# file's size and needs; exits 1 at the first file that fails.
#
#   bash scripts/check_linkage.sh [--own PREFIX] PATTERN FILE...   # prebuild_gpu.sh, build_deepep_wheel.sh
set -euo pipefail
own=""
if [ "${1:-}" = --own ]; then own=${2:?--own takes a prefix, e.g. deep_ep::}; shift 2; fi
[ $# -ge 2 ] || { echo "usage: bash scripts/check_linkage.sh [--own PREFIX] PATTERN FILE..." >&2; exit 2; }
pattern=$1
shift
for so in "$@"; do
    needed=$(readelf -d "$so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
    echo "[check_linkage] $(basename "$so"): $(du -k "$so" | cut -f1) KiB; needs: $needed" >&2
    for lib in $needed; do
        [[ "$lib" =~ $pattern ]] || { echo "[check_linkage] error: $(basename "$so") needs $lib" >&2; exit 1; }
    done
    if readelf -d "$so" | grep -qE '\((RPATH|RUNPATH)\)'; then
        echo "[check_linkage] error: $(basename "$so") has a run path: $(readelf -d "$so" | grep -E 'RPATH|RUNPATH')" >&2
        exit 1
    fi
    if [ -n "$own" ]; then
        missing=$(nm -D --undefined-only -C "$so" | sed -n 's/^ *U //p' | grep -F "$own" | sed 's/(.*//' | sort -u | tr '\n' ' ' || true)
        if [ -n "$missing" ]; then
            echo "[check_linkage] error: $(basename "$so") calls its own functions it does not define (it will not import): $missing" >&2
            exit 1
        fi
    fi
done
