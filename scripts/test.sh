#!/usr/bin/env bash
# The test command: lint, type-check, then the test suite (bounded: slow soak/benchmark tests excluded).
# Usage: bash scripts/test.sh [extra pytest args]     (KVTIER_FULL=1 also runs the slow tests)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "run 'bash scripts/bootstrap.sh --vllm' first" >&2; exit 2; }
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
echo "== ruff";  .venv/bin/ruff check kvtier tests benchmarks
echo "== mypy";  .venv/bin/mypy kvtier
marker=(-m "not slow")
[ "${KVTIER_FULL:-0}" = 1 ] && marker=()
echo "== pytest"
exec "$PY" -m pytest "${marker[@]}" -p no:cacheprovider -q -ra "$@"
