"""Both halves with a recurrent (Mamba / linear-attention) group, in vLLM's call order: request A's recurrent
state at a chunk boundary is saved from the engine's offer, request B sharing A's prefix hits it, and the worker
writes A's state bytes into B's block at the hit point, from a memory tier and from disk after a restart.

State tensors are registered as vLLM's CPU build registers them: int8 ``[blocks, 1, 1, page]``, pages padded past
the state's bytes (the padding is never read nor written).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from roundtrip_helpers import C, cfg_for, receive, step

from kvtier.connector.base import KVConnectorRole
from kvtier.connector.tiered import TieredConnector
from kvtier.engine.types import KVCacheBlocks, KVConnectorBlockState, NewRequestData, Request, SchedulerOutput
from kvtier.layout import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from kvtier.layout.geometry import NULL_BLOCK

BS, NUM_BLOCKS, PAGE = 4, 64, 48
STATE = MambaSpec(BS, ((2, 3), (4,)), ("float32", "float32"))  # 40 bytes of state per layer and block
KCC = KVCacheConfig((KVCacheGroupSpec(("f0", "f1"), FullAttentionSpec(BS, 2, 4, "float32")),
                     KVCacheGroupSpec(("m0", "m1"), STATE)), NUM_BLOCKS)
PREFIX = list(range(500, 532))  # 4 chunks; A's state at 32 tokens is offered
A, B = Request("A", [*PREFIX, *range(900, 909)]), Request("B", [*PREFIX, *range(700, 709)])
A_BLOCKS = (list(range(1, 12)), [NULL_BLOCK] * 7 + [20, 21, 22])
B_BLOCKS = (list(range(30, 41)), [NULL_BLOCK] * 7 + [50])  # vLLM's allocation for a 32-token hit: slot 7 real
NBYTES = STATE.state_bytes_per_layer()


def caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv = {n: torch.randn(2, NUM_BLOCKS, BS, 2, 4, generator=g) for n in ("f0", "f1")}
    kv.update({n: torch.randint(-128, 128, (NUM_BLOCKS, 1, 1, PAGE), generator=g, dtype=torch.int8)
               for n in ("m0", "m1")})
    return kv


def save_a(sched: TieredConnector, work: TieredConnector) -> None:
    assert sched.get_num_new_matched_tokens(A, 0) == (0, False)
    sched.update_state_after_alloc(A, KVCacheBlocks(A_BLOCKS), 0)
    offers = KVConnectorBlockState({"A": [(1, 20, 32)]})  # the block the forward wrote the state at 32 into
    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData("A", A.prompt_token_ids, A_BLOCKS, 0)],
                          num_scheduled_tokens={"A": 32}, kv_connector_block_state=offers)
    step(sched, work, out)
    assert sched.request_finished_all_groups(A, A_BLOCKS) == (True, None)
    work.flush_saves()
    assert step(sched, work, SchedulerOutput(finished_req_ids={"A"})).finished_sending == {"A"}


def load_b(sched: TieredConnector, work: TieredConnector) -> None:
    assert sched.get_num_new_matched_tokens(B, 0) == (4 * C, True)  # a state always loads asynchronously
    sched.update_state_after_alloc(B, KVCacheBlocks(B_BLOCKS), 4 * C)
    loaded = receive(sched, work, "B")
    # four attention chunks and one state chunk (both layers' states at the hit point, in one record)
    assert (loaded.get("load_chunks_group0"), loaded.get("load_chunks_group1")) == (4, 1), loaded


def assert_state_loaded(kv_a: dict[str, torch.Tensor], kv_b: dict[str, torch.Tensor], padding: torch.Tensor) -> None:
    for name in ("m0", "m1"):
        assert torch.equal(kv_b[name][50, 0, 0, :NBYTES], kv_a[name][20, 0, 0, :NBYTES]), name
    assert torch.equal(torch.stack([kv_b[n][50, 0, 0, NBYTES:] for n in ("m0", "m1")]), padding)
    for name in ("f0", "f1"):
        assert torch.equal(kv_b[name][:, B_BLOCKS[0][:8]], kv_a[name][:, A_BLOCKS[0][:8]])


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_recurrent_state_round_trips_into_the_hit_block(tier: str, tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path, (tier,))
    sched = TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
    try:
        kv = caches(seed=1)
        work.register_kv_caches(kv)
        save_a(sched, work)
        before = {n: t.clone() for n, t in kv.items()}
        padding = torch.stack([kv[n][50, 0, 0, NBYTES:] for n in ("m0", "m1")]).clone()
        assert not torch.equal(kv["m0"][50, 0, 0, :NBYTES], kv["m0"][20, 0, 0, :NBYTES])
        load_b(sched, work)
        assert_state_loaded(before, kv, padding)
        untouched = [b for b in range(NUM_BLOCKS) if b != 50]
        assert all(torch.equal(kv[n][untouched], before[n][untouched]) for n in ("m0", "m1"))
    finally:
        sched.shutdown()
        work.shutdown()


def test_a_state_saved_by_one_engine_serves_a_new_one(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path, ("disk",))
    sched = TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
    kv_a = caches(seed=2)
    work.register_kv_caches(kv_a)
    save_a(sched, work)
    sched.shutdown()
    work.shutdown()
    sched = TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
    try:
        kv_b = caches(seed=3)
        padding = torch.stack([kv_b[n][50, 0, 0, NBYTES:] for n in ("m0", "m1")]).clone()
        work.register_kv_caches(kv_b)
        load_b(sched, work)
        assert_state_loaded(kv_a, kv_b, padding)
    finally:
        sched.shutdown()
        work.shutdown()


def test_a_failed_load_of_a_hybrid_is_reported_per_request_never_as_blocks(tmp_path: Path) -> None:
    """vLLM refuses block-level load errors for a model with several KV-cache groups (block ids are unique only
    within a group: it raises). A record that cannot be read fails B's whole load instead: B is reported in
    ``failed_recving`` (and finished), no block ids, and the scheduler forgets the chunk that failed."""
    from kvtier.connector.keying import identity_from, namespaces, request_keys
    from kvtier.tiers.disk.index import Layout

    cfg = cfg_for(tmp_path, ("disk",))
    sched = TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
    try:
        kv = caches(seed=4)
        work.register_kv_caches(kv)
        save_a(sched, work)
        state_key = request_keys(namespaces(identity_from(cfg), KCC, C), B.prompt_token_ids, C, b"")[1][3]
        path = Path(Layout(str(tmp_path), 2).path(state_key))
        path.write_bytes(path.read_bytes()[:-1] + b"\0")  # one byte of the state record changed: corrupt
        before = {n: t.clone() for n, t in kv.items()}
        assert sched.get_num_new_matched_tokens(B, 0) == (4 * C, True)
        sched.update_state_after_alloc(B, KVCacheBlocks(B_BLOCKS), 4 * C)
        outs = []
        for _ in range(500):
            outs.append(step(sched, work, SchedulerOutput()))
            if "B" in (outs[-1].finished_recving or set()):
                break
            time.sleep(0.01)
        assert outs[-1].failed_recving == {"B"} and all(not o.invalid_block_ids for o in outs)
        assert torch.equal(kv["m0"][50], before["m0"][50])  # nothing of the corrupt record was written
        assert not sched._sched().directory.contains("disk", state_key)  # forgotten: B's retry misses it
        assert sched.get_num_new_matched_tokens(Request("B2", B.prompt_token_ids), 0) == (0, False)
    finally:
        sched.shutdown()
        work.shutdown()
