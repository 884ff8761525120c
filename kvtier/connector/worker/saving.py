"""The worker's queue of saves: admission against a byte backlog, then one job per step on the I/O loop.

Lifecycle, per engine step (``SavePath.save``, kvtier.connector.worker.saves):
    admit(saves)    splits the step's saves into kept and skipped: while saves are queued, one that would take
                    the backlog of unwritten bytes past ``max_backlog`` is skipped (``save_skipped_busy``), and so
                    are the request's later ones, so that a medium slower than the engine never builds an
                    unbounded queue of copies and held blocks
    submit(jobs)    after the worker gathered the kept ones: one coroutine on the I/O loop runs the step's jobs
                    in order behind earlier steps' (an eviction never overtakes an earlier write); a skipped
                    job runs only its evictions and the demotions it carries, and its chunks are reported not
                    stored; a job done reports
                    what it wrote, so the scheduler can serve those chunks before their request ends
    landed(tier, keys)  (an asynchronous load, on the I/O loop) waits for the jobs writing any of ``keys`` to
                    ``tier``: the scheduler plans loads of chunks whose writes it has not heard landed yet
Each job leaves the backlog when it is done, or when its step's future ends (cancelled after a bounded wait, even
before it ran). A job still running after ``SAVE_TIMEOUT_S`` is abandoned, and what it had not stored is reported
so; jobs queued behind it get a bound each, so a stuck medium holds a finished request's blocks for at most
``SAVE_TIMEOUT_S`` per job ahead of its last one. (A disk write already in its writer thread cannot be stopped:
its file may still land, unindexed until the tier next starts.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.config import PolicyConfig
from kvtier.connector.plans import SaveSpec
from kvtier.control.directory import StorePlan
from kvtier.control.metrics import WorkerCounters
from kvtier.records.keys import Key
from kvtier.tiers.runtime import LoopThread

if TYPE_CHECKING:
    import torch

    from kvtier.store.tiered import TieredStore

logger = logging.getLogger(__name__)

MAX_BACKLOG = PolicyConfig.save_backlog  # bytes of queued, unwritten saves past which saves are skipped
SAVE_TIMEOUT_S = 30.0  # a save job still running then is abandoned; what it had not stored is reported

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
            if spec.keys and (spec.req_id in self.skipped_requests or (queued and need > room)):
                skipped.append(spec)
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
        # A step cancelled before the loop started it (a bounded wait gave up while the loop was busy) still gets
        # one first slice: its cancellation is delivered right after that slice. Yield it before touching a tier.
        await asyncio.sleep(0)
        async with self._order:
            for job, end in zip(jobs, ends, strict=True):
                try:
                    await self._execute(job)
                finally:
                    self._end(job, end)
                self._release(tally, job.nbytes)

    def _release(self, tally: list[int], nbytes: int) -> None:
        """Take up to ``nbytes`` of a step's remaining ``tally`` out of the backlog (never twice)."""
        with self._lock:
            n = min(nbytes, tally[0])
            tally[0] -= n
            self._backlog -= n

    async def _execute(self, job: SaveJob) -> None:
        spec, plans, items = job.spec, job.plans, job.items
        t0 = time.perf_counter()
        failed: list[tuple[str, Key]] = []
        try:
            stored = await asyncio.wait_for(self.store.execute(plans, items or {}, failed, skip_writes=items is None),
                                            SAVE_TIMEOUT_S)
        except TimeoutError:  # a stuck medium: what was not stored by then is reported, and the job ends
            logger.warning("a save of %s did not finish within %.0fs: dropped", spec.req_id, SAVE_TIMEOUT_S)
            self._counters.save_timed_out()
            self._report_failed(spec, plans, failed)
            return
        except Exception as exc:  # a failed save is a future miss, never an engine failure
            logger.warning("save failed: %r", exc)
            self._counters.save_failed(len(spec.keys))
            self._report_failed(spec, None, ())
            return
        if failed:  # a skipped job's writes, each reported not stored; the demotions it carries as they went
            self._report_failed(spec, plans, failed)
        self._report_stored(spec, plans, failed)
        if items is not None:
            self._counters.saved(sum(stored.values()), job.nbytes, time.perf_counter() - t0)
