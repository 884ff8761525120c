"""Chunk events (kvtier.control.events): what the directory records entering and leaving each tier, and the scheduler's
catalogue that names each chunk in an engine's terms (kvtier.connector.scheduler.chunk_events)."""

from __future__ import annotations

from types import SimpleNamespace

from kvtier.connector.scheduler.chunk_events import ChunkEvents
from kvtier.control.directory import Directory, TierSlot
from kvtier.control.events import EventKind, EventLog
from kvtier.control.policy import make_policy
from kvtier.layout import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def directory(*caps: int, shared: tuple[str, ...] = ()) -> Directory:
    names = ["t0", "t1", "t2"][: len(caps)]
    d = Directory([TierSlot(n, c, make_policy("lru"), n in shared) for n, c in zip(names, caps, strict=True)])
    d.events = EventLog()
    return d


def store(d: Directory, tier: str, keys: list[int], chain: tuple[str, ...] = ()) -> None:
    for plan in d.prepare_store(tier, [(k(i), 10, None) for i in keys], chain):
        d.complete_store(plan.tier, plan.store, True)


def flat(d: Directory) -> list[tuple[str, str, int]]:
    assert d.events is not None
    return [(e.kind.value, e.tier, int.from_bytes(key, "big")) for e in d.events.take() for key in e.keys]


def test_a_completed_write_is_stored_and_an_eviction_is_removed() -> None:
    d = directory(20)
    store(d, "t0", [1, 2])
    assert flat(d) == [("stored", "t0", 1), ("stored", "t0", 2)]
    store(d, "t0", [3])  # evicts 1 (LRU)
    assert flat(d) == [("removed", "t0", 1), ("stored", "t0", 3)]


def test_a_demotion_is_removed_from_one_tier_and_stored_in_the_next() -> None:
    d = directory(10, 100)
    store(d, "t0", [1], chain=("t1",))
    flat(d)
    store(d, "t0", [2], chain=("t1",))
    assert flat(d) == [("removed", "t0", 1), ("stored", "t1", 1), ("stored", "t0", 2)]


def test_pending_and_failed_writes_say_nothing_and_a_dropped_ready_chunk_is_removed() -> None:
    d = directory(100)
    d.prepare_store("t0", [(k(1), 10, None), (k(2), 10, None)])
    assert flat(d) == []  # pending: not yet in the tier
    d.complete_store("t0", [k(1), k(2)], [True, False])
    assert flat(d) == [("stored", "t0", 1)]
    d.prepare_store("t0", [(k(3), 10, None)])
    assert d.remove("t0", [k(1), k(3), k(9)]) == 2
    assert flat(d) == [("removed", "t0", 1)]  # k(3) was never announced, k(9) never held


def test_a_shared_tier_reports_its_writes() -> None:
    d = directory(100, 100, shared=("t1",))
    for plan in d.prepare_store("t1", [(k(1), 10, None), (k(2), 10, None)]):
        d.complete_store(plan.tier, plan.store, [True, False])
    assert flat(d) == [("stored", "t1", 1)]


def test_the_log_is_bounded_and_counts_what_it_dropped() -> None:
    log = EventLog(limit=3)
    for i in range(5):
        log.add(EventKind.STORED, "t0", [k(i)])
    events = log.take()
    assert [int.from_bytes(e.keys[0], "big") for e in events] == [2, 3, 4]
    assert log.dropped == 2 and log.take() == []


def kcc(block_size: int = 4) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=2, dtype="float32")
    return KVCacheConfig(num_blocks=8, kv_cache_groups=[KVCacheGroupSpec(("l0",), spec)])


def test_the_catalogue_names_a_chunk_by_the_engines_block_hashes_until_it_left_every_tier() -> None:
    d = Directory([TierSlot("cpu", 10, make_policy("lru")), TierSlot("disk", 100, make_policy("lru"))])
    events = ChunkEvents(d, kcc(block_size=4), chunk_size=8)
    request = SimpleNamespace(all_token_ids=list(range(100, 124)), block_hashes=[b"h%d" % i for i in range(6)])
    keys = [k(1), k(2), k(3)]
    events.note(request, 0, keys, [1])
    for plan in d.prepare_store("cpu", [(keys[1], 10, None)], ("disk",)):
        d.complete_store(plan.tier, plan.store, True)
    (stored,) = events.take()
    assert stored.kind is EventKind.STORED and stored.tier == "cpu"
    assert stored.info.block_hashes == (b"h2", b"h3") and stored.info.parent_hash == b"h1"
    assert list(stored.info.token_ids) == list(range(108, 116)) and stored.info.block_size == 4
    for plan in d.prepare_store("cpu", [(k(7), 10, None)], ("disk",)):  # demotes keys[1] to disk
        d.complete_store(plan.tier, plan.store, True)
    kinds = [(e.kind, e.tier, e.info.block_hashes) for e in events.take()]
    assert (EventKind.REMOVED, "cpu", (b"h2", b"h3")) in kinds and (EventKind.STORED, "disk", (b"h2", b"h3")) in kinds
    assert len(events) == 1  # still on disk: still described
    d.remove("disk", [keys[1]])
    (removed,) = events.take()
    assert removed.kind is EventKind.REMOVED and removed.info.block_hashes == (b"h2", b"h3")
    assert len(events) == 0


def test_without_block_hashes_a_chunk_is_named_by_kvtiers_own_hash() -> None:
    d = Directory([TierSlot("cpu", 100, make_policy("lru"))])
    events = ChunkEvents(d, kcc(), chunk_size=8)
    events.note(SimpleNamespace(prompt_token_ids=list(range(16))), 0, [k(5), k(6)], [0])
    for plan in d.prepare_store("cpu", [(k(5), 10, None)]):
        d.complete_store(plan.tier, plan.store, True)
    (stored,) = events.take()
    assert stored.info.block_hashes == (k(5)[16:],) and stored.info.block_size == 8 and stored.info.parent_hash is None
