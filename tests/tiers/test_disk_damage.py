"""Damaged disk records: a damaged or swapped record is a miss, removed and counted; invalid and stale
temporary files are dropped at start; a corrupt read's buffer is recycled at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from contract import assert_same, key, rand
from disk_helpers import disk, record_files

from kvtier.errors import CorruptRecord
from kvtier.records import codec
from kvtier.records.codec import HEADER_SIZE, MAC_BYTES
from kvtier.tiers.disk.io import READ_PIECE, read_into_slot
from kvtier.tiers.memory.recycle import Recycler


@pytest.mark.parametrize("equal", [False, True])
@pytest.mark.parametrize("where", ["first_piece", "middle_piece", "last_byte", "append"])
async def test_damage_anywhere_in_a_large_record_is_a_miss(tmp_path: Path, where: str, equal: bool) -> None:
    """Records over READ_PIECE are hashed piece by piece as they are read: a flip in any piece is caught, whether
    the record is read whole into a buffer of its own or (``equal``: a batch of records of one size) its payload
    into a slot of the batch's buffer."""
    assert READ_PIECE < 3 << 20
    tier = await disk(tmp_path, capacity=1 << 26)
    big = rand((3 << 20) // 4 + 17, seed=5)  # 3 MiB + 68 bytes: several unequal pieces' worth
    other = rand(big.shape if equal else (1000,), seed=1)
    await tier.put([(key(0), big), (key(1), other)])
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
    assert_same(got[0], other)


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


def test_a_forged_unsigned_record_never_writes_past_its_slot(tmp_path: Path) -> None:
    """With signing on, an unsigned record forged at a signed record's file size has a payload one MAC longer than
    the slot a batch read gives it: it is read into a buffer of its own and refused, and the next slot, which may
    already hold a payload verified and handed out, keeps its bytes."""
    payload = 8192  # a whole number of slot pages: the slots lie exactly one payload apart
    forged = codec.encode_bytes(key(1), rand(((payload + MAC_BYTES) // 4,), seed=9).numpy(), "float32",
                                ((payload + MAC_BYTES) // 4,))
    assert len(forged) == HEADER_SIZE + MAC_BYTES + payload  # the size of the signed record the index expects
    path = tmp_path / "forged.kvt"
    path.write_bytes(forged)
    slots = Recycler(1 << 20).take_slots(2, payload)
    memory, after, _ = slots[1]
    memory[after:after + payload] = 7  # the next record, already read
    with pytest.raises(CorruptRecord, match="unsigned"):
        read_into_slot(str(path), key(1), b"k1", 1 << 26, slots[0], len(forged))
    assert bool((memory[after:after + payload] == 7).all())
