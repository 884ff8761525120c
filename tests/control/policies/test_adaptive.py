"""The adaptive default policy: it evicts as its leading shadow would, keeps bounded memory, and moves its lead
to whichever candidate wins on the stream it sees."""

from __future__ import annotations

import random
from collections.abc import Iterator

from kvtier.bench.hitrate import DirectoryStack, replay
from kvtier.bench.workloads import Request, Workload, agentic
from kvtier.control.policies.adaptive import AdaptivePolicy
from kvtier.control.policies.hitdensity import PrefixHitDensityPolicy
from kvtier.control.policy import EvictionPolicy, LRUPolicy, PrefixLRUPolicy, make_policy


def drive(p: EvictionPolicy, requests: list[tuple[int, ...]], capacity: int) -> list[int]:
    """What the directory does for each request: touch held chunks, insert the others in prefix order,
    evicting one key whenever ``capacity`` keys are held. Returns the victims in order."""
    victims: list[int] = []
    for chunks in requests:
        parent = None
        for c in chunks:
            if c in p:
                p.touch(c)
            else:
                while len(p) >= capacity:
                    victims += p.evict(1)  # type: ignore[arg-type]
                p.insert(c, parent)
            parent = c
    return victims


def sessions(n: int, seed: int) -> Iterator[tuple[int, ...]]:
    """Conversations that grow by one or two chunks a turn, interleaved at random, under a shared head 0."""
    rng = random.Random(seed)
    chains = {s: [0, 1000 * s] for s in range(1, n + 1)}
    while chains:
        s = rng.choice(list(chains))
        yield (*chains[s], 1000 * s + 999)  # the partial last chunk: never asked again
        chains[s] += [chains[s][-1] + 1 + i for i in range(rng.randint(1, 2))]
        if len(chains[s]) > 8:
            del chains[s]


def three_turn_conversations(n: int = 300) -> Workload:
    """Three turns per session, three sessions in flight; each turn's last chunk is never reused. prefix_hd
    learns to keep what the next turn needs; recency alone keeps the wrong chunks."""
    reqs = []
    for t in range(n + 2):
        for s in (t, t - 1, t - 2):
            if 0 <= s < n:
                base = 1000 * (s + 1)
                reqs.append(Request((0, base, base + 1, base + 2, base + 10 + t - s), 50))
    return Workload("three-turn", 10, tuple(reqs))


def rate(policy: EvictionPolicy, workload: Workload, capacity: int) -> float:
    return replay(workload, DirectoryStack([policy], [capacity])).hit_rate


def test_evicts_exactly_as_its_leader_while_it_leads() -> None:
    reqs = list(sessions(60, seed=1))
    adaptive = AdaptivePolicy(20)
    assert drive(adaptive, reqs, 20) == drive(PrefixLRUPolicy(20, tails_first=True), reqs, 20)
    assert adaptive.switches == 0 and adaptive.leader == 0


def test_evicts_what_the_leader_no_longer_holds_first() -> None:
    p = AdaptivePolicy(3, candidates=(LRUPolicy, PrefixLRUPolicy))
    p.leader = 1  # prefix_lru: the tail of 1 -> 2 -> 3 goes before its head
    drive(p, [(1, 2, 3)], 3)
    assert p.evict(1) == [3]
    p.insert(4)  # the LRU shadow makes room by dropping 1, which the tier still holds
    assert list(p.orphans[0]) == [1] and not p.orphans[1]
    p.leader = 0
    assert p.evict(1) == [1]  # LRU's orphan goes first
    assert not p.orphans[0] and sorted(p.evict(5)) == [2, 4] and len(p) == 0


def test_memory_is_bounded_by_the_capacity() -> None:
    p = AdaptivePolicy(50)
    drive(p, list(sessions(400, seed=2)), 50)
    assert len(p) <= 50
    assert all(len(s) <= 50 for s in p.shadows)
    assert all(len(o) <= len(p) for o in p.orphans)
    hd = p.shadows[1]
    assert isinstance(hd, PrefixHitDensityPolicy) and len(hd.ghosts) <= 4 * 50


def test_unknown_capacity_uses_the_most_keys_held() -> None:
    p = AdaptivePolicy()  # what kvtier's store builds: no capacity hint
    drive(p, list(sessions(100, seed=3)), 30)
    assert len(p) == 30 and [s.capacity for s in p.shadows] == [30, 30]
    assert all(len(s) <= 30 for s in p.shadows)


def test_moves_its_lead_to_prefix_hd_where_prefix_hd_wins() -> None:
    w = three_turn_conversations()
    adaptive = AdaptivePolicy(12)
    hd, plru = rate(make_policy("prefix_hd", 12), w, 12), rate(PrefixLRUPolicy(12, tails_first=True), w, 12)
    got = rate(adaptive, w, 12)
    assert hd > 1.5 * plru
    assert adaptive.leader == 1 and got >= 0.95 * hd, (got, hd)


def test_moves_its_lead_back_to_prefix_lru_where_prefix_lru_wins() -> None:
    w = agentic()
    cap = round(0.1 * w.unique_chunks())
    hd, plru = rate(make_policy("prefix_hd", cap), w, cap), rate(PrefixLRUPolicy(cap, tails_first=True), w, cap)
    adaptive = AdaptivePolicy(cap)
    adaptive.leader = 1  # start on the losing side
    got = rate(adaptive, w, cap)
    lru = rate(LRUPolicy(cap), w, cap)
    assert plru > hd and lru > hd
    assert adaptive.leader == 0 and adaptive.switches >= 1 and got > hd and got >= lru, (got, hd, plru, lru)


def test_never_evicts_a_protected_key() -> None:
    p = AdaptivePolicy(4)
    drive(p, [(1, 2, 3, 4)], 4)  # the leader (prefix LRU) would take 4, then 3, 2, 1
    assert p.evict(1, protected={4, 3}) == [2]
    assert p.evict(3, protected={4, 3}) == [1]  # only unprotected keys, even when fewer than asked
    assert len(p) == 2 and 3 in p and 4 in p
    assert p.evict(2) == [4, 3] and len(p) == 0


def test_a_protected_orphan_waits_for_the_leaders_next_victim() -> None:
    p = AdaptivePolicy(3, candidates=(LRUPolicy, PrefixLRUPolicy))
    drive(p, [(1, 2, 3)], 3)
    p.insert(4)  # the LRU shadow drops 1, which the tier still holds: an orphan
    assert list(p.orphans[0]) == [1]
    assert p.evict(1, protected={1}) == [2]  # LRU's next victim the tier holds, not the protected orphan
    assert p.evict(1) == [1] and 1 not in p and not p.orphans[0]


def test_a_lead_within_the_noise_does_not_switch() -> None:
    p = AdaptivePolicy(100)
    p.scores, p.solo = [500.0, 520.0], [30.0, 50.0]  # 20 more solo hits: under 3 standard deviations (~27)
    p._duel()
    assert p.leader == 0
    p.scores, p.solo = [500.0, 560.0], [30.0, 90.0]  # 60 more: over 3 x sqrt(120) ~ 33
    p._duel()
    assert p.leader == 1 and p.switches == 1


# ---- edges: a hint above what the tier holds, a shrinking tier, interleaved requests, shadow-only keys ----

def skewed(n: int, seed: int, keys: int = 5000) -> list[tuple[int, ...]]:
    """One-chunk requests with Pareto-skewed keys: a stream where recency matters."""
    rng = random.Random(seed)
    return [(int(rng.paretovariate(0.8)) % keys,) for _ in range(n)]


def test_identical_candidates_never_switch_when_the_hint_is_above_what_the_tier_holds() -> None:
    p = AdaptivePolicy(200, candidates=(LRUPolicy, LRUPolicy))
    drive(p, skewed(40_000, seed=0), 100)
    assert p.switches == 0 and p.scores[0] == p.scores[1]
    assert [len(s) for s in p.shadows] == [100, 100]  # each shadow simulates the 100 keys the tier holds


def test_a_hint_above_what_the_tier_holds_evicts_as_the_candidate_would_at_the_tiers_size() -> None:
    reqs = skewed(5000, seed=1)
    assert drive(AdaptivePolicy(200, candidates=(LRUPolicy, LRUPolicy)), reqs, 100) == drive(LRUPolicy(100), reqs, 100)
    reqs = list(sessions(60, seed=1))
    p = AdaptivePolicy(40)
    assert drive(p, reqs, 20) == drive(PrefixLRUPolicy(20, tails_first=True), reqs, 20)
    assert p.leader == 0 and [s.capacity for s in p.shadows] == [20, 20]


def test_the_leaders_next_victim_leaves_keys_the_tier_does_not_hold_in_its_shadow() -> None:
    p = AdaptivePolicy(3, candidates=(LRUPolicy, PrefixLRUPolicy))
    p.leader = 1
    drive(p, [(1, 2, 3)], 3)
    assert p.evict(1, protected={2, 3}) == [1]  # the prefix LRU leader frees 1; the LRU shadow keeps it
    p.leader = 0
    assert p.evict(1) == [2]  # LRU's next victim among the keys the tier holds ...
    p.insert(4)
    lru = p.shadows[0]
    assert list(lru._order) == [1, 3, 4] and len(lru) == lru.capacity  # type: ignore[attr-defined]
    # ... while its simulation keeps 1: a full shadow of 3 keys, not one shrunk to what the tier holds


def test_a_tier_shrunk_by_set_capacity_shrinks_its_shadows() -> None:
    p = AdaptivePolicy(100)
    reqs = list(sessions(400, seed=4))
    drive(p, reqs[:300], 100)
    p.set_capacity(50)
    victims = drive(p, reqs[300:], 50)
    assert victims and len(p) == 50
    assert [s.capacity for s in p.shadows] == [50, 50] and all(len(s) <= 50 for s in p.shadows)


def test_without_a_hint_the_shadows_follow_a_tier_that_shrinks() -> None:
    p = AdaptivePolicy(candidates=(LRUPolicy, LRUPolicy))
    drive(p, [(i,) for i in range(-300, 0)], 200)
    assert [s.capacity for s in p.shadows] == [200, 200]
    drive(p, skewed(20_000, seed=6), 100)  # the tier now holds 100 (bigger records, say)
    assert [s.capacity for s in p.shadows] == [100, 100] and all(len(s) == 100 for s in p.shadows)
    assert p.switches == 0


def test_interleaved_requests_score_as_if_they_ran_one_after_the_other() -> None:
    def scores(order: list[tuple[str, str | None]]) -> list[float]:
        p = AdaptivePolicy(10)
        drive(p, [("x0", "x1", "x2")], 10)
        before = list(p.scores)
        for key, parent in order:
            p.touch(key) if key in p else p.insert(key, parent)
        return [a - b for a, b in zip(p.scores, before, strict=True)]

    one_after_other = [("x0", None), ("x1", "x0"), ("x2", "x1"), ("y0", None), ("y1", "y0")]
    interleaved = [("x0", None), ("y0", None), ("x1", "x0"), ("y1", "y0"), ("x2", "x1")]
    assert scores(one_after_other) == scores(interleaved) == [3.0, 3.0]  # x0..x2 hit; the new y0, y1 do not


def test_a_call_whose_parent_missed_in_a_shadow_scores_no_hit_there() -> None:
    p = AdaptivePolicy(3, candidates=(LRUPolicy, PrefixLRUPolicy))
    drive(p, [(1, 2, 3)], 3)
    p.insert(4)  # the LRU shadow drops 1; the tier and the prefix LRU shadow keep it
    assert 1 in p and 1 not in p.shadows[0] and 1 in p.shadows[1]
    before = list(p.scores)
    p.touch(1)  # a miss in the LRU shadow, a hit in the other
    p.touch(2)  # held in both shadows, but on a held prefix only in the prefix LRU one
    assert [a - b for a, b in zip(p.scores, before, strict=True)] == [0.0, 2.0]


def test_remove_drops_a_key_that_only_a_shadow_holds() -> None:
    p = AdaptivePolicy(3, candidates=(LRUPolicy, PrefixLRUPolicy))
    p.leader = 1
    drive(p, [(1, 2, 3)], 3)
    assert p.evict(1) == [3] and 3 in p.shadows[0] and 3 not in p
    p.remove(3)
    assert all(3 not in s for s in p.shadows) and len(p) == 2
    before = list(p.scores)
    p.insert(3, 2)
    assert p.scores == before  # no shadow scores a hit on the removed key
