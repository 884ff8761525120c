"""Shared fixtures: real ``redis-server`` processes on free loopback ports (``kvtier.bench.redis_servers``).

``redis_server`` / ``redis_cluster`` are started once per session and shared: tests isolate themselves with a
unique key prefix. ``redis_factory`` starts private servers (to kill, restart or pause) and kills them at teardown.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import settings

from kvtier.bench.redis_servers import RedisClusterServers, RedisServer

# CI replays a fixed set of generated examples (derandomized) so a run is reproducible; local runs explore.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def _need_redis() -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        if os.environ.get("CI"):  # CI installs Redis: a missing binary is a broken set-up, not a skip
            pytest.fail("redis-server / redis-cli not installed (.ci/run installs them)")
        pytest.skip("redis-server / redis-cli not installed")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One standalone server for the whole session (share it with a unique key prefix)."""
    _need_redis()
    with RedisServer(maxmemory="1gb") as srv:
        yield srv


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """A 3-master Redis Cluster for the whole session."""
    _need_redis()
    with RedisClusterServers(3) as cluster:
        yield cluster


@pytest.fixture
def redis_factory() -> Iterator[Callable[..., RedisServer]]:
    """Start private servers: ``redis_factory(password=..., maxmemory=...)``; every one is killed at teardown."""
    _need_redis()
    started: list[RedisServer] = []

    def start(**kw: Any) -> RedisServer:
        srv = RedisServer(**kw)
        started.append(srv)
        return srv.start()

    yield start
    for srv in started:
        srv.stop()
