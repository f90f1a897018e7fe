#!/usr/bin/env bash
# Lint what changed: ruff (Python, settings in pyproject.toml) and clang-format (csrc/, settings
# in .clang-format), on the lines that differ between BASE and the working tree. Lines nobody
# touched are not reported, so a file's older findings never block a change to it. Then, in
# both modes, the type check of the public API: mypy over hybrid_ep's API modules and the
# package's modules they import (settings and files: pyproject.toml's [tool.mypy]).
#
#   bash scripts/lint.sh           # BASE: the merge base with the upstream branch, else HEAD~1
#   bash scripts/lint.sh BASE      # any commit
#   bash scripts/lint.sh --all     # every file, every line (the tree-wide count)
#
# The tools come from the test extras (pyproject.toml), in the environment of $PYTHON (default: the
# python3 on PATH). Exit 1 when something is reported; skips with one line when there is no
# git history to compare with.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
py=${PYTHON:-python3}
bin=$(dirname "$("$py" -c 'import sys; print(sys.executable)')")
for tool in ruff clang-format git-clang-format graylint mypy; do
    [ -x "$bin/$tool" ] || { echo "lint: $bin/$tool not found (pip install -e '.[test]')" >&2; exit 2; }
done
csrc_ext=cu,cuh,h,cpp
csrc_files() { git ls-files -- 'csrc/*.cu' 'csrc/*.cuh' 'csrc/*.h' 'csrc/*.cpp'; }
# mypy with its settings and files from pyproject.toml (one line when clean).
type_check() { "$bin/mypy" || { echo "lint: mypy reported the type errors above" >&2; return 1; }; }

if [ "${1:-}" = "--all" ]; then
    rc=0
    "$bin/ruff" check --no-cache . || rc=1
    mapfile -t sources < <(csrc_files)
    "$bin/clang-format" --dry-run --Werror "${sources[@]}" || rc=1
    type_check || rc=1
    exit "$rc"
fi

if [ $# -gt 0 ]; then
    base=$1
elif ! git rev-parse --git-dir >/dev/null 2>&1; then
    echo "lint: not a git checkout, nothing to compare with: skipped"; exit 0
elif upstream=$(git rev-parse --verify -q '@{upstream}') && [ "$upstream" != "$(git rev-parse HEAD)" ]; then
    base=$(git merge-base HEAD "$upstream")
elif git rev-parse --verify -q HEAD~1 >/dev/null; then
    base=HEAD~1
else
    echo "lint: no previous commit to compare with: skipped"; exit 0
fi
git rev-parse --verify -q "$base^{commit}" >/dev/null || { echo "lint: no commit $base" >&2; exit 2; }

rc=0
mapfile -t changed < <(git diff --name-only --diff-filter=d "$base" -- '*.py')
if [ "${#changed[@]}" -gt 0 ]; then
    # graylint runs ruff on both versions of each file and keeps the findings that are new.
    "$bin/graylint" --no-color -r "$base.." -L "$bin/ruff check --no-cache --output-format=concise" "${changed[@]}" || rc=1
fi
if ! out=$("$bin/git-clang-format" --binary "$bin/clang-format" --extensions "$csrc_ext" --diff "$base" -- csrc 2>&1); then
    printf '%s\n' "$out"
    echo "lint: clang-format would change the lines above; apply with: git clang-format --binary $bin/clang-format --extensions $csrc_ext $base" >&2
    rc=1
fi
type_check || rc=1
echo "lint: $(git rev-parse --short "$base").. : ${#changed[@]} Python file(s), csrc changes and types checked: $([ $rc = 0 ] && echo clean || echo findings)"
exit "$rc"
