"""kvtier's raw RESP connection against a real server: replies, errors, large values, staleness, timeouts."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from kvtier.bench.redis_servers import RedisServer
from kvtier.tiers.redis.resp import RespConnection, RespError, RespPool, pack


async def opened(srv: RedisServer, timeout: float = 2.0, **kw: object) -> RespConnection:
    return await RespConnection.open("127.0.0.1", srv.port, timeout=timeout, connect_timeout=2.0, **kw)  # type: ignore[arg-type]


def test_pack() -> None:
    assert pack("SET", b"k", 12) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n"


async def test_replies_and_errors(redis_factory: Callable[..., RedisServer]) -> None:
    srv = redis_factory(password="pw")
    with pytest.raises(RespError, match=r"WRONGPASS|invalid"):
        await opened(srv, password="bad")
    conn = await opened(srv, password="pw", db=2)
    assert await conn.command("SET", "a", "1") == "OK"
    assert await conn.command("INCR", "a") == 2
    assert await conn.command("GET", "a") == b"2"
    assert await conn.command("GET", "missing") is None
    with pytest.raises(RespError, match="WRONGTYPE"):
        await conn.command("LPUSH", "a", "x")
    assert srv.cli("-n", "2", "GET", "a").strip() == "2"  # SELECT 2 happened
    conn.close()


async def test_large_value_scatter_gather_and_read_into(redis_server: RedisServer) -> None:
    conn = await opened(redis_server)
    value = np.random.default_rng(0).integers(0, 256, 5_000_000, dtype=np.uint8)
    head = b"*3\r\n$3\r\nSET\r\n$6\r\nresp:v\r\n$%d\r\n" % value.nbytes
    await conn.send([head, value[:1234], value[1234:], b"\r\n"])
    assert await conn.read_reply() == "OK"
    await conn.send([pack("GET", "resp:v")])
    line = await conn.read_line()
    assert line == b"$%d" % value.nbytes
    out = np.zeros_like(value)
    await conn.read_into(memoryview(out))
    await conn.skip(2)
    assert np.array_equal(out, value) and conn.healthy()
    conn.close()


async def test_pool_replaces_connections_the_server_closed(redis_server: RedisServer) -> None:
    pool = RespPool("127.0.0.1", redis_server.port, 2, timeout=2.0, connect_timeout=2.0)
    async with pool.connection() as conn:
        await conn.command("CLIENT", "SETNAME", "kvtier-resp-test")
    redis_server.cli("CLIENT", "KILL", "ID", str(await _client_id(pool)))
    async with pool.connection() as conn:
        assert await conn.command("PING") == "PONG"
    pool.close()


async def _client_id(pool: RespPool) -> int:
    async with pool.connection() as conn:
        return int(await conn.command("CLIENT", "ID"))


async def test_idle_timeout_on_a_frozen_server(redis_factory: Callable[..., RedisServer]) -> None:
    srv = redis_factory()
    conn = await opened(srv, timeout=0.2)
    srv.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await conn.command("PING")
        assert time.monotonic() - t0 < 2.0
    finally:
        srv.resume()
        conn.close()
