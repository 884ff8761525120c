"""Fixtures of the fault suite: the shared kit on sys.path, a tiny real tmpfs, and DEBUG-capable Redis servers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import faultkit` from every module here

from kvtier.bench.redis_servers import RedisServer


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``small_tmpfs("256k")`` mounts a real tmpfs of that size (root needed; skipped where mounting fails)."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"tmpfs-{len(mounted)}"
        mnt.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
                              capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {proc.stderr.decode().strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def debug_redis(redis_factory: Callable[..., RedisServer]) -> RedisServer:
    """A private server that accepts ``DEBUG SLEEP`` (to slow it down on purpose)."""
    return redis_factory(extra=["--enable-debug-command", "yes"])
