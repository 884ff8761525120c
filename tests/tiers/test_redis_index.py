"""A private Redis tier's index (kvtier.tiers.redis.index), on real servers: lookups answered with no round trip
(the server's own count of EXISTS calls shows it), records already on the server found by the start's scan, and
records the server dropped behind kvtier's back read as misses that leave the index."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
import redis
import torch
from contract import assert_same, rand
from redis_helpers import Make, started_tiers

from kvtier.bench.redis_servers import RedisServer
from kvtier.config import RedisTierConfig
from kvtier.tiers.redis.breaker import BreakerState
from kvtier.tiers.redis.tier import RedisTier


def k(i: int) -> bytes:
    return b"namespace-I-0000" + i.to_bytes(16, "big")


@pytest.fixture
async def make(redis_server: RedisServer) -> AsyncIterator[Make]:
    async with started_tiers(redis_server.url) as build:
        yield build


@pytest.fixture
def raw(redis_server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=redis_server.port)


def exists_calls(raw: redis.Redis) -> int:
    return int(raw.info("commandstats").get("cmdstat_exists", {}).get("calls", 0))


async def indexed(tier: RedisTier, limit: float = 10.0) -> None:
    t0 = time.monotonic()
    while tier.index is None or not tier.index.ready:
        assert time.monotonic() - t0 < limit, "the index never became ready"
        await asyncio.sleep(0.02)


async def test_a_private_tier_answers_lookups_from_its_index_and_a_shared_one_asks_the_server(
        make: Make, raw: redis.Redis) -> None:
    private, shared = await make(private=True), await make()
    await indexed(private)
    assert shared.index is None and shared.known([k(1)]) is None
    assert await private.put([(k(1), rand((500,))), (k(2), rand((500,)))]) == [True, True]
    calls = exists_calls(raw)
    assert private.known([k(1), k(2), k(3)]) == [True, True, False]
    assert await private.contains([k(1), k(2), k(3)]) == [True, True, False]
    assert exists_calls(raw) == calls  # no round trip
    assert await shared.contains([k(1), k(3)]) == [True, False]  # the same server, asked (same prefix)
    assert exists_calls(raw) > calls
    assert await private.delete([k(2)]) == 1
    assert private.known([k(1), k(2)]) == [True, False]
    assert private.stats().lookups == 8 and private.stats().hits == 5


async def test_records_on_the_server_at_start_are_indexed_and_a_bad_one_is_left_out(
        make: Make, raw: redis.Redis) -> None:
    first = await make()
    values = {i: rand((2000,), seed=i) for i in range(3)}
    assert all(await first.put([(k(i), t) for i, t in values.items()]))
    raw.set(first.redis_key(k(9)), b"not a record")
    second = await make(private=True)
    assert second.index is not None and second.index.ready  # a small server is scanned before start returns
    assert second.known([k(0), k(1), k(2), k(9), k(5)]) == [True, True, True, False, False]
    got = await second.get([k(0), k(1), k(2)])
    for i, value in enumerate(got):
        assert value is not None
        assert_same(value, values[i])


async def test_a_record_the_server_dropped_reads_as_a_miss_and_leaves_the_index(
        make: Make, raw: redis.Redis) -> None:
    """What ``maxmemory`` eviction or a flush does: the index still says present, the read misses (the engine then
    recomputes: a failed load), and the key leaves the index."""
    tier = await make(private=True)
    await indexed(tier)
    assert await tier.put([(k(1), rand((500,))), (k(2), rand((500,)))]) == [True, True]
    raw.delete(tier.redis_key(k(1)))
    assert tier.known([k(1), k(2)]) == [True, True]
    got = await tier.get([k(1), k(2)])
    assert got[0] is None and got[1] is not None
    assert tier.known([k(1), k(2)]) == [False, True]


async def test_a_private_tier_with_a_ttl_forgets_a_record_when_it_expires(make: Make, raw: redis.Redis) -> None:
    tier = await make(private=True, ttl=0.5)
    await indexed(tier)
    assert await tier.put([(k(1), rand((500,)))]) == [True]
    assert tier.known([k(1)]) == [True]
    later = await make(private=True, ttl=0.5)  # the scan reads the record's expiry from its PTTL
    await indexed(later)
    assert later.known([k(1)]) == [True]
    await asyncio.sleep(0.7)
    assert tier.known([k(1)]) == [False] and later.known([k(1)]) == [False]
    assert raw.exists(tier.redis_key(k(1))) == 0


async def test_after_the_server_restarted_empty_the_index_asks_it_and_is_scanned_again(
        redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory()
    section = RedisTierConfig(name="redis", capacity=1 << 28, url=server.url, timeout=0.2, connect_timeout=0.2,
                              breaker_failures=3, breaker_backoff=0.3, private=True)
    tier = RedisTier(section)
    await tier.start()
    try:
        await indexed(tier)
        assert await tier.put([(k(1), rand((500,)))]) == [True]
        server.kill()
        for _ in range(3):
            assert await tier.get([k(1)]) == [None]
        assert tier.breaker.state != BreakerState.CLOSED
        assert tier.known([k(1)]) is None  # the server may have lost it: ask
        server.start()  # same port, empty
        t0 = time.monotonic()
        while await tier.put([(k(2), rand((500,)))]) != [True]:
            assert time.monotonic() - t0 < 10
            await asyncio.sleep(0.05)
        await indexed(tier)
        assert tier.known([k(1), k(2)]) == [False, True]
    finally:
        await tier.close()


async def test_close_stops_a_scan_that_cannot_reach_its_server() -> None:
    section = RedisTierConfig(name="redis", capacity=1 << 28, url="redis://127.0.0.1:1/0", timeout=0.2,
                              connect_timeout=0.2, private=True)
    tier = RedisTier(section)
    await tier.start()
    assert tier.known([k(1)]) is None and await tier.contains([k(1)]) == [False]
    t0 = time.monotonic()
    await tier.close()
    assert time.monotonic() - t0 < 1.0
    assert tier._scan_task is not None
    await asyncio.sleep(0)
    assert tier._scan_task.done()


def test_the_index_keeps_what_this_process_did_during_a_scan() -> None:
    """A scan lists what the server held when it read it: a record stored or deleted meanwhile keeps this process's
    answer, and a key the scan did not list leaves the index."""
    from kvtier.records.codec import HEADER_SIZE, decode_header, encode_bytes
    from kvtier.tiers.catalog import RecordInfo
    from kvtier.tiers.redis.index import KeyIndex

    def listed(i: int) -> RecordInfo:
        record = encode_bytes(k(i), torch.zeros(4).numpy(), "float32", (4,))
        return RecordInfo(k(i), len(record), None, header=decode_header(record[:HEADER_SIZE], expected_key=k(i)))

    index = KeyIndex(None)
    assert index.known([k(1)]) is None
    index.stored(k(7))  # before the scan: the scan's listing decides
    index.scanning()
    index.stored(k(1))
    index.gone([k(2)])
    index.scanned([listed(2), listed(3)])
    assert index.known([k(1), k(2), k(3), k(7)]) == [True, False, True, False]
