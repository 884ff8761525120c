"""The disk tier: one record file per key under a sharded directory, with a byte quota.

Lifecycle: ``DiskTier(section)`` -> ``await start()`` (creates the root 0700, removes stale temp files and
invalid records, rebuilds the index key -> file size from the headers; ``entries()`` then lists what an
earlier process left) -> ``contains`` (index only) / ``get`` / ``put`` / ``delete`` -> ``await close()`` (waits
for writes in flight).

Writes: encode (kvtier.codec, optional compression and HMAC) into a temp file in the target directory, fsync
when configured, ``os.replace``. The quota counts whole files; a put that would exceed it is refused. Any
OSError while writing (ENOSPC included) drops that write, removes the temp file and counts ``errors``.
Reads verify the key, checksum and signature; a corrupt or truncated file is a miss, deleted and counted in
``corrupt``; a file removed behind our back (another process sharing the directory) is a miss. Each record is
written by one blocking call in a worker thread (``asyncio.to_thread``): one thread hop per record instead of
one per file operation (aiofiles). Reads of one ``get``: small records (under ``SMALL_RECORD`` on average) first
go through one call that reads each only if the page cache holds all of it (``RWF_NOWAIT``); the rest, and
large records, go in at most ``READ_STREAMS`` calls (runs of records of similar size), so that a device has
several reads in flight. A read goes straight into the returned tensor's memory, recycled from results the
caller dropped (``kvtier.tiers.recycle``: already touched, never reused while held, payload page-aligned; small
records of one call share a buffer), and hashes each piece as it arrives instead of in a second pass.
The index is only touched on the event loop thread, so it needs no lock.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
import xxhash

from kvtier.codec import (
    FLAG_LZ4,
    FLAG_ZSTD,
    HEADER_SIZE,
    MAC_BYTES,
    RecordHeader,
    decode_header,
    encode,
    verify_payload,
)
from kvtier.config import DiskTierConfig, TierConfig
from kvtier.errors import ConfigError, CorruptRecord
from kvtier.keys import Key
from kvtier.layout import dtype_name
from kvtier.tiers.base import Tier, TierEntry, Timer
from kvtier.tiers.disk_index import DIR_MODE, Layout, scan
from kvtier.tiers.recycle import DEFAULT_MAX_IDLE, Recycler

log = logging.getLogger(__name__)


def _payload_view(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data


def write_record(layout: Layout, key: Key, tensor: torch.Tensor, compression: str | None,
                 hmac_key: bytes | None, fsync: bool) -> int:
    """Encode and atomically write one record (blocking); return the file size. Raises OSError."""
    parts = encode(key, _payload_view(tensor), dtype_name(tensor.dtype), tuple(tensor.shape),
                   compression=compression, hmac_key=hmac_key)
    final = layout.path(key)
    directory = os.path.dirname(final)
    layout.make_dirs(directory)
    tmp = layout.temp_path(final)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileNotFoundError:  # the directory was removed behind our back
        layout.forget_dirs()
        layout.make_dirs(directory)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        size = _write_all(fd, parts)
        if fsync:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, final)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        _fsync_dir(directory)
    return size


def _write_all(fd: int, parts: Sequence[bytes | memoryview]) -> int:
    total = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            n = os.write(fd, view)
            total += n
            view = view[n:]
    return total


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_buffer(nbytes: int, lead: int = 0) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


READ_PIECE = 1 << 20  # read and hash this much at a time: each piece is hashed while still in the CPU cache
READ_STREAMS = 4  # a get reads in at most this many worker-thread calls, each a run of records of similar bytes
SMALL_RECORD = 1 << 20  # ``get``: records under this size (on average) first go through the page-cache pass
NOWAIT_FLAGS = getattr(os, "RWF_NOWAIT", 0)  # Linux: fail a read that would wait for the device (EAGAIN)


class Deferred(Exception):
    """A ``nowait`` read found part of the record outside the page cache (or the file system cannot tell:
    ``unsupported``): read it again, waiting."""

    def __init__(self, unsupported: bool = False) -> None:
        super().__init__("not in the page cache" if not unsupported else "RWF_NOWAIT unsupported here")
        self.unsupported = unsupported


def _read_at(fd: int, buf: memoryview, offset: int, flags: int) -> int:
    """One ``preadv``; with ``RWF_NOWAIT``, raise ``Deferred`` where it would wait or is unsupported (raised
    after the ``except`` block: raised inside it, the OSError would stay its ``__context__``, and that error's
    traceback would keep the read buffer alive until a garbage collection)."""
    try:
        return os.preadv(fd, [buf], offset, flags)
    except BlockingIOError:
        deferred = Deferred()
    except OSError as exc:
        if not (flags and exc.errno in (errno.EOPNOTSUPP, errno.EINVAL)):
            raise
        deferred = Deferred(unsupported=True)
    raise deferred


Place = tuple[np.ndarray, int]  # an array and the byte offset of a record's room in it


def read_record(path: str, key: Key, hmac_key: bytes | None, max_size: int,
                alloc: Callable[[int, int], np.ndarray] = _new_buffer, place: Place | None = None,
                room: int = -1, nowait: bool = False) -> tuple[torch.Tensor, int]:
    """Read and verify one record (blocking); return it and the file size. The file lands at ``place`` when it is
    exactly ``room`` bytes long, else in ``alloc(n, lead)``, a ``uint8`` array with byte ``lead`` (where the
    payload starts) page-aligned if it can; the result is a view of that memory. The payload is hashed piece by
    piece as it arrives (a second pass over a record larger than the CPU cache would cost as much as the read).
    ``nowait`` (Linux): raise ``Deferred`` instead of waiting for the device. Raises FileNotFoundError,
    CorruptRecord, Deferred or OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if not HEADER_SIZE <= size <= max_size:
            raise CorruptRecord(f"file size {size} is outside [{HEADER_SIZE}, {max_size}]")
        if place is not None and size == room:
            array, start = place
        else:
            array, start = alloc(size, HEADER_SIZE + (MAC_BYTES if hmac_key is not None else 0)), 0
        view = array.data[start:start + size] if start or array.nbytes != size else array.data
        flags = NOWAIT_FLAGS if nowait else 0
        if size <= READ_PIECE:  # the common case: one read, one hash
            got = _read_at(fd, view, 0, flags)
            while got < size:
                if flags:
                    raise Deferred()
                n = _read_at(fd, view[got:], got, 0)
                if not n:
                    raise CorruptRecord(f"file ended after {got} of {size} bytes")
                got += n
            header = decode_header(view, expected_key=key, max_raw=max_size)
            digest: int | None = xxhash.xxh3_64_intdigest(view[header.prefix_len:])
        else:
            header, digest = _read_pieces(fd, view, key, max_size, flags)
    finally:
        os.close(fd)
    payload = verify_payload(view, header, hmac_key=hmac_key, payload_digest=digest)
    # a tensor over the array itself (torch.frombuffer keeps that very object alive), not over a numpy slice
    # of it: a slice's ``base`` is the memory owner, so it would let the array die (and its memory be
    # recycled) while the tensor is still in use
    dtype = getattr(torch, header.dtype)
    if header.raw_len == 0:
        return torch.empty(header.shape, dtype=dtype), size
    count = header.raw_len // dtype.itemsize
    if header.flags & (FLAG_LZ4 | FLAG_ZSTD):
        raw = alloc(header.raw_len, 0)
        raw[:] = np.frombuffer(payload, dtype=np.uint8)
        return torch.frombuffer(raw, dtype=dtype, count=count).view(header.shape), size
    # stored raw: the payload stays in the read buffer
    return torch.frombuffer(array, dtype=dtype, offset=start + header.prefix_len, count=count).view(header.shape), size


def _read_pieces(fd: int, view: memoryview, key: Key, max_size: int, flags: int) -> tuple[RecordHeader, int | None]:
    """Read a record larger than ``READ_PIECE`` into ``view`` in equal pieces, hashing each as it arrives;
    return its header and payload digest (None when a short read left the hashing behind: verify hashes)."""
    size = view.nbytes
    header: RecordHeader | None = None
    hasher = xxhash.xxh3_64()
    piece = -(-size // -(-size // READ_PIECE))  # equal pieces, at most READ_PIECE
    got = hashed = 0  # bytes read; bytes hashed up to (from the payload start on)
    while got < size:
        want = view[got:got + piece]
        n = _read_at(fd, want, got, flags)
        if n < want.nbytes and flags:
            raise Deferred()
        if not n:
            raise CorruptRecord(f"file ended after {got} of {size} bytes")
        got += n
        if header is None and got >= HEADER_SIZE:  # the header tells where the payload starts
            header = decode_header(view, expected_key=key, max_raw=max_size)
            hashed = header.prefix_len
        if header is not None and got > hashed:
            hasher.update(view[hashed:got])
            hashed = got
    assert header is not None  # size >= HEADER_SIZE
    return header, hasher.intdigest() if hashed == size else None


ReadResult = tuple[torch.Tensor, int] | BaseException


def read_records(paths: Sequence[str], keys: Sequence[Key], hmac_key: bytes | None, max_size: int,
                 alloc: Callable[[int, int], np.ndarray], recycler: Recycler | None = None,
                 sizes: Sequence[int] | None = None, nowait: bool = False) -> list[ReadResult]:
    """``read_record`` for several records in one blocking call; a failure (``Deferred`` included) is returned in
    its place, without its traceback. With ``recycler`` and the expected file ``sizes``, small records share buffers
    (``Recycler.take_many``); a file of another size gets its own."""
    lead = HEADER_SIZE + (MAC_BYTES if hmac_key is not None else 0)
    places: Sequence[Place | None] = (recycler.take_many(sizes, lead) if recycler is not None and sizes is not None
                                      else [None] * len(paths))
    rooms = sizes if sizes is not None else [-1] * len(paths)
    out: list[ReadResult] = []
    for path, key, place, room in zip(paths, keys, places, rooms, strict=True):
        try:
            out.append(read_record(path, key, hmac_key, max_size, alloc, place, room, nowait))
        except (OSError, CorruptRecord, Deferred) as exc:
            # without its traceback or chained errors: the frames they hold (this one, whose list holds the
            # exception, and the read's, which holds the buffer) would keep the read buffer from being recycled
            # until a GC cycle
            exc.__cause__ = exc.__context__ = None
            out.append(exc.with_traceback(None))
    return out


class DiskTier(Tier):
    """Records as files under ``section.path`` within a quota of ``section.capacity`` bytes."""

    def __init__(self, section: TierConfig, *, hmac_key: bytes | None = None) -> None:
        super().__init__(section.name, section.capacity)
        if not isinstance(section, DiskTierConfig) or not section.path:
            raise ConfigError(f"tiers.{section.name}.path", "a disk tier needs a directory path")
        self.section = section
        self.layout = Layout(section.path, section.shard_depth)
        self.hmac_key = hmac_key
        self._index: dict[Key, int] = {}
        self._used = 0
        self._reserved = 0
        self._writing: dict[Key, asyncio.Future[None]] = {}
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
        self._stats.extra["temp_removed"] = self._stats.extra.get("temp_removed", 0) + result.temp_removed
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
        self._buffers.clear()

    def used_bytes(self) -> int:
        return self._used

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
                self._stats.extra["reads_waited"] = self._stats.extra.get("reads_waited", 0) + len(todo)
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
        self._stats.extra["reads_cached"] = self._stats.extra.get("reads_cached", 0) + read
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
                                                                 self._buffers.take_array, self._buffers, sizes,
                                                                 nowait)))
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
        """Write records; ``puts`` counts written ones, ``puts_refused`` the ones over quota."""
        with Timer(self._stats, "put_seconds"):
            return list(await asyncio.gather(*(self._put_one(k, t) for k, t in items)))

    async def _wait_writing(self, key: Key) -> None:
        while (pending := self._writing.get(key)) is not None:
            await asyncio.shield(pending)

    async def _put_one(self, key: Key, tensor: torch.Tensor) -> bool:
        await self._wait_writing(key)
        nbytes = tensor.numel() * tensor.element_size()
        need = self.stored_size(nbytes)
        if self._used - self._index.get(key, 0) + self._reserved + need > self.capacity_bytes:
            self._stats.puts_refused += 1
            return False
        self._reserved += need
        done = asyncio.get_running_loop().create_future()
        self._writing[key] = done
        try:
            size = await asyncio.to_thread(write_record, self.layout, key, tensor, self.section.compression,
                                           self.hmac_key, self.section.fsync)
        except OSError as exc:
            log.warning("disk tier %s: write of %s dropped: %s", self.name, key.hex(), exc)
            self._stats.errors += 1
            return False
        else:
            self._forget(key)
            self._index[key] = size
            self._used += size
            self._stats.puts += 1
            self._stats.bytes_in += nbytes
            return True
        finally:
            self._reserved -= need
            del self._writing[key]
            done.set_result(None)

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
