"""What a private Redis tier holds, known locally, so that a lookup asks the server nothing.

A Redis tier with ``private: true`` is read and written by this process alone. It can then answer
``contains`` from a local index instead of an ``EXISTS`` round trip, which a request that never hits would
otherwise pay on every lookup. The index holds:

* every record this process stored (and not deleted), with its expiry when the tier has a ``ttl``;
* every record the server held when the tier started, read once by a background scan of the tier's key prefix
  (``kvtier.tiers.redis.catalog.RedisSource``: ``SCAN``, a pipelined header read and ``PTTL``, on connections
  that do not refresh the records' LRU recency). A record that fails its header check is left out.

Until the scan has finished, and again after the breaker opens (the server may have restarted empty), the index
is not ready and lookups ask the server as a shared tier's do; a new scan starts once the server answers.

The server may still drop a record the index holds: its ``maxmemory`` policy evicts it, or it restarted with
nothing. A lookup then says present and the load misses: the engine recomputes those tokens (a failed load,
never wrong KV), and the miss removes the key from the index. Size ``maxmemory`` above the tier's ``capacity``
to keep this rare.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvtier.records.keys import Key
from kvtier.tiers.catalog import RecordInfo
from kvtier.tiers.redis.catalog import RedisSource

log = logging.getLogger(__name__)


class KeyIndex:
    """Keys a private Redis holds, with their expiry (monotonic seconds; ``inf`` without a ``ttl``).

    Written on the tier's event loop, read from any thread (a dict lookup under the GIL)."""

    def __init__(self, ttl: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl
        self._clock = clock
        self._expiry: dict[Key, float] = {}
        self._changed: set[Key] | None = None  # keys stored or dropped while a scan runs: the scan must not undo
        self.ready = False  # the scan of what the server held has finished, and nothing was lost since

    def known(self, keys: Sequence[Key]) -> list[bool] | None:
        """Whether each key is held, or None while the index is not ready (ask the server)."""
        if not self.ready:
            return None
        now, expiry = self._clock(), self._expiry
        return [expiry.get(key, 0.0) > now for key in keys]

    def stored(self, key: Key) -> None:
        """``key`` was written now."""
        self._expiry[key] = self._clock() + self._ttl if self._ttl else math.inf
        if self._changed is not None:
            self._changed.add(key)

    def gone(self, keys: Iterable[Key]) -> None:
        """These keys were deleted, or a read found them missing."""
        for key in keys:
            self._expiry.pop(key, None)
            if self._changed is not None:
                self._changed.add(key)

    def lost(self) -> None:
        """The server may have lost records (its breaker opened): ask it until a new scan has finished."""
        self.ready = False

    def scanning(self) -> None:
        """A scan starts: from now on, what this process stores or drops wins over what the scan lists."""
        self._changed = set()

    def scanned(self, records: Iterable[RecordInfo]) -> None:
        """Replace the index by what the scan found, keeping what this process stored or dropped meanwhile; the
        index is then ready. A record that failed its header check is left out."""
        changed, self._changed = self._changed or set(), None
        now_wall, now = time.time(), self._clock()
        fresh: dict[Key, float] = {}
        for record in records:
            if record.error is not None or record.header is None or record.key in changed:
                continue
            if self._ttl and record.mtime is not None:
                fresh[record.key] = now + (record.mtime + self._ttl - now_wall)
            else:
                fresh[record.key] = now + self._ttl if self._ttl else math.inf
        old = self._expiry
        fresh.update((key, old[key]) for key in changed if key in old)
        self._expiry = fresh  # one swap: a reader on another thread sees the old index or the new one
        self.ready = True

    def __len__(self) -> int:
        return len(self._expiry)


def scan_records(source: RedisSource, stop: threading.Event) -> list[RecordInfo]:
    """Every record of a Redis tier, read in a worker thread (it blocks); stops early once ``stop`` is set.
    Raises ``TierUnavailable`` when the server does not answer."""
    out: list[RecordInfo] = []
    try:
        for record in source.records():
            if stop.is_set():
                break
            out.append(record)
    finally:
        source.close()
    return out
