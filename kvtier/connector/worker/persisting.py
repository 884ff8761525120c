"""Worker side of persisting (kvtier.control.persist): runs, where the bytes are, the copies of memory chunks to disk
that the scheduler planned (kvtier.connector.scheduler.persist_plans), off the engine's critical path. Decides nothing.

Lifecycle (``TieredConnector`` calls it around the worker half):
    step(meta)             each engine step, on the engine's thread: a step that computes a token marks the engine
                           busy; the step's persisting plans go to the I/O loop, where the demotions and evictions of
                           disk victims run at once (the directory already counts their room as free) and the copies
                           wait; copies the step's saves move out of memory themselves (an eviction the scheduler
                           turned into a move, kvtier.connector.scheduler.persist_plans) are dropped
    (idle)                 once the engine has computed nothing for ``after_idle`` seconds, waiting copies run on the
                           I/O loop, oldest first, ``ROUND_CHUNKS`` per round, idleness rechecked between rounds;
                           the disk writes run in the disk tier's writer thread at the lowest CPU priority
    take_rows()            the copies written or not since the last call, for the worker report
    close(budget_s)        at shutdown: the waiting copies, oldest first, until done or the budget ran out (a round
                           already started finishes)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
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
from kvtier.tiers.runtime import LoopThread

logger = logging.getLogger(__name__)

ROUND_CHUNKS = 8  # copies per idle round (idleness is rechecked between rounds)
Source = tuple[str, Key]  # (memory tier, this rank's key)
Target = tuple[str, Key]  # (persistent tier, the scheduler's key)


class Persister:
    """Waiting copies of memory chunks to disk, run while the engine is idle and at close."""

    def __init__(self, store: TieredStore, loop: LoopThread, *, after_idle: float | None, rank: str = "0",
                 mine: Callable[[Key], Key] = lambda key: key, clock: Callable[[], float] = time.monotonic) -> None:
        """``mine`` maps a key the scheduler planned with (rank 0's) to this rank's; ``after_idle`` None: copies run
        only at close."""
        self._store, self._loop = store, loop
        self.after_idle = after_idle
        self._rank, self._mine, self._clock = rank, mine, clock
        self._busy_at = clock()
        self._waiting: dict[Source, Target] = {}  # in plan order (touched on the I/O loop only)
        self._rows: list[PersistedCopy] = []
        self._rows_lock = threading.Lock()
        self._lock = asyncio.Lock()  # one round at a time: idle rounds, close
        self._wake = asyncio.Event()
        self._jobs: list[concurrent.futures.Future[None]] = []
        self._idle_task: concurrent.futures.Future[None] | None = None
        self._closed = False
        if after_idle is not None:
            self._idle_task = loop.submit(self._idle_loop(after_idle))

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
        if (plans or moved) and not self._closed:
            self._jobs = [f for f in self._jobs if not f.done()]
            self._jobs.append(self._loop.submit(self._accept(plans, moved)))

    async def _accept(self, plans: Sequence[StorePlan], moved: Sequence[Source]) -> None:
        """Drop the copies this step's saves move out of memory themselves (the scheduler turned their eviction
        into a move), queue the new copies, and run the rest (disk victims) now."""
        for source in moved:
            self._waiting.pop(source, None)
        now: list[StorePlan] = []
        theirs: dict[tuple[str, Key], Key] = {}  # (tier, this rank's key) -> the scheduler's, of what runs now
        for plan in plans:
            mine = StorePlan(plan.tier, tuple(self._mine(k) for k in plan.store),
                             tuple(self._mine(k) for k in plan.evicted), plan.source)
            if plan.source is not None and self._store.tier(plan.source).is_memory:
                self._waiting.update({(plan.source, m): (plan.tier, k)
                                      for m, k in zip(mine.store, plan.store, strict=True)})
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

    async def _idle_loop(self, after: float) -> None:
        """Run waiting copies whenever the engine has computed nothing for ``after`` seconds."""
        while not self._closed:
            await self._wake.wait()
            wait = self._busy_at + after - self._clock()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            await self._store.quiet()  # the saves queued before the engine went idle (their sources) go first
            async with self._lock:
                await self._run(list(self._waiting)[:ROUND_CHUNKS])
            if not self._waiting:
                self._wake.clear()

    async def _run(self, sources: Sequence[Source]) -> int:
        """Copy ``sources`` (under ``_lock``), one plan per (source, target) tier; report each; return how many
        were written."""
        by_pair: dict[tuple[str, str], list[tuple[Key, Key]]] = {}
        for source in sources:
            if source in self._waiting:
                target, theirs = self._waiting.pop(source)
                by_pair.setdefault((source[0], target), []).append((source[1], theirs))
        written = 0
        for (tier, target), keys in by_pair.items():
            failed: list[tuple[str, Key]] = []
            try:
                await self._store.execute([StorePlan(target, tuple(k for k, _ in keys), (), tier)], {}, failed)
            finally:  # cancelled or not, each copy is reported once
                rows = [(target, theirs, (target, k) not in failed) for k, theirs in keys]
                self._note(rows)
            written += sum(ok for _, _, ok in rows)
        return written

    async def _abandon(self, target: str, copies: Sequence[tuple[Key, Key]]) -> None:
        """Copies that will not run: reported not written (and, in one process, forgotten by the store's
        directory, where they were PENDING)."""
        if copies:
            await self._store.execute([StorePlan(target, tuple(k for k, _ in copies))], {}, skip_writes=True)
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
        """At shutdown: run the waiting copies (``budget_s`` seconds at most, one round past it); stop the idle
        loop; return how many were written. Idempotent."""
        if self._closed:
            return 0
        self._closed = True
        concurrent.futures.wait(self._jobs, timeout=max(budget_s, 1.0))
        return self._loop.run(self._drain(budget_s), timeout=budget_s + 30)

    async def _drain(self, budget_s: float) -> int:
        t0 = self._clock()
        deadline, written = t0 + budget_s, 0
        async with self._lock:  # after the idle round in flight, if any; the idle loop then only waits
            if self._idle_task is not None:
                self._idle_task.cancel()
            while self._waiting and self._clock() < deadline:
                written += await self._run(list(self._waiting)[:ROUND_CHUNKS])
            left = len(self._waiting)
            by_target: dict[str, list[tuple[Key, Key]]] = {}
            for (_, key), (target, theirs) in self._waiting.items():
                by_target.setdefault(target, []).append((key, theirs))
            self._waiting.clear()
            for target, copies in by_target.items():
                await self._abandon(target, copies)
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
                  kcc_of: Callable[[], KVCacheConfig | None]) -> Persister | None:
    """A persister for a worker when ``cfg`` persists (write-back, ``policy.persist_*``)."""
    if not enabled(cfg.policy):
        return None
    return Persister(store, loop, after_idle=cfg.policy.persist_after_idle or None, rank=str(ident.tp_rank),
                     mine=rank_mapper(ident, kcc_of, cfg.chunk_size))
