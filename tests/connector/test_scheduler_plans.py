"""TieredConnector's scheduler half: load plans, save plans (full chunks only, write policy, null blocks, output
tokens), pins of loaded chunks, and request end holding blocks until saves are confirmed."""

from __future__ import annotations

from pathlib import Path

from scheduler_harness import FULL, SCHED, SWA, TOKENS, Build, C, make_cfg, schedule_new

from kvtier.bench.redis_servers import RedisServer
from kvtier.config import CpuTierConfig, KvtierConfig, PolicyConfig, RedisTierConfig, WritePolicy
from kvtier.connector.tiered import TieredConnector
from kvtier.engine.types import CachedRequestData, KVCacheBlocks, KVConnectorOutput, Request, SchedulerOutput
from kvtier.layout import KVCacheConfig, simple_config


def test_load_plan_fills_every_group_and_skips_null_and_local_blocks(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL, SWA)))
    h.place(TOKENS, 0, [0, 1, 2, 3])
    h.place(TOKENS, 1, [2, 3])
    req = Request("r", TOKENS)
    assert h.conn.get_num_new_matched_tokens(req, 4) == (4 * C - 4, True)  # two groups: asynchronous
    full_ids = list(range(1, 10))
    swa_ids = [0, 0, 0, 0, 0, 0, 0, 31, 32]  # out-of-window blocks are the null block
    blocks = (full_ids, swa_ids)
    h.conn.update_state_after_alloc(req, KVCacheBlocks(blocks), 4 * C - 4)
    meta = schedule_new(h.conn, req, blocks, 4 * C, 1)
    loads = {(s.group, s.tier): s for s in meta.loads}
    assert set(loads) == {(0, "cpu"), (1, "cpu")}
    keys = h.keys(TOKENS)
    assert loads[0, "cpu"].keys == tuple(keys[0][:4])
    assert loads[0, "cpu"].block_ids == ((0, 2), (3, 4), (5, 6), (7, 8))  # block 1 is the local hit
    assert loads[1, "cpu"].keys == (keys[1][3],)  # window 8: only the chunk before the hit point
    assert loads[1, "cpu"].block_ids == ((0, 31),)  # a null block stays null: the worker skips it
    # write-through: chunks held only by cpu go to disk too; chunks with null blocks are never saved
    assert [(s.group, p.tier, len(p.store)) for s in meta.saves for p in s.plans] == [(0, "disk", 4)]


def test_second_alloc_call_is_a_no_op(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    h.place(TOKENS, 0, [0, 1], tier="disk")
    req = Request("r", TOKENS)
    assert h.conn.get_num_new_matched_tokens(req, 0) == (2 * C, True)
    assert h.conn.get_num_new_matched_tokens(req, 0) == (2 * C, True)  # idempotent
    h.conn.update_state_after_alloc(req, KVCacheBlocks(([1, 2, 3, 4],)), 2 * C)
    h.conn.update_state_after_alloc(req, KVCacheBlocks(([1, 2, 3, 4],)), 0)
    meta = h.conn.build_connector_meta(SchedulerOutput())
    assert [(s.tier, len(s.keys), s.is_async) for s in meta.loads] == [("disk", 2, True)]
    assert h.conn.build_connector_meta(SchedulerOutput()).loads == []


def test_save_plans_cover_only_full_chunks(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    req = Request("r", TOKENS)
    assert h.conn.get_num_new_matched_tokens(req, 0) == (0, False)
    ids = list(range(1, 10))
    h.conn.update_state_after_alloc(req, KVCacheBlocks((ids,)), 0)
    meta = schedule_new(h.conn, req, (ids,), 0, 2 * C - 1)  # one token short of two chunks
    keys = h.keys(TOKENS)[0]
    assert [s.keys for s in meta.saves] == [(keys[0],)]
    assert meta.saves[0].block_ids == ((1, 2),)
    assert {p.tier for p in meta.saves[0].plans} == {"cpu", "disk"}  # write-through
    cached = CachedRequestData(req_ids=["r"], new_block_ids=[None], num_computed_tokens=[2 * C - 1])
    meta = h.conn.build_connector_meta(SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 2 * C}))
    assert [s.keys for s in meta.saves] == [(keys[1], keys[2])]
    assert meta.saves[0].block_ids == ((3, 4), (5, 6))
    assert not meta.idle and h.conn.build_connector_meta(SchedulerOutput()).idle  # a step computing nothing


def test_write_back_stores_in_the_first_tier_only(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)), WritePolicy.WRITE_BACK)
    req = Request("r", TOKENS)
    h.conn.get_num_new_matched_tokens(req, 0)
    meta = schedule_new(h.conn, req, (list(range(1, 10)),), 0, 33)
    assert [(p.tier, len(p.store)) for s in meta.saves for p in s.plans] == [("cpu", 4)]


def test_sliding_window_chunks_with_null_blocks_are_not_saved(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL, SWA)))
    req = Request("r", TOKENS)
    h.conn.get_num_new_matched_tokens(req, 0)
    blocks = (list(range(1, 10)), [0, 0, 0, 0, 20, 21, 22, 23, 24])
    meta = schedule_new(h.conn, req, blocks, 0, 33)
    saved = {s.group: s.block_ids for s in meta.saves}
    assert saved[0] == ((1, 2), (3, 4), (5, 6), (7, 8))
    assert saved[1] == ((20, 21), (22, 23))


def test_request_finished_holds_blocks_until_saves_confirmed(tmp_path: Path) -> None:
    # Scheduler in its own process: its own directory, no store; saves stay PENDING until confirmed.
    kcc = simple_config(2, 1, 4, dtype="float32", block_size=4)
    conn = TieredConnector.from_config(make_cfg(tmp_path), SCHED, kcc)
    try:
        req = Request("a", TOKENS)
        conn.get_num_new_matched_tokens(req, 0)
        ids = list(range(1, 10))
        meta = schedule_new(conn, req, (ids,), 0, 33)
        assert len(meta.saves) == 1
        assert conn.request_finished(req, ids) == (True, None)
        other = Request("b", TOKENS)
        # being written: a hit already, loaded asynchronously (the worker's read waits for the write; issue 32)
        assert conn.get_num_new_matched_tokens(other, 0) == (4 * C, True)
        conn.update_connector_output(KVConnectorOutput(finished_sending={"a"}))
        assert conn.get_num_new_matched_tokens(other, 0) == (4 * C, False)
        idle = Request("c", [1, 2, 3])
        conn.get_num_new_matched_tokens(idle, 0)
        assert conn.request_finished_all_groups(idle, ([],)) == (False, None)
    finally:
        conn.shutdown()


def test_loaded_chunks_are_pinned_until_their_step_is_planned(harness: Build) -> None:
    cfg = KvtierConfig(chunk_size=C, tiers=(CpuTierConfig("cpu", 4 * 4096),), policy=PolicyConfig(eviction="lru"))
    h = harness(KVCacheConfig((FULL,)), cfg=cfg)  # room for exactly 4 chunks (one 4 KiB slot each)
    h.place(TOKENS, 0, [0, 1, 2, 3])
    r = Request("r", TOKENS)
    assert h.conn.get_num_new_matched_tokens(r, 0) == (4 * C, False)
    h.conn.update_state_after_alloc(r, KVCacheBlocks((list(range(1, 10)),)), 4 * C)
    other = Request("o", list(range(1000, 1033)))
    h.conn.get_num_new_matched_tokens(other, 0)
    meta = schedule_new(h.conn, other, (list(range(20, 29)),), 0, 33)
    assert len(meta.loads) == 1
    assert not meta.saves  # no room: every chunk in the tier is pinned by r's load
    third = Request("t", list(range(2000, 2033)))
    h.conn.get_num_new_matched_tokens(third, 0)
    meta = schedule_new(h.conn, third, (list(range(30, 39)),), 0, 33)
    evicted = {k for s in meta.saves for p in s.plans for k in p.evicted}
    assert evicted == set(h.keys(TOKENS)[0][:4])  # unpinned once planned: now evictable


def test_output_tokens_are_saved_once_their_chunk_is_full(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    req = Request("r", TOKENS[:20])
    h.conn.get_num_new_matched_tokens(req, 0)
    ids = list(range(1, 10))
    meta = schedule_new(h.conn, req, (ids,), 0, 20)
    assert [len(s.keys) for s in meta.saves] == [2]
    req.output_token_ids.extend([7, 7, 7, 7, 7])  # the engine appends sampled tokens: 25 tokens known
    cached = CachedRequestData(req_ids=["r"], new_block_ids=[None], num_computed_tokens=[23])
    meta = h.conn.build_connector_meta(SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 1}))
    keys = h.keys([*TOKENS[:20], 7, 7, 7, 7])[0]
    assert [s.keys for s in meta.saves] == [(keys[2],)]
    assert meta.saves[0].block_ids == ((5, 6),)


def test_a_chunk_found_in_a_shared_tier_is_not_written_there_again_unless_its_load_failed(harness: Build) -> None:
    """A Redis hit (the directory tracks no shared tier) plans no save of the chunks it loads back into Redis: the
    gather and the write would cost the engine and the medium what the hit saved. The chunks the request computes
    past the hit are saved; after a failed load the recomputed chunks are saved again, their Redis copy included."""
    with RedisServer() as server:
        cfg = KvtierConfig(chunk_size=C, tiers=(RedisTierConfig("redis", 1 << 22, url=server.url),),
                           policy=PolicyConfig(eviction="lru"))
        h = harness(KVCacheConfig((FULL,)), cfg=cfg)
        h.place(TOKENS, 0, [0, 1], tier="redis")
        keys = h.keys(TOKENS)[0]
        ids = list(range(1, 10))
        for name, fail in (("r", False), ("s", True)):
            req = Request(name, TOKENS)
            assert h.conn.get_num_new_matched_tokens(req, 0) == (2 * C, True)
            h.conn.update_state_after_alloc(req, KVCacheBlocks((ids,)), 2 * C)
            meta = schedule_new(h.conn, req, (ids,), 2 * C, 2 * C)  # computes chunks 2 and 3 past the hit
            assert [s.tier for s in meta.loads] == ["redis"]
            assert [(p.tier, p.store) for s in meta.saves for p in s.plans] == [("redis", (keys[2], keys[3]))]
            if fail:  # block 3 = chunk 1: recomputed from there, chunks 1-3 saved again
                h.conn.update_connector_output(KVConnectorOutput(invalid_block_ids={3}))
                cached = CachedRequestData([name], new_block_ids=[None], num_computed_tokens=[C])
                meta = h.conn.build_connector_meta(SchedulerOutput(scheduled_cached_reqs=cached,
                                                                   num_scheduled_tokens={name: 3 * C}))
                stored = [k for s in meta.saves for p in s.plans if p.tier == "redis" for k in p.store]
                assert stored == [keys[1], keys[2], keys[3]]


def test_a_hit_from_an_expiring_shared_tier_is_written_back_to_keep_it_alive(harness: Build) -> None:
    """A Redis tier with a ``ttl`` forgets a record that is not written again: its hits are saved back (the
    rewrite renews the expiry), as every chunk of the request."""
    with RedisServer() as server:
        cfg = KvtierConfig(chunk_size=C, tiers=(RedisTierConfig("redis", 1 << 22, url=server.url, ttl=60.0),),
                           policy=PolicyConfig(eviction="lru"))
        h = harness(KVCacheConfig((FULL,)), cfg=cfg)
        h.place(TOKENS, 0, [0, 1], tier="redis")
        keys = h.keys(TOKENS)[0]
        req = Request("r", TOKENS)
        assert h.conn.get_num_new_matched_tokens(req, 0) == (2 * C, True)
        h.conn.update_state_after_alloc(req, KVCacheBlocks((list(range(1, 10)),)), 2 * C)
        meta = schedule_new(h.conn, req, (list(range(1, 10)),), 2 * C, 2 * C)
        assert [(p.tier, p.store) for s in meta.saves for p in s.plans] == [("redis", tuple(keys[:4]))]
