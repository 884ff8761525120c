"""Prefix-aware LRU: tails of a prefix are evicted before their heads.

A chunk is useful only while every chunk before it is held, so a chunk is never worth more than its parent.
Each key carries a stamp ``(tick, depth)``: a key whose parent is held takes the parent's tick and one more
than its depth; a root (or a key whose parent is gone) takes a fresh tick. Victims are the smallest ticks,
deepest first. When a request's chunks are touched in prefix order they all share the head's tick, so the
tail is older than the head and goes first; a head shared by many requests stays as young as its last use.

With ``tails_first``, the last chunk a request stored (usually a partial block, which the next turn of a
conversation replaces) goes before everything else once the next request starts: it is as good as never
admitted. A request is a run of calls in prefix order starting at a root (a key whose parent is None). Requests
whose calls interleave (an engine saving several at once): a tail taken for the end of its request is restored
when a child of it is stored later, so a request that goes on keeps its age.
"""

from __future__ import annotations

from collections.abc import Container

from kvtier.control.policies.base import EvictionPolicy, LazyHeap
from kvtier.records.keys import Key


class PrefixLRUPolicy(EvictionPolicy):
    """LRU where a chunk is always older than its parent (deepest first among equals)."""

    name = "prefix_lru"

    def __init__(self, capacity: int = 0, tails_first: bool = False) -> None:
        super().__init__(capacity)
        self.tails_first = tails_first
        self._heap = LazyHeap()
        self._parent: dict[Key, Key | None] = {}
        self._clock = 0
        self._last_stored: Key | None = None  # the key the previous call inserted (None after a touch)
        self._demoted: dict[Key, tuple[int, int]] = {}  # tails made oldest, with the stamp they had

    def _stamp(self, key: Key) -> None:
        self._demoted.pop(key, None)
        parent = self._parent.get(key)
        if parent is not None and parent in self._demoted:  # its request went on: it was not a tail
            self._heap.set(parent, self._demoted.pop(parent))
        prio = self._heap.priority(parent) if parent is not None else None
        if prio is None:
            self._clock += 1
            self._heap.set(key, (self._clock, 0))
        else:
            self._heap.set(key, (prio[0], prio[1] - 1))

    def _call(self, key: Key, parent: Key | None, stored: bool) -> None:
        """Track request boundaries: at a root, the previous request's last stored chunk becomes a tail."""
        if self.tails_first:
            last, self._last_stored = self._last_stored, (key if stored else None)
            if parent is None and last is not None and last in self._heap:
                self._demoted[last] = self._heap.priority(last)  # type: ignore[assignment]
                self._clock += 1
                self._heap.set(last, (0, self._clock))  # tick 0: older than every live stamp

    def insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self._heap:
            self.touch(key)
            return
        self._call(key, parent, True)
        self._parent[key] = parent
        self._stamp(key)

    def touch(self, key: Key) -> None:
        if key in self._heap:
            self._call(key, self._parent[key], False)
            self._stamp(key)

    def remove(self, key: Key) -> None:
        if key in self._heap:
            self._heap.discard(key)
            del self._parent[key]
            self._demoted.pop(key, None)

    def evict(self, n: int, protected: Container[Key] = ()) -> list[Key]:
        victims: list[Key] = self._heap.pop(n, protected)  # type: ignore[assignment]
        for key in victims:
            del self._parent[key]
            self._demoted.pop(key, None)
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._heap

    def __len__(self) -> int:
        return len(self._heap)
