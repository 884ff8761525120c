"""Worker half of TieredConnector: the data plane. Executes the scheduler's plans; decides nothing.

Lifecycle:
    register_kv_caches(kv_caches)         layers -> groups, layout of each group's paged tensors (engine_kv.py)
  per step:
    start_load_kv(metadata)               sync loads: borrow views (memory tiers), scatter, release, before
                                          returning;
                                          async loads: reads start on the I/O loop (loads.py), after
                                          this worker's saves of the same records
    handle_preemptions()                  (vLLM: before every step) gathers saves a step left unflushed;
                                          never waits for writes
    wait_for_save()                       gather this step's save chunks (the blocks are free to reuse once
                                          it returns), then evict / demote / write on the I/O loop, in order,
                                          within a byte backlog (saves.py)
    get_finished(finished_req_ids)        scatter finished async loads; report them (finished_recving) and
                                          requests whose saves are all done and that have finished
    get_block_ids_with_load_errors()      blocks whose chunk could not be read (miss, corrupt, dead tier)
    flush() / stats() / close()           flush waits (bounded) for every pending save

Every wait is bounded (``wait_timeout_s``, async loads ``async_load_timeout_s``, a background save
``saves.SAVE_TIMEOUT_S``): a stuck medium fails the work (loads: their blocks become load errors; saves: dropped,
reported not stored) and is logged, never hangs the engine. Counters (``kvtier.control.metrics.WorkerCounters``) only
count; ``stats()`` hands out their snapshot since the last call, ``totals()`` since start.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.connector.base import KVConnectorStats
from kvtier.connector.keying import Identity
from kvtier.connector.plans import KVTierMetadata
from kvtier.connector.report import ReportBox, WorkerReport
from kvtier.connector.worker.engine_kv import EngineKV
from kvtier.connector.worker.loads import LoadPath
from kvtier.connector.worker.saves import MAX_BACKLOG, SavePath
from kvtier.control.metrics import Deltas, WorkerCounters, hit_tokens, nonzero, snapshot, tier_gauges
from kvtier.errors import ConnectorError
from kvtier.layout import KVCacheConfig
from kvtier.layout.geometry import KVLayout
from kvtier.records.keys import Key
from kvtier.tiers.runtime import SAVES_AT_STOP_S, LoopThread

if TYPE_CHECKING:
    import torch

    from kvtier.store.tiered import TieredStore

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.02  # in a step that computes nothing, wait this long at most for a pending load or save


class WorkerHalf:
    """Moves bytes between the engine's paged KV tensors and a TieredStore, following the plans."""

    def __init__(self, kcc: KVCacheConfig | None, store: TieredStore, loop: LoopThread, *,
                 identity: Identity | None = None, chunk_size: int = 256, layout: KVLayout | None = None,
                 strict: bool = False, max_backlog: int = MAX_BACKLOG) -> None:
        self.store = store
        self.strict = strict
        self.disabled: str | None = None  # why kvtier serves nothing in this engine (see register_kv_caches)
        self._idle = False  # the current step computes no token (see get_finished)
        self._meta: KVTierMetadata | None = None
        self._kv = EngineKV(kcc, identity=identity, chunk_size=chunk_size, layout=layout)
        self._counters = WorkerCounters(chunk_size)
        self._tier_deltas = Deltas()
        self._rank = identity.tp_rank if identity is not None else 0
        self._report = ReportBox()
        self._saves = SavePath(self._kv, store, loop, self._counters, self._report, max_backlog)
        self._loads = LoadPath(self._kv, store, loop, self._counters, self._report, self._saves.queue.landed)
        self._queue = self._saves.queue

    @property
    def kcc(self) -> KVCacheConfig | None:
        """The KV-cache config (derived from the tensors at registration when none was given)."""
        return self._kv.kcc

    @property
    def wait_timeout_s(self) -> float:
        """The longest blocking wait of the engine's thread on the I/O loop (loads, saves)."""
        return self._loads.wait_timeout_s

    @wait_timeout_s.setter
    def wait_timeout_s(self, seconds: float) -> None:
        self._loads.wait_timeout_s = self._saves.wait_timeout_s = seconds

    @property
    def async_load_timeout_s(self) -> float:
        """An asynchronous load that takes longer fails (its blocks become load errors)."""
        return self._loads.async_load_timeout_s

    @async_load_timeout_s.setter
    def async_load_timeout_s(self, seconds: float) -> None:
        self._loads.async_load_timeout_s = seconds

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
            self._kv.register(kv_caches)
        except (ConnectorError, ValueError) as exc:
            if self.strict:
                raise
            self.disable(f"{exc}. Set strict: true in kvtier's config to fail at start instead")

    def disable(self, reason: str) -> None:
        """Serve nothing from now on: planned loads fail (recomputed), saves are reported not stored, and the
        scheduler, told through the worker report, stops planning."""
        self.disabled = reason
        self._kv.clear()
        self._counters.disabled()
        self._report.disable()
        logger.error("kvtier is disabled for this engine (it serves without the cache): %s", reason)

    def _chunk_bytes(self, group: int) -> int:
        """Payload bytes of one chunk of ``group`` (0 for a group this worker holds no tensors of)."""
        return self._kv.chunk_bytes(group)

    # ---- loads -----------------------------------------------------------------------------------------
    def bind(self, metadata: KVTierMetadata | None) -> None:
        """Copy out the chunks this step's allocations take (``SaveSpec.evicted``): vLLM binds every connector's
        metadata before any connector loads and before the forward pass writes into the blocks."""
        evicted = [s for s in metadata.saves if s.evicted] if metadata is not None else []
        if not evicted:
            return
        if self.disabled is not None:
            self._saves.fail(evicted)
        else:
            self._saves.save(evicted)

    def start_load_kv(self, metadata: KVTierMetadata | None) -> None:
        """Run this step's synchronous loads now; start the asynchronous ones on the I/O loop."""
        if self._meta is not None and self._meta.saves:
            self.wait_for_save()  # a previous step's saves that nothing flushed yet go first
        self._loads.failed_now = set()
        self._meta = metadata
        self._idle = metadata is not None and metadata.idle
        if metadata is None or not metadata.loads:
            return
        if self.disabled is not None:  # every planned load fails: the engine recomputes those blocks
            self._loads.fail(metadata.loads)
        else:
            self._loads.start(metadata.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Synchronous loads are complete when ``start_load_kv`` returns; nothing to wait for per layer."""

    # ---- saves -----------------------------------------------------------------------------------------
    def wait_for_save(self) -> None:
        """Gather this step's save chunks now (the blocks are free to reuse once it returns) and hand them to the
        I/O loop in one job (kvtier.connector.worker.saves). Saves that would take the backlog of queued, unwritten
        bytes past ``max_backlog`` are skipped (``save_skipped_busy``): their evictions still run, and the
        scheduler forgets their chunks."""
        meta, self._meta = self._meta, None
        if meta is None or not meta.saves:
            return
        saves = [s for s in meta.saves if not s.evicted]  # those were saved when the step was bound
        if not saves:
            return
        if self.disabled is not None:  # nothing is stored: the scheduler forgets these chunks
            self._saves.fail(saves)
        else:  # a request whose load failed in this step computed on unfilled blocks: none of its KV is kept
            self._saves.save(saves, drop=self._loads.failed_now)

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
        self._saves.flush()

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
        recving = self._loads.finished()
        sending = self._saves.finished(finished_req_ids)
        return sending or None, recving or None

    def _wait_idle(self, finished_req_ids: set[str]) -> None:
        """In a step that computes nothing, block up to ``IDLE_WAIT_S`` for the first pending async load or the
        first pending save of a finished request (whose blocks the engine may be waiting for): the engine's
        thread sleeps instead of spinning, and kvtier's threads, the background writers at the lowest priority
        included, get the cores."""
        loads = self._loads.pending()
        saving = self._saves.of_finished(finished_req_ids)
        if any(f.done() for f in loads) or any(all(f.done() for f in futures) for futures in saving):
            return  # something to report already
        pending: list[concurrent.futures.Future[Any]] = [*loads, *(f for fs in saving for f in fs if not f.done())]
        if pending:
            concurrent.futures.wait(pending, timeout=IDLE_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._loads.take_errors()

    def get_failed_recving(self) -> set[str]:
        """Requests whose asynchronous load failed as a whole (several KV-cache groups), since the last call; they
        are in ``get_finished``'s receives too, and the engine recomputes them."""
        return self._loads.take_failed_requests()

    def totals(self) -> dict[str, float]:
        """The snapshot of every counter of this worker since it started (``stats`` hands out the counts since its
        last call)."""
        return snapshot(self._counters.totals())

    def report(self) -> WorkerReport | None:
        """This step's report to the scheduler (kvtier.connector.report), or None."""
        return self._report.take()

    def stats(self) -> KVConnectorStats | None:
        """The counts since the last call (kvtier.control.metrics snapshot, zeros left out: the worker's, and its tiers'
        counter differences), the tiers' gauges that changed, and the step's latency samples (lists, for
        histograms); None when nothing changed."""
        counts = self._counters.take()
        data: dict[str, Any] = nonzero(snapshot(counts))
        data.update(hit_tokens(counts, self._counters.chunk_size))
        tiers = {name: self.store.tier(name) for name in self.store.tier_names}
        data.update(self._tier_deltas.take({**snapshot(tiers={n: t.stats() for n, t in tiers.items()}),
                                            **tier_gauges(tiers, self._rank)}))
        if counts.load_samples:
            data["samples:load_seconds"] = counts.load_samples
        if counts.save_samples:
            data["samples:save_seconds"] = counts.save_samples
        return KVConnectorStats(data=data) if data else None

    async def landed(self, tier: str, keys: Sequence[Key]) -> None:
        """Wait until this worker's saves writing any of ``keys`` to ``tier`` are done (``SaveQueue.landed``)."""
        await self._queue.landed(tier, keys)

    def close(self, wait_s: float = SAVES_AT_STOP_S) -> None:
        """Wait (at most ``wait_s``) for pending saves, abandon pending loads."""
        self._saves.close(wait_s)
        self._loads.close()
