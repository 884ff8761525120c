"""How records are laid out in Redis, and pipelined reads and writes of them over one ``RespConnection``.

Layout: a record of T bytes is stored as ``len(parts_of(T))`` string values of 2-4 MiB (one value when
T < 4 MiB): part 0, which starts with the record header, under the record's own name, and part k under
``{name}:k`` (the hash tag puts every part in the head's cluster slot). Redis's allocator (jemalloc) hands
allocations above 8 MiB back to the kernel at once, so every 32 MiB SET or GET reply would fault in fresh
memory, costing the server about three times the copy itself; values of a few MiB reuse hot memory.
Writes send the other parts first and the head last, so a reader that finds the head finds the rest (unless a
part was evicted meanwhile: the record is then unusable, reported corrupt and deleted). Readers also accept a
whole record in one value.

Reads (``RecordReader``) GET the head, validate its header against the key asked for before allocating
anything, then GET the remaining parts; payload bytes go straight from the socket into the result tensor, which
is then checked against the header's checksum (and HMAC). About ``WINDOW`` bytes are requested ahead per
connection. A value failing a check is drained from the stream and reported corrupt; the stream stays in sync.
Compressed records are checked with ``codec.decode``.
"""

from __future__ import annotations

import hmac as hmac_mod
import struct
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from kvtier.errors import CorruptRecord
from kvtier.records import codec
from kvtier.tiers.redis.resp import RespConnection, RespProtocolError

if TYPE_CHECKING:  # torch is imported on first use: the catalog (kvtier purge, inspect) needs only the layout
    import torch

PART = 2 << 20
WINDOW = 4 << 20
HEAD_PROBE = 60  # header bytes that tell a record's length: flags at 6, stored payload length at 44
_SCRATCH = codec.HEADER_SIZE + codec.MAC_BYTES
_COMPRESSED = codec.FLAG_LZ4 | codec.FLAG_ZSTD
Alloc = Callable[[int], "torch.Tensor"]
Place = Callable[[int, int], "torch.Tensor"]  # (record index, bytes) -> the uint8 tensor its payload goes into


def _empty(nbytes: int) -> torch.Tensor:
    import torch

    return torch.empty(nbytes, dtype=torch.uint8)


def parts_of(total: int) -> list[tuple[int, int]]:
    """(offset, length) of each stored part of a record of ``total`` bytes: n = total // PART parts (at least
    one) of equal length, the last one taking the remainder, so every part is under 2 * PART."""
    n = max(1, total // PART)
    size = total // n
    return [(k * size, size if k < n - 1 else total - k * size) for k in range(n)]


def part_name(name: bytes, k: int) -> bytes:
    """Redis key of part ``k`` of the record stored under ``name`` (part 0 is ``name`` itself)."""
    return name if k == 0 else b"{%s}:%d" % (name, k)


def length_from_probe(probe: bytes) -> int | None:
    """The record length announced by the first ``HEAD_PROBE`` bytes of a head, unvalidated (for deletes)."""
    if len(probe) < HEAD_PROBE or probe[:4] != codec.MAGIC:
        return None
    (flags,) = struct.unpack_from("<H", probe, 6)
    (stored,) = struct.unpack_from("<Q", probe, 44)
    return codec.record_size(int(stored), bool(flags & codec.FLAG_SIGNED))


@dataclass
class GetResult:
    """One value per key asked for (``None`` on a miss), plus which ones were corrupt or refused by the server."""

    values: list[torch.Tensor | None]
    corrupt: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


# -- writing -----------------------------------------------------------------------------------------------------


def record_commands(name: bytes, buffers: Sequence[Any], px_ms: int | None) -> list[list[Any]]:
    """The SET commands (as buffer lists) that store a record given as consecutive ``buffers``: parts 1.. first,
    the head last."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = sum(v.nbytes for v in views)
    commands = [_set(part_name(name, k), _slice(views, off, length), px_ms)
                for k, (off, length) in enumerate(parts_of(total))]
    return commands[1:] + commands[:1]


def _slice(views: list[memoryview], off: int, length: int) -> list[memoryview]:
    out, pos = [], 0
    for v in views:
        lo, hi = max(off, pos), min(off + length, pos + v.nbytes)
        if lo < hi:
            out.append(v[lo - pos:hi - pos])
        pos += v.nbytes
    return out


def _set(name: bytes, parts: list[memoryview], px_ms: int | None) -> list[Any]:
    total = sum(p.nbytes for p in parts)
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (5 if px_ms else 3, len(name), name, total)
    tail = b"\r\n" if not px_ms else b"\r\n$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(px_ms)), px_ms)
    if parts and parts[0].nbytes < 4096:  # coalesce a small record header with the framing
        return [head + bytes(parts[0]), *parts[1:], tail]
    return [head, *parts, tail]


async def set_records(conn: RespConnection, records: Sequence[list[list[Any]]]) -> list[str | None]:
    """Send every record's SETs in one pipeline; per record None (stored) or its first error reply."""
    await conn.send([buf for commands in records for cmd in commands for buf in cmd])
    out: list[str | None] = []
    for commands in records:
        error = None
        for _ in commands:
            line = await conn.read_line()
            if line[:1] not in (b"+", b"-"):
                raise RespProtocolError(f"unexpected reply to SET: {line[:40]!r}")
            if line != b"+OK" and error is None:
                error = line[1:].decode(errors="replace")
        out.append(error)
    return out


# -- reading -----------------------------------------------------------------------------------------------------


async def get_records(conn: RespConnection, names: Sequence[bytes], keys: Sequence[bytes], *, max_raw: int,
                      hmac_key: bytes | None, alloc: Alloc = _empty, place: Place | None = None) -> GetResult:
    """Read the records stored under ``names``; each must be the record of the matching entry of ``keys``.

    ``alloc(n)`` gives the uint8 tensor a payload of ``n`` bytes is read into (e.g. ``Recycler.take``);
    ``place(i, n)``, when given, the one for the payload of record ``i`` (e.g. ``Slots.take``: evenly spaced in
    one buffer, which the copy into the engine's blocks moves in a few index operations).
    """
    return await RecordReader(conn, names, keys, max_raw=max_raw, hmac_key=hmac_key, alloc=alloc,
                              place=place).run()


@dataclass(slots=True)
class _Value:
    """A record being assembled from its parts."""

    header: codec.RecordHeader
    prefix: bytes  # header and MAC (the scratch buffer moves on to other records meanwhile)
    target: memoryview  # where the stored payload bytes go
    payload: torch.Tensor | None  # uncompressed: the result tensor (``target`` is its memory)
    record: bytearray | None  # compressed: the whole record, for ``codec.decode``
    failed: bool = False


class RecordReader:
    """Reads a batch of records over one connection: pipelined GETs of heads, then of parts (module docstring)."""

    def __init__(self, conn: RespConnection, names: Sequence[bytes], keys: Sequence[bytes], *, max_raw: int,
                 hmac_key: bytes | None, alloc: Alloc, place: Place | None = None) -> None:
        self.conn, self.names, self.keys = conn, names, keys
        self.max_raw, self.hmac_key, self.alloc = max_raw, hmac_key, alloc
        self.place = place if place is not None else lambda _, n: alloc(n)
        self.result = GetResult(values=[None] * len(keys))
        # requests: (record index, part number, offset in the record, length; -1: not known yet)
        self._todo: deque[tuple[int, int, int, int]] = deque((i, 0, 0, -1) for i in range(len(keys)))
        self._sent: deque[tuple[int, int, int, int, int]] = deque()  # the same, plus the bytes expected
        self._ahead = 0  # bytes expected from the requests in flight
        self._hint = PART  # size of the last head seen
        self._open: dict[int, _Value] = {}
        self._scratch = memoryview(bytearray(_SCRATCH))

    async def run(self) -> GetResult:
        await self._request()
        while self._sent:
            i, k, off, length, expected = self._sent.popleft()
            self._ahead -= expected
            line = await self.conn.read_line()
            if line[:1] == b"-":
                self._error(i, line)
            elif line[:1] != b"$":
                raise RespProtocolError(f"unexpected reply to GET: {line[:40]!r}")
            elif k == 0:
                await self._head(i, int(line[1:]))
            else:
                await self._part(i, off, int(line[1:]), length)
            await self._request()
        return self.result

    async def _request(self) -> None:
        """Send the next GETs while less than ``WINDOW`` bytes are in flight (always at least one)."""
        out = []
        while self._todo and (self._ahead < WINDOW or not self._sent):
            i, k, off, length = self._todo.popleft()
            name = part_name(self.names[i], k)
            out.append(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name))
            expected = length if length >= 0 else self._hint
            self._sent.append((i, k, off, length, expected))
            self._ahead += expected
        if out:
            await self.conn.send([b"".join(out)])

    def _error(self, i: int, line: bytes) -> None:
        value = self._open.pop(i, None)
        self.result.values[i] = None
        if line.startswith(b"-WRONGTYPE"):  # something else than a string under our prefix
            self.result.corrupt.append(i)
        else:
            self.result.errors.append(line[1:].decode(errors="replace"))
        if value is not None:
            value.failed = True

    async def _head(self, i: int, size: int) -> None:
        """Part 0: header, MAC, start of the payload; queue the other parts."""
        if size < 0:
            return  # a missing key
        if size < codec.HEADER_SIZE:
            return await self._corrupt(i, size)
        await self.conn.read_into(self._scratch[:codec.HEADER_SIZE])
        try:
            header = codec.decode_header(self._scratch, expected_key=self.keys[i], max_raw=self.max_raw)
        except CorruptRecord:
            return await self._corrupt(i, size - codec.HEADER_SIZE)
        layout = parts_of(header.total_len)
        if size == header.total_len:
            layout = [(0, size)]  # the whole record in one value (also accepted: any writer may do that)
        elif size != layout[0][1] or header.prefix_len > size:  # truncated, or not a layout we know
            return await self._corrupt(i, size - codec.HEADER_SIZE)
        self._hint = size
        if header.signed:
            await self.conn.read_into(self._scratch[codec.HEADER_SIZE:header.prefix_len])
        value = self._open[i] = self._allocate(i, header)
        await self.conn.read_into(value.target[:size - header.prefix_len])
        await self.conn.skip(2)
        rest = [(i, k, off, length) for k, (off, length) in enumerate(layout) if k]
        self._todo.extendleft(reversed(rest))  # finish this record before starting the next
        if not rest:
            self._finish(i)

    async def _part(self, i: int, off: int, size: int, length: int) -> None:
        value = self._open.get(i)
        last = value is not None and off + length == value.header.total_len
        if value is None or value.failed or size != length:
            await self.conn.skip(size + 2 if size >= 0 else 0)
            if value is not None and not value.failed:
                value.failed = True  # a part missing (evicted alone) or of the wrong size: unusable
                self.result.corrupt.append(i)
            if last:
                self._open.pop(i)
            return
        start = off - value.header.prefix_len
        await self.conn.read_into(value.target[start:start + size])
        await self.conn.skip(2)
        if last:
            self._finish(i)

    async def _corrupt(self, i: int, remaining: int) -> None:
        await self.conn.skip(remaining + 2)
        self.result.corrupt.append(i)

    def _allocate(self, i: int, header: codec.RecordHeader) -> _Value:
        prefix = bytes(self._scratch[:header.prefix_len])
        if header.flags & _COMPRESSED:
            record = bytearray(header.total_len)
            record[:header.prefix_len] = prefix
            return _Value(header, prefix, memoryview(record)[header.prefix_len:], None, record)
        payload = self.place(i, header.payload_len)
        return _Value(header, prefix, memoryview(payload.numpy()), payload, None)  # type: ignore[arg-type]

    def _finish(self, i: int) -> None:
        value = self._open.pop(i)
        tensor = _verified(value, self.keys[i], self.max_raw, self.hmac_key, self.alloc)
        if tensor is None:
            self.result.corrupt.append(i)
        self.result.values[i] = tensor


def _verified(value: _Value, key: bytes, max_raw: int, hmac_key: bytes | None, alloc: Alloc) -> torch.Tensor | None:
    """The record's tensor if its payload matches the header's checksum (and HMAC), else None."""
    header = value.header
    if value.record is not None:
        try:
            decoded = codec.decode(value.record, expected_key=key, max_raw=max_raw, hmac_key=hmac_key)
        except CorruptRecord:
            return None
        out = alloc(header.raw_len)
        out.numpy()[:] = decoded.payload
        return _typed(out, header)
    assert value.payload is not None
    if xxhash.xxh3_64_intdigest(value.target) != header.payload_checksum:
        return None
    if hmac_key is not None:
        mac = value.prefix[codec.HEADER_SIZE:codec.HEADER_SIZE + codec.MAC_BYTES]
        if not header.signed or not hmac_mod.compare_digest(codec.sign(hmac_key, value.prefix, value.target), mac):
            return None
    return _typed(value.payload, header)


def _typed(payload: torch.Tensor, header: codec.RecordHeader) -> torch.Tensor:
    import torch

    return payload.view(getattr(torch, header.dtype)).reshape(header.shape)
