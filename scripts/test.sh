#!/usr/bin/env bash
# The test command (README, CI): environment, lint of the whole tree (scripts/lint.sh --all), then
# pytest with the 25 slowest tests listed at the end, and beside it the nvcc compile check of csrc/.
# Extra arguments go to pytest (e.g. -m unit: CONTRIBUTING.md lists the tiers).
# Without a -m of its own, pytest runs the CI tier, -m "not slow": every test but those that
# run for tens of seconds each (training loops, sanitized builds, long searches), which CI's 20
# minutes on 2 cores do not hold. --full (first argument) runs them too: before landing a change
# under csrc/ or the balancer, and before a GPU lease (CONTRIBUTING.md).
# pytest runs on HYBRID_EP_TEST_WORKERS processes (pytest-xdist; default: the CPUs, at most 4,
# since each worker starts process-group pools of its own; 1 where a GPU is visible, as the GPU
# tests share the devices); 1 runs the tests in the one pytest process.
# "No tests collected" (pytest exit 5) is a failure.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tier=(-m "not slow") tier_name="the CI tier (-m 'not slow'; --full runs every test)"
if [ "${1:-}" = --full ]; then shift; tier=() tier_name="the full suite"; fi
for arg in "$@"; do
    case "$arg" in -m | -m*) tier=() tier_name="the tests of the -m given" ;; esac
done
if nvidia-smi -L >/dev/null 2>&1; then default_workers=1; else default_workers=$(nproc 2>/dev/null || echo 1); fi
workers=${HYBRID_EP_TEST_WORKERS:-$default_workers}
if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
    echo "test.sh: HYBRID_EP_TEST_WORKERS must be a whole number >= 1, got '$workers'" >&2; exit 2
fi
[ -n "${HYBRID_EP_TEST_WORKERS:-}" ] || [ "$workers" -le 4 ] || workers=4
py=$(bash "$repo/scripts/env.sh")
# The nvcc compile check runs beside the lint and pytest at the lowest priority (nice 19): it takes
# the CPU they leave idle (their waits on deadlines, peers and spawned ranks) instead of a span of its
# own before them; its lines are printed after pytest's, and its failure fails the run.
# In a process group of its own (setsid), so that a run that stops early (a lint finding, a
# signal) stops the check's nvcc jobs with it, not only their shell.
compile_log=$(mktemp)
own_group=()
if command -v setsid >/dev/null; then own_group=(setsid); fi
PYTHON="$py" "${own_group[@]}" nice -n 19 bash "$repo/scripts/compile_csrc.sh" > "$compile_log" 2>&1 &
compile_pid=$!
# Under set -e a failing command in the EXIT trap becomes the run's exit status: kill fails once
# the check has finished, so it may not fail the trap.
trap 'kill -- -"$compile_pid" 2>/dev/null || kill "$compile_pid" 2>/dev/null || true; rm -f "$compile_log"' EXIT
# The whole tree is ruff- and clang-format-clean, and a finding anywhere fails the run
# (CONTRIBUTING.md); HYBRID_EP_LINT=warn prints the findings and goes on, for a local run.
if ! PYTHON="$py" bash "$repo/scripts/lint.sh" --all; then
    [ "${HYBRID_EP_LINT:-strict}" = warn ] || { echo "test.sh: lint findings above (scripts/lint.sh --all)" >&2; exit 1; }
    echo "test.sh: the lint findings above do not fail this run (HYBRID_EP_LINT=warn)" >&2
fi
# which Megatron-Core the megatron tests run against (docs/megatron.md#versions)
echo "test.sh: $("$py" -W ignore -m megatron_patches.versions 2>/dev/null || echo "Megatron-Core is not importable")" >&2
cd "$repo"
xdist=()
# loadgroup: the tests that share a file's fixtures or pools run on one worker (tests/conftest.py
# marks them, and puts the slow ones first, an order --no-loadscope-reorder keeps)
if [ "$workers" -gt 1 ]; then xdist=(-n "$workers" --dist loadgroup --no-loadscope-reorder); fi
echo "test.sh: $tier_name" >&2
set +e
"$py" -m pytest --timeout=600 --durations=25 "${xdist[@]}" "${tier[@]}" "$@"
rc=$?
wait "$compile_pid"
compile_rc=$?
set -e
cat "$compile_log"
# the verdict on stdout, where a log that keeps one stream still shows which part failed
echo "test.sh: pytest exit $rc, nvcc compile check exit $compile_rc"
if [ "$compile_rc" -ne 0 ]; then echo "test.sh: the nvcc compile check failed (its lines above)"; exit 1; fi
if [ "$rc" -eq 5 ]; then echo "test.sh: pytest collected no tests; that is a failure"; exit 1; fi
exit "$rc"
