"""ARC (Megiddo & Modha), as vLLM's native CPU offloading ships it.

T1 holds keys seen once, T2 keys seen again; B1 and B2 are ghosts of keys recently evicted from each. A key
re-inserted while it is a B1 ghost says "recency was cut short": the T1 target grows; a B2 ghost says the
opposite and shrinks it. Eviction takes T1's LRU while T1 is at or above its target, T2's LRU otherwise.
Each ghost list is bounded by the capacity (in entries).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvtier.control.policies.base import EvictionPolicy, pick_unprotected
from kvtier.records.keys import Key


class ARCPolicy(EvictionPolicy):
    """Adaptive replacement cache with ghost lists."""

    name = "arc"

    def __init__(self, capacity: int = 0) -> None:
        super().__init__(capacity)
        self.target_t1 = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self.t1 or key in self.t2:
            self.touch(key)
        elif key in self.b1:
            self.target_t1 = min(self.target_t1 + max(1.0, len(self.b2) / len(self.b1)), float(self.capacity))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.target_t1 = max(self.target_t1 - max(1.0, len(self.b1) / len(self.b2)), 0.0)
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None

    def touch(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            self.t2.pop(key, None)

    def evict(self, n: int, protected: Container[Key] = ()) -> list[Key]:
        victims: list[Key] = []
        while len(victims) < n:
            from_t1 = len(self.t1) >= max(1, int(self.target_t1))
            first, second = (self.t1, self.t2) if from_t1 else (self.t2, self.t1)
            picked = pick_unprotected(first, 1, protected) or pick_unprotected(second, 1, protected)
            if not picked:
                break
            key = picked[0]
            if key in self.t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            victims.append(key)
        self._trim_ghosts()
        return victims

    def _trim_ghosts(self) -> None:
        bound = max(self.capacity, 1)
        for ghost in (self.b1, self.b2):
            while len(ghost) > bound:
                ghost.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)
