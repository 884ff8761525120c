"""The disk tier: one record file per key under a sharded directory, with a byte quota.

Lifecycle: ``DiskTier(section)`` -> ``await start()`` (creates the root 0700, removes stale temp files and
invalid records, rebuilds the index key -> file size from the headers; ``entries()`` then lists what an
earlier process left) -> ``contains`` (index only) / ``get`` / ``put`` / ``delete`` -> ``await close()`` (waits
for writes in flight).

Writes: encode (kvtier.codec, optional compression and HMAC) into a temp file in the target directory, fsync
when configured, ``os.replace``. The quota counts whole files; a put that would exceed it is refused. Any
OSError while writing (ENOSPC included) drops that write, removes the temp file and counts ``errors``.
Reads verify the key, checksum and signature; a corrupt or truncated file is a miss, deleted and counted in
``corrupt``; a file removed behind our back (another process sharing the directory) is a miss. The records of
one ``put`` are written one after another by the tier's single writer thread, at the lowest CPU priority
(``kvtier.runtime.background_thread``): one thread hop per batch, and the engine's threads run first.
Reads of one ``get``: small records (under ``SMALL_RECORD`` on average) first
go through one call that reads each only if the page cache holds all of it (``RWF_NOWAIT``); the rest, and
large records, go in at most ``READ_STREAMS`` calls (runs of records of similar size), so that a device has
several reads in flight. A read goes straight into the returned tensor's memory, recycled from results the
caller dropped (``kvtier.tiers.memory.recycle``: already touched, never reused while held, payload page-aligned; small
records of one call share a buffer), and hashes each piece as it arrives instead of in a second pass.
The index is only touched on the event loop thread, so it needs no lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Iterable, Sequence

import torch

from kvtier.codec import HEADER_SIZE, MAC_BYTES
from kvtier.config import DiskTierConfig, TierConfig
from kvtier.errors import ConfigError, CorruptRecord
from kvtier.keys import Key
from kvtier.metrics import DiskStats, Timer
from kvtier.runtime import background_thread
from kvtier.tiers.base import Tier, TierEntry
from kvtier.tiers.disk.index import DIR_MODE, Layout, scan
from kvtier.tiers.disk.io import (
    NOWAIT_FLAGS,
    READ_STREAMS,
    SMALL_RECORD,
    Deferred,
    ReadResult,
    read_records,
    write_record,
)
from kvtier.tiers.memory.recycle import DEFAULT_MAX_IDLE, Recycler

log = logging.getLogger(__name__)


class DiskTier(Tier):
    """Records as files under ``section.path`` within a quota of ``section.capacity`` bytes."""

    _stats: DiskStats

    def __init__(self, section: TierConfig, *, hmac_key: bytes | None = None) -> None:
        super().__init__(section.name, section.capacity)
        self._stats = DiskStats()
        if not isinstance(section, DiskTierConfig) or not section.path:
            raise ConfigError(f"tiers.{section.name}.path", "a disk tier needs a directory path")
        self.section = section
        self.layout = Layout(section.path, section.shard_depth)
        self.hmac_key = hmac_key
        self._index: dict[Key, int] = {}
        self._used = 0
        self._reserved = 0
        self._writing: dict[Key, asyncio.Future[None]] = {}
        self._writer_pool: concurrent.futures.ThreadPoolExecutor | None = None
        # read buffers reuse the memory of results callers dropped (fresh memory is slow on some VMs)
        self._buffers = Recycler(min(section.capacity, DEFAULT_MAX_IDLE))
        self._nowait = NOWAIT_FLAGS != 0  # the page-cache pass of ``get``; off where the file system refuses it

    async def start(self) -> None:
        """Create the root (0700) and rebuild the index from the files already there."""
        self.layout.forget_dirs()
        await asyncio.to_thread(self._create_root)
        result = await asyncio.to_thread(scan, self.layout, self.capacity_bytes)
        self._index = dict(result.entries)
        self._used = sum(self._index.values())
        self._stats.corrupt += result.corrupt
        self._stats.temp_removed += result.temp_removed
        if self._used > self.capacity_bytes:
            await self._trim_to_quota()
        log.info("disk tier %s: %d records, %d bytes in %s (%d invalid removed)", self.name, len(self._index),
                 self._used, self.layout.root, result.corrupt)

    def _create_root(self) -> None:
        if not os.path.isdir(self.layout.root):
            self.layout.make_dirs(self.layout.root)
            os.chmod(self.layout.root, DIR_MODE)

    async def _trim_to_quota(self) -> None:
        """Delete the oldest records until the quota holds (the quota was lowered since they were written)."""
        victims = []
        for key, size in self._index.items():
            if self._used <= self.capacity_bytes:
                break
            victims.append(key)
            self._used -= size
        for key in victims:
            del self._index[key]
        await asyncio.to_thread(self._unlink_many, victims)
        self._stats.evictions += len(victims)

    def entries(self) -> Iterable[TierEntry]:
        """Records present (oldest first after ``start``)."""
        return [TierEntry(k, s) for k, s in self._index.items()]

    async def close(self) -> None:
        """Wait for writes in flight; free idle read buffers. Idempotent."""
        while self._writing:
            await asyncio.gather(*self._writing.values(), return_exceptions=True)
        if self._writer_pool is not None:
            self._writer_pool.shutdown(wait=False)
            self._writer_pool = None
        self._buffers.clear()

    def used_bytes(self) -> int:
        return self._used

    def stats(self) -> DiskStats:
        return self._stats

    def stored_size(self, nbytes: int) -> int:
        """File size of an uncompressed record (an upper bound when compressing)."""
        return HEADER_SIZE + (MAC_BYTES if self.hmac_key else 0) + nbytes

    async def contains(self, keys: Sequence[Key]) -> list[bool]:
        found = [k in self._index for k in keys]
        self._stats.lookups += len(found)
        self._stats.hits += sum(found)
        return found

    async def get(self, keys: Sequence[Key]) -> list[torch.Tensor | None]:
        with Timer(self._stats, "get_seconds"):
            sizes = [self._index.get(k, 0) for k in keys]
            results: list[ReadResult | None] = [None] * len(keys)
            todo = list(range(len(keys)))
            if self._nowait and keys and sum(sizes) < SMALL_RECORD * len(keys):
                todo = await self._read_cached(keys, sizes, results)
            if todo:
                self._stats.reads_waited += len(todo)
                runs = self._read_runs([sizes[i] for i in todo])
                done: list[list[ReadResult]] = [[] for _ in runs]
                await asyncio.gather(*(self._read([keys[todo[j]] for j in run], [sizes[todo[j]] for j in run], False,
                                                  into) for run, into in zip(runs, done, strict=True)))
                for run, got in zip(runs, done, strict=True):
                    for j, result in zip(run, got, strict=True):
                        results[todo[j]] = result
            out = await self._settle(keys, results)
        hits = [t for t in out if t is not None]
        self._stats.gets += len(out)
        self._stats.get_hits += len(hits)
        self._stats.bytes_out += sum(t.numel() * t.element_size() for t in hits)
        return out

    async def _read_cached(self, keys: Sequence[Key], sizes: Sequence[int],
                           results: list[ReadResult | None]) -> list[int]:
        """The page-cache pass: read every record in one worker-thread call, each only if the page cache holds
        all of it (``RWF_NOWAIT``); fill ``results`` and return the indices left for waiting reads.

        Why: records in the page cache cost CPU only, and at small sizes mostly per-record Python work, which
        several threads on a few cores slow down (GIL hand-offs: 256 KiB reads measured 2.2 GB/s in one thread,
        1.9 in two, 1.3 in four); records that must come from the device still get ``READ_STREAMS`` reads in
        flight."""
        first: list[ReadResult] = []
        await self._read(keys, sizes, True, first)
        todo: list[int] = []
        for i, result in enumerate(first):
            if isinstance(result, Deferred):
                if result.unsupported and self._nowait:
                    log.info("disk tier %s: the file system refuses RWF_NOWAIT; reads no longer try the page "
                             "cache first", self.name)
                    self._nowait = False
                todo.append(i)
            else:
                results[i] = result
        read = sum(1 for result in results if result is not None and not isinstance(result, BaseException))
        self._stats.reads_cached += read
        return todo

    async def _read(self, keys: Sequence[Key], sizes: Sequence[int], nowait: bool, into: list[ReadResult]) -> None:
        """Read these records in a worker thread, appending the results to ``into``.

        The results never pass through a future's result: an executor future and its asyncio wrapper (and a
        gather and its tasks) reference each other through done callbacks, so a result they held would keep
        the read buffers from being recycled until a garbage collection found that cycle. (A test checks this
        with the collector off.)
        """
        paths = [self.layout.path(k) for k in keys]
        box: list[ReadResult] = []  # emptied at once: the worker may still hold the call (and this list) a moment
        await asyncio.to_thread(lambda: box.extend(read_records(paths, keys, self.hmac_key, self.capacity_bytes,
                                                                 self._buffers, sizes, nowait)))
        into.extend(box)
        box.clear()

    @staticmethod
    def _read_runs(sizes: Sequence[int]) -> list[list[int]]:
        """Positions split into at most ``READ_STREAMS`` consecutive runs of similar byte counts, one
        worker-thread call each.

        Measured on page-cached files (2 cores): one call per record runs at half the speed of a plain read
        loop (thread hops, and GIL hand-offs between many readers); a few streams keep it near the loop's speed
        and still give a device several reads in flight for uncached files.
        """
        share = -(-sum(max(n, 1) for n in sizes) // READ_STREAMS)
        runs: list[list[int]] = []
        filled = share
        for i, size in enumerate(sizes):
            if filled >= share:
                runs.append([])
                filled = 0
            runs[-1].append(i)
            filled += max(size, 1)
        return runs

    async def _settle(self, keys: Sequence[Key], results: Sequence[ReadResult | None]) -> list[torch.Tensor | None]:
        """Turn read results into tensors or misses: forget vanished records, delete corrupt ones, count errors,
        index records another process wrote."""
        out: list[torch.Tensor | None] = []
        corrupt: list[Key] = []
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, FileNotFoundError):
                self._forget(key)
                out.append(None)
            elif isinstance(result, CorruptRecord):
                log.warning("disk tier %s: corrupt record %s: %s", self.name, self.layout.path(key), result)
                self._forget(key)
                self._stats.corrupt += 1
                corrupt.append(key)
                out.append(None)
            elif isinstance(result, BaseException) or result is None:
                log.warning("disk tier %s: cannot read %s: %s", self.name, self.layout.path(key), result)
                self._stats.errors += 1
                out.append(None)
            else:
                tensor, size = result
                if key not in self._index:  # written by another process sharing the directory
                    if self._used + self._reserved + size <= self.capacity_bytes:
                        self._index[key] = size
                        self._used += size
                out.append(tensor)
        if corrupt:
            await asyncio.to_thread(self._unlink_many, corrupt)
        return out

    def _forget(self, key: Key) -> None:
        self._used -= self._index.pop(key, 0)

    async def put(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
        """Write records; ``puts`` counts written ones, ``puts_refused`` the ones over quota.

        The records of one call are written one after another by a single worker-thread call: on a few cores,
        one writer per record (threads handing the GIL and the cores back and forth) slowed the engine that
        produced them, and page-cache writes gain nothing from more threads."""
        with Timer(self._stats, "put_seconds"):
            if len({k for k, _ in items}) != len(items):  # a key twice: one by one, in order
                return [await self._put_batch([item]) == [True] for item in items]
            return await self._put_batch(items)

    async def _put_batch(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
        while any(key in self._writing for key, _ in items):  # no await between this check and the claims below
            for key, _ in items:
                await self._wait_writing(key)
        done = [False] * len(items)
        accepted = [i for i, (key, tensor) in enumerate(items) if self._reserve(key, tensor)]
        if not accepted:
            return done
        loop = asyncio.get_running_loop()
        waits = {items[i][0]: loop.create_future() for i in accepted}
        self._writing.update(waits)
        try:
            batch = [items[i] for i in accepted]
            sizes = await loop.run_in_executor(self._writer(), self._write_many, batch)
        finally:  # cancelled or not, the reservations end and waiters go on
            for i in accepted:
                key, tensor = items[i]
                self._reserved -= self.stored_size(tensor.numel() * tensor.element_size())
                if self._writing.get(key) is waits[key]:
                    del self._writing[key]
                waits[key].set_result(None)
        for i, size in zip(accepted, sizes, strict=True):
            done[i] = self._settle_write(items[i], size)
        return done

    def _writer(self) -> concurrent.futures.ThreadPoolExecutor:
        """The one thread that writes this tier's records, at background priority (``runtime.background_thread``)."""
        if self._writer_pool is None:
            self._writer_pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"kvtier-disk-{self.name}", initializer=background_thread)
        return self._writer_pool

    async def _wait_writing(self, key: Key) -> None:
        while (pending := self._writing.get(key)) is not None:
            await asyncio.shield(pending)

    def _reserve(self, key: Key, tensor: torch.Tensor) -> bool:
        need = self.stored_size(tensor.numel() * tensor.element_size())
        if self._used - self._index.get(key, 0) + self._reserved + need > self.capacity_bytes:
            self._stats.puts_refused += 1
            return False
        self._reserved += need
        return True

    def _write_many(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[int | Exception]:
        """Write each record (blocking, in a worker thread); its file size, or the error that dropped it (each
        record on its own: one that fails never takes the others of the batch along)."""
        out: list[int | Exception] = []
        for key, tensor in items:
            try:
                out.append(write_record(self.layout, key, tensor, self.section.compression, self.hmac_key,
                                        self.section.fsync))
            except Exception as exc:
                out.append(exc)
        return out

    def _settle_write(self, item: tuple[Key, torch.Tensor], size: int | Exception) -> bool:
        key, tensor = item
        if isinstance(size, Exception):
            log.warning("disk tier %s: write of %s dropped: %s", self.name, key.hex(), size)
            self._stats.errors += 1
            return False
        self._forget(key)
        self._index[key] = size
        self._used += size
        self._stats.puts += 1
        self._stats.bytes_in += tensor.numel() * tensor.element_size()
        return True

    async def delete(self, keys: Sequence[Key]) -> int:
        """Remove record files (also ones another process wrote); return how many existed."""
        for key in keys:
            await self._wait_writing(key)
        known = {k for k in keys if k in self._index}
        for key in known:
            self._forget(key)
        removed = await asyncio.to_thread(self._unlink_many, keys)
        n = len(known | removed)
        self._stats.deletes += n
        return n

    def _unlink_many(self, keys: Iterable[Key]) -> set[Key]:
        removed = set()
        for key in keys:
            try:
                os.unlink(self.layout.path(key))
                removed.add(key)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("disk tier %s: cannot remove %s: %s", self.name, key.hex(), exc)
        return removed
