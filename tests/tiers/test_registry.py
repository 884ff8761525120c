"""The tier registry without the ``redis`` extra: a Redis tier is one clear ConfigError, never an ImportError.

Each case runs a fresh interpreter that sets ``sys.modules['redis'] = None`` before importing kvtier (as if
redis-py were not installed), so the rest of the test session keeps its real redis.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier.ops import cli

FIX = "kind redis needs the redis extra: pip install 'kvtier[redis]'"
CONFIG = """\
tiers:
  - {name: cpu, kind: cpu, capacity: 1GiB}
  - {name: remote, kind: redis, capacity: 1GiB, url: "redis://127.0.0.1:1/0"}
"""
WITHOUT_REDIS = "import sys\nsys.modules['redis'] = None\n"


def run_without_redis(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_REDIS + textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "with-redis.yaml"
    path.write_text(CONFIG)
    return path


def test_make_tier_without_redis_names_the_tier_and_the_extra(config_file: Path) -> None:
    proc = run_without_redis("""
        import json
        from kvtier import load_config
        from kvtier.errors import ConfigError
        from kvtier.tiers import check_extras, make_tier, tier_class
        cfg = load_config(sys.argv[1], env={})
        out = {"cpu": type(make_tier(cfg.tiers[0])).__name__}  # tiers without an extra still build
        calls = {"path": lambda: make_tier(cfg.tiers[1], path="tiers[1]"), "name": lambda: make_tier(cfg.tiers[1]),
                 "config": lambda: check_extras(cfg), "class": lambda: tier_class("redis")}
        for label, call in calls.items():
            try:
                call()
                out[label] = None
            except ConfigError as exc:
                out[label] = [exc.path, str(exc)]
        print(json.dumps(out))
        """, str(config_file))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["cpu"] == "CpuTier"
    assert out["path"] == ["tiers[1]", f"tiers[1]: {FIX}"]
    assert out["name"] == ["tier 'remote'", f"tier 'remote': {FIX}"]
    assert out["config"] == ["tiers[1]", f"tiers[1]: {FIX}"]
    assert out["class"] == ["tier kind redis", f"tier kind redis: {FIX}"]


def test_store_without_redis_fails_with_the_fix(config_file: Path) -> None:
    proc = run_without_redis("""
        from kvtier import TieredStore, load_config
        TieredStore.from_config(load_config(sys.argv[1], env={}))
        """, str(config_file))
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvtier.errors.ConfigError: ") and last.endswith(FIX), proc.stderr
    assert "ModuleNotFoundError" not in proc.stderr and "ImportError" not in proc.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_check_without_redis_is_one_line_and_exit_2(config_file: Path, as_json: bool) -> None:
    flags = ["--json"] if as_json else []
    proc = run_without_redis("""
        from kvtier.ops.cli import main
        sys.exit(main(sys.argv[1:]))
        """, "check", str(config_file), *flags)
    assert proc.returncode == 2
    assert proc.stderr == f"kvtier: error: tiers[1]: {FIX}\n"
    if as_json:
        assert json.loads(proc.stdout) == {"ok": False, "config": str(config_file), "path": "tiers[1]",
                                           "error": f"tiers[1]: {FIX}"}
    else:
        assert proc.stdout == ""


def test_check_with_redis_installed_reports_the_redis_tier(config_file: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", str(config_file)]) == 0
    out = capsys.readouterr().out
    assert f"{config_file}: OK" in out
    assert any(line.split()[:2] == ["remote", "redis"] for line in out.splitlines())
