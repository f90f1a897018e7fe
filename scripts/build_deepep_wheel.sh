#!/usr/bin/env bash
# Build DeepEP's intranode (normal-mode) extension for sm_90a here, against the GPU machine's
# torch, into a wheel the device tool carries: the baseline of `hybrid-ep-bench --backends
# deepep` (docs/benchmarks/cuda.md, "DeepEP beside hybrid-ep"). Nothing of DeepEP is kept in
# this repository: SRC is a DeepEP checkout you provide.
#
#   bash scripts/build_deepep_wheel.sh SRC [OUT]     # OUT default build/deepep
#
# SRC must be a DeepEP whose setup.py can leave NVSHMEM out (the intranode kernels alone) and
# whose bindings then call only what that build defines: commits before c475ec6 (elastic
# buffers; e.g. da6ca24). Up to 567632d setup.py leaves NVSHMEM out when neither NVSHMEM_DIR nor
# the nvidia.nvshmem module is found, but from c475ec6 on the bindings call three mask kernels
# of internode_ll.cu, left out with NVSHMEM (the check after the build refuses such a wheel);
# from b306af0 (EPv2) on, setup.py always builds NVSHMEM and NCCL in. The build
# environment is scripts/prebuild_gpu.sh's (HYBRID_EP_GPU_BUILD_VENV), where nvidia-nvshmem
# is installed for hybrid_ep._C: this script hides that module from DeepEP's setup.py alone.
# DeepEP links the CUDA driver (-lcuda), which this machine lacks: a stub with the driver's
# soname stands in at link time; the GPU machine's driver provides libcuda.so.1.
set -euo pipefail
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: bash scripts/build_deepep_wheel.sh SRC [OUT]" >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
src=$(cd "$1" && pwd)
out=${2:-$repo/build/deepep}
mkdir -p "$out" && out=$(cd "$out" && pwd)
venv=${HYBRID_EP_GPU_BUILD_VENV:-$HOME/.cache/hybrid-ep/venv-gpu-build}
py=$venv/bin/python
log() { echo "[build_deepep_wheel] $*" >&2; }

[ -x "$py" ] || { log "error: no build environment at $venv (bash scripts/prebuild_gpu.sh makes it)"; exit 1; }
grep -q disable_nvshmem "$src/setup.py" 2>/dev/null \
    || { log "error: $src/setup.py cannot build the intranode kernels without NVSHMEM (DeepEP up to 567632d can)"; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# torch takes the CUDA toolkit from nvcc's folder, wrong where nvcc on PATH is a wrapper script
# (as setup.py's _locate_cuda_home says): nvcc --dryrun names its real home.
if [ -z "${CUDA_HOME:-}" ]; then
    : > "$work/probe.cu"
    CUDA_HOME=$(nvcc --dryrun -c "$work/probe.cu" -o "$work/probe.o" 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
    export CUDA_HOME=${CUDA_HOME:?nvcc --dryrun named no CUDA home: set CUDA_HOME}
fi
echo 'void hybrid_ep_cuda_driver_stub(void) {}' > "$work/stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$work/libcuda.so" "$work/stub.c"

# DeepEP's setup.py looks NVSHMEM up with importlib.util.find_spec("nvidia.nvshmem"): answer None.
# Without NVSHMEM it still compiles relocatable device code (-rdc=true) but asks for no device
# link step, so the module's kernels are never registered: the wheel then fails to import on the
# GPU machine (undefined __cudaRegisterLinkedBinary_*, the 2026-11-28 evening run). An
# extension compiled with -rdc=true and no nvcc_dlink gets a device link step (-dlink; torch's
# dlink=True would add -dlto, which nvlink refuses for objects compiled without it).
hide_nvshmem='import importlib.util as u, runpy, sys
import torch.utils.cpp_extension as ext
real = u.find_spec
u.find_spec = lambda name, *a, **k: None if name == "nvidia.nvshmem" else real(name, *a, **k)
cuda_extension = ext.CUDAExtension
def with_device_link(*args, **kwargs):
    flags = kwargs.get("extra_compile_args", {})
    if "-rdc=true" in flags.get("nvcc", []) and "nvcc_dlink" not in flags:
        kwargs["extra_compile_args"] = {**flags, "nvcc_dlink": ["-dlink"]}  # not dlink=True: it adds -dlto
    return cuda_extension(*args, **kwargs)
ext.CUDAExtension = with_device_link
sys.argv = ["setup.py", *sys.argv[1:]]
runpy.run_path("setup.py", run_name="__main__")'
# DeepEP includes ATen/cuda/CUDAContext.h, which needs the CUDA libraries' headers (cuSPARSE,
# cuBLAS, cuSOLVER): the nvidia-*-cu13 wheels installed with torch have them, a toolkit of nvcc
# and the runtime alone does not.
libs_include=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13/include
[ -f "$libs_include/cusparse.h" ] || { log "error: no CUDA library headers at $libs_include"; exit 1; }
rm -f "$out"/deep_ep-*.whl
start=$SECONDS
log "building $src ($(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout')) for sm_90a (log: $out/build.log)"
if ! (cd "$src" && env -u NVSHMEM_DIR TORCH_CUDA_ARCH_LIST=9.0a LDFLAGS="-L$work -Wl,--no-as-needed" \
        CPATH="$libs_include${CPATH:+:$CPATH}" \
        "$py" -c "$hide_nvshmem" bdist_wheel --dist-dir "$out") > "$out/build.log" 2>&1; then
    tail -30 "$out/build.log" >&2
    log "error: the build failed"
    exit 1
fi
grep -q 'All internode and low-latency features are disabled' "$out/build.log" \
    || { log "error: NVSHMEM was not left out (see $out/build.log)"; exit 1; }
wheel=$(ls "$out"/deep_ep-*.whl)
"$py" -m zipfile -e "$wheel" "$work/unpacked"
# --own: a DeepEP whose bindings call a kernel the NVSHMEM-free build leaves out links, and
# then fails to import on the GPU machine (567632d: internode_ll's mask kernels, from c475ec6).
bash "$repo/scripts/check_linkage.sh" --own deep_ep:: \
    '^(libc10(_cuda)?|libtorch(_cpu|_cuda|_python)?|libcudart\.so\.13|libcuda\.so\.1|libstdc\+\+|libgcc_s|libm|libc|ld-linux-x86-64)(\.so.*)?$' \
    "$work"/unpacked/*.so || { rm -f "$wheel"; exit 1; }
# Relocatable device code left unlinked leaves its registration undefined: refuse such a wheel
# here rather than on the GPU machine.
unlinked=$(nm -D --undefined-only "$work"/unpacked/*.so | grep -c __cudaRegisterLinkedBinary || true)
[ "$unlinked" -eq 0 ] || { log "error: $unlinked device-code registrations undefined (no device link step)"; rm -f "$wheel"; exit 1; }
log "built $(basename "$wheel") in $((SECONDS - start)) s: $(du -k "$wheel" | cut -f1) KiB"
