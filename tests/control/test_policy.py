"""Eviction policies: one contract suite over every registered policy, then known answers per policy."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvtier.control.policies.hitdensity import NUM_BINS, NUM_CLASSES, TAIL, PrefixHitDensityPolicy
from kvtier.control.policy import (
    POLICIES,
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    PrefixLRUPolicy,
    S3FIFOPolicy,
    make_policy,
)


def k(i: int) -> bytes:
    return i.to_bytes(4, "big")


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    return make_policy(request.param, 8)


# ---- contract: every registered policy ---------------------------------------------------------------------


def test_registry_names_match_classes() -> None:
    for name in POLICIES:
        assert make_policy(name, 4).name == name
    with pytest.raises(ValueError, match=r"unknown eviction policy 'nope'.*lru"):
        make_policy("nope")


def test_insert_contains_len_remove(policy: EvictionPolicy) -> None:
    assert len(policy) == 0 and k(1) not in policy
    policy.insert(k(1), None)
    policy.insert(k(2), k(1))
    policy.insert(k(2), k(1))  # again: no duplicate
    assert len(policy) == 2 and k(1) in policy and k(2) in policy
    policy.touch(k(9))  # unknown: no-op
    policy.remove(k(9))
    assert len(policy) == 2
    policy.remove(k(1))
    assert k(1) not in policy and len(policy) == 1


def test_evict_empty_and_zero(policy: EvictionPolicy) -> None:
    assert policy.evict(3) == []
    policy.insert(k(1))
    assert policy.evict(0) == []
    assert len(policy) == 1


def test_evict_forgets_victims(policy: EvictionPolicy) -> None:
    for i in range(6):
        policy.insert(k(i), k(i - 1) if i else None)
    victims = policy.evict(4)
    assert len(victims) == 4 and len(set(victims)) == 4
    assert set(victims) <= {k(i) for i in range(6)}
    assert all(v not in policy for v in victims) and len(policy) == 2
    assert sorted(policy.evict(10)) == sorted({k(i) for i in range(6)} - set(victims))
    assert len(policy) == 0


def test_protected_never_evicted(policy: EvictionPolicy) -> None:
    for i in range(5):
        policy.insert(k(i))
    protected = {k(0), k(1), k(2)}
    victims = policy.evict(5, protected)
    assert sorted(victims) == [k(3), k(4)]
    assert policy.evict(1, protected) == []
    assert len(policy) == 3 and all(p in policy for p in protected)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("key_kind", ["bytes", "int"])
def test_random_operations_match_a_model(policy: EvictionPolicy, seed: int, key_kind: str) -> None:
    """len/contains always agree with a plain set; evict returns exactly min(n, evictable) unprotected keys.

    Keys are bytes in the store and small ints in the hit-rate replay: policies must not care."""
    rng = random.Random(seed)
    k = globals()["k"] if key_kind == "bytes" else (lambda i: i)
    held: set[Any] = set()
    for _ in range(1500):
        op = rng.random()
        key = k(rng.randrange(40))
        if op < 0.45:
            policy.insert(key, k(rng.randrange(40)) if rng.random() < 0.7 else None)
            held.add(key)
        elif op < 0.7:
            policy.touch(key)
        elif op < 0.8:
            policy.remove(key)
            held.discard(key)
        else:
            protected = {k(rng.randrange(40)) for _ in range(rng.randrange(12))}
            n = rng.randrange(6)
            victims = policy.evict(n, protected)
            assert len(victims) == min(n, len(held - protected)) == len(set(victims))
            assert not set(victims) & protected and set(victims) <= held
            held -= set(victims)
        assert len(policy) == len(held)
        assert all(h in policy for h in held)


def test_set_capacity(policy: EvictionPolicy) -> None:
    policy.set_capacity(100)
    assert policy.capacity == 100


# ---- known answers ----------------------------------------------------------------------------------------


def test_lru_order() -> None:
    p = LRUPolicy()
    for i in (1, 2, 3):
        p.insert(k(i))
    p.touch(k(1))
    assert p.evict(1) == [k(2)]
    assert p.evict(2) == [k(3), k(1)]


def test_prefix_lru_evicts_tails_first() -> None:
    p = PrefixLRUPolicy()
    p.insert(k(0))  # request 1: 0 -> 1 -> 2, in prefix order
    p.insert(k(1), k(0))
    p.insert(k(2), k(1))
    p.touch(k(0))  # request 2: 0 -> 5
    p.insert(k(5), k(0))
    # request 1's chain goes tail first; the head 0, shared and used last, goes last
    assert p.evict(4) == [k(2), k(1), k(5), k(0)]


def test_prefix_lru_touch_in_prefix_order_makes_tail_older_than_head() -> None:
    p = PrefixLRUPolicy()
    for i in range(4):
        p.insert(k(i), k(i - 1) if i else None)
    p.insert(k(10))  # an unrelated, newer root
    for i in range(4):  # the chain is reused: touched head first
        p.touch(k(i))
    assert p.evict(5) == [k(10), k(3), k(2), k(1), k(0)]


def test_plain_lru_would_evict_the_head_first() -> None:
    p = LRUPolicy()
    for i in range(4):
        p.insert(k(i), k(i - 1) if i else None)
    assert p.evict(1) == [k(0)]


def test_arc_ghost_hits_adapt_the_target() -> None:
    p = ARCPolicy(2)
    p.insert(k(1))
    p.insert(k(2))
    assert p.evict(1) == [k(1)] and k(1) in p.b1
    p.insert(k(1))  # B1 ghost hit: recency was cut short
    assert p.target_t1 == 1.0 and k(1) in p.t2 and k(1) not in p.b1
    assert p.evict(1) == [k(2)]  # T1 at its target: T1's LRU goes
    p.touch(k(1))
    p.insert(k(3))
    assert p.evict(1) == [k(3)]  # T1 still at target 1
    p.insert(k(4))
    p.target_t1 = 2.0  # T1 below target: T2's LRU goes to B2
    assert p.evict(1) == [k(1)] and k(1) in p.b2
    assert list(p.b1) == [k(2), k(3)] and list(p.b2) == [k(1)]
    p.insert(k(1))  # B2 ghost hit: frequency matters more; the step is max(1, |B1| / |B2|) = 2
    assert p.target_t1 == 0.0 and k(1) in p.t2 and not p.b2


def test_arc_ghosts_bounded_by_capacity() -> None:
    p = ARCPolicy(3)
    for i in range(20):
        p.insert(k(i))
        if len(p) > 3:
            p.evict(1)
    assert len(p.b1) <= 3 and len(p.b2) <= 3


def _scan(p: EvictionPolicy, capacity: int) -> set[bytes]:
    """Five hot keys hit once, then a scan of 100 one-time keys; returns the hot keys that survived."""
    hot = [k(i) for i in range(5)]
    for key in hot:
        p.insert(key)
    for key in hot:
        p.touch(key)
    for i in range(100, 200):
        if len(p) >= capacity:
            p.evict(1)
        p.insert(k(i))
    return {h for h in hot if h in p}


def test_s3fifo_is_scan_resistant() -> None:
    assert _scan(S3FIFOPolicy(10), 10) == {k(i) for i in range(5)}
    assert _scan(LRUPolicy(10), 10) == set()


def test_s3fifo_ghost_reinsert_goes_to_main() -> None:
    p = S3FIFOPolicy(10)
    p.insert(k(1))
    assert p.evict(1) == [k(1)] and k(1) in p.ghost
    p.insert(k(1))
    assert k(1) in p.main and k(1) not in p.small


def _request(p: EvictionPolicy, chunks: list[int]) -> list[int]:
    """What the directory does for one request: touch held chunks, insert the others, in prefix order."""
    parent, victims = None, []
    for c in chunks:
        if k(c) in p:
            p.touch(k(c))
        else:
            while len(p) >= p.capacity:
                victims += [int.from_bytes(v, "big") for v in p.evict(1)]
            p.insert(k(c), parent)
        parent = k(c)
    return victims


def _wasteful_evictions(p: EvictionPolicy, sessions: int, warmup: int) -> float:
    """Three-turn sessions, three in flight: turn j of session s is [0, s0, s1, s2, s10+j], so each turn
    reuses the session's first chunks and its last chunk (a partial block) is never reused. Returns the
    share of evictions after ``warmup`` steps that hit a chunk still needed by a later turn."""
    bad = total = 0
    for t in range(sessions + 2):
        for s in (t, t - 1, t - 2):
            if 0 <= s < sessions:
                base = 1000 * (s + 1)
                for v in _request(p, [0, base, base + 1, base + 2, base + 10 + t - s]):
                    if t >= warmup:
                        total += 1
                        vs = v // 1000 - 1
                        bad += v == 0 or (v % 1000 < 10 and t - vs < 2)
    return bad / total


def test_prefix_hd_marks_the_last_stored_chunk_of_a_request_as_tail() -> None:
    p = PrefixHitDensityPolicy(1000)
    _request(p, [0, 1000, 1001, 1010])
    _request(p, [0, 1000, 1001, 1011])
    assert p.entries[k(1010)].cls == TAIL and p.entries[k(1001)].cls != TAIL
    p.touch(k(0))  # the next request starts: the previous one stored chunk 1011 last
    assert p.entries[k(1011)].cls == TAIL


def test_prefix_hd_learns_to_evict_what_will_not_be_reused() -> None:
    assert _wasteful_evictions(PrefixHitDensityPolicy(12), 300, warmup=100) < 0.05
    assert _wasteful_evictions(LRUPolicy(12), 300, warmup=100) > 0.2


def test_prefix_lru_tails_first_evicts_each_requests_last_stored_chunk_first() -> None:
    plain, tails = PrefixLRUPolicy(100), PrefixLRUPolicy(100, tails_first=True)
    for p in (plain, tails):
        _request(p, [0, 1, 2])
        p.insert(k(5))  # the next request: 2 was the previous one's last stored chunk
        p.insert(k(6), k(5))
        p.touch(k(0))  # and again: 6 was
    assert plain.evict(3) == [k(2), k(1), k(6)]  # the oldest tick first (deepest first), then the next
    assert tails.evict(3) == [k(2), k(6), k(1)]  # the two tails first, oldest first; then plain prefix LRU


def test_prefix_lru_tails_first_keeps_a_tail_the_next_request_touches() -> None:
    p = PrefixLRUPolicy(100, tails_first=True)
    _request(p, [0, 1, 2])
    _request(p, [0, 1, 2, 3])  # 2 is touched again: no longer a tail; 3 is
    p.insert(k(9))
    assert p.evict(1) == [k(3)]
    assert p.evict(1) == [k(2)]  # then plain prefix LRU: the old chain's deepest chunk


def test_prefix_hd_queues_a_finished_request_tail_first() -> None:
    p = PrefixHitDensityPolicy(1000)
    _request(p, [0, 1, 2, 3])
    _request(p, [0, 1, 2, 3, 4])  # 0..3 reused once, in prefix order
    p.insert(k(50))  # a new request starts: the previous one is queued again, tail first
    reused_once = [key for key in p.queues[1] if key in {k(i) for i in range(4)}]
    assert reused_once == [k(3), k(2), k(1), k(0)]


def test_prefix_lru_tails_first_keeps_the_age_of_a_request_whose_calls_interleave_with_another() -> None:
    """An engine stores chunks of several requests at once: a new root from another request does not make the
    request still being stored the oldest (its chunk taken for a tail is restored when a child of it comes)."""
    p = PrefixLRUPolicy(tails_first=True)
    c, a, b = [k(i) for i in range(0, 2)], [k(i) for i in range(10, 16)], k(20)
    p.insert(c[0])
    p.insert(c[1], c[0])  # request C ends here
    p.insert(a[0])
    p.insert(a[1], a[0])
    p.insert(b)  # request B starts while A is still being stored
    for i in range(2, 6):
        p.insert(a[i], a[i - 1])
    assert p.evict(9) == [c[1], c[0], a[5], a[4], a[3], a[2], a[1], a[0], b]


def test_prefix_hd_counts_exposure_by_stamp_bucket_as_it_would_key_by_key() -> None:
    p, rng = PrefixHitDensityPolicy(0), random.Random(7)
    for i in range(30_000):
        if i % 100 == 0 and p.capacity < 400:
            p.set_capacity(p.capacity + 20)  # a tier filling up with no hint: the bin width grows
        key = k(int(rng.paretovariate(0.7)) % 2400)
        if key in p:
            p.touch(key)
        else:
            while len(p) >= max(p.capacity, 1):
                p.evict(1)
            p.insert(key, None if rng.random() < 0.3 else k(rng.randrange(2400)))
        if rng.random() < 0.01:
            p.remove(next(iter(p.entries)))
    width, top = p.bin_width, NUM_BINS - 1
    buckets = 0
    for cls, occupancy in enumerate(p.occupancy):
        keyed = [0.0] * NUM_BINS
        for entry in [*p.entries.values(), *p.ghosts.values()]:
            if entry.cls == cls:
                keyed[min((p.clock - entry.stamp) // width, top)] += 1
        counted = [0.0] * NUM_BINS
        occupancy.expose(counted, p.clock, width, p._shift, 1.0)
        assert sum(counted) == pytest.approx(sum(keyed))
        assert all(abs(c - e) <= 2 + 0.3 * e for c, e in zip(counted, keyed, strict=True)), cls
        buckets += len(occupancy.buckets)
    assert len(p.ghosts) > 100 and buckets <= NUM_CLASSES * (NUM_BINS * width // (1 << p._shift) + 2)


def test_the_config_accepts_exactly_the_policies_and_weight_modes_that_exist() -> None:
    """The config validates these names without importing the layers that implement them."""
    from kvtier.config.tree import EVICTION_POLICIES
    from kvtier.control.policy import POLICIES
    from kvtier.records.fingerprint import weights_id

    assert tuple(POLICIES) == EVICTION_POLICIES
    with pytest.raises(ValueError, match="auto, stat, content, off"):
        weights_id("/nonexistent", mode="bogus")
