#!/usr/bin/env bash
# The test command: lint, type-check, the test suite (bounded: slow soak/benchmark tests excluded), then the
# end-to-end tests in vLLM's CPU engine (tests/e2e, in .venv-e2e).
# Usage: bash scripts/test.sh [extra pytest args]     (KVTIER_FULL=1 also runs the slow tests;
#                                                      KVTIER_SKIP_E2E=1 leaves out the end-to-end tests)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "run 'bash scripts/bootstrap.sh --vllm --e2e' first" >&2; exit 2; }
E2E=0
[ "${KVTIER_SKIP_E2E:-0}" = 1 ] || E2E=1
if [ "$E2E" = 1 ] && [ ! -x .venv-e2e/bin/python ]; then
  echo "run 'bash scripts/bootstrap.sh --vllm --e2e' first (or KVTIER_SKIP_E2E=1)" >&2; exit 2
fi
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
echo "== ruff";  .venv/bin/ruff check kvtier tests benchmarks
echo "== mypy";  .venv/bin/mypy kvtier
marker=(-m "not slow")
[ "${KVTIER_FULL:-0}" = 1 ] && marker=()
echo "== pytest"
"$PY" -m pytest "${marker[@]}" -p no:cacheprovider -q -ra "$@"
if [ "$E2E" = 1 ]; then
  echo "== pytest tests/e2e (vLLM's CPU engine, one process per engine)"
  (unset VLLM_TARGET_DEVICE; KVTIER_E2E=1 exec .venv-e2e/bin/python -m pytest tests/e2e -p no:cacheprovider -q -ra)
fi
