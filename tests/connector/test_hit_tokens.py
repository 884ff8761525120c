"""What ``kvtier_hit_tokens_total`` counts (``loaded_tokens:<tier>:<group>`` in the worker's stats): the tokens whose
KV a load wrote into the engine's blocks, the number vLLM counts as ``external_kv_transfer`` for the request (the
tokens the connector returned past the engine's own). When the engine's own prefix cache ends inside a chunk, the
chunk is loaded with the blocks the engine holds left null, and only its other blocks' tokens count (before: the
whole chunk, so kvtier's count ran above vLLM's under concurrency, where vLLM's cache often ends mid-chunk)."""

from __future__ import annotations

from pathlib import Path

import torch
from roundtrip_helpers import BS, NUM_BLOCKS, C, new_req, step

from kvtier.config import CpuTierConfig, KvtierConfig, PolicyConfig
from kvtier.config.tree import TierKind
from kvtier.connector.base import KVConnectorRole
from kvtier.connector.tiered import TieredConnector
from kvtier.engine.types import KVCacheBlocks, Request, SchedulerOutput
from kvtier.layout import simple_config

KCC = simple_config(2, 2, 4, dtype="float32", block_size=BS, num_blocks=NUM_BLOCKS)
PREFIX = list(range(500, 532))  # 4 chunks of 8 tokens, 8 blocks of 4
A = [*PREFIX, *range(900, 909)]
B = [*PREFIX, *range(700, 709)]


def test_a_chunk_the_engine_partly_holds_counts_only_the_tokens_loaded(tmp_path: Path) -> None:
    """The engine holds B's first 3 blocks (12 tokens: its prefix cache ends inside chunk 1): kvtier's hit is 4
    chunks, 20 tokens past the engine's; it loads chunks 1-3 (chunk 1 without its first block) and counts 20, the
    tokens it returned to the engine and reports as the hit's sources; A's own uncut loads count whole chunks."""
    cfg = KvtierConfig(chunk_size=C, tiers=(CpuTierConfig("cpu", 1 << 20),), policy=PolicyConfig(eviction="lru"))
    sched = TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
    g = torch.Generator().manual_seed(5)
    kv = {n: torch.randn(2, NUM_BLOCKS, BS, 2, 4, generator=g) for n in KCC.kv_cache_groups[0].layer_names}
    work.register_kv_caches(kv)
    try:
        a, a_ids = Request("A", A), list(range(1, 12))
        sched.get_num_new_matched_tokens(a, 0)
        sched.update_state_after_alloc(a, KVCacheBlocks((a_ids,)), 0)
        step(sched, work, new_req(a, (a_ids,), 0))
        b, b_ids = Request("B", B), [*a_ids[:3], *range(20, 28)]  # the engine's own cache: A's first 3 blocks
        assert sched.get_num_new_matched_tokens(b, 12) == (20, False)
        sched.update_state_after_alloc(b, KVCacheBlocks((b_ids,)), 20)
        assert sched.hit_sources(b) == {TierKind.CPU: 20}
        out = step(sched, work, new_req(b, (b_ids,), 12))
        stats = out.kv_connector_stats.data if out.kv_connector_stats else {}
        assert (stats["loaded:cpu:0"], stats["loaded_tokens:cpu:0"]) == (3, 20)
        for name in kv:  # what the engine held stays; the rest is A's
            assert torch.equal(kv[name][:, b_ids[3:8]], kv[name][:, a_ids[3:8]])
        step(sched, work, SchedulerOutput(finished_req_ids={"A", "B"}))
    finally:
        sched.shutdown()
        work.shutdown()
