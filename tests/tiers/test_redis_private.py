"""A private Redis tier (``private: true``, no ``ttl``), on real servers: the directory tracks it as it does a local
tier, so it lists what the server holds at start, lookups ask the server nothing (the server's own count of EXISTS
calls shows it), kvtier keeps it within its capacity, and a record the server dropped behind the directory is a
miss, never wrong KV."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
from contract import assert_same, rand
from redis_helpers import Make, fresh_prefix, started_tiers

from kvtier import TieredStore, load_config
from kvtier.bench.redis_servers import RedisServer
from kvtier.config import RedisTierConfig
from kvtier.tiers.catalog import RecordInfo
from kvtier.tiers.redis import tier as tier_module
from kvtier.tiers.redis.catalog import scan_entries
from kvtier.tiers.redis.tier import RedisTier


def k(i: int) -> bytes:
    return b"namespace-P-0000" + i.to_bytes(16, "big")


@pytest.fixture
async def make(redis_server: RedisServer) -> AsyncIterator[Make]:
    async with started_tiers(redis_server.url) as build:
        yield build


@pytest.fixture
def raw(redis_server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=redis_server.port)


def exists_calls(raw: redis.Redis) -> int:
    return int(raw.info("commandstats").get("cmdstat_exists", {}).get("calls", 0))


async def test_a_private_tier_lists_what_the_server_holds_and_leaves_an_unreadable_record_out(
        make: Make, raw: redis.Redis) -> None:
    first = await make()
    values = {i: rand((2000 + 1000 * i,), seed=i) for i in range(3)}
    values[3] = rand((9 << 18,), seed=3)  # 9 MiB: stored in parts (kvtier.tiers.redis.bulk)
    assert all(await first.put([(k(i), t) for i, t in values.items()]))
    raw.set(first.redis_key(k(9)), b"not a record")  # another deployment's, or a torn write: not kvtier's to delete
    await first.list_entries()
    assert first.is_shared and first.entries() == []
    second = await make(private=True)
    assert not second.is_shared and second.entries() == []  # listed only where a directory adopts them
    await second.list_entries()
    assert {e.key: e.size for e in second.entries()} == {k(i): second.stored_size(t.nbytes) for i, t in values.items()}
    assert raw.get(second.redis_key(k(9))) == b"not a record"


async def test_records_past_a_private_tiers_capacity_are_not_adopted_and_nothing_is_deleted(
        make: Make, raw: redis.Redis) -> None:
    """The capacity was lowered since they were written: what does not fit is left on the server, untracked (so
    never read: the first that allkeys-lru evicts)."""
    big = rand((9 << 18,), seed=1)
    first = await make()
    assert await first.put([(k(1), big), (k(2), big)]) == [True, True]
    before = sorted(raw.scan_iter(match=f"*{first.section.key_prefix}:*"))
    assert len(before) > 2  # the heads and their parts
    size = first.stored_size(big.nbytes)
    second = await make(private=True, capacity=size + size // 2)
    await second.list_entries()
    kept = second.entries()
    assert len(kept) == 1 and kept[0].size == size and kept[0].key in (k(1), k(2))
    assert sorted(raw.scan_iter(match=f"*{first.section.key_prefix}:*")) == before
    assert second.used_bytes() == 0


def q(i: int) -> bytes:
    return b"namespace-Q-0000" + i.to_bytes(16, "big")


@pytest.mark.parametrize(("described", "listed"), [
    ([k(1)[:16]], [k(1)]),  # this process's namespace only: another rank's shards are not its
    ([], []),  # described with none (weights not fingerprinted: it serves nothing)
    (None, [k(1), q(1)]),  # never described: every namespace
], ids=["its-own", "none", "never-described"])
async def test_a_private_tier_lists_only_the_namespaces_it_was_described(
        make: Make, described: list[bytes] | None, listed: list[bytes]) -> None:
    first = await make()
    assert all(await first.put([(k(1), rand((500,))), (q(1), rand((500,)))]))
    second = await make(private=True)
    if described is not None:
        second.describe({ns: {} for ns in described})
    await second.list_entries()
    assert sorted(e.key for e in second.entries()) == sorted(listed)


class _Source:
    """A listing's source whose server fails halfway, after returning a key twice (SCAN may)."""

    def __init__(self, records: list[RecordInfo]) -> None:
        self._records, self.closed = records, False

    def records(self) -> Iterator[RecordInfo]:
        yield from self._records
        raise ConnectionError("connection reset by peer")

    def close(self) -> None:
        self.closed = True


def test_a_listing_that_fails_halfway_keeps_what_it_listed_each_key_once() -> None:
    header = object()
    sound = [RecordInfo(k(i), 100 + i, None, header=header) for i in range(2)]  # type: ignore[arg-type]
    torn = RecordInfo(k(7), 5, None, error="bad header")
    source = _Source([sound[0], sound[1], sound[0], torn])
    listing = scan_entries(source, threading.Event())  # type: ignore[arg-type]
    assert [(e.key, e.size) for e in listing.entries] == [(k(0), 100), (k(1), 101)]
    assert listing.bad == [k(7)]
    assert listing.error is not None and "connection reset" in listing.error
    assert source.closed


def test_a_listing_stops_when_its_tier_closes() -> None:
    header = object()
    stop = threading.Event()
    stop.set()
    listing = scan_entries(_Source([RecordInfo(k(0), 1, None, header=header)]), stop)  # type: ignore[arg-type]
    assert listing.entries == [] and listing.error == "stopped"


async def test_a_key_prefix_with_a_colon_is_listed(make: Make) -> None:
    first = await make(key_prefix="app:kv")
    assert await first.put([(k(1), rand((500,)))]) == [True]
    second = await make(key_prefix="app:kv", private=True)
    await second.list_entries()
    assert [e.key for e in second.entries()] == [k(1)]


async def test_a_private_tier_with_a_ttl_is_asked_as_a_shared_one_is(
        redis_server: RedisServer, raw: redis.Redis) -> None:
    """Records that expire on the server cannot be tracked here: such a tier is looked up on the server."""
    cfg = _config(redis_server.url, fresh_prefix())
    cfg["tiers"][0]["ttl"] = "30s"  # type: ignore[index]
    store = TieredStore.from_config(load_config(cfg, env={}))
    await store.start()
    try:
        assert store.tier("redis").is_shared
        await store.put([(k(1), rand((4096,)))])
        calls = exists_calls(raw)
        assert (await store.lookup([k(1), k(2)])).hits == 1
        assert exists_calls(raw) > calls
    finally:
        await store.close()


async def test_a_private_tier_whose_server_is_down_at_start_starts_at_once_and_lists_nothing() -> None:
    section = RedisTierConfig(name="redis", capacity=1 << 28, url="redis://127.0.0.1:1/0", timeout=0.2,
                              connect_timeout=0.2, private=True)
    tier = RedisTier(section)
    t0 = time.monotonic()
    await tier.start()
    await tier.list_entries()
    assert tier.entries() == []
    await tier.close()
    assert time.monotonic() - t0 < 5.0


def _config(url: str, prefix: str, capacity: str = "1GiB") -> dict[str, object]:
    return {"chunk_size": 16, "tiers": [{"name": "redis", "kind": "redis", "capacity": capacity, "url": url,
                                         "key_prefix": prefix, "timeout": "5s", "private": True}]}


async def test_a_store_restarted_on_a_private_tier_finds_its_records_without_asking_the_server(
        redis_server: RedisServer, raw: redis.Redis) -> None:
    prefix = fresh_prefix()
    values = [(k(i), rand((4096,), seed=i)) for i in range(4)]
    store = TieredStore.from_config(load_config(_config(redis_server.url, prefix), env={}))
    await store.start()
    await store.put(values)
    await store.close()
    again = TieredStore.from_config(load_config(_config(redis_server.url, prefix), env={}))
    await again.start()
    try:
        calls = exists_calls(raw)
        assert (await again.lookup([key for key, _ in values] + [k(99)])).hits == 4
        assert exists_calls(raw) == calls  # the directory answered
        for (_, want), got in zip(values, await again.get([key for key, _ in values]), strict=True):
            assert got is not None
            assert_same(got, want)
        raw.delete(again.tier("redis").redis_key(k(0)))  # what maxmemory eviction or a flush does
        assert (await again.get([k(0)]))[0] is None  # a miss, and the directory forgets it
        assert (await again.lookup([k(0)])).hits == 0
    finally:
        await again.close()


async def test_kvtier_keeps_a_private_tier_within_its_capacity(redis_server: RedisServer, raw: redis.Redis) -> None:
    """The directory chooses victims for a private tier, as for disk, and they are deleted from the server."""
    prefix = fresh_prefix()
    record = RedisTier(RedisTierConfig(name="r", capacity=1, url=redis_server.url)).stored_size(4096 * 4)
    store = TieredStore.from_config(load_config(_config(redis_server.url, prefix, f"{3 * record}B"), env={}))
    await store.start()
    try:
        for i in range(6):
            await store.put([(k(i), rand((4096,), seed=i))])
        held = sorted(raw.scan_iter(match=f"{prefix}:*"))
        assert len(held) == 3 and store.tier("redis").used_bytes() == 3 * record
        assert (await store.lookup([k(5)])).hits == 1 and (await store.lookup([k(0)])).hits == 0
    finally:
        await store.close()


async def test_write_back_persists_memory_chunks_into_a_private_tier_and_a_restart_finds_them(
        redis_server: RedisServer) -> None:
    """A private Redis survives the engine as a disk does: at close, what only the cpu tier holds is copied there."""
    prefix = fresh_prefix()
    cfg = {"chunk_size": 16, "policy": {"write": "write_back"},
           "tiers": [{"name": "cpu", "kind": "cpu", "capacity": "64MiB"},
                     {"name": "redis", "kind": "redis", "capacity": "1GiB", "url": redis_server.url,
                      "key_prefix": prefix, "timeout": "5s", "private": True}]}
    values = [(k(i), rand((4096,), seed=i)) for i in range(3)]
    store = TieredStore.from_config(load_config(cfg, env={}))
    await store.start()
    await store.put(values)
    assert (await store.lookup([key for key, _ in values])).tiers == ("cpu",) * 3
    await store.close()
    again = TieredStore.from_config(load_config(cfg, env={}))
    await again.start()
    try:
        assert (await again.lookup([key for key, _ in values])).tiers == ("redis",) * 3
        for (_, want), got in zip(values, await again.get([key for key, _ in values]), strict=True):
            assert got is not None
            assert_same(got, want)
    finally:
        await again.close()


async def test_a_private_tier_started_again_after_close_lists_again(make: Make) -> None:
    """close stops a listing still running; the next start must not inherit that stop, nor an answer from the
    server its earlier start had."""
    first = await make()
    assert all(await first.put([(k(1), rand((500,)))]))
    second = await make(private=True)
    await second.close()
    await second.list_entries()
    assert second.entries() == []  # closed: the server's earlier answer does not count
    await second.start()
    await second.list_entries()
    assert [e.key for e in second.entries()] == [k(1)]


async def test_a_listing_the_tier_closed_meanwhile_keeps_nothing(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    first = await make()
    assert all(await first.put([(k(1), rand((500,)))]))
    second = await make(private=True)
    scan = tier_module.scan_entries

    def slow_scan(source: Any, stop: threading.Event) -> Any:
        stop.wait(5.0)  # the tier is closed while its listing runs
        return scan(source, threading.Event())  # a scan that would list everything

    monkeypatch.setattr(tier_module, "scan_entries", slow_scan)
    listing = asyncio.create_task(second.list_entries())
    await asyncio.sleep(0.05)
    await second.close()
    await listing
    assert second.entries() == []


async def test_the_capacity_is_counted_over_the_namespaces_described_after_the_listing(make: Make) -> None:
    """A one-process store lists its tiers before the connector describes them: the capacity then bounds this
    engine's own records, whatever else the server listed first."""
    first = await make()
    mine, others = rand((500,), seed=1), [(q(i), rand((500,), seed=i)) for i in range(6)]
    assert all(await first.put([(k(1), mine), *others]))
    second = await make(private=True, capacity=first.stored_size(mine.nbytes))
    await second.list_entries()
    second.describe({k(1)[:16]: {}})
    assert [e.key for e in second.entries()] == [k(1)]


async def test_a_one_process_store_keeps_only_this_engines_records_once_its_tiers_are_described(
        redis_server: RedisServer) -> None:
    """A one-process store adopts at start every record its private tier lists (no namespace is named yet). Once
    the connector describes the tiers, its directory holds this engine's records only, within the capacity."""
    from kvtier.connector.tiered import describe_tiers

    prefix = fresh_prefix()
    writer = TieredStore.from_config(load_config(_config(redis_server.url, prefix), env={}))
    await writer.start()
    await writer.put([(q(i), rand((4096,), seed=i)) for i in range(3)] + [(k(1), rand((4096,), seed=9))])
    await writer.close()
    record = RedisTier(RedisTierConfig(name="r", capacity=1, url=redis_server.url)).stored_size(4096 * 4)
    store = TieredStore.from_config(load_config(_config(redis_server.url, prefix, f"{3 * record}B"), env={}))
    await store.start()
    try:
        others = [q(i) for i in range(3)]
        assert (await store.lookup(others[:1])).hits + (await store.lookup(others[1:2])).hits >= 1  # adopted
        await describe_tiers([store.tier("redis")], {k(1)[:16]: {}}, store.directory)
        assert [(await store.lookup([key])).hits for key in others] == [0, 0, 0]
        assert (await store.lookup([k(1)])).hits == 1  # past the capacity before, this engine's own now
        assert store.directory.used_bytes("redis") == record
    finally:
        await store.close()
