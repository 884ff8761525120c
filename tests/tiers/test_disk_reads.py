"""The disk tier's read path: ordered reads over several streams, page-aligned recycled buffers, the
page-cache (RWF_NOWAIT) pass and the waiting pass, records rewritten by another process, and the payloads of
equal records read into evenly spaced slots of one buffer."""

from __future__ import annotations

import errno
import itertools
import os
from pathlib import Path
from typing import Any

import pytest
from contract import assert_same, key, rand
from disk_helpers import disk

from kvtier.bench.measure import drop_page_cache
from kvtier.kvcopy.common import spacing
from kvtier.records.codec import slot_aligned
from kvtier.tiers.disk.io import READ_STREAMS


async def test_a_get_of_many_records_keeps_order_across_read_streams(tmp_path: Path) -> None:
    tier = await disk(tmp_path, capacity=1 << 26)
    sizes = [1000, 300_000, 50, 1 << 20, 7, 2000, 400_000, 10]  # uneven: streams split by bytes
    await tier.put([(key(i), rand((n,), seed=i)) for i, n in enumerate(sizes)])
    asked = [key(i) for i in range(len(sizes))]
    asked.insert(3, key(99))  # a miss in the middle
    got = await tier.get(asked)
    assert len(got) == len(asked) and got[3] is None
    for i, n in enumerate(sizes):
        value = got[i if i < 3 else i + 1]
        assert value is not None
        assert_same(value, rand((n,), seed=i))
    assert len(tier._read_runs([tier._index.get(k, 0) for k in asked])) <= READ_STREAMS
    assert tier.stats().get_hits == len(sizes) and tier.stats().gets == len(asked)


async def test_read_payloads_start_page_aligned(tmp_path: Path) -> None:
    """Reads land in recycled buffers placed so that the payload (after the header) starts on a page."""
    tier = await disk(tmp_path)
    await tier.put([(key(i), rand((20_000,), seed=i)) for i in range(3)])
    for value in await tier.get([key(i) for i in range(3)]):
        assert value is not None and value.data_ptr() % 4096 == 0


@pytest.mark.parametrize("answer", [0, errno.EAGAIN, errno.EOPNOTSUPP])
async def test_read_buffers_come_back_without_a_gc_pass(tmp_path: Path, answer: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the caller drops the results, every read buffer is back at once: no deferred read's error (nor the
    OSError behind it) and no worker-thread future may still hold one. ``answer``: what a nowait read gets
    (0: the real page cache)."""
    import gc

    if answer and not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT here: the cache pass is off")
    real = os.preadv

    def refusing(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if flags:
            raise OSError(answer, os.strerror(answer))
        return real(fd, buffers, offset, flags)

    if answer:
        monkeypatch.setattr(os, "preadv", refusing)
    tier = await disk(tmp_path, capacity=1 << 26)
    await tier.put([(key(i), rand((5000,), seed=i)) for i in range(4)])
    gc.disable()
    try:
        got = await tier.get([key(i) for i in range(4)])
        assert all(g is not None for g in got)
        del got
        assert not tier._buffers._out  # every buffer of both passes is back, no collection needed
        assert tier._buffers.idle_bytes > 0
    finally:
        gc.enable()


async def test_records_outside_the_page_cache_are_read_by_waiting_streams(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The page-cache pass defers a record whose read would wait (EAGAIN) or came back short; the waiting pass
    reads it whole. The kernel's answer is emulated per file: a dropped file's RWF_NOWAIT read starts
    readahead and succeeds whenever that completes in time, so real drops give no fixed split."""
    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT here: the cache pass is off")
    tier = await disk(tmp_path, capacity=1 << 26)
    values = [rand((20_000 + i,), seed=i) for i in range(12)]
    await tier.put([(key(i), v) for i, v in enumerate(values)])
    blocked = {tier.layout.path(key(i)) for i in (0, 4)}
    short = {tier.layout.path(key(i)) for i in (7, 11)}
    real = os.preadv

    def nowait_as_if_cold(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if flags and path in blocked:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        if flags and path in short:
            return real(fd, [memoryview(buffers[0])[:4096]], offset, flags)  # only the first page cached
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", nowait_as_if_cold)
    got = await tier.get([key(i) for i in range(12)])
    for g, v in zip(got, values, strict=True):
        assert_same(g, v)
    stats = tier.stats()
    assert (stats.extra["reads_cached"], stats.extra["reads_waited"]) == (8, 4)
    assert stats.errors == 0 and stats.corrupt == 0 and tier._nowait


async def test_reads_after_a_real_page_cache_drop_return_the_records(tmp_path: Path) -> None:
    tier = await disk(tmp_path, capacity=1 << 26)
    values = [rand((20_000 + i,), seed=i) for i in range(12)]
    await tier.put([(key(i), v) for i, v in enumerate(values)])
    drop_page_cache([tier.layout.path(key(i)) for i in range(0, 12, 3)])
    got = await tier.get([key(i) for i in range(12)])
    for g, v in zip(got, values, strict=True):
        assert_same(g, v)
    stats = tier.stats()
    assert stats.extra.get("reads_cached", 0) + stats.extra.get("reads_waited", 0) in (0, 12)
    assert stats.errors == 0 and stats.corrupt == 0


async def test_a_file_system_refusing_nowait_reads_turns_the_cache_pass_off(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Some file systems answer RWF_NOWAIT with EOPNOTSUPP: every record is then read the waiting way, no
    error counted, and the tier stops trying."""
    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT here: the cache pass is off from the start")
    real = os.preadv

    def refusing(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if flags:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", refusing)
    tier = await disk(tmp_path, capacity=1 << 26)
    await tier.put([(key(i), rand((5000,), seed=i)) for i in range(5)])
    got = await tier.get([key(i) for i in range(5)])
    for i, g in enumerate(got):
        assert_same(g, rand((5000,), seed=i))
    assert tier.stats().errors == 0 and tier.stats().corrupt == 0
    assert not tier._nowait and tier.stats().extra["reads_waited"] == 5
    again = await tier.get([key(0)])
    assert_same(again[0], rand((5000,), seed=0))
    assert tier.stats().extra["reads_waited"] == 6 and tier.stats().extra.get("reads_cached", 0) == 0


async def test_a_record_rewritten_with_another_size_is_read_whole(tmp_path: Path) -> None:
    """Small records of one get share a buffer sized from the index; a file another process rewrote with
    another size since gets a buffer of its own."""
    tier = await disk(tmp_path, capacity=1 << 26)
    await tier.put([(key(i), rand((3000,), seed=i)) for i in range(4)])
    other = await disk(tmp_path, capacity=1 << 26)  # a second process sharing the directory
    await other.put([(key(2), rand((7000,), seed=77))])
    got = await tier.get([key(i) for i in range(4)])
    assert_same(got[2], rand((7000,), seed=77))
    for i in (0, 1, 3):
        assert_same(got[i], rand((3000,), seed=i))
    assert tier.stats().corrupt == 0


@pytest.mark.parametrize("hmac_key", [None, b"k1"])
async def test_a_batch_of_equal_records_lands_evenly_spaced_in_one_buffer(tmp_path: Path, hmac_key: bytes | None) -> None:
    """A get of records of one size (a group's chunks) reads each payload straight into its slot of one buffer,
    one slot apart, as records lie in consecutive memory slots: the copy into the engine's blocks then takes the
    few-index-ops path (kvtier.kvcopy.paged). A wrongly signed record in the batch is still a miss."""
    tier = await disk(tmp_path, capacity=1 << 26, hmac_key=hmac_key)
    shape = (4, 2, 3000)  # 96,000 bytes: slots round up to 98,304
    await tier.put([(key(i), rand(shape, seed=i)) for i in range(5)])
    got = await tier.get([key(i) for i in range(5)])
    for i, value in enumerate(got):
        assert value is not None
        assert_same(value, rand(shape, seed=i))
    assert len({v.untyped_storage().data_ptr() for v in got if v is not None}) == 1
    starts = [v.data_ptr() for v in got if v is not None]
    assert {b - a for a, b in itertools.pairwise(starts)} == {slot_aligned(96_000)} and starts[0] % 4096 == 0
    assert spacing([v for v in got if v is not None]) == slot_aligned(96_000) // 4
    if hmac_key is not None:
        forger = await disk(tmp_path, capacity=1 << 26, hmac_key=b"k2")  # same size, another key: a forgery
        await forger.put([(key(2), rand(shape, seed=99))])
        again = await tier.get([key(i) for i in range(5)])
        assert again[2] is None and tier.stats().corrupt == 1
        assert all(again[i] is not None for i in (0, 1, 3, 4))
