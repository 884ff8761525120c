"""TieredConnector's worker half, set-up and reports: finished reports wait for the request and its saves, saves of
a step without a forward pass, pickling of metadata and stats, methods of the other role, configs from the engine,
and KV tensors kvtier cannot read (disabled, or an error in strict mode). Loads and bounded waits:
test_worker_half.py.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from worker_kit import A_IDS, BS, KCC, NB, TOKENS, C, Engine, make_cfg, paged

from kvtier.config import CpuTierConfig
from kvtier.connector.base import KVConnectorRole
from kvtier.connector.tiered import TieredConnector
from kvtier.connector.worker.half import WorkerHalf
from kvtier.engine.types import NewRequestData, Request, SchedulerOutput
from kvtier.errors import ConnectorError
from kvtier.store.assembly import Role
from kvtier.store.tiered import TieredStore
from kvtier.tiers.memory.cpu import CpuTier
from kvtier.tiers.runtime import LoopThread


def test_finished_sending_waits_for_finish_and_saves(tmp_path: Path) -> None:
    eng = Engine(make_cfg(tmp_path, ("cpu",)), paged(4))
    try:
        a = Request("A", TOKENS)
        eng.sched.get_num_new_matched_tokens(a, 0)
        out = eng.run_prefill(a, A_IDS)
        assert out.finished_sending is None  # saves may be done, but A has not finished
        assert out.kv_connector_stats is not None
        assert eng.sched.request_finished(a, A_IDS) == (True, None)
        eng.work.flush_saves()
        assert eng.step(SchedulerOutput(finished_req_ids={"A"})).finished_sending == {"A"}
        assert eng.step(SchedulerOutput()).finished_sending is None  # reported once
    finally:
        eng.close()


def test_saves_of_a_step_without_forward_run_at_get_finished(tmp_path: Path) -> None:
    eng = Engine(make_cfg(tmp_path, ("cpu",)), paged(5))
    try:
        a = Request("A", TOKENS)
        eng.sched.get_num_new_matched_tokens(a, 0)
        eng.run_prefill(a, A_IDS, save=False)
        eng.work.flush_saves()
        eng.sched.request_finished(a, A_IDS)
        assert eng.step(SchedulerOutput(finished_req_ids={"A"})).finished_sending == {"A"}
        assert eng.sched.get_num_new_matched_tokens(Request("B", TOKENS), 0) == (4 * C, False)
    finally:
        eng.close()


def test_metadata_and_stats_pickle(tmp_path: Path) -> None:
    eng = Engine(make_cfg(tmp_path, ("cpu",)), paged(6))
    try:
        a = Request("A", TOKENS)
        eng.sched.get_num_new_matched_tokens(a, 0)
        out = SchedulerOutput(scheduled_new_reqs=[NewRequestData("A", TOKENS, (A_IDS,), 0)],
                              num_scheduled_tokens={"A": 40})
        meta = eng.sched.build_connector_meta(out)
        assert pickle.loads(pickle.dumps(meta)) == meta
        eng.work.bind_connector_metadata(meta)
        eng.work.start_load_kv(None)
        eng.work.wait_for_save()
        eng.work.flush_saves()
        stats = eng.work.get_kv_connector_stats()
        assert stats is not None and stats.data["save_chunks"] == 5
        assert pickle.loads(pickle.dumps(stats)).data == stats.data
        assert eng.work.get_kv_connector_stats() is None  # stats are per-step deltas
    finally:
        eng.close()


def test_methods_of_the_other_role_are_refused(tmp_path: Path) -> None:
    eng = Engine(make_cfg(tmp_path, ("cpu",)), paged(7))
    try:
        with pytest.raises(ConnectorError):
            eng.work.get_num_new_matched_tokens(Request("x", TOKENS), 0)
        with pytest.raises(ConnectorError):
            eng.sched.start_load_kv(None)
    finally:
        eng.close()


def test_kv_cache_config_none_derives_one_group(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, ("cpu",))
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, None)
    try:
        work.register_kv_caches(paged(8))
        assert work._worker is not None and work._worker.kcc is not None
        assert len(work._worker.kcc.kv_cache_groups[0].layer_names) == 2
    finally:
        work.shutdown()


def test_built_from_the_engine_extra_config(tmp_path: Path) -> None:
    conf = tmp_path / "kvtier.yaml"
    conf.write_text("chunk_size: 16\ntiers:\n  - {name: cpu, kind: cpu, capacity: 1MiB}\n")
    extra = {"config_file": str(conf), "chunk_size": C}  # the engine's keys override the file
    engine = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    for role in KVConnectorRole:
        conn = TieredConnector(engine, role, KCC)
        try:
            assert conn.kvtier_config.chunk_size == C
            assert [t.name for t in conn.kvtier_config.tiers] == ["cpu"]
            assert conn._kv_cache_config is KCC
        finally:
            conn.shutdown()


def test_a_paged_layout_that_disagrees_with_the_config_disables_kvtier_or_fails_in_strict_mode(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    heads_first = {n: torch.zeros(2, NB, 2, BS, 4) for n in KCC.kv_cache_groups[0].layer_names}
    work = TieredConnector.from_config(make_cfg(tmp_path, ("cpu",)), KVConnectorRole.WORKER, KCC)
    try:
        with caplog.at_level("ERROR"):
            work.register_kv_caches(heads_first)  # the engine still starts
        worker = work._worker
        assert worker is not None and worker.disabled is not None and "heads" in worker.disabled
        assert worker.disabled.endswith("Set strict: true in kvtier's config to fail at start instead")
        assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
            f"kvtier is disabled for this engine (it serves without the cache): {worker.disabled}"]
        stats, report = work.get_kv_connector_stats(), work.build_connector_worker_meta()
        assert stats is not None and stats.data["kvtier_disabled"] == 1
        assert report is not None and report.disabled and work.build_connector_worker_meta() is None  # said once
    finally:
        work.shutdown()
    strict = dataclasses.replace(make_cfg(tmp_path, ("cpu",)), strict=True)
    work = TieredConnector.from_config(strict, KVConnectorRole.WORKER, KCC)
    try:
        with pytest.raises(ConnectorError, match="heads"):
            work.register_kv_caches(heads_first)
    finally:
        work.shutdown()


def test_a_group_of_mixed_layer_specs_disables_kvtier_on_the_worker() -> None:
    """vLLM hands the scheduler the first layer's spec of such a group: the worker must refuse it, not crash."""
    from kvtier.layout import KVCacheConfig, KVCacheGroupSpec, OtherSpec

    mixed = KVCacheConfig((KVCacheGroupSpec(KCC.kv_cache_groups[0].layer_names,
                                            OtherSpec(BS, name="UniformTypeKVCacheSpecs(mixed)")),), NB)
    loop = LoopThread()
    store = TieredStore([CpuTier(CpuTierConfig("cpu", 1 << 20))], None, role=Role.WORKER)
    loop.run(store.start())
    worker = WorkerHalf(mixed, store, loop, chunk_size=C)
    try:
        worker.register_kv_caches(paged(1))
        assert worker.disabled is not None and "different specs" in worker.disabled
    finally:
        worker.close()
        loop.run(store.close())
        loop.close()
