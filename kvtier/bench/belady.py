"""Belady's offline optimum for the hit-rate replay: evict the chunk whose next use is farthest.

``belady_schedule`` computes, in one backward pass, the priority of every chunk access of a workload in
replay order (next request that uses the chunk, then its depth); ``BeladyPolicy`` consumes one priority per
``insert`` / ``touch`` call, so it must see exactly the replay's calls, in order, on a single tier.
"""

from __future__ import annotations

import math
from collections.abc import Container, Hashable, Iterator

from kvtier.bench.workloads import Workload
from kvtier.control.policies.base import EvictionPolicy, LazyHeap
from kvtier.records.keys import Key


def belady_schedule(workload: Workload) -> list[tuple[float, float]]:
    """Eviction priority per chunk access in replay order: (-next use, -depth); never used again = -inf."""
    next_seen: dict[Hashable, int] = {}
    out: list[tuple[float, float]] = []
    for index in range(len(workload.requests) - 1, -1, -1):
        chunks = workload.requests[index].chunks
        for depth in range(len(chunks) - 1, -1, -1):
            key = chunks[depth]
            out.append((-next_seen.get(key, math.inf), -depth))
            next_seen[key] = index
    out.reverse()
    return out


class BeladyPolicy(EvictionPolicy):
    """Clairvoyant policy driven by a precomputed schedule of priorities (one per insert/touch)."""

    name = "belady"

    def __init__(self, schedule: Iterator[tuple[float, float]], capacity: int = 0) -> None:
        super().__init__(capacity)
        self._schedule = schedule
        self._heap = LazyHeap()

    def insert(self, key: Key, parent: Key | None = None) -> None:
        self._heap.set(key, next(self._schedule))

    def touch(self, key: Key) -> None:
        prio = next(self._schedule)
        if key in self._heap:
            self._heap.set(key, prio)

    def remove(self, key: Key) -> None:
        self._heap.discard(key)

    def evict(self, n: int, protected: Container[Key] = ()) -> list[Key]:
        return self._heap.pop(n, protected)  # type: ignore[return-value]

    def __contains__(self, key: object) -> bool:
        return key in self._heap

    def __len__(self) -> int:
        return len(self._heap)
