"""scripts/bootstrap.sh and scripts/test.sh on a newcomer's checkout: a missing piece is one line naming it and
the fix, before anything is installed or run. Each test runs the real script in a copy of the repository layout
in a temporary directory (no ../shared there); nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASH = shutil.which("bash") or "/bin/bash"


def _layout(tmp_path: Path, script: str) -> Path:
    """tmp/repo/scripts/<script>, beside no shared/ directory."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / script, repo / "scripts" / script)
    return repo


def _run(repo: Path, script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    full.update(env or {})
    return subprocess.run([BASH, str(repo / "scripts" / script), *args], capture_output=True, text=True,
                          env=full, timeout=120, check=False)


def test_bootstrap_vllm_without_the_lock_fails_before_installing(tmp_path: Path) -> None:
    repo = _layout(tmp_path, "bootstrap.sh")
    # PYTHON=false: were the check missing, creating .venv would fail (rc 1) instead of installing anything
    proc = _run(repo, "bootstrap.sh", "--vllm", env={"PYTHON": "false"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("bootstrap: error: --vllm needs the dependency lock "
                               "../shared/reference/vllm-0.33-cpu-deps.lock.txt, which is absent")
    assert "KVTIER_VLLM_LOCK=FILE" in lines[0] and "without --vllm" in lines[0]
    assert not (repo / ".venv").exists() and proc.stdout == ""


def test_bootstrap_names_a_missing_lock_given_by_the_environment(tmp_path: Path) -> None:
    repo = _layout(tmp_path, "bootstrap.sh")
    lock = tmp_path / "elsewhere.lock.txt"
    proc = _run(repo, "bootstrap.sh", "--vllm", "--e2e", env={"PYTHON": "false", "KVTIER_VLLM_LOCK": str(lock)})
    assert proc.returncode == 2 and f"the dependency lock {lock}, which is absent" in proc.stderr


def test_bootstrap_with_the_lock_goes_on_to_create_the_venv(tmp_path: Path) -> None:
    repo = _layout(tmp_path, "bootstrap.sh")
    lock = tmp_path / "deps.lock.txt"
    lock.write_text("idna==3.10\n")
    proc = _run(repo, "bootstrap.sh", "--vllm", env={"PYTHON": "false", "KVTIER_VLLM_LOCK": str(lock)})
    assert proc.returncode == 1 and "lock" not in proc.stderr  # past the check: PYTHON=false cannot make .venv


def test_bootstrap_unknown_option(tmp_path: Path) -> None:
    proc = _run(_layout(tmp_path, "bootstrap.sh"), "bootstrap.sh", "--vlm", env={"PYTHON": "false"})
    assert proc.returncode == 2
    assert proc.stderr == "bootstrap: error: unknown option --vlm (use --vllm, --e2e)\n"


def test_test_sh_without_a_venv(tmp_path: Path) -> None:
    proc = _run(_layout(tmp_path, "test.sh"), "test.sh")
    assert proc.returncode == 2
    assert proc.stderr == "test.sh: error: no .venv: run 'bash scripts/bootstrap.sh --vllm --e2e' first\n"


def test_test_sh_names_what_the_venv_lacks_before_pytest(tmp_path: Path) -> None:
    repo = _layout(tmp_path, "test.sh")
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(repo / ".venv")], check=True, timeout=120)
    proc = _run(repo, "test.sh", env={"KVTIER_SKIP_E2E": "1"})
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout  # nothing ran: no ruff, no pytest
    assert proc.stderr == ("test.sh: error: .venv lacks pytest, ruff, mypy, torch, redis, vllm: run 'bash "
                           "scripts/bootstrap.sh --vllm' (vLLM needs ../shared/reference/vllm-0.33-cpu-deps.lock"
                           ".txt)\n")


def test_test_sh_names_a_vllm_installed_without_its_dependencies(tmp_path: Path) -> None:
    repo = _layout(tmp_path, "test.sh")
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(repo / ".venv")], check=True, timeout=120)
    site = next((repo / ".venv" / "lib").glob("python3*/site-packages"))
    (site / "vllm").mkdir()  # what pip install --no-deps vllm leaves: the package, not what it imports
    (site / "vllm" / "__init__.py").write_text("import cbor2_not_installed\n")
    proc = _run(repo, "test.sh", env={"KVTIER_SKIP_E2E": "1"})
    assert proc.returncode == 2
    assert ("lacks pytest, ruff, mypy, torch, redis, vllm (fails to import: No module named "
            "'cbor2_not_installed'): run") in proc.stderr and len(proc.stderr.splitlines()) == 1


def _venv_like_ours(repo: Path) -> None:
    """repo/.venv/bin/python: this test run's interpreter (every test dependency installed)."""
    (repo / ".venv" / "bin").mkdir(parents=True)
    python = repo / ".venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)


@pytest.mark.slow  # imports vllm: seconds, up to a minute on a busy machine
def test_test_sh_check_with_everything_installed(tmp_path: Path) -> None:
    repo = _layout(tmp_path, "test.sh")
    _venv_like_ours(repo)
    bin_dir = tmp_path / "bin"  # a PATH with what test.sh uses, and no redis-server
    bin_dir.mkdir()
    for tool in ("dirname", "sh"):
        found = shutil.which(tool)
        assert found
        (bin_dir / tool).symlink_to(found)
    env = {"PATH": str(bin_dir)}
    no_e2e = _run(repo, "test.sh", "--check", env=env)
    assert no_e2e.returncode == 2
    assert no_e2e.stderr == ("test.sh: error: no .venv-e2e for tests/e2e: run 'bash scripts/bootstrap.sh --vllm "
                             "--e2e' (or KVTIER_SKIP_E2E=1)\n")
    proc = _run(repo, "test.sh", "--check", env={**env, "KVTIER_SKIP_E2E": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ("test.sh: warning: redis-server / redis-cli not on PATH: the Redis tests will skip "
                           "(apt-get install redis-server)\n")
    assert proc.stdout == "test.sh: set-up complete\n"
