"""TieredConnector: kvtier's connector, engine-neutral. It branches on role and delegates:

* SCHEDULER role -> ``SchedulerHalf`` (kvtier.connector.scheduler.half): directory of the local tiers, lookups,
  load and save plans shipped as ``KVTierMetadata``.
* WORKER role -> ``WorkerHalf`` (kvtier.connector.worker.half): a ``TieredStore`` holding the bytes; executes plans.

Built by an engine as ``TieredConnector(vllm_config, role, kv_cache_config)``: kvtier's config comes from
``vllm_config.kv_transfer_config.kv_connector_extra_config`` (``config_file`` plus override keys), read with the
engine's other settings by kvtier.connector.settings. The reference engine names this class ``KVTierConnector``
(kvtier.connector.factory); vLLM's ``KVTierConnector`` is this class with vLLM's base (kvtier.integrations.vllm).
A single process (reference engine, benchmarks) builds both halves with ``from_config(cfg, role, kcc,
store=..., loop=...)`` so that they share one TieredStore: the scheduler half then uses the store's own
directory.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from kvtier.config import KvtierConfig, TierKind, bare_numbers, load_config
from kvtier.connector.base import (
    KVConnectorBase,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorTransferResults,
    SupportsHMA,
)
from kvtier.connector.capability import prefix_resume_blocker, state_blocker, weights_blocker
from kvtier.connector.keying import Identity, identity_from, manifests, namespaces
from kvtier.connector.plans import KVTierMetadata
from kvtier.connector.report import WorkerReport, report_of
from kvtier.connector.scheduler.chunk_events import ChunkEvents
from kvtier.connector.scheduler.half import SchedulerHalf
from kvtier.connector.scheduler.persist_plans import PersistPlanner, planner_for
from kvtier.connector.settings import EngineSettings, layout_from_model, read_settings
from kvtier.connector.worker.persisting import Persister, persister_for
from kvtier.control.directory import Directory
from kvtier.control.metrics import Deltas, snapshot
from kvtier.errors import ConnectorError
from kvtier.layout import KVCacheConfig, from_vllm
from kvtier.store.assembly import Role, applied, build_tiers, close_tiers, directory_for, start_tiers
from kvtier.store.tiered import TieredStore
from kvtier.tiers.base import Tier
from kvtier.tiers.runtime import LOOP_CLOSE_S, SAVES_AT_STOP_S, TIER_CLOSE_S, LoopThread

if TYPE_CHECKING:
    from kvtier.connector.worker.half import WorkerHalf

logger = logging.getLogger(__name__)


def is_scheduler(role: Any) -> bool:
    """True for the scheduler role of kvtier's or vLLM's ``KVConnectorRole`` (compared by value)."""
    return int(getattr(role, "value", role)) == KVConnectorRole.SCHEDULER.value


def hmac_key(cfg: KvtierConfig) -> bytes | None:
    """The record-signing key from the environment variable the config names, if any (kvtier.records.security)."""
    from kvtier.records.security import load_hmac_key

    return load_hmac_key(cfg.security)


def config_from_engine(engine: EngineSettings) -> KvtierConfig:
    """kvtier's config from the engine's ``kv_connector_extra_config`` (``config_file`` + overrides); a size or
    duration there written as a number (JSON) warns."""
    cfg = load_config(None, overrides=dict(engine.extra))
    for line in bare_numbers(engine.extra):
        logger.warning("kvtier: kv_connector_extra_config: %s", line)
    return cfg


def described(ident: Identity, kcc: KVCacheConfig, chunk_size: int) -> dict[bytes, dict[str, Any]]:
    """The manifests of the namespaces this process serves (none when its weights could not be fingerprinted:
    it serves nothing)."""
    return manifests(ident, kcc, chunk_size) if ident.fingerprint is not None else {}


async def describe_tiers(tiers: Iterable[Tier], spaces: dict[bytes, dict[str, Any]],
                         directory: Directory | None = None) -> None:
    """Hand the namespaces to every tier (``Tier.describe``); with the ``directory`` of tiers already started, which
    adopted what each listed before it was described (a private Redis: every namespace), forget what is no longer
    theirs and adopt what became theirs (``adopt`` skips what it holds)."""
    for tier in tiers:
        listed = None if directory is None or tier.is_shared else {e.key for e in tier.entries()}
        pending = tier.describe(spaces)
        if inspect.isawaitable(pending):  # a tier may describe synchronously
            await pending
        if directory is not None and listed is not None:
            entries = list(tier.entries())
            directory.disown(tier.name, listed - {e.key for e in entries})
            directory.adopt(tier.name, ((e.key, e.size) for e in entries))


class TieredConnector(KVConnectorBase, SupportsHMA):
    """kvtier's multi-tier KV connector (both roles). An engine's adapter subclasses it together with the
    engine's own connector base (kvtier.integrations.vllm), so each call is one hop from a half."""

    stats_type: ClassVar[type[KVConnectorStats]] = KVConnectorStats  # what get_kv_connector_stats returns

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *,
                 kvtier_config: KvtierConfig | None = None, store: TieredStore | None = None,
                 loop: LoopThread | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._engine = engine = read_settings(vllm_config)
        if engine.pipeline_size > 1:
            # each stage's workers hold other layers under the same chunk hashes; keys and disk directories
            # would have to carry the stage, which they do not yet
            raise ConnectorError(f"kvtier does not support pipeline parallelism (pipeline_parallel_size="
                                 f"{engine.pipeline_size}); run with pipeline_parallel_size 1 (tensor parallelism "
                                 "is supported)")
        # the layout the engine core resolved, converted once for both halves (kvtier.layout.from_vllm); a kvtier
        # layout (the reference engine's) is taken as it is
        own = isinstance(kv_cache_config, KVCacheConfig)
        kcc = from_vllm(kv_cache_config, None if own else engine) if kv_cache_config is not None else None
        # as the operator wrote it: each role applies pool slots and rank-local paths when it opens the tiers
        cfg = kvtier_config if kvtier_config is not None else config_from_engine(engine)
        self.kvtier_config = cfg
        self._owns_loop = loop is None
        self._loop = loop or LoopThread("kvtier-connector")
        self._owns_store = store is None
        self._store = store
        self._sched_tiers: list[Tier] = []
        self._sched_deltas = Deltas()
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        self._persist_plans: PersistPlanner | None = None  # copies of memory chunks to disk (kvtier.control.persist)
        self._persister: Persister | None = None
        try:
            if is_scheduler(role):
                self._scheduler = self._build_scheduler(cfg, kcc)
                if engine.kv_events or bool(engine.extra.get("kv_events", False)):
                    self._scheduler.events = ChunkEvents(self._scheduler.directory, self._scheduler.kcc,
                                                         cfg.chunk_size)
            else:
                self._worker = self._build_worker(cfg, kcc)
        except BaseException:
            self._close_owned()
            raise

    @classmethod
    def from_config(cls, cfg: KvtierConfig, role: Any, kv_cache_config: Any, *, store: TieredStore | None = None,
                    loop: LoopThread | None = None, vllm_config: Any = None) -> TieredConnector:
        """Build from a kvtier config directly; pass one started ``store`` (and its ``loop``) to both halves of
        a single process so that they share the tiers and the directory."""
        return cls(vllm_config, role, kv_cache_config, kvtier_config=cfg, store=store, loop=loop)

    # ---- construction ----------------------------------------------------------------------------------
    def _build_scheduler(self, cfg: KvtierConfig, kcc: KVCacheConfig | None) -> SchedulerHalf:
        if kcc is None:
            logger.warning("TieredConnector got no kv_cache_config: deriving one full-attention group from the "
                           "model config; pass the engine's KVCacheConfig for hybrid models")
            kcc = layout_from_model(self._vllm_config)
        blocker = (prefix_resume_blocker(self._engine, cfg.serve_without_prefix_caching)
                   or state_blocker(self._engine, kcc))
        ident = identity_from(cfg, self._engine, tp_rank=0, fingerprinted=blocker is None)
        blocker = blocker or weights_blocker(ident.fingerprint)
        spaces = namespaces(ident, kcc, cfg.chunk_size)
        mine = described(ident, kcc, cfg.chunk_size)
        if self._store is not None:
            tiers = {n: self._store.tier(n) for n in self._store.tier_names}
            self._loop.run(describe_tiers(tiers.values(), mine, self._store.directory))
            self._persist_plans = planner_for(cfg, kcc, self._store.directory, tiers, reports=False)
            return SchedulerHalf(cfg, kcc, spaces, directory=self._store.directory, tiers=tiers, loop=self._loop,
                                 save_reports=False, blocker=blocker)
        # the scheduler plans with rank 0's keys, so it sees rank 0's disk directory (the other ranks hold the
        # same chunks, each its own shard, in theirs)
        applied_cfg = applied(cfg, kcc, 0, ident.tp_size)
        built = build_tiers(applied_cfg, hmac_key(cfg))
        directory = directory_for(applied_cfg, built)
        self._loop.run(describe_tiers(built, mine))
        self._sched_tiers = self._loop.run(start_tiers(built, Role.SCHEDULER, directory))
        by_name = {t.name: t for t in built}
        self._persist_plans = planner_for(cfg, kcc, directory, by_name, tp_size=ident.tp_size)
        return SchedulerHalf(cfg, kcc, spaces, directory=directory, tiers=by_name, loop=self._loop,
                             tp_size=ident.tp_size, blocker=blocker)

    def _build_worker(self, cfg: KvtierConfig, kcc: KVCacheConfig | None) -> WorkerHalf:
        from kvtier.connector.worker.half import WorkerHalf  # torch: only worker processes import it

        # rank 0 stores under the scheduler's keys as shipped; other ranks key their own shards
        # (kvtier.connector.keying)
        ident = identity_from(cfg, self._engine, tp_rank=self._worker_tp_rank(), fingerprinted=False)
        if ident.tp_rank != 0 and prefix_resume_blocker(self._engine, cfg.serve_without_prefix_caching) is None:
            ident = identity_from(cfg, self._engine, tp_rank=ident.tp_rank)
        if self._store is None:
            self._store = TieredStore.from_config(cfg, hmac_key=hmac_key(cfg), kcc=kcc, role=Role.WORKER,
                                                  rank=ident.tp_rank, tp_size=ident.tp_size)
            self._loop.run(self._store.start())
            if ident.tp_rank != 0 and kcc is not None:  # rank 0's namespaces are the scheduler's to describe
                store = self._store
                self._loop.run(describe_tiers((store.tier(n) for n in store.tier_names),
                                              described(ident, kcc, cfg.chunk_size)))
        worker = WorkerHalf(kcc, self._store, self._loop, identity=ident, chunk_size=cfg.chunk_size,
                            strict=cfg.strict, max_backlog=cfg.policy.save_backlog)
        blocker = weights_blocker(ident.fingerprint)
        if blocker is not None:  # this rank cannot key its shards: it serves and stores nothing
            worker.disable(blocker)
        self._persister = persister_for(cfg, self._store, self._loop, ident, lambda: worker.kcc, worker.landed)
        return worker

    def _worker_tp_rank(self) -> int | None:
        """This worker's tensor-parallel rank (None: from the engine's parallel config). Engine adapters override."""
        return None

    def _sched(self) -> SchedulerHalf:
        if self._scheduler is None:
            raise ConnectorError("scheduler-side method called on a worker-role TieredConnector")
        return self._scheduler

    def _work(self) -> WorkerHalf:
        if self._worker is None:
            raise ConnectorError("worker-side method called on a scheduler-role TieredConnector")
        return self._worker

    # ---- worker side -----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:  # the chunks this step's allocations take, before any load or forward writes
            self._worker.bind(connector_metadata if isinstance(connector_metadata, KVTierMetadata) else None)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        self._work().start_load_kv(meta if isinstance(meta, KVTierMetadata) else None)
        if self._persister is not None:  # after the step's loads, before its saves are handed to the I/O loop
            self._persister.step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: every layer is written by ``wait_for_save``, which gathers all at once."""

    def wait_for_save(self) -> None:
        self._work().wait_for_save()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self._work().handle_preemptions()

    def flush_saves(self) -> None:
        """Wait (bounded) until every save handed to this worker is done: for shutdown, tests and benchmarks."""
        self._work().flush()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), self._work().get_failed_recving())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def reset_cache(self) -> bool | None:
        """The engine's KV memory was reset (sleep mode): the chunks held for saving on eviction are dropped; kvtier's
        tiers keep what they hold (None: nothing of theirs was reset)."""
        if self._scheduler is not None:
            self._scheduler.reset_cache()
        return None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker's counts since the last call; the scheduler's: its directory's and, where it opened them
        itself, its tiers' (kvtier.control.metrics). None when nothing changed."""
        stats = self._worker.stats() if self._worker is not None else None
        data = dict(stats.data) if stats is not None else {}
        if self._scheduler is not None:
            tiers = {t.name: t.stats() for t in self._sched_tiers}
            data.update(self._sched_deltas.take(snapshot(tiers=tiers, directory=self._scheduler.directory.stats)))
        return self.stats_type(data=data) if data else None

    def build_connector_worker_meta(self) -> WorkerReport | None:
        report = self._worker.report() if self._worker is not None else None
        rows = self._persister.take_rows() if self._persister is not None else []
        if rows:  # the persisting copies written or not (kvtier.connector.scheduler.persist_plans settles them)
            report = report or WorkerReport()
            report.persisted.extend(rows)
        return report

    # ---- scheduler side --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request: Any) -> bool:
        """Whether a hit of ``request`` may load asynchronously (a cheap guess, asking no server)."""
        return self._sched().may_load_async(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        meta = self._sched().build_connector_meta(scheduler_output)
        return self._persist_plans.attach(meta) if self._persist_plans is not None else meta

    def update_connector_output(self, connector_output: Any) -> None:
        if self._persist_plans is not None:
            self._persist_plans.note(report_of(connector_output))
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished_all_groups(request, block_ids)

    def hit_sources(self, request: Any) -> dict[TierKind, int]:
        """The tokens of ``request``'s planned load by the kind of tier they come from."""
        return self._sched().hit_sources(request.request_id)

    def take_events(self) -> Iterable[Any]:
        """What entered and left each tier since the last call (kvtier.connector.scheduler.chunk_events), when the
        engine publishes KV events; an engine adapter converts them."""
        events = self._scheduler.events if self._scheduler is not None else None
        return events.take() if events is not None else ()

    # ---- shutdown --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Flush pending saves, persist what only memory holds, close what this connector owns; visit everything,
        re-raise once. Bounded whatever a medium does (``STOP_MARGIN_S``): the pending saves may take
        ``SAVES_AT_STOP_S`` and what persisting leaves of ``policy.persist_at_close`` (their demotions are the only
        copy of chunks already evicted from memory), persisting the rest of it, the tiers' closes ``TIER_CLOSE_S``,
        the I/O loop ``LOOP_CLOSE_S``."""
        errors: list[BaseException] = []
        budget, persister, worker = self.kvtier_config.policy.persist_at_close, self._persister, self._worker
        until = time.monotonic() + SAVES_AT_STOP_S + (budget if persister is not None else 0.0)
        for name, step in (("worker", (lambda: worker.close(until - time.monotonic())) if worker else None),
                           ("persisting", (lambda: persister.close(max(min(budget, until - time.monotonic()), 0.0)))
                            if persister is not None else None),
                           ("scheduler", self._scheduler.close if self._scheduler else None)):
            if step is None:
                continue
            try:
                step()
            except Exception as exc:
                logger.exception("closing the %s half failed", name)
                errors.append(exc)
        errors.extend(self._close_owned())
        if errors:
            raise errors[0]

    def _close_owned(self) -> list[BaseException]:
        """Close the tiers this connector opened and its own store, all at once (``TIER_CLOSE_S``), then its I/O
        loop; the errors."""
        tiers, store = self._sched_tiers, self._store if self._owns_store else None

        async def close_all() -> list[BaseException | None]:
            closes = [close_tiers(tiers), *([store.close()] if store is not None else [])]
            return await asyncio.gather(*closes, return_exceptions=True)

        errors: list[BaseException] = []
        try:  # bounded inside; the bound here only guards against a blocked I/O loop
            errors = [r for r in self._loop.run(close_all(), timeout=TIER_CLOSE_S + LOOP_CLOSE_S) if r is not None]
        except TimeoutError:
            logger.warning("closing kvtier's tiers did not end within %.1fs: given up", TIER_CLOSE_S + LOOP_CLOSE_S)
        except Exception as exc:  # the loop is closed already
            errors.append(exc)
        self._sched_tiers = []
        if self._owns_store:
            self._store = None
        if self._owns_loop:
            self._loop.close()
        return errors
