#!/usr/bin/env bash
# Create or reuse the project's environment, install this checkout into it, and print the
# environment's python on stdout (progress goes to stderr). Used by demo.sh, test.sh and CI.
#
# The environment: CPython 3.12 (Megatron-Core >= 0.17 needs it) from PATH or pyenv, a
# virtualenv at $HYBRID_EP_VENV (default ~/.cache/hybrid-ep/venv-py3.12), the registry's
# torch and the nvidia-nvshmem wheel of torch's CUDA major (setup.py builds NVSHMEM's transport
# from it). It is reused across checkouts; dependencies are reinstalled only when setup.py or
# pyproject.toml change.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { echo "[env] $*" >&2; }

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

py_base=$(find_python)
ver=$("$py_base" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
venv=${HYBRID_EP_VENV:-$HOME/.cache/hybrid-ep/venv-py$ver}
py=$venv/bin/python

if [ ! -x "$py" ]; then
    log "creating $venv with $("$py_base" --version 2>&1)"
    mkdir -p "$(dirname "$venv")"
    "$py_base" -m venv "$venv"
fi

# Point the editable install at this checkout. Re-run only when the checkout moved or its
# build inputs changed: with a CUDA toolkit this compiles hybrid_ep._C (about a minute).
# csrc/microbench/ is in no extension (scripts/build_microbench.sh builds it).
build_stamp=$( (echo "$repo"; cat "$repo/setup.py" "$repo/pyproject.toml";
                find "$repo/csrc" -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.h' \) \
                    ! -path "$repo/csrc/microbench/*" -print0 2>/dev/null | sort -z | xargs -0 -r cat) \
                | sha256sum | cut -c1-16)
stamp=$(cat "$repo/setup.py" "$repo/pyproject.toml" | sha256sum | cut -c1-16)
if [ "$(cat "$venv/.hybrid-ep-deps" 2>/dev/null)" != "$stamp" ]; then
    log "installing dependencies into $venv (first time: torch from the registry, a few minutes)"
    # pybind11 first: setup.py builds the planner (hybrid_ep._planner) in every install, and
    # this install runs without build isolation, before torch is there.
    "$py" -m pip install -q --upgrade pip setuptools wheel pybind11 >&2
    "$py" -m pip install -q --no-build-isolation -e "$repo[test,megatron]" >&2
    # NVSHMEM for the inter-node transport, from the wheel matching torch's CUDA major.
    cuda_major=$("$py" -c 'import torch; print((torch.version.cuda or "").split(".")[0])')
    if [ -n "$cuda_major" ]; then
        log "installing nvidia-nvshmem-cu$cuda_major (NVSHMEM for the inter-node transport)"
        "$py" -m pip install -q "nvidia-nvshmem-cu$cuda_major" >&2
    fi
    echo "$stamp" > "$venv/.hybrid-ep-deps"
    rm -f "$venv/.hybrid-ep-build"  # torch was not importable while that install built: build below
fi

# The extensions build into the checkout (an editable install): a new clone at a path built
# before matches the stamp but has none of them, so their presence counts too.
built() { compgen -G "$repo/hybrid_ep/_planner*.so" >/dev/null; }
if [ "$(cat "$venv/.hybrid-ep-build" 2>/dev/null)" != "$build_stamp" ] || ! built; then
    buildlog=$(mktemp)
    if ! "$py" -m pip install -v --no-deps --no-build-isolation -e "$repo" >"$buildlog" 2>&1; then
        cat "$buildlog" >&2; rm -f "$buildlog"; log "error: installing hybrid-ep failed"; exit 1
    fi
    grep -ho 'hybrid-ep: building .*' "$buildlog" | sort -u >&2 || true
    rm -f "$buildlog"
    echo "$build_stamp" > "$venv/.hybrid-ep-build"
fi
echo "$py"
