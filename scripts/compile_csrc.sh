#!/usr/bin/env bash
# Compile every CUDA/C++ source under csrc/ (object files only, nothing runs), so a syntax or
# template error fails CI on machines without a GPU. Kernels (.cu) need only nvcc; the
# bindings and transport (.cpp) also need pybind11 and Python headers, taken from $PYTHON's
# torch. The GPU microbenchmarks (csrc/microbench/) are built and linked into their executable
# by scripts/build_microbench.sh (sm_90a). Skips when nvcc is absent.
#
# The NVSHMEM transport's sources (file names containing "nvshmem") are compiled with
# relocatable device code against NVSHMEM as setup.py finds it (scripts/find_nvshmem.py: the
# nvidia-nvshmem wheel or NVSHMEM_HOME), and the transport's self-test with the host bootstrap
# is device-linked and linked into a shared object against NVSHMEM's libraries, every symbol
# resolved: the NVSHMEM build compiles and links. Without NVSHMEM they are skipped with one line.
#
#   bash scripts/compile_csrc.sh                    # everything
#   bash scripts/compile_csrc.sh --nvshmem-link DIR # only the NVSHMEM link, the .so left in DIR
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
nvcc=${NVCC:-$(command -v nvcc || true)}
if [ -z "$nvcc" ]; then echo "compile_csrc: nvcc not found, CUDA compile check skipped"; exit 0; fi
link_only=""
if [ "${1:-}" = "--nvshmem-link" ]; then
    [ -n "${2:-}" ] || { echo "compile_csrc: --nvshmem-link needs an output folder" >&2; exit 2; }
    mkdir -p "$2"; link_only=$(cd "$2" && pwd)
fi
py=${PYTHON:-python3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
if [ -z "${HYBRID_EP_CUDA_ARCHS:-}" ]; then
    archs="90a"
    if "$nvcc" --list-gpu-code 2>/dev/null | grep -qw sm_100; then archs="90a;100a"; fi
else
    archs=$HYBRID_EP_CUDA_ARCHS
fi
gencode=()
for a in ${archs//;/ }; do gencode+=("-gencode=arch=compute_$a,code=sm_$a"); done
flags=(-std=c++17 -O3 --expt-relaxed-constexpr -I "$repo/csrc" "${gencode[@]}")
host_includes=$("$py" -c 'import sysconfig; from torch.utils import cpp_extension as c
print(" ".join("-I" + p for p in c.include_paths() + [sysconfig.get_paths()["include"]]))' 2>/dev/null || true)

NVSHMEM_FOUND=0
NVSHMEM_REASON="no Python to run scripts/find_nvshmem.py (set PYTHON)"
eval "$("$py" "$repo/scripts/find_nvshmem.py" --shell 2>/dev/null || true)"
nvshmem_cxx=() nvshmem_cu=()
if [ "$NVSHMEM_FOUND" = 1 ]; then
    nvshmem_cxx=(-DHYBRID_EP_WITH_NVSHMEM -I "$NVSHMEM_INCLUDE")
    nvshmem_cu=(-rdc=true -Xcompiler -fPIC "${nvshmem_cxx[@]}")
    echo "compile_csrc: NVSHMEM from $NVSHMEM_SOURCE"
else
    echo "compile_csrc: NVSHMEM sources skipped: $NVSHMEM_REASON"
fi

obj_of() { echo "$out/$(echo "$1" | tr / _).o"; }

# compile SRC: one object into $out; returns 1 when it was skipped.
compile() {
    local src=$1 obj nv=()
    obj=$(obj_of "$src")
    if [[ "$(basename "$src")" == *nvshmem* && "$NVSHMEM_FOUND" != 1 ]]; then return 1; fi
    # With NVSHMEM, _C is built with relocatable device code and its module binds the transport.
    if [[ "$src" == *.cu ]]; then nv=("${nvshmem_cu[@]}")
    elif [[ "$(basename "$src")" == *nvshmem* || "$src" == csrc/bindings/cuda_module.cpp ]]; then nv=("${nvshmem_cxx[@]}"); fi
    if [[ "$src" == *.cpp ]]; then
        if [ -z "$host_includes" ]; then
            echo "compile_csrc: $src skipped (no Python with torch for the pybind11 headers; set PYTHON)"; return 1
        fi
        echo "compile_csrc: $src"
        # shellcheck disable=SC2086
        "$nvcc" -std=c++17 -O2 -Xcompiler -fPIC -I "$repo/csrc" "${nv[@]}" $host_includes -x c++ -c "$repo/$src" \
            -o "$obj"
    else
        echo "compile_csrc: $src (sm ${archs//;/, sm }${nv:+, relocatable})"
        "$nvcc" "${flags[@]}" "${nv[@]}" -c "$repo/$src" -o "$obj"
    fi
}

# The self-test kernel and the host bootstrap, device-linked against libnvshmem_device.a and
# linked against libnvshmem_host with every symbol resolved (-Wl,--no-undefined).
nvshmem_link() {
    local dest=$1 objs=("$(obj_of csrc/transport/nvshmem_selftest_nvshmem.cu)" "$(obj_of csrc/transport/nvshmem_host.cpp)")
    "$nvcc" -dlink -Xcompiler -fPIC "${gencode[@]}" "${objs[@]}" -L "$NVSHMEM_LIB" -lnvshmem_device -o "$out/dlink.o"
    "$nvcc" -shared "${gencode[@]}" "${objs[@]}" "$out/dlink.o" -o "$dest/libhybrid_ep_nvshmem_check.so" \
        -L "$NVSHMEM_LIB" -l:libnvshmem_device.a -Xlinker --exclude-libs,libnvshmem_device.a "-l:$NVSHMEM_HOST_LIB" \
        -Xlinker -rpath -Xlinker "$NVSHMEM_LIB" \
        -Xlinker --no-undefined -lcudart
    echo "compile_csrc: NVSHMEM link: $dest/libhybrid_ep_nvshmem_check.so (self-test kernel + host bootstrap," \
        "device-linked with libnvshmem_device.a, linked with $NVSHMEM_HOST_LIB)"
}

if [ -n "$link_only" ]; then
    [ "$NVSHMEM_FOUND" = 1 ] || { echo "compile_csrc: no NVSHMEM link: $NVSHMEM_REASON" >&2; exit 3; }
    host_includes=${host_includes:-" "}  # the bootstrap needs no pybind11 headers
    compile csrc/transport/nvshmem_selftest_nvshmem.cu
    compile csrc/transport/nvshmem_host.cpp
    nvshmem_link "$link_only"
    exit 0
fi

mapfile -t sources < <(cd "$repo" && find csrc \( -name '*.cu' -o -name '*.cpp' \) ! -path 'csrc/microbench/*' | sort)
if [ "${#sources[@]}" -eq 0 ]; then echo "compile_csrc: no sources under csrc/, nothing to compile"; exit 0; fi
compiled=0
for src in "${sources[@]}"; do
    if compile "$src"; then compiled=$((compiled + 1)); fi
done
if [ "$NVSHMEM_FOUND" = 1 ]; then nvshmem_link "$out"; fi
if [ -f "$repo/csrc/microbench/main.cu" ]; then
    echo "compile_csrc: csrc/microbench/main.cu (sm 90a, linked)"
    NVCC="$nvcc" bash "$repo/scripts/build_microbench.sh" "$out/microbench" > /dev/null
    compiled=$((compiled + 1))
fi
echo "compile_csrc: $compiled file(s) compiled with $("$nvcc" --version | tail -1)"
