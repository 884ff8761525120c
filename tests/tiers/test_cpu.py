"""The cpu tier: the shared contract plus slot-pool behaviour (slots, fragmentation, pins, views)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from contract import TierContract, assert_same, key, rand

from kvtier.config import CpuTierConfig, DiskTierConfig, GpuTierConfig, RedisTierConfig
from kvtier.tiers import TIERS, make_tier, tier_class
from kvtier.tiers.base import Tier
from kvtier.tiers.memory.copies import copy_pieces
from kvtier.tiers.memory.cpu import CpuTier
from kvtier.tiers.memory.free_runs import FreeRuns
from kvtier.tiers.memory.slots import SlotPool


class TestCpuContract(TierContract):
    async def build(self, env: Any, capacity: int, name: str) -> Tier:
        tier = make_tier(CpuTierConfig(name=name, capacity=capacity, pin_memory=False))
        await tier.start()
        return tier


async def started(capacity: int, slot_bytes: int | None = None) -> CpuTier:
    tier = CpuTier(CpuTierConfig(name="cpu", capacity=capacity, slot_bytes=slot_bytes, pin_memory=False))
    await tier.start()
    return tier


def test_registry_is_lazy_and_complete() -> None:
    assert set(TIERS) == {"gpu", "cpu", "disk", "redis"}
    assert tier_class("cpu") is CpuTier
    assert tier_class("gpu").__name__ == "GpuTier" and tier_class("disk").__name__ == "DiskTier"
    assert TIERS["redis"] == "kvtier.tiers.redis.tier:RedisTier"
    with pytest.raises(ValueError, match="unknown tier kind 'tape'"):
        tier_class("tape")


def test_make_tier_builds_each_kind(tmp_path: Any) -> None:
    sections = [CpuTierConfig(name="c", capacity=1 << 20), GpuTierConfig(name="g", capacity=1 << 20, device="cpu"),
                DiskTierConfig(name="d", capacity=1 << 20, path=str(tmp_path))]
    for section in sections:
        tier = make_tier(section, hmac_key=b"k")
        assert (tier.name, tier.capacity_bytes) == (section.name, 1 << 20)
        assert tier.is_memory == (section.kind != "disk")
    assert RedisTierConfig(name="r", capacity=1).kind == "redis"


async def test_slot_size_from_first_record_rounded_to_4k() -> None:
    tier = await started(1 << 20)
    assert tier.pool.slot_bytes == 0 and tier.stored_size(5000) == 8192
    await tier.put([(key(0), rand((1250,)))])  # 5000 bytes
    assert tier.pool.slot_bytes == 8192 and tier.used_bytes() == 8192
    await tier.put([(key(1), rand((5000,)))])  # 20000 bytes -> 3 slots
    assert tier.used_bytes() == 8192 * 4 and tier.stored_size(20000) == 3 * 8192


async def test_configured_slot_bytes() -> None:
    tier = await started(1 << 20, slot_bytes=10000)
    assert tier.pool.slot_bytes == 12288
    assert tier.stored_size(100) == 12288


async def test_pool_reads_zeros_and_commits_nothing_before_a_put() -> None:
    tier = await started(64 << 10)
    buf = tier.pool._buf
    assert buf is not None and buf.numel() == 64 << 10 and int(buf.count_nonzero()) == 0
    assert tier.committed_bytes() == 0  # memory is backed as records arrive (tests/tiers/test_pool_memory.py)


async def test_fragmented_record_spans_several_runs() -> None:
    tier = await started(8 * 4096, slot_bytes=4096)
    small = [rand((1024,), seed=i) for i in range(8)]
    assert await tier.put([(key(i), t) for i, t in enumerate(small)]) == [True] * 8
    assert await tier.delete([key(i) for i in (1, 3, 5)]) == 3  # three separate free slots
    big = rand((3 * 1024,), torch.float32, seed=42)  # 3 slots, no 3-slot run is free
    assert await tier.put([(key(100), big)]) == [True]
    assert len(tier.pool._map[key(100)].runs) == 3
    assert_same((await tier.get([key(100)]))[0], big)
    for i in (0, 2, 4, 6, 7):
        assert_same((await tier.get([key(i)]))[0], small[i])
    assert tier.pool.view(key(100)) is None  # not one run: no zero-copy view
    assert await tier.put([(key(101), rand((1024,)))]) == [False]


def test_free_runs_coalesce() -> None:
    runs = FreeRuns(10)
    a, b, c = runs.take(3), runs.take(3), runs.take(4)
    assert runs.free == 0 and runs.take(1) is None
    assert a and b and c
    for r in (a, c, b):
        runs.give(*r[0])
    assert runs.free == 10 and runs.take(10) == [(0, 10)]


async def test_pinned_delete_is_deferred_until_unpin() -> None:
    tier = await started(2 * 4096, slot_bytes=4096)
    t = rand((1024,), seed=1)
    await tier.put([(key(0), t)])
    tier.pin([key(0)])
    view = tier.view(key(0))
    assert view is not None
    assert await tier.delete([key(0)]) == 1
    assert await tier.get([key(0)]) == [None]  # hidden at once
    assert tier.used_bytes() == 4096  # but its slot is still held
    assert await tier.put([(key(1), rand((1024,), seed=2))]) == [True]
    assert await tier.put([(key(2), rand((1024,), seed=3))]) == [False]  # the pinned slot is not reused
    assert_same(view, t)  # the reader's view is intact
    tier.unpin([key(0)])
    assert tier.pool.pinned() == 0 and tier.used_bytes() == 4096
    assert await tier.put([(key(2), rand((1024,), seed=3))]) == [True]


async def test_pins_are_counted() -> None:
    tier = await started(4 * 4096, slot_bytes=4096)
    await tier.put([(key(0), rand((1024,)))])
    tier.pin([key(0)])
    tier.pin([key(0)])
    await tier.delete([key(0)])
    tier.unpin([key(0)])
    assert tier.used_bytes() == 4096
    tier.unpin([key(0)])
    assert tier.used_bytes() == 0 and tier.pool.pinned() == 0


async def test_overwrite_when_full_reuses_the_old_slots_unless_pinned() -> None:
    tier = await started(4096, slot_bytes=4096)
    await tier.put([(key(0), rand((1024,), seed=1))])
    new = rand((1024,), seed=2)
    assert await tier.put([(key(0), new)]) == [True]
    assert_same((await tier.get([key(0)]))[0], new)
    tier.pin([key(0)])
    assert await tier.put([(key(0), rand((1024,), seed=3))]) == [False]
    assert_same((await tier.get([key(0)]))[0], new)  # a refused overwrite keeps the old record
    tier.unpin([key(0)])


async def test_get_into_and_view() -> None:
    tier = await started(1 << 20)
    t = rand((4, 256), torch.bfloat16, seed=5)
    await tier.put([(key(0), t)])
    out = torch.empty_like(t)
    assert await tier.get_into([(key(0), out), (key(1), torch.empty_like(t))]) == [True, False]
    assert_same(out, t)
    assert tier.stats().get_hits == 1 and tier.stats().bytes_out == t.numel() * 2
    with pytest.raises(ValueError, match="bytes"):
        await tier.get_into([(key(0), torch.empty(3))])
    view = tier.view(key(0))
    assert view is not None and view.data_ptr() != t.data_ptr()
    assert_same(view, t)


async def test_get_returns_a_new_tensor() -> None:
    tier = await started(1 << 20)
    await tier.put([(key(0), rand((256,)))])
    [a] = await tier.get([key(0)])
    assert a is not None
    a.zero_()
    [b] = await tier.get([key(0)])
    assert_same(b, rand((256,)))


async def test_zero_size_record() -> None:
    tier = await started(1 << 20)
    assert await tier.put([(key(0), torch.empty(0, 4))]) == [True]
    [got] = await tier.get([key(0)])
    assert got is not None and tuple(got.shape) == (0, 4) and tier.used_bytes() == 0
    assert await tier.put([(key(0), torch.empty(0))]) == [True]  # overwrite before any slot size is known
    assert await tier.put([(key(0), rand((8,)))]) == [True]
    assert_same((await tier.get([key(0)]))[0], rand((8,)))


def test_pool_put_before_start_fails_loudly() -> None:
    pool = SlotPool(1 << 20)
    with pytest.raises(RuntimeError, match="not started"):
        pool.put(key(0), rand((4,)))


def test_not_pinned_without_cuda() -> None:
    tier = CpuTier(CpuTierConfig(name="c", capacity=4096, pin_memory=True))
    assert tier.pool.pin_memory == torch.cuda.is_available()


async def test_borrowed_views_stay_valid_until_released() -> None:
    tier = await started(1 << 20, slot_bytes=4096)
    a, b = rand((1024,), seed=1), rand((1024,), seed=2)
    await tier.put([(key(0), a), (key(1), b)])
    views = tier.borrow([key(0), key(1), key(7)])
    assert views[2] is None and views[0] is not None and views[1] is not None
    assert views[0].data_ptr() != a.data_ptr()
    assert_same(views[0], a)
    assert tier.stats().get_hits == 2
    # deleting and overwriting while borrowed hides the old records but keeps their bytes
    await tier.delete([key(0)])
    assert await tier.put([(key(1), rand((1024,), seed=3))]) == [True]
    await tier.put([(key(5 + i), rand((1024,), seed=9)) for i in range(20)])
    assert_same(views[0], a)
    assert_same(views[1], b)
    tier.release([key(0), key(1), key(7)])
    assert tier.pool.pinned() == 0
    assert await tier.get([key(0)]) == [None]
    used = tier.used_bytes()
    await tier.delete([key(1)] + [key(5 + i) for i in range(20)])
    assert used == 21 * 4096 and tier.used_bytes() == 0  # the deferred slots were freed at release


async def test_a_record_split_over_runs_is_borrowed_as_a_copy_and_a_busy_pool_lends_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``borrow`` answers every key on the caller's thread: a view, a copy of a record stored in several runs of
    slots, None for a miss; a pool another thread holds past ``BORROW_WAIT_S`` raises and pins nothing."""
    import threading

    import kvtier.tiers.memory.pool as pool_module

    tier = await started(4 * 4096, slot_bytes=4096)
    await tier.put([(key(i), rand((1024,), seed=i)) for i in range(4)])
    await tier.delete([key(1), key(3)])
    split = rand((2048,), seed=9)  # two slots, and no two free slots are adjacent
    assert await tier.put([(key(4), split)]) == [True]
    assert tier.view(key(4)) is None
    got = tier.borrow([key(4), key(0), key(1)])
    assert got[0] is not None and got[1] is not None and got[2] is None
    assert_same(got[0], split)
    tier.release([key(4), key(0), key(1)])
    assert tier.pool.pinned() == 0
    monkeypatch.setattr(pool_module, "BORROW_WAIT_S", 0.05)
    held, free = threading.Event(), threading.Event()

    def hold() -> None:
        with tier._lock:
            held.set()
            free.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        with pytest.raises(TimeoutError):
            tier.borrow([key(0)])
    finally:
        free.set()
        holder.join()
    assert tier.pool.pinned() == 0


async def test_get_reuses_memory_of_dropped_results_only() -> None:
    tier = await started(1 << 20)
    await tier.put([(key(0), rand((4096,), seed=1)), (key(1), rand((4096,), seed=2))])
    [held] = await tier.get([key(0)])
    [dropped] = await tier.get([key(1)])
    assert held is not None and dropped is not None
    ptr = dropped.data_ptr()
    del dropped
    [again] = await tier.get([key(1)])
    assert again is not None and again.data_ptr() == ptr  # recycled: no fresh memory
    assert again.data_ptr() != held.data_ptr()
    assert_same(held, rand((4096,), seed=1))


async def test_small_results_of_one_get_share_a_buffer_yet_stay_independent() -> None:
    tier = await started(1 << 22, slot_bytes=4096)
    want = [rand((8, 64), seed=1), rand((3, 5, 7), torch.bfloat16, seed=2), rand((1000,), torch.float16, seed=3),
            rand((2, 2), torch.float64, seed=4)]
    await tier.put([(key(i), t) for i, t in enumerate(want)])
    got = await tier.get([key(0), key(9), key(1), key(2), key(3)])
    assert got[1] is None
    hits = [t for t in got if t is not None]
    for g, w in zip(hits, want, strict=True):
        assert_same(g, w)
        assert g.is_contiguous()
    storages = {t.untyped_storage().data_ptr() for t in hits}
    assert len(storages) == 1  # one recycled buffer for the whole batch
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in hits)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))  # no overlap
    hits[0].zero_()
    for g, w in zip(hits[1:], want[1:], strict=True):
        assert_same(g, w)
    first = hits[0].data_ptr()
    del got, g, hits
    again = await tier.get([key(0), key(9), key(1), key(2), key(3)])
    assert again[0] is not None and again[0].data_ptr() == first  # the group came back once all were dropped
    assert_same(again[0], want[0])


def test_adjacent_pieces_are_merged_and_others_kept() -> None:
    src = torch.arange(64, dtype=torch.uint8)
    pool = torch.zeros(64, dtype=torch.uint8)
    pieces = [(0, src, 0, 16), (16, src, 16, 16),  # adjacent on both sides: one copy
              (40, src, 32, 8),  # a gap on the pool side: a new copy
              (48, src, 40, 8)]
    assert copy_pieces(pool, pieces, into_pool=True) == 2
    assert torch.equal(pool[0:32], src[0:32]) and torch.equal(pool[40:56], src[32:48])
    assert int(pool[32:40].sum()) == 0 and int(pool[56:].sum()) == 0
    back = torch.zeros(64, dtype=torch.uint8)
    assert copy_pieces(pool, [(0, back, 0, 32), (40, back, 32, 16)], into_pool=False) == 2
    assert torch.equal(back[:48], src[:48])


def test_pieces_of_separate_tensors_are_not_merged_across_storages() -> None:
    """Two tensors with storages of their own that merely follow each other in memory are copied apart (a merged
    view would run past the first one's storage)."""
    memory = bytearray(range(32))
    first = torch.frombuffer(memoryview(memory)[:16], dtype=torch.uint8)
    second = torch.frombuffer(memoryview(memory)[16:], dtype=torch.uint8)
    assert second.data_ptr() == first.data_ptr() + 16  # adjacent, yet two storages
    pool = torch.zeros(32, dtype=torch.uint8)
    assert copy_pieces(pool, [(0, first, 0, 16), (16, second, 0, 16)], into_pool=True) == 2
    assert pool.tolist() == list(range(32))


def test_put_many_with_a_repeated_key_keeps_the_last_value() -> None:
    pool = SlotPool(1 << 20)
    pool.allocate()
    batch = torch.arange(3 * 4096, dtype=torch.int32).view(3, 4096)  # adjacent sources: merged copies
    assert pool.put_many([(key(0), batch[0]), (key(1), batch[1]), (key(0), batch[2])]) == [True, True, True]
    got = pool.get_many([key(0), key(1), key(2)])
    assert got[2] is None
    assert_same(got[0], batch[2])
    assert_same(got[1], batch[1])
    outs = [torch.empty(4096, dtype=torch.int32) for _ in range(2)]
    assert pool.read_many([(key(1), outs[0]), (key(9), outs[1]), (key(0), outs[1])]) == [True, False, True]
    assert_same(outs[0], batch[1])
    assert_same(outs[1], batch[2])


def test_a_failing_batch_put_leaves_misses_never_stale_bytes() -> None:
    """Slots are reserved before the batch's copies run; when the batch fails, nothing it placed may be served
    (the slots would still hold a deleted record's bytes)."""
    pool = SlotPool(1 << 20)
    pool.allocate()
    assert pool.put(key(9), torch.full((1024,), 7.0))
    assert pool.delete(key(9))
    bad = torch.zeros(1024).to_sparse()  # has no flat byte view: raises while being placed
    with pytest.raises(RuntimeError):
        pool.put_many([(key(1), torch.ones(1024)), (key(2), bad)])
    assert pool.get(key(1)) is None and pool.get(key(2)) is None
    assert pool.used_bytes() == 0
    assert pool.put(key(1), torch.ones(1024))
    assert_same(pool.get(key(1)), torch.ones(1024))
