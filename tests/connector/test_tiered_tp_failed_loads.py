"""A synchronous load that fails on one tensor-parallel rank (the other holds the record): nothing computed on
top of it is served, from either rank, and the recompute stores the right KV on both (issue 31, part 1)."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvtier.config import CpuTierConfig, KvtierConfig, PolicyConfig, WritePolicy
from kvtier.connector.base import KVConnectorRole
from kvtier.connector.keying import identity_from, namespaces, rank_key
from kvtier.connector.report import WorkerReport
from kvtier.connector.settings import read_settings
from kvtier.connector.tiered import TieredConnector
from kvtier.engine.types import (
    CachedRequestData,
    KVCacheBlocks,
    KVConnectorOutput,
    NewRequestData,
    Request,
    SchedulerOutput,
)
from kvtier.layout import simple_config
from kvtier.records.keys import Key

C, BS, NUM_BLOCKS = 8, 4, 64
KCC = simple_config(2, 2, 4, dtype="float32", block_size=BS, num_blocks=NUM_BLOCKS)  # one group: loads are sync
PREFIX = list(range(500, 532))  # 4 chunks
A_TOKENS, B_TOKENS = [*PREFIX, *range(900, 909)], [*PREFIX, *range(700, 709)]  # 41 tokens: 5 whole chunks
A_BLOCKS, B_BLOCKS, C_BLOCKS = (list(range(1, 12)),), (list(range(30, 41)),), (list(range(45, 56)),)
CFG = KvtierConfig(chunk_size=C, tiers=(CpuTierConfig("cpu", 1 << 20),),
                   policy=PolicyConfig(eviction="lru", write=WritePolicy.WRITE_BACK))


def vllm(rank: int) -> Any:
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, rank=rank), model_config=None)


def engine() -> tuple[TieredConnector, list[TieredConnector], list[dict[str, torch.Tensor]]]:
    sched = TieredConnector(vllm(0), KVConnectorRole.SCHEDULER, KCC, kvtier_config=CFG)
    workers = [TieredConnector(vllm(r), KVConnectorRole.WORKER, KCC, kvtier_config=CFG) for r in (0, 1)]
    kvs = []
    for r, w in enumerate(workers):
        g = torch.Generator().manual_seed(10 + r)
        kvs.append({n: torch.randn(2, NUM_BLOCKS, BS, 2, 4, generator=g) for n in KCC.kv_cache_groups[0].layer_names})
        w.register_kv_caches(kvs[-1])
    return sched, workers, kvs


def run_step(sched: TieredConnector, workers: list[TieredConnector], out: SchedulerOutput) -> KVConnectorOutput:
    """One step on both ranks; the output aggregated over them (as vLLM's KVOutputAggregator), delivered."""
    meta = pickle.dumps(sched.build_connector_meta(out))
    invalid: set[int] = set()
    report = WorkerReport()
    for w in workers:
        w.bind_connector_metadata(pickle.loads(meta))
        w.start_load_kv(None)
        w.wait_for_save()
        w.flush_saves()
        w.get_finished(set())
        invalid |= w.get_block_ids_with_load_errors()
        report = report.aggregate(w.build_connector_worker_meta() or WorkerReport())
        w.get_kv_connector_stats()
        w.clear_connector_metadata()
    output = KVConnectorOutput(invalid_block_ids=invalid, kv_connector_worker_meta=report)
    sched.update_connector_output(pickle.loads(pickle.dumps(output)))
    return output


def new(req: Request, blocks: tuple[list[int], ...], computed: int) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=[NewRequestData(req.request_id, req.prompt_token_ids, blocks, computed)],
                           num_scheduled_tokens={req.request_id: req.num_tokens - computed})


def records(workers: list[TieredConnector], keys: list[Key]) -> list[list[torch.Tensor | None]]:
    """What each rank's cpu pool holds for ``keys`` (rank 0's), under its own keys (None: nothing)."""
    out = []
    for r, w in enumerate(workers):
        space = namespaces(identity_from(CFG, read_settings(vllm(r))), KCC, C)[0]
        pool = w._store.tier("cpu").pool
        out.append([None if (v := pool.view(rank_key(k, space))) is None else v.clone() for k in keys])
    return out


def blocks_of(kv: dict[str, torch.Tensor], blocks: list[int]) -> torch.Tensor:
    return torch.stack([kv[n][:, blocks] for n in KCC.kv_cache_groups[0].layer_names])


def test_a_load_failed_on_one_rank_drops_what_both_computed_on_it(tmp_path: Path) -> None:
    sched, workers, kvs = engine()
    try:
        a = Request("A", A_TOKENS)
        sched.get_num_new_matched_tokens(a, 0)
        sched.update_state_after_alloc(a, KVCacheBlocks(A_BLOCKS), 0)
        run_step(sched, workers, new(a, A_BLOCKS, 0))
        a_keys = sched._sched()._requests["A"].keys[0]
        assert all(v is not None for rank in records(workers, a_keys) for v in rank)  # 5 chunks on both ranks
        space1 = namespaces(identity_from(CFG, read_settings(vllm(1))), KCC, C)[0]
        pool1 = workers[1]._store.tier("cpu")
        assert workers[1]._loop.run(pool1.delete([rank_key(a_keys[1], space1)])) == 1  # rank 1 lost chunk 1

        b = Request("B", B_TOKENS)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, False)  # synchronous: a cpu tier, one group
        sched.update_state_after_alloc(b, KVCacheBlocks(B_BLOCKS), 4 * C)
        b_keys = sched._sched()._requests["B"].keys[0]
        out = run_step(sched, workers, new(b, B_BLOCKS, 4 * C))  # loads chunks 0-3, computes and saves chunk 4
        assert out.invalid_block_ids == set(B_BLOCKS[0][2:4])  # chunk 1's blocks, from rank 1
        directory = sched._sched().directory
        assert not directory.holds("cpu", b_keys[4]) and not directory.holds("cpu", b_keys[1])
        held = records(workers, [b_keys[4]])
        assert held[0][0] is not None and held[1] == [None]  # rank 1 wrote nothing on its failed load

        run_step(sched, workers, SchedulerOutput())  # the drops ship before anything else
        assert records(workers, [b_keys[1], b_keys[4]]) == [[None, None], [None, None]]  # gone from both ranks

        for kv in kvs:  # the recompute: chunks 1-3 as A computed them (same tokens), chunk 4 unlike the failed step's
            for name in kv:
                kv[name][:, B_BLOCKS[0][2:8]] = kv[name][:, A_BLOCKS[0][2:8]]
                kv[name][:, B_BLOCKS[0][8:10]] = torch.randn_like(kv[name][:, B_BLOCKS[0][8:10]])
        cached = CachedRequestData(["B"], set(), [None], [C])  # the engine recomputes from the failed chunk
        run_step(sched, workers, SchedulerOutput(scheduled_cached_reqs=cached,
                                                 num_scheduled_tokens={"B": len(B_TOKENS) - C}))
        assert [directory.contains("cpu", k) for k in b_keys[:5]] == [True] * 5

        c = Request("C", [*B_TOKENS[:5 * C], 1])  # hits B's 5 chunks: each rank gets the recomputed KV
        assert sched.get_num_new_matched_tokens(c, 0) == (5 * C, False)
        sched.update_state_after_alloc(c, KVCacheBlocks(C_BLOCKS), 5 * C)
        assert not run_step(sched, workers, new(c, C_BLOCKS, 5 * C)).invalid_block_ids
        for kv in kvs:
            assert torch.equal(blocks_of(kv, C_BLOCKS[0][:10]), blocks_of(kv, B_BLOCKS[0][:10]))
    finally:
        sched.shutdown()
        for w in workers:
            w.shutdown()
