"""What the standalone scripts in benchmarks/ (redis_bandwidth.py, soak.py) share: their checks before a run and
their exit codes, each error one line on stderr (``kvtier: error: ...``), never a traceback.

Exit codes: 0 done; 1 the run failed (or the script's own checks did); 2 a bad option or a missing dependency;
130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def missing(commands: Sequence[str], why: str, out: Path) -> str | None:
    """What a Redis benchmark needs and does not find: redis-py, ``commands`` on PATH (``why``: what it runs them
    for), a place for its results file ``out``. One line, or None when all is there."""
    if importlib.util.find_spec("redis") is None:
        return "redis-py is not installed: pip install 'kvtier[redis]'"
    absent = [c for c in commands if shutil.which(c) is None]
    if absent:
        return f"{' and '.join(absent)} not found on PATH ({why}): install Redis, e.g. apt-get install redis-server"
    return unwritable(out)


def unwritable(out: Path) -> str | None:
    """Why the results file ``out`` cannot be written there (one line), or None."""
    from kvtier.bench.output import check_writable
    from kvtier.errors import KvtierError

    try:
        check_writable(argparse.Namespace(json=out))
    except KvtierError as exc:
        return str(exc)
    return None


def run_checked(name: str, need: str | None, work: Callable[[], int]) -> int:
    """``work()``'s exit code, unless ``need`` (what :func:`missing` found) stops it first; errors in one line."""
    if need is not None:
        print(f"kvtier: error: {need}", file=sys.stderr)
        return 2
    try:
        return work()
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        print(f"kvtier: error: {name}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
