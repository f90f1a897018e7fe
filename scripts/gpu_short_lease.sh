#!/usr/bin/env bash
# The runbook's first three calls in one command, for a lease of 15 device-minutes (one call of
# at most 10 minutes, the machine's start included in the lease): the extension builds while
# the microbenchmarks run, then the GPU tests, the benchmark (direct path + W=8 as 2 nodes), and
# the receive path's single-node sweep. Every part is bounded; the logs of all parts are packed
# into OUT/logs_short_lease.tgz beside OUT/summary.txt (the device returns at most 8 files).
#
#   GPU_CHECK_COMMIT=<short hash> bash scripts/gpu_short_lease.sh "$OUT"
#
# Budgets (seconds) per part: SHORT_LEASE_MICRO_S (150), SHORT_LEASE_TEST_S (150),
# SHORT_LEASE_BENCH_S (170), SHORT_LEASE_RECEIVE_S (90).
set -u
out=${1:?usage: scripts/gpu_short_lease.sh OUT}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
r=$(mktemp -d)
export HYBRID_EP_CUDA_ARCHS=${HYBRID_EP_CUDA_ARCHS:-90a} PYTHONUNBUFFERED=1
export HYBRID_EP_TIMEOUT_S=${HYBRID_EP_TIMEOUT_S:-20}
note() { echo "short_lease [$(date +%T), ${SECONDS} s]: $*" | tee -a "$r/summary.txt"; }
pack() {
    tar czf "$out/logs_short_lease.tgz" -C "$r" .
    cp "$r/summary.txt" "$out/summary.txt"
}
trap pack EXIT

note "extension build in the background, microbenchmarks in front"
(GPU_CHECK_BUDGET_S=240 bash scripts/gpu_check.sh build "$r/build" > "$r/build_stage.out" 2>&1) &
build_pid=$!
GPU_CHECK_BUDGET_S=${SHORT_LEASE_MICRO_S:-150} bash scripts/gpu_check.sh micro "$r/micro" > "$r/micro_stage.out" 2>&1
note "micro exit $?"
wait "$build_pid"
note "build exit $?"
GPU_CHECK_BUDGET_S=${SHORT_LEASE_TEST_S:-150} bash scripts/gpu_check.sh test "$r/test" > "$r/test_stage.out" 2>&1
note "test exit $?: $(grep -E '^=+ .*(passed|failed|error)' "$r/test/gpu_tests.log" | tail -1)"
GPU_CHECK_BUDGET_S=${SHORT_LEASE_BENCH_S:-170} bash scripts/gpu_check.sh bench "$r/bench" > "$r/bench_stage.out" 2>&1
note "bench exit $?"
note "receive path, one node (bench_receive/)"
HYBRID_EP_DATA_PATH=receive timeout -k 10 --signal=INT "${SHORT_LEASE_RECEIVE_S:-90}" python3 -m hybrid_ep.bench \
    --emulate 2 8 --hidden 8192 --tokens 4096 --topk 8 --experts 16 --dtype bf16 --sms 1 2 4 \
    --out "$r/bench_receive" > "$r/bench_receive.log" 2>&1
note "bench receive exit $?"
