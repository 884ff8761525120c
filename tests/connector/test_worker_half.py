"""TieredConnector's worker half, loads and bounded waits: load errors from a corrupt or deleted disk record,
layouts, borrowed views, a stuck or broken tier, idle steps, and counters that follow the copies. Real cpu and disk
tiers; the scheduler half writes the plans. Set-up, roles, finished reports and pickling: test_worker_setup.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from worker_kit import (
    A_IDS,
    B_IDS,
    BOUND,
    CHUNK_BLOCKS,
    CHUNK_KEYS,
    KCC,
    NB,
    TOKENS,
    C,
    Engine,
    StuckCpuTier,
    bounded_worker,
    disk_file,
    load_b_async,
    make_cfg,
    paged,
    save_a,
    store_a,
)

import kvtier.connector.worker.half as worker_module
import kvtier.connector.worker.loads as loads_module
from kvtier.config import CpuTierConfig, DiskTierConfig
from kvtier.connector.plans import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.connector.worker.half import WorkerHalf
from kvtier.control.directory import StorePlan
from kvtier.engine.types import KVCacheBlocks, Request
from kvtier.kvcopy.transfer import KVLayout, gather
from kvtier.records.keys import Key
from kvtier.store.assembly import Role
from kvtier.store.tiered import TieredStore
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.memory.cpu import CpuTier
from kvtier.tiers.runtime import LoopThread


@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_damaged_disk_record_reports_its_blocks(tmp_path: Path, damage: str) -> None:
    kv_a = paged(1)
    store_a(tmp_path, kv_a)
    kv_b = paged(2)
    eng = Engine(make_cfg(tmp_path), kv_b)  # adopts A's records, then one goes bad behind its back
    path = disk_file(tmp_path, 2)
    if damage == "corrupt":
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    try:
        errors, received = load_b_async(eng)
        assert received == {"B"}  # reported even though part of it failed
        assert errors == {B_IDS[4], B_IDS[5]}  # chunk 2's blocks: the engine recomputes them
        for n in kv_a:
            assert torch.equal(kv_b[n][:, B_IDS[:4]], kv_a[n][:, A_IDS[:4]])
            assert torch.equal(kv_b[n][:, B_IDS[6:8]], kv_a[n][:, A_IDS[6:8]])
        # the failed chunk left the directory: the next lookup stops before it
        assert eng.sched.get_num_new_matched_tokens(Request("C", TOKENS), 0) == (2 * C, True)
    finally:
        eng.close()


def test_blocks_first_layout_roundtrip(tmp_path: Path) -> None:
    kv = paged(3, layout="blocks_first")
    eng = Engine(make_cfg(tmp_path, ("cpu",)), kv)
    try:
        save_a(eng)
        b = Request("B", TOKENS)
        assert eng.sched.get_num_new_matched_tokens(b, 0) == (4 * C, False)
        eng.sched.update_state_after_alloc(b, KVCacheBlocks((B_IDS,)), 4 * C)
        eng.run_prefill(b, B_IDS, 4 * C)
        for n in kv:
            assert torch.equal(kv[n][B_IDS[:8]], kv[n][A_IDS[:8]])
    finally:
        eng.close()


def test_cpu_load_scatters_from_borrowed_views_and_releases_them(tmp_path: Path) -> None:
    kv = paged(11)
    eng = Engine(make_cfg(tmp_path, ("cpu",)), kv)
    try:
        save_a(eng)
        worker = eng.work._worker
        assert worker is not None
        cpu = worker.store.tier("cpu")
        hits_before = cpu.stats().get_hits
        b = Request("B", TOKENS)
        assert eng.sched.get_num_new_matched_tokens(b, 0) == (4 * C, False)
        eng.sched.update_state_after_alloc(b, KVCacheBlocks((B_IDS,)), 4 * C)
        out = eng.run_prefill(b, B_IDS, 4 * C)
        assert not out.invalid_block_ids
        for n in kv:
            assert torch.equal(kv[n][:, B_IDS[:8]], kv[n][:, A_IDS[:8]])
        assert cpu.stats().get_hits - hits_before == 4  # read as views, counted as gets
        assert cpu.pool.pinned() == 0  # type: ignore[attr-defined]  # every view was taken back in the step
    finally:
        eng.close()


class BrokenReleaseCpuTier(CpuTier):
    """A cpu tier whose ``release`` raises."""

    def release(self, keys: Sequence[Key]) -> None:
        super().release(keys)
        raise RuntimeError("release broke")


@pytest.mark.timeout(20)  # without the bounds this test hangs: fail it instead
def test_stuck_tier_fails_loads_and_drops_saves_within_the_bound() -> None:
    tier = StuckCpuTier(CpuTierConfig("cpu", 1 << 20))
    worker, loop = bounded_worker(tier, paged(3))
    try:
        t0 = time.monotonic()
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", 0, "cpu", CHUNK_KEYS, CHUNK_BLOCKS)]))
        assert time.monotonic() - t0 < BOUND + 1.5
        assert worker.get_block_ids_with_load_errors() == {21, 22, 23, 24}
        assert tier.pool.pinned() == 0  # a miss in a memory tier fails at once (no read), pinning nothing for good
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("a", 0, "cpu", CHUNK_KEYS[:1], CHUNK_BLOCKS[:1], True)]))
        deadline = time.monotonic() + BOUND + 1.5
        recving: set[str] = set()
        while not recving and time.monotonic() < deadline:
            recving = worker.get_finished(set())[1] or set()
            time.sleep(0.02)
        assert recving == {"a"}
        assert worker.get_block_ids_with_load_errors() == {21, 22}
        save = SaveSpec("s", 0, CHUNK_KEYS, ((1, 2), (3, 4)), (StorePlan("cpu", CHUNK_KEYS),))
        worker.start_load_kv(KVTierMetadata(saves=[save]))
        t0 = time.monotonic()
        worker.handle_preemptions()  # flushes the step's save: a memory-only save is awaited, bounded
        assert time.monotonic() - t0 < 2 * BOUND + 1.5
        assert worker.get_finished({"s"})[0] == {"s"}  # dropped, so nothing keeps the blocks
    finally:
        worker.close()
        loop.close()


class StuckDiskTier(DiskTier):
    """A disk tier (it lends nothing: a synchronous load of it is read on the I/O loop) whose reads hang."""

    async def get(self, keys: Sequence[Key]) -> list[torch.Tensor | None]:
        await asyncio.Event().wait()
        return [None] * len(keys)


@pytest.mark.timeout(20)
def test_a_synchronous_load_of_a_tier_that_lends_nothing_is_read_on_the_loop_within_the_bound(
        tmp_path: Path) -> None:
    worker, loop = bounded_worker(StuckDiskTier(DiskTierConfig("disk", 1 << 20, path=str(tmp_path))),  # type: ignore[arg-type]
                                  paged(3))
    try:
        t0 = time.monotonic()
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", 0, "disk", CHUNK_KEYS, CHUNK_BLOCKS)]))
        assert BOUND <= time.monotonic() - t0 < BOUND + 1.5  # it waited for the read, bounded
        assert worker.get_block_ids_with_load_errors() == {21, 22, 23, 24}
    finally:
        worker.close()
        loop.close()


def test_a_failing_release_does_not_reach_the_engine() -> None:
    kv = paged(5)
    tier = BrokenReleaseCpuTier(CpuTierConfig("cpu", 1 << 20))
    worker, loop = bounded_worker(tier, kv)
    try:
        layers = [kv[n] for n in KCC.kv_cache_groups[0].layer_names]
        data = gather(layers, [(1, 2), (3, 4)], KVLayout.KV_FIRST)
        loop.run(tier.put([(k, data[i].contiguous()) for i, k in enumerate(CHUNK_KEYS)]))
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", 0, "cpu", CHUNK_KEYS, CHUNK_BLOCKS)]))
        assert worker.get_block_ids_with_load_errors() == set()
        for n in kv:
            assert torch.equal(kv[n][:, [21, 22, 23, 24]], kv[n][:, [1, 2, 3, 4]])
    finally:
        worker.close()
        loop.close()


def test_a_load_after_the_io_loop_closed_fails_its_blocks_and_leaves_no_coroutine_unawaited(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An engine step that outlives kvtier's I/O loop (shutdown): the planned blocks become load errors (the
    engine recomputes them) and no coroutine is left unawaited (Python's RuntimeWarning at collection)."""
    monkeypatch.setattr(loads_module.logger, "disabled", True)  # a captured log record would keep the error alive
    kv = paged(6)
    before = {n: t.clone() for n, t in kv.items()}
    worker, loop = bounded_worker(DiskTier(DiskTierConfig("disk", 1 << 20, path=str(tmp_path))), kv)  # type: ignore[arg-type]
    loop.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a disk tier lends nothing: its synchronous load needs the (closed) loop
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", 0, "disk", CHUNK_KEYS, CHUNK_BLOCKS)]))
        gc.collect()
    assert worker.get_block_ids_with_load_errors() == {21, 22, 23, 24}
    assert all(torch.equal(kv[n], before[n]) for n in kv)
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []


@pytest.mark.parametrize("idle", [True, False])
def test_a_step_that_computes_nothing_waits_for_pending_async_loads(idle: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine spinning through empty steps holds the GIL: in such a step the worker blocks (bounded) on its
    pending async loads instead of returning at once; a step with work never waits."""
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 10.0)
    worker, loop = bounded_worker(CpuTier(CpuTierConfig("cpu", 1 << 20)), paged(3))
    try:
        future: concurrent.futures.Future[list[list[torch.Tensor | None]]] = concurrent.futures.Future()
        worker.start_load_kv(KVTierMetadata(idle=idle))
        worker._loads.recving["r"] = ([], future)
        timer = threading.Timer(0.05 if idle else 3.0, future.set_result, ([],))
        timer.start()
        t0 = time.monotonic()
        _, recving = worker.get_finished(set())
        if idle:  # returned as soon as the load finished, well before the (patched) 10 s bound
            assert recving == {"r"} and time.monotonic() - t0 < 5
        else:  # returned at once, the load still running
            assert recving is None and time.monotonic() - t0 < 2.5
        timer.join()
    finally:
        worker.close()
        loop.close()


def test_a_save_whose_copy_fails_is_reported_not_stored(tmp_path: Path) -> None:
    """A gather that raises (here: blocks past the end of the tensors) costs the save, never the engine."""
    worker, loop = bounded_worker(CpuTier(CpuTierConfig("cpu", 1 << 20)), paged(3))
    try:
        bad = SaveSpec("s", 0, CHUNK_KEYS, ((NB + 5, NB + 6), (3, 4)), (StorePlan("cpu", CHUNK_KEYS),))
        worker.start_load_kv(KVTierMetadata(saves=[bad]))
        worker.wait_for_save()  # no exception
        stats = worker.stats()
        assert stats is not None and stats.data["save_failures"] == 2
        report = worker.report()
        assert report is not None and sorted(row[2] for row in report.failed_saves) == sorted(CHUNK_KEYS)
        assert worker.get_finished({"s"})[0] == {"s"}  # the request's blocks are freed
    finally:
        worker.close()
        loop.close()


@pytest.mark.parametrize("bad", ["dtype", "shape"])
def test_a_chunk_counts_as_loaded_only_once_its_copy_landed(bad: str) -> None:
    """Counters follow the copy into the engine's blocks: a record the scatter refuses (another dtype, another
    shape) is a load failure with its blocks reported, never a hit; good records count as hits."""
    kv = paged(3)
    tier = CpuTier(CpuTierConfig("cpu", 1 << 20))
    worker, loop = bounded_worker(tier, kv)
    try:
        good = gather(list(kv.values()), [(1, 2), (3, 4)], KVLayout.KV_FIRST)
        wrong = good.float() if bad == "dtype" else good.reshape(2, -1)[:, :good[0].numel() // 2].contiguous()
        loop.run(tier.put([(CHUNK_KEYS[0], good[0]), (CHUNK_KEYS[1], good[1])]))
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", 0, "cpu", CHUNK_KEYS, CHUNK_BLOCKS)]))
        assert worker.get_block_ids_with_load_errors() == set()
        stats = worker.stats()
        assert stats is not None
        assert {k: stats.data.get(k) for k in ("load_chunks", "hits_cpu", "load_chunks_group0", "load_failures")} \
            == {"load_chunks": 2, "hits_cpu": 2, "load_chunks_group0": 2, "load_failures": None}

        bad_key = bytes([9]) * 32
        loop.run(tier.put([(bad_key, wrong[0])]))
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("s", 0, "cpu", (bad_key,), CHUNK_BLOCKS[:1])]))
        assert worker.get_block_ids_with_load_errors() == set(CHUNK_BLOCKS[0])
        stats = worker.stats()
        assert stats is not None
        assert stats.data["load_failures"] == 1 and stats.data["load_scatter_failures"] == 1
        assert not {"load_chunks", "hits_cpu", "load_chunks_group0", "load_bytes"} & set(stats.data)
    finally:
        worker.close()
        loop.close()


def test_a_failed_load_drops_its_requests_writes_but_not_the_demotions_its_save_carries(tmp_path: Path) -> None:
    """Request r's synchronous load from cpu fails (the record is gone) in the step whose save writes r's chunks
    into cpu and, to make room there, demotes another request's chunk X to disk. r's writes are dropped (computed
    after a failed load: wrong); X's demotion still lands on disk, bit for bit (it was evicted from cpu and never
    written: lost)."""
    cpu = CpuTier(CpuTierConfig("cpu", 1 << 20))
    disk = DiskTier(DiskTierConfig("disk", 1 << 22, path=str(tmp_path)))
    loop = LoopThread()
    store = TieredStore([cpu, disk], None, role=Role.WORKER)
    loop.run(store.start())
    worker = WorkerHalf(KCC, store, loop, chunk_size=C)
    worker.register_kv_caches(paged(4))
    worker.wait_timeout_s = worker.async_load_timeout_s = BOUND
    try:
        x, gone = bytes([9]) * 32, bytes([8]) * 32
        value = torch.arange(64, dtype=torch.float32)
        assert loop.run(cpu.put([(x, value)])) == [True]
        load = LoadSpec("r", 0, "cpu", (gone,), ((11, 12),))
        save = SaveSpec("r", 0, CHUNK_KEYS, CHUNK_BLOCKS, (StorePlan("disk", (x,), (), "cpu"),
                                                         StorePlan("cpu", CHUNK_KEYS, (x,))))
        worker.start_load_kv(KVTierMetadata(loads=[load], saves=[save]))
        assert worker.get_block_ids_with_load_errors() == {11, 12}
        worker.wait_for_save()
        worker.flush()
        assert loop.run(cpu.contains(list(CHUNK_KEYS))) == [False, False]  # r's writes dropped
        got = loop.run(disk.get([x]))[0]
        assert got is not None and torch.equal(got, value)  # X demoted, not lost
        assert loop.run(cpu.contains([x])) == [False]
        report = worker.report()  # the scheduler learns both: X READY on disk, r's chunks forgotten
        assert report is not None and [row[1:3] for row in report.stored_saves] == [("disk", x)]
        assert sorted(row[1:3] for row in report.failed_saves) == [("cpu", k) for k in CHUNK_KEYS]
    finally:
        worker.close()
        loop.run(store.close())
        loop.close()
