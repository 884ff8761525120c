"""Eviction policies: pure Python bookkeeping of which key of one tier to evict next.

Lifecycle per tier: ``policy = make_policy(name, capacity)``; then, as the directory sees them, ``insert(key,
parent)`` for a newly stored key (``parent`` = the previous chunk of the same prefix, or None), ``touch(key)``
on a hit, ``remove(key)`` when a key leaves for another reason, and ``evict(n, protected)`` to pick and
forget up to ``n`` victims, never one in ``protected`` (pinned or in flight). Policies know nothing of bytes:
the directory evicts until enough bytes are free. ``capacity`` is in entries and is a hint (ARC sizes its
ghost lists with it); ``set_capacity`` updates it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Container

from kvtier.keys import Key


class EvictionPolicy(ABC):
    """Orders one tier's keys for eviction."""

    name: str = ""

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity

    def set_capacity(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Key, parent: Key | None = None) -> None: ...

    @abstractmethod
    def touch(self, key: Key) -> None: ...

    @abstractmethod
    def remove(self, key: Key) -> None: ...

    @abstractmethod
    def evict(self, n: int, protected: Container[Key] = ()) -> list[Key]: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...


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
        victims: list[Key] = []
        for key in self._order:
            if len(victims) >= n:
                break
            if key not in protected:
                victims.append(key)
        for key in victims:
            del self._order[key]
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LRUPolicy,
}


def make_policy(name: str, capacity: int = 0) -> EvictionPolicy:
    """Build a policy by name; ``ValueError`` naming the valid ones otherwise."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; use one of {sorted(POLICIES)}") from None
    return factory(capacity)
