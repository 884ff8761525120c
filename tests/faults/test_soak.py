"""Bounded soak (CI): requests through the reference engine with cpu + disk + redis tiers while seeded faults
hit them (benchmarks/soak.py: Redis killed and restarted, disk and Redis records corrupted or removed, quota
pressure). The long run is ``test_long_soak`` (slow) or ``python benchmarks/soak.py``."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvtier.bench.redis_servers import RedisServer

REPO = Path(__file__).resolve().parents[2]


def load_soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvtier_soak", REPO / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvtier_soak"] = module
    spec.loader.exec_module(module)
    return module


def check(fig: dict[str, Any], kinds: tuple[str, ...]) -> None:
    assert fig["wrong_answers"] == 0
    assert fig["leaked_blocks"] == 0
    assert (fig["directory_pins"], fig["directory_pending"], fig["temp_files"]) == (0, 0, 0)
    assert fig["within_capacity"], fig["capacity"]
    assert set(kinds) <= set(fig["faults_injected"]), fig["faults_injected"]
    assert fig["faults_injected"]["redis_restart"] == fig["faults_injected"]["redis_kill"]
    assert fig["load_errors_recovered"] > 0 and sum(fig["corrupt_detected"].values()) > 0
    assert fig["requests_with_hits"] > 0 and fig["evictions"]["cpu"] > 0 and fig["evictions"]["disk"] > 0


def test_bounded_soak(redis_factory: Callable[..., RedisServer], tmp_path: Path) -> None:
    soak = load_soak()
    fig = soak.run_soak(soak.SoakSpec(waves=24, requests=6, seed=3), redis_factory(), tmp_path)
    print(soak.summary(fig))
    check(fig, soak.KINDS)
    assert fig["requests"] == 144


@pytest.mark.slow
def test_long_soak(redis_factory: Callable[..., RedisServer], tmp_path: Path) -> None:
    soak = load_soak()
    fig = soak.run_soak(soak.SoakSpec(waves=120, requests=6, seed=11), redis_factory(), tmp_path)
    print(soak.summary(fig))
    check(fig, soak.KINDS)


def test_sliding_window_chunks_a_load_skipped_are_never_saved(redis_server: RedisServer) -> None:
    """Found by the soak: a sliding-window group loads only the chunks covering its window, and re-saving the
    earlier chunks from their (unwritten) blocks stored stale bytes under valid keys; a later request sharing
    only the beginning of the prompt then loaded them. Redis shows it at once (a shared tier stores every save;
    local tiers skip keys they hold, so there it needed eviction first)."""
    from faultkit import assert_identical, make_config, prompts, run_faulted, tier_section

    from kvtier.engine import RequestSpec

    long, tail, other = prompts(5, 320, 40, 30)
    waves = [[RequestSpec("store", tuple(long), 2)],
             [RequestSpec("extend", tuple(long + tail), 2)],  # loads only the window's chunks, saves the rest
             [RequestSpec("short", tuple(long[:128] + other), 2)]]  # needs chunks 0-3 of both groups
    run = run_faulted(make_config([tier_section("redis", url=redis_server.url, timeout="1s")]), waves)
    assert_identical(run, waves)
    assert run.wave_hits("extend") > 0 and run.wave_hits("short") > 0
