"""Persisting write-back chunks in one process (kvtier.control.persist, ``TieredStore.close`` / ``persist``) and the config
keys: what only the cpu tier holds is on disk after ``close`` and a new store finds it; the budget bounds the time
(oldest first, heads before tails); a persisted chunk lives in both tiers, counted once in each, and its later
eviction from cpu writes nothing again."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from kvtier.config import KvtierConfig, load_config
from kvtier.control.persist import copy_target
from kvtier.errors import ConfigError
from kvtier.records.keys import Namespace, chunk_keys
from kvtier.store.tiered import TieredStore, persist_memory

CHUNK = 16
SHAPE = (2, 2, CHUNK, 2, 8)
NBYTES = 2 * 2 * CHUNK * 2 * 8 * 4


def make_cfg(tmp_path: Path, cpu_chunks: int = 200, **policy: object) -> KvtierConfig:
    return load_config({
        "chunk_size": CHUNK,
        "tiers": [{"name": "cpu", "kind": "cpu", "capacity": cpu_chunks * NBYTES, "slot_bytes": NBYTES},
                  {"name": "disk", "kind": "disk", "capacity": 400 * (NBYTES + 4096), "path": str(tmp_path)}],
        "policy": {"eviction": "lru", "write": "write_back", **policy},
    }, env={})


def chunks(n: int, seed: int = 0) -> list[tuple[bytes, torch.Tensor]]:
    keys = chunk_keys(Namespace("test").digest(), list(range(seed, seed + n * CHUNK)), CHUNK)
    gen = torch.Generator().manual_seed(seed)
    return [(k, torch.randn(SHAPE, generator=gen)) for k in keys]


async def started(cfg: KvtierConfig) -> TieredStore:
    store = TieredStore.from_config(cfg)
    await store.start()
    return store


async def test_close_leaves_on_disk_what_only_the_cpu_tier_held(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    store = await started(cfg)
    items = chunks(6, seed=3)
    await store.put(items)
    keys = [k for k, _ in items]
    assert store.lookup_local(keys).tiers == ("cpu",) * 6 and store.tier("disk").used_bytes() == 0
    await store.close()
    again = await started(cfg)
    assert again.lookup_local(keys).tiers == ("disk",) * 6  # adopted at start
    got = await again.get(keys)
    assert all(g is not None and torch.equal(g, w) for g, (_, w) in zip(got, items, strict=True))
    await again.close()


async def test_without_a_budget_close_persists_nothing(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, persist_at_close=0)
    store = await started(cfg)
    await store.put(chunks(3))
    await store.close()
    again = await started(cfg)
    assert again.lookup_local([k for k, _ in chunks(3)]).hits == 0
    await again.close()


async def test_the_budget_bounds_the_copies_oldest_first(tmp_path: Path) -> None:
    """A clock that advances 1 s per look, a 1.5 s budget: one round of 64 chunks, the first 64 stored (a prefix's
    head before its tail), then a warning; the other 36 stay in cpu only."""
    store = await started(make_cfg(tmp_path))
    items = chunks(100, seed=5)
    await store.put(items)
    ticks = itertools.count()
    assert await persist_memory(store, 1.5, clock=lambda: float(next(ticks))) == 64
    on_disk = [store.directory.contains("disk", k) for k, _ in items]
    assert on_disk == [True] * 64 + [False] * 36
    store.persist_at_close = 0
    await store.close()


async def test_a_persisted_chunk_is_counted_once_per_tier_and_never_written_twice(tmp_path: Path) -> None:
    store = await started(make_cfg(tmp_path, cpu_chunks=4))
    first = chunks(4, seed=1)
    await store.put(first)
    assert await store.persist(10.0) == 4
    disk = store.tier("disk")
    assert disk.stats().puts == 4 and store.directory.used_bytes("disk") == 4 * disk.stored_size(NBYTES)
    assert await store.persist(10.0) == 0  # already there: nothing planned again
    await store.put(chunks(4, seed=9))  # evicts the first four from cpu: their demotion finds them on disk
    assert disk.stats().puts == 4 and store.directory.used_bytes("disk") == 4 * disk.stored_size(NBYTES)
    assert store.lookup_local([k for k, _ in first]).tiers == ("disk",) * 4
    store.persist_at_close = 0
    await store.close()


def test_copy_target_is_the_first_persistent_tier_below() -> None:
    persistent = {"disk", "disk2"}.__contains__
    assert copy_target(["gpu", "cpu", "disk", "redis"], "gpu", persistent) == ("disk", ["redis"])
    assert copy_target(["cpu", "redis"], "cpu", persistent) is None
    assert copy_target(["cpu", "disk", "disk2"], "cpu", persistent) == ("disk", ["disk2"])
    assert copy_target(["disk"], "cpu", persistent) is None


def test_persist_keys_are_durations_validated_with_their_path(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, persist_after_idle="250ms", persist_at_close="10s")
    assert (cfg.policy.persist_after_idle, cfg.policy.persist_at_close) == (0.25, 10.0)
    assert make_cfg(tmp_path, persist_after_idle=0).policy.persist_after_idle == 0  # never while running
    assert load_config(cfg.to_dict(), env={}) == cfg
    defaults = make_cfg(tmp_path).policy
    assert (defaults.persist_after_idle, defaults.persist_at_close) == (1.0, 4.0)
    for key, value in (("persist_after_idle", -1), ("persist_after_idle", "soon"), ("persist_at_close", None)):
        with pytest.raises(ConfigError, match=f"policy.{key}"):
            make_cfg(tmp_path, **{key: value})
