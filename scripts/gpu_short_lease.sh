#!/usr/bin/env bash
# The first call of a lease of 15 device-minutes, in one command that ends SHORT_LEASE_END_S
# (540) seconds after it starts, the build included (the device runs one command for at most 10
# minutes; the machine's start is outside it): the extension builds in the background while the
# microbenchmarks run (the carried build of scripts/prebuild_gpu.sh in seconds when it fits the
# checkout and loads, else a build here; among them the hand-offs the timing model prices,
# H_converged and H_named, the token stage's loads C_gather_1 / C_gather_8, and fp8's stores
# C_direct_1_fp8 / C_direct_2_fp8), then the decisions: the oracle on every direct-combine variant
# and combination the lease times and on the dispatch's store runs (gpu_check.sh test with
# GPU_CHECK_TEST_K), the same run's seed bf16 baseline, fp8 dispatch with a row a store and with
# store runs (fp8 must reach 1.6x bf16's tokens/s), the DeepSeek-V3-like layer (E=256, top-8,
# H=7168), all at W=8 on the direct path, 1 and 2 SMs per rank, then the direct combine's variants
# at both shapes, 1 and 2 SMs per rank, by what the committed predictions rank first, and ncu's
# warp samples by source line of fp8's dispatch and the first-ranked combine at the bench's own
# point (1 SM per rank, the GPU's clocks: gpu_check.sh ncu); then the GPU tests, the process
# bench's emulation points alone (the 2026-11-28 runs' illegal memory access), one NVLink domain of
# 36 ranks emulated (seed and DeepSeek-V3-like shapes, direct path), W=8 ranks as 8 processes under
# MPS beside the emulation (gpu_check.sh processes) and its seed point with 3 direct-combine stages,
# the benchmark (direct path + W=8 as 2 and 4 nodes), DeepEP beside hybrid-ep, the DeepSeek-V3-like
# layer on the receive path and the racecheck probe, as the time allows.
# Every part is bounded by
# its budget and by what is left before the end (a part with under 30 s left is not run, and the
# summary says so); after every part the logs so far are packed into OUT/logs_short_lease.tgz
# beside OUT/summary.txt (the device returns at most 8 files), so a call cut short still returns
# what ran.
#
#   GPU_CHECK_COMMIT=<short hash> bash scripts/gpu_short_lease.sh "$OUT"
#   GPU_CHECK_COMMIT=<short hash> bash scripts/gpu_short_lease.sh --second "$OUT"
#
# --second: the lease's second call, about 4.5 minutes on the machine the first call warmed (it
# ends SHORT_LEASE_END_S, default 270, seconds after it starts): the extension again (the
# carried build), then what the first could not fit, by value: dispatch + combine across NVSHMEM
# processes against the oracle (gpu_check.sh nvshmem-ep), the soak (both paths at W=8 and 2 nodes
# of 4, its budget shared among them), the NVSHMEM transport's self-test with
# its 0-byte put-with-signal case (nvshmem: 8 runs of at least 20 s each), and compute-sanitizer's
# memcheck and synccheck on the small case of both paths (sanitize; racecheck is the first call's
# probe) if time is left.
# Its logs go to OUT/logs_second_call.tgz beside OUT/summary.txt.
#
# Budgets (seconds) per part, and what each took or is expected to take (docs/benchmarks/cuda.md,
# "A lease of 15 device-minutes"): SHORT_LEASE_BUILD_S (240; the carried build about 10, a build
# here 50-90 measured), SHORT_LEASE_MICRO_S (150; 23-26 measured), SHORT_LEASE_ORACLE_S (90; the
# variants' and store runs' oracle tests), SHORT_LEASE_TEST_S (200; 137 on the H200 on 2026-11-28),
# SHORT_LEASE_BENCH_S (100), SHORT_LEASE_SEED_S (30), SHORT_LEASE_FP8_S (30, each of fp8's two points;
# 12 measured), SHORT_LEASE_DSV3_S (30 for each of the two paths; 13 measured), SHORT_LEASE_VARIANTS_S
# (220, the combine's variants together: about 13 s a variant and shape at 1 and 2 SMs), SHORT_LEASE_NCU_S (100; the
# profiled call about 20 s inside ncu), SHORT_LEASE_DOMAIN_S (30 for each shape of the 36-rank
# domain), SHORT_LEASE_EMULATION_ALONE_S (100; the process
# bench's emulation points alone, launches blocking, without and with MPS, then memcheck),
# SHORT_LEASE_PROCESSES_S (110), SHORT_LEASE_STAGES_S (60; the processes point at 3
# direct-combine stages: 40 ran out before its first point), SHORT_LEASE_DEEPEP_S (90), SHORT_LEASE_PROBE_S
# (60); the second call's: SHORT_LEASE_NVSHMEM_EP_S (60; 43 measured), SHORT_LEASE_SOAK_S (120), SHORT_LEASE_NVSHMEM_S (170),
# SHORT_LEASE_SANITIZE_S (90).
set -u
call=first
if [ "${1:-}" = --second ]; then call=second; shift; fi
out=${1:?usage: scripts/gpu_short_lease.sh [--second] OUT}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
r=$(mktemp -d)
if [ "$call" = second ]; then end=${SHORT_LEASE_END_S:-270}; else end=${SHORT_LEASE_END_S:-540}; fi
export HYBRID_EP_CUDA_ARCHS=${HYBRID_EP_CUDA_ARCHS:-90a} PYTHONUNBUFFERED=1
export HYBRID_EP_TIMEOUT_S=${HYBRID_EP_TIMEOUT_S:-20}
# pack: every log so far into OUT's archive (written aside, then moved: a call killed while it
# packs leaves the last whole archive), after every part and at the exit, so that a call cut short
# still returns what ran. ncu's report is left out (tens of MB, each pack again; its tables are
# text beside it). tar's exit 1 (a file changed while read: the build in the background still
# writes) leaves a whole archive; a worse one leaves the last and no .part in OUT.
pack() {
    local archive=$out/logs_short_lease.tgz rc
    [ "$call" = second ] && archive=$out/logs_second_call.tgz
    tar czf "$archive.part" --exclude='*.ncu-rep' -C "$r" . 2>/dev/null
    rc=$?
    if [ "$rc" -le 1 ]; then mv -f "$archive.part" "$archive"; else rm -f "$archive.part"; fi
    cp "$r/summary.txt" "$out/summary.txt" 2>/dev/null
}
line() { echo "short_lease [$call call, $(date +%T), ${SECONDS} s]: $*" | tee -a "$r/summary.txt"; }
note() {  # a part's line in the summary, then the logs packed
    line "$@"
    pack
}
trap pack EXIT
# fits PART BUDGET: true with $s = the part's seconds, its budget cut to what is left before
# $end (10 s kept to pack the logs); false, with a note, when under 30 s are left (gpu_check.sh
# keeps 20 s of a stage's budget for its own end).
fits() {
    s=$((end - 10 - SECONDS))
    [ "$2" -lt "$s" ] && s=$2
    [ "$s" -ge 30 ] && return 0
    line "$1 not run: $((end - SECONDS)) s left of $end"
    return 1
}
# bench PART BUDGET FOLDER [VAR=VALUE ...] -- FLAGS: one hybrid_ep.bench run into FOLDER/ and FOLDER.log
bench() {
    local part=$1 budget=$2 folder=$3
    shift 3
    local env=()
    while [ "$1" != -- ]; do env+=("$1"); shift; done
    shift
    fits "$part" "$budget" || return 0
    env ${env[@]+"${env[@]}"} timeout -k 10 --signal=INT "$s" python3 -m hybrid_ep.bench "$@" \
        --out "$r/$folder" > "$r/$folder.log" 2>&1
    note "$part exit $?"
}

# stage PART BUDGET STAGE [ARG ...]: one gpu_check.sh stage into $r/STAGE/ (its ARGs after the
# folder), its exit in the summary
stage() {
    fits "$1" "$2" || return 0
    GPU_CHECK_BUDGET_S=$s bash scripts/gpu_check.sh "$3" "$r/$3" "${@:4}" > "$r/$3_stage.out" 2>&1
    note "$1 exit $?: $(grep -v '^gpu_check \[build\]' "$r/$3/gpu_check_summary.txt" 2>/dev/null | tail -1)"
}

if [ "$call" = second ]; then
    GPU_CHECK_BUDGET_S=${SHORT_LEASE_BUILD_S:-120} bash scripts/gpu_check.sh build "$r/build" > "$r/build_stage.out" 2>&1
    note "build exit $?: $(grep -m1 -oE '(using the carried build|building hybrid_ep|the carried|no carried).*' \
        "$r/build_stage.out")"
    stage "nvshmem-ep" "${SHORT_LEASE_NVSHMEM_EP_S:-60}" nvshmem-ep
    stage soak "${SHORT_LEASE_SOAK_S:-120}" soak
    stage nvshmem "${SHORT_LEASE_NVSHMEM_S:-170}" nvshmem
    stage sanitize "${SHORT_LEASE_SANITIZE_S:-90}" sanitize memcheck synccheck
    exit 0
fi
note "extension build in the background, microbenchmarks in front"
(GPU_CHECK_BUDGET_S=${SHORT_LEASE_BUILD_S:-240} bash scripts/gpu_check.sh build "$r/build" > "$r/build_stage.out" 2>&1) &
build_pid=$!
GPU_CHECK_BUDGET_S=${SHORT_LEASE_MICRO_S:-150} bash scripts/gpu_check.sh micro "$r/micro" > "$r/micro_stage.out" 2>&1
note "micro exit $?"
wait "$build_pid"
note "build exit $?: $(grep -m1 -oE '(using the carried build|building hybrid_ep|the carried|no carried).*' \
    "$r/build_stage.out")"
# whether this machine's GPU can make and export a fabric handle (what NVLink domains across
# hosts need; registered.py's probe): the reason it cannot, or that it can
note "fabric probe: $(python3 -c 'from hybrid_ep.backends.cuda.layout import compiled as ext
print(ext.fabric_probe(0) or "a fabric allocation was created and exported")' 2>&1 | tail -1)"
# Decisions first (what the committed predictions score and the designs they judge: the direct
# combine's default, fp8's store design). The oracle on every combine variant and combination the
# lease times, and on the dispatch's store runs, before any of them is timed.
if fits oracle "${SHORT_LEASE_ORACLE_S:-90}"; then
    GPU_CHECK_TEST_K="direct_combine_variants or store_runs" GPU_CHECK_BUDGET_S=$s \
        bash scripts/gpu_check.sh test "$r/oracle" > "$r/oracle_stage.out" 2>&1
    note "oracle exit $?: $(grep -E '^=+ .*(passed|failed|error)' "$r/oracle/gpu_tests.log" | tail -1)"
fi
shape=(--hidden 8192 --tokens 4096 --topk 8 --experts 16)
dsv3=(--hidden 7168 --tokens 4096 --topk 8 --experts 256)
# The same run's bf16 baseline at the seed shape (the variants and fp8 are read against it), then
# fp8's dispatch (it must reach 1.6x bf16's tokens/s) with a row a store and with store runs
# (HYBRID_EP_STORE_RUNS=1: whichever C_direct_2_fp8 favours), then the DeepSeek-V3-like layer.
note "seed bf16, fp8 and fp8 with store runs, DeepSeek-V3-like: W=8 direct path, 1 and 2 SMs per rank"
bench "bench seed" "${SHORT_LEASE_SEED_S:-30}" bench_seed HYBRID_EP_DATA_PATH=direct -- \
    --emulate 8 "${shape[@]}" --dtype bf16 --sms 1 2
bench "bench fp8" "${SHORT_LEASE_FP8_S:-30}" bench_fp8 -- --emulate 8 "${shape[@]}" --dtype fp8 --sms 1 2
bench "bench fp8 store runs" "${SHORT_LEASE_FP8_S:-30}" bench_fp8_runs HYBRID_EP_STORE_RUNS=1 -- \
    --emulate 8 "${shape[@]}" --dtype fp8 --sms 1 2
bench "bench dsv3 direct" "${SHORT_LEASE_DSV3_S:-30}" bench_dsv3_direct HYBRID_EP_DATA_PATH=direct -- \
    --emulate 8 "${dsv3[@]}" --dtype bf16 --sms 1 2
# The direct combine's designs the timing model judges (its predictions of each are committed
# before the run: benchmarks/results/predicted-8dc6462/), W = 8, 1 and 2 SMs per rank, by what
# the predictions rank first: the proposed default (token stages, the named hand-off, 8 reducer
# warps), the same with 4, the converged wait with 8 (whose hand-off price is still an estimate),
# then token stages with each hand-off, the named hand-off, the elected wait, at the seed shape
# and the DeepSeek-V3-like one; then the seed shape alone; each into
# combine_variants/<variant>_<shape>/. What the budget leaves out is said.
variants=("token_named_r8 seed COMBINE_STAGE=token REDUCER_WAIT=named REDUCER_WARPS=8"
    "token_named_r8 dsv3 COMBINE_STAGE=token REDUCER_WAIT=named REDUCER_WARPS=8"
    "token_named seed COMBINE_STAGE=token REDUCER_WAIT=named"
    "token_named dsv3 COMBINE_STAGE=token REDUCER_WAIT=named"
    "converged_r8 seed REDUCER_WAIT=converged REDUCER_WARPS=8" "converged_r8 dsv3 REDUCER_WAIT=converged REDUCER_WARPS=8"
    "token seed COMBINE_STAGE=token" "token dsv3 COMBINE_STAGE=token"
    "named seed REDUCER_WAIT=named" "named dsv3 REDUCER_WAIT=named"
    "r8_elect seed REDUCER_WARPS=8 REDUCER_WAIT=elect" "r8_elect dsv3 REDUCER_WARPS=8 REDUCER_WAIT=elect"
    "token_converged seed COMBINE_STAGE=token REDUCER_WAIT=converged"
    "named_r8 seed REDUCER_WAIT=named REDUCER_WARPS=8" "converged seed REDUCER_WAIT=converged"
    "token_elect_r8 seed COMBINE_STAGE=token REDUCER_WAIT=elect REDUCER_WARPS=8")
variants_end=$((SECONDS + ${SHORT_LEASE_VARIANTS_S:-220}))
mkdir -p "$r/combine_variants"
for v in "${variants[@]}"; do
    read -r name on settings <<< "$v"
    [ "$SECONDS" -lt "$variants_end" ] || { line "combine $name $on not run: the variants' budget is spent"; continue; }
    if [ "$on" = seed ]; then flags=("${shape[@]}"); else flags=("${dsv3[@]}"); fi
    env_settings=()
    for setting in $settings; do env_settings+=("HYBRID_EP_$setting"); done
    bench "combine $name $on" "$((variants_end - SECONDS))" "combine_variants/${name}_$on" HYBRID_EP_DATA_PATH=direct \
        "${env_settings[@]}" -- --emulate 8 "${flags[@]}" --dtype bf16 --sms 1 2
done
# Where the direct kernels' warps stall, by source line (ncu/ncu_lines_*.txt), at the bench's own
# point (1 SM per rank, the GPU's own clocks: gpu_check.sh's ncu stage): fp8's dispatch, which no
# ncu reading has read, and the combine the predictions rank first (token stages, the named
# hand-off, 8 reducer warps)
HYBRID_EP_COMBINE_STAGE=token HYBRID_EP_REDUCER_WAIT=named HYBRID_EP_REDUCER_WARPS=8 \
    GPU_CHECK_NCU_DTYPE=fp8 GPU_CHECK_NCU_SMS=1 \
    stage ncu "${SHORT_LEASE_NCU_S:-100}" ncu
if fits test "${SHORT_LEASE_TEST_S:-200}"; then
    GPU_CHECK_BUDGET_S=$s bash scripts/gpu_check.sh test "$r/test" > "$r/test_stage.out" 2>&1
    note "test exit $?: $(grep -E '^=+ .*(passed|failed|error)' "$r/test/gpu_tests.log" | tail -1)"
fi
# The illegal memory access of both 2026-11-28 runs (the process bench's plain emulation of seed
# fp8, right after seed bf16 through peer memory, in the bench's own process; the CPU model and a
# fresh process of `bench --emulate 8 --dtype fp8` run clean): the emulation points alone, no
# pool of processes, launches blocking (the failing launch is named), first without MPS, then
# under MPS as the processes stage ran them, then under compute-sanitizer memcheck (no MPS: the
# faulting access, its kernel and address) with what is left of the part's budget.
if fits "emulation alone" "${SHORT_LEASE_EMULATION_ALONE_S:-100}"; then
    alone=(--pool none --nodes 1 --shapes seed --dtypes bf16 fp8 --sms 1 --iters 3)
    part_end=$((SECONDS + s))
    mkdir -p "$r/emulation_alone"
    CUDA_LAUNCH_BLOCKING=1 timeout -k 5 --signal=INT $((s / 4)) python3 -m hybrid_ep.bench.processes "${alone[@]}" \
        --out "$r/emulation_alone/no_mps" > "$r/emulation_alone/no_mps.log" 2>&1
    note "emulation alone, no MPS, launches blocking: exit $?"
    grep -E '^processes |Error' "$r/emulation_alone/no_mps.log" | head -6 >> "$r/summary.txt"
    CUDA_LAUNCH_BLOCKING=1 GPU_CHECK_BUDGET_S=$((s / 4 + 20)) GPU_CHECK_PROCESSES_ARGS="${alone[*]}" \
        bash scripts/gpu_check.sh processes "$r/emulation_alone/mps" > "$r/emulation_alone/mps_stage.out" 2>&1
    note "emulation alone, under MPS, launches blocking: exit $?"
    grep -E '^processes |Error' "$r/emulation_alone/mps/processes.log" 2>/dev/null | head -6 >> "$r/summary.txt"
    left=$((part_end - SECONDS))
    if [ "$left" -ge 20 ]; then
        timeout -k 5 --signal=INT "$left" compute-sanitizer --tool memcheck --print-limit 5 \
            python3 -m hybrid_ep.bench.processes "${alone[@]}" --out "$r/emulation_alone/memcheck" \
            > "$r/emulation_alone/memcheck.log" 2>&1
        note "emulation alone, memcheck: exit $?"
        grep -m8 -E 'Invalid|ERROR SUMMARY|^=+ +at |^processes ' "$r/emulation_alone/memcheck.log" >> "$r/summary.txt"
    fi
fi
# One NVLink domain of 36 ranks (a GB200 NVL36) emulated on this GPU, the direct path, seed shape
# (E = 72) and DeepSeek-V3-like (E = 288), 1 and 2 SMs per rank: GB/s/SM beside the 8-rank points
note "one domain of 36 ranks, direct path, 1 and 2 SMs per rank (bench_domain36_{seed,dsv3}/)"
bench "bench domain36 seed" "${SHORT_LEASE_DOMAIN_S:-30}" bench_domain36_seed HYBRID_EP_DATA_PATH=direct -- \
    --emulate 36 --hidden 8192 --tokens 4096 --topk 8 --experts 72 --dtype bf16 --sms 1 2
bench "bench domain36 dsv3" "${SHORT_LEASE_DOMAIN_S:-30}" bench_domain36_dsv3 HYBRID_EP_DATA_PATH=direct -- \
    --emulate 36 --hidden 7168 --tokens 4096 --topk 8 --experts 288 --dtype bf16 --sms 1 2
if fits processes "${SHORT_LEASE_PROCESSES_S:-120}"; then
    GPU_CHECK_BUDGET_S=$s NVSHMEM_DEBUG=INFO bash scripts/gpu_check.sh processes "$r/processes" \
        > "$r/processes_stage.out" 2>&1
    note "processes exit $? (processes/processes.log):"
    grep '^processes ' "$r/processes/processes.log" >> "$r/summary.txt" 2>/dev/null
fi
if fits "processes, 3 combine stages" "${SHORT_LEASE_STAGES_S:-60}"; then
    HYBRID_EP_DIRECT_COMBINE_STAGES=3 GPU_CHECK_BUDGET_S=$s GPU_CHECK_PROCESSES_ARGS="--nodes 1 --shapes seed --sms 1" \
        bash scripts/gpu_check.sh processes "$r/processes_3_stages" > "$r/processes_3_stages_stage.out" 2>&1
    note "processes, 3 combine stages exit $? (processes_3_stages/processes.log):"
    grep '^processes ' "$r/processes_3_stages/processes.log" >> "$r/summary.txt" 2>/dev/null
fi
if fits bench "${SHORT_LEASE_BENCH_S:-100}"; then
    GPU_CHECK_BUDGET_S=$s bash scripts/gpu_check.sh bench "$r/bench" > "$r/bench_stage.out" 2>&1
    note "bench exit $?"
fi
if fits deepep "${SHORT_LEASE_DEEPEP_S:-90}"; then
    GPU_CHECK_BUDGET_S=$s bash scripts/gpu_check.sh deepep "$r/deepep" > "$r/deepep_stage.out" 2>&1
    note "deepep exit $?: $(grep -m1 -oE '(DeepEP from|no DeepEP wheel).*' "$r/deepep_stage.out")"
fi
note "DeepSeek-V3-like layer, W=8, 4096 tokens per rank, receive path, 1 and 2 SMs per rank (bench_dsv3_receive/)"
bench "bench dsv3 receive" "${SHORT_LEASE_DSV3_S:-30}" bench_dsv3_receive HYBRID_EP_DATA_PATH=receive -- \
    --emulate 8 --hidden 7168 --tokens 4096 --topk 8 --experts 256 --dtype bf16 --sms 1 2
if fits "racecheck probe" "${SHORT_LEASE_PROBE_S:-60}"; then
    GPU_CHECK_BUDGET_S=$s bash scripts/gpu_check.sh racecheck-probe "$r/racecheck_probe" \
        > "$r/racecheck_probe_stage.out" 2>&1
    note "racecheck probe exit $? (racecheck_probe/racecheck_probe_summary.txt):"
    cat "$r/racecheck_probe/racecheck_probe_summary.txt" >> "$r/summary.txt" 2>/dev/null
fi
