"""S3-FIFO (Yang et al., SOSP'23): scan-resistant with three FIFO queues.

New keys enter a small FIFO (10% of the capacity). A key leaving the small FIFO moves to the main FIFO if it
was hit while there, else it is dropped and remembered in a ghost FIFO; a key re-inserted while it is a ghost
goes straight to the main FIFO. The main FIFO gives each hit key another pass (a 2-bit frequency, decremented
per pass) before dropping it. One-hit wonders, such as a long scan, leave through the small FIFO quickly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from typing import cast

from kvtier.control.policies.base import EvictionPolicy
from kvtier.records.keys import Key

MAX_FREQ = 3
_PROTECTED, _MOVED, _DECREMENTED = object(), object(), object()  # outcomes of one step


class S3FIFOPolicy(EvictionPolicy):
    """Small FIFO + main FIFO + ghost FIFO, with frequency bits."""

    name = "s3fifo"

    def __init__(self, capacity: int = 0, small_ratio: float = 0.1) -> None:
        super().__init__(capacity)
        self.small_ratio = small_ratio
        self.small: OrderedDict[Key, None] = OrderedDict()
        self.main: OrderedDict[Key, None] = OrderedDict()
        self.ghost: OrderedDict[Key, None] = OrderedDict()
        self.freq: dict[Key, int] = {}

    def insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self.freq:
            self.touch(key)
            return
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None
        self.freq[key] = 0

    def touch(self, key: Key) -> None:
        freq = self.freq.get(key)
        if freq is not None and freq < MAX_FREQ:
            self.freq[key] = freq + 1

    def remove(self, key: Key) -> None:
        if self.freq.pop(key, None) is not None:
            self.small.pop(key, None)
            self.main.pop(key, None)

    def evict(self, n: int, protected: Container[Key] = ()) -> list[Key]:
        victims: list[Key] = []
        # A queue is blocked once a run of protected keys as long as the queue came up; a key moving from the
        # small FIFO to the main FIFO unblocks the main one. Every other step evicts, moves a key out of the
        # small FIFO for good or spends a frequency bit, so the loop ends.
        streak = {"small": 0, "main": 0}
        while len(victims) < n:
            small_ok = bool(self.small) and streak["small"] < len(self.small)
            main_ok = bool(self.main) and streak["main"] < len(self.main)
            if not (small_ok or main_ok):
                break
            use_small = small_ok and (len(self.small) > self.small_ratio * self.capacity or not main_ok)
            name, step = ("small", self._step_small) if use_small else ("main", self._step_main)
            outcome = step(protected)
            if outcome is _PROTECTED:
                streak[name] += 1
                continue
            streak[name] = 0
            if outcome is _MOVED:
                streak["main"] = 0
            elif outcome is not _DECREMENTED:
                victims.append(cast(Key, outcome))
        return victims

    def _step_small(self, protected: Container[Key]) -> Key | object:
        key, _ = self.small.popitem(last=False)
        if key in protected:
            self.small[key] = None
            return _PROTECTED
        if self.freq[key] > 0:
            self.main[key] = None
            return _MOVED
        del self.freq[key]
        self.ghost[key] = None
        while len(self.ghost) > max(self.capacity - int(self.small_ratio * self.capacity), 1):
            self.ghost.popitem(last=False)
        return key

    def _step_main(self, protected: Container[Key]) -> Key | object:
        key, _ = self.main.popitem(last=False)
        if key in protected:
            self.main[key] = None
            return _PROTECTED
        freq = self.freq[key]
        if freq > 0:
            self.freq[key] = freq - 1
            self.main[key] = None
            return _DECREMENTED
        del self.freq[key]
        return key

    def __contains__(self, key: object) -> bool:
        return key in self.freq

    def __len__(self) -> int:
        return len(self.freq)
