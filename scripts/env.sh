#!/usr/bin/env bash
# Create or reuse the project's environment, install this checkout into it, and print the
# environment's python on stdout (progress goes to stderr). Used by demo.sh, test.sh and CI.
#
# The environment: CPython 3.12 (Megatron-Core >= 0.17 needs it) from PATH or pyenv, a
# virtualenv at $HYBRID_EP_VENV (default ~/.cache/hybrid-ep/venv-py3.12), the registry's
# torch and Megatron-Core, and this checkout installed editable. It is reused across
# checkouts; dependencies are reinstalled only when setup.py or pyproject.toml change.
#
# The CUDA extension hybrid_ep._C and the nvidia-nvshmem wheel of torch's CUDA major (its
# inter-node transport) are built and installed only where a GPU is visible (nvidia-smi -L
# lists one and torch sees it): they run nowhere else, and _C takes minutes to compile.
# HYBRID_EP_FORCE_CUDA_BUILD=1 builds them anyway (a login node building for GPU nodes).
# The nvcc compile check of csrc/ (scripts/compile_csrc.sh, run by test.sh) does not depend
# on it. Each long step says what it does and how long it usually takes first.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { echo "[env] $*" >&2; }

# What each step took on a shared 2-core VM with the package registry on local disk
# (2026-11-25, fresh venvs; docs/benchmarks/setup.md): printed before the step.
USUAL_DEPS="3 to 4 min: torch with its CUDA libraries and Megatron-Core, 5.6 GB installed"
USUAL_NVSHMEM="about 5 s"
USUAL_BUILD="2 to 3 min on 2 cores for the planner and the CPU model of the kernels"
USUAL_CUDA_BUILD="about 10 min more for hybrid_ep._C (sm_90a and sm_100a)"

runs() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1; }

find_python() {
    local cand pyenv_root
    pyenv_root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
    # A pyenv shim exists for versions that are not active and then fails: run each candidate.
    for cand in python3.12 "$pyenv_root"/versions/3.12*/bin/python3.12; do
        if runs "$cand"; then command -v "$cand"; return 0; fi
    done
    for cand in python3.11 python3.10 python3; do
        if runs "$cand"; then
            log "warning: Python 3.12 not found, using $("$cand" --version 2>&1) (Megatron-Core >= 0.17 needs 3.12)"
            command -v "$cand"; return 0
        fi
    done
    log "error: no Python >= 3.10 found (install 3.12, e.g. 'pyenv install 3.12')"
    return 1
}

# One step: what it does, how long it usually takes, then how long it took.
step() {
    local what=$1 usual=$2 start=$SECONDS
    shift 2
    log "$what ($usual) ..."
    "$@"
    log "$what: done in $((SECONDS - start)) s"
}

# cuda: "on" where a GPU is visible or HYBRID_EP_FORCE_CUDA_BUILD=1, else "off" with why.
cuda_build() {
    if [ "${HYBRID_EP_FORCE_CUDA_BUILD:-0}" = 1 ]; then echo "on"; return; fi
    if ! nvidia-smi -L >/dev/null 2>&1; then echo "off: no GPU visible (nvidia-smi -L fails)"; return; fi
    if ! "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1; then
        echo "off: no GPU visible to torch (torch.cuda.is_available() is False)"; return
    fi
    echo "on"
}

py_base=$(find_python)
ver=$("$py_base" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
venv=${HYBRID_EP_VENV:-$HOME/.cache/hybrid-ep/venv-py$ver}
py=$venv/bin/python
# pip's notices (a newer pip exists, scripts not on PATH) and setuptools' warning box about
# editable installs are not the user's business here; errors still print
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1
quiet_pip() { PYTHONWARNINGS=ignore "$py" -m pip "$@"; }

if [ ! -x "$py" ]; then
    log "creating $venv with $("$py_base" --version 2>&1)"
    mkdir -p "$(dirname "$venv")"
    "$py_base" -m venv "$venv"
fi

install_deps() {
    # pybind11 first: setup.py builds the planner (hybrid_ep._planner) in every install, and
    # this install runs without build isolation, before torch is there. The extensions are
    # built below, once torch is importable: none here.
    quiet_pip install -q --upgrade pip setuptools wheel pybind11 >&2
    HYBRID_EP_SKIP_CUDA_BUILD=1 \
        quiet_pip install -q --no-build-isolation -e "$repo[test,megatron,plots]" >&2
}

stamp=$(cat "$repo/setup.py" "$repo/pyproject.toml" | sha256sum | cut -c1-16)
if [ "$(cat "$venv/.hybrid-ep-deps" 2>/dev/null)" != "$stamp" ]; then
    step "installing torch, Megatron-Core and the test tools into $venv" "$USUAL_DEPS" install_deps
    echo "$stamp" > "$venv/.hybrid-ep-deps"
    rm -f "$venv/.hybrid-ep-build"  # built without torch and the model: build below
fi

cuda=$(cuda_build)
if [ "$cuda" = on ]; then
    # NVSHMEM for the inter-node transport, from the wheel matching torch's CUDA major.
    cuda_major=$("$py" -c 'import torch; print((torch.version.cuda or "").split(".")[0])')
    if [ -n "$cuda_major" ] && ! "$py" -m pip show -q "nvidia-nvshmem-cu$cuda_major" >/dev/null 2>&1; then
        step "installing nvidia-nvshmem-cu$cuda_major (NVSHMEM for the inter-node transport)" "$USUAL_NVSHMEM" \
            quiet_pip install -q "nvidia-nvshmem-cu$cuda_major" >&2
    fi
    build_env=()
else
    build_env=(HYBRID_EP_SKIP_CUDA_BUILD=1)
fi
# The host-compiled modules (the CPU model, the planner) kept by the digest of their inputs
# (setup.py): a fresh clone of a tree built before, as CI makes, copies them instead of 2 to 3
# minutes of compiling.
build_env+=("HYBRID_EP_BUILD_CACHE=${HYBRID_EP_BUILD_CACHE:-$HOME/.cache/hybrid-ep/ext-builds}")
# A development build: the CPU model of the kernels (hybrid_ep._model, with the timing model)
# too, which a wheel leaves out.
build_env+=(HYBRID_EP_BUILD_MODEL=1)

# Point the editable install at this checkout. Re-run only when the checkout moved, its build
# inputs changed or the CUDA decision did. csrc/microbench/ is in no extension
# (scripts/build_microbench.sh builds it).
build_stamp=$( (echo "$repo cuda=$cuda"; cat "$repo/setup.py" "$repo/pyproject.toml";
                find "$repo/csrc" -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.h' \) \
                    ! -path "$repo/csrc/microbench/*" -print0 2>/dev/null | sort -z | xargs -0 -r cat) \
                | sha256sum | cut -c1-16)

build() {
    local buildlog
    buildlog=$(mktemp)
    if ! env ${build_env[@]+"${build_env[@]}"} "$py" -m pip install -v --no-deps --no-build-isolation -e "$repo" >"$buildlog" 2>&1
    then
        cat "$buildlog" >&2; rm -f "$buildlog"; log "error: installing hybrid-ep failed"; exit 1
    fi
    grep -hoE 'hybrid-ep: (building .*|hybrid_ep[._a-z]* taken from the build cache.*)' "$buildlog" | sort -u >&2 || true
    rm -f "$buildlog"
}

# The extensions build into the checkout (an editable install): a new clone at a path built
# before matches the stamp but has none of them, so their presence counts too.
built() { compgen -G "$repo/hybrid_ep/_planner*.so" >/dev/null; }
if [ "$(cat "$venv/.hybrid-ep-build" 2>/dev/null)" != "$build_stamp" ] || ! built; then
    if [ "$cuda" = on ]; then
        usual="$USUAL_BUILD, $USUAL_CUDA_BUILD"
    else
        usual=$USUAL_BUILD
        log "skipping the CUDA extension hybrid_ep._C and the NVSHMEM install: ${cuda#off: };" \
            "HYBRID_EP_FORCE_CUDA_BUILD=1 builds them anyway"
    fi
    step "building hybrid-ep into $venv" "$usual" build
    echo "$build_stamp" > "$venv/.hybrid-ep-build"
fi
echo "$py"
