"""A chunk whose write is still in flight is served (issue 32): split halves, B looked up before any step delivered
the worker report of A's writes (an idle engine runs no step, so the first reuse after a pause is such a lookup).

B's load is asynchronous and the worker's read waits for its own write of the chunk; a write that fails makes the
read a miss, reported as a load error (the engine recomputes), and nothing wrong is loaded.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from worker_kit import A_IDS, B_IDS, KCC, TOKENS, C, Engine, make_cfg, paged

from kvtier.config import TierKind
from kvtier.connector.base import KVConnectorRole
from kvtier.connector.plans import SaveSpec
from kvtier.connector.report import WorkerReport
from kvtier.connector.tiered import TieredConnector
from kvtier.connector.worker.saves import SaveJob, SaveQueue
from kvtier.control.directory import StorePlan
from kvtier.control.metrics import WorkerCounters
from kvtier.engine.types import KVCacheBlocks, KVConnectorOutput, NewRequestData, Request, SchedulerOutput
from kvtier.records.keys import Key
from kvtier.tiers.runtime import LoopThread


class HeldWrites:
    """A worker's writes to one tier wait until ``release``; then each succeeds, or fails when ``fail``."""

    def __init__(self, work: TieredConnector, tier: str, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self._loop = work._loop
        self._gate = asyncio.Event()
        self.puts = 0
        target = work._work().store.tier(tier)
        put = target.put

        async def held(items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
            self.puts += 1
            await self._gate.wait()
            return [False] * len(items) if fail else await put(items)

        monkeypatch.setattr(target, "put", held)

    def release(self) -> None:
        self._loop.loop.call_soon_threadsafe(self._gate.set)


def save_a_held(eng: Engine) -> None:
    """A is prefilled, its chunks planned for saving (the write held in the worker), and finished."""
    a = Request("A", TOKENS)
    assert eng.sched.get_num_new_matched_tokens(a, 0) == (0, False)
    eng.run_prefill(a, A_IDS)
    assert eng.sched.request_finished(a, A_IDS) == (True, None)


def receive(eng: Engine, req_id: str, release: HeldWrites) -> tuple[set[int], dict[str, float]]:
    """Steps until ``req_id``'s load is reported; its load errors and the load counters. The held writes are
    released after a few steps in which the load must still be waiting."""
    errors: set[int] = set()
    counts: dict[str, float] = {}
    for i in range(500):
        if i == 5:
            release.release()
        out = eng.step(SchedulerOutput())
        errors |= out.invalid_block_ids
        for key, value in (out.kv_connector_stats.data if out.kv_connector_stats else {}).items():
            if not key.startswith("samples:"):
                counts[key] = counts.get(key, 0) + value
        if req_id in (out.finished_recving or set()):
            assert i >= 5, "the load did not wait for the write"
            return errors, counts
        time.sleep(0.01)
    raise AssertionError(f"the load of {req_id} never finished")


def kv_of(kv: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    return torch.stack([kv[n][:, ids] for n in KCC.kv_cache_groups[0].layer_names])


@pytest.mark.parametrize("tiers", [("disk",), ("cpu", "disk")], ids=["disk", "cpu-written-through"])
def test_a_chunk_being_written_is_hit_and_loaded_once_written(tiers: tuple[str, ...], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """B hits A's 4 chunks while A's write is held (it hit 0 before), asynchronously even from the memory tier, and
    gets A's blocks once the write lands; the hit is reported from the tier it comes from."""
    kv = paged(5)
    eng = Engine(make_cfg(tmp_path, tiers), kv)
    held = HeldWrites(eng.work, "disk", monkeypatch)
    try:
        save_a_held(eng)
        b = Request("B", TOKENS)
        assert eng.sched.get_num_new_matched_tokens(b, 0) == (4 * C, True)
        eng.sched.update_state_after_alloc(b, KVCacheBlocks((B_IDS,)), 4 * C)
        assert eng.sched.hit_sources(b) == {TierKind(tiers[0]): 4 * C}
        errors, counts = receive(eng, "B", held)
        assert not errors and counts[f"hits_{tiers[0]}"] == 4 and not counts.get("load_failures")
        assert torch.equal(kv_of(kv, B_IDS[:8]), kv_of(kv, A_IDS[:8]))
    finally:
        held.release()  # a failed assertion must not leave the write for shutdown to wait out
        eng.close()


def test_a_write_that_fails_after_the_lookup_fails_the_load_cleanly(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A's disk write fails after B counted on it: B's load reports every loaded block as a load error (the engine
    recomputes them), B's blocks are left as they were, and the chunks are no longer a hit."""
    kv = paged(6)
    eng = Engine(make_cfg(tmp_path, ("disk",)), kv)
    held = HeldWrites(eng.work, "disk", monkeypatch, fail=True)
    try:
        save_a_held(eng)
        b = Request("B", TOKENS)
        assert eng.sched.get_num_new_matched_tokens(b, 0) == (4 * C, True)
        eng.sched.update_state_after_alloc(b, KVCacheBlocks((B_IDS,)), 4 * C)
        before = kv_of(kv, B_IDS).clone()
        errors, counts = receive(eng, "B", held)
        assert errors == set(B_IDS[:8]) and counts["load_failures"] == 4
        assert torch.equal(kv_of(kv, B_IDS), before)
        assert eng.sched.get_num_new_matched_tokens(Request("C", TOKENS), 0) == (0, False)
    finally:
        held.release()  # a failed assertion must not leave the write for shutdown to wait out
        eng.close()


# ---- two tensor-parallel ranks: each waits for its own write -------------------------------------------------
def vllm(rank: int) -> Any:
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, rank=rank), model_config=None)


def tp_step(sched: TieredConnector, workers: list[TieredConnector], out: SchedulerOutput) -> KVConnectorOutput:
    """One step on both ranks, aggregated as vLLM's KVOutputAggregator does (a load is done once both are)."""
    meta = pickle.dumps(sched.build_connector_meta(out))
    invalid: set[int] = set()
    recving: list[set[str]] = []
    report = WorkerReport()
    for w in workers:
        w.bind_connector_metadata(pickle.loads(meta))
        w.start_load_kv(None)
        w.wait_for_save()
        recving.append(w.get_finished(set())[1] or set())
        invalid |= w.get_block_ids_with_load_errors()
        report = report.aggregate(w.build_connector_worker_meta() or WorkerReport())
        w.clear_connector_metadata()
    output = KVConnectorOutput(finished_recving=set.intersection(*recving) or None, invalid_block_ids=invalid,
                               kv_connector_worker_meta=report)
    sched.update_connector_output(pickle.loads(pickle.dumps(output)))
    return output


def test_with_two_ranks_a_rank_whose_write_failed_reports_its_load_failed(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's write lands, rank 1's fails: B's load waits for each rank's own write, rank 0 loads A's KV and rank
    1 reports the blocks as load errors, so the engine recomputes them on both."""
    cfg = make_cfg(tmp_path, ("disk",))
    sched = TieredConnector(vllm(0), KVConnectorRole.SCHEDULER, KCC, kvtier_config=cfg)
    workers = [TieredConnector(vllm(r), KVConnectorRole.WORKER, KCC, kvtier_config=cfg) for r in (0, 1)]
    kvs = [paged(20 + r) for r in (0, 1)]
    held = [HeldWrites(w, "disk", monkeypatch, fail=r == 1) for r, w in enumerate(workers)]
    try:
        for w, kv in zip(workers, kvs, strict=True):
            w.register_kv_caches(kv)
        a = Request("A", TOKENS)
        sched.get_num_new_matched_tokens(a, 0)
        tp_step(sched, workers, SchedulerOutput(scheduled_new_reqs=[NewRequestData("A", TOKENS, (A_IDS,), 0)],
                                                num_scheduled_tokens={"A": len(TOKENS)}))
        b = Request("B", TOKENS)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, True)
        sched.update_state_after_alloc(b, KVCacheBlocks((B_IDS,)), 4 * C)
        before = kv_of(kvs[1], B_IDS).clone()
        errors: set[int] = set()
        for i in range(500):
            if i == 3:
                for h in held:
                    h.release()
            out = tp_step(sched, workers, SchedulerOutput())
            errors |= out.invalid_block_ids
            if "B" in (out.finished_recving or set()):
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the load never finished")
        assert i >= 3 and errors == set(B_IDS[:8])  # it waited for the writes
        assert torch.equal(kv_of(kvs[0], B_IDS[:8]), kv_of(kvs[0], A_IDS[:8]))  # rank 0: its own write, landed
        assert torch.equal(kv_of(kvs[1], B_IDS), before)  # rank 1: nothing loaded
    finally:
        for h in held:
            h.release()
        sched.shutdown()
        for w in workers:
            w.shutdown()


# ---- the save queue's ``landed``: what an asynchronous read waits for ----------------------------------------
class GatedStore:
    """Stands in for a worker's store: every write waits for ``gate``."""

    completes_writes = False

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def execute(self, plans: Any, items: Any, failed: Any, skip_writes: bool = False) -> dict[str, int]:
        await self.gate.wait()
        return {}


def queue_with(store: GatedStore) -> SaveQueue:
    return SaveQueue(store, WorkerCounters(C), lambda *_: None, lambda *_: None)  # type: ignore[arg-type]


def job(key: Key, written: bool = True) -> SaveJob:
    spec = SaveSpec("r", 0, (key,), ((1, 2),), (StorePlan("disk", (key,)),))
    return SaveJob(spec, list(spec.plans), {key: torch.zeros(4)} if written else None)


def test_a_read_waits_only_for_the_job_writing_its_record() -> None:
    """``landed`` waits for the job that writes the key (not for a skipped one, which writes nothing), a waiter
    that gives up leaves the others waiting, and once the job is done nothing is waited for."""
    loop, store = LoopThread(), GatedStore()
    queue = queue_with(store)
    k1, k2, k3 = (Key(bytes([i]) * 32) for i in (1, 2, 3))
    try:
        step = queue.submit(loop, [job(k1), job(k2, written=False)])
        loop.run(asyncio.wait_for(queue.landed("disk", [k2, k3]), 1))  # at once
        loop.run(asyncio.wait_for(queue.landed("cpu", [k1]), 1))  # another tier's record: at once
        waiter = loop.submit(queue.landed("disk", [k3, k1]))
        with pytest.raises(TimeoutError):  # gives up: the job's end stays for the others
            loop.run(asyncio.wait_for(queue.landed("disk", [k1]), 0.1))
        assert not waiter.done()
        loop.loop.call_soon_threadsafe(store.gate.set)
        waiter.result(5)
        step.result(5)
        assert not queue._writes
    finally:
        loop.close()


def test_a_save_step_cancelled_before_it_ran_ends_the_waits_for_it() -> None:
    loop, store = LoopThread(), GatedStore()
    queue = queue_with(store)
    k1 = Key(bytes([1]) * 32)
    busy, release = threading.Event(), threading.Event()
    try:
        loop.loop.call_soon_threadsafe(lambda: (busy.set(), release.wait(10)))
        assert busy.wait(5)  # the loop thread is held: the step below is queued, not started
        queue.submit(loop, [job(k1)]).cancel()  # a bounded wait gave up on it
        release.set()
        loop.run(asyncio.wait_for(queue.landed("disk", [k1]), 1))  # nothing to wait for: it will never write
    finally:
        release.set()
        loop.close()
