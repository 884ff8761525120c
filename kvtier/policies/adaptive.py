"""Adaptive (``adaptive``, the default): follow whichever of two policies would be hitting more right now.

Two candidate policies each run a shadow cache of the tier's capacity over the same calls: keys only, no bytes.
A shadow scores a hit when a call finds its key held while the request is still on a held prefix (a request
is a run of calls in prefix order that starts at a root, a key whose parent is None), the replay's own
definition of a hit. Scores decay with a half-life of ``half_life`` x capacity calls, so the lead follows the
workload as it changes. The tier evicts what the leading shadow no longer holds (its "orphans"), oldest
first, and when the two agree it takes the leader's own next victim, so the tier converges to the
leader's contents. The leader changes only when the other scores ``margin`` more.

The candidates are prefix-aware LRU that evicts each request's last stored chunk first (it wins on short
and recency-driven workloads, where there is too little history to learn from) and ``prefix_hd`` (it learns
per-class reuse chances and wins on long conversation traces). Memory: two shadows of ``capacity`` keys (plus
``prefix_hd``'s bounded ghosts) and the orphan lists, which only hold keys the tier holds. Each call costs
one call on each shadow, O(log n).

``capacity`` is a hint in entries; when it is 0 (unknown) the shadows use the most keys the tier has held
at once, which is its capacity once it is full.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Sequence

from kvtier.keys import Key
from kvtier.policies.base import EvictionPolicy, pick_unprotected
from kvtier.policies.hitdensity import PrefixHitDensityPolicy
from kvtier.policies.prefix_lru import PrefixLRUPolicy

PolicyFactory = Callable[[int], EvictionPolicy]


def _tail_first_prefix_lru(capacity: int) -> EvictionPolicy:
    return PrefixLRUPolicy(capacity, tails_first=True)


CANDIDATES: tuple[PolicyFactory, ...] = (_tail_first_prefix_lru, PrefixHitDensityPolicy)


class AdaptivePolicy(EvictionPolicy):
    """Set-dueling between shadow caches of two policies; the tier follows the one hitting more."""

    name = "adaptive"

    def __init__(self, capacity: int = 0, candidates: Sequence[PolicyFactory] = CANDIDATES,
                 half_life: float = 4.0, margin: float = 0.01, z: float = 3.0) -> None:
        self.half_life, self.margin, self.z = half_life, margin, z
        self.shadows = [factory(capacity) for factory in candidates]
        self.orphans: list[OrderedDict[Key, None]] = [OrderedDict() for _ in self.shadows]
        self.scores = [0.0] * len(self.shadows)
        self.solo = [0.0] * len(self.shadows)  # hits that no other shadow scored
        self.leader = 0
        self.switches = 0
        self._on_prefix = [False] * len(self.shadows)
        self._held: dict[Key, Key | None] = {}
        self._most_held = 0
        self._calls = 0
        super().__init__(capacity)
        self.set_capacity(capacity)

    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        self._sync_capacity()

    def _shadow_capacity(self) -> int:
        return max(self.capacity or self._most_held, 1)

    def _sync_capacity(self) -> None:
        cap = self._shadow_capacity()
        for shadow in self.shadows:
            if shadow.capacity != cap:
                shadow.set_capacity(cap)
        self._period = max(64, cap // 8)
        self._decay = 0.5 ** (self._period / (self.half_life * cap))

    # -- the shadows --------------------------------------------------------------------------------------

    def _access(self, key: Key, parent: Key | None) -> None:
        """One call seen by every shadow: score it, then hit or admit it there."""
        cap = self._shadow_capacity()
        hits = [key in shadow and (parent is None or on)
                for shadow, on in zip(self.shadows, self._on_prefix, strict=True)]
        for i, shadow in enumerate(self.shadows):
            self._on_prefix[i] = hits[i]
            self.scores[i] += hits[i]
            if hits[i] and hits.count(True) == 1:
                self.solo[i] += 1
            if key in shadow:
                shadow.touch(key)
                continue
            while len(shadow) >= cap:
                out = shadow.evict(1)
                if not out:
                    break
                if out[0] in self._held:
                    self.orphans[i][out[0]] = None
            shadow.insert(key, parent)
            self.orphans[i].pop(key, None)
        self._calls += 1
        if self._calls % self._period == 0:
            self._duel()

    def _duel(self) -> None:
        """Decay the scores; hand the lead to a shadow that scores ``margin`` more than the leader, by more than
        ``z`` standard deviations of the calls only one of the two hit (a sign test)."""
        self.scores = [s * self._decay for s in self.scores]
        self.solo = [s * self._decay for s in self.solo]
        best = max(range(len(self.scores)), key=self.scores.__getitem__)
        lead = self.solo[best] - self.solo[self.leader]
        noise = self.z * (self.solo[best] + self.solo[self.leader]) ** 0.5
        if lead > self.margin * self.scores[self.leader] and lead > noise:
            self.leader = best
            self.switches += 1

    # -- the policy interface ------------------------------------------------------------------------------

    def insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self._held:
            self.touch(key)
            return
        self._held[key] = parent
        if len(self._held) > self._most_held:
            self._most_held = len(self._held)
            if not self.capacity:
                self._sync_capacity()
        self._access(key, parent)

    def touch(self, key: Key) -> None:
        if key in self._held:
            self._access(key, self._held[key])

    def remove(self, key: Key) -> None:
        if key in self._held:
            self._forget(key)
            for shadow in self.shadows:
                shadow.remove(key)

    def evict(self, n: int, protected: Container[Key] = ()) -> list[Key]:
        victims: list[Key] = []
        while len(victims) < n:
            key = self._pick(protected)
            if key is None:
                break
            self._forget(key)
            victims.append(key)
        return victims

    def _pick(self, protected: Container[Key]) -> Key | None:
        """The leader's oldest orphan; else the leader's own next victim; else any orphan or held key."""
        lead = self.leader
        picked = pick_unprotected(self.orphans[lead], 1, protected)
        if picked:
            return picked[0]
        shadow = self.shadows[lead]
        while True:
            out = shadow.evict(1, protected)
            if not out:
                break
            if out[0] in self._held:
                return out[0]
        for orphans in self.orphans:
            picked = pick_unprotected(orphans, 1, protected)
            if picked:
                return picked[0]
        picked = pick_unprotected(self._held, 1, protected)
        return picked[0] if picked else None

    def _forget(self, key: Key) -> None:
        del self._held[key]
        for orphans in self.orphans:
            orphans.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)
