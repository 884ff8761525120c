"""A synchronous load that fails leaves no wrong KV behind (issue 31, part 1).

As in vLLM, the engine learns of a failed synchronous load only after the step's forward pass: that step computed
the request's suffix over blocks that were never filled. Nothing computed on top of the failed load may be stored,
and the recompute must store the right KV, so a later request that hits those chunks gets the uncached logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import load_config
from kvtier.engine import EngineArgs, KVTierPair, ModelConfig
from kvtier.engine.core import Engine, RequestSpec
from kvtier.engine.types import KVTransferConfig
from kvtier.records.keys import chunk_keys

C = 32
MODEL = ModelConfig()
PREFIX = tuple(range(1, 4 * C + 1))  # 4 chunks


def overrides(tmp_path: Path) -> dict[str, Any]:
    return {"chunk_size": C, "tiers": [{"name": "cpu", "kind": "cpu", "capacity": "32MiB"}],
            "policy": {"write": "write_back", "eviction": "prefix_lru"}}


def kvtier_engine(tmp_path: Path, split: bool) -> Engine:
    """One engine with kvtier on a cpu tier (synchronous loads): both halves over one store, or each role with its
    own store as vLLM builds them (the directory learns of writes from the worker reports)."""
    if split:
        ktc = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                               kv_connector_extra_config=overrides(tmp_path))
        return Engine(EngineArgs(model=MODEL), connector=None, kv_transfer_config=ktc)
    return Engine(EngineArgs(model=MODEL), connector=KVTierPair(load_config(overrides(tmp_path), env={})))


def worker_pool(engine: Engine) -> Any:
    return engine.worker_connector._work().store.tier("cpu")


def run(engine: Engine, req_id: str, tokens: tuple[int, ...]) -> Any:
    return engine.run([RequestSpec(req_id, tokens, max_tokens=2)])[req_id]


def uncached_logits(tokens: tuple[int, ...]) -> list[torch.Tensor]:
    engine = Engine(EngineArgs(model=MODEL))
    try:
        return run(engine, "ref", tokens).logits
    finally:
        engine.close()


@pytest.mark.parametrize("split", [False, True], ids=["one-store", "split-halves"])
def test_a_failed_synchronous_load_stores_nothing_computed_on_it(tmp_path: Path, split: bool) -> None:
    """A stores 4 chunks; chunk 1 vanishes from the worker's pool while the directory lists it. B hits the 4 chunks
    with a 70-token suffix: the load of chunk 1 fails and B is recomputed (its own output right). D stores chunk 1
    again. C then hits B's 6 chunks: it must get the uncached logits, bit for bit (it got 0.143 off when the
    failed step's chunks 4-5 were saved), and it must have hit them all (a recompute would also match)."""
    engine = kvtier_engine(tmp_path, split)
    try:
        run(engine, "A", (*PREFIX, 7, 7))
        pool = worker_pool(engine)
        chunk1 = chunk_keys(engine.scheduler_connector._sched()._spaces[0], PREFIX, C)[1]
        assert len(pool.pool) == 4 and chunk1 in pool.pool
        assert engine.worker_connector._loop.run(pool.delete([chunk1])) == 1  # the directory still lists it
        suffix = tuple(range(300, 370))
        b = run(engine, "B", PREFIX + suffix)
        assert b.num_load_failures == 1
        assert torch.equal(torch.stack(b.logits), torch.stack(uncached_logits(PREFIX + suffix)))
        run(engine, "D", (*PREFIX[:2 * C], 9, 9, 9))
        later = PREFIX + suffix[:2 * C] + (11, 12, 13)
        c = run(engine, "C", later)
        assert c.num_load_failures == 0
        assert c.external_tokens == 6 * C, c.external_tokens  # every chunk B computed came from the tier
        assert torch.equal(torch.stack(c.logits), torch.stack(uncached_logits(later)))
    finally:
        engine.close()
