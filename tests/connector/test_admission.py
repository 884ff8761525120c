"""The save admission (``policy.admission: learned``): a class of requests whose chunks nobody asks for again stops
saving, it still learns from the chunks it did not save, reuse brings saving back, and what it saves loads bit
for bit (real cpu tier, both connector halves driven as vLLM drives them); a declined request still promotes what
it loaded, and with a shared tier placed every chunk is saved (unless it is private).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from scheduler_harness import FULL, MAMBA, Build, Harness, schedule_new
from scheduler_harness import C as SC
from worker_kit import A_IDS, B_IDS, C, Engine, make_cfg, paged

from kvtier.config import (
    ConfigError,
    CpuTierConfig,
    DiskTierConfig,
    KvtierConfig,
    PolicyConfig,
    RedisTierConfig,
    TierConfig,
    WritePolicy,
    load_config,
)
from kvtier.connector.scheduler import admission
from kvtier.connector.scheduler.admission import SaveAdmission, request_class
from kvtier.connector.scheduler.half import SchedulerHalf
from kvtier.control.directory import Directory, TierSlot
from kvtier.control.policy import make_policy
from kvtier.engine.types import KVCacheBlocks, KVConnectorBlockState, NewRequestData, Request, SchedulerOutput
from kvtier.layout import KVCacheConfig
from kvtier.layout.geometry import NULL_BLOCK
from kvtier.records.keys import Key

KEYS = [Key(i.to_bytes(4, "big") * 8) for i in range(64)]


def test_request_classes_bucket_the_hit_depth_and_the_prompt_length_in_powers_of_two() -> None:
    assert request_class(0, 0) != request_class(0, 1) != request_class(0, 2) == request_class(0, 3)
    assert request_class(2, 8) == request_class(3, 15) != request_class(4, 15)
    assert request_class(1000, 1000) == admission.DEPTH_BUCKETS * admission.SIZE_BUCKETS - 1


def test_a_class_is_judged_on_a_window_old_enough_for_its_reuses_to_have_come(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "WARMUP", 4)
    gate = SaveAdmission(ghosts=8, min_reuse=0.25)
    gate.offer(0, KEYS[:8])
    assert gate.matched(0) == (0, 0) and gate.admits(0)  # its chunks could still be asked for: saved
    gate.offer(0, KEYS[8:16])
    assert gate.lag() == 8 and gate.matched(0) == (8, 0)  # no reuse yet: judged on offers a whole window old
    assert not gate.admits(0) and gate.admits(1)  # another class is still warming up
    assert gate.asked([KEYS[14], KEYS[15]]) == 2  # asked past the engine's hit: reuses, though not saved
    assert gate.lag() == 2  # they came within 2 offers: judged on the window that ended 2 offers ago
    assert gate.matched(0) == (8, 2) and gate.admits(0)
    assert gate.asked([KEYS[13], KEYS[0], KEYS[12]]) == 1  # a run from the hit point; KEYS[0] is forgotten


def test_before_a_lag_and_a_window_have_passed_offers_and_reuses_are_counted_over_spans_as_long(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two classes alternate. Class 1's chunks are each asked for again 40 offers later (the lag becomes the whole
    window); one chunk of class 0 in 8 is asked for again 4 offers later, under its min_reuse of 1 in 4. After 96
    offers the offers a lag old span 32: against all of a window's reuses (those of the later offers too) class 0
    would look reused 1 in 4 and stay saved; over spans as long it is 1 in 8 and declined."""
    monkeypatch.setattr(admission, "WARMUP", 4)
    gate = SaveAdmission(ghosts=64, min_reuse=0.25)

    def key(cls: int, i: int) -> Key:
        return Key(bytes([cls]) + i.to_bytes(4, "big") * 7 + b"abc")

    for t in range(96):
        gate.offer(t % 2, [key(t % 2, t)])
        if t % 2 == 1 and t >= 41:
            assert gate.asked([key(1, t - 40)]) == 1
        if t % 16 == 0 and t >= 4:
            assert gate.asked([key(0, t - 4)]) == 1
    assert gate.lag() == 64
    assert gate.matched(0) == (16, 2) and not gate.admits(0)
    assert gate.matched(1) == (16, 17) and gate.admits(1)


def test_ghosts_and_marks_stay_bounded() -> None:
    gate = SaveAdmission(ghosts=64, min_reuse=0.1)
    for i in range(100):
        gate.offer(i % 3, [Key(i.to_bytes(4, "big") * 8 + bytes([j])) for j in range(30)])
    assert len(gate) == 64
    assert len(gate._marks) <= 2 * admission.MARKS_PER_WINDOW + 2
    assert sum(gate.matched(0)) > 0
    with pytest.raises(ValueError):
        SaveAdmission(0, 0.1)


def test_the_config_takes_all_or_learned_and_a_share_between_0_and_1(tmp_path: Path) -> None:
    base = {"chunk_size": 32, "tiers": [{"name": "cpu", "kind": "cpu", "capacity": "64MiB"}]}
    cfg = load_config({**base, "policy": {"admission": "learned", "admission_min_reuse": 0.2}})
    assert (cfg.policy.admission, cfg.policy.admission_min_reuse) == ("learned", 0.2)
    assert load_config(base).policy.admission == "learned"
    with pytest.raises(ConfigError, match=r"policy\.admission"):
        load_config({**base, "policy": {"admission": "some"}})
    with pytest.raises(ConfigError, match=r"policy\.admission_min_reuse.*between 0 and 1"):
        load_config({**base, "policy": {"admission_min_reuse": 2}})


def _tokens(n: int) -> list[int]:
    return [1000 * n + t for t in range(5 * C)]  # 5 chunks; a lookup covers the first 4


def _serve(eng: Engine, name: str, tokens: list[int]) -> tuple[int, int]:
    """One request: its lookup, then its prefill into A_IDS (or its load into B_IDS on a hit); the tokens it hit and
    the chunks it saved."""
    req = Request(name, tokens)
    hit, is_async = eng.sched.get_num_new_matched_tokens(req, 0)
    assert is_async is False
    ids = B_IDS if hit else A_IDS
    eng.sched.update_state_after_alloc(req, KVCacheBlocks((ids,)), hit)
    out = eng.run_prefill(req, ids, hit)
    saved = (out.kv_connector_stats.data if out.kv_connector_stats else {}).get("save_chunks", 0)
    eng.sched.request_finished(req, ids)
    eng.work.flush_saves()
    eng.step(SchedulerOutput(finished_req_ids={name}))
    return hit, int(saved)


def test_one_off_prompts_stop_saving_and_a_prompt_asked_again_is_saved_and_loads_bit_for_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "WARMUP", 4)
    monkeypatch.setattr(admission, "MAX_GHOSTS", 10)  # a window of 10 chunks
    cfg = make_cfg(tmp_path, ("cpu",))
    cfg = type(cfg)(chunk_size=cfg.chunk_size, tiers=cfg.tiers,
                    policy=PolicyConfig(eviction="lru", write=WritePolicy.WRITE_BACK, admission="learned",
                                        admission_min_reuse=0.5))
    kv = paged(9)
    eng = Engine(cfg, kv)
    try:
        saved = [_serve(eng, f"once{i}", _tokens(i))[1] for i in range(4)]
        assert saved == [5, 5, 5, 0]  # offers a window old (10 chunks) and no reuse since: the class stops saving
        assert _serve(eng, "p1", _tokens(7)) == (0, 0)  # the same class: not saved, but remembered
        before = {n: t[:, B_IDS].clone() for n, t in kv.items()}
        assert _serve(eng, "p2", _tokens(7)) == (0, 5)  # asked again: a deep class of its own, saved
        assert all(torch.equal(t[:, B_IDS], before[n]) for n, t in kv.items())  # nothing loaded yet
        assert _serve(eng, "p3", _tokens(7)) == (4 * C, 0)  # and hit
        for name, t in kv.items():  # the 8 blocks of the 4 chunks hold A's bytes: loaded, not recomputed
            assert torch.equal(t[:, B_IDS[:8]], t[:, A_IDS[:8]]), name
            assert torch.equal(t[:, B_IDS[8:]], before[name][:, 8:]), name
        stats = eng.sched.get_kv_connector_stats()
        assert stats is not None
        assert (stats.data["directory_admitted"], stats.data["directory_declined"]) == (17, 10)
    finally:
        eng.close()


def _planned(h: Harness, name: str, tokens: list[int], ids: list[int]) -> list[int]:
    """Look ``tokens`` up, allocate ``ids`` for whatever it hit, schedule its prefill: the chunk indices (group 0)
    the step plans to save from the engine's blocks."""
    req = Request(name, tokens)
    hit, _ = h.conn.get_num_new_matched_tokens(req, 0)
    h.conn.update_state_after_alloc(req, KVCacheBlocks((ids,)), hit)
    meta = schedule_new(h.conn, req, (ids,), 0, len(tokens))
    keys = h.keys(tokens)[0]
    return sorted(keys.index(k) for spec in meta.saves for k in spec.keys)


def _learned(tiers: tuple[TierConfig, ...]) -> KvtierConfig:
    return KvtierConfig(chunk_size=SC, tiers=tiers, policy=PolicyConfig(eviction="lru", write=WritePolicy.WRITE_BACK,
                                                                        admission="learned"))


def test_a_declined_request_still_promotes_the_chunks_it_loaded(
        harness: Build, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "WARMUP", 1)
    monkeypatch.setattr(admission, "MAX_GHOSTS", 4)
    cfg = _learned((CpuTierConfig("cpu", 1 << 20), DiskTierConfig("disk", 1 << 22, path=str(tmp_path))))
    h = harness(KVCacheConfig((FULL,)), cfg=cfg)
    ids = list(range(1, 15))
    assert _planned(h, "once0", [1000 + t for t in range(7 * SC)], ids) == list(range(7))  # saved: warming up
    assert _planned(h, "once1", [2000 + t for t in range(7 * SC)], ids) == []  # no reuse a window later: declined
    tokens = [3000 + t for t in range(7 * SC)]
    h.place(tokens, 0, [0, 1, 2, 3], tier="disk")  # its class is declined, but it hits 4 chunks on disk
    assert _planned(h, "hit", tokens, ids) == [0, 1, 2, 3]  # promoted into cpu; its 3 new chunks are not saved


@pytest.mark.parametrize("redis", [None, "shared", "private"])
def test_with_a_shared_tier_placed_every_chunk_is_saved_unless_it_is_private(
        monkeypatch: pytest.MonkeyPatch, redis: str | None) -> None:
    """Other engines' reuse of what this one saves in Redis is invisible here: learning would decline it. A Redis
    tier no other engine reads (``private: true``) is judged as a local tier is."""
    monkeypatch.setattr(admission, "WARMUP", 1)
    monkeypatch.setattr(admission, "MAX_GHOSTS", 4)
    tiers: tuple[TierConfig, ...] = (CpuTierConfig("cpu", 1 << 20),)
    slots = [TierSlot("cpu", 1 << 20, make_policy("lru"))]
    if redis:
        tiers += (RedisTierConfig("redis", 1 << 30, url="redis://127.0.0.1:1/0", private=redis == "private"),)
        slots.append(TierSlot("redis", 1 << 30, make_policy("lru"), shared=True))
    stand_ins = {t.name: SimpleNamespace(name=t.name, stored_size=lambda n: n) for t in tiers}
    half = SchedulerHalf(_learned(tiers), KVCacheConfig((FULL,)), [bytes(16)],
                         directory=Directory(slots), tiers=stand_ins)  # type: ignore[arg-type]
    planned = []
    for i in range(3):
        tokens = [1000 * i + t for t in range(7 * SC)]
        req = SimpleNamespace(request_id=f"r{i}", prompt_token_ids=tokens, all_token_ids=tokens, cache_salt=None,
                              prompt_embeds=None, lora_request=None, mm_features=None, mm_hashes=None)
        half.get_num_new_matched_tokens(req, 0)
        meta = half.build_connector_meta(SchedulerOutput(
            scheduled_new_reqs=[NewRequestData(f"r{i}", tokens, (list(range(1, 15)),), 0)],
            num_scheduled_tokens={f"r{i}": len(tokens)}))
        planned.append(sum(len(spec.keys) for spec in meta.saves))
    assert planned == ([7, 7, 7] if redis == "shared" else [7, 0, 0])


def test_chunks_a_request_loaded_are_remembered_so_their_next_reuse_is_seen(harness: Build) -> None:
    """Chunks in a tier that the admission never saw offered (adopted at start, say): the request that loads them
    offers them, so the next turn's lookup credits its whole prefix as reuse and offers only its new chunks."""
    h = harness(KVCacheConfig((FULL,)), cfg=_learned((CpuTierConfig("cpu", 1 << 20),)))
    turn = [4000 + t for t in range(7 * SC)]
    h.place(turn, 0, [0, 1, 2, 3])
    assert _planned(h, "b", turn, list(range(1, 15))) == [4, 5, 6]  # loads 0-3, saves its own chunks
    assert _offered(h) == (7, 0)
    _planned(h, "c", turn + [5000 + t for t in range(3 * SC)], list(range(1, 21)))
    assert _offered(h) == (3, 0)  # 0-6 were asked for again: only 7-9 are new


def _offered(h: Harness) -> tuple[int, int]:
    stats = h.conn.get_kv_connector_stats()
    data = stats.data if stats is not None else {}
    return data.get("directory_admitted", 0), data.get("directory_declined", 0)


def test_the_lag_follows_reuses_that_come_sooner_than_before() -> None:
    """The reuse ages are counted with a half-life of one window: after many windows of reuses a whole window
    late, reuses that come 4 offers after their offer bring the lag down within 4 windows (without the decay it
    would take 64: 40 windows of 24 old reuses against 60 new ones a window)."""
    window = 64
    gate = SaveAdmission(ghosts=window, min_reuse=0.1)

    def rounds(n: int, age: int, start: int) -> None:
        for r in range(start, start + n):
            keys = [Key(r.to_bytes(4, "big") + i.to_bytes(4, "big") * 7) for i in range(window)]
            for i, key in enumerate(keys):
                gate.offer(0, [key])
                if i >= age:
                    gate.asked([keys[i - age]])

    rounds(40, 40, 0)  # reuses 40 offers late: the lag is the whole window (ages in powers of two)
    assert gate.lag() == window
    rounds(4, 4, 40)
    assert gate.lag() <= 8


def test_with_a_store_threshold_only_chunks_asked_for_often_enough_are_offered(
        harness: Build, monkeypatch: pytest.MonkeyPatch) -> None:
    """``policy.store_threshold`` goes first: a prompt asked for once is neither saved nor offered (the admission
    learns nothing from chunks no request could save); asked for a second time, the chunks its lookups asked for
    are offered and saved: all but the last, which no lookup of this prompt asks for (one token is always
    computed)."""
    monkeypatch.setattr(admission, "WARMUP", 1)
    cfg = KvtierConfig(chunk_size=SC, tiers=(CpuTierConfig("cpu", 1 << 20),),
                       policy=PolicyConfig(eviction="lru", write=WritePolicy.WRITE_BACK, admission="learned",
                                           store_threshold=2))
    h = harness(KVCacheConfig((FULL,)), cfg=cfg)
    tokens, ids = [6000 + t for t in range(7 * SC)], list(range(1, 15))
    assert _planned(h, "a", tokens, ids) == [] and _offered(h) == (0, 0)
    assert _planned(h, "b", tokens, ids) == list(range(6)) and _offered(h) == (6, 0)


def test_a_declined_hybrid_request_saves_neither_its_kv_nor_its_recurrent_states(
        harness: Build, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid model's states are saved under the request's one decision, as its attention KV is: a state without
    its attention prefix (or the reverse) is no hit."""
    monkeypatch.setattr(admission, "WARMUP", 1)
    monkeypatch.setattr(admission, "MAX_GHOSTS", 2)  # a window of 2 chunks: the first request fills two
    h = harness(KVCacheConfig((FULL, MAMBA)), cfg=_learned((CpuTierConfig("cpu", 1 << 20),)))
    saved = []
    for i in range(2):
        name, tokens = f"r{i}", [1000 * (i + 1) + t for t in range(4 * SC + 1)]
        h.conn.get_num_new_matched_tokens(Request(name, tokens), 0)
        blocks = (list(range(1, 10)), [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 21])
        meta = h.conn.build_connector_meta(SchedulerOutput(
            scheduled_new_reqs=[NewRequestData(name, tokens, blocks, 0)], num_scheduled_tokens={name: 4 * SC},
            kv_connector_block_state=KVConnectorBlockState({name: [(1, 21, 4 * SC)]})))
        saved.append(sorted((spec.group, len(spec.keys)) for spec in meta.saves))
    assert saved == [[(0, 4), (1, 1)], []]  # warming up: KV and the state at chunk 3; then declined: neither
