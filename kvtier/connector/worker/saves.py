"""The worker half's save path: gather the chunks the scheduler planned to save out of the engine's blocks, queue
them for the I/O loop within a byte backlog, and report what was written and what was not. Decides nothing.

Lifecycle, per engine step (``WorkerHalf.wait_for_save`` / ``get_finished``):
    save(specs)                 ``SaveQueue.admit`` splits the step's saves into kept and skipped, the kept ones
                                are gathered into recycled host buffers (the blocks are free to reuse once it
                                returns), then ``SaveQueue.submit`` runs the step's jobs on the I/O loop: evict /
                                demote / write in order, at once for memory-only saves with nothing queued ahead
    fail(specs)                 (kvtier disabled) every save is reported not stored
    flush()                     waits (bounded) for every pending save
    finished(finished_req_ids)  requests that have finished and whose saves are all done
    close()                     waits for pending saves

The queue (``SaveQueue``):
    admit(saves)    while saves are queued, one that would take the backlog of unwritten bytes past
                    ``max_backlog`` is skipped (``save_skipped_busy``), and so are the request's later ones, so
                    that a medium slower than the engine never builds an unbounded queue of copies and held blocks
    submit(jobs)    one coroutine on the I/O loop runs the step's jobs in order behind earlier steps' (an eviction
                    never overtakes an earlier write); a skipped job runs only its evictions and the demotions it
                    carries, and its chunks are reported not stored; a job done reports what it wrote, so the
                    scheduler can serve those chunks before their request ends
    landed(tier, keys)  (an asynchronous load, on the I/O loop) waits for the jobs writing any of ``keys`` to
                    ``tier``: the scheduler plans loads of chunks whose writes it has not heard landed yet
Each job leaves the backlog when it is done, or when its step's future ends (cancelled after a bounded wait, even
before it ran). A job still running after ``SAVE_TIMEOUT_S`` is abandoned, and what it had not stored is reported
so; jobs queued behind it get a bound each, so a stuck medium holds a finished request's blocks for at most
``SAVE_TIMEOUT_S`` per job ahead of its last one. (A disk write already in its writer thread cannot be stopped:
its file may still land, unindexed until the tier next starts.)

The scheduler learns of chunks written (``report_stored``: it serves them from then on) and of chunks not stored
(``report_failed``) through the worker report, under the keys it planned with (rank 0's) and this worker's
tensor-parallel rank; a save still running past ``wait_timeout_s`` is dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.config import PolicyConfig
from kvtier.connector.plans import SaveSpec
from kvtier.connector.report import ReportBox
from kvtier.connector.worker.engine_kv import EngineKV
from kvtier.connector.worker.loads import WAIT_TIMEOUT_S, done
from kvtier.control.directory import StorePlan
from kvtier.control.metrics import WorkerCounters
from kvtier.records.keys import Key
from kvtier.tiers.memory.recycle import Recycler
from kvtier.tiers.runtime import SAVES_AT_STOP_S, LoopThread

if TYPE_CHECKING:
    import torch

    from kvtier.store.tiered import TieredStore

logger = logging.getLogger(__name__)

MAX_BACKLOG = PolicyConfig.save_backlog  # bytes of queued, unwritten saves past which saves are skipped
SAVE_TIMEOUT_S = 30.0  # a save job still running then is abandoned; what it had not stored is reported
SAVE_BUFFERS_IDLE = 256 << 20  # idle gather buffers kept for reuse

ReportFailed = Callable[[SaveSpec, "Sequence[StorePlan] | None", "Sequence[tuple[str, Key]]"], None]
ReportStored = Callable[[SaveSpec, "Sequence[StorePlan]", "Sequence[tuple[str, Key]]"], None]


@dataclass(frozen=True)
class SaveJob:
    """One save spec as the I/O loop runs it: the plans under this rank's keys and the gathered payloads
    (None: skipped, only its evictions and the demotions it carries run)."""

    spec: SaveSpec
    plans: list[StorePlan]
    items: dict[Key, torch.Tensor] | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.items or {}).values())


class SaveQueue:
    """Saves handed to the I/O loop, in step order, within a byte backlog."""

    def __init__(self, store: TieredStore, counters: WorkerCounters, report_failed: ReportFailed,
                 report_stored: ReportStored, max_backlog: int = MAX_BACKLOG) -> None:
        self.store = store
        self.max_backlog = max_backlog
        self._counters = counters
        self._report_failed = report_failed
        self._report_stored = report_stored
        self._backlog = 0  # bytes of jobs submitted and not yet done
        self._lock = threading.Lock()  # the backlog grows on the engine's thread and shrinks on the I/O loop
        self._order = asyncio.Lock()
        self.skipped_requests: set[str] = set()  # requests with a skipped save (their later chunks are skipped)
        self._writes: dict[tuple[str, Key], concurrent.futures.Future[None]] = {}  # (tier, key) -> job writing it

    @property
    def backlog(self) -> int:
        with self._lock:
            return self._backlog

    def admit(self, saves: Sequence[SaveSpec], chunk_bytes: Callable[[int], int]
              ) -> tuple[list[SaveSpec], list[SaveSpec]]:
        """This step's saves split into those to gather and those to skip; ``chunk_bytes(group)`` is the payload
        size of one chunk of the group. With nothing queued every save is taken, whatever its size; else a save
        that would take the backlog past ``max_backlog`` is skipped, and so is every later save of a request
        once one of its saves was (its later chunks could never be hit without the skipped ones)."""
        queued = self.backlog
        room = self.max_backlog - queued
        kept: list[SaveSpec] = []
        skipped: list[SaveSpec] = []
        for spec in saves:
            need = chunk_bytes(spec.group) * len(spec.keys)
            chained = not spec.evicted  # an evicted chunk is another request's: it skips no later chunk
            if spec.keys and ((chained and spec.req_id in self.skipped_requests) or (queued and need > room)):
                skipped.append(spec)
                if chained:
                    self.skipped_requests.add(spec.req_id)
            else:
                kept.append(spec)
                room -= need
        if skipped:
            chunks = sum(len(spec.keys) for spec in skipped)
            self._counters.save_skipped(chunks)
            logger.debug("%d chunk(s) not saved: %d bytes of saves are still queued", chunks, queued)
        return kept, skipped

    def forget(self, req_id: str) -> None:
        """The request has finished and its saves are done: a new request of that id starts afresh."""
        self.skipped_requests.discard(req_id)

    def submit(self, loop: LoopThread, jobs: Sequence[SaveJob]) -> concurrent.futures.Future[None]:
        """Run the step's ``jobs`` on ``loop`` after every earlier step's; the future of the whole step. Its bytes
        count in the backlog until each job is done, or until the future ends (cancelled before it ran, too)."""
        tally = [sum(job.nbytes for job in jobs)]
        ends = [self._claim(job) for job in jobs]
        with self._lock:
            self._backlog += tally[0]
        future = loop.submit(self._run(jobs, tally, ends))
        future.add_done_callback(lambda _: self._step_ended(jobs, tally, ends))
        return future

    def _step_ended(self, jobs: Sequence[SaveJob], tally: list[int],
                    ends: Sequence[concurrent.futures.Future[None]]) -> None:
        """The step's future ended (done, or cancelled even before it ran): what is left leaves the backlog, and
        no load waits for its jobs any longer."""
        self._release(tally, tally[0])
        for job, end in zip(jobs, ends, strict=True):
            self._end(job, end)

    def _claim(self, job: SaveJob) -> concurrent.futures.Future[None]:
        """The future that ends with ``job``; loads of the records it writes wait for it (``landed``)."""
        end: concurrent.futures.Future[None] = concurrent.futures.Future()
        writes = [(p.tier, k) for p in job.plans for k in p.store  # a skipped job writes only its demotions
                  if job.items is not None or p.source is not None]
        if writes:
            with self._lock:
                self._writes.update((w, end) for w in writes)
        return end

    def _end(self, job: SaveJob, end: concurrent.futures.Future[None]) -> None:
        """``job`` is done (or will never run): its writes stop being waited for."""
        with self._lock:
            for p in job.plans:
                for k in p.store:
                    if self._writes.get((p.tier, k)) is end:
                        del self._writes[(p.tier, k)]
            if not end.done():  # under the lock: the loop and a cancelling thread may both end it
                end.set_result(None)

    async def landed(self, tier: str, keys: Sequence[Key]) -> None:
        """Wait until no save job of this worker is still writing any of ``keys`` to ``tier`` (at once when none
        is). Whether the write succeeded is for the read to find out: a failed one is a miss."""
        with self._lock:
            ends = {id(f): f for f in (self._writes.get((tier, k)) for k in keys) if f is not None}
        for end in ends.values():  # shielded: a load that gives up must not cancel the job's end for the others
            await asyncio.shield(asyncio.wrap_future(end))

    async def _run(self, jobs: Sequence[SaveJob], tally: list[int],
                   ends: Sequence[concurrent.futures.Future[None]]) -> None:
        """Each job's plans through ``TieredStore.execute``, one job after another, each within SAVE_TIMEOUT_S."""
        # A step cancelled before the loop started it (a bounded wait gave up while the loop was busy) still gets
        # one first slice: its cancellation is delivered right after that slice. Yield it before touching a tier.
        await asyncio.sleep(0)
        async with self._order:
            for job, end in zip(jobs, ends, strict=True):
                t0 = time.perf_counter()
                failed: list[tuple[str, Key]] = []
                try:
                    stored = await asyncio.wait_for(
                        self.store.execute(job.plans, job.items or {}, failed, skip_writes=job.items is None),
                        SAVE_TIMEOUT_S)
                except Exception as exc:  # a failed save is a future miss, never an engine failure
                    self._failed(job, exc, failed)
                else:
                    self._stored(job, stored, failed, time.perf_counter() - t0)
                finally:
                    self._end(job, end)
                self._release(tally, job.nbytes)

    def _release(self, tally: list[int], nbytes: int) -> None:
        """Take up to ``nbytes`` of a step's remaining ``tally`` out of the backlog (never twice)."""
        with self._lock:
            n = min(nbytes, tally[0])
            tally[0] -= n
            self._backlog -= n

    def _failed(self, job: SaveJob, exc: Exception, failed: Sequence[tuple[str, Key]]) -> None:
        """Report a job that raised: a stuck medium (the job timed out) reports what was not stored by then."""
        if isinstance(exc, TimeoutError):
            logger.warning("a save of %s did not finish within %.0fs: dropped", job.spec.req_id, SAVE_TIMEOUT_S)
            self._counters.save_timed_out()
            self._report_failed(job.spec, job.plans, failed)
        else:
            logger.warning("save failed: %r", exc)
            self._counters.save_failed(len(job.spec.keys))
            self._report_failed(job.spec, None, ())

    def _stored(self, job: SaveJob, stored: dict[str, int], failed: Sequence[tuple[str, Key]],
                seconds: float) -> None:
        """Report a job that ran: a skipped job's writes, each not stored; its demotions as they went."""
        if failed:
            self._report_failed(job.spec, job.plans, failed)
        self._report_stored(job.spec, job.plans, failed)
        if job.items is not None:
            self._counters.saved(sum(stored.values()), job.nbytes, seconds)


class SavePath:
    """Saves of planned chunks from the engine's blocks, in step order, within the queue's byte backlog."""

    def __init__(self, kv: EngineKV, store: TieredStore, loop: LoopThread, counters: WorkerCounters,
                 report: ReportBox, max_backlog: int = MAX_BACKLOG) -> None:
        self._kv = kv
        self.store = store
        self._loop = loop
        self._counters = counters
        self._report = report
        self.queue = SaveQueue(store, counters, self.report_failed, self.report_stored, max_backlog)
        self.requests: dict[str, list[concurrent.futures.Future[None]]] = {}  # the futures of each request's saves
        self.finished_requests: set[str] = set()  # finished, with saves still running
        self.drops: list[concurrent.futures.Future[None]] = []  # steps of the scheduler's drops (no request's blocks)
        self._buffers = Recycler(SAVE_BUFFERS_IDLE)
        self.wait_timeout_s = WAIT_TIMEOUT_S

    def save(self, specs: Sequence[SaveSpec], drop: Set[str] = frozenset()) -> None:
        """Gather this step's saves now and hand them to the I/O loop in one job; write them to memory tiers at
        once when nothing is queued ahead (a copy, no I/O to hide), else in the background in step order. Saves
        that would take the backlog of queued, unwritten bytes past the queue's ``max_backlog`` are skipped: their
        evictions and the demotions they carry (other chunks') still run, and the scheduler forgets their chunks.
        So are the saves of the requests in ``drop`` (their load failed in this step: what it computed is wrong),
        without marking their later saves."""
        dropped = [s for s in specs if s.keys and s.req_id in drop]
        kept, skipped = self.queue.admit([s for s in specs if not (s.keys and s.req_id in drop)], self._kv.chunk_bytes)
        skipped.extend(dropped)
        t0 = time.perf_counter()
        payloads = self._gather(kept)
        self._counters.gathered(time.perf_counter() - t0)
        jobs = [SaveJob(spec, [self._kv.plan(spec.group, p) for p in spec.plans], None) for spec in skipped]
        for spec in kept:
            if any((spec.group, k) not in payloads for k in spec.keys):  # its group's gather failed: skipped
                jobs.append(SaveJob(spec, [self._kv.plan(spec.group, p) for p in spec.plans], None))
                continue
            items = {self._kv.key(spec.group, k): payloads[(spec.group, k)] for k in spec.keys}
            jobs.append(SaveJob(spec, [self._kv.plan(spec.group, p) for p in spec.plans], items))
        if not jobs:
            return
        sync = all(self._memory_only(job.plans) for job in jobs) and not self._saving()
        future = self.queue.submit(self._loop, jobs)
        if sync:
            self.bound([future])
        self.drops = [f for f in self.drops if not f.done()]
        for job in jobs:  # the scheduler's drops (evictions only) hold no request's blocks
            if job.spec.keys or any(p.store for p in job.spec.plans):
                self.requests.setdefault(job.spec.req_id, []).append(future)
            elif future not in self.drops:
                self.drops.append(future)

    def fail(self, specs: Sequence[SaveSpec]) -> None:
        """Store nothing (kvtier is disabled): the scheduler forgets these chunks."""
        for spec in specs:
            self.report_failed(spec)
            self.requests.setdefault(spec.req_id, []).append(done(None))

    def _memory_only(self, plans: Sequence[StorePlan]) -> bool:
        return all(p.source is None and self.store.tier(p.tier).is_memory for p in plans)

    def _saving(self) -> bool:
        return any(not f.done() for futures in self.requests.values() for f in futures)

    def _gather(self, saves: Sequence[SaveSpec]) -> dict[tuple[int, Key], torch.Tensor]:
        """One batched gather per group over every chunk any request saves this step, into recycled host
        buffers (a fresh allocation per step is first touched at a fraction of memory speed on VMs)."""
        per_group: dict[int, tuple[list[Key], list[tuple[int, ...]]]] = {}
        for spec in saves:
            keys, blocks = per_group.setdefault(spec.group, ([], []))
            keys.extend(spec.keys)
            blocks.extend(spec.block_ids)
        out: dict[tuple[int, Key], torch.Tensor] = {}
        for group, (keys, blocks) in per_group.items():
            if not keys:
                continue
            try:  # host copies: a step's saves must not hold device memory while tiers write them
                data = self._kv.gather(group, blocks, self._buffers)
            except (ValueError, RuntimeError, IndexError) as exc:  # a save is never worth an engine failure
                logger.warning("saving %d chunk(s) of group %d failed: %r", len(keys), group, exc)
                self._counters.save_failed(len(keys))
                continue
            out.update(((group, k), data[i]) for i, k in enumerate(keys))
        return out

    def report_failed(self, spec: SaveSpec, plans: Sequence[StorePlan] | None = None,
                      failed: Sequence[tuple[str, Key]] = ()) -> None:
        """Tell the scheduler (through the worker report) which chunks of ``spec`` were not stored, under the keys it
        planned with (rank 0's), with this worker's tensor-parallel rank: ``failed`` among this rank's
        ``plans``, or, without plans (the whole save raised), all of them. The scheduler forgets a chunk every
        rank failed instead of marking it READY, so no later lookup counts on it."""
        rank = self._kv.rank
        if plans is None:
            rows = [(spec.req_id, tier, key, rank) for tier, key in spec.stored_keys()]
        else:
            planned = _planned(spec, plans)
            rows = [(spec.req_id, tier, planned[(tier, k)], rank) for tier, k in failed if (tier, k) in planned]
        self._counters.not_stored(len(rows))
        self._report.fail(rows)

    def report_stored(self, spec: SaveSpec, plans: Sequence[StorePlan], failed: Sequence[tuple[str, Key]]) -> None:
        """Tell the scheduler which chunks of ``spec`` this rank has written (``plans`` less ``failed``), under the
        keys it planned with: once every rank has, it serves them to lookups without waiting for the request's
        end (vLLM's own prefix cache serves a block once computed; a request sent while an earlier one with the
        same prefix is still decoding hits here too). Nothing to tell when the store shares the scheduler's
        directory (one process): it has marked them itself."""
        if self.store.completes_writes:
            return
        missing = set(failed)
        rank = self._kv.rank
        self._report.stored([(spec.req_id, tier, theirs, rank) for (tier, mine), theirs in _planned(spec, plans).items()
                             if (tier, mine) not in missing])

    def flush(self) -> None:
        """Wait (at most ``wait_timeout_s``) until every pending save (and drop) is done."""
        self.bound([*self.drops, *(f for futures in self.requests.values() for f in futures)])

    def bound(self, futures: Sequence[concurrent.futures.Future[None]]) -> None:
        """Wait at most ``wait_timeout_s`` for ``futures``; saves still running then are cancelled (dropped)."""
        _, late = concurrent.futures.wait(futures, timeout=self.wait_timeout_s)
        if late:
            logger.warning("%d save(s) did not finish within %.1fs: dropped", len(late), self.wait_timeout_s)
            self._counters.save_timed_out(len(late))
            for future in late:
                future.cancel()  # not reported as failed: part of it may be stored (the scheduler learns on load)

    def of_finished(self, finished_req_ids: set[str]) -> list[list[concurrent.futures.Future[None]]]:
        """The save futures of each finished request (reported or not) that still holds saves."""
        return [self.requests[r] for r in self.finished_requests | (finished_req_ids & self.requests.keys())]

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests that have finished (now or earlier) and whose saves are all done; each is reported once."""
        self.finished_requests |= {r for r in finished_req_ids if r in self.requests}
        sending: set[str] = set()
        for req_id in list(self.finished_requests):
            if all(f.done() for f in self.requests[req_id]):
                sending.add(req_id)
                self.finished_requests.discard(req_id)
                del self.requests[req_id]
                self.queue.forget(req_id)
        return sending

    def close(self, wait_s: float = SAVES_AT_STOP_S) -> None:
        """Wait (at most ``wait_s``) for pending saves; the ones still running then are dropped."""
        pending = [*self.drops, *(f for futures in self.requests.values() for f in futures)]
        _, late = concurrent.futures.wait(pending, timeout=max(wait_s, 0.0))
        if late:
            logger.warning("%d save(s) still running at the stop after %.1fs: dropped", len(late), wait_s)
            for future in late:
                future.cancel()


def _planned(spec: SaveSpec, plans: Sequence[StorePlan]) -> dict[tuple[str, Key], Key]:
    """(tier, this rank's key) -> the key the scheduler planned with (rank 0's), for every write of ``plans``."""
    return {(mine.tier, k): key for theirs, mine in zip(spec.plans, plans, strict=True)
            for key, k in zip(theirs.store, mine.store, strict=True)}
