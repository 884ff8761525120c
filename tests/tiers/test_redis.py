"""The Redis tier on real servers: record layout, TTL, corrupt and foreign values, namespaces, HMAC,
compression, large values over several connections, buffer recycling, cluster routing, two processes."""

from __future__ import annotations

import asyncio
import gc
import itertools
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
import torch
from contract import assert_same, rand
from redis_helpers import Make, started_tiers

from kvtier.bench.redis_servers import RedisClusterServers, RedisServer
from kvtier.records import codec
from kvtier.tiers.redis.bulk import part_name, parts_of

NS_A = b"namespace-A-0000"
NS_B = b"namespace-B-0000"


def k(i: int, ns: bytes = NS_A) -> bytes:
    return ns + i.to_bytes(16, "big")


@pytest.fixture
async def make(redis_server: RedisServer) -> AsyncIterator[Make]:
    """Build and start tiers on the shared server; a fresh key prefix per test unless one is given."""
    async with started_tiers(redis_server.url) as build:
        yield build


@pytest.fixture
def raw(redis_server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=redis_server.port)


async def test_one_key_per_record_holding_a_codec_record(make: Make, raw: redis.Redis) -> None:
    tier = await make()
    t = rand((3, 128), torch.bfloat16, seed=1)
    assert await tier.put([(k(1), t)]) == [True]
    name = f"{tier.section.key_prefix}:{NS_A.hex()}:{(1).to_bytes(16, 'big').hex()}".encode()
    assert tier.redis_key(k(1)) == name
    assert raw.keys(f"{tier.section.key_prefix}:*") == [name]
    value = raw.get(name)
    assert isinstance(value, bytes) and len(value) == tier.stored_size(t.nbytes) == tier.used_bytes()
    record = codec.decode(value, expected_key=k(1))
    assert record.header.dtype == "bfloat16" and record.header.shape == (3, 128)
    assert bytes(record.payload) == t.view(torch.uint8).numpy().tobytes()
    assert raw.pttl(name) == -1  # no TTL configured


async def test_ttl_sets_expiry(make: Make, raw: redis.Redis) -> None:
    tier = await make(ttl=30.0)
    await tier.put([(k(1), rand((64,)))])
    assert 25_000 < raw.pttl(tier.redis_key(k(1))) <= 30_000


async def test_garbage_truncated_and_foreign_values_are_deleted_misses(make: Make, raw: redis.Redis) -> None:
    tier = await make()
    good = {i: rand((1000,), seed=i) for i in (0, 2, 4, 6, 8, 14, 16)}
    assert all(await tier.put(list((k(i), t) for i, t in good.items())))
    record = codec.encode_bytes(k(100), rand((70_000,)).numpy(), "float32", (70_000,))
    flipped = bytearray(record)
    flipped[-5] ^= 0x01
    big = bytearray(codec.encode_bytes(k(15), rand((9 << 18,)).numpy(), "float32", (9 << 18,)))  # 9 MiB: 3 pieces
    truncated_big = bytes(big[:-1])
    big[-3] ^= 0x40
    bad = {1: b"not a record", 3: record[:-10], 5: bytes(flipped), 7: record, 9: b"x", 11: b"\x00" * 300_000,
           15: bytes(big), 17: truncated_big}
    for i, value in bad.items():
        raw.set(tier.redis_key(k(i)), value)
    raw.rpush(tier.redis_key(k(13)), b"a list is not a record")
    asked = list(range(18))
    got = await tier.get([k(i) for i in asked])
    for i, g in zip(asked, got, strict=True):
        if i in good:
            assert_same(g, good[i])  # the stream stayed in sync around every bad value
        else:
            assert g is None
    assert tier.stats().corrupt == len(bad) + 1
    assert tier.stats().errors == 0
    assert raw.exists(*[tier.redis_key(k(i)) for i in [*bad, 13]]) == 0  # deleted
    assert raw.exists(*[tier.redis_key(k(i)) for i in good]) == len(good)
    raw.set(tier.redis_key(k(20)), b"")
    empty, after = await tier.get([k(20), k(0)])
    assert empty is None and tier.stats().corrupt == len(bad) + 2
    assert_same(after, good[0])


async def test_large_records_are_split_into_parts(make: Make, raw: redis.Redis) -> None:
    tier = await make()
    items = [(k(i), rand((9 << 18,), seed=i)) for i in range(3)]  # 9 MiB each
    assert await tier.put(items) == [True] * 3
    total = tier.stored_size(9 << 20)
    layout = parts_of(total)
    assert len(layout) == 4 and all(2 << 20 <= n < 4 << 20 for _, n in layout)
    names = [tier.redis_key(key) for key, _ in items]
    for name in names:
        assert raw.strlen(name) == layout[0][1]
        assert [raw.strlen(part_name(name, j)) for j in range(1, 4)] == [n for _, n in layout[1:]]
        assert part_name(name, 1) == b"{" + name + b"}:1"  # same cluster slot as the head
    raw.setrange(part_name(names[0], 2), 1000, b"\xff\xfe")  # damaged part
    raw.delete(part_name(names[1], 3))  # a part evicted on its own
    got = await tier.get([key for key, _ in items])
    assert got[:2] == [None, None] and tier.stats().corrupt == 2
    assert_same(got[2], items[2][1])
    assert raw.exists(*[part_name(n, j) for n in names[:2] for j in range(4)]) == 0  # every part deleted
    whole = codec.encode_bytes(k(7), rand((9 << 18,), seed=7).numpy(), "float32", (9 << 18,))
    raw.set(tier.redis_key(k(7)), whole)  # one value holding a whole large record is read as well
    assert_same((await tier.get([k(7)]))[0], rand((9 << 18,), seed=7))
    other = await make()  # knows nothing of the sizes: probes the header to find every part
    assert await other.delete([items[2][0], k(7), k(99)]) == 2
    assert raw.keys(f"{tier.section.key_prefix}*") == [] and raw.keys(b"{" + names[2] + b"}*") == []


async def test_two_namespaces_on_one_redis_never_see_each_other(make: Make, raw: redis.Redis) -> None:
    tier_a, tier_b = await make(), await make()
    chunk = (7).to_bytes(16, "big")
    ta, tb = rand((256,), seed=1), rand((256,), seed=2)
    await tier_a.put([(NS_A + chunk, ta)])
    assert await tier_b.contains([NS_B + chunk]) == [False]
    assert await tier_b.get([NS_B + chunk]) == [None]
    await tier_b.put([(NS_B + chunk, tb)])
    assert_same((await tier_a.get([NS_A + chunk]))[0], ta)
    assert_same((await tier_b.get([NS_B + chunk]))[0], tb)
    # A's record copied under B's name is refused: the record names its own namespace and key.
    copied = raw.get(tier_a.redis_key(NS_A + chunk))
    assert isinstance(copied, bytes)
    raw.set(tier_b.redis_key(NS_B + chunk), copied)
    assert await tier_b.get([NS_B + chunk]) == [None]
    assert tier_b.stats().corrupt == 1


async def test_hmac_signed_records(make: Make) -> None:
    signer = await make(hmac_key=b"secret-1")
    other = await make(hmac_key=b"secret-2")
    plain = await make()
    t = rand((512,))
    await signer.put([(k(1), t)])
    assert signer.stored_size(t.nbytes) == plain.stored_size(t.nbytes) + codec.MAC_BYTES
    assert_same((await signer.get([k(1)]))[0], t)
    assert_same((await plain.get([k(1)]))[0], t)  # no key configured: the signature is not required
    assert await other.get([k(1)]) == [None]  # wrong key: rejected and deleted
    assert other.stats().corrupt == 1 and await signer.contains([k(1)]) == [False]
    await plain.put([(k(2), t)])
    assert await signer.get([k(2)]) == [None]  # unsigned where signing is required
    assert signer.stats().corrupt == 1


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
async def test_compressed_records(make: Make, raw: redis.Redis, compression: str) -> None:
    tier = await make(compression=compression)
    zeros, noise = torch.zeros(65536, dtype=torch.float16), rand((4096,), seed=3)
    assert await tier.put([(k(1), zeros), (k(2), noise)]) == [True, True]
    assert raw.strlen(tier.redis_key(k(1))) < zeros.nbytes // 10
    got = await tier.get([k(1), k(2)])
    assert_same(got[0], zeros)
    assert_same(got[1], noise)


async def test_large_values_over_several_connections(make: Make) -> None:
    tier = await make(connections=3)
    items = [(k(i), rand((n,), torch.float16, seed=i)) for i, n in enumerate([3 << 20, 1, 777_777, 2 << 20, 12345])]
    assert await tier.put(items) == [True] * len(items)
    batches = await asyncio.gather(*(tier.get([key for key, _ in items]) for _ in range(4)))
    for got in batches:
        for g, (_, t) in zip(got, items, strict=True):
            assert_same(g, t)
    assert len(tier._pools) == 1 and tier.stats().get_hits == 4 * len(items)


async def test_read_buffers_are_recycled_only_when_released(make: Make) -> None:
    tier = await make()
    a, b = rand((100_000,), seed=1), rand((100_000,), seed=2)
    await tier.put([(k(1), a), (k(2), b)])
    [first] = await tier.get([k(1)])
    assert first is not None
    view = first[10:20]
    del first
    gc.collect()
    [second] = await tier.get([k(2)])
    assert tier.buffers.reused == 0  # ``view`` still holds the first buffer
    assert_same(second, b)
    assert torch.equal(view, a[10:20])
    del view, second
    gc.collect()
    [third] = await tier.get([k(1)])
    assert tier.buffers.reused == 1
    assert_same(third, a)


async def test_cluster_batches_per_node(make: Make, redis_cluster: RedisClusterServers) -> None:
    tier = await make(url=redis_cluster.url, connections=2)
    items = [(k(i), rand((2000 + i,), seed=i)) for i in range(39)] + [(k(39), rand((3 << 20,), seed=39))]
    assert await tier.put(items) == [True] * 40  # the 12 MiB record's parts share its head's slot
    assert len(tier._pools) == 3  # the batch went to every master, each over its own connections
    for node in redis_cluster.nodes:
        assert int(node.cli("DBSIZE")) > 0
    got = await tier.get([key for key, _ in items])
    for g, (_, t) in zip(got, items, strict=True):
        assert_same(g, t)
    assert await tier.contains([k(0), k(39), k(99)]) == [True, True, False]
    assert await tier.delete([key for key, _ in items]) == 40 and tier.used_bytes() == 0


async def test_cluster_flag_with_plain_url(make: Make, redis_cluster: RedisClusterServers) -> None:
    node = redis_cluster.nodes[1]
    tier = await make(url=f"redis://127.0.0.1:{node.port}", cluster=True)
    await tier.put([(k(i), rand((100,), seed=i)) for i in range(10)])
    assert await tier.contains([k(i) for i in range(10)]) == [True] * 10


WRITER = textwrap.dedent("""
    import asyncio, sys, torch
    from kvtier.config import RedisTierConfig
    from kvtier.tiers.redis.tier import RedisTier

    async def main(url, prefix):
        tier = RedisTier(RedisTierConfig(name="redis", capacity=1 << 30, url=url, key_prefix=prefix, timeout=5.0))
        await tier.start()
        items = [(b"namespace-A-0000" + i.to_bytes(16, "big"),
                  torch.full((1000 + i,), float(i), dtype=torch.bfloat16)) for i in range(8)]
        assert all(await tier.put(items))
        await tier.close()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")


async def test_two_processes_share_the_tier(make: Make, redis_server: RedisServer) -> None:
    tier = await make()
    assert await tier.contains([k(i) for i in range(8)]) == [False] * 8
    root = Path(__file__).resolve().parents[2]
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", WRITER, redis_server.url,
                                                tier.section.key_prefix, cwd=root, stderr=subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    got = await tier.get([k(i) for i in range(8)])
    for i, g in enumerate(got):
        assert_same(g, torch.full((1000 + i,), float(i), dtype=torch.bfloat16))
    assert tier.used_bytes() == 0  # written by the other process


@pytest.mark.slow
async def test_cluster_slots_moving_under_the_tier(make: Make) -> None:
    """Resharding moves keys to another master: first a miss (MOVED), then the slot map reloads and hits resume."""
    with RedisClusterServers(3) as cluster:
        tier = await make(url=cluster.url)
        items = [(k(i), rand((500,), seed=i)) for i in range(30)]
        assert all(await tier.put(items))
        src, dst = cluster.nodes[0], cluster.nodes[1]
        ids = [n.cli("CLUSTER", "MYID").strip() for n in (src, dst)]
        subprocess.run(["redis-cli", "--cluster", "reshard", f"127.0.0.1:{src.port}", "--cluster-from", ids[0],
                        "--cluster-to", ids[1], "--cluster-slots", "16384", "--cluster-yes"],
                       capture_output=True, timeout=120, check=True)
        assert int(src.cli("DBSIZE")) == 0
        first = await tier.get([key for key, _ in items])
        assert any(g is None for g in first)  # asked the old owner: MOVED replies are misses
        assert tier.stats().extra["slot_refreshes"] >= 1
        again = await tier.get([key for key, _ in items])
        for g, (_, t) in zip(again, items, strict=True):
            assert_same(g, t)
        assert await tier.put(items) == [True] * len(items)


@pytest.mark.slow
async def test_cluster_node_down_only_loses_its_own_records(make: Make) -> None:
    with RedisClusterServers(3) as cluster:
        tier = await make(url=cluster.url, timeout=0.5, connect_timeout=0.5)
        items = [(k(i), rand((300,), seed=i)) for i in range(30)]
        assert all(await tier.put(items))
        dead = cluster.nodes[2]
        on_dead = {i for i in range(30) if tier._client.get_node_from_key(tier.redis_key(k(i))).port == dead.port}
        assert 0 < len(on_dead) < 30
        dead.kill()
        got = await tier.get([key for key, _ in items])
        for i, (g, (_, t)) in enumerate(zip(got, items, strict=True)):
            if i in on_dead:
                assert g is None
            else:
                assert_same(g, t)
        assert tier.stats().errors + tier.stats().timeouts >= 1


async def test_a_small_reader_reads_records_bigger_than_its_own_capacity(make: Make) -> None:
    writer, reader = await make(), await make(capacity=1 << 20)
    t = rand((1 << 20,))  # 4 MiB
    await writer.put([(k(1), t)])
    assert_same((await reader.get([k(1)]))[0], t)  # used bytes count what a process writes, not what it reads
    assert reader.stats().corrupt == 0 and reader.used_bytes() == 0


async def test_writing_more_than_capacity_keeps_caching(make: Make) -> None:
    # Redis memory is the server's (maxmemory + allkeys-lru): the bytes this process wrote are a report, not a limit
    tier = await make(capacity=64 * 1024)
    items = [(k(i), rand((8192,), seed=i)) for i in range(10)]  # 32 KiB each, 320 KiB in all
    for item in items:
        assert await tier.put([item]) == [True]
    assert tier.used_bytes() == sum(tier.stored_size(t.nbytes) for _, t in items) > tier.capacity_bytes
    assert tier.stats().puts_refused == 0
    for (_, want), got in zip(items, await tier.get([key for key, _ in items]), strict=True):
        assert_same(got, want)
    assert await tier.put([(k(99), rand((20000,)))]) == [False]  # one record above capacity: still refused
    assert tier.stats().puts_refused == 1


async def test_a_batch_of_equal_records_lands_evenly_spaced_in_one_buffer(
        make: Make, redis_cluster: RedisClusterServers) -> None:
    """The payloads of a get of records of one size (a group's chunks) go straight into evenly spaced slots of one
    buffer, whichever cluster node each comes from, so that the copy into the engine's blocks takes a few index
    operations (kvtier.kvcopy.paged); a record of another size in the batch gets a buffer of its own."""
    tier = await make(url=redis_cluster.url)
    shape = (4, 2, 3000)  # 96,000 bytes: slots round up to 98,304
    items = [(k(i), rand(shape, seed=i)) for i in range(12)] + [(k(12), rand((10,), seed=12))]
    assert await tier.put(items) == [True] * 13
    got = await tier.get([key for key, _ in items])
    for g, (_, t) in zip(got, items, strict=True):
        assert_same(g, t)
    equal = [g for g in got[:12] if g is not None]
    assert len({g.untyped_storage().data_ptr() for g in equal}) == 1
    assert {b.data_ptr() - a.data_ptr() for a, b in itertools.pairwise(equal)} == {codec.slot_aligned(96_000)}
    assert got[12] is not None and got[12].untyped_storage().data_ptr() != equal[0].untyped_storage().data_ptr()
