"""Helpers of the two-halves tests (test_tiered_roundtrip.py, test_tiered_parallel.py): the KV-cache config, the
requests A and B sharing a prefix and their blocks, paged KV tensors, and one engine step driven in vLLM's call
order with pickled metadata and outputs."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import torch

from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig, PolicyConfig, WritePolicy
from kvtier.connector.tiered import TieredConnector
from kvtier.engine.types import KVConnectorOutput, NewRequestData, Request, SchedulerOutput
from kvtier.layout import KVCacheConfig, simple_config

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


def step(sched: TieredConnector, work: TieredConnector, out: SchedulerOutput) -> KVConnectorOutput:
    """One engine step: schedule -> worker (bind, load, save, report) -> scheduler learns the output."""
    meta = pickle.loads(pickle.dumps(sched.build_connector_meta(out)))
    work.bind_connector_metadata(meta)
    work.start_load_kv(None)
    work.wait_for_save()
    results = work.get_transfer_results(out.finished_req_ids)
    result = KVConnectorOutput(results.finished_sending or None, results.finished_recving or None,
                               work.get_kv_connector_stats(), work.get_block_ids_with_load_errors(),
                               work.build_connector_worker_meta(), failed_recving=results.failed_recving)
    work.clear_connector_metadata()
    result = pickle.loads(pickle.dumps(result))
    if not result.is_empty():
        sched.update_connector_output(result)
    return result


def new_req(req: Request, blocks: tuple[list[int], ...], computed: int) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=[NewRequestData(req.request_id, req.prompt_token_ids, blocks, computed)],
                           num_scheduled_tokens={req.request_id: req.num_tokens - computed})


def assert_loaded(kv_a: dict[str, torch.Tensor], kv_b: dict[str, torch.Tensor], hit_blocks: int) -> None:
    full, swa = KCC.kv_cache_groups
    for name in full.layer_names:  # every block of the hit
        assert torch.equal(kv_b[name][:, B_BLOCKS[0][:hit_blocks]], kv_a[name][:, A_BLOCKS[0][:hit_blocks]])
    for name in swa.layer_names:  # only the window before the hit point
        assert torch.equal(kv_b[name][:, B_BLOCKS[1][6:hit_blocks]], kv_a[name][:, A_BLOCKS[1][6:hit_blocks]])


def receive(sched: TieredConnector, work: TieredConnector, req_id: str) -> dict[str, float]:
    """Empty steps until ``req_id``'s asynchronous load is reported done; the load counters of those steps."""
    counts: dict[str, float] = {}
    for _ in range(500):
        out = step(sched, work, SchedulerOutput())
        assert not out.invalid_block_ids and not out.failed_recving
        for key, value in (out.kv_connector_stats.data if out.kv_connector_stats else {}).items():
            counts[key] = counts.get(key, 0) + value
        if req_id in (out.finished_recving or set()):
            return counts
        time.sleep(0.01)
    raise AssertionError(f"the load of {req_id} never finished")
