"""Saves on eviction (``policy.save_at: evict``, kvtier.connector.scheduler.lazy): a computed chunk is saved only
when a step's allocation takes one of its blocks, copied when the step is bound (before any load or forward pass
writes into the block), and then hit past vLLM's own hit, bit for bit; a chunk whose block cannot be copied
safely is dropped, never saved. Both connector halves with a real cpu tier, driven as vLLM drives them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from scheduler_harness import FULL, SWA, Harness
from worker_kit import A_IDS, TOKENS, C, Engine, paged

from kvtier.config import ConfigError, CpuTierConfig, KvtierConfig, PolicyConfig, WritePolicy, load_config
from kvtier.connector.scheduler.admission import SaveAdmission
from kvtier.connector.scheduler.lazy import Held, LazySaves
from kvtier.engine.types import (
    CachedRequestData,
    KVCacheBlocks,
    KVConnectorOutput,
    NewRequestData,
    Request,
    SchedulerOutput,
)
from kvtier.layout import KVCacheConfig, KVCacheGroupSpec

OTHER = [5000 + t for t in range(5 * C)]  # another prompt of 5 chunks
X_IDS = [30, 31, 32, 33, A_IDS[6], A_IDS[7], 36, 37, 38, 39]  # takes the two blocks of A's chunk 3


def _cfg(admission: str = "all") -> KvtierConfig:
    return KvtierConfig(chunk_size=C, tiers=(CpuTierConfig("cpu", 1 << 20),),
                        policy=PolicyConfig(eviction="lru", write=WritePolicy.WRITE_BACK, admission=admission,
                                            save_at="evict"))


@pytest.fixture
def eng() -> Iterator[Engine]:
    engine = Engine(_cfg(), paged(3))
    try:
        yield engine
    finally:
        engine.close()


def _saved(out: KVConnectorOutput) -> int:
    return int((out.kv_connector_stats.data if out.kv_connector_stats else {}).get("save_chunks", 0))


def _finish(eng: Engine, name: str, ids: list[int]) -> None:
    eng.sched.request_finished(Request(name, []), ids)
    eng.work.flush_saves()
    eng.step(SchedulerOutput(finished_req_ids={name}))


def _compute_a(eng: Engine) -> int:
    """Prefill A into A_IDS and finish it: the chunks it saved (none: they are held)."""
    a = Request("A", TOKENS)
    assert eng.sched.get_num_new_matched_tokens(a, 0) == (0, False)
    eng.sched.update_state_after_alloc(a, KVCacheBlocks((A_IDS,)), 0)
    saved = _saved(eng.run_prefill(a, A_IDS))
    _finish(eng, "A", A_IDS)
    return saved


def _take_with_new_request(eng: Engine, ids: list[int], *, shown: bool = True,
                           zeroed: list[int] | None = None) -> int:
    """A new request X allocated ``ids`` (shown with its blocks, or hidden by a chain); its step's loads write into
    the blocks (noise) before the forward pass: the chunks saved in that step."""
    x = Request("X", OTHER)
    eng.sched.get_num_new_matched_tokens(x, 0)
    eng.sched.update_state_after_alloc(x, KVCacheBlocks((ids if shown else [],)), 0)
    original = eng.work.start_load_kv

    def load_then_write(metadata: object) -> None:  # what a load or the forward pass does to the blocks
        for t in eng.kv.values():
            t[:, ids] = torch.randn(t[:, ids].shape).to(t.dtype)
        original(metadata)

    eng.work.start_load_kv = load_then_write  # type: ignore[method-assign]
    out = eng.step(SchedulerOutput(scheduled_new_reqs=[NewRequestData("X", OTHER, (ids,), 0)],
                                   num_scheduled_tokens={"X": len(OTHER)}, new_block_ids_to_zero=zeroed))
    eng.work.start_load_kv = original  # type: ignore[method-assign]
    _finish(eng, "X", ids)
    return _saved(out)


def _hit_past_the_engines(eng: Engine, name: str) -> int:
    """A's prompt again with vLLM's cache still holding its first 3 chunks (A_IDS[:6]): kvtier's hit past them."""
    return eng.sched.get_num_new_matched_tokens(Request(name, TOKENS), 3 * C)[0]


def test_a_chunk_is_saved_when_an_allocation_takes_its_block_and_hits_past_the_engines_hit_bit_for_bit(
        eng: Engine) -> None:
    before = {n: t[:, A_IDS[6:8]].clone() for n, t in eng.kv.items()}  # A's chunk 3 (written by the prefill)
    assert _compute_a(eng) == 0  # computed: held, not saved
    assert _hit_past_the_engines(eng, "A1") == 0  # the tier has nothing
    assert _take_with_new_request(eng, X_IDS) == 1  # X takes chunk 3's blocks: saved, before X's writes
    assert _admitted(eng) == 1
    assert _hit_past_the_engines(eng, "A2") == C  # chunk 3 from the tier, past vLLM's 3
    b_ids = [*A_IDS[:6], 20, 21, 22, 23]
    a3 = Request("A3", TOKENS)
    assert eng.sched.get_num_new_matched_tokens(a3, 3 * C) == (C, False)
    eng.sched.update_state_after_alloc(a3, KVCacheBlocks((b_ids,)), C)
    eng.run_prefill(a3, b_ids, 3 * C)
    for name, t in eng.kv.items():  # A's bytes, never computed into these blocks: loaded
        assert torch.equal(t[:, [20, 21]], before[name]), name
    assert _admitted(eng) == 3  # A3's vLLM hit shares chunks 0-2's blocks: their first reuse saves them too


def _admitted(eng: Engine) -> int:
    """Chunks planned for saving on eviction since the last call."""
    stats = eng.sched.get_kv_connector_stats()
    return int(stats.data.get("directory_admitted", 0)) if stats is not None else 0


def test_a_block_taken_by_a_running_request_saves_its_chunk(eng: Engine) -> None:
    assert _compute_a(eng) == 0
    y = Request("Y", OTHER)
    eng.sched.get_num_new_matched_tokens(y, 0)
    eng.sched.update_state_after_alloc(y, KVCacheBlocks(([40, 41, 42, 43, 44, 45, 46, 47],)), 0)
    eng.run_prefill(y, [40, 41, 42, 43, 44, 45, 46, 47])
    grown = CachedRequestData(["Y"], set(), [([A_IDS[8], A_IDS[9]],)], [len(OTHER)])  # its decode takes chunk 4's
    out = eng.step(SchedulerOutput(scheduled_cached_reqs=grown, num_scheduled_tokens={"Y": 1}))
    assert _saved(out) == 1


@pytest.mark.parametrize("unsafe", ["zeroed", "hidden", "reset", "failed load"])
def test_a_held_chunk_whose_bytes_may_be_gone_is_dropped_unsaved(eng: Engine, unsafe: str) -> None:
    assert _compute_a(eng) == 0
    if unsafe == "zeroed":  # vLLM zeroes its block before the step
        saved = _take_with_new_request(eng, X_IDS, zeroed=[A_IDS[7]])
    elif unsafe == "hidden":  # a chain showed X without its blocks: another connector may load into them
        saved = _take_with_new_request(eng, X_IDS, shown=False)
        assert eng.sched._sched()._lazy is None  # and every later chunk is saved when computed
    else:
        if unsafe == "reset":  # vLLM's sleep mode discarded the KV memory
            assert eng.sched.reset_cache() is None
        else:  # a load failed somewhere: a held chunk may lie in, or be computed on, a block it left unfilled
            eng.sched.update_connector_output(KVConnectorOutput(invalid_block_ids={45}))
        saved = _take_with_new_request(eng, X_IDS)
    declined = eng.sched.get_kv_connector_stats()
    assert saved == (5 if unsafe == "hidden" else 0) and declined is not None  # hidden: X's own, when computed
    assert declined.data.get("directory_admitted", 0) == 0 and declined.data["directory_declined"] >= 1
    assert _hit_past_the_engines(eng, "A1") == 0  # the same steps with a safe block save it (the first test)


def test_a_save_planned_before_a_failed_load_was_reported_is_undone(eng: Engine) -> None:
    """Asynchronous scheduling plans step N+1 before step N's output: a failed load reported then undoes the saves
    on eviction planned in between (a chunk computed in step N may stand on a block the load left unfilled)."""
    assert _compute_a(eng) == 0
    x = Request("X", OTHER)
    eng.sched.get_num_new_matched_tokens(x, 0)
    eng.sched.update_state_after_alloc(x, KVCacheBlocks((X_IDS,)), 0)
    meta = eng.sched.build_connector_meta(SchedulerOutput(scheduled_new_reqs=[NewRequestData("X", OTHER, (X_IDS,), 0)],
                                                          num_scheduled_tokens={"X": len(OTHER)}))
    assert [len(s.keys) for s in meta.saves if s.evicted] == [1]  # A's chunk 3, planned
    eng.sched.update_connector_output(KVConnectorOutput(invalid_block_ids={45}))  # the last step's load failed
    eng.work.bind_connector_metadata(meta)  # the step runs as planned: the worker writes the chunk
    eng.work.start_load_kv(None)
    eng.work.wait_for_save()
    eng.work.clear_connector_metadata()
    eng.work.flush_saves()
    _finish(eng, "X", X_IDS)  # the next steps ship the drop of its key
    assert _hit_past_the_engines(eng, "A1") == 0


def test_chunks_a_request_took_are_dropped_when_it_finishes_before_its_step_is_planned(eng: Engine) -> None:
    assert _compute_a(eng) == 0
    x = Request("X", OTHER)
    eng.sched.get_num_new_matched_tokens(x, 0)
    eng.sched.update_state_after_alloc(x, KVCacheBlocks((X_IDS,)), 0)  # takes A's chunk 3
    eng.sched.request_finished(x, X_IDS)  # aborted before the step was planned: no save can be filed under it
    meta = eng.sched.build_connector_meta(SchedulerOutput(finished_req_ids={"X"}))
    assert not [s for s in meta.saves if s.evicted]
    assert _admitted(eng) == 0


def test_a_request_that_loaded_from_kvtier_saves_when_it_computes(eng: Engine) -> None:
    _compute_a(eng)
    _take_with_new_request(eng, X_IDS)  # chunk 3 saved
    b_ids = [*A_IDS[:6], 20, 21, 22, 23]
    a2 = Request("A2", TOKENS)
    assert eng.sched.get_num_new_matched_tokens(a2, 3 * C) == (C, False)
    eng.sched.update_state_after_alloc(a2, KVCacheBlocks((b_ids,)), C)
    # computed on a loaded chunk: saved at once, chunk 4 and the engine's own 0-2 (saved at compute time, as ever)
    assert _saved(eng.run_prefill(a2, b_ids, 3 * C)) == 4


def test_held_chunks_a_block_held_again_for_another_chunk_drops_the_old() -> None:
    lazy = LazySaves()
    a, b = Held(b"a" * 32, None, (1, 2)), Held(b"b" * 32, b"a" * 32, (3, 4))
    lazy.hold(a)
    lazy.hold(b)
    lazy.hold(a)  # the same chunk again: nothing changes
    assert len(lazy) == 2 and lazy.dropped == 0
    lazy.hold(Held(b"c" * 32, None, (4, 5)))  # block 4 now holds c: an allocation came in between
    assert lazy.dropped == 1 and lazy.take([3]) == []
    assert lazy.take([2, 1, 5]) == [a, Held(b"c" * 32, None, (4, 5))] and len(lazy) == 0
    lazy.hold(a)
    lazy.hold(b)
    copies = SchedulerOutput()
    copies.kv_cache_block_copies = [SimpleNamespace(src=7, dst=2)]  # type: ignore[attr-defined]  # vLLM's field
    lazy.observe(copies)  # a block copied into before the step runs: its chunk is dropped
    assert lazy.take([1, 2]) == [] and lazy.dropped == 2 and lazy.take([3]) == [b]


def test_the_config_takes_compute_or_evict(tmp_path: Path) -> None:
    base = {"chunk_size": 256, "tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1GiB"}]}
    assert load_config(base).policy.save_at == "compute"
    assert load_config({**base, "policy": {"save_at": "evict"}}).policy.save_at == "evict"
    with pytest.raises(ConfigError, match=r"policy\.save_at"):
        load_config({**base, "policy": {"save_at": "later"}})


def test_a_request_the_learned_admission_declines_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SaveAdmission, "admits", lambda self, cls: False)
    engine = Engine(_cfg("learned"), paged(3))
    try:
        assert _compute_a(engine) == 0
        assert _take_with_new_request(engine, X_IDS) == 0  # A's chunk 3 was never held
        assert _hit_past_the_engines(engine, "A1") == 0
    finally:
        engine.close()


@pytest.mark.parametrize("groups", [(FULL,), (FULL, SWA)])
def test_only_a_model_with_one_full_attention_group_holds_its_chunks(
        groups: tuple[KVCacheGroupSpec, ...], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        h = Harness(_cfg(), KVCacheConfig(groups, 64))
    try:
        lazy = h.conn._sched()._lazy
        if len(groups) == 1:
            assert lazy is not None
        else:  # a sliding window frees blocks while its request runs: saved when computed
            assert lazy is None and "evict needs one full-attention" in caplog.text
    finally:
        h.close()
