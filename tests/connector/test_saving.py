"""The worker's saves: gathered copies outlive the engine's blocks, preemption never waits for writes, the save
backlog skips what a slow medium cannot take (evictions still run, the chunks are reported not stored), an idle
step waits for the writes finished requests hold blocks for, and ``policy.store_threshold`` saves only reused
prefixes. Real disk and cpu tiers; a disk tier whose writer waits on a gate stands in for a slow device.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from worker_kit import A_IDS, B_IDS, KCC, TOKENS, C, Engine, make_cfg, paged

from kvtier.config import DiskTierConfig, PolicyConfig, WritePolicy
from kvtier.connector.plans import KVTierMetadata, SaveSpec
from kvtier.connector.scheduler.reuse import SeenCounter
from kvtier.connector.worker import half as worker_module
from kvtier.connector.worker.half import WorkerHalf
from kvtier.control.directory import StorePlan
from kvtier.engine.types import Request, SchedulerOutput
from kvtier.kvcopy.transfer import KVLayout, gather
from kvtier.records.keys import Key
from kvtier.store.assembly import Role
from kvtier.store.tiered import TieredStore
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.runtime import LoopThread

KEYS = tuple(Key(bytes([i]) * 32) for i in range(1, 5))


class GatedDiskTier(DiskTier):
    """A real disk tier whose writer thread waits until ``gate`` is set before it writes anything."""

    def __init__(self, path: Path) -> None:
        super().__init__(DiskTierConfig("disk", 1 << 24, path=str(path)))
        self.gate = threading.Event()

    def _write_many(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[int | OSError]:
        assert self.gate.wait(20)
        return super()._write_many(items)


@pytest.fixture
def gated(tmp_path: Path):  # type: ignore[no-untyped-def]
    tier = GatedDiskTier(tmp_path / "kv")
    loop = LoopThread()
    store = TieredStore([tier], None, role=Role.WORKER)
    loop.run(store.start())
    kv = paged(7)
    worker = WorkerHalf(KCC, store, loop, chunk_size=C)
    worker.register_kv_caches(kv)
    yield worker, tier, loop, kv
    tier.gate.set()
    worker.close()
    loop.run(store.close())
    loop.close()


def save(worker: WorkerHalf, req: str, keys: Sequence[Key], blocks: Sequence[tuple[int, int]],
         evicted: Sequence[Key] = ()) -> None:
    """One engine step that saves ``keys`` from ``blocks`` to the disk tier."""
    plan = StorePlan("disk", tuple(keys), tuple(evicted))
    worker.start_load_kv(KVTierMetadata(saves=[SaveSpec(req, 0, tuple(keys), tuple(blocks), (plan,))]))
    worker.wait_for_save()


def stored(loop: LoopThread, tier: DiskTier, keys: Sequence[Key]) -> list[torch.Tensor | None]:
    return loop.run(tier.get(list(keys)))


def test_preemption_never_waits_for_writes_and_the_saved_bytes_are_the_gathered_ones(gated) -> None:  # type: ignore[no-untyped-def]
    worker, tier, loop, kv = gated
    layers = [kv[n] for n in KCC.kv_cache_groups[0].layer_names]
    expected = gather(layers, [(1, 2), (3, 4)], KVLayout.KV_FIRST).clone()
    save(worker, "r", KEYS[:2], [(1, 2), (3, 4)])
    t0 = time.monotonic()
    worker.handle_preemptions()  # vLLM calls this before every step
    assert time.monotonic() - t0 < 0.5
    assert worker.get_finished({"r"})[0] is None  # the write still waits for the device
    for t in layers:
        t.zero_()  # the engine reuses the preempted blocks
    tier.gate.set()
    worker.flush()
    assert worker.get_finished(set())[0] == {"r"}
    got = stored(loop, tier, KEYS[:2])
    assert all(g is not None for g in got)
    assert torch.equal(torch.stack([g for g in got if g is not None]), expected)  # not the zeroed blocks


def test_saves_past_the_backlog_are_skipped_reported_and_still_evict(gated) -> None:  # type: ignore[no-untyped-def]
    worker, tier, loop, _ = gated
    tier.gate.set()
    save(worker, "old", KEYS[3:], [(5, 6)])
    worker.flush()
    assert stored(loop, tier, KEYS[3:])[0] is not None
    tier.gate.clear()
    worker._queue.max_backlog = worker._chunk_bytes(0)  # room for one chunk in flight
    save(worker, "a", KEYS[:1], [(1, 2)])  # admitted: it waits at the gate
    save(worker, "b", KEYS[1:2], [(3, 4)], evicted=KEYS[3:])  # over the backlog: skipped
    tier.gate.set()
    worker.flush()
    stats = worker.stats()
    assert stats is not None
    assert stats.data["save_skipped_busy"] == 1
    assert "failed_saves" not in stats.data  # stats only count: the rows travel in the worker report
    report = worker.report()
    assert report is not None and report.failed_saves == [("b", "disk", KEYS[1], "0")]  # the scheduler forgets it
    a, b, old = stored(loop, tier, [KEYS[0], KEYS[1], KEYS[3]])
    assert a is not None and b is None
    assert old is None  # the skipped plan's eviction ran: the directory had counted that room as free
    assert worker._queue.backlog == 0


def test_with_nothing_queued_a_save_larger_than_the_backlog_is_taken(gated) -> None:  # type: ignore[no-untyped-def]
    """The bound only holds back saves behind others: a step bigger than it, alone, is saved (else a large
    prefill would never be cached), and a request with a skipped save skips its later ones even when the queue
    has room again (they could never be hit without the skipped chunk)."""
    worker, tier, loop, _ = gated
    worker._queue.max_backlog = worker._chunk_bytes(0)  # less than the two chunks below
    save(worker, "big", KEYS[:2], [(1, 2), (3, 4)])
    save(worker, "late", KEYS[2:3], [(5, 6)])  # queued behind "big": skipped
    tier.gate.set()
    worker.flush()
    assert worker._queue.backlog == 0
    save(worker, "late", KEYS[3:], [(7, 8)])  # room now, but its earlier chunk is missing: skipped
    save(worker, "other", KEYS[3:], [(7, 8)])  # another request with the same room: saved
    worker.flush()
    assert [v is not None for v in stored(loop, tier, KEYS)] == [True, True, False, True]
    stats = worker.stats()
    assert stats is not None and stats.data["save_skipped_busy"] == 2
    report = worker.report()
    assert report is not None and [row[0] for row in report.failed_saves] == ["late", "late"]


def test_a_save_step_cancelled_before_it_ran_leaves_the_backlog(gated) -> None:  # type: ignore[no-untyped-def]
    """A bounded wait that gives up cancels the steps it waited for; their bytes leave the backlog even when
    their jobs never started (the I/O loop was busy), and nothing of them is written."""
    worker, tier, loop, _ = gated
    busy, release = threading.Event(), threading.Event()
    loop.loop.call_soon_threadsafe(lambda: (busy.set(), release.wait(10)))
    assert busy.wait(5)  # the loop thread is held: the steps below are queued, not started
    save(worker, "a", KEYS[:1], [(1, 2)])
    save(worker, "b", KEYS[1:2], [(3, 4)])
    assert worker._queue.backlog == 2 * worker._chunk_bytes(0)
    worker.wait_timeout_s = 0.2
    worker.flush()  # gives up: both steps cancelled before they ran
    assert worker._queue.backlog == 0
    release.set()
    tier.gate.set()
    time.sleep(0.2)
    assert stored(loop, tier, KEYS[:2]) == [None, None]


def test_a_stuck_save_is_abandoned_and_frees_its_request(gated, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A medium that never finishes a write: after ``SAVE_TIMEOUT_S`` the save is dropped and reported not stored,
    and the finished request is reported done, so the engine gets its blocks back."""
    from kvtier.connector.worker import saves

    worker, _, _, _ = gated
    monkeypatch.setattr(saves, "SAVE_TIMEOUT_S", 0.3)
    save(worker, "r", KEYS[:1], [(1, 2)])
    assert worker.get_finished({"r"})[0] is None
    deadline = time.monotonic() + 10
    sending = None
    while sending is None and time.monotonic() < deadline:
        time.sleep(0.05)
        sending = worker.get_finished(set())[0]
    assert sending == {"r"}
    stats = worker.stats()
    assert stats is not None
    report = worker.report()
    assert stats.data["save_timeouts"] == 1 and report is not None and report.failed_saves == [("r", "disk", KEYS[0], "0")]
    assert worker._queue.backlog == 0


def test_an_idle_step_waits_for_the_writes_a_finished_request_holds_blocks_for(gated, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    worker, tier, _, _ = gated
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 5.0)
    save(worker, "r", KEYS[:1], [(1, 2)])
    assert worker.get_finished({"r"})[0] is None  # a busy step does not wait
    threading.Timer(0.1, tier.gate.set).start()
    worker.start_load_kv(KVTierMetadata(idle=True))
    t0 = time.monotonic()
    assert worker.get_finished(set())[0] == {"r"}  # the idle step slept until the write was done
    assert 0.05 < time.monotonic() - t0 < 4.0


def test_store_threshold_saves_a_prefix_once_a_second_request_asks_for_it(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, ("cpu",))
    cfg = type(cfg)(chunk_size=cfg.chunk_size, tiers=cfg.tiers,
                    policy=PolicyConfig(eviction="lru", write=WritePolicy.WRITE_BACK, store_threshold=2))
    eng = Engine(cfg, paged(5))
    try:
        for name, ids, hit in (("A", A_IDS, 0), ("B", B_IDS, 0), ("C", A_IDS, 4 * C)):
            req = Request(name, TOKENS)
            assert eng.sched.get_num_new_matched_tokens(req, 0) == (hit, False)
            if hit:
                break
            out = eng.run_prefill(req, ids)
            saved = (out.kv_connector_stats.data if out.kv_connector_stats else {}).get("save_chunks", 0)
            # A: first sight, nothing saved; B: its prefix was seen (the 4 chunks a lookup covers; the last one
            # holds the token that is always computed, and a later, longer prompt's lookup counts it)
            assert saved == (0 if name == "A" else 4)
            eng.sched.request_finished(req, ids)
            eng.work.flush_saves()
            eng.step(SchedulerOutput(finished_req_ids={name}))
    finally:
        eng.close()


def test_seen_counter_counts_per_key_and_forgets_deep_chunks_before_their_prefix_root() -> None:
    seen = SeenCounter(capacity=2)
    seen.add([KEYS[0], KEYS[1]])  # one request's prefix, root first
    seen.add([KEYS[2]])  # over capacity: the deeper chunk goes, the root stays (a chunk is useless without it)
    assert (len(seen), seen.count(KEYS[0]), seen.count(KEYS[1]), seen.count(KEYS[2])) == (2, 1, 0, 1)
    seen.add([KEYS[2]])
    assert seen.count(KEYS[2]) == 2
    with pytest.raises(ValueError):
        SeenCounter(0)
