"""Why kvtier reads disk records with ``os.preadv`` in a thread, not with aiofiles: the ways to read a hit's records
from files in the page cache into the buffer that the copy into the engine's blocks takes, side by side, in one run.

For each record size (1, 4 and 32 MiB; ``--mib`` per batch, 32 MiB by default: a 2048-token hit of an 8B model's
chunk layout), the same payloads lie in plain files and in a kvtier disk tier. Each round reads the whole batch
into evenly spaced slots of one touched buffer, every way in turn (the order rotates every round), and the medians
over ``--reps`` rounds are reported:

* ``aiofiles read + copy``: ``aiofiles.open`` then ``read()`` per file, gathered on the event loop, each reply
  copied into its slot (a ``read()`` makes a new bytes object; aiofiles runs each call in a thread pool);
* ``aiofiles readinto``: the same, but ``readinto`` straight into the slot (one pool hop per call);
* ``pread + copy``: ``os.pread`` per file into a new bytes object, then a copy into its slot, the whole batch in
  one thread (one hop);
* ``preadv into slots``: ``os.preadv`` straight into each slot, the batch in one thread (kvtier's way);
* ``preadv + xxh3``: the same, then the xxh3-64 of each payload (the checksum a kvtier record carries);
* ``kvtier DiskTier.get``: the tier's own get of the same records: ``preadv`` into slots plus the header read, the
  xxh3 checksum and the index (what a hit pays);
* ``LMCache LocalDiskBackend get``: LMCache 0.5.6's local disk backend (``benchmarks/lmcache_peer.py``), the same
  payloads put into it first, read back into LMCache's CPU memory: ``readinto`` per file on its pool of I/O
  threads, no checksum. When LMCache is installed (``--lmcache``; without it the row is left out, with a note).

Besides wall time, each way's CPU time (this process's, every thread: the aiofiles ways read their files on
several pool threads at once, the others in one thread). Every way's bytes are checked against the payloads once,
outside the timed rounds. Prints a table and writes ``benchmarks/results/disk_read.json`` (its page:
docs/benchmarks/disk.md). Without aiofiles installed (``pip install aiofiles``; the ``dev`` extra has it) its rows
are left out and the rest is measured.

    .venv/bin/python benchmarks/disk_read.py [--reps 15] [--mib 32] [--sizes 1 4 32] [--out FILE] [--lmcache DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvtier from this checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402

from benchmarks import lmcache_peer  # noqa: E402
from benchmarks.script_run import run_checked, unwritable  # noqa: E402
from kvtier.bench.output import machine_info  # noqa: E402
from kvtier.config import DiskTierConfig  # noqa: E402
from kvtier.ops.argtypes import positive_int  # noqa: E402
from kvtier.ops.cli import KvtierParser  # noqa: E402
from kvtier.records.keys import Key  # noqa: E402
from kvtier.tiers.disk.tier import DiskTier  # noqa: E402

MIB = 1 << 20
BASE = "preadv into slots"
PEER = "LMCache LocalDiskBackend get"
Read = Callable[[], Awaitable[Any]]  # one batch read: the buffer that holds the payloads, or the payloads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=positive_int, default=15, help="rounds (medians reported)")
    parser.add_argument("--mib", type=positive_int, default=32, help="MiB per batch and size")
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=[1, 4, 32], help="record sizes in MiB")
    parser.add_argument("--lmcache", type=Path, default=None,
                        help="folder LMCache 0.5.6 was installed into with pip --target (default: .peers/lmcache "
                             "when present; without LMCache its row is left out)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "disk_read.json")


def _aiofiles_ways(paths: list[str], dest: torch.Tensor, size: int) -> dict[str, Read]:
    import aiofiles

    array = dest.numpy()
    async def read_copy() -> torch.Tensor:
        async def one(i: int, path: str) -> None:
            async with aiofiles.open(path, "rb") as f:
                data = await f.read()
            array[i * size:(i + 1) * size] = np.frombuffer(data, dtype=np.uint8)
        await asyncio.gather(*(one(i, p) for i, p in enumerate(paths)))
        return dest

    async def read_into() -> torch.Tensor:
        view = array.data

        async def one(i: int, path: str) -> None:
            async with aiofiles.open(path, "rb", buffering=0) as f:
                got = 0
                while got < size:
                    n = await f.readinto(view[i * size + got:(i + 1) * size])
                    if not n:
                        raise RuntimeError(f"{path} ended after {got} bytes")
                    got += n
        await asyncio.gather(*(one(i, p) for i, p in enumerate(paths)))
        return dest

    return {"aiofiles read + copy": read_copy, "aiofiles readinto": read_into}


def _thread_ways(paths: list[str], dest: torch.Tensor, size: int) -> dict[str, Read]:
    array = dest.numpy()
    view = array.data

    def pread_copy() -> torch.Tensor:
        for i, path in enumerate(paths):
            fd = os.open(path, os.O_RDONLY)
            try:
                data = os.pread(fd, size, 0)
            finally:
                os.close(fd)
            array[i * size:(i + 1) * size] = np.frombuffer(data, dtype=np.uint8)
        return dest

    def preadv() -> torch.Tensor:
        for i, path in enumerate(paths):
            fd = os.open(path, os.O_RDONLY)
            try:
                got = 0
                while got < size:
                    n = os.preadv(fd, [view[i * size + got:(i + 1) * size]], got)
                    if not n:
                        raise RuntimeError(f"{path} ended after {got} bytes")
                    got += n
            finally:
                os.close(fd)
        return dest

    def preadv_hashed() -> torch.Tensor:
        preadv()
        for i in range(len(paths)):
            xxhash.xxh3_64_intdigest(view[i * size:(i + 1) * size])
        return dest

    async def in_thread(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        return await asyncio.get_running_loop().run_in_executor(None, fn)

    return {"pread + copy": lambda: in_thread(pread_copy), BASE: lambda: in_thread(preadv),
            "preadv + xxh3": lambda: in_thread(preadv_hashed)}


async def _tier(root: str, payloads: list[torch.Tensor]) -> tuple[DiskTier, list[Key]]:
    capacity = sum(p.numel() for p in payloads) * 2 + 64 * MIB
    tier = DiskTier(DiskTierConfig(name="disk", capacity=capacity, path=root))
    await tier.start()
    keys = [hashlib.sha256(f"disk-read-{i}".encode()).digest() for i in range(len(payloads))]
    if not all(await tier.put(list(zip(keys, payloads, strict=True)))):
        raise RuntimeError("the disk tier did not store every record")
    return tier, keys


def _peer(size: int, payloads: list[torch.Tensor], work: str) -> lmcache_peer.LmcachePeer:
    """LMCache's local disk backend in a folder of its own under ``work``, the payloads written into it."""
    folder = os.path.join(work, f"lmcache-{size}")
    os.makedirs(folder)
    peer = lmcache_peer.LmcachePeer(size, len(payloads), disk=folder, name=f"disk-read-{size}")
    try:
        staged = peer.stage(payloads)
        peer.put(staged)
        peer.release(staged)
    except BaseException:
        peer.close()
        raise
    return peer


async def measure_size(size: int, count: int, reps: int, work: str,
                       peer: bool = False) -> dict[str, tuple[float, float]]:
    """Every way's median wall and CPU seconds (this process's, every thread) for ``count`` records of ``size``
    bytes, each way's bytes checked first; ``peer``: LMCache's local disk backend among them."""
    gen = torch.Generator().manual_seed(size)
    payloads = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen) for _ in range(count)]
    paths = []
    for i, payload in enumerate(payloads):
        paths.append(os.path.join(work, f"plain-{size}-{i}.bin"))
        Path(paths[-1]).write_bytes(payload.numpy().tobytes())
    dest = torch.ones(count * size, dtype=torch.uint8)  # touched: the first timed round pays no page faults
    tier, keys = await _tier(os.path.join(work, f"tier-{size}"), payloads)
    lmcache: lmcache_peer.LmcachePeer | None = None
    try:
        if peer:
            lmcache = _peer(size, payloads, work)
        return await _timed(_ways(paths, dest, size, tier, keys, lmcache), payloads, dest, reps, lmcache)
    finally:
        await tier.close()
        if lmcache is not None:
            lmcache.close()


def _ways(paths: list[str], dest: torch.Tensor, size: int, tier: DiskTier, keys: list[Key],
          lmcache: lmcache_peer.LmcachePeer | None) -> dict[str, Read]:
    """Every way of reading the batch, by name (aiofiles' when it is installed, LMCache's with ``lmcache``)."""

    async def kvtier_get() -> list[torch.Tensor | None]:
        return await tier.get(keys)  # views of one buffer's slots (of a record's own buffer, one record)

    async def lmcache_get() -> list[torch.Tensor]:
        assert lmcache is not None
        return lmcache.get()

    return {**(_aiofiles_ways(paths, dest, size) if importlib.util.find_spec("aiofiles") else {}),
            **_thread_ways(paths, dest, size), "kvtier DiskTier.get": kvtier_get,
            **({PEER: lmcache_get} if lmcache is not None else {})}


async def _timed(ways: dict[str, Read], payloads: list[torch.Tensor], dest: torch.Tensor, reps: int,
                 lmcache: lmcache_peer.LmcachePeer | None = None) -> dict[str, tuple[float, float]]:
    """Each way's bytes checked against the payloads, then its median wall and CPU seconds over ``reps`` rounds
    (the order of the ways rotates every round). LMCache's records of a get go back to its allocator after it,
    outside the timing, as kvtier's buffers go back to its pool when the results are dropped."""
    expected = torch.cat(payloads)
    for name, read in ways.items():  # every way reads right (and the page cache is warm)
        dest.zero_()
        got = await read()
        if isinstance(got, list):
            got = torch.cat([t.view(torch.uint8).reshape(-1) if t is not None else torch.empty(0) for t in got])
        if not torch.equal(got, expected):
            raise RuntimeError(f"{name} read other bytes than the payloads")
    wall: dict[str, list[float]] = {name: [] for name in ways}
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            t0, c0 = time.perf_counter(), time.process_time()
            await ways[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            if lmcache is not None:
                lmcache.release()
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in ways}


def table(result: dict[str, Any]) -> list[str]:
    seconds, cpu = result["seconds"], result["cpu_seconds"]
    width = max(len(name) for name in next(iter(seconds.values())))
    lines = [f"{'way':<{width}} " + " ".join(f"{size + ' MiB: wall, GB/s, x limit, CPU':>38}" for size in seconds)]
    for name in next(iter(seconds.values())):
        cells = [f"{seconds[size][name] * 1e3:6.2f} ms {result['bytes'][size] / seconds[size][name] / 1e9:5.1f} "
                 f"GB/s {seconds[size][name] / seconds[size][BASE]:4.2f}x {cpu[size][name] * 1e3:6.2f} ms"
                 for size in seconds]
        lines.append(f"{name:<{width}} " + " ".join(f"{c:>38}" for c in cells))
    return lines


async def run(args: argparse.Namespace) -> dict[str, Any]:
    found: dict[str, dict[str, tuple[float, float]]] = {}
    nbytes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-disk-read-") as work:
        for mib in args.sizes:
            count = max(1, args.mib // mib)
            found[str(mib)] = await measure_size(mib * MIB, count, args.reps, work, args.peer)
            nbytes[str(mib)] = count * mib * MIB
    result = {"batch_mib": args.mib, "reps": args.reps, "page_cache": "warm", "baseline": BASE, "bytes": nbytes,
              "seconds": {size: {n: t[0] for n, t in ways.items()} for size, ways in found.items()},
              "cpu_seconds": {size: {n: t[1] for n, t in ways.items()} for size, ways in found.items()},
              "aiofiles": importlib.util.find_spec("aiofiles") is not None,
              "lmcache": lmcache_peer.VERSION if args.peer else None, "machine": machine_info()}
    print("\n".join(table(result)))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = KvtierParser(prog="benchmarks/disk_read.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    need, args.peer = unwritable(args.out), False
    if need is None and not importlib.util.find_spec("aiofiles"):
        print("disk_read: aiofiles is not installed (pip install aiofiles): its ways are left out", file=sys.stderr)
    if need is None:
        args.peer, need = lmcache_peer.wanted(args.lmcache, "disk_read")

    def work() -> int:
        result = asyncio.run(run(args))
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"results: {args.out}")
        return 0

    return run_checked("disk_read", need, work)


if __name__ == "__main__":
    sys.exit(main())
