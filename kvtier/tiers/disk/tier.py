"""The disk tier: one record file per key under a sharded directory, with a byte quota.

Lifecycle: ``DiskTier(section)`` -> ``await describe(manifests)`` (optional: the namespaces this process
serves) -> ``await start()`` (creates the root 0700, joins the directory's ledger, removes stale temp files and
invalid records, rebuilds the index key -> file size from the headers; ``entries()`` then lists what an
earlier process left in this process's namespaces) -> ``contains`` (index only) / ``get`` / ``put`` /
``delete`` -> ``await close()`` (waits for writes in flight, leaves the ledger). A root that cannot be made or
written (``PATH_ERRNOS``) is a ``ConfigError`` naming the key; other OSErrors (a failing disk) propagate: a miss.

A directory several processes share (vLLM instances of different models, the scheduler and worker processes
of one engine): kvtier.tiers.disk.shared has the rule. One quota for the directory (the first writer's, kept in
``<root>/.kvtier-ledger``), bytes counted across processes under ``flock``; for room a process below its fair
share (quota / namespaces served) deletes the oldest of orphans (namespaces no running process serves), then of
the namespace furthest over its share (never below it), then its own; at its share, its own then orphans'. No global
LRU (each evicts by age within what it may take), and a namespace at or below its share is never cut by
another process. A put costs one short ledger transaction in the writer thread (no extra thread hop), after its
records are written into temp files: it makes room, counts them and renames them into place, so the ledger
matches the files (kvtier.tiers.disk.ledger). Manifests: kvtier.tiers.manifest.

Writes: encode (kvtier.records.codec, optional compression and HMAC) into a temp file in the target directory, fsync
when configured, ``os.replace`` under the ledger's lock. The quota counts whole files; a put that would exceed
it is refused. Any OSError while writing (ENOSPC included) drops that write, removes the temp file and counts
``errors``.
Reads verify the key, checksum and signature; a corrupt or truncated file is a miss, deleted and counted in
``corrupt``; a file removed behind our back (another process sharing the directory) is a miss. The records of
one ``put`` are written one after another by the tier's single writer thread, at the lowest CPU priority
(``kvtier.tiers.runtime.background_thread``): one thread hop per batch, and the engine's threads run first.
Reads of one ``get``: small records (under ``SMALL_RECORD`` on average) first go through one call that reads
each only if the page cache holds all of it (``RWF_NOWAIT``); the rest, and large records, go in at most
``READ_STREAMS`` calls (runs of records of similar size), so that a device has several reads in flight. A read
goes straight into the returned tensor's memory, recycled from results the caller dropped
(``kvtier.tiers.memory.recycle``: already touched, never reused while held, payload page-aligned; the payloads of
records of one size, a group's chunks, go evenly spaced into one buffer, as memory slots hold them, so that the
copy into the engine's blocks takes one index operation per layer; other small records of one call share a
buffer), and hashes each piece as it arrives instead of in a second pass.
The index is only touched on the event loop thread, so it needs no lock."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from kvtier.config import DiskTierConfig, TierConfig
from kvtier.control.metrics import DiskStats, Timer
from kvtier.errors import ConfigError, CorruptRecord
from kvtier.records.codec import record_size, stored_size
from kvtier.records.keys import DIGEST_BYTES, Key
from kvtier.tiers.base import Tier, TierEntry
from kvtier.tiers.disk.files import Staged
from kvtier.tiers.disk.index import DIR_MODE, PATH_ERRNOS, Layout, scan
from kvtier.tiers.disk.io import (
    NOWAIT_FLAGS,
    SMALL_RECORD,
    Deferred,
    ReadResult,
    Slot,
    read_records,
    read_runs,
    stage_record,
)
from kvtier.tiers.disk.records import Records
from kvtier.tiers.disk.shared import SharedDirectory, Victim
from kvtier.tiers.memory.recycle import DEFAULT_MAX_IDLE, Recycler
from kvtier.tiers.runtime import CLOSE_WAIT_S, background_thread

log = logging.getLogger(__name__)


class DiskTier(Tier):
    """Records as files under ``section.path`` within a quota of ``section.capacity`` bytes."""

    _stats: DiskStats

    def __init__(self, section: TierConfig, *, hmac_key: bytes | None = None, key_path: str | None = None) -> None:
        super().__init__(section.name, section.capacity)
        self._stats = DiskStats()
        self.key_path = key_path or f"tiers.{section.name}"  # the config section, for errors (``tiers[2]``)
        if not isinstance(section, DiskTierConfig) or not section.path:
            raise ConfigError(f"{self.key_path}.path", "a disk tier needs a directory path")
        self.section = section
        self.layout = Layout(section.path, section.shard_depth)
        self.hmac_key = hmac_key
        self._records = Records()  # what is on disk; our own namespaces (kvtier.tiers.disk.shared)
        self._index = self._records.index
        self._shared = SharedDirectory(section.name, self.layout, section.capacity, section.fsync)
        self._started = False
        self._reserved = 0
        self._writing: dict[Key, asyncio.Future[None]] = {}
        self._writer_pool: concurrent.futures.ThreadPoolExecutor | None = None
        # read buffers reuse the memory of results callers dropped (fresh memory is slow on some VMs)
        self._buffers = Recycler(min(section.capacity, DEFAULT_MAX_IDLE))
        self._nowait = NOWAIT_FLAGS != 0  # the page-cache pass of ``get``; off where the file system refuses it

    async def start(self) -> None:
        """Create the root (0700), join its ledger and rebuild the index from the files already there."""
        self.layout.forget_dirs()
        self._shared.closed = False
        try:
            await asyncio.to_thread(self._create_root)
            result = await asyncio.to_thread(self._shared.join, lambda: scan(self.layout, self.capacity_bytes),
                                             sorted(self._records.own))
        except OSError as exc:
            if exc.errno not in PATH_ERRNOS:
                raise
            raise ConfigError(f"{self.key_path}.path", f"cannot use {self.layout.root} as the disk tier's directory "
                              f"({exc.strerror or exc})", "set it to a directory this user may create and write"
                              ) from None
        self._records.clear()
        for key, size in result.entries:
            self._records.add(key, size)
        if not self._shared.described:  # raw keys: adopt namespaces no one describes or serves
            self._records.take([s for s in self._records.spaces
                                if s not in result.manifested and s not in self._shared.foreign])
        self._shared.manifested |= result.manifested & set(self._shared.described)
        self._stats.corrupt += result.corrupt
        self._stats.temp_removed += result.temp_removed
        self._started = True
        if self._shared.described:
            await asyncio.to_thread(self._shared.write_manifests, sorted(self._shared.described))
        if self._records.used > self.capacity_bytes:
            await self._trim_to_quota()
        log.info("disk tier %s: %d records, %d bytes of its own in %s (%d invalid removed; the directory holds %d "
                 "of its %d bytes)", self.name, len(self._index), self._records.used, self.layout.root, result.corrupt,
                 self._shared.total, self._shared.quota)

    def _create_root(self) -> None:
        if not os.path.isdir(self.layout.root):
            self.layout.make_dirs(self.layout.root)
            os.chmod(self.layout.root, DIR_MODE)

    async def describe(self, manifests: Mapping[bytes, Mapping[str, Any]]) -> None:
        """Take these namespaces (digest -> manifest, kvtier.tiers.manifest) as this process's own: ``entries()``
        lists their records, evictions may take them, and each gets its manifest."""
        spaces = [bytes(d) for d in manifests]
        self._shared.described.update({bytes(d): dict(m) for d, m in manifests.items()})
        self._records.take(spaces)
        if self._started:
            try:
                await asyncio.to_thread(self._shared.claim, spaces)
            except OSError as exc:
                log.warning("disk tier %s: cannot record its namespaces in %s: %s", self.name,
                            self._shared.ledger.path, exc)

    async def _trim_to_quota(self) -> None:
        """Delete our namespaces' oldest records until our capacity holds (it was lowered since they were
        written)."""
        excess = self._records.used - self.capacity_bytes
        victims = [v.key for v in self._records.victims(excess, self._writing, (), orphans=False)]
        for key in victims:
            self._records.forget(key)
        await asyncio.to_thread(self._shared.remove, victims)
        self._stats.evictions += len(victims)

    def entries(self) -> Iterable[TierEntry]:
        """Records of this process's namespaces (oldest first after ``start``)."""
        return [TierEntry(k, s) for k, s in self._index.items() if self._records.is_own(k)]

    async def close(self) -> None:
        """Wait for writes in flight and leave the ledger, each for at most ``CLOSE_WAIT_S``: a write still stuck
        in the writer thread then is never counted or placed (``SharedDirectory.closed``); free idle read buffers.
        Idempotent."""
        if self._writing:
            _, stuck = await asyncio.wait(list(self._writing.values()), timeout=CLOSE_WAIT_S)
            if stuck:
                log.warning("disk tier %s: %d write(s) still running at close after %.1fs: dropped", self.name,
                            len(stuck), CLOSE_WAIT_S)
        if self._writer_pool is not None:
            self._writer_pool.shutdown(wait=False)
            self._writer_pool = None
        if self._started:
            self._started = False
            self._shared.closed = True
            try:
                leaving = asyncio.get_running_loop().run_in_executor(None, self._shared.leave)
            except RuntimeError:  # at interpreter exit the executor takes no more work: leave inline (one write)
                self._shared.leave()
            else:
                try:
                    await asyncio.wait_for(leaving, CLOSE_WAIT_S)
                except TimeoutError:
                    log.warning("disk tier %s: leaving the ledger of %s took over %.1fs: given up (the entry goes "
                                "with this process)", self.name, self.layout.root, CLOSE_WAIT_S)
        self._buffers.clear()

    def used_bytes(self) -> int:
        """Bytes of this process's namespaces' records (the whole directory's are in the ledger)."""
        return self._records.used

    def stats(self) -> DiskStats:
        return self._stats

    def stored_size(self, nbytes: int) -> int:
        """File size of an uncompressed record (an upper bound when compressing)."""
        return stored_size(nbytes, signed=bool(self.hmac_key), memory=False)

    async def contains(self, keys: Sequence[Key]) -> list[bool]:
        found = [k in self._index for k in keys]
        self._stats.lookups += len(found)
        self._stats.hits += sum(found)
        return found

    async def get(self, keys: Sequence[Key]) -> list[torch.Tensor | None]:
        with Timer(self._stats, "get_seconds"):
            sizes = [self._index.get(k, 0) for k in keys]
            slots = self._slots(sizes)
            results: list[ReadResult | None] = [None] * len(keys)
            todo = list(range(len(keys)))
            if self._nowait and keys and sum(sizes) < SMALL_RECORD * len(keys):
                todo = await self._read_cached(keys, sizes, results, slots)
            if todo:
                self._stats.reads_waited += len(todo)
                runs = self._read_runs([sizes[i] for i in todo])
                done: list[list[ReadResult]] = [[] for _ in runs]
                await asyncio.gather(*(self._read([keys[todo[j]] for j in run], [sizes[todo[j]] for j in run], False,
                                                  into, None if slots is None else [slots[todo[j]] for j in run])
                                       for run, into in zip(runs, done, strict=True)))
                for run, got in zip(runs, done, strict=True):
                    for j, result in zip(run, got, strict=True):
                        results[todo[j]] = result
            out = await self._settle(keys, results)
        hits = [t for t in out if t is not None]
        self._stats.gets += len(out)
        self._stats.get_hits += len(hits)
        self._stats.bytes_out += sum(t.numel() * t.element_size() for t in hits)
        return out

    def _slots(self, sizes: Sequence[int]) -> list[Slot] | None:
        """Evenly spaced rooms in one buffer for the payloads of a batch of records of one size (what a group's
        chunks are): ``io.read_into_slot``; None for a single record or records of several sizes."""
        lead = record_size(0, self.hmac_key is not None)
        if len(sizes) < 2 or len(set(sizes)) != 1 or sizes[0] <= lead:
            return None
        return self._buffers.take_slots(len(sizes), sizes[0] - lead)

    async def _read_cached(self, keys: Sequence[Key], sizes: Sequence[int], results: list[ReadResult | None],
                           slots: Sequence[Slot] | None) -> list[int]:
        """The page-cache pass: read every record in one worker-thread call, each only if the page cache holds
        all of it (``RWF_NOWAIT``); fill ``results`` and return the indices left for waiting reads.

        Why: records in the page cache cost CPU only, and at small sizes mostly per-record Python work, which
        several threads on a few cores slow down (GIL hand-offs: 256 KiB reads measured 2.2 GB/s in one thread,
        1.9 in two, 1.3 in four); records that must come from the device still get ``READ_STREAMS`` reads in
        flight."""
        first: list[ReadResult] = []
        await self._read(keys, sizes, True, first, slots)
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

    async def _read(self, keys: Sequence[Key], sizes: Sequence[int], nowait: bool, into: list[ReadResult],
                    slots: Sequence[Slot] | None = None) -> None:
        """Read these records in a worker thread (each payload into its slot, if given), appending the results to
        ``into``.

        The results never pass through a future's result: an executor future and its asyncio wrapper (and a
        gather and its tasks) reference each other through done callbacks, so a result they held would keep
        the read buffers from being recycled until a garbage collection found that cycle. (A test checks this
        with the collector off.)
        """
        paths = [self.layout.path(k) for k in keys]
        box: list[ReadResult] = []  # emptied at once: the worker may still hold the call (and this list) a moment
        rooms = [slots]  # the same for the slots' buffer
        await asyncio.to_thread(lambda: box.extend(read_records(paths, keys, self.hmac_key, self.capacity_bytes,
                                                                 self._buffers, sizes, nowait, rooms[0])))
        into.extend(box)
        box.clear()
        rooms.clear()

    _read_runs = staticmethod(read_runs)

    async def _settle(self, keys: Sequence[Key], results: Sequence[ReadResult | None]) -> list[torch.Tensor | None]:
        """Turn read results into tensors or misses: forget vanished records, delete corrupt ones, count errors,
        index records another process wrote."""
        out: list[torch.Tensor | None] = []
        corrupt: list[Key] = []
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, FileNotFoundError):
                self._records.forget(key)
                out.append(None)
            elif isinstance(result, CorruptRecord):
                log.warning("disk tier %s: corrupt record %s: %s", self.name, self.layout.path(key), result)
                self._records.forget(key)
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
                    if not self._records.is_own(key) or (self._records.used + self._reserved + size
                                                         <= self.capacity_bytes):
                        self._records.add(key, size)
                out.append(tensor)
        if corrupt:
            await asyncio.to_thread(self._shared.remove, corrupt)
        return out

    async def put(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
        """Write records; ``puts`` counts written ones, ``puts_refused`` the ones over quota.

        The records of one call are written one after another by a single worker-thread call: on a few cores,
        one writer per record (threads handing the GIL and the cores back and forth) slowed the engine that
        produced them, and page-cache writes gain nothing from more threads."""
        if len({k for k, _ in items}) != len(items):  # a key twice: one by one, in order
            return [await self.put([item]) == [True] for item in items]
        with Timer(self._stats, "put_seconds"):
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
                self._records.take({key[:DIGEST_BYTES] for key, _ in batch})  # a namespace we write is ours
                victims = self._room_for(batch)
                sizes, evicted = await loop.run_in_executor(self._writer(), self._shared.store, batch, victims,
                                                            sorted(self._records.own), self._write_many)
                self._evicted(evicted)
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
        if self._records.used - self._index.get(key, 0) + self._reserved + need > self.capacity_bytes:
            self._stats.puts_refused += 1
            return False
        self._reserved += need
        return True

    def _room_for(self, batch: Sequence[tuple[Key, torch.Tensor]]) -> list[Victim]:
        """Records the writer may delete for ``batch`` when the directory was near its quota at the last look
        (twice the batch's bytes of slack: other processes write meanwhile)."""
        need = sum(self.stored_size(t.numel() * t.element_size()) for _, t in batch)
        over = self._shared.total + 2 * need - self._shared.quota
        if over <= 0:
            return []
        keep = {k for k, _ in batch} | set(self._writing)
        return list(self._records.victims(over, keep, self._shared.foreign))

    def _evicted(self, evicted: Mapping[Key, int]) -> None:
        for key in evicted:
            self._records.forget(key)
        self._stats.evictions += len(evicted)

    def _write_many(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[Staged | Exception]:
        """Write each record into its temp file (blocking, in the writer thread; ``SharedDirectory.store`` renames
        them into place); each staged file, or the error that dropped it (each record on its own: one that fails
        never takes the others of the batch along)."""
        out: list[Staged | Exception] = []
        for key, tensor in items:
            try:
                out.append(stage_record(self.layout, key, tensor, self.section.compression, self.hmac_key,
                                        self.section.fsync))
            except Exception as exc:
                out.append(exc)
        return out

    def _settle_write(self, item: tuple[Key, torch.Tensor], size: int | Exception | None) -> bool:
        key, tensor = item
        if size is None:
            self._stats.puts_refused += 1
            return False
        if isinstance(size, Exception):
            log.warning("disk tier %s: write of %s dropped: %s", self.name, key.hex(), size)
            self._stats.errors += 1
            return False
        self._records.add(key, size)
        self._stats.puts += 1
        self._stats.bytes_in += tensor.numel() * tensor.element_size()
        return True

    async def delete(self, keys: Sequence[Key]) -> int:
        """Remove record files (also ones another process wrote); return how many existed."""
        for key in keys:
            await self._wait_writing(key)
        known = {k for k in keys if k in self._index}
        for key in known:
            self._records.forget(key)
        removed = await asyncio.to_thread(self._shared.remove, list(keys))
        n = len(known | set(removed))
        self._stats.deletes += n
        return n
