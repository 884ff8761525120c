"""The processes a benchmark starts import the kvtier the benchmark imported (kvtier.ops.vllm_server.same_kvtier):
never a tree in their working directory, which ``python -m`` and ``python -c`` would put first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvtier
from kvtier.ops.vllm_server import same_kvtier


def test_a_child_process_imports_the_kvtier_this_process_imported_not_the_working_directorys(tmp_path: Path) -> None:
    decoy = tmp_path / "kvtier"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the working directory's kvtier was imported')\n")
    env = same_kvtier({k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")})
    out = subprocess.run([sys.executable, "-c", "import kvtier; print(kvtier.__file__)"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-500:]
    assert Path(out.stdout.strip()).resolve() == Path(kvtier.__file__).resolve()
