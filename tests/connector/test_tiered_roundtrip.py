"""Both halves of KVTierConnector in one process, driven in vLLM's call order: request A's paged KV is saved,
request B sharing the prefix hits, and the worker loads it into B's (different) blocks bit for bit.

The halves talk only through pickled metadata and ``KVConnectorOutput``, as across vLLM's process boundary.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig, PolicyConfig, WritePolicy
from kvtier.connector.base import KVConnectorRole
from kvtier.connector.keying import identity_from, namespaces
from kvtier.connector.tiered import KVTierConnector
from kvtier.connector.types import KVCacheBlocks, KVConnectorOutput, NewRequestData, Request, SchedulerOutput
from kvtier.layout import KVCacheConfig, simple_config
from kvtier.runtime import LoopThread
from kvtier.store import TieredStore

C, BS, NUM_BLOCKS = 8, 4, 64
KCC = simple_config(3, 2, 4, dtype="float32", block_size=BS, sliding_window=8, swa_layers=[1], num_blocks=NUM_BLOCKS)
PREFIX = list(range(500, 532))  # 4 chunks
A_TOKENS = [*PREFIX, *range(900, 909)]  # 41 tokens
B_TOKENS = [*PREFIX, *range(700, 709)]
A_BLOCKS = (list(range(1, 12)), list(range(12, 23)))
B_BLOCKS = (list(range(30, 41)), [0, 0, 0, 0, 0, 0, 47, 48, 49, 50, 51])  # SWA: out-of-window blocks null


def cfg_for(tmp: Path, tiers: tuple[str, ...] = ("cpu", "disk")) -> KvtierConfig:
    all_tiers = {"cpu": CpuTierConfig("cpu", 1 << 20), "disk": DiskTierConfig("disk", 1 << 22, path=str(tmp))}
    return KvtierConfig(chunk_size=C, tiers=tuple(all_tiers[t] for t in tiers),
                        policy=PolicyConfig(eviction="lru", write=WritePolicy.WRITE_THROUGH))


def paged(kcc: KVCacheConfig, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(2, NUM_BLOCKS, BS, 2, 4, generator=g)
            for group in kcc.kv_cache_groups for name in group.layer_names}


def step(sched: KVTierConnector, work: KVTierConnector, out: SchedulerOutput) -> KVConnectorOutput:
    """One engine step: schedule -> worker (bind, load, save, report) -> scheduler learns the output."""
    meta = pickle.loads(pickle.dumps(sched.build_connector_meta(out)))
    work.bind_connector_metadata(meta)
    work.start_load_kv(None)
    work.wait_for_save()
    sending, recving = work.get_finished(out.finished_req_ids)
    result = KVConnectorOutput(sending, recving, work.get_kv_connector_stats(), work.get_block_ids_with_load_errors(),
                               work.build_connector_worker_meta())
    work.clear_connector_metadata()
    result = pickle.loads(pickle.dumps(result))
    if not result.is_empty():
        sched.update_connector_output(result)
    return result


def new_req(req: Request, blocks: tuple[list[int], ...], computed: int) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=[NewRequestData(req.request_id, req.prompt_token_ids, blocks, computed)],
                           num_scheduled_tokens={req.request_id: req.num_tokens - computed})


def save_request_a(sched: KVTierConnector, work: KVTierConnector) -> None:
    a = Request("A", A_TOKENS)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    sched.update_state_after_alloc(a, KVCacheBlocks(A_BLOCKS), 0)
    step(sched, work, new_req(a, A_BLOCKS, 0))
    assert sched.request_finished_all_groups(a, A_BLOCKS) == (True, None)
    work.flush_saves()  # every save of A is done
    out = step(sched, work, SchedulerOutput(finished_req_ids={"A"}))
    assert out.finished_sending == {"A"}


def assert_loaded(kv_a: dict[str, torch.Tensor], kv_b: dict[str, torch.Tensor], hit_blocks: int) -> None:
    full, swa = KCC.kv_cache_groups
    for name in full.layer_names:  # every block of the hit
        assert torch.equal(kv_b[name][:, B_BLOCKS[0][:hit_blocks]], kv_a[name][:, A_BLOCKS[0][:hit_blocks]])
    for name in swa.layer_names:  # only the window before the hit point
        assert torch.equal(kv_b[name][:, B_BLOCKS[1][6:hit_blocks]], kv_a[name][:, A_BLOCKS[1][6:hit_blocks]])


def test_roundtrip_from_memory_tier_is_synchronous(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path)
    sched = KVTierConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = KVTierConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
    try:
        kv = paged(KCC, seed=1)
        work.register_kv_caches(kv)
        save_request_a(sched, work)
        b = Request("B", B_TOKENS)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, False)
        sched.update_state_after_alloc(b, KVCacheBlocks(B_BLOCKS), 4 * C)
        null_before = {n: t[:, 0].clone() for n, t in kv.items()}
        out = step(sched, work, new_req(b, B_BLOCKS, 4 * C))
        assert not out.invalid_block_ids
        assert out.kv_connector_stats.data["hits_cpu"] == 4 + 1  # 4 full-attention chunks + 1 window chunk
        assert_loaded(kv, kv, 8)
        assert all(torch.equal(kv[n][:, 0], null_before[n]) for n in kv)
    finally:
        sched.shutdown()
        work.shutdown()


def test_roundtrip_after_restart_loads_asynchronously_from_disk(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path)
    sched = KVTierConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = KVTierConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
    kv_a = paged(KCC, seed=2)
    work.register_kv_caches(kv_a)
    save_request_a(sched, work)
    sched.shutdown()
    work.shutdown()
    # A new engine over the same disk directory: the cpu pool is empty, the disk records are adopted.
    sched = KVTierConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = KVTierConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
    try:
        kv_b = paged(KCC, seed=3)
        work.register_kv_caches(kv_b)
        b = Request("B", B_TOKENS)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, True)
        sched.update_state_after_alloc(b, KVCacheBlocks(B_BLOCKS), 4 * C)
        received: set[str] = set()
        for _ in range(500):
            out = step(sched, work, SchedulerOutput())
            assert not out.invalid_block_ids
            received |= out.finished_recving or set()
            if received:
                break
            time.sleep(0.01)
        assert received == {"B"}
        sched.update_state_after_alloc(b, KVCacheBlocks(B_BLOCKS), 0)  # second call: no-op
        step(sched, work, new_req(b, B_BLOCKS, 4 * C))
        assert_loaded(kv_a, kv_b, 8)
    finally:
        sched.shutdown()
        work.shutdown()


def test_shared_store_in_one_process(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path, ("cpu",))
    loop = LoopThread()
    store = TieredStore.from_config(cfg)
    loop.run(store.start())
    sched = KVTierConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC, store=store, loop=loop)
    work = KVTierConnector.from_config(cfg, KVConnectorRole.WORKER, KCC, store=store, loop=loop)
    try:
        kv = paged(KCC, seed=4)
        work.register_kv_caches(kv)
        save_request_a(sched, work)
        b = Request("B", B_TOKENS)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, False)
        sched.update_state_after_alloc(b, KVCacheBlocks(B_BLOCKS), 4 * C)
        step(sched, work, new_req(b, B_BLOCKS, 4 * C))
        assert_loaded(kv, kv, 8)
    finally:
        sched.shutdown()
        work.shutdown()
        loop.run(store.close())
        loop.close()


def test_write_back_demotes_to_disk_and_loads_from_both(tmp_path: Path) -> None:
    kcc = simple_config(2, 2, 4, dtype="float32", block_size=BS, num_blocks=NUM_BLOCKS)
    cfg = KvtierConfig(chunk_size=C, tiers=(CpuTierConfig("cpu", 2 * 4096),  # two 4 KiB slots
                                            DiskTierConfig("disk", 1 << 22, path=str(tmp_path))),
                       policy=PolicyConfig(eviction="lru", write=WritePolicy.WRITE_BACK))
    sched = KVTierConnector.from_config(cfg, KVConnectorRole.SCHEDULER, kcc)
    work = KVTierConnector.from_config(cfg, KVConnectorRole.WORKER, kcc)
    try:
        kv = paged(kcc, seed=5)
        work.register_kv_caches(kv)
        a = Request("A", A_TOKENS)
        sched.get_num_new_matched_tokens(a, 0)
        meta_out = new_req(a, (A_BLOCKS[0],), 0)
        step(sched, work, meta_out)
        assert sched.request_finished(a, A_BLOCKS[0]) == (True, None)
        work.flush_saves()
        assert step(sched, work, SchedulerOutput(finished_req_ids={"A"})).finished_sending == {"A"}
        b = Request("B", B_TOKENS)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, True)  # part of it now lives on disk
        sched.update_state_after_alloc(b, KVCacheBlocks((B_BLOCKS[0],)), 4 * C)
        tiers_used: set[str] = set()
        for _ in range(500):
            out = step(sched, work, SchedulerOutput())
            assert not out.invalid_block_ids
            if out.kv_connector_stats:
                tiers_used |= {k for k in out.kv_connector_stats.data if k.startswith("hits_")}
            if out.finished_recving:
                break
            time.sleep(0.01)
        assert tiers_used == {"hits_cpu", "hits_disk"}
        for name in kcc.kv_cache_groups[0].layer_names:
            assert torch.equal(kv[name][:, B_BLOCKS[0][:8]], kv[name][:, A_BLOCKS[0][:8]])
    finally:
        sched.shutdown()
        work.shutdown()


def tp_engine(cfg: KvtierConfig) -> tuple[KVTierConnector, list[KVTierConnector]]:
    """A scheduler and the workers of two tensor-parallel ranks, as vLLM builds them (ranks from the engine's
    parallel config), all with the same kvtier config."""
    def vllm(rank: int) -> Any:
        return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, rank=rank), model_config=None)

    sched = KVTierConnector(vllm(0), KVConnectorRole.SCHEDULER, KCC, kvtier_config=cfg)
    return sched, [KVTierConnector(vllm(r), KVConnectorRole.WORKER, KCC, kvtier_config=cfg) for r in (0, 1)]


def test_tensor_parallel_ranks_keep_their_disk_records_apart(tmp_path: Path) -> None:
    """Each rank stores its own shard of every chunk in its own subdirectory of the disk path; after a restart
    the scheduler adopts rank 0's records only, and every rank loads its own KV back."""
    cfg = cfg_for(tmp_path, ("disk",))
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


def test_a_save_the_worker_could_not_store_is_forgotten_by_the_scheduler(tmp_path: Path) -> None:
    """The worker's disk tier cannot write (a file stands where a namespace directory goes): the worker reports
    the chunks in its stats, the scheduler forgets them instead of marking them READY, and a request sharing the
    prefix misses instead of planning a load that would fail."""
    cfg = cfg_for(tmp_path, ("disk",))
    for space in namespaces(identity_from(cfg, None, tp_rank=0), KCC, C):
        (tmp_path / space.hex()).write_bytes(b"not a directory")
    sched = KVTierConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = KVTierConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
    try:
        work.register_kv_caches(paged(KCC, seed=4))
        a = Request("A", A_TOKENS)
        sched.get_num_new_matched_tokens(a, 0)
        sched.update_state_after_alloc(a, KVCacheBlocks(A_BLOCKS), 0)
        outs = [step(sched, work, new_req(a, A_BLOCKS, 0))]
        assert sched.request_finished_all_groups(a, A_BLOCKS) == (True, None)
        work.flush_saves()
        outs.append(step(sched, work, SchedulerOutput(finished_req_ids={"A"})))
        assert outs[-1].finished_sending == {"A"}
        reported = [row for out in outs if out.kv_connector_worker_meta is not None
                    for row in out.kv_connector_worker_meta.failed_saves]
        assert len(reported) == 2 * 5 and {row[0] for row in reported} == {"A"}  # both groups, 5 chunks each
        b = Request("B", B_TOKENS)
        assert sched.get_num_new_matched_tokens(b, 0) == (0, False)
    finally:
        sched.shutdown()
        work.shutdown()


def test_worker_reports_aggregate_over_ranks_and_reach_each_child_of_a_multi_connector() -> None:
    """The report travels through the worker-metadata hook: aggregated over ranks by the engine, split per child
    by a multi connector (each child sees its own), never through stats."""
    from kvtier.connector.multi import MultiConnector
    from kvtier.connector.report import ChildReports, WorkerReport

    key = bytes(range(32))
    rank0 = WorkerReport([("A", "disk", key, "0")])
    rank1 = WorkerReport([("A", "disk", key, "1")], disabled=True)
    merged = rank0.aggregate(rank1)
    assert merged.failed_saves == [("A", "disk", key, "0"), ("A", "disk", key, "1")] and merged.disabled
    assert not WorkerReport() and pickle.loads(pickle.dumps(merged)) == merged
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
    return identity_from(cfg, SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, rank=rank),
                                              model_config=None))


def run_tp_step(sched: KVTierConnector, workers: list[KVTierConnector], out: SchedulerOutput,
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


def test_a_chunk_is_forgotten_only_when_every_tensor_parallel_rank_failed_it(tmp_path: Path) -> None:
    """Two ranks. Rank 1 cannot write the full-attention group, both ranks cannot write the window group: the
    full-attention chunks, held by rank 0, stay tracked (evictable from rank 0's tiers; rank 1's later load of
    one is reported and recomputed); the window chunks, held by no rank, are forgotten."""
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
        saved = list(half._saving["A"])
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
        assert tracked[spaces[0][0]] == [True] * 5  # full attention: rank 0 holds it
        assert tracked[spaces[0][1]] == [False] * 5  # window: no rank holds it
        assert not half._save_failures
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
        KVTierConnector(vllm, KVConnectorRole.WORKER, KCC, kvtier_config=cfg_for(tmp_path))
