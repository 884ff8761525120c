"""Headers that lie about their payload's size, read by the codec, the disk tier and the Redis tier: only a miss
(``CorruptRecord`` inside, counted and deleted), and never an allocation sized by the lie.

tests/records/test_codec.py already fuzzes ``decode`` with random and mutated bytes (only ``CorruptRecord`` escapes)
and rejects forged field values; tests/config/test_config_fuzz.py fuzzes config loading (only ``ConfigError``). These
add well-formed headers (valid header checksum) claiming up to the 2 GiB bound, and measure allocations.
"""

from __future__ import annotations

import asyncio
import tempfile
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.bench.redis_servers import RedisServer
from kvtier.config import DiskTierConfig, RedisTierConfig
from kvtier.errors import CorruptRecord
from kvtier.records import codec
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.redis.tier import RedisTier

KEY = bytes(range(32))


def forged(claimed: tuple[int, ...], actual_payload: int, *, stored: int | None = None, key: bytes = KEY) -> bytes:
    """A record whose header (checksum valid) claims a uint8 payload of shape ``claimed`` but carries
    ``actual_payload`` bytes."""
    raw = 1
    for d in claimed:
        raw *= d
    payload = bytes(actual_payload)
    dims = list(claimed) + [0] * (codec.MAX_DIMS - len(claimed))
    body = codec._BODY.pack(codec.MAGIC, codec.VERSION, 0, codec.DTYPE_CODES["uint8"], len(claimed),
                            codec.CHECKSUM_XXH3, 0, *dims, raw if stored is None else stored, raw,
                            xxhash.xxh3_64_intdigest(payload), key)
    return body + codec._CHECK.pack(xxhash.xxh3_64_intdigest(body)) + payload


CLAIMS = st.lists(st.integers(1, 1 << 16), min_size=1, max_size=3).filter(
    lambda dims: (n := _prod(dims)) <= codec.DEFAULT_MAX_RAW and n > 4096)


def _prod(dims: list[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


@settings(max_examples=200, deadline=None)
@given(claimed=CLAIMS, actual=st.integers(0, 4096))
def test_codec_never_allocates_what_a_header_claims(claimed: list[int], actual: int) -> None:
    buf = forged(tuple(claimed), actual)
    assert codec.decode_header(buf).raw_len == _prod(claimed)  # the header alone is well formed
    tracemalloc.start()
    try:
        with pytest.raises(CorruptRecord, match="header says"):
            codec.decode(buf, expected_key=KEY)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10


@contextmanager
def allocations() -> Iterator[list[int]]:
    """Record the size of every ``torch.empty`` while inside (the disk tier reads records into one)."""
    sizes: list[int] = []
    real = torch.empty

    def spy(*size: object, **kw: object) -> torch.Tensor:
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        sizes.append(_prod([int(d) for d in shape]))  # type: ignore[union-attr]
        return real(*size, **kw)  # type: ignore[call-overload, no-any-return]

    torch.empty = spy  # type: ignore[assignment]
    try:
        yield sizes
    finally:
        torch.empty = real


async def _disk_round(root: str, buf: bytes) -> tuple[torch.Tensor | None, DiskTier, list[int]]:
    tier = DiskTier(DiskTierConfig(name="d", capacity=codec.DEFAULT_MAX_RAW * 2, path=root))
    await tier.start()
    path = Path(tier.layout.path(KEY))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf)
    with allocations() as sizes:
        [got] = await tier.get([KEY])
    assert not path.exists()
    return got, tier, sizes


@settings(max_examples=60, deadline=None)
@given(claimed=CLAIMS, actual=st.integers(0, 4096))
def test_disk_tier_reading_a_lying_file_allocates_only_the_file(claimed: list[int], actual: int) -> None:
    buf = forged(tuple(claimed), actual)
    with tempfile.TemporaryDirectory() as root:
        got, tier, sizes = asyncio.run(_disk_round(root, buf))
        assert got is None and tier.stats().corrupt == 1
        assert max(sizes, default=0) <= len(buf)
        Path(tier.layout.path(KEY)).write_bytes(buf)  # and at start-up: the scan reads the header only
        again = DiskTier(DiskTierConfig(name="d", capacity=codec.DEFAULT_MAX_RAW * 2, path=root))
        asyncio.run(again.start())
        assert list(again.entries()) == [] and again.stats().corrupt == 1


class RecordingBuffers:
    """The Redis tier's buffer pool with every request's size written down."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def take(self, nbytes: int) -> torch.Tensor:
        self.sizes.append(nbytes)
        return self.inner.take(nbytes)  # type: ignore[attr-defined, no-any-return]


@pytest.mark.parametrize(("claimed", "actual"), [((1 << 27,), 10), ((1 << 27,), 5 << 20), ((4096, 4096), 5000),
                                                 ((1000,), 999), ((1000,), 1001), ((9 << 20,), 8 << 20)])
async def test_redis_tier_reading_a_lying_value_allocates_within_the_bound(
        redis_server: RedisServer, claimed: tuple[int, ...], actual: int) -> None:
    """A miss, deleted and counted. A claim over the tier's bound (its capacity, here 64 MiB; at most 2 GiB)
    allocates nothing; any other allocation stays within the bound whatever the header says."""
    import redis.asyncio as aredis

    section = RedisTierConfig(name="r", capacity=64 << 20, url=redis_server.url, timeout=2.0,
                              key_prefix=f"kvtier-fuzz-{claimed[0]}-{actual}")
    tier = RedisTier(section)
    await tier.start()
    buffers = RecordingBuffers(tier.buffers)
    tier.buffers = buffers  # type: ignore[assignment]
    client = aredis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        await client.set(tier.redis_key(KEY), forged(claimed, actual))
        assert await tier.get([KEY]) == [None]
        assert tier.stats().corrupt == 1
        assert max(buffers.sizes, default=0) <= section.capacity
        if _prod(list(claimed)) > section.capacity:
            assert buffers.sizes == []
        assert await client.exists(tier.redis_key(KEY)) == 0
    finally:
        await client.aclose()
        await tier.close()
