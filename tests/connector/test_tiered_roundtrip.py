"""Both halves of TieredConnector in one process, driven in vLLM's call order: request A's paged KV is saved,
request B sharing the prefix hits, and the worker loads it into B's (different) blocks bit for bit.

The halves talk only through pickled metadata and ``KVConnectorOutput``, as across vLLM's process boundary.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest
import torch
from roundtrip_helpers import (
    A_BLOCKS,
    A_TOKENS,
    B_BLOCKS,
    B_TOKENS,
    BS,
    KCC,
    NUM_BLOCKS,
    C,
    assert_loaded,
    cfg_for,
    new_req,
    paged,
    receive,
    step,
)

from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig, PolicyConfig, WritePolicy
from kvtier.connector.base import KVConnectorRole
from kvtier.connector.keying import identity_from, namespaces
from kvtier.connector.tiered import TieredConnector
from kvtier.engine.types import KVCacheBlocks, KVConnectorOutput, Request, SchedulerOutput
from kvtier.layout import simple_config
from kvtier.store.tiered import TieredStore
from kvtier.tiers.runtime import LoopThread


def save_request_a(sched: TieredConnector, work: TieredConnector) -> None:
    a = Request("A", A_TOKENS)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    sched.update_state_after_alloc(a, KVCacheBlocks(A_BLOCKS), 0)
    step(sched, work, new_req(a, A_BLOCKS, 0))
    assert sched.request_finished_all_groups(a, A_BLOCKS) == (True, None)
    work.flush_saves()  # every save of A is done
    out = step(sched, work, SchedulerOutput(finished_req_ids={"A"}))
    assert out.finished_sending == {"A"}


def test_roundtrip_from_a_memory_tier(tmp_path: Path) -> None:
    """Two KV-cache groups: the load is asynchronous even from memory (vLLM takes a failed load of such a model
    only per request, kvtier.connector.worker.loads)."""
    cfg = cfg_for(tmp_path)
    sched = TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
    try:
        kv = paged(KCC, seed=1)
        work.register_kv_caches(kv)
        save_request_a(sched, work)
        b = Request("B", B_TOKENS)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, True)
        sched.update_state_after_alloc(b, KVCacheBlocks(B_BLOCKS), 4 * C)
        null_before = {n: t[:, 0].clone() for n, t in kv.items()}
        counts = receive(sched, work, "B")
        assert counts["hits_cpu"] == 4 + 1  # 4 full-attention chunks + 1 window chunk
        assert_loaded(kv, kv, 8)
        assert all(torch.equal(kv[n][:, 0], null_before[n]) for n in kv)
    finally:
        sched.shutdown()
        work.shutdown()


def test_roundtrip_after_restart_loads_asynchronously_from_disk(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path)
    sched = TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
    kv_a = paged(KCC, seed=2)
    work.register_kv_caches(kv_a)
    save_request_a(sched, work)
    sched.shutdown()
    work.shutdown()
    # A new engine over the same disk directory: the cpu pool is empty, the disk records are adopted.
    sched = TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
    try:
        kv_b = paged(KCC, seed=3)
        work.register_kv_caches(kv_b)
        b = Request("B", B_TOKENS)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, True)
        sched.update_state_after_alloc(b, KVCacheBlocks(B_BLOCKS), 4 * C)
        receive(sched, work, "B")
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
    sched = TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC, store=store, loop=loop)
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, KCC, store=store, loop=loop)
    try:
        kv = paged(KCC, seed=4)
        work.register_kv_caches(kv)
        save_request_a(sched, work)
        b = Request("B", B_TOKENS)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, True)
        sched.update_state_after_alloc(b, KVCacheBlocks(B_BLOCKS), 4 * C)
        receive(sched, work, "B")
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
    sched = TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, kcc)
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, kcc)
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


def test_a_save_the_worker_could_not_store_is_forgotten_by_the_scheduler(tmp_path: Path) -> None:
    """The worker's disk tier cannot write (a file stands where a namespace directory goes): the worker reports
    the chunks in its stats, the scheduler forgets them instead of marking them READY, and a request sharing the
    prefix misses instead of planning a load that would fail."""
    cfg = cfg_for(tmp_path, ("disk",))
    for space in namespaces(identity_from(cfg, None, tp_rank=0), KCC, C):
        (tmp_path / space.hex()).write_bytes(b"not a directory")
    sched = TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
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


@pytest.mark.parametrize("tiers", [("cpu",), ("disk",)])
def test_a_request_hits_the_chunks_of_one_still_running(tiers: tuple[str, ...], tmp_path: Path) -> None:
    """A's prefill saves its chunks; A goes on decoding (not finished). B, sent meanwhile, hits them as soon as they
    are planned (the worker's read waits for its write, issue 32), and once the worker reports them written: it
    loads A's KV bit for bit (from the cpu pool: written in A's step; from disk: in the background, reported at a
    later step)."""
    cfg = cfg_for(tmp_path, tiers)
    sched = TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
    try:
        kv = paged(KCC, seed=5)
        work.register_kv_caches(kv)
        a, b = Request("A", A_TOKENS), Request("B", B_TOKENS)
        sched.get_num_new_matched_tokens(a, 0)
        sched.update_state_after_alloc(a, KVCacheBlocks(A_BLOCKS), 0)
        meta = sched.build_connector_meta(new_req(a, A_BLOCKS, 0))  # planned, not yet written
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, True)
        work.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
        work.start_load_kv(None)
        work.wait_for_save()
        work.flush_saves()  # A's writes are done; the scheduler has not heard of them yet
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, True)
        report = work.build_connector_worker_meta()
        work.get_kv_connector_stats()  # this step's counts: not checked here
        work.clear_connector_metadata()
        assert report is not None and len(report.stored_saves) == 2 * 5  # 5 chunks per group
        sched.update_connector_output(pickle.loads(pickle.dumps(KVConnectorOutput(kv_connector_worker_meta=report))))
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, True)  # A is still running
        sched.update_state_after_alloc(b, KVCacheBlocks(B_BLOCKS), 4 * C)
        receive(sched, work, "B")
        assert_loaded(kv, kv, 8)
        assert sched.request_finished_all_groups(a, A_BLOCKS) == (True, None)
        assert step(sched, work, SchedulerOutput(finished_req_ids={"A"})).finished_sending == {"A"}
        assert sched.get_num_new_matched_tokens(Request("C", B_TOKENS), 0) == (4 * C, True)
    finally:
        sched.shutdown()
        work.shutdown()
