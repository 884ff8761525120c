"""Saves over two tensor-parallel ranks: a chunk is served once every rank reported it written (each rank's rows
under the scheduler's keys), and the victims a save evicts, of any group sharing the tier, leave every rank's
tier under that rank's own keys."""

from __future__ import annotations

import pickle
from pathlib import Path

from roundtrip_helpers import A_BLOCKS, A_TOKENS, B_TOKENS, KCC, C, cfg_for, new_req, paged
from test_tiered_parallel import run_tp_step, tp_engine, tp_ident

from kvtier.config import CpuTierConfig, KvtierConfig, PolicyConfig, WritePolicy
from kvtier.connector.keying import namespaces, rank_key
from kvtier.connector.report import WorkerReport
from kvtier.connector.tiered import TieredConnector
from kvtier.engine.types import KVCacheBlocks, KVConnectorOutput, Request, SchedulerOutput
from kvtier.records.keys import Key


def save_on_ranks(sched: TieredConnector, workers: list[TieredConnector], req: Request) -> list[WorkerReport]:
    """Plan ``req``'s saves and run them on every rank; each rank's report, not yet given to the scheduler."""
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, KVCacheBlocks(A_BLOCKS), 0)
    meta = pickle.dumps(sched.build_connector_meta(new_req(req, A_BLOCKS, 0)))
    reports = []
    for w in workers:
        w.bind_connector_metadata(pickle.loads(meta))
        w.start_load_kv(None)
        w.wait_for_save()
        w.flush_saves()
        report = w.build_connector_worker_meta()
        w.get_kv_connector_stats()
        w.clear_connector_metadata()
        assert isinstance(report, WorkerReport)
        reports.append(report)
    return reports


def deliver(sched: TieredConnector, report: WorkerReport) -> None:
    sched.update_connector_output(pickle.loads(pickle.dumps(KVConnectorOutput(kv_connector_worker_meta=report))))


def test_a_chunk_is_served_once_every_rank_reported_it_written(tmp_path: Path) -> None:
    sched, workers = tp_engine(cfg_for(tmp_path, ("cpu",)))
    try:
        for r, w in enumerate(workers):
            w.register_kv_caches(paged(KCC, seed=40 + r))
        reports = save_on_ranks(sched, workers, Request("A", A_TOKENS))
        planned = set(sched._sched()._inflight.planned("A"))
        assert len(planned) == 2 * 5
        for rank, report in enumerate(reports):  # each rank reports every chunk under the scheduler's keys
            assert {(tier, key) for _, tier, key, _ in report.stored_saves} == planned
            assert {row[3] for row in report.stored_saves} == {str(rank)}
        deliver(sched, reports[0])
        directory = sched._sched().directory
        assert not any(directory.contains(tier, key) for tier, key in planned)  # rank 1 not heard of: not READY
        deliver(sched, reports[1])
        assert all(directory.contains(tier, key) for tier, key in planned)
        assert sched.get_num_new_matched_tokens(Request("B", B_TOKENS), 0) == (4 * C, True)  # A still running
        assert sched._sched()._inflight.planned("A") == []
    finally:
        sched.shutdown()
        for w in workers:
            w.shutdown()


def held_keys(workers: list[TieredConnector], cfg: KvtierConfig, keys: list[list[Key]]) -> list[int]:
    """How many of the chunks ``keys`` (rank 0's, per group) each rank's cpu pool holds, under its own keys."""
    held = []
    for r, w in enumerate(workers):
        spaces = namespaces(tp_ident(cfg, r), KCC, C)
        pool = w._store.tier("cpu").pool
        held.append(sum(pool.nbytes(rank_key(k, spaces[g])) is not None for g, ks in enumerate(keys) for k in ks))
    return held


def test_victims_of_every_group_leave_every_rank(tmp_path: Path) -> None:
    """A cpu tier with room for one request's 10 chunks (5 per group), A's group 0 used more recently than its
    group 1: B's save of group 0 evicts A's group 1, then its group 1 evicts A's group 0. Every victim leaves both
    ranks: rank 1 maps each by its own group (it once mapped them all by the saving group's, kept the other
    group's records and dropped nothing, until its pool was full)."""
    def cfg_of(capacity: int) -> KvtierConfig:
        return KvtierConfig(chunk_size=C, tiers=(CpuTierConfig("cpu", capacity),),
                            policy=PolicyConfig(eviction="lru", write=WritePolicy.WRITE_BACK))

    sched, workers = tp_engine(cfg_of(1 << 20))
    try:  # the room one request takes
        for r, w in enumerate(workers):
            w.register_kv_caches(paged(KCC, seed=50 + r))
        for report in save_on_ranks(sched, workers, Request("A", A_TOKENS)):
            assert not report.failed_saves
            deliver(sched, report)
        room = sched._sched().directory.used_bytes("cpu")
    finally:
        sched.shutdown()
        for w in workers:
            w.shutdown()
    cfg = cfg_of(room)
    sched, workers = tp_engine(cfg)
    sending: dict[str, int] = {}
    try:
        for r, w in enumerate(workers):
            w.register_kv_caches(paged(KCC, seed=50 + r))
        a, b = Request("A", A_TOKENS), Request("B", [7000 + i for i in range(len(A_TOKENS))])
        for report in save_on_ranks(sched, workers, a):
            deliver(sched, report)
        keys_a = [list(ks[:5]) for ks in sched._sched()._requests["A"].keys]
        assert held_keys(workers, cfg, keys_a) == [10, 10]
        sched.request_finished_all_groups(a, A_BLOCKS)
        run_tp_step(sched, workers, SchedulerOutput(finished_req_ids={"A"}), sending)
        sched._sched().directory.touch("cpu", keys_a[0])  # group 0 used again: B's first save evicts group 1
        for report in save_on_ranks(sched, workers, b):
            deliver(sched, report)
        keys_b = [list(ks[:5]) for ks in sched._sched()._requests["B"].keys]
        assert held_keys(workers, cfg, keys_a) == [0, 0]  # every victim left both ranks
        assert held_keys(workers, cfg, keys_b) == [10, 10]
        assert sched.get_num_new_matched_tokens(Request("B2", [*range(7000, 7032), 1, 2]), 0) == (4 * C, True)
    finally:
        sched.shutdown()
        for w in workers:
            w.shutdown()
