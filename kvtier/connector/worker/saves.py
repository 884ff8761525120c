"""The worker half's save path: gather the chunks the scheduler planned to save out of the engine's blocks, hand
them to the save queue (kvtier.connector.worker.saving), and report what was written and what was not. Decides nothing.

Lifecycle, per engine step (``WorkerHalf.wait_for_save`` / ``get_finished``):
    save(specs)                 gathers the step's kept saves into recycled host buffers (the blocks are free to
                                reuse once it returns), then one job on the I/O loop: evict / demote / write in
                                order, at once for memory-only saves with nothing queued ahead
    fail(specs)                 (kvtier disabled) every save is reported not stored
    flush()                     waits (bounded) for every pending save
    finished(finished_req_ids)  requests that have finished and whose saves are all done
    close()                     waits for pending saves

The scheduler learns of chunks written (``report_stored``: it serves them from then on) and of chunks not stored
(``report_failed``) through the worker report, under the keys it planned with (rank 0's) and this worker's
tensor-parallel rank; a save still running past ``wait_timeout_s`` is dropped.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence, Set
from typing import TYPE_CHECKING

from kvtier.connector.plans import SaveSpec
from kvtier.connector.report import ReportBox
from kvtier.connector.worker.engine_kv import EngineKV
from kvtier.connector.worker.loads import WAIT_TIMEOUT_S, done
from kvtier.connector.worker.saving import MAX_BACKLOG, SaveJob, SaveQueue
from kvtier.control.directory import StorePlan
from kvtier.control.metrics import WorkerCounters
from kvtier.records.keys import Key
from kvtier.tiers.memory.recycle import Recycler
from kvtier.tiers.runtime import SAVES_AT_STOP_S, LoopThread

if TYPE_CHECKING:
    import torch

    from kvtier.store.tiered import TieredStore

logger = logging.getLogger(__name__)

SAVE_BUFFERS_IDLE = 256 << 20  # idle gather buffers kept for reuse


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
