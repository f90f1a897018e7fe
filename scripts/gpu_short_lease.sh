#!/usr/bin/env bash
# The runbook's first three calls in one command, for a lease of 15 device-minutes (one call of
# at most 10 minutes, the machine's start included in the lease): the extension builds while
# the microbenchmarks run, then the GPU tests, the benchmark (direct path + W=8 as 2 nodes), the
# receive path's single-node sweep, fp8 dispatch at W=8 (direct path, 1 and 2 SMs per rank: fp8
# must reach bf16's tokens/s), the shape users run (a DeepSeek-V3-like layer: E=256, top-8,
# H=7168, 4096 tokens per rank, W=8, default settings; direct path, then receive path, with the
# bytes each rank's buffer holds in its JSON), W=8 ranks as 8 processes under MPS with no
# arena_bytes (gpu_check.sh processes: oracle, path per call, GB/s/SM beside the emulation's), and
# last the racecheck probe (docs/benchmarks/racecheck.md; its
# table is copied into the summary). Every part is bounded; the logs of all parts are packed
# into OUT/logs_short_lease.tgz beside OUT/summary.txt (the device returns at most 8 files).
#
#   GPU_CHECK_COMMIT=<short hash> bash scripts/gpu_short_lease.sh "$OUT"
#
# Budgets (seconds) per part: SHORT_LEASE_MICRO_S (150), SHORT_LEASE_TEST_S (150),
# SHORT_LEASE_BENCH_S (170), SHORT_LEASE_RECEIVE_S (90), SHORT_LEASE_FP8_S (60), SHORT_LEASE_DSV3_S
# (45 for each of the two paths), SHORT_LEASE_PROCESSES_S (90), SHORT_LEASE_PROBE_S (60, and never past 580 s from the start,
# so the command ends inside the device's 10 minutes).
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
note "fp8 dispatch, W=8 direct path, 1 and 2 SMs per rank (bench_fp8/)"
timeout -k 10 --signal=INT "${SHORT_LEASE_FP8_S:-60}" python3 -m hybrid_ep.bench \
    --emulate 8 --hidden 8192 --tokens 4096 --topk 8 --experts 16 --dtype fp8 --sms 1 2 \
    --out "$r/bench_fp8" > "$r/bench_fp8.log" 2>&1
note "bench fp8 exit $?"
for path in direct receive; do  # the shape users run, default settings (no arena, default rings)
    note "DeepSeek-V3-like layer, W=8, 4096 tokens per rank, $path path, 1 and 2 SMs per rank (bench_dsv3_$path/)"
    HYBRID_EP_DATA_PATH=$path timeout -k 10 --signal=INT "${SHORT_LEASE_DSV3_S:-45}" python3 -m hybrid_ep.bench \
        --emulate 8 --hidden 7168 --tokens 4096 --topk 8 --experts 256 --dtype bf16 --sms 1 2 \
        --out "$r/bench_dsv3_$path" > "$r/bench_dsv3_$path.log" 2>&1
    note "bench dsv3 $path exit $?"
done
proc_s=$((520 - SECONDS))  # never past 520 s: the probe keeps its minute inside the 10
[ "$proc_s" -gt "${SHORT_LEASE_PROCESSES_S:-90}" ] && proc_s=${SHORT_LEASE_PROCESSES_S:-90}
if [ "$proc_s" -ge 45 ]; then
    GPU_CHECK_BUDGET_S=$proc_s bash scripts/gpu_check.sh processes "$r/processes" > "$r/processes_stage.out" 2>&1
    note "processes exit $? (processes/processes.log):"
    grep '^process_bench' "$r/processes/processes.log" >> "$r/summary.txt" 2>/dev/null
else
    note "processes not run: $proc_s s left of 520"
fi
probe_s=$((580 - SECONDS))
[ "$probe_s" -gt "${SHORT_LEASE_PROBE_S:-60}" ] && probe_s=${SHORT_LEASE_PROBE_S:-60}
if [ "$probe_s" -ge 30 ]; then
    GPU_CHECK_BUDGET_S=$probe_s bash scripts/gpu_check.sh racecheck-probe "$r/racecheck_probe" \
        > "$r/racecheck_probe_stage.out" 2>&1
    note "racecheck probe exit $? (racecheck_probe/racecheck_probe_summary.txt):"
    cat "$r/racecheck_probe/racecheck_probe_summary.txt" >> "$r/summary.txt" 2>/dev/null
else
    note "racecheck probe not run: $probe_s s left of 580"
fi
