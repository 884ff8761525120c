"""Whatever a synchronous load borrows is released exactly once, whether the wait completes, times out or is
cancelled (issue 31, part 3): a borrow that completes after the engine's thread stopped waiting for it used to stay
pinned for ever, its slots held by no record, until the pool refused puts in silence."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch
from worker_kit import CHUNK_BLOCKS, CHUNK_KEYS, KCC, bounded_worker, paged

import kvtier.connector.worker.loads as loads_module
from kvtier.config import CpuTierConfig
from kvtier.connector.plans import KVTierMetadata, LoadSpec
from kvtier.kvcopy.transfer import KVLayout, gather
from kvtier.records.keys import Key
from kvtier.tiers.memory.cpu import CpuTier
from kvtier.tiers.runtime import LoopThread

STALL_S = 0.25  # each borrow holds the I/O loop this long: past the engine's wait (0.05 s + 0.05 s of grace)


class SlowBorrowCpuTier(CpuTier):
    """A cpu tier whose ``borrow`` blocks the I/O loop before pinning, as a loop busy with other work would."""

    def borrow(self, keys: Sequence[Key]) -> list[torch.Tensor | None]:
        time.sleep(STALL_S)
        return super().borrow(keys)


def chunks_taken(tier: CpuTier, loop: LoopThread, payload: torch.Tensor) -> int:
    """How many records of ``payload``'s size the tier takes before it refuses one."""
    n = 0
    while loop.run(tier.put([(bytes([7, n % 256, n // 256]) * 10 + b"xx", payload)])) == [True]:
        n += 1
    return n


@pytest.mark.timeout(60)
def test_stalled_borrows_release_their_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loads_module, "CANCEL_GRACE_S", 0.05)
    kv = paged(5)
    layers = [kv[n] for n in KCC.kv_cache_groups[0].layer_names]
    data = gather(layers, [(1, 2), (3, 4)], KVLayout.KV_FIRST)
    fresh = CpuTier(CpuTierConfig("fresh", 64 * data[0].nbytes))
    tier = SlowBorrowCpuTier(CpuTierConfig("cpu", 64 * data[0].nbytes))
    worker, loop = bounded_worker(tier, kv)
    worker.wait_timeout_s = 0.05
    try:
        loop.run(fresh.start())
        expected = chunks_taken(fresh, loop, data[0].contiguous())
        loop.run(tier.put([(k, data[i].contiguous()) for i, k in enumerate(CHUNK_KEYS)]))
        for _ in range(6):
            worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", 0, "cpu", CHUNK_KEYS, CHUNK_BLOCKS)]))
            assert worker.get_block_ids_with_load_errors() == {21, 22, 23, 24}  # the wait gave up: recomputed
        loop.run(loads_module.asyncio.sleep(STALL_S * 2))  # every late borrow has completed on the loop
        assert tier.pool.pinned() == 0  # each released once (it was 2 -> 12 over 6 stalls)
        assert loop.run(tier.delete(list(CHUNK_KEYS))) == 2
        assert chunks_taken(tier, loop, data[0].contiguous()) == expected  # as many as an empty pool (was 244/256)
    finally:
        worker.close()
        loop.close()
