"""Redis tier under faults, on real servers: killed, restarted on the same port, frozen (SIGSTOP), CLIENT PAUSE.

Every call must return misses (never raise) within a bounded time, the breaker must open and, once the server
answers again, hits must resume without restarting kvtier. Latency bounds are generous guards (10x the
timeout), not timing benchmarks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest
from contract import assert_same, rand

from kvtier.bench.redis_servers import RedisServer
from kvtier.config import RedisTierConfig
from kvtier.tiers.redis.breaker import BreakerState
from kvtier.tiers.redis.tier import RedisTier

TIMEOUT = 0.2
BOUND = 10 * TIMEOUT
T = TypeVar("T")


def k(i: int) -> bytes:
    return b"namespace-F-0000" + i.to_bytes(16, "big")


@pytest.fixture
def server(redis_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_factory()


@pytest.fixture
async def tier(server: RedisServer) -> AsyncIterator[RedisTier]:
    section = RedisTierConfig(name="shared", capacity=1 << 28, url=server.url, timeout=TIMEOUT, connect_timeout=TIMEOUT,
                              breaker_failures=3, breaker_backoff=0.3)
    t = RedisTier(section)
    await t.start()
    yield t
    await t.close()


async def timed(coro: Awaitable[T]) -> tuple[T, float]:
    t0 = time.monotonic()
    out = await coro
    return out, time.monotonic() - t0


async def every_op_misses(tier: RedisTier) -> float:
    """Run each operation once; all must miss without raising. Returns the slowest call's duration."""
    results: list[tuple[Any, float]] = [
        await timed(tier.get([k(0), k(1)])),
        await timed(tier.contains([k(0)])),
        await timed(tier.put([(k(5), rand((1000,)))])),
        await timed(tier.delete([k(9)])),
    ]
    assert [r for r, _ in results] == [[None, None], [False], [False], 0]
    return max(d for _, d in results)


async def until(pred: Callable[[], Awaitable[bool]], limit: float = 10.0) -> float:
    t0 = time.monotonic()
    while not await pred():
        assert time.monotonic() - t0 < limit, "condition not reached"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def test_killed_server_then_restarted(tier: RedisTier, server: RedisServer) -> None:
    t = rand((20_000,))
    assert await tier.put([(k(0), t)]) == [True]
    used = tier.used_bytes()
    server.kill()
    slowest = max([await every_op_misses(tier) for _ in range(3)])
    assert slowest < BOUND
    assert await tier.put([(k(0), rand((500,)))]) == [False]  # a failed overwrite keeps the old record's bytes
    assert tier.used_bytes() == used
    s = tier.stats()
    assert s.errors + s.timeouts >= 3
    assert tier.breaker.state != BreakerState.CLOSED and s.extra["breaker_opens"] >= 1
    # While open, calls are refused at once, without touching the network.
    rejected = tier.breaker.rejected
    _, took = await timed(tier.get([k(0)]))
    assert took < TIMEOUT and tier.breaker.rejected == rejected + 1

    server.start()  # same port, empty (nothing persisted)
    waited = await until(lambda: _put_ok(tier, k(1), t))
    assert waited < 10
    assert_same((await tier.get([k(1)]))[0], t)
    assert await tier.contains([k(1), k(0)]) == [True, False]  # redis-py's pool reconnected too
    assert await tier.delete([k(1)]) == 1
    assert tier.breaker.state == BreakerState.CLOSED and tier.stats().extra["breaker_state"] == 0


async def _put_ok(tier: RedisTier, key: bytes, t: Any) -> bool:
    return (await tier.put([(key, t)])) == [True]


async def test_frozen_server_gives_bounded_misses(tier: RedisTier, server: RedisServer) -> None:
    t = rand((300_000,))
    await tier.put([(k(0), t)])
    server.pause()  # SIGSTOP: sockets stay open, nothing is answered
    try:
        slowest = max([await every_op_misses(tier) for _ in range(2)])
        assert slowest < BOUND
        assert tier.stats().timeouts >= 1 and tier.breaker.opens >= 1
    finally:
        server.resume()
    await until(lambda: _hit(tier, k(0)))
    assert_same((await tier.get([k(0)]))[0], t)


async def _hit(tier: RedisTier, key: bytes) -> bool:
    return (await tier.get([key]))[0] is not None


async def test_client_pause_longer_than_timeout(tier: RedisTier, server: RedisServer) -> None:
    t = rand((50_000,))
    await tier.put([(k(0), t)])
    server.client_pause(1.5)
    (got, took) = await timed(tier.get([k(0)]))
    assert got == [None] and took < BOUND
    assert tier.stats().timeouts == 1
    waited = await until(lambda: _hit(tier, k(0)))
    assert waited < 10
    assert_same((await tier.get([k(0)]))[0], t)


async def test_kill_during_a_large_transfer(tier: RedisTier, server: RedisServer) -> None:
    items = [(k(i), rand((1 << 20,), seed=i)) for i in range(8)]  # 32 MiB in flight
    assert all(await tier.put(items))

    async def killer() -> None:
        await asyncio.sleep(0.005)
        server.kill()

    (got, took), _ = await asyncio.gather(timed(tier.get([key for key, _ in items])), killer())
    assert took < BOUND + 1
    for g, (_, t) in zip(got, items, strict=True):
        assert g is None or assert_same(g, t) is None  # never a wrong or partial tensor
