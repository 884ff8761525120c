"""kvtier's I/O threads run torch ops single-threaded, leaving the caller's threads as they were."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from kvtier.tiers.runtime import LoopThread


def test_io_threads_run_torch_single_threaded_and_the_callers_setting_is_kept() -> None:
    if torch.get_num_threads() < 2:
        pytest.skip("needs a torch with two or more intra-op threads here")  # pragma: no cover
    before = torch.get_num_threads()
    loop = LoopThread("test-io")
    try:
        async def on_loop() -> tuple[int, int]:
            return torch.get_num_threads(), await asyncio.to_thread(torch.get_num_threads)

        assert loop.run(on_loop()) == (1, 1)
        # a parallel op there still computes the right thing
        async def total() -> float:
            return float(torch.ones(1 << 20).sum())

        assert loop.run(total()) == float(1 << 20)
    finally:
        loop.close()
    assert torch.get_num_threads() == before


def test_background_threads_run_at_the_lowest_priority_single_threaded() -> None:
    """kvtier's writer threads (``background_thread``): nice 19 on Linux, torch single-threaded; the calling
    thread keeps its own priority."""
    import os
    import sys
    import threading

    from kvtier.tiers.runtime import background_thread

    seen: dict[str, int] = {}

    def body() -> None:
        background_thread()
        seen["threads"] = torch.get_num_threads()
        if sys.platform == "linux":
            seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if sys.platform == "linux" else 0
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen["threads"] == 1
    if sys.platform == "linux":
        assert seen["nice"] == 19
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


@pytest.mark.parametrize(("env", "cores"), [
    ({"OMP_PLACES": "{0,1,2}"}, {0, 1, 2}),  # what vLLM's CPU build sets with the default OpenMP
    ({"OMP_PLACES": "{0},{1},{4}"}, {0, 1, 4}),
    ({"GOMP_CPU_AFFINITY": "0 1 2-4"}, {0, 1, 2, 3, 4}),  # with libgomp preloaded
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[3,5]"}, {3, 5}),  # with libiomp preloaded
    ({}, set()),  # nothing bound: in-process engines, tests
    ({"OMP_PLACES": "cores"}, set()),  # forms not read here bind nothing of kvtier's
    ({"OMP_PLACES": "{0:4}"}, set()),
    ({"GOMP_CPU_AFFINITY": "0 x"}, set()),
])
def test_compute_cores_are_read_from_what_vllm_sets_for_its_worker(env: dict[str, str], cores: set[int]) -> None:
    from kvtier.tiers.runtime import compute_cores

    assert compute_cores(env) == cores


CHILD = """
import asyncio, json, os, threading
os.sched_setaffinity(0, {0})  # as vLLM's CPU build binds its worker's main thread to its first compute core
os.environ["OMP_PLACES"] = "{0}"
from kvtier.tiers.runtime import LoopThread, background_thread
loop = LoopThread("test-io")
async def on_loop():
    return sorted(os.sched_getaffinity(0)), sorted(await asyncio.to_thread(os.sched_getaffinity, 0))
seen = {}
def writer():
    background_thread()
    seen["writer"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=writer)
t.start(); t.join()
print(json.dumps({"loop": loop.run(on_loop()), "writer": seen["writer"], "main": sorted(os.sched_getaffinity(0))}))
loop.close()
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two or more cores to leave one free")
def test_io_threads_leave_the_engines_compute_cores_to_it() -> None:
    """In a process bound as vLLM's CPU worker is (its main thread on core 0, OpenMP told so), kvtier's loop,
    executor and writer threads run on the cores the parent may use less core 0; the main thread stays put."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=120)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    spare = sorted(os.sched_getaffinity(0) - {0})
    assert seen["loop"] == [spare, spare]
    assert seen["writer"] == spare
    assert seen["main"] == [0]


def test_io_threads_keep_their_cores_when_nothing_is_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("Linux only")  # pragma: no cover
    for name in ("OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"):
        monkeypatch.delenv(name, raising=False)
    loop = LoopThread("test-io")
    try:
        async def cores() -> set[int]:
            return os.sched_getaffinity(0)

        assert loop.run(cores()) == os.sched_getaffinity(0)
    finally:
        loop.close()
