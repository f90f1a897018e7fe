#!/usr/bin/env bash
# The test command (README, CI): environment, nvcc compile check of csrc/, then pytest.
# Extra arguments go to pytest. "No tests collected" (pytest exit 5) is a failure.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=$(bash "$repo/scripts/env.sh")
PYTHON="$py" bash "$repo/scripts/compile_csrc.sh"
cd "$repo"
set +e
"$py" -m pytest --timeout=600 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "test.sh: pytest collected no tests; that is a failure" >&2; exit 1; fi
exit "$rc"
