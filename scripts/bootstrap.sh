#!/usr/bin/env bash
# Create .venv with CPU torch, kvtier (editable, dev extras) and, with --vllm, vLLM 0.33 for integration tests.
# Usage: bash scripts/bootstrap.sh [--vllm]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WITH_VLLM=0
[ "${1:-}" = "--vllm" ] && WITH_VLLM=1
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# Torch first, pinned: a bare 'torch' requirement could pull a newer multi-GB CUDA build. Where a CPU wheel of
# 2.13.0 is on pip's find-links (as on the CI machines) pip takes it; elsewhere point PIP_EXTRA_INDEX_URL at a
# CPU wheel index to avoid the CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q 'torch==2.13.0'
fi
echo 'torch==2.13.0' > .venv/torch-pin.txt
if [ "$WITH_VLLM" = 1 ] && ! .venv/bin/python -c "import vllm" 2>/dev/null; then
  LOCK=../shared/reference/vllm-0.33-cpu-deps.lock.txt
  if [ -f "$LOCK" ]; then
    grep -v '^torch==' "$LOCK" > .venv/vllm-deps.txt
    $PIP install -q -c .venv/torch-pin.txt -r .venv/vllm-deps.txt
  fi
  $PIP install -q --no-deps 'vllm==0.33.0'
fi
$PIP install -q -c .venv/torch-pin.txt -e '.[dev]'
echo "bootstrap: $(.venv/bin/python -c 'import torch,sys; print("python", sys.version.split()[0], "torch", torch.__version__)')"
