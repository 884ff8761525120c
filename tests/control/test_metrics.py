"""kvtier.control.metrics: the snapshot's contents and key names, and every event counted exactly once by its owner (the
worker half's loads and saves, a tier's own operations, the directory's lookups, evictions and demotions)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from kvtier.config import CpuTierConfig, load_config
from kvtier.connector.plans import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.connector.worker.half import WorkerHalf
from kvtier.control.directory import StorePlan
from kvtier.control.metrics import (
    DirectoryStats,
    DiskStats,
    RedisStats,
    TierStats,
    Timer,
    WorkerCounters,
    WorkerCounts,
    nonzero,
    snapshot,
)
from kvtier.layout import simple_config
from kvtier.records.keys import Key, Namespace, chunk_keys
from kvtier.store.assembly import Role
from kvtier.store.tiered import TieredStore
from kvtier.tiers.memory.cpu import CpuTier
from kvtier.tiers.runtime import LoopThread

WORKER_KEYS = {
    "load_chunks", "load_bytes", "load_failures", "load_scatter_failures", "load_seconds", "load_calls",
    "save_chunks", "save_bytes", "save_seconds", "save_calls", "save_gather_seconds", "save_gather_calls",
    "save_failures", "save_timeouts", "save_skipped_busy", "save_chunks_not_stored", "kvtier_disabled",
}
C, BS, NB = 8, 4, 16
KCC = simple_config(2, 2, 4, dtype="bfloat16", block_size=BS, num_blocks=NB)
KEYS = tuple(Key(bytes([i]) * 32) for i in range(1, 4))
BLOCKS = ((1, 2), (3, 4), (5, 6))
LOADED = ((9, 10), (11, 12), (13, 14))


def test_the_worker_snapshot_keeps_the_names_engines_and_benchmarks_read() -> None:
    assert set(snapshot(WorkerCounts())) == WORKER_KEYS  # every fixed key, zeros included
    counters = WorkerCounters()
    counters.loaded(1, {"cpu": 2, "disk": 1}, 300)
    counters.load_failed(2, scatter=True)
    counters.saved(4, 400, 0.5)
    counters.disabled()
    numbers = snapshot(counters.take())
    assert set(numbers) == WORKER_KEYS | {"hits_cpu", "hits_disk", "load_chunks_group1", "loaded:cpu:1",
                                          "loaded:disk:1"}
    assert nonzero(numbers) == {"load_chunks": 3, "load_bytes": 300, "hits_cpu": 2, "hits_disk": 1,
                                "load_chunks_group1": 3, "loaded:cpu:1": 2, "loaded:disk:1": 1,
                                "load_failures": 2, "load_scatter_failures": 2,
                                "save_chunks": 4, "save_bytes": 400, "save_seconds": 0.5, "save_calls": 1,
                                "kvtier_disabled": 1}
    assert all(isinstance(v, int | float) for v in numbers.values())


def test_take_hands_out_deltas_and_totals_keep_counting() -> None:
    counters = WorkerCounters()
    counters.save_skipped(2)
    assert snapshot(counters.take())["save_skipped_busy"] == 2
    assert nonzero(snapshot(counters.take())) == {}
    counters.save_skipped(1)
    counters.not_stored(3)
    counters.save_timed_out()
    counters.save_failed(5)
    counters.gathered(0.25)
    counters.load_timed(0.125)
    totals = snapshot(counters.totals())
    assert (totals["save_skipped_busy"], totals["save_chunks_not_stored"], totals["save_timeouts"]) == (3, 3, 1)
    assert (totals["save_failures"], totals["save_gather_seconds"], totals["save_gather_calls"]) == (5, 0.25, 1)
    assert (totals["load_seconds"], totals["load_calls"]) == (0.125, 1)
    assert counters.totals() is not counters.totals()  # a copy: the caller cannot change the counters


def test_counting_from_many_threads_loses_nothing() -> None:
    counters = WorkerCounters()

    def count() -> None:
        for _ in range(1000):
            counters.loaded(0, {"cpu": 1}, 10)
            counters.saved(1, 10, 0.0)

    threads = [threading.Thread(target=count) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    totals = snapshot(counters.totals())
    assert (totals["load_chunks"], totals["hits_cpu"], totals["load_chunks_group0"]) == (4000, 4000, 4000)
    assert (totals["save_chunks"], totals["save_bytes"], totals["save_calls"]) == (4000, 40000, 4000)


def test_tier_and_directory_keys() -> None:
    disk, redis = DiskStats(reads_cached=3), RedisStats(breaker_opens=1)
    assert disk.extra == {"temp_removed": 0, "reads_cached": 3, "reads_waited": 0}
    assert set(redis.extra) == {"server_errors", "slot_refreshes", "breaker_state", "breaker_opens",
                                "breaker_rejected"}
    assert TierStats().extra == {}
    directory = DirectoryStats(lookups=5, hits=2, evictions=1, evictions_by_tier={"cpu": 1})
    numbers = snapshot(tiers={"disk": disk, "redis": redis}, directory=directory)
    assert numbers["tier_disk_reads_cached"] == 3 and numbers["tier_redis_breaker_opens"] == 1
    assert {f"tier_disk_{k}" for k in TierStats().as_dict()} <= set(numbers)
    assert {k: v for k, v in numbers.items() if k.startswith("directory_")} == {
        "directory_lookups": 5, "directory_hits": 2, "directory_evictions": 1, "directory_demotions": 0,
        "directory_refused": 0, "directory_unplaced": 0, "directory_admitted": 0, "directory_declined": 0,
        "directory_evictions_cpu": 1}


def test_a_timer_counts_time_and_calls() -> None:
    stats = TierStats()
    with Timer(stats, "get_seconds"):
        pass
    with Timer(stats, "put_seconds"):
        pass
    with Timer(stats, "put_seconds"):
        pass
    assert (stats.get_calls, stats.put_calls) == (1, 2) and stats.get_seconds >= 0 and stats.put_seconds >= 0


async def test_a_store_counts_each_demotion_eviction_and_lookup_once(tmp_path: Path) -> None:
    """Write-back through cpu (room for two chunks) into disk: the directory counts the eviction it chose and the
    demotion, the cpu tier a delete (never an eviction), the disk tier the demoted put; a local lookup is counted
    by the directory alone."""
    chunk, shape = 16, (2, 2, 16, 2, 8)
    nbytes = 2 * 2 * 16 * 2 * 8 * 4
    cfg = load_config({"chunk_size": chunk, "policy": {"write": "write_back", "promote_on_hit": False}, "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity": 2 * nbytes, "slot_bytes": nbytes},
        {"name": "disk", "kind": "disk", "capacity": 8 * (nbytes + 4096), "path": str(tmp_path)}]}, env={})
    store = TieredStore.from_config(cfg)
    await store.start()
    try:
        keys = chunk_keys(Namespace("metrics").digest(), list(range(3 * chunk)), chunk)
        gen = torch.Generator().manual_seed(0)
        items = [(k, torch.randn(shape, generator=gen)) for k in keys]
        await store.put(items[:2])
        await store.put(items[2:])  # cpu is full: its oldest chunk is demoted to disk
        numbers = store.stats()
        assert (numbers["directory_evictions"], numbers["directory_demotions"]) == (1, 1)
        assert numbers["directory_evictions_cpu"] == 1
        assert (numbers["tier_cpu_puts"], numbers["tier_cpu_deletes"], numbers["tier_cpu_evictions"]) == (3, 1, 0)
        assert (numbers["tier_disk_puts"], numbers["tier_disk_evictions"]) == (1, 0)
        assert numbers["tier_cpu_gets"] == 1  # the demotion read the victim once
        result = await store.lookup(keys)
        after = store.stats()
        assert result.hits == 3 and result.tiers.count("disk") == 1
        assert (after["directory_lookups"], after["directory_hits"]) == (3, 3)
        assert after["tier_cpu_lookups"] == after["tier_disk_lookups"] == 0  # local tiers are not asked
    finally:
        await store.close()


def paged(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn((2, NB, BS, 2, 4), generator=g).to(torch.bfloat16)
            for n in KCC.kv_cache_groups[0].layer_names}


def test_the_worker_half_counts_each_load_and_save_once() -> None:
    """Saves counted by the worker half once each (and by the cpu tier as its own puts), loads once each, per
    step: a second ``stats()`` has nothing to say; ``totals()`` keeps everything."""
    tier = CpuTier(CpuTierConfig("cpu", 1 << 20))
    loop = LoopThread()
    store = TieredStore([tier], None, role=Role.WORKER)
    loop.run(store.start())
    worker = WorkerHalf(KCC, store, loop, chunk_size=C)
    worker.register_kv_caches(paged(1))
    try:
        save = SaveSpec("s", 0, KEYS, BLOCKS, (StorePlan("cpu", KEYS),))
        worker.start_load_kv(KVTierMetadata(saves=[save]))
        worker.wait_for_save()
        worker.flush()
        saved = worker.stats()
        assert saved is not None
        assert {k: saved.data.get(k) for k in ("save_chunks", "save_calls", "save_gather_calls", "load_chunks")} \
            == {"save_chunks": 3, "save_calls": 1, "save_gather_calls": 1, "load_chunks": None}
        assert saved.data["save_bytes"] == 3 * worker._chunk_bytes(0)
        assert (tier.stats().puts, tier.stats().bytes_in) == (3, saved.data["save_bytes"])
        assert worker.stats() is None
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", 0, "cpu", KEYS[:2], LOADED[:2])]))
        assert worker.get_block_ids_with_load_errors() == set()
        loaded = worker.stats()
        assert loaded is not None
        worker_keys = {k for k in loaded.data if not k.startswith(("tier_", "gauge:", "samples:", "loaded"))}
        assert worker_keys == {"load_chunks", "load_bytes", "hits_cpu", "load_chunks_group0", "load_seconds",
                               "load_calls"}
        # this step's tier reads and hits by tier and group, for kvtier.integrations.prometheus; no level changed
        assert (loaded.data["tier_cpu_get_hits"], loaded.data["loaded:cpu:0"]) == (2, 2)
        assert loaded.data["loaded_tokens:cpu:0"] == 2 * worker._counters.chunk_size
        assert len(loaded.data["samples:load_seconds"]) == 1 and not any(k.startswith("gauge:") for k in loaded.data)
        assert (loaded.data["load_chunks"], loaded.data["hits_cpu"], loaded.data["load_calls"]) == (2, 2, 1)
        assert tier.stats().get_hits == 2  # the tier counts its own reads (borrowed views), once
        totals = worker.totals()
        assert (totals["save_chunks"], totals["load_chunks"], totals["load_failures"]) == (3, 2, 0)
        assert set(totals) >= WORKER_KEYS
    finally:
        worker.close()
        loop.run(store.close())
        loop.close()


def test_hit_tokens_and_latency_samples_are_kept_per_step_and_bounded() -> None:
    from kvtier.control.metrics import SAMPLES_PER_SPAN, hit_tokens

    counters = WorkerCounters(chunk_size=32)
    counters.loaded(0, {"cpu": 3}, 300)
    for _ in range(SAMPLES_PER_SPAN + 5):
        counters.load_timed(0.001)
    counters.saved(1, 10, 0.25)
    step = counters.take()
    assert hit_tokens(step, counters.chunk_size) == {"loaded_tokens:cpu:0": 96}
    assert len(step.load_samples) == SAMPLES_PER_SPAN and step.save_samples == [0.25]
    assert counters.take().load_samples == [] and counters.totals().load_samples == []  # totals keep no samples


def test_deltas_report_counts_as_differences_and_levels_when_they_change() -> None:
    from kvtier.control.metrics import Deltas

    deltas = Deltas()
    first = {"tier_cpu_puts": 2, "gauge:used_bytes:cpu:0": 100, "tier_redis_breaker_state": 0}
    assert deltas.take(first) == {"tier_cpu_puts": 2, "gauge:used_bytes:cpu:0": 100, "tier_redis_breaker_state": 0}
    assert deltas.take(first) == {}
    assert deltas.take({**first, "tier_cpu_puts": 5, "tier_redis_breaker_state": 2}) == {
        "tier_cpu_puts": 3, "tier_redis_breaker_state": 2}
