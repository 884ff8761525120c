"""Record files of the disk tier: atomic writes and verified reads (blocking; the tier runs them in worker threads).

``stage_record`` encodes a record into a temp file, which the shared directory renames into place as it counts
it. ``read_record`` / ``read_records`` read files into recycled buffers (small records of one call share one),
hash each piece as it arrives and verify the header, key, checksum and signature; with ``nowait`` (Linux
``RWF_NOWAIT``) a record the page cache does not hold entirely raises ``Deferred`` instead of waiting for the
device.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch
import xxhash

from kvtier.errors import CorruptRecord
from kvtier.layout import dtype_name
from kvtier.records.codec import (
    FLAG_LZ4,
    FLAG_ZSTD,
    HEADER_SIZE,
    RecordHeader,
    decode_header,
    encode,
    record_size,
    verify_parts,
    verify_payload,
)
from kvtier.records.keys import Key
from kvtier.tiers.disk.files import Staged, finish_temp, open_temp
from kvtier.tiers.disk.index import Layout
from kvtier.tiers.memory.recycle import Recycler


def _payload_view(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data


def stage_record(layout: Layout, key: Key, tensor: torch.Tensor, compression: str | None,
                 hmac_key: bytes | None, fsync: bool) -> Staged:
    """Encode one record into a temp file beside its place (blocking; fsynced when asked), to be renamed into place
    under the ledger's lock (kvtier.tiers.disk.shared). Raises OSError (the temp file removed)."""
    parts = encode(key, _payload_view(tensor), dtype_name(tensor.dtype), tuple(tensor.shape),
                   compression=compression, hmac_key=hmac_key)
    final = layout.path(key)
    directory = os.path.dirname(final)
    layout.make_dirs(directory)
    tmp = layout.temp_path(final)
    try:
        fd = open_temp(tmp)
    except FileNotFoundError:  # the directory was removed behind our back
        layout.forget_dirs()
        layout.make_dirs(directory)
        fd = open_temp(tmp)
    return Staged(tmp, final, finish_temp(fd, tmp, parts, fsync))


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
Slot = tuple[torch.Tensor, int, int]  # a uint8 tensor, the byte offset of a payload's room in it, its bytes


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
            array, start = alloc(size, record_size(0, hmac_key is not None)), 0
        view = array.data[start:start + size] if start or array.nbytes != size else array.data
        flags = NOWAIT_FLAGS if nowait else 0
        if size <= READ_PIECE:  # the common case: one read, one hash
            _read_fully(fd, view, 0, flags)
            header = decode_header(view, expected_key=key, max_raw=max_size)
            digest = xxhash.xxh3_64_intdigest(view[header.prefix_len:])
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


def _read_pieces(fd: int, view: memoryview, key: Key, max_size: int, flags: int) -> tuple[RecordHeader, int]:
    """Read a record larger than ``READ_PIECE`` into ``view``: its header first (it tells where the payload
    starts), then the payload in equal pieces, each hashed as it arrives; its header and payload digest."""
    _read_fully(fd, view[:HEADER_SIZE], 0, flags)
    header = decode_header(view, expected_key=key, max_raw=max_size)
    prefix = min(header.prefix_len, view.nbytes)
    _read_fully(fd, view[HEADER_SIZE:prefix], HEADER_SIZE, flags)
    return header, _read_hashed(fd, view[prefix:], prefix, flags)


def read_into_slot(path: str, key: Key, hmac_key: bytes | None, max_size: int, slot: Slot, room: int,
                   alloc: Callable[[int, int], np.ndarray] = _new_buffer, nowait: bool = False,
                   ) -> tuple[torch.Tensor, int]:
    """``read_record`` with the payload read straight into ``slot`` (a ``uint8`` tensor and the byte offset of the
    payload's room in it) and the header, and MAC, into a small buffer of their own: the payloads of one ``get``
    then lie evenly spaced in one storage, as records in consecutive memory slots do, and the copy into the
    engine's blocks takes one index operation per layer instead of one copy per chunk and layer
    (kvtier.kvcopy.paged; in vLLM's CPU engine a 32 MiB hit's copy took 2.7 ms instead of 5.7). A file that is not
    ``room`` bytes long, or whose payload is compressed or not exactly the slot's size, is read by ``read_record``:
    nothing but a payload of the slot's size is ever written into a slot (an unsigned record forged at a signed
    record's file size has a longer payload, which would overwrite the start of the next slot, maybe a payload
    already verified and handed out, before its signature check failed). Same errors."""
    memory, offset, length = slot
    flags = NOWAIT_FLAGS if nowait else 0
    prefix = np.empty(record_size(0, True), dtype=np.uint8).data  # header and MAC: at most this long
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        header = None
        if size == room and HEADER_SIZE <= size <= max_size:
            _read_fully(fd, prefix[:HEADER_SIZE], 0, flags)
            header = decode_header(prefix[:HEADER_SIZE], expected_key=key, max_raw=max_size)
        if (header is None or header.total_len != size or header.flags & (FLAG_LZ4 | FLAG_ZSTD)
                or header.payload_len != length or offset + length > memory.numel()):
            header = None
        else:
            head = prefix[:header.prefix_len]
            _read_fully(fd, head[HEADER_SIZE:], HEADER_SIZE, flags)
            stored = memory.numpy().data[offset:offset + header.payload_len]
            digest = _read_hashed(fd, stored, header.prefix_len, flags)
    finally:
        os.close(fd)
    if header is None:
        return read_record(path, key, hmac_key, max_size, alloc, nowait=nowait)
    verify_parts(head, stored, header, hmac_key=hmac_key, payload_digest=digest)
    dtype = getattr(torch, header.dtype)
    if header.raw_len == 0:
        return torch.empty(header.shape, dtype=dtype), size
    return memory[offset:offset + header.raw_len].view(dtype).view(header.shape), size


def _read_fully(fd: int, view: memoryview, offset: int, flags: int) -> None:
    """Fill ``view`` from the file at ``offset``; a file that ends first is corrupt (``nowait``: a short read
    raises ``Deferred``)."""
    got = 0
    while got < view.nbytes:
        n = _read_at(fd, view[got:], offset + got, flags)
        if n < view.nbytes - got and flags:
            raise Deferred()
        if not n:
            raise CorruptRecord(f"file ended after {offset + got} bytes")
        got += n


def _read_hashed(fd: int, view: memoryview, offset: int, flags: int) -> int:
    """Fill ``view`` from the file at ``offset`` in equal pieces of at most ``READ_PIECE``, hashing each as it
    arrives (while it is in the CPU cache); the xxh3-64 of the whole."""
    hasher = xxhash.xxh3_64()
    size = view.nbytes
    piece = -(-size // -(-size // READ_PIECE)) if size else 0
    for start in range(0, size, piece or 1):
        part = view[start:start + piece]
        _read_fully(fd, part, offset + start, flags)
        hasher.update(part)
    return hasher.intdigest()


ReadResult = tuple[torch.Tensor, int] | BaseException


def read_records(paths: Sequence[str], keys: Sequence[Key], hmac_key: bytes | None, max_size: int,
                 recycler: Recycler | None = None, sizes: Sequence[int] | None = None,
                 nowait: bool = False, slots: Sequence[Slot] | None = None) -> list[ReadResult]:
    """``read_record`` for several records in one blocking call; a failure (``Deferred`` included) is returned in
    its place, without its traceback. Buffers come from ``recycler`` (fresh ones without it); with the expected
    file ``sizes`` too, small records share buffers (``Recycler.take_many``), or, with ``slots`` (one per record,
    ``Recycler.take_slots``), each payload goes into its slot (``read_into_slot``); a file of another size gets
    its own."""
    lead = record_size(0, hmac_key is not None)
    alloc = recycler.take_array if recycler is not None else _new_buffer
    places: Sequence[Place | None] = (recycler.take_many(sizes, lead) if recycler is not None and sizes is not None
                                      and slots is None else [None] * len(paths))
    rooms = sizes if sizes is not None else [-1] * len(paths)
    out: list[ReadResult] = []
    for i, (path, key, place, room) in enumerate(zip(paths, keys, places, rooms, strict=True)):
        try:
            if slots is not None:
                out.append(read_into_slot(path, key, hmac_key, max_size, slots[i], room, alloc, nowait))
            else:
                out.append(read_record(path, key, hmac_key, max_size, alloc, place, room, nowait))
        except (OSError, CorruptRecord, Deferred) as exc:
            # without its traceback or chained errors: the frames they hold (this one, whose list holds the
            # exception, and the read's, which holds the buffer) would keep the read buffer from being recycled
            # until a GC cycle
            exc.__cause__ = exc.__context__ = None
            out.append(exc.with_traceback(None))
    return out


def read_runs(sizes: Sequence[int]) -> list[list[int]]:
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
