"""scripts/bootstrap.sh and scripts/test.sh on a newcomer's checkout: a missing piece is one line naming it and
the fix, before anything is installed or run. Each test runs the real script in a copy of the repository layout
in a temporary directory (no ../shared there); nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
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
                               "requirements/vllm-0.33-cpu.lock.txt, which is absent")
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


def test_the_shipped_lock_is_where_bootstrap_looks_and_pins_what_vllm_needs() -> None:
    """A fresh clone has the lock: --vllm needs nothing beside the repository."""
    lock = ROOT / "requirements" / "vllm-0.33-cpu.lock.txt"
    pins = [line for line in lock.read_text().splitlines() if line and not line.startswith("#")]
    assert all("==" in line for line in pins) and len(pins) > 100
    assert {"torch", "transformers", "fastapi"} <= {p.split("==")[0] for p in pins}
    assert "LOCK=${KVTIER_VLLM_LOCK:-requirements/vllm-0.33-cpu.lock.txt}" in (ROOT / "scripts" / "bootstrap.sh").read_text()


def test_bootstrap_help(tmp_path: Path) -> None:
    proc = _run(_layout(tmp_path, "bootstrap.sh"), "bootstrap.sh", "--help", env={"PYTHON": "false"})
    assert proc.returncode == 0 and proc.stdout.startswith("usage: bash scripts/bootstrap.sh [--vllm] [--e2e]")
    assert "--e2e" in proc.stdout and proc.stderr == ""


def test_bootstrap_unknown_option(tmp_path: Path) -> None:
    proc = _run(_layout(tmp_path, "bootstrap.sh"), "bootstrap.sh", "--vlm", env={"PYTHON": "false"})
    assert proc.returncode == 2
    assert proc.stderr == "bootstrap: error: unknown option --vlm (use --vllm, --e2e, --print-torch)\n"


def test_bootstrap_takes_the_cpu_torch_index_where_no_local_cpu_wheel_is(tmp_path: Path) -> None:
    """Off the CI machines (no CPU wheel on pip's find-links: here pip's config and find-links are taken away) the
    torch pip would take is the CPU build, from PyTorch's CPU index; a CUDA build only when asked for."""
    repo = _layout(tmp_path, "bootstrap.sh")
    bare = {"PYTHON": sys.executable, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_NO_INDEX": "1"}
    proc = _run(repo, "bootstrap.sh", "--print-torch", env=bare)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout == "torch==2.13.0+cpu from https://download.pytorch.org/whl/cpu (no local CPU wheel)\n"
    assert not (repo / ".venv").exists()
    proc = _run(repo, "bootstrap.sh", "--print-torch", env={**bare, "KVTIER_TORCH_INDEX": "https://mirror/cpu"})
    assert proc.stdout == "torch==2.13.0+cpu from https://mirror/cpu (no local CPU wheel)\n"
    proc = _run(repo, "bootstrap.sh", "--print-torch", env={**bare, "KVTIER_TORCH": "cuda"})
    assert proc.stdout == "torch==2.13.0 from PyPI's default build (KVTIER_TORCH=cuda)\n"
    wheels = tmp_path / "wheels"  # a local CPU wheel: a stand-in that holds only what a dry run reads
    wheels.mkdir()
    info = "torch-2.13.0+cpu.dist-info"
    with zipfile.ZipFile(wheels / "torch-2.13.0+cpu-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    proc = _run(repo, "bootstrap.sh", "--print-torch", env={**bare, "PIP_FIND_LINKS": str(wheels)})
    assert proc.stdout == "torch==2.13.0+cpu from pip's find-links (a local CPU wheel)\n", proc.stdout + proc.stderr


def test_bootstrap_installs_torch_from_where_it_chose() -> None:
    text = (ROOT / "scripts" / "bootstrap.sh").read_text()
    assert text.count("""install -q "${TORCH_ARGS[@]}" 'torch==2.13.0'""") == 2  # .venv and .venv-e2e
    assert "install -q 'torch" not in text


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
    assert proc.stderr == "test.sh: error: .venv lacks pytest, ruff, mypy, importlinter, torch, redis: run 'bash scripts/bootstrap.sh'\n"


def _fake_venv(repo: Path, vllm: str | None = None, *, vllm_034: bool = False) -> None:
    """repo/.venv/bin/python: this run's interpreter (every test dependency installed); with ``vllm``, a package
    vllm whose __init__ is that text first on its path; with ``vllm_034``, an empty vLLM 0.34 in .venv/vllm-0.34."""
    prefix = ""
    if vllm is not None:
        shadow = repo.parent / "shadow"
        (shadow / "vllm").mkdir(parents=True)
        (shadow / "vllm" / "__init__.py").write_text(vllm)
        prefix = f'PYTHONPATH="{shadow}" '
    if vllm_034:
        (repo / ".venv" / "vllm-0.34" / "vllm").mkdir(parents=True)
        (repo / ".venv" / "vllm-0.34" / "vllm" / "__init__.py").write_text("")
    (repo / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
    python = repo / ".venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\n{prefix}exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)


def test_test_sh_without_a_working_vllm_skips_the_integration_tests_and_says_so(tmp_path: Path) -> None:
    repo = _layout(tmp_path, "test.sh")
    _fake_venv(repo, "import cbor2_not_installed\n")  # what pip install --no-deps vllm leaves
    proc = _run(repo, "test.sh", "--check", env={"KVTIER_SKIP_E2E": "1"})
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "vLLM" in line]
    assert notes == ["test.sh: note: .venv has no working vLLM (ModuleNotFoundError: No module named "
                     "'cbor2_not_installed'): the vLLM integration tests (tests/integration) are skipped; 'bash "
                     "scripts/bootstrap.sh --vllm' installs it"]
    required = _run(repo, "test.sh", "--check", env={"KVTIER_SKIP_E2E": "1", "KVTIER_REQUIRE_ALL": "1"})
    assert required.returncode == 2 and "error: .venv has no working vLLM" in required.stderr


def test_test_sh_without_vllm_034_runs_the_integration_tests_on_033_alone_and_says_so(tmp_path: Path) -> None:
    repo = _layout(tmp_path, "test.sh")
    _fake_venv(repo, "")  # a vLLM that imports (and imports nothing, so that this test is quick)
    proc = _run(repo, "test.sh", "--check", env={"KVTIER_SKIP_E2E": "1"})
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stderr.splitlines() if "vLLM" in line] == [
        "test.sh: note: no vLLM 0.34 in .venv/vllm-0.34: the integration tests run on vLLM 0.33 only; 'bash "
        "scripts/bootstrap.sh --vllm' installs it"]
    required = _run(repo, "test.sh", "--check", env={"KVTIER_SKIP_E2E": "1", "KVTIER_REQUIRE_ALL": "1"})
    assert required.returncode == 2
    assert required.stderr == ("test.sh: error: no vLLM 0.34 in .venv/vllm-0.34: run 'bash scripts/bootstrap.sh "
                               "--vllm'\n")
    (repo / ".venv" / "vllm-0.34" / "vllm").mkdir(parents=True)
    (repo / ".venv" / "vllm-0.34" / "vllm" / "__init__.py").write_text("")
    proc = _run(repo, "test.sh", "--check", env={"KVTIER_SKIP_E2E": "1", "KVTIER_REQUIRE_ALL": "1"})
    assert proc.returncode == 0 and "vLLM" not in proc.stderr, proc.stderr


def test_bootstrap_puts_vllm_034_where_test_sh_runs_it_from() -> None:
    bootstrap = (ROOT / "scripts" / "bootstrap.sh").read_text()
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert "--no-deps --target .venv/vllm-0.34 'vllm==0.34.0'" in bootstrap
    assert 'PYTHONPATH="$PWD/.venv/vllm-0.34${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest tests/integration' in test_sh


@pytest.mark.slow  # imports vllm: seconds, up to a minute on a busy machine
def test_test_sh_check_with_everything_installed(tmp_path: Path) -> None:
    repo = _layout(tmp_path, "test.sh")
    _fake_venv(repo, vllm_034=True)
    bin_dir = tmp_path / "bin"  # a PATH with what test.sh uses, and no redis-server
    bin_dir.mkdir()
    for tool in ("dirname", "sh"):
        found = shutil.which(tool)
        assert found
        (bin_dir / tool).symlink_to(found)
    env = {"PATH": str(bin_dir)}
    no_e2e = _run(repo, "test.sh", "--check", env=env)
    assert no_e2e.returncode == 0
    assert "test.sh: note: no .venv-e2e: the end-to-end tests (tests/e2e) are skipped" in no_e2e.stderr
    required = _run(repo, "test.sh", "--check", env={**env, "KVTIER_REQUIRE_ALL": "1"})
    assert required.returncode == 2 and "error: no .venv-e2e for tests/e2e" in required.stderr
    proc = _run(repo, "test.sh", "--check", env={**env, "KVTIER_SKIP_E2E": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ("test.sh: warning: redis-server / redis-cli not on PATH: the Redis tests will skip "
                           "(apt-get install redis-server)\n")
    assert proc.stdout == "test.sh: set-up complete\n"



MADE = (".venv", ".venv-e2e", ".peers", "kvtier-results")  # what bootstrap and kvtier's tools make in the root


def _git(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=60)


def test_the_repository_tracks_no_link_and_nothing_that_bootstrap_or_the_tools_make() -> None:
    """A tracked .venv link (d95c46f committed a worktree's) made a clone's bootstrap fail at once ('File exists:
    .venv'); a link points somewhere a clone does not have."""
    if shutil.which("git") is None or _git("rev-parse", "--show-toplevel", cwd=ROOT).returncode != 0:
        pytest.skip("not a usable git checkout: nothing is tracked")
    staged = _git("ls-files", "-s", "-z", cwd=ROOT)
    assert staged.returncode == 0, staged.stderr
    entries = [entry.split("\t", 1) for entry in staged.stdout.split("\0") if entry]
    assert [path for mode, path in entries if mode.startswith("120000 ")] == []
    assert [path for _, path in entries if path.split("/")[0] in MADE] == []


def test_gitignore_keeps_out_what_bootstrap_and_the_tools_make_as_links_too(tmp_path: Path) -> None:
    """A '.venv/' pattern ignores a directory only: a worktree's .venv link was added by 'git add -A'. In a scratch
    repository with this .gitignore and a link under each name, 'git add -A' adds the .gitignore alone."""
    if shutil.which("git") is None or not (ROOT / ".gitignore").is_file():
        pytest.skip("no git, or no .gitignore (not a checkout)")
    repo = tmp_path / "repo"
    repo.mkdir()
    assert _git("init", "-q", cwd=repo).returncode == 0
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    for name in MADE:
        (repo / name).symlink_to(tmp_path)
    added = _git("add", "-A", "--dry-run", cwd=repo)
    assert added.returncode == 0, added.stderr
    assert added.stdout == "add '.gitignore'\n"
