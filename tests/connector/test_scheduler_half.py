"""KVTierConnector's scheduler half: hits per group, load plans, save plans, async flag, request end.

Real tiers (a cpu pool and a disk tier in a tmp dir) behind a real TieredStore; chunks are placed with
``store.put`` under the keys the scheduler computes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.bench.redis_servers import RedisServer
from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig, PolicyConfig, RedisTierConfig, WritePolicy
from kvtier.connector.base import KVConnectorRole
from kvtier.connector.keying import identity_from, namespaces, request_extra, request_keys
from kvtier.connector.plans import KVTierMetadata
from kvtier.connector.tiered import KVTierConnector
from kvtier.connector.types import (
    CachedRequestData,
    KVCacheBlocks,
    KVConnectorOutput,
    NewRequestData,
    Request,
    SchedulerOutput,
)
from kvtier.keys import Key
from kvtier.layout import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    simple_config,
)
from kvtier.runtime import LoopThread
from kvtier.store import TieredStore

C = 8  # chunk size; block size 4 -> two blocks per chunk
SCHED = KVConnectorRole.SCHEDULER
FULL = KVCacheGroupSpec(("f0", "f1"), FullAttentionSpec(4, 1, 4, "float32"))
SWA = KVCacheGroupSpec(("s0",), SlidingWindowSpec(4, 1, 4, "float32", sliding_window=8))
MAMBA = KVCacheGroupSpec(("m0",), MambaSpec(4, ((4,),), ("float32",)))


def make_cfg(tmp: Path, write: WritePolicy = WritePolicy.WRITE_THROUGH) -> KvtierConfig:
    return KvtierConfig(chunk_size=C, tiers=(CpuTierConfig("cpu", 1 << 20), DiskTierConfig("disk", 1 << 22, path=str(tmp))),
                        policy=PolicyConfig(eviction="lru", write=write))


class Harness:
    """A started store shared with a scheduler-role connector, and helpers to place chunks."""

    def __init__(self, cfg: KvtierConfig, kcc: KVCacheConfig) -> None:
        self.cfg, self.kcc = cfg, kcc
        self.loop = LoopThread()
        self.store = TieredStore.from_config(self.cfg)
        self.loop.run(self.store.start())
        self.conn = KVTierConnector.from_config(self.cfg, SCHED, kcc, store=self.store, loop=self.loop)
        self.spaces = namespaces(identity_from(self.cfg, None, tp_rank=0), kcc, C)

    def keys(self, tokens: list[int]) -> list[list[Key]]:
        return request_keys(self.spaces, tokens, C, b"")

    def place(self, tokens: list[int], group: int, chunks: list[int], tier: str = "cpu") -> None:
        keys = self.keys(tokens)[group]
        self.loop.run(self.store.put([(keys[i], torch.zeros(4)) for i in chunks], tiers=[tier]))

    def close(self) -> None:
        self.conn.shutdown()
        self.loop.run(self.store.close())
        self.loop.close()


Build = Callable[..., Harness]


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Build]:
    made: list[Harness] = []

    def build(kcc: KVCacheConfig, write: WritePolicy = WritePolicy.WRITE_THROUGH,
              cfg: KvtierConfig | None = None) -> Harness:
        made.append(Harness(cfg or make_cfg(tmp_path / f"disk{len(made)}", write), kcc))
        return made[-1]

    yield build
    for h in made:
        h.close()


TOKENS = list(range(100, 133))  # 33 tokens: 4 full chunks, a hit may cover all 4 (one token left)


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
    assert h.conn.get_num_new_matched_tokens(Request("b", TOKENS), 0) == (2 * C, False)


def test_never_the_whole_prompt_and_beyond_local_hits(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    tokens = TOKENS[:32]  # exactly 4 chunks
    h.place(tokens, 0, [0, 1, 2, 3])
    conn = h.conn
    assert conn.get_num_new_matched_tokens(Request("r", tokens), 0) == (3 * C, False)
    assert conn.get_num_new_matched_tokens(Request("r", tokens), 12) == (3 * C - 12, False)
    assert conn.get_num_new_matched_tokens(Request("r", tokens), 3 * C) == (0, False)
    assert conn.get_num_new_matched_tokens(Request("s", tokens[:1]), 0) == (0, False)


def test_mamba_group_never_hits_and_nothing_is_saved_for_it(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL, MAMBA)))
    h.place(TOKENS, 0, [0, 1, 2, 3])
    h.place(TOKENS, 1, [0, 1, 2, 3])
    req = Request("r", TOKENS)
    assert h.conn.get_num_new_matched_tokens(req, 0) == (0, False)
    h.conn.update_state_after_alloc(req, KVCacheBlocks((list(range(1, 10)), [10])), 0)
    meta = _schedule_new(h.conn, req, (list(range(1, 10)), [10]), 0, 4 * C)  # four full chunks computed
    assert meta.saves == []  # the full-attention group's chunks could never be part of a hit


def test_chunks_the_engines_blocks_do_not_fit_disable_kvtier_or_fail_in_strict_mode(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kcc = KVCacheConfig((KVCacheGroupSpec(("x",), FullAttentionSpec(3, 1, 4, "float32")),))
    with caplog.at_level("ERROR"):
        conn = KVTierConnector.from_config(make_cfg(tmp_path), SCHED, kcc)  # the engine still starts
    try:
        assert conn.get_num_new_matched_tokens(Request("r", TOKENS), 0) == (0, False)
        assert any("kvtier is disabled" in r.getMessage() and "multiple" in r.getMessage() for r in caplog.records)
    finally:
        conn.shutdown()
    strict = dataclasses.replace(make_cfg(tmp_path), strict=True)
    with pytest.raises(ValueError, match="multiple"):
        KVTierConnector.from_config(strict, SCHED, kcc)


def test_a_model_with_a_mamba_group_starts_whatever_its_block_sizes(tmp_path: Path) -> None:
    """vLLM sizes hybrid models' blocks itself (attention 160, Mamba 1024 tokens, ...): no hit is possible,
    nothing to check."""
    odd = KVCacheConfig((KVCacheGroupSpec(("x",), FullAttentionSpec(160, 1, 4, "float32")),
                         KVCacheGroupSpec(("m",), MAMBA.kv_cache_spec)))
    strict = dataclasses.replace(make_cfg(tmp_path), strict=True)
    conn = KVTierConnector.from_config(strict, SCHED, odd)
    try:
        req = Request("r", TOKENS)
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
        assert _schedule_new(conn, req, ([1, 2], [3]), 0, 4 * C).saves == []
    finally:
        conn.shutdown()


def test_async_flag_follows_the_tier_kind(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    h.place(TOKENS, 0, [0], tier="cpu")
    h.place(TOKENS, 0, [1], tier="disk")
    assert h.conn.get_num_new_matched_tokens(Request("r", TOKENS), 0) == (2 * C, True)
    assert h.conn.get_num_new_matched_tokens(Request("r", TOKENS), C) == (C, True)
    assert h.conn.get_num_new_matched_tokens(Request("q", TOKENS[:17]), 0) == (2 * C, True)


def _schedule_new(conn: KVTierConnector, req: Request, blocks: tuple[list[int], ...], computed: int,
                  scheduled: int) -> KVTierMetadata:
    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData(req.request_id, req.prompt_token_ids, blocks, computed)],
                          num_scheduled_tokens={req.request_id: scheduled})
    return conn.build_connector_meta(out)


def test_load_plan_fills_every_group_and_skips_null_and_local_blocks(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL, SWA)))
    h.place(TOKENS, 0, [0, 1, 2, 3])
    h.place(TOKENS, 1, [2, 3])
    req = Request("r", TOKENS)
    assert h.conn.get_num_new_matched_tokens(req, 4) == (4 * C - 4, False)
    full_ids = list(range(1, 10))
    swa_ids = [0, 0, 0, 0, 0, 0, 0, 31, 32]  # out-of-window blocks are the null block
    blocks = (full_ids, swa_ids)
    h.conn.update_state_after_alloc(req, KVCacheBlocks(blocks), 4 * C - 4)
    meta = _schedule_new(h.conn, req, blocks, 4 * C, 1)
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
    meta = _schedule_new(h.conn, req, (ids,), 0, 2 * C - 1)  # one token short of two chunks
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
    meta = _schedule_new(h.conn, req, (list(range(1, 10)),), 0, 33)
    assert [(p.tier, len(p.store)) for s in meta.saves for p in s.plans] == [("cpu", 4)]


def test_sliding_window_chunks_with_null_blocks_are_not_saved(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL, SWA)))
    req = Request("r", TOKENS)
    h.conn.get_num_new_matched_tokens(req, 0)
    blocks = (list(range(1, 10)), [0, 0, 0, 0, 20, 21, 22, 23, 24])
    meta = _schedule_new(h.conn, req, blocks, 0, 33)
    saved = {s.group: s.block_ids for s in meta.saves}
    assert saved[0] == ((1, 2), (3, 4), (5, 6), (7, 8))
    assert saved[1] == ((20, 21), (22, 23))


def test_request_finished_holds_blocks_until_saves_confirmed(tmp_path: Path) -> None:
    # Scheduler in its own process: its own directory, no store; saves stay PENDING until confirmed.
    kcc = simple_config(2, 1, 4, dtype="float32", block_size=4)
    conn = KVTierConnector.from_config(make_cfg(tmp_path), SCHED, kcc)
    try:
        req = Request("a", TOKENS)
        conn.get_num_new_matched_tokens(req, 0)
        ids = list(range(1, 10))
        meta = _schedule_new(conn, req, (ids,), 0, 33)
        assert len(meta.saves) == 1
        assert conn.request_finished(req, ids) == (True, None)
        other = Request("b", TOKENS)
        assert conn.get_num_new_matched_tokens(other, 0) == (0, False)  # pending: not visible yet
        conn.update_connector_output(KVConnectorOutput(finished_sending={"a"}))
        assert conn.get_num_new_matched_tokens(other, 0) == (4 * C, False)
        idle = Request("c", [1, 2, 3])
        conn.get_num_new_matched_tokens(idle, 0)
        assert conn.request_finished_all_groups(idle, ([],)) == (False, None)
    finally:
        conn.shutdown()


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


def test_loaded_chunks_are_pinned_until_their_step_is_planned(harness: Build) -> None:
    cfg = KvtierConfig(chunk_size=C, tiers=(CpuTierConfig("cpu", 4 * 4096),), policy=PolicyConfig(eviction="lru"))
    h = harness(KVCacheConfig((FULL,)), cfg=cfg)  # room for exactly 4 chunks (one 4 KiB slot each)
    h.place(TOKENS, 0, [0, 1, 2, 3])
    r = Request("r", TOKENS)
    assert h.conn.get_num_new_matched_tokens(r, 0) == (4 * C, False)
    h.conn.update_state_after_alloc(r, KVCacheBlocks((list(range(1, 10)),)), 4 * C)
    other = Request("o", list(range(1000, 1033)))
    h.conn.get_num_new_matched_tokens(other, 0)
    meta = _schedule_new(h.conn, other, (list(range(20, 29)),), 0, 33)
    assert len(meta.loads) == 1
    assert not meta.saves  # no room: every chunk in the tier is pinned by r's load
    third = Request("t", list(range(2000, 2033)))
    h.conn.get_num_new_matched_tokens(third, 0)
    meta = _schedule_new(h.conn, third, (list(range(30, 39)),), 0, 33)
    evicted = {k for s in meta.saves for p in s.plans for k in p.evicted}
    assert evicted == set(h.keys(TOKENS)[0][:4])  # unpinned once planned: now evictable


def test_output_tokens_are_saved_once_their_chunk_is_full(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    req = Request("r", TOKENS[:20])
    h.conn.get_num_new_matched_tokens(req, 0)
    ids = list(range(1, 10))
    meta = _schedule_new(h.conn, req, (ids,), 0, 20)
    assert [len(s.keys) for s in meta.saves] == [2]
    req.output_token_ids.extend([7, 7, 7, 7, 7])  # the engine appends sampled tokens: 25 tokens known
    cached = CachedRequestData(req_ids=["r"], new_block_ids=[None], num_computed_tokens=[23])
    meta = h.conn.build_connector_meta(SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 1}))
    keys = h.keys([*TOKENS[:20], 7, 7, 7, 7])[0]
    assert [s.keys for s in meta.saves] == [(keys[2],)]
    assert meta.saves[0].block_ids == ((5, 6),)


@dataclass
class MMRequest(Request):
    """An engine request with vLLM 0.33's multimodal / prompt-embeds attributes."""

    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None


@dataclass
class MMNewRequestData(NewRequestData):
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None


def _image(ident: str, offset: int = 2, length: int = 20) -> SimpleNamespace:
    return SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=offset, length=length))


def test_same_placeholders_different_images_never_share_kv(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    cat = MMRequest("cat", TOKENS, mm_features=[_image("img-cat")])
    cat_keys = request_keys(h.spaces, TOKENS, C, request_extra(cat))
    h.loop.run(h.store.put([(k, torch.zeros(4)) for k in cat_keys[0][:4]], tiers=["cpu"]))
    assert h.conn.get_num_new_matched_tokens(cat, 0) == (4 * C, False)
    dog = MMRequest("dog", TOKENS, mm_features=[_image("img-dog")])
    assert h.conn.get_num_new_matched_tokens(dog, 0) == (0, False)
    moved = MMRequest("moved", TOKENS, mm_features=[_image("img-cat", offset=3)])
    assert h.conn.get_num_new_matched_tokens(moved, 0) == (0, False)
    old_style = MMRequest("old", TOKENS, mm_features=[SimpleNamespace(mm_hash="img-cat", mm_position=None)])
    assert request_extra(old_style) != request_extra(MMRequest("x", TOKENS))
    assert h.conn.get_num_new_matched_tokens(MMRequest("plain", TOKENS), 0) == (0, False)


def test_new_request_data_path_keys_multimodal_requests_like_the_lookup(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    ids = list(range(1, 10))
    request = MMRequest("n", TOKENS, mm_features=[_image("img-cat")])
    assert h.conn.get_num_new_matched_tokens(request, 0) == (0, False)
    new = MMNewRequestData("n", TOKENS, (ids,), 0, mm_features=[_image("img-cat")])
    meta = h.conn.build_connector_meta(SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={"n": 2 * C}))
    expected = request_keys(h.spaces, TOKENS, C, request_extra(request))
    assert [s.keys for s in meta.saves] == [tuple(expected[0][:2])]
    assert expected[0][0] != h.keys(TOKENS)[0][0]


def test_requests_never_looked_up_plan_no_saves(harness: Build) -> None:
    """Without the engine's request (cache salt, LoRA) the keys could miss the tenant: nothing is saved."""
    h = harness(KVCacheConfig((FULL,)))
    new = MMNewRequestData("u", TOKENS, (list(range(1, 10)),), 0)
    meta = h.conn.build_connector_meta(SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={"u": 3 * C}))
    assert meta.saves == []


def test_prompt_embeds_requests_never_hit_and_never_save(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    h.place(TOKENS, 0, [0, 1, 2, 3])
    embeds = torch.zeros(len(TOKENS), 4)
    req = MMRequest("e", TOKENS, prompt_embeds=embeds)
    assert h.conn.get_num_new_matched_tokens(req, 0) == (0, False)
    ids = list(range(1, 10))
    h.conn.update_state_after_alloc(req, KVCacheBlocks((ids,)), 0)
    new = MMNewRequestData("e", TOKENS, (ids,), 0, prompt_embeds=embeds)
    meta = h.conn.build_connector_meta(SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={"e": 3 * C}))
    assert meta.saves == [] and meta.loads == []
    # only the scheduler output says so (no lookup first): still no saves
    other = MMNewRequestData("f", TOKENS, (ids,), 0, prompt_embeds=embeds)
    meta = h.conn.build_connector_meta(SchedulerOutput(scheduled_new_reqs=[other], num_scheduled_tokens={"f": 3 * C}))
    assert meta.saves == []
