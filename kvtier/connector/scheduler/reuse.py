"""Reuse signal for saves (``policy.store_threshold``): how many requests have asked for each chunk.

A chunk's key names its whole prefix, so a count per key says how many requests have shared that prefix. With a
threshold of N, the scheduler saves a chunk only once N requests have looked it up: a prompt nobody sends twice
costs no gather, no copy and no write. A request counts the chunks its lookup covers (all but the one holding
its last prompt token, and none of its generated tokens): a longer prompt sharing them, such as a conversation's
next turn, counts those. The counts are bounded: past ``capacity`` keys, the least recently seen
are forgotten (and start again from zero).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvtier.records.keys import Key

DEFAULT_CAPACITY = 1 << 18  # keys remembered (about 30 MB)


class SeenCounter:
    """Requests that looked up each chunk key, least recently seen forgotten first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._counts: OrderedDict[Key, int] = OrderedDict()

    def add(self, keys: Iterable[Key]) -> None:
        """One more request asked for each of ``keys`` (give each request's keys once)."""
        counts = self._counts
        for key in reversed(list(keys)):  # a prefix's first chunk ends most recent: roots are forgotten last
            counts[key] = counts.pop(key, 0) + 1
        while len(counts) > self.capacity:
            counts.popitem(last=False)

    def count(self, key: Key) -> int:
        return self._counts.get(key, 0)

    def __len__(self) -> int:
        return len(self._counts)
