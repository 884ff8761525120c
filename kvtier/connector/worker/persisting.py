"""Worker side of persisting (kvtier.control.persist): runs, where the bytes are, the copies of memory chunks to disk
that the scheduler planned (kvtier.connector.scheduler.persist_plans), off the engine's critical path. Decides nothing.

Lifecycle (``TieredConnector`` calls it around the worker half):
    step(meta)             each engine step, on the engine's thread: a step that computes a token marks the engine
                           busy; the step's persisting plans go to the I/O loop, where the demotions and evictions of
                           disk victims run at once (the directory already counts their room as free) and the copies
                           wait; copies the step's saves move out of memory themselves (an eviction the scheduler
                           turned into a move, kvtier.connector.scheduler.persist_plans) are dropped; a waiting copy
                           the step loads from memory counts a hit
    (rounds)               on the I/O loop, ``ROUND_CHUNKS`` copies a round, hot ones first (the most hits, then the
                           oldest), each after the save that writes its source: every waiting copy once the engine has
                           computed nothing for ``after_idle`` seconds; while it is busy, the copies that have waited
                           half of ``max_lag``, paced to ``PACE`` of the time (back to back once the oldest waited
                           ``max_lag``), so a chunk reaches disk within about ``max_lag`` while the disk keeps up with
                           the engine. The disk writes run in the disk tier's writer thread at the lowest CPU priority
    take_rows()            the copies written or not since the last call, for the worker report
    close(budget_s)        at shutdown: the waiting copies, hot first, until done or the budget ran out (a round
                           still running then is cancelled, its copies reported not written)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.connector.keying import Identity, namespaces, rank_key
from kvtier.connector.plans import persists_of
from kvtier.connector.report import PersistedCopy
from kvtier.control.directory import StorePlan
from kvtier.control.persist import enabled
from kvtier.layout import KVCacheConfig
from kvtier.records.keys import DIGEST_BYTES, Key
from kvtier.store.tiered import TieredStore
from kvtier.tiers.runtime import LOOP_CLOSE_S, LoopThread

logger = logging.getLogger(__name__)

ROUND_CHUNKS = 8  # copies per round (idleness and the lag are rechecked between rounds)
PACE = 0.25  # while the engine is busy, the share of the time copy rounds may take (unless the lag is exceeded)
Source = tuple[str, Key]  # (memory tier, this rank's key)
Landed = Callable[[str, Sequence[Key]], Awaitable[None]]  # waits for this worker's saves of keys into a tier


@dataclass
class _Waiting:
    """A planned copy: into ``target`` as the scheduler's key ``theirs``; planned at ``since``; ``hits`` loads of
    its chunk from memory since."""

    target: str
    theirs: Key
    since: float
    hits: int = 0


class Persister:
    """Waiting copies of memory chunks to disk: run while the engine is idle, within a lag while it is busy, and
    at close."""

    def __init__(self, store: TieredStore, loop: LoopThread, *, after_idle: float | None,
                 max_lag: float | None = None, landed: Landed | None = None, rank: str = "0",
                 mine: Callable[[Key], Key] = lambda key: key, clock: Callable[[], float] = time.monotonic) -> None:
        """``mine`` maps a key the scheduler planned with (rank 0's) to this rank's; ``after_idle`` and ``max_lag``
        None: copies run only at close; ``landed`` (the worker's ``SaveQueue.landed``): None waits for every save
        in flight instead."""
        self._store, self._loop = store, loop
        self.after_idle, self.max_lag = after_idle, max_lag
        self._landed = landed
        self._rank, self._mine, self._clock = rank, mine, clock
        self._busy_at = clock()
        self._waiting: dict[Source, _Waiting] = {}  # in plan order (touched on the I/O loop only)
        self._hot: set[Source] = set()  # the waiting copies with hits
        self._rows: list[PersistedCopy] = []
        self._rows_lock = threading.Lock()
        self._lock = asyncio.Lock()  # one round at a time: the loop's, close's
        self._wake = asyncio.Event()
        self._jobs: list[concurrent.futures.Future[None]] = []
        self._task: concurrent.futures.Future[None] | None = None
        self._closed = False
        if after_idle is not None or max_lag is not None:
            self._task = loop.submit(self._copy_loop())

    @property
    def waiting(self) -> int:
        """Copies planned and not run yet."""
        return len(self._waiting)

    def step(self, meta: Any) -> None:
        """One engine step's metadata (on the engine's thread): note whether it computes, take its plans."""
        if meta is None or not getattr(meta, "idle", False):
            self._busy_at = self._clock()
        plans = persists_of(meta)
        moved = [(p.source, self._mine(k)) for spec in getattr(meta, "saves", ()) for p in spec.plans
                 if p.source is not None and self._store.tier(p.source).is_memory for k in p.store]
        hot = [(spec.tier, self._mine(k)) for spec in getattr(meta, "loads", ())
               if self._store.tier(spec.tier).is_memory for k in spec.keys]
        if (plans or moved or hot) and not self._closed:
            self._jobs = [f for f in self._jobs if not f.done()]
            self._jobs.append(self._loop.submit(self._accept(plans, moved, hot)))

    async def _accept(self, plans: Sequence[StorePlan], moved: Sequence[Source], hot: Sequence[Source]) -> None:
        """Drop the copies this step's saves move out of memory themselves (the scheduler turned their eviction
        into a move), count the hits of waiting ones, queue the new copies, and run the rest (disk victims) now."""
        for source in moved:
            self._forget(source)
        for source in hot:
            if (waiting := self._waiting.get(source)) is not None:
                waiting.hits += 1
                self._hot.add(source)
        now: list[StorePlan] = []
        theirs: dict[tuple[str, Key], Key] = {}  # (tier, this rank's key) -> the scheduler's, of what runs now
        planned = self._clock()
        for plan in plans:
            mine = StorePlan(plan.tier, tuple(self._mine(k) for k in plan.store),
                             tuple(self._mine(k) for k in plan.evicted), plan.source)
            if plan.source is not None and self._store.tier(plan.source).is_memory:
                for m, k in zip(mine.store, plan.store, strict=True):
                    self._forget((plan.source, m))  # planned again: it queues at the end
                    self._waiting[(plan.source, m)] = _Waiting(plan.tier, k, planned)
                mine = StorePlan(plan.tier, (), mine.evicted)  # the victims go now, the copy waits
            else:
                theirs.update({(plan.tier, m): k for m, k in zip(mine.store, plan.store, strict=True)})
            if mine.store or mine.evicted:
                now.append(mine)
        self._wake.set()
        if now:
            failed: list[tuple[str, Key]] = []
            await self._store.execute(now, {}, failed)
            self._note([(tier, key, (tier, m) not in failed) for (tier, m), key in theirs.items()])

    def _forget(self, source: Source) -> _Waiting | None:
        self._hot.discard(source)
        return self._waiting.pop(source, None)

    async def _copy_loop(self) -> None:
        """Run rounds of waiting copies whenever ``_next_round`` has one; while the engine is busy, rest
        ``1 / PACE - 1`` times a round's copying time after it (less once a copy is due past the lag, or the
        engine goes idle). An unexpected error is logged and the loop goes on."""
        while not self._closed:
            try:
                await self._wake.wait()
                wait, sources, busy = self._next_round()
                if not sources:
                    if self._waiting:
                        await asyncio.sleep(wait)
                    else:
                        self._wake.clear()
                    continue
                async with self._lock:
                    _, spent = await self._run(sources)
                if busy:
                    await asyncio.sleep(min(spent * (1 - PACE) / PACE, self._rest_limit()))
            except Exception:
                logger.exception("kvtier: a round of copies to disk failed")
                await asyncio.sleep(0.1)

    def _next_round(self) -> tuple[float, list[Source], bool]:
        """(seconds until a round may be due, the copies of the round due now, whether the engine is busy)."""
        now = self._clock()
        idle_in = None if self.after_idle is None else self._busy_at + self.after_idle - now
        if idle_in is not None and idle_in <= 0:
            return 0.0, self._pick(None), False
        oldest = self._oldest_since()
        if self.max_lag is None or oldest is None:
            return max(idle_in or 0.0, 0.001), [], True
        half = self.max_lag / 2
        if now - oldest >= half:
            return 0.0, self._pick(now - half), True
        due_in = oldest + half - now
        return max(min(due_in, idle_in if idle_in is not None else due_in), 0.001), [], True

    def _rest_limit(self) -> float:
        """Seconds until the oldest waiting copy has waited ``max_lag``, or the engine counts as idle (0: now)."""
        limits = []
        if (oldest := self._oldest_since()) is not None and self.max_lag is not None:
            limits.append(oldest + self.max_lag - self._clock())
        if self.after_idle is not None:
            limits.append(self._busy_at + self.after_idle - self._clock())
        return max(min(limits, default=0.0), 0.0)

    def _oldest_since(self) -> float | None:
        """When the oldest waiting copy was planned (None: none waits); ``_waiting`` is in plan order."""
        oldest = next(iter(self._waiting.values()), None)
        return None if oldest is None else oldest.since

    def _pick(self, planned_by: float | None) -> list[Source]:
        """The next round's copies (planned by ``planned_by``; None: any): the most hit first, then the oldest.
        Looks at the hit ones and at most ``ROUND_CHUNKS`` others, whatever waits."""
        def due(source: Source) -> bool:
            return planned_by is None or self._waiting[source].since <= planned_by

        out = heapq.nsmallest(ROUND_CHUNKS, (s for s in self._hot if due(s)),
                              key=lambda s: (-self._waiting[s].hits, self._waiting[s].since))
        for source, waiting in self._waiting.items():
            if len(out) >= ROUND_CHUNKS or (planned_by is not None and waiting.since > planned_by):
                break
            if source not in self._hot:
                out.append(source)
        return out

    async def _run(self, sources: Sequence[Source]) -> tuple[int, float]:
        """Copy ``sources`` (under ``_lock``), one plan per (source, target) tier, each after the saves writing
        its sources; report each; return how many were written and the seconds spent copying. Cancelled, the
        copies not started stay waiting, and the one waiting for its source's save is completed as not written."""
        by_pair: dict[tuple[str, str], list[Source]] = {}
        for source in sources:
            if (waiting := self._waiting.get(source)) is not None:
                by_pair.setdefault((source[0], waiting.target), []).append(source)
        written, spent = 0, 0.0
        for (tier, target), pair in by_pair.items():
            keys = [(source[1], waiting.theirs) for source in pair if (waiting := self._forget(source)) is not None]
            failed: list[tuple[str, Key]] = []
            plan = StorePlan(target, tuple(k for k, _ in keys), (), tier)
            ran = False
            try:
                try:
                    await (self._landed(tier, list(plan.store)) if self._landed else self._store.quiet())
                except BaseException:  # no copy started
                    await self._unplan(target, plan.store)
                    raise
                t0 = time.perf_counter()
                await self._store.execute([plan], {}, failed)
                spent += time.perf_counter() - t0
                ran = True
            finally:  # cancelled or not, each copy is reported once
                rows = [(target, theirs, ran and (target, k) not in failed) for k, theirs in keys]
                self._note(rows)
            written += sum(ok for _, _, ok in rows)
        return written, spent

    async def _unplan(self, target: str, keys: Sequence[Key]) -> None:
        """Copies to ``target`` that will not run: in one process, the store's directory forgets them (they were
        PENDING there)."""
        await self._store.execute([StorePlan(target, tuple(keys))], {}, skip_writes=True)

    async def _abandon(self, target: str, copies: Sequence[tuple[Key, Key]]) -> None:
        """Copies that will not run, reported not written."""
        if copies:
            await self._unplan(target, [k for k, _ in copies])
            self._note([(target, theirs, False) for _, theirs in copies])

    def _note(self, rows: Sequence[tuple[str, Key, bool]]) -> None:
        with self._rows_lock:
            self._rows.extend((tier, key, self._rank, ok) for tier, key, ok in rows)

    def take_rows(self) -> list[PersistedCopy]:
        """The copies written (True) or not since the last call (for the worker report)."""
        with self._rows_lock:
            rows, self._rows = self._rows, []
        return rows

    def close(self, budget_s: float) -> int:
        """At shutdown: run the waiting copies for ``budget_s`` seconds at most (a round still running then is
        cancelled: a hung disk never holds the stop); stop the copy loop; return how many were written.
        Idempotent."""
        if self._closed:
            return 0
        self._closed = True
        t0 = time.monotonic()
        concurrent.futures.wait(self._jobs, timeout=budget_s)
        left = max(budget_s - (time.monotonic() - t0), 0.0)
        try:
            return self._loop.run(self._drain(left), timeout=left + LOOP_CLOSE_S)
        except TimeoutError:  # the loop itself is stuck (a blocking call on it): the stop goes on
            logger.warning("kvtier: persisting at shutdown did not end within %.1fs: given up", budget_s)
            return 0

    async def _drain(self, budget_s: float) -> int:
        t0 = self._clock()
        deadline, written = t0 + budget_s, 0
        try:  # after the copy loop's round in flight, if it ends within the budget
            await asyncio.wait_for(self._lock.acquire(), budget_s)
        except TimeoutError:  # a round stuck in a medium: cancelled (its copies reported not written)
            if self._task is not None:
                self._task.cancel()
            await self._lock.acquire()
        try:
            while self._waiting and (rest := deadline - self._clock()) > 0:
                try:
                    written += (await asyncio.wait_for(self._run(self._pick(None)), rest))[0]
                except TimeoutError:
                    break
            left = len(self._waiting)
            by_target: dict[str, list[tuple[Key, Key]]] = {}
            for (_, key), waiting in self._waiting.items():
                by_target.setdefault(waiting.target, []).append((key, waiting.theirs))
            self._waiting.clear()
            self._hot.clear()
            for target, copies in by_target.items():
                await self._abandon(target, copies)
        finally:
            self._lock.release()
            if self._task is not None:
                self._task.cancel()
        log = logger.warning if left and budget_s > 0 else logger.info
        log("kvtier: persisted %d chunk(s) to disk at shutdown in %.2fs; %d left only in memory (budget %.1fs, "
            "policy.persist_at_close)", written, self._clock() - t0, left, budget_s)
        return written


def rank_mapper(ident: Identity, kcc_of: Callable[[], KVCacheConfig | None],
                chunk_size: int) -> Callable[[Key], Key]:
    """``key`` (rank 0's, as the scheduler plans) under this rank's namespace of the same group; rank 0: itself.
    The namespaces are read from the KV-cache config when first needed (a worker may derive it at registration)."""
    if ident.tp_rank == 0:
        return lambda key: key
    space_of: dict[bytes, bytes] = {}

    def mine(key: Key) -> Key:
        kcc = kcc_of()
        if not space_of and kcc is not None:
            space_of.update(zip(namespaces(ident, kcc, chunk_size, rank=0), namespaces(ident, kcc, chunk_size),
                                strict=True))
        space = space_of.get(key[:DIGEST_BYTES])
        return key if space is None else rank_key(key, space)

    return mine


def persister_for(cfg: KvtierConfig, store: TieredStore, loop: LoopThread, ident: Identity,
                  kcc_of: Callable[[], KVCacheConfig | None], landed: Landed | None = None) -> Persister | None:
    """A persister for a worker when ``cfg`` persists (write-back, ``policy.persist_*``)."""
    if not enabled(cfg.policy):
        return None
    policy = cfg.policy
    return Persister(store, loop, after_idle=policy.persist_after_idle or None,
                     max_lag=policy.persist_max_lag or None, landed=landed, rank=str(ident.tp_rank),
                     mine=rank_mapper(ident, kcc_of, cfg.chunk_size))
