#!/usr/bin/env bash
# The test command: lint, type-check, the test suite (bounded: slow soak/benchmark tests excluded; the vLLM
# integration tests on vLLM 0.33, then again on 0.34), then the end-to-end tests in vLLM's CPU engine (tests/e2e,
# in .venv-e2e).
# Usage: bash scripts/test.sh [extra pytest args]     (KVTIER_FULL=1 also runs the slow tests;
#                                                      KVTIER_SKIP_E2E=1 leaves out the end-to-end tests)
#        bash scripts/test.sh --check                 (only check the set-up: what is missing, and the fix)
# A .venv without vLLM (bootstrap without --vllm) skips the vLLM integration tests, and a missing .venv-e2e the
# end-to-end tests, each with a note saying so; KVTIER_REQUIRE_ALL=1 (CI) makes either an error instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
E2E=0
[ "${KVTIER_SKIP_E2E:-0}" = 1 ] || E2E=1
VLLM=1
VLLM034=1
REQUIRE=${KVTIER_REQUIRE_ALL:-0}

# Everything the tests need, checked before any of them runs: one line per missing thing, with its fix.
check_setup() {
  local missing
  if [ ! -x "$PY" ]; then
    echo "test.sh: error: no .venv: run 'bash scripts/bootstrap.sh --vllm --e2e' first" >&2; return 2
  fi
  missing=$("$PY" -c '
import importlib, importlib.util
out = []
for name in ("pytest", "ruff", "mypy", "importlinter", "torch", "redis"):
    if importlib.util.find_spec(name) is None:
        out.append(name)
        continue
    try:
        importlib.import_module(name)
    except Exception as exc:  # installed without its dependencies (vLLM from a bootstrap without the lock)
        out.append(f"{name} (fails to import: {exc})")
print(", ".join(out))' 2>/dev/null) || missing="a working python (.venv/bin/python fails to start)"
  if [ -n "$missing" ]; then
    echo "test.sh: error: .venv lacks $missing: run 'bash scripts/bootstrap.sh'" >&2
    return 2
  fi
  local why
  if ! why=$("$PY" -c 'import vllm' 2>&1); then
    why=${why##*$'\n'}  # the exception's own line
    if [ "$REQUIRE" = 1 ]; then
      echo "test.sh: error: .venv has no working vLLM ($why): run 'bash scripts/bootstrap.sh --vllm'" >&2; return 2
    fi
    echo "test.sh: note: .venv has no working vLLM ($why): the vLLM integration tests (tests/integration) are" \
         "skipped; 'bash scripts/bootstrap.sh --vllm' installs it" >&2
    VLLM=0
  fi
  if [ "$VLLM" = 1 ] && [ ! -f .venv/vllm-0.34/vllm/__init__.py ]; then
    if [ "$REQUIRE" = 1 ]; then
      echo "test.sh: error: no vLLM 0.34 in .venv/vllm-0.34: run 'bash scripts/bootstrap.sh --vllm'" >&2; return 2
    fi
    echo "test.sh: note: no vLLM 0.34 in .venv/vllm-0.34: the integration tests run on vLLM 0.33 only;" \
         "'bash scripts/bootstrap.sh --vllm' installs it" >&2
    VLLM034=0
  fi
  if [ "$E2E" = 1 ] && [ ! -x .venv-e2e/bin/python ]; then
    if [ "$REQUIRE" = 1 ]; then
      echo "test.sh: error: no .venv-e2e for tests/e2e: run 'bash scripts/bootstrap.sh --vllm --e2e'" >&2; return 2
    fi
    echo "test.sh: note: no .venv-e2e: the end-to-end tests (tests/e2e) are skipped; 'bash scripts/bootstrap.sh" \
         "--vllm --e2e' builds it" >&2
    E2E=0
  fi
  if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    echo "test.sh: warning: redis-server / redis-cli not on PATH: the Redis tests will skip (apt-get install redis-server)" >&2
  fi
  return 0
}

status=0
check_setup || status=$?
[ "$status" = 0 ] || exit "$status"
if [ "${1:-}" = --check ]; then
  echo "test.sh: set-up complete"; exit 0
fi
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
echo "== ruff";  .venv/bin/ruff check kvtier tests benchmarks
echo "== mypy";  .venv/bin/mypy kvtier
marker=(-m "not slow")
[ "${KVTIER_FULL:-0}" = 1 ] && marker=()
skip=()
[ "$VLLM" = 1 ] || skip=(--ignore=tests/integration)
echo "== pytest"
"$PY" -m pytest "${marker[@]}" "${skip[@]}" -p no:cacheprovider -q -ra --durations=15 "$@"
if [ "$VLLM" = 1 ] && [ "$VLLM034" = 1 ]; then
  echo "== pytest tests/integration on vLLM 0.34 (.venv/vllm-0.34 before 0.33)"
  PYTHONPATH="$PWD/.venv/vllm-0.34${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest tests/integration "${marker[@]}" \
    -p no:cacheprovider -q -ra --durations=5
fi
if [ "$E2E" = 1 ]; then
  # kvtier as a user installs it: the wheel built from this tree (a file the package leaves out fails these tests),
  # and PYTHONSAFEPATH so that no process of theirs imports the source tree from the working directory instead
  # (from a clean build: setuptools never removes from build/ a module deleted from the tree)
  echo "== kvtier's wheel into .venv-e2e"
  rm -rf .venv-e2e/dist build kvtier.egg-info
  .venv-e2e/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .venv-e2e/dist .
  .venv-e2e/bin/python -m pip install -q --no-deps --force-reinstall .venv-e2e/dist/kvtier-*.whl
  echo "== pytest tests/e2e (vLLM's CPU engine, one process per engine)"
  (unset VLLM_TARGET_DEVICE; KVTIER_E2E=1 PYTHONSAFEPATH=1 exec .venv-e2e/bin/python -m pytest tests/e2e \
    -p no:cacheprovider -q -ra --durations=0)
fi
