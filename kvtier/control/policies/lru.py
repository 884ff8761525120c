"""Least recently used."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvtier.control.policies.base import EvictionPolicy, pick_unprotected
from kvtier.records.keys import Key


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, parent: Key | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, protected: Container[Key] = ()) -> list[Key]:
        victims = pick_unprotected(self._order, n, protected)
        for key in victims:
            del self._order[key]
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)
