"""Control plane: which chunk lives in which tier, space reservations, pins and eviction. No tensors.

Lifecycle of a chunk in one tier::

    prepare_store(tier, [(key, size, parent)])  -> plans; the key is PENDING, its space reserved,
                                                   victims chosen by the tier's policy (READY, unpinned)
    complete_store(tier, keys, success)        -> READY (visible to lookup) or forgotten
    touch / pin / unpin / hold                  -> hits refresh the policy; pins protect in-flight reads
    remove(tier, keys)                          -> gone (deleted, corrupt, failed load)

A plan list is executed in order by whoever holds the bytes (``TieredStore.execute``): each plan first
drops its ``evicted`` keys from its tier, then writes ``store`` (from the engine, or moved from ``source``
for write-back demotion). Shared tiers (Redis) are not tracked: their plans store everything, evict nothing.
All methods take one lock, so a scheduler thread and an I/O thread may share a directory. Its counters
(``stats``, a ``kvtier.control.metrics.DirectoryStats``) count the lookups it answers and the evictions it chooses.

The tiers' policies are fed in order (insert, touch, remove), at once or, after ``defer_policy(schedule)``, queued
and applied in batches that ``schedule`` runs on another thread (the I/O loop): a policy call costs tens of
microseconds of Python (the adaptive policy runs two shadow caches), 32 of them per 2048-token hit, and the engine's
thread is the one that asks. A tier's queue is applied whole before its policy chooses a victim, so an eviction
sees every call made before it, as if none had been deferred.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvtier.control.events import EventKind, EventLog
from kvtier.control.metrics import DirectoryStats
from kvtier.control.policy import EvictionPolicy
from kvtier.records.keys import Key

logger = logging.getLogger(__name__)

DRAIN_BATCH = 8  # policy calls applied between two looks at the clock
DRAIN_BUDGET_S = 0.0003  # the longest a drain job holds the lock (and the GIL) before it yields to a next one
MAX_QUEUED = 4096  # queued policy calls per tier past which the oldest are applied by the caller (a stalled drainer)
LOST_DRAIN_S = 1.0  # a drain job that has not run after this long is taken as lost (its loop stopped) and replaced
Schedule = Callable[[Callable[[], None]], object]


class ChunkState(Enum):
    PENDING = 1
    READY = 2


class PolicyCall(Enum):
    INSERT = 1
    TOUCH = 2
    REMOVE = 3


@dataclass(frozen=True)
class TierSlot:
    """One tier as the directory sees it."""

    name: str
    capacity_bytes: int
    policy: EvictionPolicy
    shared: bool = False


@dataclass(frozen=True)
class StorePlan:
    """Store ``store`` in ``tier`` after dropping ``evicted`` from it; ``source``: move from that tier."""

    tier: str
    store: tuple[Key, ...]
    evicted: tuple[Key, ...] = ()
    source: str | None = None


@dataclass(frozen=True)
class Located:
    """Where chunks are: the tier of each (None: in none searched), and which are still being written there."""

    tiers: list[str | None]
    writing: frozenset[int] = frozenset()

    def prefix(self) -> list[str]:
        """The tiers of the leading run of chunks found."""
        run = self.tiers.index(None) if None in self.tiers else len(self.tiers)
        return [t for t in self.tiers[:run] if t is not None]


@dataclass
class _Entry:
    size: int
    state: ChunkState
    pins: int = 0
    parent: Key | None = None  # kept so a demoted chunk keeps its prefix structure in the next tier


@dataclass
class _TierIndex:
    slot: TierSlot
    entries: dict[Key, _Entry] = field(default_factory=dict)
    used: int = 0
    protected: set[Key] = field(default_factory=set)  # pinned or pending: never evicted
    calls: deque[tuple[PolicyCall, Key, Key | None]] = field(default_factory=deque)  # not yet given to the policy
    deferred: bool = False

    def feed(self, call: PolicyCall, key: Key, parent: Key | None = None) -> None:
        """Give the policy one call, or queue it when calls are deferred (in order, behind the queued ones; a full
        queue applies its oldest ``DRAIN_BATCH`` first)."""
        if not self.deferred:  # nothing is queued then: defer_policy(None) applied the queue
            self._call(call, key, parent)
            return
        if len(self.calls) >= MAX_QUEUED:
            self.apply(DRAIN_BATCH)
        self.calls.append((call, key, parent))

    def apply(self, limit: int) -> None:
        """Give the policy up to ``limit`` queued calls, oldest first."""
        calls = self.calls
        for _ in range(min(limit, len(calls))):
            self._call(*calls.popleft())

    def _call(self, call: PolicyCall, key: Key, parent: Key | None) -> None:
        policy = self.slot.policy
        if call is PolicyCall.TOUCH:
            policy.touch(key)
        elif call is PolicyCall.INSERT:
            policy.insert(key, parent)
        else:
            policy.remove(key)

    def ready(self, key: Key) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.state is ChunkState.READY

    def drop(self, key: Key) -> bool:
        entry = self.entries.pop(key, None)
        if entry is None:
            return False
        self.used -= entry.size
        self.protected.discard(key)
        self.feed(PolicyCall.REMOVE, key)
        return True

    def refresh(self, key: Key, entry: _Entry) -> None:
        if entry.pins or entry.state is ChunkState.PENDING:
            self.protected.add(key)
        else:
            self.protected.discard(key)


class Directory:
    """Bookkeeping of every local tier, in tier order (fastest first)."""

    def __init__(self, tiers: Sequence[TierSlot]) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tier names in {names}")
        self._tiers = {t.name: _TierIndex(t) for t in tiers}
        self._order = names
        self._lock = threading.RLock()
        self.stats = DirectoryStats()
        self.events: EventLog | None = None  # set to record what enters and leaves each tier (kvtier.control.events)
        self._schedule: Schedule | None = None
        self._drain_due: float | None = None  # when the drain job not yet run was scheduled

    def _emit(self, kind: EventKind, tier: str, keys: Iterable[Key]) -> None:
        if self.events is not None:
            self.events.add(kind, tier, keys)

    @property
    def tier_names(self) -> list[str]:
        return list(self._order)

    def is_shared(self, tier: str) -> bool:
        return self._tiers[tier].slot.shared

    def locate(self, keys: Sequence[Key], tiers: Sequence[str] | None = None, *, whole: bool = False,
               writing: Callable[[str, Key], bool] | None = None, count: bool = True) -> Located:
        """Where each chunk is among the local tiers in ``tiers`` (every local tier when None; none when empty),
        under one lock: the fastest tier holding it READY, else, with ``writing`` (whether a write of the key into
        the tier is in flight), the fastest tier with its space reserved and its write in flight (marked in
        ``Located.writing``). The search stops at the first chunk found nowhere unless ``whole`` (a sliding window
        or a recurrent state needs chunks past a gap). ``count``: add the lookup to ``stats``."""
        names = [n for n in (self._order if tiers is None else tiers) if not self._tiers[n].slot.shared]
        indexes = [self._tiers[n] for n in names]
        out: list[str | None] = [None] * len(keys)
        in_flight: set[int] = set()
        with self._lock:
            for i, key in enumerate(keys):
                out[i] = next((x.slot.name for x in indexes if x.ready(key)), None)
                if out[i] is None and writing is not None:
                    out[i] = next((x.slot.name for x in indexes
                                   if key in x.entries and writing(x.slot.name, key)), None)
                    if out[i] is not None:
                        in_flight.add(i)
                if out[i] is None and not whole:
                    break
            if count:
                self.stats.lookups += len(keys)
                self.stats.hits += len(out) - out.count(None)
        return Located(out, frozenset(in_flight))

    def lookup(self, keys: Sequence[Key], tiers: Sequence[str] | None = None) -> list[str]:
        """Tier name (fastest first) holding each chunk of the longest READY prefix in the local tiers among
        ``tiers`` (every tier when None; none when empty): ``locate``'s leading run."""
        return self.locate(keys, tiers).prefix()

    def count_unplaced(self, n: int) -> None:
        """Chunks a placement (kvtier.control.planner) could put in no tier of their chain."""
        with self._lock:
            self.stats.unplaced += n

    def count_admission(self, admitted: bool, n: int) -> None:
        """Chunks offered for saving that the save admission (kvtier.connector.scheduler.admission) took or declined."""
        with self._lock:
            if admitted:
                self.stats.admitted += n
            else:
                self.stats.declined += n

    def contains(self, tier: str, key: Key) -> bool:
        with self._lock:
            return self._tiers[tier].ready(key)

    def holds(self, tier: str, key: Key) -> bool:
        """Whether ``tier`` has ``key`` ready or reserved for a write in flight (placement must not write it
        elsewhere: a write-back chunk lives in one tier until it is demoted)."""
        with self._lock:
            return key in self._tiers[tier].entries

    def parent(self, tier: str, key: Key) -> Key | None:
        """The parent ``key`` was stored with in ``tier`` (None: none, or not there)."""
        with self._lock:
            entry = self._tiers[tier].entries.get(key)
            return entry.parent if entry is not None else None

    def ready_keys(self, tier: str) -> list[Key]:
        """The READY keys of ``tier``, in the order they were stored (a prefix's head before its tail)."""
        with self._lock:
            return [k for k, e in self._tiers[tier].entries.items() if e.state is ChunkState.READY]

    def used_bytes(self, tier: str) -> int:
        return self._tiers[tier].used

    def __len__(self) -> int:
        return sum(len(t.entries) for t in self._tiers.values())

    def touch(self, tier: str, keys: Iterable[Key]) -> None:
        """A hit on these keys: each READY one refreshes the tier's policy."""
        index = self._tiers[tier]
        with self._lock:
            for key in keys:
                if index.ready(key):
                    index.feed(PolicyCall.TOUCH, key)
            self._schedule_drain()

    def hold(self, tier: str, keys: Iterable[Key]) -> None:
        """A hit about to be read: pin the keys (``unpin`` after the read) and touch them, under one lock."""
        keys = list(keys)
        with self._lock:
            self.pin(tier, keys)
            self.touch(tier, keys)

    def pin(self, tier: str, keys: Iterable[Key]) -> None:
        index = self._tiers[tier]
        with self._lock:
            for key in keys:
                entry = index.entries.get(key)
                if entry is not None:
                    entry.pins += 1
                    index.protected.add(key)

    def unpin(self, tier: str, keys: Iterable[Key]) -> None:
        index = self._tiers[tier]
        with self._lock:
            for key in keys:
                entry = index.entries.get(key)
                if entry is not None and entry.pins:
                    entry.pins -= 1
                    index.refresh(key, entry)

    def prepare_store(self, tier: str, entries: Sequence[tuple[Key, int, Key | None]],
                      demote_chain: Sequence[str] = ()) -> list[StorePlan]:
        """Reserve space in ``tier`` for the keys it lacks; return plans in execution order.

        With a ``demote_chain`` (write-back), victims are moved to the next tier of the chain instead of
        dropped, recursively. Keys already present or pending are skipped; keys that cannot fit are left out.
        """
        with self._lock:
            return self._prepare(tier, [(k, s, p, None) for k, s, p in entries], list(demote_chain))

    def _prepare(self, tier: str, entries: list[tuple[Key, int, Key | None, str | None]],
                 chain: list[str]) -> list[StorePlan]:
        index = self._tiers[tier]
        if index.slot.shared:
            return self._group_plans(tier, [(k, src) for k, _, _, src in entries], [])
        stored: list[tuple[Key, str | None]] = []
        evicted: list[tuple[Key, int, Key | None]] = []
        for key, size, parent, source in entries:
            if key in index.entries:
                continue
            if size > index.slot.capacity_bytes or not self._make_room(index, size, evicted):
                self.stats.refused += 1
                continue
            index.entries[key] = _Entry(size, ChunkState.PENDING, parent=parent)
            index.protected.add(key)
            index.used += size
            index.feed(PolicyCall.INSERT, key, parent)
            stored.append((key, source))
        self._schedule_drain()
        plans: list[StorePlan] = []
        evicted_keys = [k for k, _, _ in evicted]
        if chain and evicted:
            self.stats.demotions += len(evicted)
            plans = self._prepare(chain[0], [(k, s, p, tier) for k, s, p in evicted], chain[1:])
        return plans + self._group_plans(tier, stored, evicted_keys)

    def _make_room(self, index: _TierIndex, size: int, evicted: list[tuple[Key, int, Key | None]]) -> bool:
        capacity = index.slot.capacity_bytes
        if index.used + size <= capacity:
            return True
        protected = index.protected
        index.apply(len(index.calls))  # the victim is chosen on every call made so far
        while index.used + size > capacity:
            victims = index.slot.policy.evict(1, protected)
            if not victims:
                return False
            victim = victims[0]
            entry = index.entries.pop(victim)
            index.used -= entry.size
            evicted.append((victim, entry.size, entry.parent))
            self._emit(EventKind.REMOVED, index.slot.name, (victim,))
            self.stats.evictions += 1
            by_tier = self.stats.evictions_by_tier
            by_tier[index.slot.name] = by_tier.get(index.slot.name, 0) + 1
        return True

    @staticmethod
    def _group_plans(tier: str, stored: list[tuple[Key, str | None]], evicted: list[Key]) -> list[StorePlan]:
        """One plan per source (engine or a source tier), the evictions on the first."""
        sources: dict[str | None, list[Key]] = {}
        for key, source in stored:
            sources.setdefault(source, []).append(key)
        if not sources:
            return [StorePlan(tier, (), tuple(evicted))] if evicted else []
        plans = []
        for i, (source, keys) in enumerate(sources.items()):
            plans.append(StorePlan(tier, tuple(keys), tuple(evicted) if i == 0 else (), source))
        return plans

    def complete_store(self, tier: str, keys: Iterable[Key], success: bool | Sequence[bool] = True) -> None:
        """Mark pending keys READY, or forget them when their write failed."""
        index = self._tiers[tier]
        keys = list(keys)
        flags = [success] * len(keys) if isinstance(success, bool) else list(success)
        if index.slot.shared:
            self._emit(EventKind.STORED, tier, [k for k, ok in zip(keys, flags, strict=True) if ok])
            return
        ready: list[Key] = []
        with self._lock:
            for key, ok in zip(keys, flags, strict=True):
                entry = index.entries.get(key)
                if entry is None or entry.state is ChunkState.READY:
                    continue
                if ok:
                    entry.state = ChunkState.READY
                    index.refresh(key, entry)
                    ready.append(key)
                else:
                    index.drop(key)
            self._emit(EventKind.STORED, tier, ready)
            self._schedule_drain()

    def remove(self, tier: str, keys: Iterable[Key]) -> int:
        index = self._tiers[tier]
        dropped, announced = 0, []
        with self._lock:
            for key in keys:
                ready = index.ready(key)  # a chunk still being written was never announced
                if index.drop(key):
                    dropped += 1
                    if ready:
                        announced.append(key)
            self._emit(EventKind.REMOVED, tier, announced)
            self._schedule_drain()
        return dropped

    def adopt(self, tier: str, entries: Iterable[tuple[Key, int]]) -> int:
        """Take over records a persistent tier already holds (READY), as far as capacity allows."""
        index = self._tiers[tier]
        adopted = 0
        with self._lock:
            for key, size in entries:
                if key in index.entries or index.used + size > index.slot.capacity_bytes:
                    continue
                index.entries[key] = _Entry(size, ChunkState.READY)
                index.used += size
                index.feed(PolicyCall.INSERT, key)
                adopted += 1
            self._schedule_drain()
        return adopted

    def disown(self, tier: str, keys: Iterable[Key]) -> int:
        """Forget adopted records that are no longer the tier's (its namespaces were named after it listed them):
        those READY and unpinned, without events (their adoption had none)."""
        index = self._tiers[tier]
        dropped = 0
        with self._lock:
            for key in keys:
                entry = index.entries.get(key)
                if entry is not None and entry.state is ChunkState.READY and not entry.pins:
                    dropped += index.drop(key)
            self._schedule_drain()
        return dropped

    # ---- the policies' calls, deferred -------------------------------------------------------------------
    def defer_policy(self, schedule: Schedule | None) -> None:
        """Queue the policies' calls from now on, applied by ``drain`` jobs handed to ``schedule`` (e.g. one that
        runs them on an event loop); None: apply them at once again, the queued ones first. A ``schedule`` that
        raises (its loop closed) turns deferring off."""
        with self._lock:
            self._schedule, self._drain_due = schedule, None
            for index in self._tiers.values():
                index.deferred = schedule is not None
                if schedule is None:
                    index.apply(len(index.calls))
            self._schedule_drain()

    def queued_calls(self) -> int:
        """Policy calls queued and not yet applied, over every tier."""
        with self._lock:
            return sum(len(index.calls) for index in self._tiers.values())

    def drain(self) -> None:
        """Apply queued policy calls, oldest first, for at most ``DRAIN_BUDGET_S``; schedule another drain for
        what is left."""
        with self._lock:
            self._drain_due = None
            deadline = time.perf_counter() + DRAIN_BUDGET_S
            for index in self._tiers.values():
                while index.calls and time.perf_counter() < deadline:
                    index.apply(DRAIN_BATCH)
            self._schedule_drain()

    def _schedule_drain(self) -> None:
        """Schedule a drain when calls are queued and no drain is due (under the lock)."""
        due = self._drain_due
        if (due is not None and time.monotonic() - due < LOST_DRAIN_S) or self._schedule is None \
                or not any(i.calls for i in self._tiers.values()):
            return
        try:
            self._schedule(self.drain)
            self._drain_due = time.monotonic()
        except Exception as exc:  # the loop is closed: apply the calls here from now on
            logger.debug("policy calls no longer deferred: %r", exc)
            self.defer_policy(None)
