"""TieredStore over real cpu and disk tiers: lookup, get with promotion, write-back and write-through."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import CpuTierConfig, KvtierConfig, load_config
from kvtier.control.directory import Directory, TierSlot
from kvtier.control.policy import make_policy
from kvtier.records.keys import Key, Namespace, chunk_keys
from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Tier
from kvtier.tiers.memory.cpu import CpuTier

CHUNK = 16
SHAPE = (2, 2, CHUNK, 2, 8)  # layers, K/V, tokens, heads, head size
NBYTES = 2 * 2 * CHUNK * 2 * 8 * 4


def make_cfg(tmp_path: Path, cpu_chunks: int, disk_chunks: int, write: str = "write_back",
             eviction: str = "lru", promote: bool = True) -> KvtierConfig:
    return load_config({
        "chunk_size": CHUNK,
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": cpu_chunks * NBYTES, "slot_bytes": NBYTES},
            {"name": "disk", "kind": "disk", "capacity": disk_chunks * (NBYTES + 4096), "path": str(tmp_path)},
        ],
        "policy": {"eviction": eviction, "write": write, "promote_on_hit": promote},
    }, env={})


def chunks(n: int, seed: int = 0) -> list[tuple[bytes, torch.Tensor]]:
    keys = chunk_keys(Namespace("test").digest(), list(range(seed, seed + n * CHUNK)), CHUNK)
    gen = torch.Generator().manual_seed(seed)
    return [(k, torch.randn(SHAPE, generator=gen)) for k in keys]


def lru_directory(*tiers: Tier) -> Directory:
    return Directory([TierSlot(t.name, t.capacity_bytes, make_policy("lru"), t.is_shared) for t in tiers])


async def started(cfg: KvtierConfig) -> TieredStore:
    store = TieredStore.from_config(cfg)
    await store.start()
    return store


async def test_put_get_round_trip(tmp_path: Path) -> None:
    store = await started(make_cfg(tmp_path, 8, 8))
    items = chunks(4)
    assert await store.put(items) == 4
    result = await store.lookup([k for k, _ in items])
    assert result.hits == 4 and result.tiers == ("cpu",) * 4
    got = await store.get([k for k, _ in items])
    for (_, want), have in zip(items, got, strict=True):
        assert have is not None and torch.equal(want, have)
    await store.close()


async def test_lookup_is_longest_prefix(tmp_path: Path) -> None:
    store = await started(make_cfg(tmp_path, 8, 8))
    items = chunks(4)
    await store.put([items[0], items[1], items[3]])
    result = await store.lookup([k for k, _ in items])
    assert result.hits == 2
    got = await store.get([k for k, _ in items])
    assert got[2] is None and got[3] is None
    await store.close()


async def test_write_back_demotes_to_disk_and_promotes_on_hit(tmp_path: Path) -> None:
    store = await started(make_cfg(tmp_path, 2, 8))
    items = chunks(4)
    await store.put(items[:2])
    await store.put(items[2:])
    keys = [k for k, _ in items]
    assert store.lookup_local(keys).tiers == ("disk", "disk", "cpu", "cpu")
    assert store.tier("cpu").used_bytes() <= store.tier("cpu").capacity_bytes
    assert len(list(tmp_path.rglob("*.kvt"))) == 2
    got = await store.get(keys[:1])
    assert got[0] is not None and torch.equal(got[0], items[0][1])
    assert store.lookup_local(keys[:1]).tiers == ("cpu",)  # promoted
    assert store.tier("disk").stats().get_hits >= 1
    await store.close()


async def test_write_through_stores_every_tier(tmp_path: Path) -> None:
    store = await started(make_cfg(tmp_path, 8, 8, write="write_through"))
    items = chunks(3)
    await store.put(items)
    keys = [k for k, _ in items]
    assert all(store.directory.contains("disk", k) and store.directory.contains("cpu", k) for k in keys)
    assert len(list(tmp_path.rglob("*.kvt"))) == 3
    await store.close()


async def test_disk_records_survive_a_restart(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, 8, 8, write="write_through")
    store = await started(cfg)
    items = chunks(3, seed=7)
    await store.put(items)
    await store.close()
    again = await started(cfg)
    keys = [k for k, _ in items]
    assert again.lookup_local(keys).tiers == ("disk",) * 3
    got = await again.get(keys)
    assert all(g is not None and torch.equal(g, w) for g, (_, w) in zip(got, items, strict=True))
    await again.close()


async def test_corrupt_disk_record_is_a_miss_and_forgotten(tmp_path: Path) -> None:
    store = await started(make_cfg(tmp_path, 1, 8))
    items = chunks(2)
    await store.put(items[:1])
    await store.put(items[1:])  # the first chunk is demoted to disk
    keys = [k for k, _ in items]
    assert store.lookup_local(keys).tiers[0] == "disk"
    path = next(tmp_path.rglob("*.kvt"))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    got = await store.get(keys)
    assert got[0] is None
    assert not store.directory.contains("disk", keys[0])
    assert store.tier("disk").stats().corrupt == 1
    assert not path.exists()
    await store.close()


@pytest.mark.parametrize("eviction", ["lru", "prefix_lru"])
async def test_capacity_never_exceeded_under_churn(tmp_path: Path, eviction: str) -> None:
    store = await started(make_cfg(tmp_path, 3, 5, eviction=eviction))
    for seed in range(12):
        await store.put(chunks(2, seed=seed * 100))
        for name in store.tier_names:
            tier = store.tier(name)
            assert tier.used_bytes() <= tier.capacity_bytes
            assert store.directory.used_bytes(name) <= tier.capacity_bytes
    disk_files = sum(os.path.getsize(p) for p in tmp_path.rglob("*.kvt"))
    assert disk_files <= store.tier("disk").capacity_bytes
    await store.close()


@pytest.mark.parametrize("tier", ["cpu", "disk"])
async def test_read_into_and_borrow_equal_read(tmp_path: Path, tier: str) -> None:
    store = await started(make_cfg(tmp_path, 8, 8))
    items = chunks(3)
    assert await store.write(tier, items) == [True] * 3
    keys = [k for k, _ in items] + [b"\x01" * 32]
    read = await store.read(tier, keys)
    outs = [torch.zeros(SHAPE) for _ in keys]
    assert await store.read_into(tier, list(zip(keys, outs, strict=True))) == [True, True, True, False]
    borrowed = store.borrow(tier, keys)
    if tier == "disk":  # only a memory tier lends: a reader reads the others
        assert borrowed is None
        await store.close()
        return
    assert borrowed is not None and borrowed[3] is None and read[3] is None
    for (_, want), r, out, b in zip(items, read[:3], outs[:3], borrowed[:3], strict=True):
        assert r is not None and b is not None and torch.equal(r, want) and torch.equal(out, want)
        assert torch.equal(b, want) and b.dtype == want.dtype and b.shape == want.shape
    # a borrowed record stays intact while its key is deleted and its space written again
    assert await store.delete(tier, keys[:1]) == 1
    assert await store.write(tier, chunks(3, seed=100)) == [True] * 3
    assert borrowed[0] is not None and torch.equal(borrowed[0], items[0][1])
    store.release(tier, keys)
    assert store.tier("cpu").pool.pinned() == 0  # type: ignore[attr-defined]
    await store.close()


class BrokenPutTier(CpuTier):
    """Test double of a failing medium: every put raises."""

    async def put(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
        raise OSError("medium failed")


async def test_failing_plan_completes_and_later_plans_run() -> None:
    cpu = CpuTier(CpuTierConfig(name="cpu", capacity=2 * NBYTES, slot_bytes=NBYTES))
    broken = BrokenPutTier(CpuTierConfig(name="broken", capacity=8 * NBYTES, slot_bytes=NBYTES))
    store = TieredStore([cpu, broken], lru_directory(cpu, broken))
    await store.start()
    first, second = chunks(2), chunks(2, seed=100)
    assert await store.put(first) == 2
    # cpu is full: the plans demote ``first`` to the broken tier (raises), then store ``second`` in cpu
    assert await store.put(second) == 2
    assert store.directory.used_bytes("broken") == 0
    assert store.directory.used_bytes("cpu") == cpu.used_bytes() == 2 * NBYTES
    keys = [k for k, _ in second]
    assert store.lookup_local(keys).tiers == ("cpu", "cpu")
    assert store.lookup_local([k for k, _ in first]).hits == 0
    # a direct plan into the broken tier raises inside execute: completed as failed, the next plan still runs
    third = chunks(1, seed=200)
    plans = [*store.directory.prepare_store("broken", [(third[0][0], NBYTES, None)]),
             *store.directory.prepare_store("cpu", [(third[0][0], NBYTES, None)])]
    assert [p.tier for p in plans] == ["broken", "cpu"]
    failed: list[tuple[str, bytes]] = []
    assert await store.execute(plans, dict(third), failed) == {"cpu": 1}
    assert failed == [("broken", third[0][0])]  # what the worker reports to the scheduler
    assert store.directory.used_bytes("broken") == 0 and not store.directory.contains("broken", third[0][0])
    got = await store.get([third[0][0]])
    assert got[0] is not None and torch.equal(got[0], third[0][1])
    await store.close()


async def test_a_skipped_save_runs_its_evictions_and_completes_as_not_stored() -> None:
    """``execute(skip_writes=True)``: what the worker runs for saves past its backlog."""
    cpu = CpuTier(CpuTierConfig(name="cpu", capacity=2 * NBYTES, slot_bytes=NBYTES))
    store = TieredStore([cpu], lru_directory(cpu))
    await store.start()
    old, new = chunks(1), chunks(1, seed=300)
    assert await store.put(old) == 1
    store.directory.remove("cpu", [old[0][0]])  # the directory chose it as a victim: its room counts as free
    plans = store.directory.prepare_store("cpu", [(new[0][0], NBYTES, None)])
    plans = [type(p)(p.tier, p.store, (old[0][0],), p.source) for p in plans]
    failed: list[tuple[str, bytes]] = []
    assert await store.execute(plans, dict(new), failed, skip_writes=True) == {"cpu": 0}
    assert failed == [("cpu", new[0][0])]
    assert cpu.used_bytes() == 0  # the eviction ran; nothing was written
    assert not store.directory.contains("cpu", new[0][0])  # completed as not stored, not left pending
    assert (await store.get([new[0][0]])) == [None]
    await store.close()


# ---- what the old shape got wrong: a put overflow was lost silently, lookups and evictions counted twice ----
async def test_a_put_larger_than_the_first_tier_goes_down_the_chain(tmp_path: Path) -> None:
    """Write-back: the chunks the first tier cannot take go to the next tier (they used to be dropped, uncounted)."""
    store = await started(make_cfg(tmp_path, 2, 8))
    items = chunks(5)
    keys = [k for k, _ in items]
    assert await store.put(items) == 2  # the first tier of the chain stored two
    assert store.lookup_local(keys).tiers == ("cpu", "cpu", "disk", "disk", "disk")
    got = await store.get(keys)
    assert all(g is not None and torch.equal(g, v) for g, (_, v) in zip(got, items, strict=True))
    assert store.directory.stats.unplaced == 0
    await store.close()


async def test_chunks_no_tier_can_take_are_counted_unplaced(tmp_path: Path) -> None:
    cfg = load_config({"chunk_size": CHUNK, "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity": 2 * NBYTES, "slot_bytes": NBYTES}]}, env={})
    store = await started(cfg)
    items = chunks(5)
    assert await store.put(items) == 2
    assert store.directory.stats.unplaced == 3
    assert store.lookup_local([k for k, _ in items]).hits == 2
    await store.close()


async def test_each_lookup_and_eviction_is_counted_once(tmp_path: Path, redis_server: Any) -> None:
    """A Redis lookup is counted by the Redis tier alone; a local one by the directory; an eviction the directory
    chose is counted by the directory as an eviction and by the tier as a delete (not as an eviction too)."""
    cfg = load_config({"chunk_size": CHUNK, "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity": 2 * NBYTES, "slot_bytes": NBYTES},
        {"name": "redis", "kind": "redis", "capacity": "64MiB", "url": redis_server.url,
         "key_prefix": f"once{os.getpid()}"}],
        "policy": {"write": "write_through"}}, env={})
    store = await started(cfg)
    items = chunks(3, seed=7)
    keys = [k for k, _ in items]
    await store.put(items[:2])
    await store.put(items[2:])  # cpu holds 2 chunks: the first is evicted for the third
    cpu, redis = store.tier("cpu").stats(), store.tier("redis").stats()
    assert (store.directory.stats.evictions, cpu.evictions, cpu.deletes) == (1, 0, 1)
    directory = store.directory.stats
    before = (redis.lookups, redis.hits, directory.lookups, directory.hits)
    result = await store.lookup(keys)
    local = result.tiers.count("cpu")  # the prefix cpu holds; the rest is asked from Redis
    assert result.hits == 3 and 1 <= local < 3 and result.tiers[local:] == ("redis",) * (3 - local)
    assert (redis.lookups - before[0], redis.hits - before[1]) == (3 - local, 3 - local)
    assert (directory.lookups - before[2], directory.hits - before[3]) == (3, local)
    await store.close()
