"""The eviction-policy interface and the helpers its implementations share.

Lifecycle per tier: ``policy = make_policy(name, capacity)``; then, as the directory sees them, ``insert(key,
parent)`` for a newly stored key (``parent`` = the previous chunk of the same prefix, or None), ``touch(key)``
on a hit, ``remove(key)`` when a key leaves for another reason, and ``evict(n, protected)`` to pick and
forget up to ``n`` victims, never one in ``protected`` (pinned or in flight). Policies know nothing of bytes:
the directory evicts until enough bytes are free. ``capacity`` is in entries and is a hint (ARC, S3-FIFO and
the ghost-based policies size their queues with it); ``set_capacity`` updates it.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Container, Hashable, Iterable

from kvtier.records.keys import Key


class EvictionPolicy(ABC):
    """Orders one tier's keys for eviction."""

    name: str = ""

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity

    def set_capacity(self, capacity: int) -> None:
        """Update the capacity hint (in entries)."""
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Key, parent: Key | None = None) -> None:
        """Record a newly stored key; ``parent`` is the previous chunk of its prefix."""

    @abstractmethod
    def touch(self, key: Key) -> None:
        """Record a hit on a held key (no-op for unknown keys)."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Forget a key that left the tier for another reason (no-op for unknown keys)."""

    @abstractmethod
    def evict(self, n: int, protected: Container[Key] = ()) -> list[Key]:
        """Pick and forget up to ``n`` victims, none of them in ``protected``."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...


def pick_unprotected(keys: Iterable[Key], n: int, protected: Container[Key]) -> list[Key]:
    """The first ``n`` keys of ``keys`` that are not protected, in iteration order."""
    victims: list[Key] = []
    if n <= 0:
        return victims
    for key in keys:
        if key not in protected:
            victims.append(key)
            if len(victims) >= n:
                break
    return victims


class LazyHeap:
    """Keys ordered by a mutable priority (smallest first), with lazy deletion of stale heap entries.

    ``set`` and ``discard`` are O(log n); stale entries are dropped when popped and the heap is rebuilt when
    they outnumber the live ones, so memory stays O(live keys).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[float, ...], int, Hashable]] = []
        self._live: dict[Hashable, tuple[tuple[float, ...], int]] = {}
        self._seq = itertools.count()

    def set(self, key: Hashable, priority: tuple[float, ...]) -> None:
        """Insert ``key`` or change its priority."""
        entry = (priority, next(self._seq))
        self._live[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(*e, k) for k, e in self._live.items()]
            heapq.heapify(self._heap)

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` if present."""
        self._live.pop(key, None)

    def priority(self, key: Hashable) -> tuple[float, ...] | None:
        """The current priority of ``key``, or None."""
        entry = self._live.get(key)
        return None if entry is None else entry[0]

    def pop(self, n: int, protected: Container[Hashable] = ()) -> list[Hashable]:
        """Remove and return up to ``n`` unprotected keys with the smallest priorities."""
        out: list[Hashable] = []
        skipped: list[tuple[tuple[float, ...], int, Hashable]] = []
        heap, live = self._heap, self._live
        while heap and len(out) < n:
            item = heapq.heappop(heap)
            prio, seq, key = item
            if live.get(key) != (prio, seq):
                continue
            if key in protected:
                skipped.append(item)
                continue
            del live[key]
            out.append(key)
        for item in skipped:
            heapq.heappush(heap, item)
        return out

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __len__(self) -> int:
        return len(self._live)
