"""The disk tier: the shared contract, layout, persistence, quota, signing, compression and the writer."""

from __future__ import annotations

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
from disk_helpers import disk, record_files

from kvtier.config import DiskTierConfig
from kvtier.errors import ConfigError
from kvtier.records.codec import HEADER_SIZE, MAC_BYTES
from kvtier.tiers import make_tier
from kvtier.tiers.base import Tier
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
