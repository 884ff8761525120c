"""kvtier's I/O threads run torch ops single-threaded, leaving the caller's threads as they were."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvtier.runtime import LoopThread


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

    from kvtier.runtime import background_thread

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
