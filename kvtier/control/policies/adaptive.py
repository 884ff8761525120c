"""Adaptive (``adaptive``, the default): follow whichever of two policies would be hitting more right now.

Two candidate policies each run a shadow cache of the tier's capacity over the same calls: keys only, no bytes.
A shadow scores a hit when a call finds its key held while the request is still on a held prefix: its parent
is None (a root) or the parent's latest call was a hit in that shadow, the replay's own definition of a hit;
tracking it per chain keeps the score right when concurrent requests' calls interleave. Scores decay with a
half-life of ``half_life`` x capacity calls, so the lead follows the workload as it changes. The tier evicts
what the leading shadow no longer holds (its "orphans"), oldest first, and when the two agree it takes the
leader's own next victim, so the tier converges to the leader's contents. The leader changes only when the
other scores ``margin`` more.

The candidates are prefix-aware LRU that evicts each request's last stored chunk first (it wins on short
and recency-driven workloads, where there is too little history to learn from) and ``prefix_hd`` (it learns
per-class reuse chances and wins on long conversation traces). Memory: two shadows of ``capacity`` keys (plus
``prefix_hd``'s bounded ghosts), the orphan lists, which only hold keys the tier holds, and the hits of the
last ``RECENT_CALLS`` calls. Each call costs one call on each shadow, O(log n).

``capacity`` is a hint in entries. The shadows hold the most keys the tier has held at once (its capacity
once it is full), capped by the hint when there is one; that high-water mark decays towards what the tier
holds now with the scores' half-life, so the shadows follow a tier that shrinks. The tier takes the
leader's next victim among the keys it holds without dropping the others from the leader's shadow, so
that simulation stays whole.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Sequence

from kvtier.control.policies.base import EvictionPolicy, pick_unprotected
from kvtier.control.policies.hitdensity import PrefixHitDensityPolicy
from kvtier.control.policies.prefix_lru import PrefixLRUPolicy
from kvtier.records.keys import Key

PolicyFactory = Callable[[int], EvictionPolicy]
RECENT_CALLS = 4096  # calls whose per-shadow hit is remembered, for the calls of the keys they parent


class _NotHeldOrProtected:
    """Protects, for a shadow's own eviction, the keys the tier does not hold and those the caller protects."""

    __slots__ = ("held", "protected")

    def __init__(self, held: Container[Key], protected: Container[Key]) -> None:
        self.held, self.protected = held, protected

    def __contains__(self, key: object) -> bool:
        return key not in self.held or key in self.protected


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
        self._recent: OrderedDict[Key, list[bool]] = OrderedDict()  # per shadow: was the key's latest call a hit
        self._held: dict[Key, Key | None] = {}
        self._most_held = 0.0  # high-water mark of len(_held), decaying towards it
        self._evicted = False  # whether the tier has evicted yet: once it has, it is as full as it gets
        self._calls = 0
        super().__init__(capacity)
        self.set_capacity(capacity)

    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        self._sync_capacity()

    def _shadow_capacity(self) -> int:
        """The hint until the tier first evicts; then the most keys it held, capped by the hint."""
        most = round(self._most_held)
        if self.capacity:
            return max(min(self.capacity, most), 1) if self._evicted else self.capacity
        return max(most, 1)

    def _sync_capacity(self) -> None:
        cap = self._shadow_capacity()
        for i, shadow in enumerate(self.shadows):
            if shadow.capacity != cap:
                shadow.set_capacity(cap)
                self._shrink(i, cap)
        span = self.capacity or cap  # the hint, when there is one, sets the duel's pace
        self._period = max(64, span // 8)
        self._decay = 0.5 ** (self._period / (self.half_life * span))

    # -- the shadows --------------------------------------------------------------------------------------

    def _access(self, key: Key, parent: Key | None) -> None:
        """One call seen by every shadow: score it, then hit or admit it there."""
        cap = self._shadow_capacity()
        on = self._recent.get(parent) if parent is not None else None
        hits = [key in shadow and (parent is None or (on is not None and on[i]))
                for i, shadow in enumerate(self.shadows)]
        self._recent[key] = hits
        self._recent.move_to_end(key)
        if len(self._recent) > RECENT_CALLS:
            self._recent.popitem(last=False)
        for i, shadow in enumerate(self.shadows):
            self.scores[i] += hits[i]
            if hits[i] and hits.count(True) == 1:
                self.solo[i] += 1
            if key in shadow:
                shadow.touch(key)
                continue
            self._shrink(i, cap - 1)
            shadow.insert(key, parent)
            self.orphans[i].pop(key, None)
        self._calls += 1
        if self._calls % self._period == 0:
            self._duel()

    def _shrink(self, i: int, size: int) -> None:
        """Evict from shadow ``i`` down to ``size`` keys; the tier's keys it drops become its orphans."""
        shadow = self.shadows[i]
        while len(shadow) > size:
            out = shadow.evict(1)
            if not out:
                break
            if out[0] in self._held:
                self.orphans[i][out[0]] = None

    def _duel(self) -> None:
        """Decay the scores; hand the lead to a shadow that scores ``margin`` more than the leader, by more than
        ``z`` standard deviations of the calls only one of the two hit (a sign test)."""
        self.scores = [s * self._decay for s in self.scores]
        self.solo = [s * self._decay for s in self.solo]
        held = len(self._held)
        self._most_held = held + (self._most_held - held) * self._decay
        if self.shadows[0].capacity != self._shadow_capacity():
            self._sync_capacity()
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
            if self.shadows[0].capacity != self._shadow_capacity():
                self._sync_capacity()
        self._access(key, parent)

    def touch(self, key: Key) -> None:
        if key in self._held:
            self._access(key, self._held[key])

    def remove(self, key: Key) -> None:
        """The key is gone (deleted, or moved to another tier): from the tier and from every shadow, even one
        that alone still holds it, so no shadow scores hits on it."""
        if key in self._held:
            self._forget(key)
        for shadow in self.shadows:
            shadow.remove(key)

    def evict(self, n: int, protected: Container[Key] = ()) -> list[Key]:
        if n > 0 and self._held and not self._evicted:
            self._evicted = True
            self._sync_capacity()
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
        out = self.shadows[lead].evict(1, _NotHeldOrProtected(self._held, protected))
        if out:
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
