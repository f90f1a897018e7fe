#!/usr/bin/env bash
# The main job (README): a tiny MoE GPT (Megatron-Core GPTModel, 2 layers, hidden 128,
# 8 experts, top-2) trained for 30 steps with expert parallelism on 4 processes as 2 nodes
# x 2 ranks, through the hybrid_ep token dispatcher and, for comparison, Megatron's
# alltoall dispatcher. CPU (gloo) here; with 4 GPUs the same command runs on them.
# Per step, printed as it ends: loss, tokens/s, expert-load imbalance per layer, dispatch bytes
# over NVLink and RDMA; JSON and a PNG of both loss and tokens/s curves under results/demo/.
# Extra arguments go to `python -m megatron_patches.local.demo` (a bad one: status 2 and a message).
# The dispatch/combine benchmark demo is scripts/bench_demo.sh.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$repo/scripts/env.sh")
cd "$repo"
export PYTHONWARNINGS=ignore
exec "$py" -m megatron_patches.local.demo --world-size 4 --ranks-per-node 2 --steps 30 --out results/demo "$@"
