"""The disk tier: the shared contract, layout, persistence, corruption, quota, signing and compression."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from contract import TierContract, assert_same, key, rand

from kvtier.bench.measure import drop_page_cache
from kvtier.codec import HEADER_SIZE, MAC_BYTES
from kvtier.config import DiskTierConfig
from kvtier.errors import ConfigError
from kvtier.tiers import make_tier
from kvtier.tiers.base import Tier
from kvtier.tiers.disk.io import READ_PIECE, READ_STREAMS
from kvtier.tiers.disk.tier import DiskTier

REPO = Path(__file__).resolve().parents[2]


class TestDiskContract(TierContract):
    persistent = True

    async def build(self, env: Any, capacity: int, name: str) -> Tier:
        tier = make_tier(DiskTierConfig(name=name, capacity=capacity, path=str(env / name)))
        await tier.start()
        return tier


class TestDiskContractCompressedSigned(TierContract):
    persistent = True
    exact_size = False  # compression makes files smaller than stored_size()

    async def build(self, env: Any, capacity: int, name: str) -> Tier:
        section = DiskTierConfig(name=name, capacity=capacity, path=str(env / name), compression="lz4", fsync=True)
        tier = make_tier(section, hmac_key=b"secret")
        await tier.start()
        return tier


async def disk(path: Path, capacity: int = 1 << 24, **kw: Any) -> DiskTier:
    hmac_key = kw.pop("hmac_key", None)
    tier = DiskTier(DiskTierConfig(name="disk", capacity=capacity, path=str(path), **kw), hmac_key=hmac_key)
    await tier.start()
    return tier


def record_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvt"))


def test_path_is_required() -> None:
    with pytest.raises(ConfigError, match=r"tiers\.d\.path"):
        DiskTier(DiskTierConfig(name="d", capacity=1))


async def test_layout_and_directory_modes(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier = await disk(root, shard_depth=2)
    k = key(1)
    await tier.put([(k, rand((100,)))])
    [f] = record_files(root)
    digest = k[16:].hex()
    assert f == root / k[:16].hex() / digest[:2] / digest[2:4] / f"{k.hex()}.kvt"
    assert f.stat().st_size == HEADER_SIZE + 400 == tier.used_bytes()
    d = f.parent
    while d != tmp_path:  # the root and every level below it
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, (d, oct(d.stat().st_mode))
        d = d.parent
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert not list(root.rglob("*.tmp"))


async def test_persistence_across_processes(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    code = f"""
import asyncio, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from contract import key, rand
from kvtier.config import DiskTierConfig
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.disk.io import READ_PIECE, READ_STREAMS
async def main():
    t = DiskTier(DiskTierConfig(name="d", capacity=1 << 24, path={str(root)!r}))
    await t.start()
    assert await t.put([(key(i), rand((8, 64), seed=i)) for i in range(5)]) == [True] * 5
    await t.close()
asyncio.run(main())
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)
    tier = await disk(root)
    assert sorted(e.key for e in tier.entries()) == sorted(key(i) for i in range(5))
    assert tier.used_bytes() == sum(e.size for e in tier.entries()) == 5 * (HEADER_SIZE + 2048)
    assert await tier.contains([key(0), key(9)]) == [True, False]
    for i, got in enumerate(await tier.get([key(i) for i in range(5)])):
        assert_same(got, rand((8, 64), seed=i))


async def test_entries_are_oldest_first(tmp_path: Path) -> None:
    tier = await disk(tmp_path)
    for i in range(3):
        await tier.put([(key(i), rand((16,), seed=i))])
    paths = record_files(tmp_path)
    for n, i in enumerate((2, 0, 1)):  # make key 2 the oldest
        p = next(p for p in paths if p.name.startswith(key(i).hex()))
        os.utime(p, (time.time() - 100 + n, time.time() - 100 + n))
    again = await disk(tmp_path)
    assert [e.key for e in again.entries()] == [key(2), key(0), key(1)]


@pytest.mark.parametrize("where", ["first_piece", "middle_piece", "last_byte", "append"])
async def test_damage_anywhere_in_a_large_record_is_a_miss(tmp_path: Path, where: str) -> None:
    """Records over READ_PIECE are hashed piece by piece as they are read: a flip in any piece is caught."""
    assert READ_PIECE < 3 << 20
    tier = await disk(tmp_path, capacity=1 << 26)
    big = rand((3 << 20) // 4 + 17, seed=5)  # 3 MiB + 68 bytes: several unequal pieces' worth
    await tier.put([(key(0), big), (key(1), rand((1000,), seed=1))])
    path = next(p for p in record_files(tmp_path) if p.name.startswith(key(0).hex()))
    data = bytearray(path.read_bytes())
    if where == "first_piece":
        data[HEADER_SIZE] ^= 0x01
    elif where == "middle_piece":
        data[len(data) // 2] ^= 0x80
    elif where == "last_byte":
        data[-1] ^= 0x01
    else:
        data += b"x"
    path.write_bytes(bytes(data))
    got = await tier.get([key(1), key(0)])
    assert got[1] is None and tier.stats().corrupt == 1
    assert_same(got[0], rand((1000,), seed=1))


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


@pytest.mark.parametrize("damage", ["bitflip_payload", "bitflip_header", "truncate", "empty", "swap_key"])
async def test_damaged_record_is_a_miss_removed_and_counted(tmp_path: Path, damage: str) -> None:
    tier = await disk(tmp_path)
    await tier.put([(key(0), rand((1000,))), (key(1), rand((1000,), seed=1))])
    path = next(p for p in record_files(tmp_path) if p.name.startswith(key(0).hex()))
    data = bytearray(path.read_bytes())
    if damage == "bitflip_payload":
        data[HEADER_SIZE + 123] ^= 0x10
    elif damage == "bitflip_header":
        data[40] ^= 0x01
    elif damage == "truncate":
        data = data[:-7]
    elif damage == "empty":
        data = bytearray()
    else:  # a valid record of another key under this key's name
        other = next(p for p in record_files(tmp_path) if p.name.startswith(key(1).hex()))
        data = bytearray(other.read_bytes())
    path.write_bytes(bytes(data))
    got = await tier.get([key(0), key(1)])
    assert got[0] is None
    assert_same(got[1], rand((1000,), seed=1))
    assert tier.stats().corrupt == 1
    assert not path.exists()
    assert await tier.contains([key(0)]) == [False]
    assert tier.used_bytes() == HEADER_SIZE + 4000


async def test_invalid_files_are_dropped_at_start(tmp_path: Path) -> None:
    tier = await disk(tmp_path)
    await tier.put([(key(i), rand((500,), seed=i)) for i in range(4)])
    files = record_files(tmp_path)
    files[0].write_bytes(files[0].read_bytes()[:-1])  # truncated
    raw = bytearray(files[1].read_bytes())
    raw[5] ^= 0xFF  # header bit flips
    files[1].write_bytes(bytes(raw))
    junk = files[2].parent / ("ab" * 32 + ".kvt")
    junk.write_bytes(b"not a record")
    again = await disk(tmp_path)
    assert len(list(again.entries())) == 2 and again.stats().corrupt == 3
    assert not files[0].exists() and not files[1].exists() and not junk.exists()
    for e in again.entries():
        [got] = await again.get([e.key])
        assert got is not None


async def test_stale_temp_files_are_removed_at_start(tmp_path: Path) -> None:
    tier = await disk(tmp_path)
    await tier.put([(key(0), rand((10,)))])
    final = record_files(tmp_path)[0]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = [Path(f"{final}.{int(dead.stdout)}.abcd1234.tmp"), Path(f"{final}.{os.getpid()}.abcd1234.tmp")]
    old_live = Path(f"{final}.1.deadbeef.tmp")  # pid 1 is alive, but the file is an hour old
    live = Path(f"{final}.1.cafe0000.tmp")  # pid 1 and fresh: a write in flight elsewhere, kept
    for p in [*stale, old_live, live]:
        p.write_bytes(b"partial")
    os.utime(old_live, (time.time() - 3600, time.time() - 3600))
    again = await disk(tmp_path)
    assert [p.exists() for p in [*stale, old_live, live]] == [False, False, False, True]
    assert again.stats().extra["temp_removed"] == 3
    assert [e.key for e in again.entries()] == [key(0)]


async def test_quota_counts_whole_files_and_is_enforced_at_start(tmp_path: Path) -> None:
    size = HEADER_SIZE + 4096
    tier = await disk(tmp_path, capacity=3 * size)
    assert await tier.put([(key(i), rand((1024,), seed=i)) for i in range(4)]) == [True] * 3 + [False]
    assert tier.used_bytes() == 3 * size == sum(p.stat().st_size for p in record_files(tmp_path))
    smaller = await disk(tmp_path, capacity=2 * size)  # the quota was lowered: oldest dropped
    assert smaller.used_bytes() <= 2 * size and len(record_files(tmp_path)) == 2
    assert smaller.stats().evictions == 1


async def test_signed_records(tmp_path: Path) -> None:
    signer = await disk(tmp_path, hmac_key=b"k1")
    t = rand((300,))
    await signer.put([(key(0), t)])
    assert signer.used_bytes() == HEADER_SIZE + MAC_BYTES + 1200 == signer.stored_size(1200)
    assert_same((await (await disk(tmp_path, hmac_key=b"k1")).get([key(0)]))[0], t)
    wrong = await disk(tmp_path, hmac_key=b"k2")
    assert await wrong.get([key(0)]) == [None] and wrong.stats().corrupt == 1
    plain = await disk(tmp_path / "plain")
    await plain.put([(key(1), t)])
    strict = await disk(tmp_path / "plain", hmac_key=b"k1")
    assert await strict.get([key(1)]) == [None] and strict.stats().corrupt == 1  # unsigned refused


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
async def test_compression_shrinks_files(tmp_path: Path, compression: str) -> None:
    tier = await disk(tmp_path, compression=compression)
    t = torch.zeros(64, 1024, dtype=torch.bfloat16)
    t[:, :8] = 1.5
    await tier.put([(key(0), t)])
    assert tier.used_bytes() < tier.stored_size(t.numel() * 2) // 4
    assert_same((await (await disk(tmp_path)).get([key(0)]))[0], t)


async def test_file_removed_behind_our_back_is_a_miss(tmp_path: Path) -> None:
    tier = await disk(tmp_path)
    await tier.put([(key(0), rand((10,)))])
    record_files(tmp_path)[0].unlink()
    assert await tier.get([key(0)]) == [None]
    assert tier.used_bytes() == 0 and await tier.contains([key(0)]) == [False]
    assert tier.stats().corrupt == 0


async def test_reads_records_written_by_another_process_after_start(tmp_path: Path) -> None:
    reader = await disk(tmp_path)
    writer = await disk(tmp_path)
    await writer.put([(key(3), rand((64,), seed=3))])
    assert await reader.contains([key(3)]) == [False]  # contains answers from the index
    assert_same((await reader.get([key(3)]))[0], rand((64,), seed=3))
    assert await reader.contains([key(3)]) == [True]
    assert await reader.delete([key(3)]) == 1 and not record_files(tmp_path)


async def test_a_key_twice_in_one_put_keeps_the_last_value_and_an_exact_index(tmp_path: Path) -> None:
    tier = await disk(tmp_path)
    small, big = rand((10,)), rand((1000,), seed=1)
    assert await tier.put([(key(0), small), (key(0), big)]) == [True, True]
    assert_same((await tier.get([key(0)]))[0], big)
    assert tier.used_bytes() == HEADER_SIZE + 4000 == record_files(tmp_path)[0].stat().st_size


async def test_a_corrupt_reads_buffer_is_recycled_without_a_gc_pass(tmp_path: Path) -> None:
    """The error kept for a corrupt record must not hold the read buffer through its traceback."""
    import gc

    tier = await disk(tmp_path)
    await tier.put([(key(0), rand((5000,)))])
    path = record_files(tmp_path)[0]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    gc.disable()
    try:
        assert await tier.get([key(0)]) == [None]
        assert tier._buffers.idle_bytes > 0  # back on the free list at once
    finally:
        gc.enable()


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


async def test_a_tier_at_a_shared_path_leaves_the_rank_directories_alone(tmp_path: Path) -> None:
    """Tensor-parallel ranks keep their records in <path>/tp<rank>-of-<size>: a tier opened at <path> itself
    (another engine, a benchmark) neither adopts nor moves them."""
    rank = await disk(tmp_path / "tp1-of-2")
    await rank.put([(key(i), rand((100,), seed=i)) for i in range(3)])
    before = sorted(p.relative_to(tmp_path) for p in record_files(tmp_path / "tp1-of-2"))
    bare = await disk(tmp_path)
    assert list(bare.entries()) == [] and bare.used_bytes() == 0
    assert sorted(p.relative_to(tmp_path) for p in record_files(tmp_path / "tp1-of-2")) == before
    assert_same((await rank.get([key(2)]))[0], rand((100,), seed=2))


async def test_one_put_writes_its_records_in_one_background_thread_and_a_failed_one_drops_alone(
        tmp_path: Path) -> None:
    """A batch goes to the tier's single writer thread (nice 19, so that the engine's threads run first); an
    OSError on one record (its shard directory is a file here) drops that record only."""
    import threading

    tier = DiskTier(DiskTierConfig(name="batchwriter", capacity=1 << 24, path=str(tmp_path / "d")))
    await tier.start()
    keys = [key(i) for i in range(5)]
    values = [rand((64,), seed=i) for i in range(5)]
    blocked = Path(tier.layout.path(keys[2])).parent
    blocked.parent.mkdir(parents=True, exist_ok=True)
    blocked.write_bytes(b"not a directory")
    assert await tier.put(list(zip(keys, values, strict=True))) == [True, True, False, True, True]
    assert tier.stats().errors == 1 and tier.stats().puts == 4
    got = await tier.get(keys)
    assert got[2] is None
    for g, v in zip(got[:2] + got[3:], values[:2] + values[3:], strict=True):
        assert_same(g, v)
    writers = [t for t in threading.enumerate() if t.name.startswith("kvtier-disk-batchwriter")]
    assert len(writers) == 1
    if sys.platform == "linux":
        assert os.getpriority(os.PRIO_PROCESS, writers[0].native_id or 0) == 19
    await tier.close()



async def test_overlapping_puts_of_shared_keys_wait_for_each_other_and_settle_exactly(tmp_path: Path) -> None:
    """Puts in flight at once whose batches share keys (A=[k2], B=[k1, k2], C=[k1]): each waits for the others'
    writes of its keys before claiming them, nothing deadlocks or loses a claim, and the index and quota match
    the files (a key's last writer wins)."""
    import asyncio

    tier = await disk(tmp_path)
    a = [(key(2), rand((256,), seed=1))]
    b = [(key(1), rand((300,), seed=2)), (key(2), rand((400,), seed=3))]
    c = [(key(1), rand((500,), seed=4))]
    done = await asyncio.wait_for(asyncio.gather(tier.put(a), tier.put(b), tier.put(c)), 30)
    assert done == [[True], [True, True], [True]]
    assert tier._reserved == 0 and not tier._writing
    got = await tier.get([key(1), key(2)])
    assert_same(got[0], b[0][1])  # B waited for C's write of k1, then wrote it
    assert_same(got[1], b[1][1])
    assert tier.used_bytes() == sum(p.stat().st_size for p in record_files(tmp_path))
    await tier.close()
