"""The worker's queue of saves: admission against a byte backlog, then one job per step on the I/O loop.

Lifecycle, per engine step (``WorkerHalf.wait_for_save``):
    admit(saves)    splits the step's saves into kept and skipped: a save that would take the backlog of
                    queued, unwritten bytes past ``max_backlog`` is skipped (``save_skipped_busy``), so that a
                    medium slower than the engine never builds an unbounded queue of copies and held blocks
    submit(jobs)    after the worker gathered the kept ones: one coroutine on the I/O loop runs the step's jobs
                    in order behind earlier steps' (an eviction never overtakes an earlier write); a skipped
                    job runs only its evictions, and its chunks are reported not stored
Each job leaves the backlog when it is done, or when its step's future is cancelled (a bounded wait timed out).
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

from kvtier.connector.counters import WorkerCounters
from kvtier.connector.plans import SaveSpec
from kvtier.directory import StorePlan
from kvtier.keys import Key
from kvtier.runtime import LoopThread

if TYPE_CHECKING:
    import torch

    from kvtier.store import TieredStore

logger = logging.getLogger(__name__)

MAX_BACKLOG = 256 << 20  # bytes of queued, unwritten saves past which a step's saves are skipped

ReportFailed = Callable[[SaveSpec, "Sequence[StorePlan] | None", "Sequence[tuple[str, Key]]"], None]


@dataclass(frozen=True)
class SaveJob:
    """One save spec as the I/O loop runs it: the plans under this rank's keys and the gathered payloads
    (None: skipped, only its evictions run)."""

    spec: SaveSpec
    plans: list[StorePlan]
    items: dict[Key, torch.Tensor] | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.items or {}).values())


class SaveQueue:
    """Saves handed to the I/O loop, in step order, within a byte backlog."""

    def __init__(self, store: TieredStore, stats: WorkerCounters, report_failed: ReportFailed,
                 max_backlog: int = MAX_BACKLOG) -> None:
        self.store = store
        self.max_backlog = max_backlog
        self._stats = stats
        self._report_failed = report_failed
        self._backlog = 0  # bytes of jobs submitted and not yet done
        self._lock = threading.Lock()  # the backlog grows on the engine's thread and shrinks on the I/O loop
        self._order = asyncio.Lock()

    @property
    def backlog(self) -> int:
        with self._lock:
            return self._backlog

    def admit(self, saves: Sequence[SaveSpec], chunk_bytes: Callable[[int], int]
              ) -> tuple[list[SaveSpec], list[SaveSpec]]:
        """This step's saves split into those within the backlog bound and those to skip; ``chunk_bytes(group)``
        is the payload size of one chunk of the group."""
        room = self.max_backlog - self.backlog
        kept: list[SaveSpec] = []
        skipped: list[SaveSpec] = []
        for spec in saves:
            need = chunk_bytes(spec.group) * len(spec.keys)
            if need > room and spec.keys:
                skipped.append(spec)
            else:
                kept.append(spec)
                room -= need
        if skipped:
            chunks = sum(len(spec.keys) for spec in skipped)
            self._stats.add(save_skipped_busy=chunks)
            logger.debug("%d chunk(s) not saved: %d bytes of saves are still queued", chunks, self.backlog)
        return kept, skipped

    def submit(self, loop: LoopThread, jobs: Sequence[SaveJob]) -> concurrent.futures.Future[None]:
        """Run the step's ``jobs`` on ``loop`` after every earlier step's; the future of the whole step."""
        with self._lock:
            self._backlog += sum(job.nbytes for job in jobs)
        return loop.submit(self._run(jobs))

    async def _run(self, jobs: Sequence[SaveJob]) -> None:
        left = list(jobs)
        try:
            async with self._order:
                while left:
                    await self._execute(left[0])
                    self._unqueue(left.pop(0).nbytes)
        finally:  # cancelled: what never ran leaves the backlog too
            self._unqueue(sum(job.nbytes for job in left))

    def _unqueue(self, nbytes: int) -> None:
        with self._lock:
            self._backlog -= nbytes

    async def _execute(self, job: SaveJob) -> None:
        spec, plans, items = job.spec, job.plans, job.items
        t0 = time.perf_counter()
        failed: list[tuple[str, Key]] = []
        try:
            stored = await self.store.execute(plans, items or {}, failed, skip_writes=items is None)
        except Exception as exc:  # a failed save is a future miss, never an engine failure
            logger.warning("save failed: %r", exc)
            self._stats.add(save_failures=len(spec.keys))
            self._report_failed(spec, None, ())
            return
        if items is None:
            self._report_failed(spec, None, ())
            return
        if failed:
            self._report_failed(spec, plans, failed)
        self._stats.add(save_chunks=sum(stored.values()), save_bytes=job.nbytes,
                        save_seconds=time.perf_counter() - t0)
