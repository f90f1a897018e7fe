#!/usr/bin/env bash
# The dispatch/combine benchmark demo on 4 CPU processes as 2 nodes x 2
# ranks with the reference backend; table on stdout, JSON and PNG under results/demo/.
# Extra arguments go to `python -m hybrid_ep.bench`.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$repo/scripts/env.sh")
cd "$repo"
exec "$py" -m hybrid_ep.bench --world-size 4 --ranks-per-node 2 --backends reference --out results/demo "$@"
