"""The scheduler's persisting plans (kvtier.connector.scheduler.persist_plans): which saves get a copy planned, into which
tier, and how the workers' reports settle them with tensor parallelism."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig, PolicyConfig, RedisTierConfig, WritePolicy
from kvtier.connector.plans import KVTierMetadata, PersistingMetadata, SaveSpec
from kvtier.connector.report import WorkerReport
from kvtier.connector.scheduler.persist_plans import PersistPlanner, planner_for
from kvtier.control.directory import Directory, StorePlan
from kvtier.layout import simple_config
from kvtier.store.assembly import build_tiers, directory_for

KCC = simple_config(2, 2, 4, dtype="float32", block_size=4)
KEYS = tuple(bytes([i]) * 32 for i in range(1, 4))


def setup(tmp: Path, **policy: Any) -> tuple[KvtierConfig, PersistPlanner | None, Directory]:
    cfg = KvtierConfig(chunk_size=8, tiers=(CpuTierConfig("cpu", 1 << 20), DiskTierConfig("disk", 1 << 22, path=str(tmp)),
                                            RedisTierConfig("redis", 1 << 22)),
                       policy=PolicyConfig(eviction="lru", **policy))
    tiers = build_tiers(cfg)
    directory = directory_for(cfg, tiers)
    planner = planner_for(cfg, KCC, directory, {t.name: t for t in tiers}, tp_size=2)
    return cfg, planner, directory


def saved(directory: Directory) -> KVTierMetadata:
    """A step whose save writes KEYS into cpu (as the scheduler half plans it)."""
    plans = directory.prepare_store("cpu", [(k, 4096, None) for k in KEYS])
    return KVTierMetadata(saves=[SaveSpec("r", 0, KEYS, ((1, 2),) * 3, tuple(plans))])


def test_saves_into_cpu_get_a_copy_into_disk_settled_once_every_rank_reported(tmp_path: Path) -> None:
    _, planner, directory = setup(tmp_path)
    assert planner is not None
    meta = planner.attach(saved(directory))
    assert isinstance(meta, PersistingMetadata) and meta.saves and not meta.is_empty()
    assert meta.persists == [StorePlan("disk", KEYS, (), "cpu")]  # a copy from cpu, into the next local tier
    assert planner.attach(saved(directory)).saves  # planned once: the disk holds them now (PENDING)
    assert all(directory.holds("disk", k) and not directory.contains("disk", k) for k in KEYS)
    a, b, c = KEYS
    planner.note(WorkerReport(persisted=[("disk", a, "0", True), ("disk", b, "0", False), ("disk", c, "0", False)]))
    assert not any(directory.contains("disk", k) for k in KEYS)  # rank 1 not heard of yet
    planner.note(WorkerReport(persisted=[("disk", a, "1", True), ("disk", b, "1", True), ("disk", c, "1", False)]))
    assert [directory.contains("disk", k) for k in KEYS] == [True, True, False]
    assert not directory.holds("disk", c)  # no rank wrote it: forgotten (b: rank 1 did, READY)


def test_no_planner_without_write_back_or_with_every_bound_off(tmp_path: Path) -> None:
    assert setup(tmp_path, write=WritePolicy.WRITE_THROUGH)[1] is None
    assert setup(tmp_path, persist_after_idle=0.0, persist_max_lag=0.0, persist_at_close=0.0)[1] is None
    assert setup(tmp_path, persist_after_idle=0.0, persist_max_lag=0.0)[1] is not None  # at close only
    assert setup(tmp_path, persist_after_idle=0.0, persist_at_close=0.0)[1] is not None  # under load only


def test_evicting_a_chunk_whose_copy_waits_moves_it_first_and_its_save_settles_it(tmp_path: Path) -> None:
    _, planner, directory = setup(tmp_path)
    assert planner is not None
    planner.attach(saved(directory))
    evict = StorePlan("cpu", (), (KEYS[0],))
    meta = planner.attach(KVTierMetadata(saves=[SaveSpec("s", 0, (), (), (evict,))]))
    assert meta.saves[0].plans == (StorePlan("disk", (KEYS[0],), (), "cpu"), evict)  # the demotion, before it
    assert planner.attach(KVTierMetadata(saves=[SaveSpec("t", 0, (), (), (evict,))])).saves[0].plans == (evict,)
    planner.note(WorkerReport(persisted=[("disk", KEYS[0], r, False) for r in "01"]))  # the dropped copy: ignored
    assert directory.holds("disk", KEYS[0]) and not directory.contains("disk", KEYS[0])
    planner.note(WorkerReport(stored_saves=[("s", "disk", KEYS[0], r) for r in "01"]))
    assert directory.contains("disk", KEYS[0])
