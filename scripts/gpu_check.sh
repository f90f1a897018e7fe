#!/usr/bin/env bash
# One call on a lent GPU: build hybrid_ep._C (timed), run the GPU tests, then the emulated
# benchmark at the seed configuration. Logs and results go to $OUT (default results/gpu-check).
#   bash scripts/gpu_check.sh            # everything
#   SKIP_BENCH=1 bash scripts/gpu_check.sh
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:-$repo/results/gpu-check}
mkdir -p "$out"
cd "$repo"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
start=$(date +%s)
py=$(bash scripts/env.sh 2> "$out/build.log") || { tail -40 "$out/build.log"; exit 1; }
echo "build + env: $(( $(date +%s) - start )) s" | tee "$out/build_time.txt"
"$py" -c "import hybrid_ep._C" || exit 1
"$py" -m pytest -m "gpu or multigpu" -rA --timeout=600 tests/test_cuda_emulation.py tests/test_reference_nccl.py \
    > "$out/gpu_tests.log" 2>&1
echo "gpu tests exit $?; $(tail -1 "$out/gpu_tests.log")"
if [ -z "${SKIP_BENCH:-}" ]; then
    "$py" -m hybrid_ep.bench --emulate 8 --hidden 8192 --tokens 4096 --topk 8 --experts 16 --dtype bf16 \
        --sms 1 2 4 8 16 --out "$out/bench" > "$out/bench.log" 2>&1
    echo "bench exit $?"; tail -15 "$out/bench.log"
fi
