"""kvtier in the end-to-end venv is installed as a user installs it: from the wheel built from this tree
(``scripts/test.sh`` builds and installs it, and runs these tests with ``PYTHONSAFEPATH`` so that the working
directory's source tree is never imported instead). A file the package leaves out then fails here, or in the
end-to-end test that needs it."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import kvtier
from kvtier.bench.hitrate import DEFAULT_TRACE

SOURCE = Path(__file__).resolve().parents[2] / "kvtier"
INSTALLED = Path(kvtier.__file__).resolve().parent


def test_kvtier_is_imported_from_its_installed_wheel_not_from_the_source_tree() -> None:
    assert INSTALLED != SOURCE and "site-packages" in INSTALLED.parts, INSTALLED
    direct = importlib.metadata.distribution("kvtier").read_text("direct_url.json")
    assert direct is None or not json.loads(direct).get("dir_info", {}).get("editable"), direct


def test_the_wheel_holds_every_module_and_the_benchmarks_trace() -> None:
    modules = {p.relative_to(SOURCE) for p in SOURCE.rglob("*.py")}
    shipped = {p.relative_to(INSTALLED) for p in INSTALLED.rglob("*.py")}
    assert modules - shipped == set() and shipped - modules == set()  # nothing left out, nothing stale
    assert DEFAULT_TRACE.resolve().is_relative_to(INSTALLED) and DEFAULT_TRACE.stat().st_size > 1 << 20


def test_the_installed_command_reports_its_version() -> None:
    out = subprocess.run([str(Path(sys.executable).parent / "kvtier"), "--version"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == f"kvtier {kvtier.__version__}"
