"""Bounded soaks (CI): requests through the reference engine with cpu + disk + redis tiers while seeded faults
hit them (benchmarks/soak.py: Redis killed and restarted, disk and Redis records corrupted or removed, quota
pressure), with both halves over one store, and with the halves split as vLLM builds them (each its own tiers, the
directory fed by the worker reports, the default policy) under the worker's faults too (cpu records lost behind the
directory's back, its I/O loop stalled past the worker's wait, Redis flushed), between waves and within them. The long
runs are ``test_long_soak`` / ``test_long_split_soak`` (slow) or ``python benchmarks/soak.py [--split]``."""

from __future__ import annotations

import gc
import importlib.util
import logging
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvtier.bench.redis_servers import RedisServer
from kvtier.config import PolicyConfig

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
    assert (fig["directory_pins"], fig["directory_pending"], fig["pool_pins"], fig["temp_files"]) == (0, 0, 0, 0)
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


MODELS = {"full-attention": None, "hybrid": 48}  # one group: cpu loads synchronous; sliding window: asynchronous


def split_spec(soak: ModuleType, model: str, waves: int, seed: int) -> Any:
    """The split soak's sizes (``SPLIT_SIZES``): recent prompts come back, so that a chunk computed on top of a
    failed load is hit while still cached. On a35606b (before issue 31's fixes) the full-attention run failed every
    time on the pins its stalled borrows leaked (16; a borrow no longer goes through the I/O loop); with stalls
    off, 12, 4 and 0 of its 144 answers were wrong in three runs (0-2 without ``recent``)."""
    return soak.SoakSpec(waves=waves, requests=6, seed=seed, split=True, sliding_window=MODELS[model], fault_every=7,
                         **soak.SPLIT_SIZES)


def check_split(soak: ModuleType, fig: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """The one-store checks, and that the worker's faults happened and did what they are for; asyncio logged no
    error (a stalled load's task once ended in an exception nobody retrieved: a traceback per stall)."""
    sync = fig["groups"] == 1
    kinds = fig["faults_injected"]
    check(fig, (*soak.KINDS, *(k for k in soak.WORKER_KINDS if sync or k != "loop_stall")))
    assert fig["mode"] == "split halves" and fig["policy"] == asdict(PolicyConfig()), fig["policy"]  # the default
    assert sum(fig["faults_within_waves"].values()) >= fig["waves"] // 2, fig["faults_within_waves"]
    assert fig["records_damaged"]["cpu_lost"] > 0 and kinds["redis_flush"] > 0
    if sync:  # synchronous loads failed (records lost from the cpu pool), and the loop stalled
        assert fig["sync_load_steps"] > 0 and fig["sync_load_failures"] > 0 and fig["loop_stalls"] > 0
    else:
        assert (fig["sync_load_steps"], fig["loop_stalls"]) == (0, 0)
    gc.collect()  # a task's unretrieved exception is logged when the task is collected
    unretrieved = [r.getMessage() for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
    assert not unretrieved, unretrieved[:3]


@pytest.mark.parametrize("model", list(MODELS))
def test_bounded_split_soak(redis_factory: Callable[..., RedisServer], tmp_path: Path, model: str,
                            caplog: pytest.LogCaptureFixture) -> None:
    soak = load_soak()
    fig = soak.run_soak(split_spec(soak, model, 24, 3), redis_factory(), tmp_path)
    print(soak.summary(fig))
    check_split(soak, fig, caplog)
    assert fig["requests"] == 144


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_long_split_soak(redis_factory: Callable[..., RedisServer], tmp_path: Path, model: str,
                         caplog: pytest.LogCaptureFixture) -> None:
    soak = load_soak()
    fig = soak.run_soak(split_spec(soak, model, 120, 11), redis_factory(), tmp_path)
    print(soak.summary(fig))
    check_split(soak, fig, caplog)


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
