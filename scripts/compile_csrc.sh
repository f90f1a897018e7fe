#!/usr/bin/env bash
# Compile the CUDA extension's sources under csrc/ (object files only, nothing runs), so a syntax
# or template error fails CI on machines without a GPU, where setup.py does not build
# hybrid_ep._C. Kernels (.cu) need only nvcc; the bindings and transport (.cpp) also need
# pybind11 and Python headers, taken from $PYTHON's torch. The GPU microbenchmarks
# (csrc/microbench/) and the racecheck probe (csrc/tools/racecheck_probe.cu) are built and
# linked into their executables by scripts/build_microbench.sh and
# scripts/build_racecheck_probe.sh (sm_90a). Any file that fails to compile fails the run, and
# the run names it. Skips when nvcc is absent.
#
# Not compiled here: the planner's and the CPU model's sources (csrc/balancer/, csrc/device/model/
# and their bindings, planner_module.cpp and model_module.cpp). setup.py builds them, with the
# host compiler, in every install (scripts/env.sh, so every CI run), and the sanitizer tier
# builds them again; --list prints what is compiled and what is left to setup.py.
#
# The files compile in parallel, HYBRID_EP_COMPILE_JOBS at a time (default: the number of CPUs),
# and each file's lines are printed in the order they started once all have finished.
#
# A check that passed leaves a stamp named by a digest of everything it read (every file under
# csrc/, these scripts, the compiler's version, the archs, the host includes, NVSHMEM's source)
# in HYBRID_EP_COMPILE_CACHE (default ~/.cache/hybrid-ep/compile-check, kept by CI as it keeps
# the virtualenv); a run that finds its stamp compiles nothing and says so. The full check (one
# arch, below) takes minutes on 2 cores, so a CI run without a change under csrc/ skips it.
# HYBRID_EP_COMPILE_CACHE=off always compiles.
#
# The NVSHMEM transport's sources (file names containing "nvshmem") are compiled with
# relocatable device code against NVSHMEM as setup.py finds it (scripts/find_nvshmem.py: the
# nvidia-nvshmem wheel or NVSHMEM_HOME), and the transport's self-test with the host bootstrap
# is device-linked and linked into a shared object against NVSHMEM's libraries, every symbol
# resolved: the NVSHMEM build compiles and links. Without NVSHMEM they are skipped with one line.
#
#   bash scripts/compile_csrc.sh                    # everything
#   bash scripts/compile_csrc.sh --list             # the files it compiles and those it leaves to setup.py
#   bash scripts/compile_csrc.sh --nvshmem-link DIR # only the NVSHMEM link, the .so left in DIR
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Built by setup.py with the host compiler: the planner in every install, the CPU model in a
# development build (HYBRID_EP_BUILD_MODEL=1).
built_by_setup() {
    case "$1" in
        csrc/balancer/*.cpp | csrc/device/model/*.cpp | csrc/bindings/planner_module.cpp | csrc/bindings/model_module.cpp)
            return 0 ;;
    esac
    return 1
}
mapfile -t all_sources < <(cd "$repo" && find csrc \( -name '*.cu' -o -name '*.cpp' \) ! -path 'csrc/microbench/*' | sort)
sources=()
for src in "${all_sources[@]}"; do built_by_setup "$src" || sources+=("$src"); done
microbench=""
if [ -f "$repo/csrc/microbench/main.cu" ]; then microbench=csrc/microbench/main.cu; fi

if [ "${1:-}" = "--list" ]; then
    for src in "${sources[@]}" $microbench; do echo "compile $src"; done
    for src in "${all_sources[@]}"; do if built_by_setup "$src"; then echo "setup.py $src"; fi; done
    exit 0
fi

nvcc=${NVCC:-$(command -v nvcc || true)}
if [ -z "$nvcc" ]; then echo "compile_csrc: nvcc not found, CUDA compile check skipped"; exit 0; fi
link_only=""
if [ "${1:-}" = "--nvshmem-link" ]; then
    [ -n "${2:-}" ] || { echo "compile_csrc: --nvshmem-link needs an output folder" >&2; exit 2; }
    mkdir -p "$2"; link_only=$(cd "$2" && pwd)
fi
jobs=${HYBRID_EP_COMPILE_JOBS:-$(nproc 2>/dev/null || echo 1)}
if ! [[ "$jobs" =~ ^[1-9][0-9]*$ ]]; then
    echo "compile_csrc: HYBRID_EP_COMPILE_JOBS must be a whole number >= 1, got '$jobs'" >&2; exit 2
fi
py=${PYTHON:-python3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# sm_90a alone unless HYBRID_EP_CUDA_ARCHS says more: the sources have no per-arch branches, so a
# second arch compiles the same code again (about twice the time) and can fail only in ptxas
# for that arch; HYBRID_EP_CUDA_ARCHS="90a;100a" checks both, as setup.py builds them.
archs=${HYBRID_EP_CUDA_ARCHS:-90a}
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

# compile SRC: one object into $out (the microbenchmarks: their executable); the compiler's
# status. A file that cannot be compiled here says why and leaves SRC.skipped beside its object.
compile() {
    local src=$1 obj nv=()
    obj=$(obj_of "$src")
    if [ "$src" = "$microbench" ]; then
        echo "compile_csrc: $src (sm 90a, linked)"
        NVCC="$nvcc" bash "$repo/scripts/build_microbench.sh" "$out/microbench" > /dev/null
        return
    fi
    if [ "$src" = csrc/tools/racecheck_probe.cu ]; then
        echo "compile_csrc: $src (sm 90a, linked)"
        NVCC="$nvcc" bash "$repo/scripts/build_racecheck_probe.sh" "$out/racecheck_probe" > /dev/null
        return
    fi
    if [[ "$(basename "$src")" == *nvshmem* && "$NVSHMEM_FOUND" != 1 ]]; then touch "$obj.skipped"; return 0; fi
    # With NVSHMEM, _C is built with relocatable device code and its module binds the transport.
    if [[ "$src" == *.cu ]]; then nv=("${nvshmem_cu[@]}")
    elif [[ "$(basename "$src")" == *nvshmem* || "$src" == csrc/bindings/cuda_module.cpp ]]; then nv=("${nvshmem_cxx[@]}"); fi
    if [[ "$src" == *.cpp ]]; then
        if [ -z "$host_includes" ]; then
            echo "compile_csrc: $src skipped (no Python with torch for the pybind11 headers; set PYTHON)"
            touch "$obj.skipped"; return 0
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

# the linked microbenchmarks first, then the kernels' sources, widest first: the largest jobs
# start at once, so the last one to finish is a small one
todo=($microbench)
for src in csrc/kernels/kernels_nvshmem.cu csrc/kernels/direct.cu; do
    for s in "${sources[@]}"; do [ "$s" = "$src" ] && todo+=("$s"); done
done
for s in "${sources[@]}"; do [[ " ${todo[*]} " == *" $s "* ]] || todo+=("$s"); done
if [ "${#todo[@]}" -eq 0 ]; then echo "compile_csrc: no CUDA sources under csrc/, nothing to compile"; exit 0; fi
cache=${HYBRID_EP_COMPILE_CACHE:-$HOME/.cache/hybrid-ep/compile-check}
stamp=""
if [ "$cache" != off ]; then
    stamp="$cache/$( {
        echo "$archs|$host_includes|$NVSHMEM_FOUND|${NVSHMEM_SOURCE:-}|${NVSHMEM_INCLUDE:-}|${NVSHMEM_LIB:-}"
        "$nvcc" --version
        cd "$repo"
        for f in scripts/compile_csrc.sh scripts/build_microbench.sh scripts/build_racecheck_probe.sh \
            scripts/find_nvshmem.py; do [ ! -f "$f" ] || sha256sum "$f"; done
        find csrc -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
    } | sha256sum | cut -c1-20)"
    if [ -f "$stamp" ]; then
        echo "compile_csrc: nothing changed since the check that passed on $(head -1 "$stamp") (stamp $stamp;" \
            "HYBRID_EP_COMPILE_CACHE=off compiles anyway)"
        exit 0
    fi
fi
# Each file in a background job of its own ($jobs at once), its lines and status kept in $out.
for i in "${!todo[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
    ( set +e; compile "${todo[i]}" > "$out/job$i.log" 2>&1; echo $? > "$out/job$i.status" ) &
done
wait
compiled=0 failed=()
for i in "${!todo[@]}"; do
    src=${todo[i]}
    cat "$out/job$i.log"
    status=$(cat "$out/job$i.status" 2>/dev/null || echo "no status")
    if [ "$status" != 0 ]; then failed+=("$src")
    elif [ ! -e "$(obj_of "$src").skipped" ]; then compiled=$((compiled + 1)); fi
done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "compile_csrc: ${#failed[@]} file(s) failed to compile: ${failed[*]}" >&2
    exit 1
fi
if [ "$NVSHMEM_FOUND" = 1 ]; then nvshmem_link "$out"; fi
echo "compile_csrc: $compiled file(s) compiled with $("$nvcc" --version | tail -1), $jobs at a time;" \
    "the planner's and the CPU model's sources are built by setup.py"
# The stamp only saves the next run's time: a cache that cannot be written (a read-only home, a
# full disk) costs that run the compile again, never this run its pass.
if [ -n "$stamp" ]; then
    if ! { mkdir -p "$cache" && { date -u +%Y-%m-%dT%H:%M:%SZ; echo "$compiled file(s), archs $archs"; } \
        > "$stamp.tmp.$$" && mv "$stamp.tmp.$$" "$stamp"; } 2>/dev/null; then
        rm -f "$stamp.tmp.$$" 2>/dev/null || true
        echo "compile_csrc: passed, but no stamp could be written in $cache (the next run compiles again)"
    fi
fi
exit 0
