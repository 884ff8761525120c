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
