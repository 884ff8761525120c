"""The adaptive default policy: it evicts as its leading shadow would, keeps bounded memory, and moves its lead
to whichever candidate wins on the stream it sees."""

from __future__ import annotations

import random
from collections.abc import Iterator

from kvtier.bench.hitrate import DirectoryStack, replay
from kvtier.bench.workloads import Request, Workload, agentic
from kvtier.policies.adaptive import AdaptivePolicy
from kvtier.policies.hitdensity import PrefixHitDensityPolicy
from kvtier.policy import EvictionPolicy, LRUPolicy, PrefixLRUPolicy, make_policy


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
