"""Chunk events: what entered and what left each tier, as the directory decides it (kvtier.control.directory).

The directory records, per tier, ``STORED`` when a write completed (a save, a promotion or a demotion's copy)
and ``REMOVED`` when a chunk left the tier (its eviction, its demotion to the next tier, a failed load, a
corrupt record). Shared tiers (Redis) report their writes only: what a Redis server evicts by itself is not
seen. Records a persistent tier already held at start are adopted without events. An engine adapter turns the
events into its own (kvtier.integrations.vllm: vLLM's ``BlockStored`` / ``BlockRemoved``) with what the scheduler
knew about each chunk (kvtier.connector.scheduler.chunk_events).

The log is bounded: past ``limit`` events not yet taken, the oldest are dropped and counted (``dropped``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from kvtier.records.keys import Key

DEFAULT_LIMIT = 100_000


class EventKind(Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class ChunkEvent:
    """Chunks ``keys`` entered (STORED) or left (REMOVED) tier ``tier``."""

    kind: EventKind
    tier: str
    keys: tuple[Key, ...]


class EventLog:
    """A thread-safe, bounded queue of chunk events (the scheduler thread and an I/O thread may both add)."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._events: deque[ChunkEvent] = deque()
        self._lock = threading.Lock()
        self._limit = limit
        self._queued = 0  # keys queued
        self.dropped = 0

    def add(self, kind: EventKind, tier: str, keys: Iterable[Key]) -> None:
        batch = tuple(keys)
        if not batch:
            return
        with self._lock:
            self._events.append(ChunkEvent(kind, tier, batch))
            self._queued += len(batch)
            while self._queued > self._limit and self._events:
                old = self._events.popleft()
                self._queued -= len(old.keys)
                self.dropped += len(old.keys)

    def take(self) -> list[ChunkEvent]:
        """The events since the last call, oldest first."""
        with self._lock:
            events, self._events = list(self._events), deque()
            self._queued = 0
        return events
