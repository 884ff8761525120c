"""The optional progress bar: tqdm's on stderr when installed, nothing at all without the ``bench`` extra, and
``kvtier demo`` / ``kvtier bench hit-rate`` run the same without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.ops.progress import progress_bar

# As if tqdm and the redis extra were not installed: the demo needs only kvtier's core dependencies.
WITHOUT_EXTRAS = "import sys\nfor name in ('tqdm', 'redis', 'hiredis'):\n    sys.modules[name] = None\n"


def test_bar_counts_updates_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    with progress_bar(5, desc="replay", unit="req") as update:
        update(2)
        update(3)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "replay" in captured.err and "5/5" in captured.err and "req" in captured.err


def test_disabled_bar_writes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with progress_bar(5, desc="replay", enabled=False) as update:
        update(5)
    assert capsys.readouterr() == ("", "")


def test_without_tqdm_the_bar_is_a_no_op(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `from tqdm import tqdm` now raises ImportError
    with progress_bar(5, desc="replay") as update:
        update(5)
    assert capsys.readouterr() == ("", "")


def _kvtier_without_extras(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    code = WITHOUT_EXTRAS + "from kvtier.ops.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}, "KVTIER_CACHE_DIR": str(tmp_path)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=240,
                          env=env, check=False)


def test_demo_runs_without_tqdm_or_redis(tmp_path: Path) -> None:
    proc = _kvtier_without_extras(tmp_path, "demo", "--users", "2", "--turns", "2", "--max-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    assert "outputs identical with and without the cache: yes" in proc.stdout
    assert "Traceback" not in proc.stderr and "turn/s" not in proc.stderr  # no bar, no error


def test_hit_rate_bench_runs_without_tqdm(tmp_path: Path) -> None:
    proc = _kvtier_without_extras(tmp_path, "bench", "hit-rate", "--workload", "long-doc", "--workload-arg",
                                  "documents=4", "--sweep", "50%", "--policies", "lru", "--no-belady",
                                  "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "lru" in proc.stdout and "long-doc" in proc.stdout
    assert proc.stderr == ""
