#!/usr/bin/env bash
# GPU checks of the cuda backend on a single-GPU machine exactly as it is: its own python3
# and the packages already installed, no network, no virtualenv, nothing installed. One
# command runs one stage or several (comma-separated, in order, building once) and ends
# inside GPU_CHECK_BUDGET_S seconds, build included; its logs go into RESULTS.
#
#   bash scripts/gpu_check.sh build    RESULTS   # hybrid_ep._C in place, sm_90a only (or the
#                                                #     carried one: scripts/prebuild_gpu.sh)
#   bash scripts/gpu_check.sh test     RESULTS   # (a) build + every GPU test
#   bash scripts/gpu_check.sh sanitize RESULTS [TOOL ...]   # (b) compute-sanitizer on small
#                                                #     emulated cases (memcheck racecheck synccheck)
#   bash scripts/gpu_check.sh bench    RESULTS   # (c) the emulated benchmark sweep
#   bash scripts/gpu_check.sh bench-dsv3 RESULTS # (c') the DeepSeek-V3-like layer, W=8 direct path:
#                                                #     4096 and 1024 tokens per rank, bf16 and fp8
#   bash scripts/gpu_check.sh ncu      RESULTS   # (d) ncu on dispatch and combine, seed shape
#   bash scripts/gpu_check.sh nvshmem  RESULTS   # (e) NVSHMEM transport, 2 and 4 PEs on the GPU,
#                                                #     without and with MPS (summary: nvshmem_summary.txt)
#   bash scripts/gpu_check.sh nvshmem-ep RESULTS # (f) dispatch + combine across 2-4 processes on the
#                                                #     GPU, nodes joined by NVSHMEM, against the oracle
#   bash scripts/gpu_check.sh micro    RESULTS   # (g) the microbenchmarks (csrc/microbench/): micro.json,
#                                                #     micro.txt; needs no hybrid_ep._C, builds none
#   bash scripts/gpu_check.sh ncu-l1tex RESULTS  # (h) ncu's L1TEX breakdown of dispatch and of two
#                                                #     microbenchmark copy patterns
#   bash scripts/gpu_check.sh racecheck-probe RESULTS  # (i) each case of csrc/tools/racecheck_probe.cu alone
#                                                #     under racecheck; needs no hybrid_ep._C, builds none
#   bash scripts/gpu_check.sh deepep   RESULTS   # (j) DeepEP beside hybrid-ep: 8 processes on the GPU
#                                                #     under MPS (the carried wheel, build/deepep/)
#   bash scripts/gpu_check.sh soak     RESULTS   # (k) 2000 pairs W=8 direct, 2000 receive, 500 as 2 nodes
#                                                #     of 4, oracle every 50 calls, memory recorded
#   bash scripts/gpu_check.sh processes RESULTS  # (l) W=8 ranks as 8 processes under MPS, no arena_bytes:
#                                                #     oracle, data path per call, GB/s/SM beside the
#                                                #     emulation's (plain and through peer memory), growth
#                                                #     time, held bytes; one node of 8 and two of 4 (NVSHMEM)
#   bash scripts/gpu_check.sh test,sanitize RESULTS   # several stages in one command
#
# Environment: PYTHON (default python3); HYBRID_EP_CUDA_ARCHS (default 90a);
# GPU_CHECK_BUDGET_S (seconds the whole command may take, build included, default 540: every
# stage's main command is cut, and killed 10 s later, so that packing ends inside it);
# HYBRID_EP_TIMEOUT_S (the kernels' wait bound, default 20 here: a hang costs 20 s, not 100);
# GPU_CHECK_PACK=1 (at the end, every file this command wrote goes into
# RESULTS/logs_<stages>.tgz beside RESULTS/gpu_check_summary.txt: for machines that return only
# a few files); GPU_CHECK_COMMIT (the commit being checked, for machine.txt; default: read
# from .git when the checkout has one); GPU_CHECK_MICRO (what the micro stage runs: the
# microbenchmark's arguments, default "all"); GPU_CHECK_PREBUILT (the carried build, default
# build/gpu-prebuilt); GPU_CHECK_DEEPEP_WHEEL (default build/deepep/deep_ep-*.whl);
# GPU_CHECK_PROCESSES_ARGS (the processes stage's points as hybrid_ep.bench.processes flags; default
# every layout the build serves, bf16 and fp8); GPU_CHECK_NCU_DTYPE (the ncu stage's rows, bf16 or
# fp8; default bf16); GPU_CHECK_NCU_SMS (the ncu stage's SMs per rank, default 1: the bench's point);
# GPU_CHECK_TEST_K (the test stage's tests: a pytest -k expression; default every GPU test).
set -uo pipefail

usage() {
    sed -n '7,34p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
[ $# -ge 2 ] || usage
IFS=, read -ra stages <<< "$1"
results=$2
shift 2
[ ${#stages[@]} -gt 0 ] || usage
for s in "${stages[@]}"; do
    case "$s" in
        build|test|sanitize|bench|bench-dsv3|ncu|nvshmem|nvshmem-ep|micro|ncu-l1tex|racecheck-probe|deepep|soak|processes) ;;
        *) echo "gpu_check: unknown stage '$s'" >&2; usage ;;
    esac
done
if [ $# -gt 0 ] && [[ " ${stages[*]} " != *" sanitize "* ]]; then
    echo "gpu_check: only the sanitize stage takes further arguments (tools), got: $*" >&2
    usage
fi
mkdir -p "$results" || { echo "gpu_check: can not create the results folder $results" >&2; exit 2; }
results=$(cd "$results" && pwd)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

py=${PYTHON:-python3}
budget=${GPU_CHECK_BUDGET_S:-540}
deadline=$((SECONDS + budget))
reserve=20  # seconds kept for the kill grace, the post-processing and packing
export PYTHONUNBUFFERED=1
export HYBRID_EP_CUDA_ARCHS=${HYBRID_EP_CUDA_ARCHS:-90a}
export HYBRID_EP_TIMEOUT_S=${HYBRID_EP_TIMEOUT_S:-20}
export PYTHONPATH="$repo:$repo/tests${PYTHONPATH:+:$PYTHONPATH}"  # tests/: the harnesses run as -m harness.<module>
summary="$results/gpu_check_summary.txt"
stamp=$(mktemp)  # files newer than this were written by this command
stage=setup
mps_started=""

say() { echo "gpu_check [$stage]: $*" | tee -a "$summary"; }
# Seconds the next command may run; never below 1.
left() { local n=$((deadline - SECONDS - reserve)); [ "$n" -ge 1 ] && echo "$n" || echo 1; }
# A command cut at $1 seconds: SIGINT first (pytest and Python write their logs), SIGKILL 10 s
# later (a process blocked in a CUDA call ignores SIGINT).
bounded() { local limit=$1; shift; timeout -k 10 --signal=INT "$limit" "$@"; }
# The last lines of a log, on stdout and in the summary.
show_tail() { tail -"$1" "$2" | tee -a "$summary"; }

commit_of_checkout() {
    if [ -n "${GPU_CHECK_COMMIT:-}" ]; then echo "$GPU_CHECK_COMMIT"; return; fi
    [ -f .git/HEAD ] || { echo "unknown (no .git here; pass GPU_CHECK_COMMIT)"; return; }
    local head ref
    head=$(cat .git/HEAD)
    case "$head" in
        "ref: "*) ref=${head#ref: }
                  cat ".git/$ref" 2>/dev/null || grep " $ref\$" .git/packed-refs 2>/dev/null | cut -d' ' -f1 ;;
        *) echo "$head" ;;
    esac
}

on_exit() {
    local rc=$?
    mps_stop
    if [ "${GPU_CHECK_PACK:-0}" = 1 ]; then
        local name files
        name="logs_$(IFS=-; echo "${stages[*]}").tgz"
        files=$(cd "$results" && find . -type f -newer "$stamp" ! -name gpu_check_summary.txt ! -name "$name" | sort)
        if [ -n "$files" ]; then
            (cd "$results" && echo "$files" | tar czf "$name" -T - && echo "$files" | xargs rm -f \
                && find . -mindepth 1 -type d -empty -delete)
            echo "gpu_check: packed $(echo "$files" | wc -l) files into $results/$name" | tee -a "$summary"
        fi
    fi
    rm -f "$stamp"
    exit "$rc"
}
trap on_exit EXIT

facts_py='import sys, torch; ok = torch.cuda.is_available(); print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "| device", torch.cuda.get_device_name(0) if ok else None)'

machine_facts() {
    {
        echo "date: $(date -Iseconds)"
        echo "commit: $(commit_of_checkout)"
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
        "$py" -c "$facts_py" 2>&1
        nvcc --version 2>&1 | tail -1
        echo "stages: ${stages[*]}; budget ${budget} s; HYBRID_EP_TIMEOUT_S=$HYBRID_EP_TIMEOUT_S"
    } > "$results/machine.txt"
    cat "$results/machine.txt" >> "$summary"
    echo "gpu_check: $(sed -n '2,4p' "$results/machine.txt" | tr '\n' ' ')"
}

# The extension is rebuilt when a source is newer than it or it was built for other archs.
archs_stamp=build/gpu_check_archs
extension_is_fresh() {
    local so
    so=$(ls hybrid_ep/_C*.so 2>/dev/null | head -1)
    [ -n "$so" ] || return 1
    [ "$(cat "$archs_stamp" 2>/dev/null)" = "$HYBRID_EP_CUDA_ARCHS" ] || return 1
    # (csrc/microbench/ and csrc/tools/ are not part of it)
    [ -z "$(find csrc setup.py scripts/find_nvshmem.py -newer "$so" -type f ! -path 'csrc/microbench/*' \
        ! -path 'csrc/tools/*' 2>/dev/null | head -1)" ]
}

# A build made ahead on another machine (scripts/prebuild_gpu.sh; GPU_CHECK_PREBUILT, default
# build/gpu-prebuilt) is used when its stamp fits this checkout and this machine's Python,
# torch and NVSHMEM (scripts/gpu_prebuilt.py check) and its extensions import; otherwise its
# files are taken away again and the extension is built here. build.log says which.
prebuilt=${GPU_CHECK_PREBUILT:-build/gpu-prebuilt}
use_prebuilt() {
    [ -d "$prebuilt" ] || { say "no carried build at $prebuilt: building here"; return 1; }
    local fits why so
    if ! fits=$("$py" scripts/gpu_prebuilt.py check "$prebuilt" --archs "$HYBRID_EP_CUDA_ARCHS" 2>&1); then
        say "the carried build at $prebuilt does not fit: ${fits##*$'\n'}; building here"
        return 1
    fi
    cp "$prebuilt"/hybrid_ep/*.so hybrid_ep/ || { say "copying the carried build failed: building here"; return 1; }
    if ! why=$("$py" -c 'import torch, hybrid_ep._C, hybrid_ep._model, hybrid_ep._planner' 2>&1); then
        say "the carried extensions do not load: ${why##*$'\n'}; building here"
        for so in "$prebuilt"/hybrid_ep/*.so; do rm -f "hybrid_ep/$(basename "$so")"; done
        return 1
    fi
    say "using the carried build ($prebuilt), not building: $fits"
    { echo "carried build from $prebuilt:"; cat "$prebuilt/stamp" "$prebuilt/build.log" 2>/dev/null; } > "$results/build.log"
    mkdir -p "$(dirname "$archs_stamp")" && echo "$HYBRID_EP_CUDA_ARCHS" > "$archs_stamp"
}

build() {
    if extension_is_fresh; then
        say "hybrid_ep._C is newer than its sources and built for sm_$HYBRID_EP_CUDA_ARCHS: not rebuilt"
    elif use_prebuilt; then
        :
    else
        local start=$SECONDS
        say "building hybrid_ep._C in place for sm_${HYBRID_EP_CUDA_ARCHS//;/, sm_} (log: build.log)"
        if ! bounded "$(left)" "$py" setup.py build_ext --inplace > "$results/build.log" 2>&1; then
            tail -30 "$results/build.log"
            say "build failed"
            exit 1
        fi
        mkdir -p "$(dirname "$archs_stamp")" && echo "$HYBRID_EP_CUDA_ARCHS" > "$archs_stamp"
        say "built in $((SECONDS - start)) s"
    fi
    "$py" -c 'import torch, hybrid_ep._C' || { say "hybrid_ep._C does not import"; exit 1; }
}

run_tests() {
    say "GPU tests${GPU_CHECK_TEST_K:+ -k '$GPU_CHECK_TEST_K'} (log: gpu_tests.log, at most $(left) s)"
    bounded "$(left)" "$py" -m pytest -m "gpu or multigpu" -v -rfEs -p no:cacheprovider --timeout=120 \
        --maxfail=10 --junitxml="$results/gpu_tests.xml" ${GPU_CHECK_TEST_K:+-k "$GPU_CHECK_TEST_K"} \
        tests/gpu/test_cuda_emulation.py tests/gpu/test_reference_nccl.py tests/unit/hybrid_ep/balancer/test_loop.py \
        tests/unit/hybrid_ep/backends/cuda/test_nvshmem_transport.py tests/unit/hybrid_ep/verify/test_oracle.py \
        tests/unit/hybrid_ep/backends/cuda/test_cuda_plan.py tests/gpu/test_cuda_arena.py \
        tests/gpu/test_launch_more_ranks.py tests/faults tests/unit/megatron_patches/test_te_grouped_rows.py \
        > "$results/gpu_tests.log" 2>&1
    local rc=$?
    say "pytest exit $rc: $(tail -1 "$results/gpu_tests.log")"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then  # -v names each test as it starts
        say "stopped at its time limit; the last test it started: $(grep -oE '^tests/[^ ]+::[^ ]+' \
            "$results/gpu_tests.log" | tail -1)"
    fi
    grep -E '^(FAILED|ERROR) ' "$results/gpu_tests.log" | head -20 | tee -a "$summary"
    return "$rc"
}

run_sanitizer() {
    local tools=("$@")
    [ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck synccheck)
    local tool rc worst=0 todo=${#tools[@]} per_tool
    for tool in "${tools[@]}"; do
        case "$tool" in memcheck|racecheck|synccheck|initcheck) ;;
            *) echo "gpu_check: unknown compute-sanitizer tool '$tool'" >&2; exit 2 ;; esac
    done
    : > "$results/sanitizer_summary.txt"
    # Each tool on both data paths: the direct one (emulation's own) and the receive one (that
    # of one process per GPU); the time left is shared among the runs not yet made.
    local path log
    todo=$((todo * 2))
    for tool in "${tools[@]}"; do
        for path in direct receive; do
            per_tool=$(( $(left) / todo ))
            todo=$((todo - 1))
            log=sanitizer_${tool}_$path.log
            say "compute-sanitizer --tool $tool, $path path (log: $log, at most $per_tool s)"
            HYBRID_EP_DATA_PATH=$path HYBRID_EP_TIMEOUT_S=60 bounded "$per_tool" compute-sanitizer --tool "$tool" \
                --error-exitcode 99 --print-limit 50 "$py" -m harness.emulated_check --preset small \
                --calls 1 > "$results/$log" 2>&1
            rc=$?
            # memcheck and synccheck end with "ERROR SUMMARY", racecheck with "RACECHECK SUMMARY"
            echo "$tool ($path): exit $rc; $(grep -hE '(ERROR|RACECHECK) SUMMARY' "$results/$log" | tail -1)" \
                | tee -a "$results/sanitizer_summary.txt" "$summary"
            [ "$rc" -gt "$worst" ] && worst=$rc
        done
    done
    return "$worst"
}

run_bench() {
    say "emulated benchmark: W=2 and W=8, 1 2 4 SMs per rank (log: bench.log, results: bench/)"
    local rc rc_nodes rc_nodes4
    bounded "$(left)" "$py" -m hybrid_ep.bench --emulate 2 8 --hidden 8192 --tokens 4096 --topk 8 \
        --experts 16 --dtype bf16 --sms 1 2 4 --out "$results/bench" > "$results/bench.log" 2>&1
    rc=$?
    show_tail 20 "$results/bench.log"
    # The same shape as 2 nodes of 4: the RDMA stage through the loopback transport, its rows
    # checked against the traffic model.
    say "emulated benchmark, W=8 as 2 nodes (log: bench_nodes.log, results: bench_nodes/)"
    bounded "$(left)" "$py" -m hybrid_ep.bench --emulate 8 --emulate-nodes 2 --hidden 8192 --tokens 4096 \
        --topk 8 --experts 16 --dtype bf16 --sms 1 2 4 --out "$results/bench_nodes" > "$results/bench_nodes.log" 2>&1
    rc_nodes=$?
    show_tail 12 "$results/bench_nodes.log"
    # And as 4 nodes of 2, where more of the traffic crosses nodes (RDMA bytes per SM).
    say "emulated benchmark, W=8 as 4 nodes (log: bench_nodes4.log, results: bench_nodes4/)"
    bounded "$(left)" "$py" -m hybrid_ep.bench --emulate 8 --emulate-nodes 4 --hidden 8192 --tokens 4096 \
        --topk 8 --experts 16 --dtype bf16 --sms 1 2 --out "$results/bench_nodes4" > "$results/bench_nodes4.log" 2>&1
    rc_nodes4=$?
    [ "$rc_nodes" -eq 0 ] && rc_nodes=$rc_nodes4
    show_tail 8 "$results/bench_nodes4.log"
    [ "$rc" -ne 0 ] && return "$rc"
    return "$rc_nodes"
}

# The shape users run: a DeepSeek-V3-like layer (H=7168, 256 experts, top-8), W=8 on the direct
# path, 4096 and 1024 tokens per rank, bf16 and fp8, 1 and 2 SMs per rank, default settings.
run_bench_dsv3() {
    local dtype tokens name rc=0
    for dtype in bf16 fp8; do
        for tokens in 4096 1024; do
            name=bench_dsv3_${dtype}_$tokens
            say "emulated benchmark, DeepSeek-V3-like, W=8, $tokens tokens per rank, $dtype (log: $name.log, results: $name/)"
            HYBRID_EP_DATA_PATH=direct bounded "$(left)" "$py" -m hybrid_ep.bench --emulate 8 --hidden 7168 \
                --tokens "$tokens" --topk 8 --experts 256 --dtype "$dtype" --sms 1 2 \
                --out "$results/$name" > "$results/$name.log" 2>&1 || rc=$?
            show_tail 6 "$results/$name.log"
        done
    done
    return "$rc"
}

# The kernels of each data path (HYBRID_EP_DATA_PATH; emulation takes the direct path unless
# told otherwise).
ncu_path=${HYBRID_EP_DATA_PATH:-direct}
ncu_dtype=${GPU_CHECK_NCU_DTYPE:-bf16}  # the dispatched rows' dtype (fp8: rows and their scales)
# SMs per rank: the bench's own point (its kernels at 1 SM per rank, the clocks it runs at: ncu's
# --clock-control none; ncu's default locks the base clock, 1.5 GHz on the H200 against 1.98)
ncu_sms=${GPU_CHECK_NCU_SMS:-1}
if [ "$ncu_path" = receive ]; then ncu_kernels=(dispatch_receive_kernel combine_receive_kernel)
else ncu_kernels=(dispatch_direct_kernel combine_direct_kernel); fi

run_ncu() {
    # Each call of emulated_check launches dispatch, combine, dispatch (handle reuse); skip the
    # first call's three and profile the second call's dispatch and combine.
    say "ncu on ${ncu_kernels[0]} and ${ncu_kernels[1]} ($ncu_path path), W=8 H=8192 T=4096 K=8 E=16 $ncu_dtype," \
        "$ncu_sms SM(s) per rank, the GPU's own clocks (log: ncu.log)"
    HYBRID_EP_DATA_PATH=$ncu_path bounded "$(( $(left) - 40 > 30 ? $(left) - 40 : 30 ))" ncu --target-processes all \
        --clock-control none \
        --kernel-name "regex:${ncu_kernels[0]}|${ncu_kernels[1]}" \
        --launch-skip 3 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats \
        --section SourceCounters --export "$results/ncu" --force-overwrite \
        "$py" -m harness.emulated_check -w 8 --hidden 8192 --tokens 4096 --topk 8 --experts 16 \
        --dtype "$ncu_dtype" --sms "$ncu_sms" --calls 2 --no-check > "$results/ncu.log" 2>&1
    local rc=$?
    if [ -f "$results/ncu.ncu-rep" ]; then  # the post-processing has the 40 s kept above
        bounded "$(left)" ncu --import "$results/ncu.ncu-rep" --page details > "$results/ncu_details.txt" 2>&1
        bounded "$(left)" ncu --import "$results/ncu.ncu-rep" --page details --csv > "$results/ncu_details.csv" 2>&1
        # per-SASS-instruction stall samples (SourceCounters), one table per kernel
        local k
        for k in "${ncu_kernels[@]}"; do
            bounded "$(left)" ncu --import "$results/ncu.ncu-rep" --page source --csv --print-source sass \
                --kernel-name "regex:$k" > "$results/ncu_source_$k.csv" 2>&1
            # the same summed per source line (the build has -lineinfo)
            bounded "$(left)" ncu --import "$results/ncu.ncu-rep" --page source --csv --print-source cuda,sass \
                --kernel-name "regex:$k" > "$results/ncu_source_lines.tmp" 2>&1
            "$py" scripts/ncu_lines.py "$results/ncu_source_lines.tmp" > "$results/ncu_lines_$k.txt" 2>&1
            show_tail 6 "$results/ncu_lines_$k.txt" > /dev/null
        done
        rm -f "$results/ncu_source_lines.tmp"
    fi
    show_tail 5 "$results/ncu.log"
    return "$rc"
}

# The microbenchmarks (csrc/microbench/, built by scripts/build_microbench.sh into build/), rebuilt
# when a source under csrc/ or the build script is newer than the executable.
micro_bin=build/microbench/hybrid_ep_microbench
build_micro() {
    if [ -x "$micro_bin" ] && [ -z "$(find csrc scripts/build_microbench.sh -newer "$micro_bin" -type f | head -1)" ]; then
        say "$micro_bin is newer than its sources: not rebuilt"
        return 0
    fi
    local start=$SECONDS
    say "building the microbenchmarks (log: micro_build.log)"
    if ! bounded "$(left)" bash scripts/build_microbench.sh build/microbench > "$results/micro_build.log" 2>&1; then
        show_tail 20 "$results/micro_build.log"
        say "microbenchmark build failed"
        return 1
    fi
    say "built in $((SECONDS - start)) s"
}

# Every measurement (or GPU_CHECK_MICRO's) as JSON lines, then micro.json (metadata block, every
# line, the constants), micro.txt (the constants, also in the summary) and micro_tma.png.
run_micro() {
    build_micro || return 1
    local args=${GPU_CHECK_MICRO:-all} rc
    say "microbenchmarks: hybrid_ep_microbench $args (lines: micro.jsonl, log: micro.log, at most $(left) s)"
    # shellcheck disable=SC2086
    bounded "$(left)" "$micro_bin" $args > "$results/micro.jsonl" 2> "$results/micro.log"
    rc=$?
    say "microbench exit $rc: $(tail -1 "$results/micro.log")"
    if "$py" -m tools.microbench "$results/micro.jsonl" --out "$results" --command "hybrid_ep_microbench $args" \
        --commit "$(commit_of_checkout)" > "$results/micro_report.log" 2>&1; then
        tee -a "$summary" < "$results/micro.txt"
    else
        say "micro.json not written: $(tail -1 "$results/micro_report.log")"
        [ "$rc" -eq 0 ] && rc=1
    fi
    return "$rc"
}

# ncu's breakdown of L1TEX throughput into its sub-units, and the bytes L1TEX wrote to and read
# from the crossbar per cycle (M8 in docs/benchmarks/cuda.md: which sub-unit is busy when
# dispatch's L1/TEX throughput reads 77-95%): the direct path's dispatch at W=8 and W=2 on 1 SM
# per rank (the headline; 94.9% on the 2026-11-26 H200 at W=8, 8 SMs per rank, while its stores
# ran at half the microbenchmarks' rate) and the receive path's at W=8 on 8 (the one measured
# on 2026-11-24), then the microbenchmark's copy patterns (tma-profile: store-only, one load
# with two stores and one load with eight stores per stage). Beside the rates, the counts: the
# request path's busy cycles and bytes, the plain global stores, loads, reductions and atomics
# (requests and sectors), the duration and the SM clock, so that a kernel's request cycles per
# token are counted by kind (docs/dev/request_path.md), and the fp8 dispatch, whose scales the
# route table stores.
l1tex_metrics="breakdown:l1tex__throughput.avg.pct_of_peak_sustained_active"
l1tex_metrics+=",l1tex__m_l1tex2xbar_write_bytes.sum.per_cycle_active,l1tex__m_xbar2l1tex_read_bytes.sum.per_cycle_active"
l1tex_metrics+=",l1tex__m_l1tex2xbar_req_cycles_active.sum,l1tex__m_l1tex2xbar_write_bytes.sum"
l1tex_metrics+=",l1tex__m_xbar2l1tex_read_bytes.sum,l1tex__cycles_active.sum"
for op in st ld red atom; do
    l1tex_metrics+=",l1tex__t_requests_pipe_lsu_mem_global_op_$op.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_$op.sum"
done
l1tex_metrics+=",gpu__time_duration.sum,sm__cycles_elapsed.max"
l1tex_dispatches=(
    "direct_w8_1sm|direct|dispatch_direct_kernel|-w 8 --sms 1 --tokens 4096"
    "direct_w8_1sm_fp8|direct|dispatch_direct_kernel|-w 8 --sms 1 --tokens 4096 --dtype fp8"
    "direct_w2_1sm|direct|dispatch_direct_kernel|-w 2 --sms 1 --tokens 2048"
    "w8_8sm|receive|dispatch_receive_kernel|-w 8 --sms 8 --tokens 4096"
)
run_ncu_l1tex() {
    local rc=0 one entry name path kernel shape
    # each emulated_check call launches dispatch twice (the second reuses the handle): profile the
    # second call's first
    for entry in "${l1tex_dispatches[@]}"; do
        IFS='|' read -r name path kernel shape <<< "$entry"
        say "ncu L1TEX breakdown of $kernel, $shape (ncu_l1tex_dispatch_$name.txt)"
        # shellcheck disable=SC2086
        HYBRID_EP_DATA_PATH=$path bounded "$(( $(left) / 4 > 30 ? $(left) / 4 : 30 ))" ncu --target-processes all \
            --kernel-name "regex:$kernel" --launch-skip 2 --launch-count 1 --metrics "$l1tex_metrics" \
            "$py" -m harness.emulated_check $shape --hidden 8192 --topk 8 --experts 16 --calls 2 \
            --no-check > "$results/ncu_l1tex_dispatch_$name.txt" 2>&1
        one=$?
        [ "$one" -gt "$rc" ] && rc=$one
        show_tail 3 "$results/ncu_l1tex_dispatch_$name.txt"
    done
    if build_micro; then
        say "ncu L1TEX breakdown of hybrid_ep_microbench tma-profile (ncu_l1tex_tma.txt)"
        bounded "$(left)" ncu --kernel-name regex:tma_kernel --metrics "$l1tex_metrics" "$micro_bin" tma-profile \
            > "$results/ncu_l1tex_tma.txt" 2>&1
        one=$?
        [ "$one" -gt "$rc" ] && rc=$one
        show_tail 3 "$results/ncu_l1tex_tma.txt"
    else
        [ "$rc" -lt 1 ] && rc=1
    fi
    return "$rc"
}

# The racecheck probe (csrc/tools/racecheck_probe.cu, docs/benchmarks/racecheck.md), built by
# scripts/build_racecheck_probe.sh into build/, rebuilt when a source under csrc/ or the build
# script is newer. Each of its cases runs alone under racecheck (racecheck_probe_<case>.log; the
# time left is shared among the cases not yet run), and racecheck_probe_summary.txt has a line
# per case: the hazards racecheck reported, what the PTX memory model expects (0 for an ordered
# case, > 0 for a racy one) and the verdict. The stage fails when a control case comes out
# wrong (the __syncthreads one flagged, the racy one not), a value read was wrong, or a run
# failed; an ordered case flagged is the finding, not a failure. Then, while time is left, each
# ordered case that was flagged runs again with --racecheck-trace-sync yes
# (racecheck_probe_<case>_trace.log: the synchronisation operations racecheck saw).
probe_bin=build/racecheck_probe/racecheck_probe
run_racecheck_probe() {
    if [ -x "$probe_bin" ] && [ -z "$(find csrc scripts/build_racecheck_probe.sh -newer "$probe_bin" -type f \
        | head -1)" ]; then
        say "$probe_bin is newer than its sources: not rebuilt"
    elif ! bounded "$(left)" bash scripts/build_racecheck_probe.sh build/racecheck_probe \
        > "$results/racecheck_probe_build.log" 2>&1; then
        show_tail 20 "$results/racecheck_probe_build.log"
        say "racecheck probe build failed"
        return 1
    fi
    local cases line name ordered role rc hazards expected verdict log todo per_case worst=0 flagged=()
    mapfile -t cases < <("$probe_bin" --list)
    [ ${#cases[@]} -gt 0 ] || { say "racecheck_probe --list named no case"; return 1; }
    local table="$results/racecheck_probe_summary.txt"
    printf '%-24s %-8s %-9s %s\n' case hazards expected verdict > "$table"
    todo=${#cases[@]}
    for line in "${cases[@]}"; do
        IFS=$'\t' read -r name ordered role _ <<< "$line"
        log=racecheck_probe_$name.log
        per_case=$(( $(left) / todo ))
        [ "$per_case" -ge 1 ] || per_case=1
        bounded "$per_case" compute-sanitizer --tool racecheck --error-exitcode 99 --print-limit 50 \
            "$probe_bin" "$name" > "$results/$log" 2>&1
        rc=$?
        todo=$((todo - 1))
        hazards=$(grep -oE 'RACECHECK SUMMARY: [0-9]+ hazard' "$results/$log" | grep -oE '[0-9]+' | tail -1)
        expected=0
        [ "$ordered" = racy ] && expected=">0"
        if [ -z "$hazards" ] || { [ "$rc" -ne 0 ] && [ "$rc" -ne 99 ]; } \
            || ! grep -q "racecheck_probe: $name: .*every value read was right" "$results/$log"; then
            verdict="FAILED: exit $rc; $(grep -m1 "racecheck_probe: $name:" "$results/$log" || tail -1 "$results/$log")"
            hazards=${hazards:--}
        elif [ "$ordered" = racy ]; then
            if [ "$hazards" -gt 0 ]; then verdict="flagged: racy"; else verdict="FAILED: racecheck missed the race"; fi
        elif [ "$hazards" -eq 0 ]; then
            verdict="clean"
        elif [ "$role" = control ]; then
            verdict="FAILED: racecheck flags what __syncthreads orders"
        else
            verdict="flagged although ordered: a limit of racecheck"
        fi
        printf '%-24s %-8s %-9s %s\n' "$name" "$hazards" "$expected" "$verdict" >> "$table"
        [[ "$verdict" == FAILED* ]] && worst=1
        [[ "$verdict" == "flagged although"* ]] && flagged+=("$name")
    done
    tee -a "$summary" < "$table"
    todo=${#flagged[@]}
    for name in "${flagged[@]}"; do
        per_case=$(( $(left) / todo ))
        todo=$((todo - 1))
        [ "$per_case" -ge 5 ] || { say "no time left to trace $name's synchronisation"; continue; }
        bounded "$per_case" compute-sanitizer --tool racecheck --racecheck-trace-sync yes --print-limit 50 \
            "$probe_bin" "$name" > "$results/racecheck_probe_${name}_trace.log" 2>&1
        say "$name with --racecheck-trace-sync yes: exit $?, racecheck_probe_${name}_trace.log"
    done
    return "$worst"
}

# The MPS daemon, for processes that share the GPU and wait on each other's kernels. Its pipe
# folder is in /tmp (the daemon's socket path must stay short: a Unix socket name) and the same
# for its clients; its logs go under RESULTS/mps/.
mps_folders() {
    CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/hybrid-ep-mps.XXXXXX)
    export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY="$results/mps/log"
    mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
}
# Start the daemon (mps_folders first); fails with its output in RESULTS/mps/start.log.
mps_start() {
    nvidia-cuda-mps-control -d > "$results/mps/start.log" 2>&1 || return 1
    mps_started=1
    sleep 1
}
mps_stop() {
    if [ -n "$mps_started" ]; then echo quit | nvidia-cuda-mps-control > /dev/null 2>&1; fi
    mps_started=""
}

# Several processes on the one GPU, each one NVSHMEM PE (harness.nvshmem_selftest):
# without MPS (NVSHMEM's limited support of several PEs per GPU) and with the MPS daemon
# started here (full support), each with NVSHMEM's default CUDA VMM heap and with
# NVSHMEM_DISABLE_CUDA_VMM=1. Every combination is logged; the stage passes when some
# combination works for both 2 and 4 PEs.
# Whether hybrid_ep._C was built with the NVSHMEM transport (torch first: the extension needs it).
has_nvshmem() { "$py" -c 'import torch, hybrid_ep._C as c, sys; sys.exit(0 if c.has_nvshmem() else 1)'; }
NVSHMEM_RUN_MIN_S=${NVSHMEM_RUN_MIN_S:-20}  # the least one self-test run gets
run_nvshmem() {
    has_nvshmem || {
        say "hybrid_ep._C was built without NVSHMEM (see build.log): nothing to run"; return 1; }
    local todo=8 per_run mps vmm procs rc name worked2="" worked4=""
    local nv_summary="$results/nvshmem_summary.txt"
    : > "$nv_summary"
    mps_folders
    for mps in off on; do
        if [ "$mps" = on ] && ! mps_start; then
            echo "mps=on: nvidia-cuda-mps-control -d failed: $(tail -1 "$results/mps/start.log")" \
                | tee -a "$nv_summary" "$summary"
            break
        fi
        for vmm in default off; do
            for procs in 2 4; do
                name="mps-${mps}_vmm-${vmm}_p${procs}"
                # each run its share, but never under NVSHMEM_RUN_MIN_S (a process start and
                # NVSHMEM's init take seconds; the 2026-11-27 run's 60 s gave 8 runs 2-3 s each,
                # and none finished): the later ones are not run instead
                per_run=$(( $(left) / todo ))
                todo=$((todo - 1))
                if [ "$per_run" -lt "$NVSHMEM_RUN_MIN_S" ]; then
                    if [ "$(left)" -lt "$NVSHMEM_RUN_MIN_S" ]; then
                        echo "mps=$mps vmm=$vmm procs=$procs: not run ($(left) s left)" | tee -a "$nv_summary" "$summary"
                        continue
                    fi
                    per_run=$NVSHMEM_RUN_MIN_S
                fi
                say "NVSHMEM self-test, $procs PEs, MPS $mps, CUDA VMM heap $vmm (log: nvshmem_$name.log, at most $per_run s)"
                if [ "$vmm" = off ]; then export NVSHMEM_DISABLE_CUDA_VMM=1; else unset NVSHMEM_DISABLE_CUDA_VMM; fi
                bounded "$per_run" "$py" -m harness.nvshmem_selftest --procs "$procs" \
                    --deadline $((per_run > 10 ? per_run - 5 : 5)) --out "$results/nvshmem/$name" \
                    > "$results/nvshmem_$name.log" 2>&1
                rc=$?
                local log="$results/nvshmem_$name.log" why
                why=$(grep -m1 -E '^rank .*(failed|did not|differ|killed|stopped|wrote no)' "$log" || tail -1 "$log")
                echo "mps=$mps vmm=$vmm procs=$procs: exit $rc; $why" | tee -a "$nv_summary" "$summary"
                if [ "$rc" -eq 0 ]; then
                    if [ "$procs" = 2 ]; then worked2+=" $mps/$vmm"; else worked4+=" $mps/$vmm"; fi
                fi
            done
        done
        unset NVSHMEM_DISABLE_CUDA_VMM
        mps_stop
    done
    rm -rf "$CUDA_MPS_PIPE_DIRECTORY"
    say "worked with 2 PEs (mps/vmm):${worked2:- none}; with 4 PEs:${worked4:- none}"
    [ -n "$worked2" ] && [ -n "$worked4" ]
}

# The cuda backend across real processes: each one rank, nodes of one or two ranks joined by
# the NVSHMEM transport (harness.nvshmem_cases), every case against the oracle.
run_nvshmem_cases() {
    has_nvshmem || {
        say "hybrid_ep._C was built without NVSHMEM (see build.log): nothing to run"; return 1; }
    say "dispatch + combine across NVSHMEM processes on the GPU (log: nvshmem_cases.log)"
    bounded "$(left)" "$py" -m harness.nvshmem_cases --out "$results/nvshmem_cases" \
        --timeout "$HYBRID_EP_TIMEOUT_S" > "$results/nvshmem_cases.log" 2>&1
    local rc=$?
    say "exit $rc: $(tail -1 "$results/nvshmem_cases.log")"
    return "$rc"
}

# DeepEP beside hybrid-ep (docs/benchmarks/README.md, "DeepEP beside hybrid-ep"): the bench's
# W = 8 ranks as 8 processes on the one GPU under the MPS daemon, hybrid-ep's cuda backend (its
# path for one process per rank) and DeepEP's intranode kernels at the seed shape on 2 and 8 SMs
# per rank, in one table and results.json (bench_deepep/). DeepEP is the carried wheel
# (scripts/build_deepep_wheel.sh; GPU_CHECK_DEEPEP_WHEEL, default build/deepep/deep_ep-*.whl),
# unpacked into a temporary folder on PYTHONPATH; without it the bench runs hybrid-ep alone and
# says why DeepEP did not run.
run_deepep() {
    local wheel unpacked rc
    wheel=$(ls ${GPU_CHECK_DEEPEP_WHEEL:-build/deepep/deep_ep-*.whl} 2>/dev/null | head -1)
    unpacked=$(mktemp -d)
    if [ -n "$wheel" ] && "$py" -m zipfile -e "$wheel" "$unpacked"; then
        say "DeepEP from $wheel"
    else
        say "no DeepEP wheel at ${GPU_CHECK_DEEPEP_WHEEL:-build/deepep/deep_ep-*.whl}: hybrid-ep alone"
    fi
    mps_folders
    mps_start || { say "nvidia-cuda-mps-control -d failed: $(tail -1 "$results/mps/start.log")"; return 1; }
    say "8 processes on the GPU under MPS, cuda and deepep (log: bench_deepep.log, at most $(left) s)"
    PYTHONPATH="$unpacked:$PYTHONPATH" bounded "$(left)" "$py" -m hybrid_ep.bench --device cuda -w 8 \
        --backends cuda deepep --hidden 8192 --tokens 4096 --topk 8 --experts 16 --dtype bf16 --sms 2 8 \
        --warmup 5 --iters 20 --out "$results/bench_deepep" > "$results/bench_deepep.log" 2>&1
    rc=$?
    mps_stop
    rm -rf "$unpacked" "$CUDA_MPS_PIPE_DIRECTORY"
    say "exit $rc$(grep -m1 -oE 'deepep: not run: .*' "$results/bench_deepep.log" | sed 's/^/; /')"
    show_tail 3 "$results/bench_deepep.log" > /dev/null
    return "$rc"
}

# Many calls (harness.soak): fresh routing every call, the oracle every 50 calls, device
# memory and host RSS at each check. First W=8 as 8 processes under MPS, each one rank with its
# buffer kept for the whole soak, as a training job runs (the direct path after peer memory grew);
# then on one emulated group, W=8 on the receive path and as 2 nodes of 4 (direct across nodes).
# Each run gets its share of what is left, the processes half of it, and stops itself 10 s before
# its share ends (exit 3: fewer calls than asked, recorded in its soak.json).
run_soak() {
    local spec path per_node calls share rc worst_soak=0 runs_left=3 mode
    mps_folders
    mps_start || { say "nvidia-cuda-mps-control -d failed: the processes take turns"; unset CUDA_MPS_PIPE_DIRECTORY; }
    for spec in "processes 8 2000" "receive 8 2000" "direct 4 500"; do
        read -r path per_node calls <<< "$spec"
        share=$(( $(left) / runs_left )); runs_left=$((runs_left - 1))
        [ "$path" = processes ] && share=$(( $(left) / 2 ))
        local name="soak_${path}_g${per_node}"
        mode=(--data-path "$path")
        [ "$path" = processes ] && mode=(--processes --timeout-s "$HYBRID_EP_TIMEOUT_S")
        say "W=8, $per_node ranks per node, $path, $calls calls (log: $name.log, at most $share s)"
        bounded "$share" "$py" -m harness.soak -w 8 --ranks-per-node "$per_node" "${mode[@]}" \
            --calls "$calls" --check-every 50 --budget-s $((share > 20 ? share - 10 : share)) \
            --out "$results/$name" > "$results/$name.log" 2>&1
        rc=$?
        say "exit $rc: $(tail -1 "$results/$name.log")"
        [ "$rc" -gt "$worst_soak" ] && worst_soak=$rc
    done
    mps_stop
    rm -rf "${CUDA_MPS_PIPE_DIRECTORY:-/nonexistent}"
    return "$worst_soak"
}

# One process per rank on the GPU, under the MPS daemon started here (the processes' kernels then
# run side by side): hybrid_ep.bench.processes, one node of 8 and two nodes of 4 (NVSHMEM
# between them where the build has it), then the emulation of the same shapes, plain and through
# peer memory.
run_processes() {
    local nodes="1" rc
    has_nvshmem && nodes="1 2"
    mps_folders
    if ! mps_start; then
        say "nvidia-cuda-mps-control -d failed ($(tail -1 "$results/mps/start.log")): the processes take turns"
        unset CUDA_MPS_PIPE_DIRECTORY
    fi
    # the points: GPU_CHECK_PROCESSES_ARGS (the bench's flags) where given, else every layout, bf16 and fp8
    local points="--nodes $nodes --dtypes bf16 fp8"
    [ -n "${GPU_CHECK_PROCESSES_ARGS:-}" ] && points=$GPU_CHECK_PROCESSES_ARGS
    say "8 processes, $points (log: processes.log, JSON: processes/processes.json)"
    # shellcheck disable=SC2086
    bounded "$(left)" "$py" -m hybrid_ep.bench.processes --out "$results/processes" $points \
        --timeout "$HYBRID_EP_TIMEOUT_S" > "$results/processes.log" 2>&1
    rc=$?
    grep '^processes ' "$results/processes.log" | tee -a "$summary"
    mps_stop
    rm -rf "${CUDA_MPS_PIPE_DIRECTORY:-/nonexistent}"
    say "exit $rc"
    return "$rc"
}

machine_facts
stage=build
needs_extension=""
for s in "${stages[@]}"; do [ "$s" != micro ] && [ "$s" != racecheck-probe ] && needs_extension=1; done
if [ -n "$needs_extension" ]; then
    build
else
    say "the ${stages[*]// /, } stage needs no hybrid_ep._C: not built"
fi
worst=0
for stage in "${stages[@]}"; do
    if [ "$stage" != build ] && [ $((deadline - SECONDS - reserve)) -lt 5 ]; then
        say "not run: $((deadline - SECONDS)) s of the ${budget} s budget left"
        [ "$worst" -lt 124 ] && worst=124
        continue
    fi
    case "$stage" in
        build) rc=0 ;;
        test) run_tests; rc=$? ;;
        sanitize) run_sanitizer "$@"; rc=$? ;;
        bench) run_bench; rc=$? ;;
        bench-dsv3) run_bench_dsv3; rc=$? ;;
        ncu) run_ncu; rc=$? ;;
        nvshmem) run_nvshmem; rc=$? ;;
        nvshmem-ep) run_nvshmem_cases; rc=$? ;;
        micro) run_micro; rc=$? ;;
        ncu-l1tex) run_ncu_l1tex; rc=$? ;;
        racecheck-probe) run_racecheck_probe; rc=$? ;;
        deepep) run_deepep; rc=$? ;;
        soak) run_soak; rc=$? ;;
        processes) run_processes; rc=$? ;;
    esac
    [ "$rc" -gt "$worst" ] && worst=$rc
done
exit "$worst"
