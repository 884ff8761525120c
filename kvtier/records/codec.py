"""Record format: a fixed header, an optional HMAC, then the payload.

One record per (group, chunk, shard). The same bytes go to disk and to Redis. Layout (little-endian):

    magic "KVT1" | version u16 | flags u16 | dtype u8 | ndim u8 | checksum algo u8 | reserved u8
    | shape 8 x u32 | stored payload length u64 | raw payload length u64 | payload checksum u64
    | key 32 bytes | header checksum u64        [ | HMAC-SHA256 32 bytes if FLAG_SIGNED ] | payload

Decoding validates every field before trusting any length, bounds every allocation by ``max_raw`` and raises
``CorruptRecord`` on any mismatch. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import hmac as hmac_mod
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from kvtier.errors import CorruptRecord
from kvtier.layout import DTYPE_SIZES
from kvtier.records.keys import KEY_BYTES

MAGIC = b"KVT1"
VERSION = 1
FLAG_LZ4 = 1
FLAG_ZSTD = 2
FLAG_SIGNED = 4
_KNOWN_FLAGS = FLAG_LZ4 | FLAG_ZSTD | FLAG_SIGNED
CHECKSUM_XXH3 = 1
MAX_DIMS = 8
MAC_BYTES = 32
DTYPE_CODES: dict[str, int] = {name: i + 1 for i, name in enumerate(DTYPE_SIZES)}
_DTYPE_BY_CODE = {code: name for name, code in DTYPE_CODES.items()}

_BODY = struct.Struct(f"<4sHHBBBB{MAX_DIMS}IQQQ{KEY_BYTES}s")
_CHECK = struct.Struct("<Q")
HEADER_SIZE = _BODY.size + _CHECK.size
DEFAULT_MAX_RAW = 1 << 31
SLOT_ALIGN = 4096  # memory tiers hold a payload in whole slots of this many bytes (kvtier.tiers.memory.slots)


def record_size(payload_bytes: int, signed: bool) -> int:
    """Bytes of the encoded record of a stored payload of ``payload_bytes``: the header, the MAC when ``signed``,
    the payload."""
    return HEADER_SIZE + (MAC_BYTES if signed else 0) + payload_bytes


def stored_size(payload_bytes: int, *, signed: bool, memory: bool, slot_bytes: int | None = None) -> int:
    """What one chunk of ``payload_bytes`` costs a tier, the one rule the tiers, the fit check (kvtier.records.fit)
    and ``kvtier check`` count capacity by. Disk and Redis hold the encoded record (:func:`record_size`). A memory
    tier (cpu, gpu) holds the raw payload in whole slots of ``slot_bytes`` (its ``slot_bytes`` setting), rounded up
    to ``SLOT_ALIGN``; without that setting the first record stored sizes the slots, so a tier of chunks alone
    takes one slot of the payload rounded up (a hybrid model's smaller state stored first makes chunks cost more
    slots: set ``slot_bytes`` there)."""
    if not memory:
        return record_size(payload_bytes, signed)
    if payload_bytes <= 0:
        return 0
    slot = slot_aligned(slot_bytes or payload_bytes)
    return -(-payload_bytes // slot) * slot


def slot_aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole ``SLOT_ALIGN``: the size of a memory slot that holds them."""
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


@dataclass(frozen=True, slots=True)
class RecordHeader:
    key: bytes
    dtype: str
    shape: tuple[int, ...]
    flags: int
    payload_len: int
    raw_len: int
    payload_checksum: int

    @property
    def signed(self) -> bool:
        return bool(self.flags & FLAG_SIGNED)

    @property
    def prefix_len(self) -> int:
        """Bytes before the payload: header plus MAC when signed."""
        return record_size(0, self.signed)

    @property
    def total_len(self) -> int:
        return self.prefix_len + self.payload_len


@dataclass(frozen=True, slots=True)
class Record:
    header: RecordHeader
    payload: memoryview  # raw (decompressed) payload bytes


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    n = DTYPE_SIZES[dtype]
    for d in shape:
        n *= d
    return n


def _compress(data: memoryview, compression: str | None) -> tuple[bytes | memoryview, int]:
    if compression in (None, "", "none"):
        return data, 0
    if compression == "lz4":
        import lz4.block

        return lz4.block.compress(data, store_size=False), FLAG_LZ4
    if compression == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=1).compress(data), FLAG_ZSTD
    raise ValueError(f"unknown compression {compression!r}; use none, lz4 or zstd")


def encode(key: bytes, payload: Any, dtype: str, shape: Sequence[int], *, compression: str | None = None,
           hmac_key: bytes | None = None) -> list[bytes | memoryview]:
    """Encode a record as parts to write in order (header, then payload) without joining them."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes")
    if dtype not in DTYPE_CODES or len(shape) > MAX_DIMS:
        raise ValueError(f"unsupported dtype {dtype!r} or shape {tuple(shape)!r}")
    raw = memoryview(payload).cast("B")
    if raw.nbytes != _nbytes(shape, dtype):
        raise ValueError(f"payload has {raw.nbytes} bytes, shape {tuple(shape)} of {dtype} needs "
                         f"{_nbytes(shape, dtype)}")
    stored, flags = _compress(raw, compression)
    if flags and len(stored) >= raw.nbytes:
        stored, flags = raw, 0  # incompressible: store raw
    if hmac_key:
        flags |= FLAG_SIGNED
    stored_len = memoryview(stored).nbytes
    dims = list(shape) + [0] * (MAX_DIMS - len(shape))
    body = _BODY.pack(MAGIC, VERSION, flags, DTYPE_CODES[dtype], len(shape), CHECKSUM_XXH3, 0, *dims,
                      stored_len, raw.nbytes, xxhash.xxh3_64_intdigest(stored), key)
    header = body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))
    if hmac_key:
        header += sign(hmac_key, header, stored)
    return [header, stored]


def sign(hmac_key: bytes, header: bytes | memoryview, stored: Any) -> bytes:
    mac = hmac_mod.new(hmac_key, digestmod=hashlib.sha256)
    mac.update(header[:HEADER_SIZE])
    mac.update(stored)
    return mac.digest()


def encode_bytes(key: bytes, payload: Any, dtype: str, shape: Sequence[int], **kw: Any) -> bytes:
    """Encode a record as one bytes object."""
    return b"".join(encode(key, payload, dtype, shape, **kw))


def decode_header(buf: Any, *, expected_key: bytes | None = None,
                  max_raw: int = DEFAULT_MAX_RAW) -> RecordHeader:
    """Validate and parse the header at the start of ``buf`` (at least HEADER_SIZE bytes)."""
    view = memoryview(buf).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CorruptRecord(f"record of {view.nbytes} bytes is shorter than its header ({HEADER_SIZE})")
    body = view[:_BODY.size]
    (check,) = _CHECK.unpack_from(view, _BODY.size)
    if xxhash.xxh3_64_intdigest(body) != check:
        raise CorruptRecord("header checksum mismatch")
    magic, version, flags, dcode, ndim, algo, _, *rest = _BODY.unpack(body)
    dims, (stored_len, raw_len, pcheck, key) = rest[:MAX_DIMS], rest[MAX_DIMS:]
    if magic != MAGIC or version != VERSION or algo != CHECKSUM_XXH3:
        raise CorruptRecord(f"unknown record format (magic {magic!r}, version {version})")
    if flags & ~_KNOWN_FLAGS or (flags & FLAG_LZ4 and flags & FLAG_ZSTD):
        raise CorruptRecord(f"invalid flags {flags:#x}")
    if dcode not in _DTYPE_BY_CODE or not 0 <= ndim <= MAX_DIMS or any(dims[ndim:]):
        raise CorruptRecord("invalid dtype or shape")
    dtype, shape = _DTYPE_BY_CODE[dcode], tuple(dims[:ndim])
    if raw_len != _nbytes(shape, dtype) or raw_len > max_raw:
        raise CorruptRecord(f"payload size {raw_len} does not match shape or exceeds the bound {max_raw}")
    compressed = flags & (FLAG_LZ4 | FLAG_ZSTD)
    if (not compressed and stored_len != raw_len) or stored_len > raw_len:
        raise CorruptRecord(f"stored length {stored_len} invalid for raw length {raw_len}")
    if expected_key is not None and key != expected_key:
        raise CorruptRecord("record holds another key (namespace or key mismatch)")
    return RecordHeader(key, dtype, shape, flags, stored_len, raw_len, pcheck)


def decode(buf: Any, *, expected_key: bytes | None, max_raw: int = DEFAULT_MAX_RAW,
           hmac_key: bytes | None = None) -> Record:
    """Validate a whole record and return its raw payload. Any mismatch raises ``CorruptRecord``."""
    view = memoryview(buf).cast("B")
    header = decode_header(view, expected_key=expected_key, max_raw=max_raw)
    return Record(header, verify_payload(view, header, hmac_key=hmac_key))


def verify_payload(view: memoryview, header: RecordHeader, *, hmac_key: bytes | None,
                   payload_digest: int | None = None) -> memoryview:
    """Check the whole record ``view`` (``header`` parsed from it) against its size, payload checksum and
    signature; return the raw (decompressed) payload. Any mismatch raises ``CorruptRecord``.

    ``payload_digest``: the xxh3-64 of the stored payload when the caller already hashed it (a reader that
    hashes each piece right after reading it, while it is in the CPU cache); None hashes it here.
    """
    if view.nbytes != header.total_len:
        raise CorruptRecord(f"record is {view.nbytes} bytes, header says {header.total_len}")
    return verify_parts(view[:header.prefix_len], view[header.prefix_len:], header, hmac_key=hmac_key,
                        payload_digest=payload_digest)


def verify_parts(prefix: memoryview, stored: memoryview, header: RecordHeader, *, hmac_key: bytes | None,
                 payload_digest: int | None = None) -> memoryview:
    """``verify_payload`` of a record read in two places: its ``prefix`` (header, and MAC when signed) and its
    ``stored`` payload (a reader that puts payloads straight into evenly spaced slots)."""
    if prefix.nbytes != header.prefix_len or stored.nbytes != header.payload_len:
        raise CorruptRecord(f"record is {prefix.nbytes + stored.nbytes} bytes, header says {header.total_len}")
    if payload_digest is None:
        payload_digest = xxhash.xxh3_64_intdigest(stored)
    if payload_digest != header.payload_checksum:
        raise CorruptRecord("payload checksum mismatch")
    if hmac_key is not None:
        if not header.signed:
            raise CorruptRecord("unsigned record where signing is required")
        mac = prefix[HEADER_SIZE:HEADER_SIZE + MAC_BYTES]
        if not hmac_mod.compare_digest(sign(hmac_key, prefix, stored), bytes(mac)):
            raise CorruptRecord("record signature mismatch")
    return _decompress(header, stored)


def _decompress(header: RecordHeader, stored: memoryview) -> memoryview:
    if not header.flags & (FLAG_LZ4 | FLAG_ZSTD):
        return stored
    try:
        if header.flags & FLAG_LZ4:
            import lz4.block

            out = lz4.block.decompress(stored, uncompressed_size=header.raw_len)
        else:
            import zstandard

            out = zstandard.ZstdDecompressor().decompress(stored, max_output_size=header.raw_len)
    except Exception as exc:  # the libraries raise their own error types
        raise CorruptRecord(f"payload does not decompress: {exc}") from exc
    if len(out) != header.raw_len:
        raise CorruptRecord("decompressed payload has the wrong size")
    return memoryview(out)
