"""Worker half of KVTierConnector: the data plane. Executes the scheduler's plans; decides nothing.

Lifecycle:
    register_kv_caches(kv_caches)         layers -> groups, layout of each group's paged tensors
  per step:
    start_load_kv(metadata)               sync loads: borrow views (memory tiers), scatter, release, before
                                          returning;
                                          async loads: reads start on the I/O loop
    handle_preemptions()                  (vLLM: before every step) gathers saves a step left unflushed;
                                          never waits for writes
    wait_for_save()                       gather this step's save chunks (the blocks are free to reuse once
                                          it returns), then evict / demote / write on the I/O loop, in order,
                                          within a byte backlog (kvtier.connector.saving)
    get_finished(finished_req_ids)        scatter finished async loads; report them (finished_recving) and
                                          requests whose saves are all done and that have finished
    get_block_ids_with_load_errors()      blocks whose chunk could not be read (miss, corrupt, dead tier)
    flush() / stats() / close()           flush waits (bounded) for every pending save

Every wait is bounded (``wait_timeout_s``, async loads ``async_load_timeout_s``, a background save
``saving.SAVE_TIMEOUT_S``): a stuck medium fails the work (loads: their blocks become load errors; saves: dropped,
reported not stored) and is logged, never hangs the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier.connector.base import KVConnectorStats
from kvtier.connector.counters import GroupLoad, WorkerCounters
from kvtier.connector.keying import Identity, namespaces, rank_key
from kvtier.connector.plans import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.connector.registration import derive_config, group_tensors
from kvtier.connector.report import ReportBox, WorkerReport
from kvtier.connector.saving import MAX_BACKLOG, SaveJob, SaveQueue
from kvtier.directory import StorePlan
from kvtier.errors import ConnectorError
from kvtier.geometry import NULL_BLOCK, KVLayout, kernel_ids
from kvtier.keys import Key
from kvtier.layout import KVCacheConfig
from kvtier.runtime import LoopThread
from kvtier.tiers.memory.recycle import Recycler, size_class
from kvtier.transfer import gather, gathered_shape, scatter

if TYPE_CHECKING:
    import torch

    from kvtier.store import TieredStore

logger = logging.getLogger(__name__)

Reads = list["torch.Tensor | None"]
T = TypeVar("T")

WAIT_TIMEOUT_S = 5.0  # longest blocking wait of the engine's thread on the I/O loop (loads, releases, saves)
ASYNC_LOAD_TIMEOUT_S = 30.0  # an asynchronous load that takes longer fails (its blocks become load errors)
IDLE_WAIT_S = 0.02  # in a step that computes nothing, wait this long at most for a pending load or save
CANCEL_GRACE_S = 1.0  # extra wait for a timed-out coroutine to unwind (release what it borrowed)
SAVE_BUFFERS_IDLE = 256 << 20  # idle gather buffers kept for reuse


def _done(value: T) -> concurrent.futures.Future[T]:
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    future.set_result(value)
    return future


class WorkerHalf:
    """Moves bytes between the engine's paged KV tensors and a TieredStore, following the plans."""

    def __init__(self, kcc: KVCacheConfig | None, store: TieredStore, loop: LoopThread, *,
                 identity: Identity | None = None, chunk_size: int = 256, layout: KVLayout | None = None,
                 strict: bool = False, max_backlog: int = MAX_BACKLOG) -> None:
        self.kcc = kcc
        self.store = store
        self._loop = loop
        self._identity = identity
        self._chunk_size = chunk_size
        self._rank_spaces: list[bytes] | None = None
        self._layout_hint = layout
        self._layers: list[list[torch.Tensor]] = []
        self._layouts: list[KVLayout] = []
        self._ratios: list[int] = []  # kernel blocks per scheduler block, per group
        self._chunk_nbytes: dict[int, int] = {}  # payload bytes of one chunk, per group (computed on first use)
        self.strict = strict
        self._idle = False  # the current step computes no token (see get_finished)
        self.disabled: str | None = None  # why kvtier serves nothing in this engine (see register_kv_caches)
        self._meta: KVTierMetadata | None = None
        self._recving: dict[str, tuple[list[LoadSpec], concurrent.futures.Future[list[Reads]]]] = {}
        self._saves: dict[str, list[concurrent.futures.Future[None]]] = {}
        self._finished: set[str] = set()
        self._errors: set[int] = set()
        self._stats = WorkerCounters()
        self._queue = SaveQueue(store, self._stats, self._report_failed, max_backlog)
        self._buffers = Recycler(SAVE_BUFFERS_IDLE)
        self._report = ReportBox()
        self.wait_timeout_s = WAIT_TIMEOUT_S
        self.async_load_timeout_s = ASYNC_LOAD_TIMEOUT_S

    # ---- setup -----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Map every registered layer to its group; groups keep their layers in config order.

        KV tensors kvtier cannot read (an unknown layout or shape) disable it for this engine: one error is
        logged, every planned load becomes a load error (the engine recomputes), every save is reported not
        stored, and the scheduler, told through the worker report, stops planning. The engine starts and serves. With
        ``strict`` the error is raised instead."""
        if self.disabled is not None:
            return
        try:
            self._register(kv_caches)
        except (ConnectorError, ValueError) as exc:
            if self.strict:
                raise
            self.disable(f"{exc}. Set strict: true in kvtier's config to fail at start instead")

    def disable(self, reason: str) -> None:
        """Serve nothing from now on: planned loads fail (recomputed), saves are reported not stored, and the
        scheduler, told through the worker report, stops planning."""
        self.disabled = reason
        self._layers, self._layouts, self._ratios = [], [], []
        self._stats.add(kvtier_disabled=1)
        self._report.disable()
        logger.error("kvtier is disabled for this engine (it serves without the cache): %s", reason)

    def _register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if self.kcc is None:
            logger.warning("no kv_cache_config given: treating all %d layers as one full-attention group",
                           len(kv_caches))
            self.kcc = derive_config(kv_caches)
        groups = [group_tensors(gid, group, kv_caches, self.kcc.kv_layout, self._layout_hint, self.kcc.num_blocks)
                  for gid, group in enumerate(self.kcc.kv_cache_groups)]
        self._layers = [g.layers for g in groups]
        self._layouts = [g.layout for g in groups]
        self._ratios = [g.ratio for g in groups]
        if self._identity is not None and self._identity.tp_rank != 0:
            self._rank_spaces = namespaces(self._identity, self.kcc, self._chunk_size)

    def _kernel(self, group: int, block_ids: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """The scheduler's block ids of each chunk as ids of the group's tensors (kernel blocks)."""
        ratio = self._ratios[group]
        return [kernel_ids(ids, ratio) for ids in block_ids]

    def _key(self, group: int, key: Key) -> Key:
        if self._rank_spaces is None:
            return key
        return rank_key(key, self._rank_spaces[group])

    def _plan(self, group: int, plan: StorePlan) -> StorePlan:
        if self._rank_spaces is None:
            return plan
        return StorePlan(plan.tier, tuple(self._key(group, k) for k in plan.store),
                         tuple(self._key(group, k) for k in plan.evicted), plan.source)

    # ---- loads -----------------------------------------------------------------------------------------
    def start_load_kv(self, metadata: KVTierMetadata | None) -> None:
        """Run this step's synchronous loads now; start the asynchronous ones on the I/O loop."""
        if self._meta is not None and self._meta.saves:
            self.wait_for_save()  # a previous step's saves that nothing flushed yet go first
        self._meta = metadata
        self._idle = metadata is not None and metadata.idle
        if metadata is None or not metadata.loads:
            return
        if self.disabled is not None:  # every planned load fails: the engine recomputes those blocks
            failed: list[Reads] = [[None] * len(s.keys) for s in metadata.loads]
            self._apply(metadata.loads, failed)
            for spec in metadata.loads:
                if spec.is_async and spec.req_id not in self._recving:
                    self._recving[spec.req_id] = ([], _done([]))
            return
        sync = [s for s in metadata.loads if not s.is_async]
        if sync:
            t0 = time.perf_counter()
            self._load_now(sync)
            self._stats.add(load_seconds=time.perf_counter() - t0)
        by_req: dict[str, list[LoadSpec]] = {}
        for spec in metadata.loads:
            if spec.is_async:
                by_req.setdefault(spec.req_id, []).append(spec)
        for req_id, specs in by_req.items():
            read = asyncio.wait_for(self._read_all(specs), self.async_load_timeout_s)
            self._recving[req_id] = (specs, self._loop.submit(read))

    def _load_now(self, specs: Sequence[LoadSpec]) -> None:
        """Synchronous loads, one copy per byte: memory tiers lend pinned views that are scattered straight into
        the blocks, then released (after the device has consumed them)."""
        borrowed: list[tuple[str, list[Key]]] = []
        try:
            results = self._run_bounded(self._borrow_all(specs, borrowed))
        except Exception as exc:  # a dead or stuck tier fails the load, not the engine
            logger.warning("synchronous load failed: %r", exc)
            results = [[None] * len(s.keys) for s in specs]
        try:
            self._apply(specs, results)
            self._sync_devices()
        finally:
            if borrowed:
                try:
                    self._run_bounded(self._release_all(borrowed))
                except Exception as exc:  # a release that fails must not replace the load's outcome
                    logger.warning("releasing %d borrowed batch(es) failed: %r", len(borrowed), exc)

    def _run_bounded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the I/O loop for at most ``wait_timeout_s`` (it is cancelled then, and
        ``TimeoutError`` raised)."""
        future = self._loop.submit(asyncio.wait_for(coro, self.wait_timeout_s))
        try:
            return future.result(self.wait_timeout_s + CANCEL_GRACE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"I/O did not finish within {self.wait_timeout_s + CANCEL_GRACE_S:.1f}s") from None

    def _sync_devices(self) -> None:
        """Wait for the copies queued on the layers' CUDA devices (they may still read borrowed host views)."""
        devices = {t.device for layers in self._layers for t in layers if t.is_cuda}
        if devices:
            import torch

            for device in devices:
                torch.cuda.current_stream(device).synchronize()

    async def _borrow_all(self, specs: Sequence[LoadSpec], borrowed: list[tuple[str, list[Key]]]) -> list[Reads]:
        """Like ``_read_all``, but memory tiers lend views; ``borrowed`` lists what to release, even on error."""
        out: list[Reads] = []
        try:
            for spec in specs:
                keys = [self._key(spec.group, k) for k in spec.keys]
                if self.store.tier(spec.tier).is_memory:
                    out.append(await self.store.borrow(spec.tier, keys))
                    borrowed.append((spec.tier, keys))
                else:
                    out.append(await self.store.read(spec.tier, keys))
        except BaseException:
            await self._release_all(borrowed)
            borrowed.clear()
            raise
        return out

    async def _release_all(self, borrowed: Sequence[tuple[str, list[Key]]]) -> None:
        for tier, keys in borrowed:
            await self.store.release(tier, keys)

    async def _read_all(self, specs: Sequence[LoadSpec]) -> list[Reads]:
        reads = [self.store.read(s.tier, [self._key(s.group, k) for k in s.keys]) for s in specs]
        return list(await asyncio.gather(*reads))

    def _apply(self, specs: Sequence[LoadSpec], results: Sequence[Reads]) -> None:
        """Scatter what was read, one batched scatter per group; blocks of failed chunks become errors.

        A chunk counts as loaded (``load_chunks``, ``hits_<tier>``, ``load_chunks_group<g>``, ``load_bytes``) only
        once its copy into the engine's blocks has completed; a chunk that was not read, or whose group's scatter
        failed, counts in ``load_failures`` and its blocks are reported for recompute."""
        per_group: dict[int, GroupLoad] = {}
        missing = 0
        for spec, values in zip(specs, results, strict=True):
            for ids, value in zip(spec.block_ids, values, strict=True):
                if value is None:
                    self._errors.update(b for b in ids if b != NULL_BLOCK)
                    missing += 1
                    continue
                per_group.setdefault(spec.group, GroupLoad()).add(spec.tier, ids, value)
        if missing:
            self._stats.add(load_failures=missing)
        for group, load in per_group.items():
            try:
                scatter(self._layers[group], self._kernel(group, load.blocks), self._layouts[group], load.payloads)
            except (ValueError, RuntimeError, IndexError) as exc:  # wrong shape/dtype: a bad record
                logger.warning("loading %d chunk(s) into group %d failed: %s", len(load.blocks), group, exc)
                self._errors.update(b for ids in load.blocks for b in ids if b != NULL_BLOCK)
                self._stats.add(load_failures=len(load.blocks), load_scatter_failures=len(load.blocks))
                continue
            self._stats.add(load_chunks=len(load.blocks), load_bytes=load.nbytes,
                            **{f"load_chunks_group{group}": len(load.blocks)},
                            **{f"hits_{tier}": n for tier, n in load.per_tier.items()})

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Synchronous loads are complete when ``start_load_kv`` returns; nothing to wait for per layer."""

    # ---- saves -----------------------------------------------------------------------------------------
    def wait_for_save(self) -> None:
        """Gather this step's save chunks now (the blocks are free to reuse once it returns) and hand them to the
        I/O loop in one job; write them to memory tiers at once when nothing is queued ahead (a copy, no I/O
        to hide), else in the background in step order. Saves that would take the backlog of queued, unwritten
        bytes past ``max_backlog`` are skipped (``save_skipped_busy``): their evictions still run, and the
        scheduler forgets their chunks."""
        meta, self._meta = self._meta, None
        if meta is None or not meta.saves:
            return
        if self.disabled is not None:  # nothing is stored: the scheduler forgets these chunks
            for spec in meta.saves:
                self._report_failed(spec)
                self._saves.setdefault(spec.req_id, []).append(_done(None))
            return
        kept, skipped = self._queue.admit(meta.saves, self._chunk_bytes)
        t0 = time.perf_counter()
        payloads = self._gather(kept)
        self._stats.add(save_gather_seconds=time.perf_counter() - t0)
        jobs = [SaveJob(spec, [self._plan(spec.group, p) for p in spec.plans], None) for spec in skipped]
        for spec in kept:
            if any((spec.group, k) not in payloads for k in spec.keys):  # its group's gather failed
                self._report_failed(spec)
                self._saves.setdefault(spec.req_id, []).append(_done(None))
                continue
            items = {self._key(spec.group, k): payloads[(spec.group, k)] for k in spec.keys}
            jobs.append(SaveJob(spec, [self._plan(spec.group, p) for p in spec.plans], items))
        if not jobs:
            return
        sync = all(self._memory_only(job.plans) for job in jobs) and not self._saving()
        future = self._queue.submit(self._loop, jobs)
        if sync:
            self._bound_saves([future])
        for job in jobs:
            self._saves.setdefault(job.spec.req_id, []).append(future)

    def _chunk_bytes(self, group: int) -> int:
        """Payload bytes of one chunk of ``group`` (0 for a group this worker holds no tensors of)."""
        known = self._chunk_nbytes.get(group)
        if known is not None:
            return known
        if self.kcc is None or group >= len(self._layers) or not self._layers[group]:
            return 0
        layers = self._layers[group]
        per_chunk = self._chunk_size // self.kcc.kv_cache_groups[group].kv_cache_spec.block_size
        shape = gathered_shape(layers, self._kernel(group, [tuple(range(1, per_chunk + 1))]), self._layouts[group])
        self._chunk_nbytes[group] = math.prod(shape) * layers[0].element_size()
        return self._chunk_nbytes[group]

    def _memory_only(self, plans: Sequence[StorePlan]) -> bool:
        return all(p.source is None and self.store.tier(p.tier).is_memory for p in plans)

    def _saving(self) -> bool:
        return any(not f.done() for futures in self._saves.values() for f in futures)

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
            layers = self._layers[group]
            try:
                # host copies: a step's saves must not hold device memory while tiers write them
                ids = self._kernel(group, blocks)
                shape = gathered_shape(layers, ids, self._layouts[group])
                nbytes = math.prod(shape) * layers[0].element_size()
                buffer = self._buffers.take(size_class(nbytes))[:nbytes]
                data = gather(layers, ids, self._layouts[group], out=buffer.view(layers[0].dtype).view(shape))
            except (ValueError, RuntimeError, IndexError) as exc:  # a save is never worth an engine failure
                logger.warning("saving %d chunk(s) of group %d failed: %r", len(keys), group, exc)
                self._stats.add(save_failures=len(keys))
                continue
            out.update(((group, k), data[i]) for i, k in enumerate(keys))
        return out

    def _report_failed(self, spec: SaveSpec, plans: Sequence[StorePlan] | None = None,
                       failed: Sequence[tuple[str, Key]] = ()) -> None:
        """Tell the scheduler (through the worker report) which chunks of ``spec`` were not stored, under the keys it
        planned with (rank 0's), with this worker's tensor-parallel rank: ``failed`` among this rank's
        ``plans``, or, without plans (the whole save raised), all of them. The scheduler forgets a chunk every
        rank failed instead of marking it READY, so no later lookup counts on it."""
        rank = str(self._identity.tp_rank if self._identity is not None else 0)
        if plans is None:
            rows = [(spec.req_id, tier, key, rank) for tier, key in spec.stored_keys()]
        else:
            planned = {(mine.tier, k): key for theirs, mine in zip(spec.plans, plans, strict=True)
                       for key, k in zip(theirs.store, mine.store, strict=True)}
            rows = [(spec.req_id, tier, planned[(tier, k)], rank) for tier, k in failed if (tier, k) in planned]
        self._stats.add(save_chunks_not_stored=len(rows))
        self._report.fail(rows)

    def handle_preemptions(self) -> None:
        """Gather the saves a step left unflushed, so that preempted blocks may be reused. A save copies its
        blocks out when it is gathered, so writes still in flight read no engine block and go on. (vLLM calls
        this before every step: waiting here for the writes, as kvtier once did, made every disk save block the
        next step, 30-40 ms per 600-token request.)"""
        if self._meta is not None and self._meta.saves:
            self.wait_for_save()

    def flush(self) -> None:
        """Gather unflushed saves and wait (at most ``wait_timeout_s``) until every pending save is done."""
        self.handle_preemptions()
        self._bound_saves([f for futures in self._saves.values() for f in futures])

    def _bound_saves(self, futures: Sequence[concurrent.futures.Future[None]]) -> None:
        """Wait at most ``wait_timeout_s`` for ``futures``; saves still running then are cancelled (dropped)."""
        _, late = concurrent.futures.wait(futures, timeout=self.wait_timeout_s)
        if late:
            logger.warning("%d save(s) did not finish within %.1fs: dropped", len(late), self.wait_timeout_s)
            self._stats.add(save_timeouts=len(late))
            for future in late:
                future.cancel()  # not reported as failed: part of it may be stored (the scheduler learns on load)

    # ---- reports ---------------------------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose saves are done and that have finished, requests whose async loads are done).

        In a step that computes no token (the engine only waits for loads, or for blocks that finished requests
        hold until their saves are written) it blocks up to ``IDLE_WAIT_S`` for the first of them: an engine loop
        spinning through empty steps holds the GIL and a core, and leaves the I/O threads a slice every few
        milliseconds (measured in vLLM's CPU engine: a 1 MiB disk load took 60-90 ms that way, 4 ms with the
        wait; a replay whose engine ran out of blocks waited seconds for low-priority writes)."""
        idle = self._idle
        if self._meta is not None and self._meta.saves:
            self.wait_for_save()  # steps without a forward pass skip wait_for_save
        if idle:
            self._wait_idle(finished_req_ids)
        recving: set[str] = set()
        for req_id, (specs, future) in list(self._recving.items()):
            if not future.done():
                continue
            del self._recving[req_id]
            try:
                results = future.result()
            except Exception as exc:
                logger.warning("asynchronous load of %s failed: %r", req_id, exc)
                results = [[None] * len(s.keys) for s in specs]
            self._apply(specs, results)
            recving.add(req_id)
        self._finished |= {r for r in finished_req_ids if r in self._saves}
        sending: set[str] = set()
        for req_id in list(self._finished):
            if all(f.done() for f in self._saves[req_id]):
                sending.add(req_id)
                self._finished.discard(req_id)
                del self._saves[req_id]
                self._queue.forget(req_id)
        return sending or None, recving or None

    def _wait_idle(self, finished_req_ids: set[str]) -> None:
        """In a step that computes nothing, block up to ``IDLE_WAIT_S`` for the first pending async load or the
        first pending save of a finished request (whose blocks the engine may be waiting for): the engine's
        thread sleeps instead of spinning, and kvtier's threads, the background writers at the lowest priority
        included, get the cores."""
        loads = [future for _, future in self._recving.values()]
        saving = [self._saves[r] for r in self._finished | (finished_req_ids & self._saves.keys())]
        if any(f.done() for f in loads) or any(all(f.done() for f in futures) for futures in saving):
            return  # something to report already
        pending: list[concurrent.futures.Future[Any]] = [*loads, *(f for fs in saving for f in fs if not f.done())]
        if pending:
            concurrent.futures.wait(pending, timeout=IDLE_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def totals(self) -> dict[str, float]:
        """Every counter of this worker since it started (``stats`` hands out the counts since its last call)."""
        return self._stats.totals()

    def report(self) -> WorkerReport | None:
        """This step's report to the scheduler (kvtier.connector.report), or None."""
        return self._report.take()

    def stats(self) -> KVConnectorStats | None:
        data = self._stats.take()
        return KVConnectorStats(data=data) if data else None

    def close(self) -> None:
        """Wait for pending saves, abandon pending loads."""
        pending = [f for futures in self._saves.values() for f in futures]
        concurrent.futures.wait(pending, timeout=30)
        for _, future in self._recving.values():
            future.cancel()
        self._recving.clear()
