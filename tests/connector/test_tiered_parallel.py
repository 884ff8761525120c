"""TieredConnector over parallel engines: tensor-parallel ranks keep their disk records apart and load their own
KV back, worker reports aggregate over ranks (and reach each child of a multi connector), a chunk is forgotten only
when any rank failed it, and pipeline parallelism is refused."""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from roundtrip_helpers import A_BLOCKS, A_TOKENS, B_BLOCKS, B_TOKENS, KCC, C, assert_loaded, cfg_for, new_req, paged

from kvtier.config import KvtierConfig
from kvtier.connector.base import KVConnectorRole
from kvtier.connector.keying import identity_from, namespaces
from kvtier.connector.settings import read_settings
from kvtier.connector.tiered import TieredConnector
from kvtier.engine.types import KVCacheBlocks, KVConnectorOutput, Request, SchedulerOutput


def tp_engine(cfg: KvtierConfig) -> tuple[TieredConnector, list[TieredConnector]]:
    """A scheduler and the workers of two tensor-parallel ranks, as vLLM builds them (ranks from the engine's
    parallel config), all with the same kvtier config."""
    def vllm(rank: int) -> Any:
        return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, rank=rank), model_config=None)

    sched = TieredConnector(vllm(0), KVConnectorRole.SCHEDULER, KCC, kvtier_config=cfg)
    return sched, [TieredConnector(vllm(r), KVConnectorRole.WORKER, KCC, kvtier_config=cfg) for r in (0, 1)]


def save_a_on_both_ranks(cfg: KvtierConfig) -> list[dict[str, torch.Tensor]]:
    """A two-rank engine saves request A on every rank, then shuts down; the ranks' paged KV."""
    sched, workers = tp_engine(cfg)
    kv_a = [paged(KCC, seed=10 + r) for r in (0, 1)]
    try:
        for w, kv in zip(workers, kv_a, strict=True):
            w.register_kv_caches(kv)
        a = Request("A", A_TOKENS)
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
        sched.update_state_after_alloc(a, KVCacheBlocks(A_BLOCKS), 0)
        meta = pickle.dumps(sched.build_connector_meta(new_req(a, A_BLOCKS, 0)))
        for w in workers:
            w.bind_connector_metadata(pickle.loads(meta))
            w.start_load_kv(None)
            w.wait_for_save()
            w.clear_connector_metadata()
            w.flush_saves()  # every save of A is done
    finally:
        sched.shutdown()
        for w in workers:
            w.shutdown()
    return kv_a


def test_tensor_parallel_ranks_keep_their_disk_records_apart(tmp_path: Path) -> None:
    """Each rank stores its own shard of every chunk in its own subdirectory of the disk path; after a restart
    the scheduler adopts rank 0's records only, and every rank loads its own KV back."""
    cfg = cfg_for(tmp_path, ("disk",))
    kv_a = save_a_on_both_ranks(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tp0-of-2", "tp1-of-2"]
    files = [sorted(p.name for p in (tmp_path / d).rglob("*.kvt")) for d in ("tp0-of-2", "tp1-of-2")]
    assert len(files[0]) == len(files[1]) == 2 * 5  # both groups, 5 whole chunks of A each
    assert not set(files[0]) & set(files[1])  # each rank's own keys

    sched, workers = tp_engine(cfg)  # a restart over the same path
    kv_b = [paged(KCC, seed=20 + r) for r in (0, 1)]
    try:
        for w, kv in zip(workers, kv_b, strict=True):
            w.register_kv_caches(kv)
        b = Request("B", B_TOKENS)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, True)
        sched.update_state_after_alloc(b, KVCacheBlocks(B_BLOCKS), 4 * C)
        received: list[set[str]] = [set(), set()]
        for _ in range(500):
            meta = pickle.dumps(sched.build_connector_meta(SchedulerOutput()))
            for r, w in enumerate(workers):
                w.bind_connector_metadata(pickle.loads(meta))
                w.start_load_kv(None)
                w.wait_for_save()
                _, recving = w.get_finished(set())
                assert not w.get_block_ids_with_load_errors()
                received[r] |= recving or set()
                w.clear_connector_metadata()
            if all(received):
                break
            time.sleep(0.01)
        assert received == [{"B"}, {"B"}]
        for r in (0, 1):
            assert_loaded(kv_a[r], kv_b[r], 8)
    finally:
        sched.shutdown()
        for w in workers:
            w.shutdown()


def test_worker_reports_aggregate_over_ranks_and_reach_each_child_of_a_multi_connector() -> None:
    """The report travels through the worker-metadata hook: aggregated over ranks by the engine, split per child
    by a multi connector (each child sees its own), never through stats."""
    from kvtier.connector.multi import MultiConnector
    from kvtier.connector.report import ChildReports, WorkerReport

    key = bytes(range(32))
    rank0 = WorkerReport([("A", "disk", key, "0")], stored_saves=[("A", "cpu", key, "0")])
    rank1 = WorkerReport([("A", "disk", key, "1")], disabled=True, stored_saves=[("A", "cpu", key, "1")])
    merged = rank0.aggregate(rank1)
    assert merged.failed_saves == [("A", "disk", key, "0"), ("A", "disk", key, "1")] and merged.disabled
    assert merged.stored_saves == [("A", "cpu", key, "0"), ("A", "cpu", key, "1")]
    assert not WorkerReport() and WorkerReport(stored_saves=[("A", "cpu", key, "0")])  # rows alone are news
    assert pickle.loads(pickle.dumps(merged)) == merged
    nested = ChildReports((None, rank0)).aggregate(ChildReports((None, rank1)))
    assert nested == ChildReports((None, merged))

    seen: list[Any] = []

    class Child:
        def update_connector_output(self, output: Any) -> None:
            seen.append(output.kv_connector_worker_meta)

    multi = object.__new__(MultiConnector)
    multi._connectors = [Child(), Child()]  # type: ignore[attr-defined]
    output = KVConnectorOutput(kv_connector_worker_meta=nested)
    multi.update_connector_output(output)
    assert seen == [None, merged] and output.kv_connector_worker_meta is nested


def tp_ident(cfg: KvtierConfig, rank: int) -> Any:
    engine = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, rank=rank), model_config=None)
    return identity_from(cfg, read_settings(engine))


def run_tp_step(sched: TieredConnector, workers: list[TieredConnector], out: SchedulerOutput,
                sending: dict[str, int]) -> KVConnectorOutput:
    """One engine step with every rank executing the same metadata; outputs merged as vLLM's aggregator does (a
    request is finished sending once every rank reported it; stats and worker reports aggregated)."""
    meta = pickle.dumps(sched.build_connector_meta(out))
    merged = KVConnectorOutput(set(), set(), None, set())
    for w in workers:
        w.bind_connector_metadata(pickle.loads(meta))
        w.start_load_kv(None)
        w.wait_for_save()
        done, _ = w.get_finished(out.finished_req_ids)
        for req_id in done or ():
            sending[req_id] = sending.get(req_id, 0) + 1
        stats = w.get_kv_connector_stats()
        if stats is not None:
            merged.kv_connector_stats = stats if merged.kv_connector_stats is None else \
                merged.kv_connector_stats.aggregate(stats)
        report = w.build_connector_worker_meta()
        if report is not None:
            merged.kv_connector_worker_meta = report if merged.kv_connector_worker_meta is None else \
                merged.kv_connector_worker_meta.aggregate(report)
        w.clear_connector_metadata()
    merged.finished_sending = {r for r, n in sending.items() if n == len(workers)}
    for req_id in merged.finished_sending:
        del sending[req_id]
    sched.update_connector_output(pickle.loads(pickle.dumps(merged)))
    return merged


def test_a_chunk_any_tensor_parallel_rank_failed_is_forgotten_and_leaves_the_others(tmp_path: Path) -> None:
    """Two ranks. Rank 1 cannot write the full-attention group, both ranks cannot write the window group: every
    chunk is forgotten (a chunk one rank lacks is no hit: its load would fail there, and the step computed on it
    would be wrong), and the full-attention records rank 0 wrote leave its disk at the next step."""
    cfg = cfg_for(tmp_path, ("disk",))
    spaces = [namespaces(tp_ident(cfg, r), KCC, C) for r in (0, 1)]
    for rank, group in ((1, 0), (0, 1), (1, 1)):
        (tmp_path / f"tp{rank}-of-2").mkdir(exist_ok=True)
        (tmp_path / f"tp{rank}-of-2" / spaces[rank][group].hex()).write_bytes(b"not a directory")
    sched, workers = tp_engine(cfg)
    sending: dict[str, int] = {}
    try:
        for r, w in enumerate(workers):
            w.register_kv_caches(paged(KCC, seed=30 + r))
        a = Request("A", A_TOKENS)
        sched.get_num_new_matched_tokens(a, 0)
        sched.update_state_after_alloc(a, KVCacheBlocks(A_BLOCKS), 0)
        outs = [run_tp_step(sched, workers, new_req(a, A_BLOCKS, 0), sending)]
        half = sched._sched()
        saved = half._inflight.planned("A")
        assert len(saved) == 2 * 5
        assert sched.request_finished_all_groups(a, A_BLOCKS) == (True, None)
        for w in workers:
            w.flush_saves()
        outs.append(run_tp_step(sched, workers, SchedulerOutput(finished_req_ids={"A"}), sending))
        assert outs[-1].finished_sending == {"A"}
        rows = [row for out in outs if out.kv_connector_worker_meta is not None
                for row in out.kv_connector_worker_meta.failed_saves]
        assert len(rows) == 5 + 2 * 5 and {row[3] for row in rows} == {"0", "1"}
        tracked = {key[:16]: [] for _, key in saved}
        for tier, key in saved:
            tracked[key[:16]].append(half.directory.contains(tier, key))
        assert tracked[spaces[0][0]] == [False] * 5  # full attention: rank 1 lacks it
        assert tracked[spaces[0][1]] == [False] * 5  # window: no rank holds it
        assert not half._inflight.failures("A") and not half._inflight.pending("A")
        full = [key for _, key in saved if key[:16] == spaces[0][0]]
        disk0 = workers[0]._store.tier("disk")
        assert workers[0]._loop.run(disk0.contains(full)) == [True] * 5
        run_tp_step(sched, workers, SchedulerOutput(), sending)  # the drops ship
        for w in workers:
            w.flush_saves()
        assert workers[0]._loop.run(disk0.contains(full)) == [False] * 5
    finally:
        sched.shutdown()
        for w in workers:
            w.shutdown()


def test_pipeline_parallelism_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    import pytest

    from kvtier.errors import ConnectorError

    vllm = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=2, rank=0),
                           model_config=None)
    with pytest.raises(ConnectorError, match="pipeline_parallel_size=2"):
        TieredConnector(vllm, KVConnectorRole.WORKER, KCC, kvtier_config=cfg_for(tmp_path))
