#!/usr/bin/env bash
# GPU checks of the cuda backend on a single-GPU machine exactly as it is: its own python3
# and the packages already installed, no network, no virtualenv, nothing installed. Each
# stage is one command that ends well inside 10 minutes and writes its logs into RESULTS.
#
#   bash scripts/gpu_check.sh build    RESULTS   # hybrid_ep._C in place, sm_90a only
#   bash scripts/gpu_check.sh test     RESULTS   # (a) build + every GPU test
#   bash scripts/gpu_check.sh sanitize RESULTS [TOOL ...]   # (b) compute-sanitizer on small
#                                                #     emulated cases (memcheck racecheck synccheck)
#   bash scripts/gpu_check.sh bench    RESULTS   # (c) the emulated benchmark sweep
#   bash scripts/gpu_check.sh ncu      RESULTS   # (d) ncu on dispatch and combine, seed shape
#   bash scripts/gpu_check.sh nvshmem  RESULTS   # (e) NVSHMEM transport, 2 and 4 PEs on the GPU,
#                                                #     without and with MPS (summary: nvshmem_summary.txt)
#   bash scripts/gpu_check.sh nvshmem-ep RESULTS # (f) dispatch + combine across 2-4 processes on the
#                                                #     GPU, nodes joined by NVSHMEM, against the oracle
#
# Every stage builds the extension first unless hybrid_ep/_C*.so is newer than csrc/ and
# setup.py. Environment: PYTHON (default python3), HYBRID_EP_CUDA_ARCHS (default 90a),
# GPU_CHECK_BUDGET_S (seconds a stage's main command may run, default 480).
set -uo pipefail

usage() {
    sed -n '6,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
[ $# -ge 2 ] || usage
stage=$1
results=$2
shift 2
case "$stage" in
    build|test|sanitize|bench|ncu|nvshmem|nvshmem-ep) ;;
    *) echo "gpu_check: unknown stage '$stage'" >&2; usage ;;
esac
if [ "$stage" != sanitize ] && [ $# -gt 0 ]; then
    echo "gpu_check: stage $stage takes no further arguments, got: $*" >&2
    usage
fi
mkdir -p "$results" || { echo "gpu_check: can not create the results folder $results" >&2; exit 2; }
results=$(cd "$results" && pwd)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

py=${PYTHON:-python3}
budget=${GPU_CHECK_BUDGET_S:-480}
export PYTHONUNBUFFERED=1
export HYBRID_EP_CUDA_ARCHS=${HYBRID_EP_CUDA_ARCHS:-90a}
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "gpu_check [$stage]: $*"; }

facts_py='import sys, torch; ok = torch.cuda.is_available(); print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "| device", torch.cuda.get_device_name(0) if ok else None)'

machine_facts() {
    {
        echo "date: $(date -Iseconds)"
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
        "$py" -c "$facts_py" 2>&1
        nvcc --version 2>&1 | tail -1
    } > "$results/machine.txt"
    say "$(head -3 "$results/machine.txt" | tr '\n' ' ')"
}

extension_is_fresh() {
    local so
    so=$(ls hybrid_ep/_C*.so 2>/dev/null | head -1)
    [ -n "$so" ] || return 1
    [ -z "$(find csrc setup.py -newer "$so" -type f 2>/dev/null | head -1)" ]
}

build() {
    if extension_is_fresh; then
        say "hybrid_ep._C is newer than csrc/ and setup.py: not rebuilt"
    else
        local start=$SECONDS
        say "building hybrid_ep._C in place for sm_${HYBRID_EP_CUDA_ARCHS//;/, sm_} (log: build.log)"
        if ! "$py" setup.py build_ext --inplace > "$results/build.log" 2>&1; then
            tail -30 "$results/build.log"
            say "build failed"
            exit 1
        fi
        say "built in $((SECONDS - start)) s"
    fi
    "$py" -c 'import hybrid_ep._C' || { say "hybrid_ep._C does not import"; exit 1; }
}

run_tests() {
    say "GPU tests (log: gpu_tests.log)"
    timeout --signal=INT "$budget" "$py" -m pytest -m "gpu or multigpu" -rA -p no:cacheprovider --timeout=300 \
        --junitxml="$results/gpu_tests.xml" \
        tests/test_cuda_emulation.py tests/test_reference_nccl.py tests/test_balancer_loop.py \
        tests/test_nvshmem_transport.py > "$results/gpu_tests.log" 2>&1
    local rc=$?
    say "pytest exit $rc: $(tail -1 "$results/gpu_tests.log")"
    return "$rc"
}

run_sanitizer() {
    local tools=("$@")
    [ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck synccheck)
    local per_tool=$((budget / ${#tools[@]})) worst=0 tool rc
    : > "$results/sanitizer_summary.txt"
    for tool in "${tools[@]}"; do
        case "$tool" in memcheck|racecheck|synccheck|initcheck) ;;
            *) echo "gpu_check: unknown compute-sanitizer tool '$tool'" >&2; exit 2 ;; esac
        say "compute-sanitizer --tool $tool (log: sanitizer_$tool.log, at most $per_tool s)"
        HYBRID_EP_TIMEOUT_S=60 timeout --signal=INT "$per_tool" compute-sanitizer --tool "$tool" --error-exitcode 99 \
            --print-limit 50 "$py" -m hybrid_ep.testing.emulated_check --preset small --calls 1 \
            > "$results/sanitizer_$tool.log" 2>&1
        rc=$?
        echo "$tool: exit $rc; $(grep -h 'ERROR SUMMARY' "$results/sanitizer_$tool.log" | tail -1)" \
            | tee -a "$results/sanitizer_summary.txt"
        [ "$rc" -gt "$worst" ] && worst=$rc
    done
    return "$worst"
}

run_bench() {
    say "emulated benchmark: W=2 and W=8, 1 2 4 SMs per rank (log: bench.log, results: bench/)"
    local start=$SECONDS rc rc_nodes
    timeout --signal=INT "$budget" "$py" -m hybrid_ep.bench --emulate 2 8 --hidden 8192 --tokens 4096 --topk 8 \
        --experts 16 --dtype bf16 --sms 1 2 4 --out "$results/bench" > "$results/bench.log" 2>&1
    rc=$?
    tail -20 "$results/bench.log"
    # The same shape as 2 nodes of 4: the RDMA stage through the loopback transport, its rows
    # checked against the traffic model.
    say "emulated benchmark, W=8 as 2 nodes (log: bench_nodes.log, results: bench_nodes/)"
    timeout --signal=INT "$((budget - (SECONDS - start) > 30 ? budget - (SECONDS - start) : 30))" "$py" \
        -m hybrid_ep.bench --emulate 8 --emulate-nodes 2 --hidden 8192 --tokens 4096 --topk 8 --experts 16 \
        --dtype bf16 --sms 1 2 4 --out "$results/bench_nodes" > "$results/bench_nodes.log" 2>&1
    rc_nodes=$?
    tail -12 "$results/bench_nodes.log"
    [ "$rc" -ne 0 ] && return "$rc"
    return "$rc_nodes"
}

run_ncu() {
    # Each call of emulated_check launches dispatch, combine, dispatch (handle reuse); skip the
    # first call's three and profile the second call's dispatch and combine.
    say "ncu on dispatch_kernel and combine_kernel, W=8 H=8192 T=4096 K=8 E=16 bf16 (log: ncu.log)"
    timeout --signal=INT "$budget" ncu --target-processes all --kernel-name "regex:dispatch_kernel|combine_kernel" \
        --launch-skip 3 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats \
        --section SourceCounters --export "$results/ncu" --force-overwrite \
        "$py" -m hybrid_ep.testing.emulated_check -w 8 --hidden 8192 --tokens 4096 --topk 8 --experts 16 \
        --calls 2 --no-check > "$results/ncu.log" 2>&1
    local rc=$?
    if [ -f "$results/ncu.ncu-rep" ]; then
        ncu --import "$results/ncu.ncu-rep" --page details > "$results/ncu_details.txt" 2>&1
        ncu --import "$results/ncu.ncu-rep" --page details --csv > "$results/ncu_details.csv" 2>&1
        # per-SASS-instruction stall samples (SourceCounters), one table per kernel
        local k
        for k in dispatch_kernel combine_kernel; do
            ncu --import "$results/ncu.ncu-rep" --page source --csv --print-source sass \
                --kernel-name "regex:$k" > "$results/ncu_source_$k.csv" 2>&1
            # the same summed per source line (the build has -lineinfo)
            ncu --import "$results/ncu.ncu-rep" --page source --csv --print-source cuda,sass \
                --kernel-name "regex:$k" > "$results/ncu_source_lines.tmp" 2>&1
            "$py" scripts/ncu_lines.py "$results/ncu_source_lines.tmp" > "$results/ncu_lines_$k.txt" 2>&1
        done
        rm -f "$results/ncu_source_lines.tmp"
    fi
    tail -5 "$results/ncu.log"
    return "$rc"
}

# Several processes on the one GPU, each one NVSHMEM PE (hybrid_ep.testing.nvshmem_selftest):
# without MPS (NVSHMEM's limited support of several PEs per GPU) and with the MPS daemon
# started here (full support), each with NVSHMEM's default CUDA VMM heap and with
# NVSHMEM_DISABLE_CUDA_VMM=1. Every combination is logged; the stage passes when some
# combination works for both 2 and 4 PEs.
run_nvshmem() {
    "$py" -c 'import hybrid_ep._C as c, sys; sys.exit(0 if c.has_nvshmem() else 1)' || {
        say "hybrid_ep._C was built without NVSHMEM (see build.log): nothing to run"; return 1; }
    local per_run=$((budget / 8)) mps vmm procs rc name worked2="" worked4=""
    local summary="$results/nvshmem_summary.txt"
    : > "$summary"
    # The daemon's socket path must stay short (a Unix socket name): its pipe folder is in /tmp.
    CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/hybrid-ep-mps.XXXXXX)
    export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY="$results/mps/log"
    mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
    for mps in off on; do
        if [ "$mps" = on ]; then
            if ! nvidia-cuda-mps-control -d > "$results/mps/start.log" 2>&1; then
                echo "mps=on: nvidia-cuda-mps-control -d failed: $(tail -1 "$results/mps/start.log")" | tee -a "$summary"
                break
            fi
            trap 'echo quit | nvidia-cuda-mps-control > /dev/null 2>&1' EXIT
            sleep 1
        fi
        for vmm in default off; do
            for procs in 2 4; do
                name="mps-${mps}_vmm-${vmm}_p${procs}"
                say "NVSHMEM self-test, $procs PEs, MPS $mps, CUDA VMM heap $vmm (log: nvshmem/$name/)"
                if [ "$vmm" = off ]; then export NVSHMEM_DISABLE_CUDA_VMM=1; else unset NVSHMEM_DISABLE_CUDA_VMM; fi
                timeout --signal=INT "$per_run" "$py" -m hybrid_ep.testing.nvshmem_selftest --procs "$procs" \
                    --deadline $((per_run - 5)) --out "$results/nvshmem/$name" > "$results/nvshmem_$name.log" 2>&1
                rc=$?
                local log="$results/nvshmem_$name.log" why
                why=$(grep -m1 -E '^rank .*(failed|did not|differ|killed|stopped|wrote no)' "$log" || tail -1 "$log")
                echo "mps=$mps vmm=$vmm procs=$procs: exit $rc; $why" | tee -a "$summary"
                if [ "$rc" -eq 0 ]; then
                    if [ "$procs" = 2 ]; then worked2+=" $mps/$vmm"; else worked4+=" $mps/$vmm"; fi
                fi
            done
        done
        unset NVSHMEM_DISABLE_CUDA_VMM
        if [ "$mps" = on ]; then
            echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
            trap - EXIT
        fi
    done
    rm -rf "$CUDA_MPS_PIPE_DIRECTORY"
    say "worked with 2 PEs (mps/vmm):${worked2:- none}; with 4 PEs:${worked4:- none}"
    [ -n "$worked2" ] && [ -n "$worked4" ]
}

# The cuda backend across real processes: each one rank, nodes of one or two ranks joined by
# the NVSHMEM transport (hybrid_ep.testing.nvshmem_cases), every case against the oracle.
run_nvshmem_cases() {
    "$py" -c 'import hybrid_ep._C as c, sys; sys.exit(0 if c.has_nvshmem() else 1)' || {
        say "hybrid_ep._C was built without NVSHMEM (see build.log): nothing to run"; return 1; }
    say "dispatch + combine across NVSHMEM processes on the GPU (log: nvshmem_cases.log)"
    timeout --signal=INT "$budget" "$py" -m hybrid_ep.testing.nvshmem_cases --out "$results/nvshmem_cases" \
        --timeout 40 > "$results/nvshmem_cases.log" 2>&1
    local rc=$?
    say "exit $rc: $(tail -1 "$results/nvshmem_cases.log")"
    return "$rc"
}

machine_facts
build
case "$stage" in
    build) exit 0 ;;
    test) run_tests ;;
    sanitize) run_sanitizer "$@" ;;
    bench) run_bench ;;
    ncu) run_ncu ;;
    nvshmem) run_nvshmem ;;
    nvshmem-ep) run_nvshmem_cases ;;
esac
