"""Record codec: round trips, every corruption is CorruptRecord, bounded allocation, signing, fuzzing."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import CorruptRecord
from kvtier.layout import DTYPE_SIZES
from kvtier.records import codec
from kvtier.records.codec import HEADER_SIZE, MAC_BYTES, decode, decode_header, encode, encode_bytes

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


def payload(n: int = 4096, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def compressible(n: int = 8192) -> bytes:
    return (b"\x00" * 60 + b"\x3f\x80\x01\x02") * (n // 64)


@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
@pytest.mark.parametrize("hmac_key", [None, b"secret"])
def test_round_trip(compression: str | None, hmac_key: bytes | None) -> None:
    data = compressible()
    rec = encode_bytes(KEY, data, "bfloat16", (2, 2048), compression=compression, hmac_key=hmac_key)
    out = decode(rec, expected_key=KEY, hmac_key=hmac_key)
    assert bytes(out.payload) == data
    h = out.header
    assert (h.key, h.dtype, h.shape, h.raw_len) == (KEY, "bfloat16", (2, 2048), len(data))
    assert h.signed == bool(hmac_key) and h.total_len == len(rec)
    if compression:
        assert len(rec) < len(data) // 2
    assert decode_header(rec[:HEADER_SIZE], expected_key=KEY) == h


def test_parts_are_not_joined_and_payload_is_not_copied() -> None:
    data = bytearray(payload(1024))
    header, body = encode(KEY, data, "uint8", (1024,))
    assert len(header) == HEADER_SIZE
    assert isinstance(body, memoryview) and body.obj is data


def test_incompressible_payload_is_stored_raw() -> None:
    data = payload(4096)
    rec = encode_bytes(KEY, data, "uint8", (4096,), compression="zstd")
    assert decode_header(rec).flags == 0 and len(rec) == HEADER_SIZE + 4096


@pytest.mark.parametrize("dtype,shape", [("float32", (3, 5)), ("float16", (7,)), ("int8", (2, 2, 2)),
                                         ("float8_e4m3fn", (16,)), ("uint8", ())])
def test_dtypes_and_shapes(dtype: str, shape: tuple[int, ...]) -> None:
    n = int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZES[dtype]
    rec = encode_bytes(KEY, payload(n), dtype, shape)
    h = decode(rec, expected_key=KEY).header
    assert (h.dtype, h.shape) == (dtype, shape)


def test_encode_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="key"):
        encode(b"short", b"", "uint8", (0,))
    with pytest.raises(ValueError, match="dtype"):
        encode(KEY, b"abcd", "float64", (4,))
    with pytest.raises(ValueError, match="needs"):
        encode(KEY, b"abc", "float32", (1,))
    with pytest.raises(ValueError, match="compression"):
        encode(KEY, b"abcd", "uint8", (4,), compression="brotli")


@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
def test_every_header_bit_flip_is_corrupt(compression: str | None) -> None:
    rec = encode_bytes(KEY, compressible(1024), "uint8", (1024,), compression=compression, hmac_key=b"k")
    prefix = HEADER_SIZE + MAC_BYTES
    for bit in range(prefix * 8):
        bad = bytearray(rec)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptRecord):
            decode(bad, expected_key=KEY, hmac_key=b"k")


@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
def test_payload_bit_flips_are_corrupt(compression: str | None) -> None:
    rec = encode_bytes(KEY, compressible(4096), "uint8", (4096,), compression=compression)
    prefix = decode_header(rec).prefix_len
    for bit in range(prefix * 8, len(rec) * 8, 97):
        bad = bytearray(rec)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptRecord):
            decode(bad, expected_key=KEY)


def test_truncation_and_extension_are_corrupt() -> None:
    rec = encode_bytes(KEY, payload(1000), "uint8", (1000,))
    for n in [0, 1, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, len(rec) - 1]:
        with pytest.raises(CorruptRecord):
            decode(rec[:n], expected_key=KEY)
    with pytest.raises(CorruptRecord, match="header says"):
        decode(rec + b"\0", expected_key=KEY)


def test_wrong_expected_key_is_corrupt() -> None:
    rec = encode_bytes(KEY, payload(64), "uint8", (64,))
    with pytest.raises(CorruptRecord, match="another key"):
        decode(rec, expected_key=OTHER)
    with pytest.raises(CorruptRecord, match="another key"):
        decode_header(rec, expected_key=OTHER)
    assert decode(rec, expected_key=None).header.key == KEY


def forge(rec: bytes, **fields: int) -> bytes:
    """Rewrite header fields and fix the header checksum, as a malicious writer would."""
    body_struct = codec._BODY
    values = list(body_struct.unpack_from(rec))
    names = ["magic", "version", "flags", "dtype", "ndim", "algo", "reserved"] + [f"d{i}" for i in range(8)] + [
        "stored", "raw", "pcheck", "key"]
    for name, value in fields.items():
        values[names.index(name)] = value
    body = body_struct.pack(*values)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + rec[HEADER_SIZE:]


@pytest.mark.parametrize("fields", [
    {"raw": 1 << 60, "stored": 1 << 60, "d0": 1 << 31},  # huge lengths
    {"d0": 1 << 30, "d1": 1 << 30, "raw": 0},
    {"stored": 1 << 40},
    {"raw": 1 << 40},
    {"flags": 1 | 2},
    {"flags": 64},
    {"version": 9},
    {"dtype": 200},
    {"ndim": 9},
    {"d5": 3},  # a dimension beyond ndim
])
def test_forged_headers_are_rejected_without_allocating(fields: dict[str, int]) -> None:
    rec = encode_bytes(KEY, payload(64), "uint8", (64,))
    with pytest.raises(CorruptRecord):
        decode(forge(rec, **fields), expected_key=KEY)


def test_max_raw_bounds_the_declared_size() -> None:
    rec = encode_bytes(KEY, payload(4096), "uint8", (4096,))
    with pytest.raises(CorruptRecord, match="bound"):
        decode(rec, expected_key=KEY, max_raw=4095)
    decode(rec, expected_key=KEY, max_raw=4096)


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_decompression_bomb_is_bounded(compression: str) -> None:
    if compression == "zstd":
        import zstandard

        bomb = zstandard.ZstdCompressor().compress(b"\0" * (1 << 20))
    else:
        import lz4.block

        bomb = lz4.block.compress(b"\0" * (1 << 20), store_size=False)
    rec = encode_bytes(KEY, compressible(8192), "uint8", (8192,), compression=compression)
    forged = forge(rec[:HEADER_SIZE] + bomb, stored=len(bomb), pcheck=xxhash.xxh3_64_intdigest(bomb))
    assert decode_header(forged).raw_len == 8192  # the header is valid; only the payload lies
    with pytest.raises(CorruptRecord, match="decompress"):
        decode(forged, expected_key=KEY)


def test_hmac_signed_unsigned_and_wrong_key() -> None:
    signed = encode_bytes(KEY, payload(256), "uint8", (256,), hmac_key=b"right")
    unsigned = encode_bytes(KEY, payload(256), "uint8", (256,))
    assert decode(signed, expected_key=KEY, hmac_key=b"right").header.signed
    with pytest.raises(CorruptRecord, match="signature"):
        decode(signed, expected_key=KEY, hmac_key=b"wrong")
    with pytest.raises(CorruptRecord, match="unsigned"):
        decode(unsigned, expected_key=KEY, hmac_key=b"right")
    assert decode(signed, expected_key=KEY).header.signed  # readers without a key still check the checksum
    # a record re-signed with another key after tampering the payload is still rejected
    body = bytearray(signed)
    body[-1] ^= 1
    with pytest.raises(CorruptRecord):
        decode(bytes(body), expected_key=KEY, hmac_key=b"right")


def test_mac_flip_is_caught_only_with_the_key() -> None:
    signed = bytearray(encode_bytes(KEY, payload(256), "uint8", (256,), hmac_key=b"right"))
    signed[HEADER_SIZE + 3] ^= 0x80
    with pytest.raises(CorruptRecord, match="signature"):
        decode(bytes(signed), expected_key=KEY, hmac_key=b"right")


VALID = [encode_bytes(KEY, compressible(512), "float16", (16, 16), compression=c, hmac_key=h)
         for c in (None, "lz4", "zstd") for h in (None, b"k")]


def decode_only_corrupt(buf: bytes, hmac_key: bytes | None = None) -> None:
    try:
        rec = decode(buf, expected_key=None, max_raw=1 << 20, hmac_key=hmac_key)
    except CorruptRecord:
        return
    assert rec.payload.nbytes == rec.header.raw_len <= 1 << 20


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_random_bytes(buf: bytes) -> None:
    decode_only_corrupt(buf)
    decode_only_corrupt(buf, b"k")


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8),
       st.integers(0, 800), st.booleans())
def test_fuzz_mutated_records(rec: bytes, edits: list[tuple[int, int]], cut: int, use_key: bool) -> None:
    buf = bytearray(rec)
    for pos, val in edits:
        buf[pos % len(buf)] = val
    if cut:
        buf = buf[:len(buf) - cut % len(buf)]
    decode_only_corrupt(bytes(buf), b"k" if use_key else None)
