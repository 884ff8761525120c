"""The worker half's load path: read the chunks the scheduler planned to load and scatter them into the engine's
blocks. Decides nothing.

Lifecycle, per engine step (``WorkerHalf.start_load_kv`` / ``get_finished``):
    start(loads)      synchronous loads run now, on the engine's thread, one copy per byte: memory tiers lend
                      pinned views, scattered straight into the blocks and released once the device consumed
                      them; asynchronous loads start their reads on the I/O loop, each
                      after this worker's save job writing its records, if one is queued or running
                      (``SaveQueue.landed``: the scheduler serves chunks whose writes are still in flight)
    fail(loads)       (kvtier disabled) every planned load fails: the engine recomputes those blocks
    finished()        scatters the asynchronous loads whose reads are done; their requests
    take_errors()     blocks whose chunk could not be read or copied (miss, corrupt, dead tier, bad record)
    close()           abandons pending asynchronous loads

Every wait is bounded (``wait_timeout_s``; an asynchronous load ``async_load_timeout_s``): a stuck medium fails the
load (its blocks become load errors) and is logged, never hangs the engine. A chunk counts as loaded
(``kvtier.control.metrics.WorkerCounters.loaded``) only once its copy into the engine's blocks completed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier.connector.plans import LoadSpec
from kvtier.connector.report import ReportBox
from kvtier.connector.worker.engine_kv import EngineKV
from kvtier.control.metrics import WorkerCounters
from kvtier.layout.geometry import NULL_BLOCK
from kvtier.records.keys import Key
from kvtier.tiers.runtime import LoopThread

if TYPE_CHECKING:
    import torch

    from kvtier.store.tiered import TieredStore

logger = logging.getLogger(__name__)

Reads = list["torch.Tensor | None"]
T = TypeVar("T")

WAIT_TIMEOUT_S = 5.0  # longest blocking wait of the engine's thread on the I/O loop (loads, saves)
ASYNC_LOAD_TIMEOUT_S = 30.0  # an asynchronous load that takes longer fails (its blocks become load errors)
CANCEL_GRACE_S = 1.0  # extra wait for a timed-out coroutine to unwind


def done(value: T) -> concurrent.futures.Future[T]:
    """A future already holding ``value``."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    future.set_result(value)
    return future


class GroupLoad:
    """The chunks of one group read for one scatter: their blocks, payloads, tiers and the load each came from."""

    def __init__(self) -> None:
        self.blocks: list[tuple[int, ...]] = []
        self.payloads: list[torch.Tensor] = []
        self.chunks: list[tuple[LoadSpec, Key]] = []
        self.per_tier: dict[str, int] = {}
        self.nbytes = 0

    def add(self, spec: LoadSpec, key: Key, ids: tuple[int, ...], payload: torch.Tensor) -> None:
        tier = spec.tier
        self.blocks.append(ids)
        self.payloads.append(payload)
        self.chunks.append((spec, key))
        self.per_tier[tier] = self.per_tier.get(tier, 0) + 1
        self.nbytes += payload.numel() * payload.element_size()


class LoadPath:
    """Loads of planned chunks into the engine's blocks, synchronous or on the I/O loop."""

    def __init__(self, kv: EngineKV, store: TieredStore, loop: LoopThread, counters: WorkerCounters,
                 report: ReportBox, landed: Callable[[str, Sequence[Key]], Awaitable[None]] | None = None) -> None:
        """``landed``: this worker's save queue's (``SaveQueue.landed``), whose writes an asynchronous read waits
        for."""
        self._kv = kv
        self._landed = landed
        self.store = store
        self._loop = loop
        self._counters = counters
        self._report = report
        self.recving: dict[str, tuple[list[LoadSpec], concurrent.futures.Future[list[Reads]]]] = {}
        self._errors: set[int] = set()
        self._failed_requests: set[str] = set()
        self.failed_now: set[str] = set()  # requests whose synchronous load failed in this step (reset per step)
        self.wait_timeout_s = WAIT_TIMEOUT_S
        self.async_load_timeout_s = ASYNC_LOAD_TIMEOUT_S

    def start(self, loads: Sequence[LoadSpec]) -> None:
        """Run the synchronous loads now; start the asynchronous ones on the I/O loop."""
        sync = [s for s in loads if not s.is_async]
        if sync:
            t0 = time.perf_counter()
            self._load_now(sync)
            self._counters.load_timed(time.perf_counter() - t0)
        by_req: dict[str, list[LoadSpec]] = {}
        for spec in loads:
            if spec.is_async:
                by_req.setdefault(spec.req_id, []).append(spec)
        for req_id, specs in by_req.items():
            self.recving[req_id] = (specs, self._submit(self._read_all(specs), self.async_load_timeout_s))

    def fail(self, loads: Sequence[LoadSpec]) -> None:
        """Fail every load (kvtier is disabled): the blocks become load errors, asynchronous ones finish now."""
        self.apply(loads, [[None] * len(s.keys) for s in loads])
        for spec in loads:
            if spec.is_async and spec.req_id not in self.recving:
                self.recving[spec.req_id] = ([], done([]))

    def _load_now(self, specs: Sequence[LoadSpec]) -> None:
        """Synchronous loads, one copy per byte: memory tiers lend pinned views on the engine's thread (no hand-off
        to the I/O loop: a memory tier is thread-safe), scattered straight into the blocks and released once the
        device has consumed them."""
        lent: list[tuple[str, list[Key]]] = []
        failed: set[str] = set()  # tiers that failed or stayed busy in this step: their other specs fail at once
        try:
            try:
                results = [self._lend(spec, lent, failed) for spec in specs]
            except Exception as exc:  # a bug, not a medium: fail the loads, not the engine
                logger.warning("synchronous load failed: %r", exc)
                results = [[None] * len(s.keys) for s in specs]
            self.apply(specs, results)
        finally:
            try:
                self._kv.sync_devices()  # queued device copies may still read the borrowed views
            finally:
                for tier, keys in lent:
                    self._release(tier, keys)

    def _lend(self, spec: LoadSpec, lent: list[tuple[str, list[Key]]], failed: set[str]) -> Reads:
        """What ``spec``'s tier lends (kept in ``lent``, to release; None for a miss), waiting at most
        ``wait_timeout_s`` for the tier; a tier that lends nothing is read on the I/O loop, bounded. A tier that
        fails or stays busy past the bound fails this spec, and its other specs of the step without a wait."""
        keys = [self._kv.key(spec.group, k) for k in spec.keys]
        if spec.tier in failed:
            return [None] * len(keys)
        try:
            values = self.store.borrow(spec.tier, keys, self.wait_timeout_s)
            if values is None:
                return self.run_bounded(self.store.read(spec.tier, keys))
        except Exception as exc:  # a dead, stuck or busy tier fails the load, not the engine
            logger.warning("synchronous load from %s failed: %r", spec.tier, exc)
            failed.add(spec.tier)
            return [None] * len(keys)
        lent.append((spec.tier, keys))
        return values

    def _release(self, tier: str, keys: list[Key]) -> None:
        """End a borrow; a release that fails is logged, never reaches the engine."""
        try:
            self.store.release(tier, keys)
        except Exception as exc:
            logger.warning("releasing %d borrowed view(s) of %s failed: %r", len(keys), tier, exc)

    def _submit(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the I/O loop, bounded by ``timeout_s``; a loop already closed raises ``RuntimeError``
        and closes ``coro`` (never left unawaited)."""
        bounded = asyncio.wait_for(coro, timeout_s)
        try:
            return self._loop.submit(bounded)
        except RuntimeError:
            bounded.close()
            coro.close()
            raise

    def run_bounded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the I/O loop for at most ``wait_timeout_s`` (it is cancelled then, and
        ``TimeoutError`` raised)."""
        future = self._submit(coro, self.wait_timeout_s)
        try:
            return future.result(self.wait_timeout_s + CANCEL_GRACE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"I/O did not finish within {self.wait_timeout_s + CANCEL_GRACE_S:.1f}s") from None

    async def _read_all(self, specs: Sequence[LoadSpec]) -> list[Reads]:
        return list(await asyncio.gather(*(self._read_landed(s) for s in specs)))

    async def _read_landed(self, spec: LoadSpec) -> Reads:
        """Read ``spec``'s records once no save job of this worker is still writing them (a failed write: misses)."""
        keys = [self._kv.key(spec.group, k) for k in spec.keys]
        if self._landed is not None:
            await self._landed(spec.tier, keys)
        return await self.store.read(spec.tier, keys)

    def apply(self, specs: Sequence[LoadSpec], results: Sequence[Reads]) -> None:
        """Scatter what was read, one batched scatter per group; blocks of failed chunks become errors.

        A chunk counts as loaded only once its copy into the engine's blocks has completed; a chunk that was not
        read, or whose group's scatter failed, counts as a load failure and its blocks are reported for
        recompute."""
        per_group: dict[int, GroupLoad] = {}
        missing: list[tuple[LoadSpec, Key, tuple[int, ...]]] = []
        for spec, values in zip(specs, results, strict=True):
            state = self._kv.is_state_group(spec.group)
            for key, ids, value in zip(spec.keys, spec.block_ids, values, strict=True):
                if value is None or (state and all(b == NULL_BLOCK for b in ids)):  # a state needs its block
                    missing.append((spec, key, ids))
                    continue
                per_group.setdefault(spec.group, GroupLoad()).add(spec, key, ids, value)
        if missing:
            self._counters.load_failed(len(missing))
            self._failed(missing)
        for group, load in per_group.items():
            try:
                self._kv.scatter(group, load.blocks, load.payloads)
            except (ValueError, RuntimeError, IndexError) as exc:  # wrong shape/dtype: a bad record
                logger.warning("loading %d chunk(s) into group %d failed: %s", len(load.blocks), group, exc)
                self._counters.load_failed(len(load.blocks), scatter=True)
                self._failed([(spec, key, ids) for (spec, key), ids in zip(load.chunks, load.blocks, strict=True)])
                continue
            self._counters.loaded(group, load.per_tier, load.nbytes,
                                  [(spec.tier, ids) for (spec, _), ids in zip(load.chunks, load.blocks, strict=True)])

    def _failed(self, chunks: Sequence[tuple[LoadSpec, Key, tuple[int, ...]]]) -> None:
        """Report chunks that could not be loaded: with several KV-cache groups an asynchronous load fails as a
        whole request (its chunks told to the scheduler in the worker report), block ids being unique only within
        a group; otherwise their blocks become load errors (the engine recomputes from the first)."""
        several = self._kv.kcc is not None and len(self._kv.kcc.kv_cache_groups) > 1
        for spec, _, ids in chunks:
            if not spec.is_async:
                self.failed_now.add(spec.req_id)
            if several and spec.is_async:
                self._failed_requests.add(spec.req_id)
            else:
                self._errors.update(b for b in ids if b != NULL_BLOCK)
        self._report.fail_loads((spec.tier, key) for spec, key, _ in chunks if several and spec.is_async)

    def take_failed_requests(self) -> set[str]:
        """Requests whose asynchronous load failed since the last call (reported with their ``finished_recving``)."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def finished(self) -> set[str]:
        """Scatter the asynchronous loads whose reads are done (failed reads: load errors); their requests."""
        recving: set[str] = set()
        for req_id, (specs, future) in list(self.recving.items()):
            if not future.done():
                continue
            del self.recving[req_id]
            try:
                results = future.result()
            except Exception as exc:
                logger.warning("asynchronous load of %s failed: %r", req_id, exc)
                results = [[None] * len(s.keys) for s in specs]
            self.apply(specs, results)
            recving.add(req_id)
        return recving

    def pending(self) -> list[concurrent.futures.Future[list[Reads]]]:
        """The futures of the asynchronous loads not reported yet."""
        return [future for _, future in self.recving.values()]

    def take_errors(self) -> set[int]:
        """Blocks whose load failed since the last call."""
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        """Abandon pending asynchronous loads."""
        for _, future in self.recving.values():
            future.cancel()
        self.recving.clear()
