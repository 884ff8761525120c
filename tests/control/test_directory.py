"""Directory (control plane): reservations, eviction, pins, demotion plans, lookup, deferred policy calls."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.control import directory
from kvtier.control.directory import DRAIN_BATCH, Directory, StorePlan, TierSlot
from kvtier.control.policy import LRUPolicy, make_policy


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def make(*caps: int, shared: tuple[str, ...] = ()) -> Directory:
    names = ["t0", "t1", "t2", "t3"][: len(caps)]
    return Directory([TierSlot(n, c, make_policy("lru"), n in shared) for n, c in zip(names, caps, strict=True)])


def store(d: Directory, tier: str, keys: list[int], size: int = 10, chain: tuple[str, ...] = ()) -> list[StorePlan]:
    plans = d.prepare_store(tier, [(k(i), size, None) for i in keys], chain)
    for p in plans:
        d.complete_store(p.tier, p.store, True)
    return plans


def test_pending_is_invisible_until_complete() -> None:
    d = make(100)
    plans = d.prepare_store("t0", [(k(1), 10, None)])
    assert plans == [StorePlan("t0", (k(1),))]
    assert d.lookup([k(1)]) == []
    d.complete_store("t0", [k(1)], True)
    assert d.lookup([k(1)]) == ["t0"]
    assert d.used_bytes("t0") == 10


def test_failed_store_is_forgotten_and_space_freed() -> None:
    d = make(100)
    d.prepare_store("t0", [(k(1), 40, None), (k(2), 40, None)])
    d.complete_store("t0", [k(1), k(2)], [True, False])
    assert d.lookup([k(1), k(2)]) == ["t0"]
    assert d.used_bytes("t0") == 40


def test_lookup_stops_at_first_miss_and_spans_tiers() -> None:
    d = make(100, 100)
    store(d, "t0", [1])
    store(d, "t1", [2, 4])
    assert d.lookup([k(1), k(2), k(3), k(4)]) == ["t0", "t1"]
    assert d.lookup([k(1), k(2)], ["t1"]) == []
    assert d.lookup([k(1), k(2)], []) == []  # an empty chain searches no tier, not every tier


def test_locate_goes_past_a_gap_only_when_asked_and_finds_writes_in_flight_where_space_is_reserved() -> None:
    d = make(100, 100, 100, shared=("t2",))
    store(d, "t0", [1])
    store(d, "t1", [3, 4])
    d.prepare_store("t1", [(k(2), 10, None), (k(5), 10, None)])  # reserved, written by a save in flight
    keys = [k(i) for i in range(1, 7)]
    assert d.locate(keys).tiers == ["t0", None, None, None, None, None]  # stops at the first miss
    assert d.locate(keys, whole=True).tiers == ["t0", None, "t1", "t1", None, None]
    in_flight = d.locate(keys, whole=True, writing=lambda tier, key: key == k(2))
    assert in_flight.tiers == ["t0", "t1", "t1", "t1", None, None] and in_flight.writing == {1}
    assert in_flight.prefix() == ["t0", "t1", "t1", "t1"] == d.locate(keys, writing=lambda t, key: key == k(2)).prefix()
    assert d.locate(keys, ["t2"], whole=True).tiers == [None] * 6  # a shared tier is asked by its client, not here
    assert d.lookup(keys) == d.locate(keys).prefix() == ["t0"]


def test_a_lookup_is_counted_unless_told_not_to() -> None:
    d = make(100)
    store(d, "t0", [1, 2])
    d.locate([k(1), k(2), k(3)], count=False)
    assert (d.stats.lookups, d.stats.hits) == (0, 0)
    d.locate([k(1), k(3), k(2)], whole=True)
    assert (d.stats.lookups, d.stats.hits) == (3, 2)


def test_eviction_keeps_capacity_and_uses_policy_order() -> None:
    d = make(30)
    store(d, "t0", [1, 2, 3])
    d.touch("t0", [k(1)])
    plans = store(d, "t0", [4])
    assert plans == [StorePlan("t0", (k(4),), (k(2),))]
    assert d.used_bytes("t0") == 30
    assert d.lookup([k(1)]) == ["t0"] and d.lookup([k(2)]) == []


def test_pinned_and_pending_are_never_evicted() -> None:
    d = make(20)
    store(d, "t0", [1])
    d.pin("t0", [k(1)])
    d.prepare_store("t0", [(k(2), 10, None)])  # pending
    plans = d.prepare_store("t0", [(k(3), 10, None)])
    assert plans == [] and d.stats.refused == 1
    d.unpin("t0", [k(1)])
    plans = d.prepare_store("t0", [(k(3), 10, None)])
    assert plans == [StorePlan("t0", (k(3),), (k(1),))]


def test_oversized_record_is_refused() -> None:
    d = make(10)
    assert d.prepare_store("t0", [(k(1), 11, None)]) == []
    assert d.used_bytes("t0") == 0


def test_write_back_demotes_victims_down_the_chain() -> None:
    d = make(20, 20, 100)
    store(d, "t0", [1, 2], chain=("t1", "t2"))
    store(d, "t0", [3, 4], chain=("t1", "t2"))
    assert d.lookup([k(1), k(2), k(3), k(4)]) == ["t1", "t1", "t0", "t0"]
    plans = store(d, "t0", [5, 6], chain=("t1", "t2"))
    # deepest first: t2 takes 1,2 from t1; t1 takes 3,4 from t0; t0 takes 5,6 from the engine.
    assert plans == [
        StorePlan("t2", (k(1), k(2)), (), "t1"),
        StorePlan("t1", (k(3), k(4)), (k(1), k(2)), "t0"),
        StorePlan("t0", (k(5), k(6)), (k(3), k(4)), None),
    ]
    assert d.lookup([k(i) for i in range(1, 7)]) == ["t2", "t2", "t1", "t1", "t0", "t0"]


def test_shared_tier_is_not_tracked() -> None:
    d = make(10, 10, shared=("t1",))
    plans = d.prepare_store("t1", [(k(1), 50, None)])
    assert plans == [StorePlan("t1", (k(1),))]
    d.complete_store("t1", [k(1)], True)
    assert d.lookup([k(1)]) == [] and d.used_bytes("t1") == 0


def test_adopt_respects_capacity() -> None:
    d = make(25)
    assert d.adopt("t0", [(k(1), 10), (k(2), 10), (k(3), 10)]) == 2
    assert d.lookup([k(1), k(2)]) == ["t0", "t0"]


def test_disown_forgets_only_adopted_records_that_are_ready_and_unpinned_with_no_event() -> None:
    """What a tier no longer lists once described: gone from the directory and its bytes freed; a record a load
    holds, or one being written, stays; no event (the adoption had none)."""
    from kvtier.control.events import EventLog

    d = make(100)
    d.events = EventLog()
    d.adopt("t0", [(k(1), 10), (k(2), 10)])
    d.pin("t0", [k(2)])
    d.prepare_store("t0", [(k(3), 10, None)])  # pending
    assert d.disown("t0", [k(1), k(2), k(3), k(9)]) == 1
    assert d.lookup([k(1)]) == [] and d.contains("t0", k(2)) and d.holds("t0", k(3))
    assert d.used_bytes("t0") == 20
    assert not d.events.take()


def test_remove_frees_space() -> None:
    d = make(100)
    store(d, "t0", [1, 2])
    assert d.remove("t0", [k(1), k(9)]) == 1
    assert d.used_bytes("t0") == 10 and len(d) == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "pin", "unpin", "remove", "fail"]),
                          st.integers(0, 15), st.integers(1, 40)), max_size=80))
def test_capacity_never_exceeded(ops: list[tuple[str, int, int]]) -> None:
    d = make(100, 60)
    for op, key, size in ops:
        if op == "put":
            for p in d.prepare_store("t0", [(k(key), size, None)], ("t1",)):
                d.complete_store(p.tier, p.store, True)
        elif op == "fail":
            for p in d.prepare_store("t0", [(k(key), size, None)], ("t1",)):
                d.complete_store(p.tier, p.store, False)
        elif op == "pin":
            d.pin("t0", [k(key)])
        elif op == "unpin":
            d.unpin("t0", [k(key)])
        else:
            d.remove("t0", [k(key)])
        assert 0 <= d.used_bytes("t0") <= 100
        assert 0 <= d.used_bytes("t1") <= 60


def test_thread_safety_of_concurrent_stores() -> None:
    d = make(10_000)

    def worker(base: int) -> None:
        for i in range(200):
            for p in d.prepare_store("t0", [(k(base + i), 10, None)]):
                d.complete_store(p.tier, p.store, True)

    threads = [threading.Thread(target=worker, args=(n * 1000,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert d.used_bytes("t0") == 8000 and len(d) == 800


class RecordingLRU(LRUPolicy):
    """LRU that remembers the parent each key was inserted with."""

    def __init__(self, capacity: int = 0) -> None:
        super().__init__(capacity)
        self.parents: dict[bytes, bytes | None] = {}

    def insert(self, key: bytes, parent: bytes | None = None) -> None:
        self.parents[key] = parent
        super().insert(key, parent)


def test_demotion_keeps_the_parent_for_prefix_aware_policies() -> None:
    lower = RecordingLRU()
    d = Directory([TierSlot("t0", 20, make_policy("lru")), TierSlot("t1", 100, lower)])
    entries = [(k(1), 10, None), (k(2), 10, k(1))]
    for p in d.prepare_store("t0", entries, ("t1",)):
        d.complete_store(p.tier, p.store, True)
    for p in d.prepare_store("t0", [(k(3), 10, k(2)), (k(4), 10, k(3))], ("t1",)):
        d.complete_store(p.tier, p.store, True)
    assert lower.parents == {k(1): None, k(2): k(1)}


class Jobs:
    """A ``schedule`` for ``Directory.defer_policy`` that keeps the jobs until the test runs them."""

    def __init__(self) -> None:
        self.jobs: list[Callable[[], None]] = []

    def __call__(self, job: Callable[[], None]) -> None:
        self.jobs.append(job)

    def run_all(self) -> int:
        """Run jobs (and those they schedule) until none is left; how many ran."""
        ran = 0
        while self.jobs:
            self.jobs.pop(0)()
            ran += 1
        return ran


def test_deferred_policy_calls_wait_for_a_drain_but_a_victim_is_chosen_on_all_of_them() -> None:
    policy = LRUPolicy()
    d = Directory([TierSlot("t0", 30, policy)])
    jobs = Jobs()
    d.defer_policy(jobs)
    store(d, "t0", [1, 2, 3])
    d.touch("t0", [k(1)])
    assert len(policy) == 0 and d.queued_calls() == 4 and len(jobs.jobs) == 1  # one drain due, nothing applied
    store(d, "t0", [4])  # needs room: the queue is applied first, so key 1's touch counts
    assert d.lookup([k(1)]) == ["t0"] and d.lookup([k(2)]) == []
    assert d.queued_calls() == 1  # key 4's insert, queued behind the eviction
    jobs.run_all()
    assert d.queued_calls() == 0 and k(4) in policy


def test_deferred_policy_calls_drain_in_batches_in_their_order() -> None:
    """The same operations, deferred and drained in batches or applied at once, evict the same keys."""
    rng = random.Random(7)
    ops = [(rng.choice(["put", "put", "touch", "remove"]), rng.randrange(60)) for _ in range(600)]
    victims = []
    for deferred in (False, True):
        d = Directory([TierSlot("t0", 300, make_policy("adaptive", 30))])
        jobs = Jobs()
        if deferred:
            d.defer_policy(jobs)
        gone, backlog = [], 0
        for n, (op, key) in enumerate(ops):
            if op == "put":
                gone += [p.evicted for p in store(d, "t0", [key])]
            elif op == "touch":
                d.touch("t0", [k(key)])
            else:
                d.remove("t0", [k(key)])
            if n % 97 == 0:
                backlog = max(backlog, d.queued_calls())
                jobs.run_all()
                assert d.queued_calls() == 0
        victims.append(gone)
    assert victims[0] == victims[1] and sum(map(len, victims[0])) > 50
    assert backlog > DRAIN_BATCH  # the drains had more than one batch to apply


def test_a_schedule_that_fails_turns_deferring_off() -> None:
    policy = LRUPolicy()
    d = Directory([TierSlot("t0", 100, policy)])

    def closed(job: Callable[[], None]) -> None:
        raise RuntimeError("Event loop is closed")

    d.defer_policy(closed)
    store(d, "t0", [1])
    assert d.queued_calls() == 0 and k(1) in policy
    store(d, "t0", [2])
    assert k(2) in policy


def test_hold_pins_and_touches_under_one_call() -> None:
    d = make(30)
    store(d, "t0", [1, 2, 3])
    d.hold("t0", [k(1)])  # touched: key 2 is now the oldest
    store(d, "t0", [4])
    assert d.lookup([k(1)]) == ["t0"] and d.lookup([k(2)]) == []
    d.touch("t0", [k(3), k(4)])  # key 1 is the oldest now, but pinned: key 3 goes
    store(d, "t0", [5])
    assert d.lookup([k(1)]) == ["t0"] and d.lookup([k(3)]) == []
    d.unpin("t0", [k(1)])
    store(d, "t0", [6])  # unpinned, the oldest goes
    assert d.lookup([k(1)]) == []


def test_a_full_queue_applies_its_oldest_calls_and_turning_deferring_off_applies_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(directory, "MAX_QUEUED", 4)
    policy = LRUPolicy()
    d = Directory([TierSlot("t0", 1000, policy)])
    jobs = Jobs()  # never run: a stalled drainer
    d.defer_policy(jobs)
    store(d, "t0", list(range(12)))
    assert d.queued_calls() <= 4 and k(0) in policy and k(11) not in policy  # the oldest went first
    d.defer_policy(None)
    assert d.queued_calls() == 0 and len(policy) == 12


def test_a_drain_that_never_ran_is_scheduled_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A drain job lost with its loop (stopped, not closed) does not stop the queue from draining."""
    d = make(100)
    jobs = Jobs()
    d.defer_policy(jobs)
    store(d, "t0", [1])
    store(d, "t0", [2])
    assert len(jobs.jobs) == 1  # one drain due at a time
    monkeypatch.setattr(directory, "LOST_DRAIN_S", 0.0)
    store(d, "t0", [3])
    assert len(jobs.jobs) > 1  # scheduled again
    jobs.run_all()
    assert d.queued_calls() == 0
