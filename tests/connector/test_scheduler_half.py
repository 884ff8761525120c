"""TieredConnector's scheduler half: hits per group, chunks the engine's blocks do not fit, the async flag, a
shared Redis tier, failed blocks. Plans: test_scheduler_plans.py; multimodal keys: test_scheduler_multimodal.py;
recurrent state: test_scheduler_states.py.

Real tiers (a cpu pool and a disk tier in a tmp dir) behind a real TieredStore; chunks are placed with
``store.put`` under the keys the scheduler computes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
from scheduler_harness import FULL, SCHED, SWA, TOKENS, Build, C, make_cfg, schedule_new

from kvtier.bench.redis_servers import RedisServer
from kvtier.config import CpuTierConfig, KvtierConfig, PolicyConfig, RedisTierConfig, WritePolicy
from kvtier.connector.tiered import TieredConnector
from kvtier.control.policy import LRUPolicy
from kvtier.engine.types import KVCacheBlocks, KVConnectorOutput, Request, SchedulerOutput
from kvtier.errors import ConfigError
from kvtier.layout import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec


def test_full_attention_needs_every_chunk(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    h.place(TOKENS, 0, [0, 2, 3])
    assert h.conn.get_num_new_matched_tokens(Request("r", TOKENS), 0) == (C, False)
    h.place(TOKENS, 0, [1])
    assert h.conn.get_num_new_matched_tokens(Request("r", TOKENS), 0) == (4 * C, False)


def test_sliding_window_needs_only_the_last_window(harness: Build) -> None:
    h = harness(KVCacheConfig((SWA,)))
    h.place(TOKENS, 0, [3])  # window 8 = one chunk: only chunk 3 matters for a 4-chunk hit
    assert h.conn.get_num_new_matched_tokens(Request("r", TOKENS), 0) == (4 * C, False)


def test_hybrid_hit_is_the_largest_point_every_group_accepts(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL, SWA)))
    h.place(TOKENS, 0, [0, 1])
    h.place(TOKENS, 1, [3])
    assert h.conn.get_num_new_matched_tokens(Request("a", TOKENS), 0) == (0, False)
    h.place(TOKENS, 1, [1])
    # several groups: the load is asynchronous even from memory (vLLM takes a failed load only per request then)
    assert h.conn.get_num_new_matched_tokens(Request("b", TOKENS), 0) == (2 * C, True)


def test_a_prefix_the_engine_serves_is_refreshed_in_kvtiers_tiers_once_per_request(harness: Build) -> None:
    """kvtier's lookup asks only past the engine's own hit, and its saves skip what a tier holds: without a refresh, a
    prefix the engine keeps serving would be kvtier's oldest record, the first evicted (lru here), and gone with the
    rest of its chain by the time the engine drops it."""
    h = harness(KVCacheConfig((FULL,)))
    other = [500 + t for t in range(2 * C)]
    h.place(TOKENS, 0, [0, 1])  # the prompt's first two chunks, stored first
    h.place(other, 0, [0, 1])  # then another prompt's
    directory = h.store.directory
    assert h.conn.get_num_new_matched_tokens(Request("r", TOKENS), 2 * C) == (0, False)  # the engine hit both
    h.place(other, 0, [0, 1])  # held: stored again, not refreshed (a save plan skips it)
    h.conn.get_num_new_matched_tokens(Request("r", TOKENS), 2 * C)  # the same request asking again: no refresh
    room = h.cfg.tier("cpu").capacity - directory.used_bytes("cpu") + 1
    plans = directory.prepare_store("cpu", [(b"k" * 32, room, None)])
    assert [plans[-1].evicted] == [tuple(h.keys(other)[0][:1])]  # the least recently used is the other prompt's


def test_never_the_whole_prompt_and_beyond_local_hits(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    tokens = TOKENS[:32]  # exactly 4 chunks
    h.place(tokens, 0, [0, 1, 2, 3])
    conn = h.conn
    assert conn.get_num_new_matched_tokens(Request("r", tokens), 0) == (3 * C, False)
    assert conn.get_num_new_matched_tokens(Request("r", tokens), 12) == (3 * C - 12, False)
    assert conn.get_num_new_matched_tokens(Request("r", tokens), 3 * C) == (0, False)
    assert conn.get_num_new_matched_tokens(Request("s", tokens[:1]), 0) == (0, False)


def test_chunks_the_engines_blocks_do_not_fit_disable_kvtier_or_fail_in_strict_mode(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kcc = KVCacheConfig((KVCacheGroupSpec(("x",), FullAttentionSpec(3, 1, 4, "float32")),))
    with caplog.at_level("ERROR"):
        conn = TieredConnector.from_config(make_cfg(tmp_path), SCHED, kcc)  # the engine still starts
    try:
        assert conn.get_num_new_matched_tokens(Request("r", TOKENS), 0) == (0, False)
        assert any("kvtier is disabled" in r.getMessage() and "multiple" in r.getMessage() for r in caplog.records)
    finally:
        conn.shutdown()
    strict = dataclasses.replace(make_cfg(tmp_path), strict=True)
    with pytest.raises(ConfigError, match=r"chunk_size: .*use a multiple of 3"):
        TieredConnector.from_config(strict, SCHED, kcc)


def test_a_tier_too_small_for_one_chunk_disables_kvtier_or_fails_in_strict_mode(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The same fit rule as ``kvtier check`` (kvtier.records.fit): a tier that cannot hold one record of a group placed
    on it is found at start, not by a stream of refused saves."""
    big = KVCacheConfig((KVCacheGroupSpec(tuple(f"l{i}" for i in range(64)), FullAttentionSpec(C, 8, 128,
                                                                                                 "float32")),))
    with caplog.at_level("ERROR"):
        conn = TieredConnector.from_config(make_cfg(tmp_path), SCHED, big)  # 4 MiB per chunk, 1 MiB cpu tier
    try:
        assert conn.get_num_new_matched_tokens(Request("r", TOKENS), 0) == (0, False)
        assert any("kvtier is disabled" in r.getMessage() and "tiers[0].capacity" in r.getMessage()
                   for r in caplog.records)
    finally:
        conn.shutdown()
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity"):
        TieredConnector.from_config(dataclasses.replace(make_cfg(tmp_path), strict=True), SCHED, big)


def test_a_recurrent_group_whose_states_miss_the_chunk_boundaries_disables_kvtier(tmp_path: Path) -> None:
    """States lie every block_size tokens: a state block of 160 tokens cannot serve chunks of 8."""
    odd = KVCacheConfig((KVCacheGroupSpec(("x",), FullAttentionSpec(4, 1, 4, "float32")),
                         KVCacheGroupSpec(("m",), MambaSpec(160, ((4,),), ("float32",)))))
    conn = TieredConnector.from_config(make_cfg(tmp_path), SCHED, odd)
    try:
        req = Request("r", TOKENS)
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
        assert schedule_new(conn, req, ([1, 2], [3]), 0, 4 * C).saves == []
    finally:
        conn.shutdown()
    with pytest.raises(ConfigError, match="block size 160 of KV-cache group 1"):
        TieredConnector.from_config(dataclasses.replace(make_cfg(tmp_path), strict=True), SCHED, odd)


def test_async_flag_follows_the_tier_kind(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    h.place(TOKENS, 0, [0], tier="cpu")
    h.place(TOKENS, 0, [1], tier="disk")
    assert h.conn.get_num_new_matched_tokens(Request("r", TOKENS), 0) == (2 * C, True)
    assert h.conn.get_num_new_matched_tokens(Request("r", TOKENS), C) == (C, True)
    assert h.conn.get_num_new_matched_tokens(Request("q", TOKENS[:17]), 0) == (2 * C, True)


def test_failed_blocks_drop_their_chunks(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    h.place(TOKENS, 0, [0, 1, 2, 3])
    req = Request("r", TOKENS)
    assert h.conn.get_num_new_matched_tokens(req, 0)[0] == 4 * C
    ids = list(range(1, 10))
    h.conn.update_state_after_alloc(req, KVCacheBlocks((ids,)), 4 * C)
    h.conn.build_connector_meta(SchedulerOutput())
    h.conn.update_connector_output(KVConnectorOutput(invalid_block_ids={5}))  # block 5 = chunk 2
    assert h.conn.get_num_new_matched_tokens(Request("s", TOKENS), 0) == (2 * C, False)


def test_shared_redis_tier_hits_asynchronously_and_a_dead_one_is_a_quick_miss(harness: Build) -> None:
    with RedisServer() as server:
        cfg = KvtierConfig(chunk_size=C, tiers=(CpuTierConfig("cpu", 1 << 20),
                                                RedisTierConfig("redis", 1 << 22, url=server.url)),
                           policy=PolicyConfig(eviction="lru", write=WritePolicy.WRITE_THROUGH))
        h = harness(KVCacheConfig((FULL,)), cfg=cfg)
        h.place(TOKENS, 0, [0], tier="cpu")
        h.place(TOKENS, 0, [1, 2], tier="redis")
        assert h.conn.get_num_new_matched_tokens(Request("r", TOKENS), 0) == (3 * C, True)
        server.kill()
        t0 = time.perf_counter()
        assert h.conn.get_num_new_matched_tokens(Request("s", TOKENS), 0) == (C, False)
        assert time.perf_counter() - t0 < 2.0


def test_may_load_async_answers_from_the_local_tiers_as_the_lookup_would(harness: Build) -> None:
    """vLLM 0.34 asks ``may_load_async`` whenever a request enters a waiting queue, to start asynchronous loads
    while the batch is full: yes where the lookup's load would be asynchronous (a chunk on disk; several groups),
    no where it would load from memory or find nothing, without asking any server."""
    h = harness(KVCacheConfig((FULL,)))
    assert not h.conn.may_load_async(Request("nothing", TOKENS))
    h.place(TOKENS, 0, [0, 1])
    assert not h.conn.may_load_async(Request("cpu", TOKENS))
    assert h.conn.get_num_new_matched_tokens(Request("cpu", TOKENS), 0) == (2 * C, False)
    h.place(TOKENS, 0, [2], tier="disk")
    assert h.conn.may_load_async(Request("disk", TOKENS))
    assert h.conn.get_num_new_matched_tokens(Request("disk", TOKENS), 0) == (3 * C, True)
    assert not h.conn.may_load_async(Request("short", TOKENS[:C - 1]))  # not a chunk long: never a hit
    hybrid = harness(KVCacheConfig((FULL, SWA)))
    assert not hybrid.conn.may_load_async(Request("h0", TOKENS))
    hybrid.place(TOKENS, 1, [0])
    assert hybrid.conn.may_load_async(Request("h1", TOKENS))  # several groups: every load is asynchronous


def test_may_load_async_says_yes_with_a_shared_tier_without_asking_it(harness: Build,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.tiers.redis.tier import RedisTier

    asked: list[int] = []

    async def contains(self: RedisTier, keys: list[bytes]) -> list[bool]:
        asked.append(len(keys))
        return [False] * len(keys)

    with RedisServer() as server:
        cfg = KvtierConfig(chunk_size=C, tiers=(CpuTierConfig("cpu", 1 << 20),
                                                RedisTierConfig("redis", 1 << 22, url=server.url)),
                           policy=PolicyConfig(eviction="lru", write=WritePolicy.WRITE_THROUGH))
        h = harness(KVCacheConfig((FULL,)), cfg=cfg)
        monkeypatch.setattr(RedisTier, "contains", contains)
        assert h.conn.may_load_async(Request("r", TOKENS)) and asked == []
        assert h.conn.get_num_new_matched_tokens(Request("r", TOKENS), 0) == (0, False) and asked  # the lookup asks


def test_a_lookup_counts_group_0s_chunks_in_the_directorys_stats_and_may_load_async_counts_nothing(
        harness: Build) -> None:
    """``kvtier_lookup_chunks_total{tier="local"}`` and its hits count what the scheduler's lookups ask of the
    local tiers: the chunks of group 0 asked (up to the hit limit) and those found (up to the first miss of a
    full-attention group)."""
    h = harness(KVCacheConfig((FULL, SWA)))
    h.place(TOKENS, 0, [0, 1])
    h.place(TOKENS, 1, [1])
    assert h.conn._scheduler is not None
    stats = h.conn._scheduler.directory.stats
    before = (stats.lookups, stats.hits)
    assert h.conn.may_load_async(Request("a", TOKENS))  # several groups: asynchronous
    assert (stats.lookups, stats.hits) == before
    assert h.conn.get_num_new_matched_tokens(Request("b", TOKENS), 0) == (2 * C, True)
    assert (stats.lookups - before[0], stats.hits - before[1]) == (4, 2)


def test_a_hits_policy_touches_run_on_the_io_loop_and_at_once_after_close(
        harness: Build, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's thread queues a hit's policy calls (kvtier.control.directory.Directory.defer_policy); the
    scheduler half's I/O loop applies them. Once it is closed, calls apply at once on the caller's thread."""
    threads: list[str] = []
    touch = LRUPolicy.touch

    def recorded(self: LRUPolicy, key: bytes) -> None:
        threads.append(threading.current_thread().name)
        touch(self, key)

    monkeypatch.setattr(LRUPolicy, "touch", recorded)
    h = harness(KVCacheConfig((FULL,)))
    h.place(TOKENS, 0, [0, 1, 2, 3])
    req = Request("r", TOKENS)
    assert h.conn.get_num_new_matched_tokens(req, 0)[0] == 4 * C
    h.conn.update_state_after_alloc(req, KVCacheBlocks((list(range(1, 10)),)), 4 * C)
    deadline = time.monotonic() + 5
    while h.store.directory.queued_calls() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(threads) == 4 and threading.current_thread().name not in threads
    h.conn.shutdown()
    h.store.directory.touch("cpu", h.keys(TOKENS)[0][:1])
    assert threads[-1] == threading.current_thread().name and h.store.directory.queued_calls() == 0
