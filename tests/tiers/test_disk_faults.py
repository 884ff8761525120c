"""Disk tier under faults, with real processes and files: SIGKILL mid-write, two processes sharing one
directory, and a full filesystem."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from contract import assert_same, key, rand

from kvtier.config import DiskTierConfig
from kvtier.tiers.disk.tier import DiskTier

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PRELUDE = f"""
import asyncio, json, random, sys
sys.path.insert(0, {str(HERE)!r})
from contract import key, rand, raw
from kvtier.config import DiskTierConfig
from kvtier.tiers.disk.tier import DiskTier
def shape(i): return (64 + i % 7, 1024)  # 256-283 KiB records, content derived from the key index
"""

WRITER = PRELUDE + """
async def main(root):
    t = DiskTier(DiskTierConfig(name="d", capacity=1 << 34, path=root, fsync=True))
    await t.start()
    i = 0
    while True:  # fsync widens the window in which a kill lands mid-write
        [ok] = await t.put([(key(i), rand(shape(i), seed=i))])
        print(i if ok else -1, flush=True)
        i += 1
asyncio.run(main(sys.argv[1]))
"""

SHARER = PRELUDE + """
async def main(root, me, n):
    t = DiskTier(DiskTierConfig(name="d", capacity=1 << 34, path=root))
    await t.start()
    rng = random.Random(me)
    stats = {"puts": 0, "hits": 0, "misses": 0, "wrong": 0, "deletes": 0}
    for step in range(n):
        i = rng.randrange(40)
        op = rng.random()
        if op < 0.45:
            stats["puts"] += (await t.put([(key(i), rand(shape(i), seed=i))]))[0]
        elif op < 0.9:
            [got] = await t.get([key(i)])
            if got is None:
                stats["misses"] += 1
            elif raw(got) == raw(rand(shape(i), seed=i)) and tuple(got.shape) == shape(i):
                stats["hits"] += 1
            else:
                stats["wrong"] += 1
        else:
            stats["deletes"] += await t.delete([key(i)])
    await t.close()
    stats["corrupt"] = t.stats().corrupt
    print(json.dumps(stats))
asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


def shape(i: int) -> tuple[int, int]:
    return (64 + i % 7, 1024)


async def reopen(root: Path, capacity: int = 1 << 34) -> DiskTier:
    tier = DiskTier(DiskTierConfig(name="d", capacity=capacity, path=str(root)))
    await tier.start()
    return tier


async def assert_all_entries_exact(tier: DiskTier) -> set[bytes]:
    keys = {e.key for e in tier.entries()}
    index = {key(i): i for i in range(10_000)}
    for e in tier.entries():
        [got] = await tier.get([e.key])
        i = index[e.key]
        assert_same(got, rand(shape(i), seed=i))
    assert tier.stats().corrupt == 0
    return keys


def run_writer_and_kill(root: Path, after: int) -> set[int]:
    """Start a writer, SIGKILL it once ``after`` records are acknowledged; return the acknowledged ones."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    done: set[int] = set()
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while len(done) < after and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if int(line) >= 0:
            done.add(int(line))
    time.sleep(0.003 * after % 0.02)  # land the kill at varying points of the next write
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    # acknowledgements printed before the kill: read through the same buffered stream as readline() above
    # (communicate() with a timeout reads the raw pipe and would drop lines readline() had buffered ahead)
    rest, err = proc.stdout.read(), (proc.stderr.read() if proc.stderr else "")
    done |= {int(line) for line in rest.split() if int(line) >= 0}
    assert len(done) >= after, f"writer did not make progress: {err[-2000:]}"
    return done


@pytest.mark.parametrize("after", [5, 23, 40])
async def test_sigkill_mid_write_never_serves_a_partial_record(tmp_path: Path, after: int) -> None:
    acked = run_writer_and_kill(tmp_path, after)
    tier = await reopen(tmp_path)
    keys = await assert_all_entries_exact(tier)
    names = {k: i for i, k in enumerate(key(i) for i in range(10_000))}
    assert {key(i) for i in acked} <= keys, sorted(acked - {names[k] for k in keys})  # all acknowledged survived
    assert len(keys) <= len(acked) + 1, (sorted(acked), sorted(names[k] for k in keys))  # + the one in flight
    assert not list(tmp_path.rglob("*.tmp")), tier.stats()  # the dead writer's temp file was cleaned
    assert tier.used_bytes() == sum(p.stat().st_size for p in tmp_path.rglob("*.kvt"))


async def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", SHARER, str(tmp_path), str(me), "300"], cwd=REPO,
                              stdout=subprocess.PIPE, text=True) for me in (1, 2)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["wrong"] == 0 and r["corrupt"] == 0 for r in results), results
    assert sum(r["hits"] for r in results) > 0 and sum(r["puts"] for r in results) > 0
    tier = await reopen(tmp_path)
    await assert_all_entries_exact(tier)
    assert not list(tmp_path.rglob("*.tmp"))


async def test_full_filesystem_drops_writes_and_keeps_reads(tiny_fs: Path) -> None:
    tier = await reopen(tiny_fs)
    results = []
    for i in range(6):  # 256+ KiB each into a 1 MiB filesystem
        results += await tier.put([(key(i), rand(shape(i), seed=i))])
    assert results[:3] == [True] * 3 and False in results
    assert tier.stats().errors == results.count(False)
    assert tier.stats().puts_refused == 0  # within the quota: a filesystem error, not a refusal
    assert not list(tiny_fs.rglob("*.tmp"))
    stored = [i for i, ok in enumerate(results) if ok]
    for i in stored:
        assert_same((await tier.get([key(i)]))[0], rand(shape(i), seed=i))
    assert tier.used_bytes() == sum(p.stat().st_size for p in tiny_fs.rglob("*.kvt"))
    assert await tier.delete([key(stored[0])]) == 1
    assert await tier.put([(key(99), rand(shape(0), seed=99))]) == [True]  # space came back


async def test_quota_refusals_when_disk_is_small(tmp_path: Path) -> None:
    tier = await reopen(tmp_path, capacity=600 << 10)
    results = await tier.put([(key(i), rand(shape(i), seed=i)) for i in range(4)])
    assert results.count(True) == 2 and tier.stats().puts_refused == 2 and tier.stats().errors == 0
    assert tier.used_bytes() <= 600 << 10
