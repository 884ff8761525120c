"""vLLM integration: the classes vLLM loads with ``kv_connector_module_path="kvtier.integrations.vllm"``.

The only kvtier module that imports vLLM (vLLM itself imports it, by module path). Usage::

    --kv-transfer-config '{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"config_file": "kvtier.yaml"}}'

Chained (loads from the first child that hits, saves to all)::

    {"kv_connector": "KVTierMultiConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
     "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
         {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
          "kv_role": "kv_both", "kv_connector_extra_config": {"config_file": "kvtier.yaml"}},
         {"kv_connector": "MyOldConnector", "kv_connector_module_path": "my.module", "kv_role": "kv_both"}]}}

Both classes ARE kvtier's engine-neutral connectors (``kvtier.connector.tiered.TieredConnector``, given
``kvtier.layout.from_vllm(kv_cache_config, engine_settings)``, the layout resolved once per start;
``kvtier.connector.multi.MultiConnector``, given vLLM's objects) with vLLM's ``KVConnectorBase_V1`` and
``SupportsHMA`` as further bases: each call is one hop from a half or a child. They take ``(vllm_config, role,
kv_cache_config=None)``, keep vLLM's ``KVCacheConfig`` as ``_kv_cache_config`` and add only vLLM's own hooks.

The composite is deliberately NOT called ``MultiConnector``: vLLM 0.33 special-cases that name and checks its
children with its own rules, which reject legacy children.

Versions and connector styles covered (verified against vLLM 0.33.0; the base-class contract is that of
vLLM >= 0.12, where ``kv_cache_config`` is the third constructor argument):

- children of ``KVTierMultiConnector`` are built by kvtier's factory (:mod:`kvtier.connector.factory`):
  three-argument connectors (explicit ``kv_cache_config``, with or without a default) get the config
  positionally; ``**kwargs``-only constructors get it by keyword; vLLM's registered connectors (``ExampleConnector``,
  ...) are built with three arguments, never probed;
- two-argument connectors written for vLLM <= 0.11 (``__init__(self, vllm_config, role)`` calling
  ``super().__init__(vllm_config=vllm_config, role=role)``) are built with two arguments (and a warning) under
  :data:`LegacyConnectorBase`, an adapter placed between the class and ``KVConnectorBase_V1`` that supplies
  ``kv_cache_config=None`` (see :mod:`kvtier.connector.legacy`); they see ``_kv_cache_config is None``. Authors may
  also derive from ``LegacyConnectorBase`` directly. On vLLM 0.33 such a class cannot be the top-level connector
  (vLLM rejects it before kvtier runs): wrap it in ``KVTierMultiConnector``.
- HMA: both classes are ``SupportsHMA``, so vLLM keeps the hybrid KV-cache manager on. If the KV-cache config then
  has several groups and a child is not ``SupportsHMA``, construction fails and says to pass
  ``--disable-hybrid-kv-cache-manager``.
Not forwarded to children: their Prometheus metrics (``build_prom_metrics``), and KV-cache events from a second
child that reports some (the first child's are kept, with a warning).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA as VllmSupportsHMA
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma as vllm_supports_hma
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats as VllmStats

from kvtier import __version__
from kvtier.config import TierKind
from kvtier.config.parse import format_size
from kvtier.connector import base as kvbase
from kvtier.connector import settings
from kvtier.connector.factory import ConnectorFactory
from kvtier.connector.legacy import adapter_base
from kvtier.connector.multi import MultiConnector, MultiConnectorStats, required_layout
from kvtier.connector.report import ChildReports, WorkerReport
from kvtier.connector.tiered import TieredConnector
from kvtier.control.events import EventKind
from kvtier.errors import ConnectorError
from kvtier.integrations.prometheus import LATENCY_BUCKETS, METRICS, observe_into

logger = logging.getLogger(__name__)

__all__ = ["VLLM_FACTORY", "KVTierConnector", "KVTierMultiConnector", "KVTierMultiStats", "KVTierMultiWorkerMetadata",
           "KVTierStats", "LegacyConnectorBase"]

LegacyConnectorBase: type = adapter_base(KVConnectorBase_V1)
"""``KVConnectorBase_V1`` whose constructor also accepts the legacy ``(vllm_config, role)`` form."""

VLLM_FACTORY = ConnectorFactory(
    {"KVTierConnector": "kvtier.integrations.vllm:KVTierConnector",
     "KVTierMultiConnector": "kvtier.integrations.vllm:KVTierMultiConnector"},
    bases=(KVConnectorBase_V1,),
    fallback=KVConnectorFactory.get_connector_class_by_name,
)


class KVTierStats(kvbase.KVConnectorStats, VllmStats):  # type: ignore[misc, unused-ignore]  # misc only where vLLM is installed
    """kvtier's stats (numbers summed on aggregate) as a vLLM ``KVConnectorStats``."""


class KVTierPromMetrics(KVConnectorPromMetrics):
    """kvtier's metrics (kvtier.integrations.prometheus) in vLLM's registry, so they appear in the server's
    ``/metrics``, labelled with vLLM's engine labels. Stats of a chained connector's kvtier children are summed."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        counter: Any = self._counter_cls
        gauge: Any = self._gauge_cls
        histogram: Any = self._histogram_cls
        for m in METRICS:
            names = [*labelnames, *m.labels]
            if m.kind == "counter":
                self._metrics[m.name] = counter(name=m.name, documentation=m.help, labelnames=names)
            elif m.kind == "gauge":
                self._metrics[m.name] = gauge(name=m.name, documentation=m.help, labelnames=names,
                                              multiprocess_mode="mostrecent")
            else:
                self._metrics[m.name] = histogram(name=m.name, documentation=m.help, labelnames=names,
                                                  buckets=LATENCY_BUCKETS)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues.get(engine_idx, [])
        base = {name: str(value) for name, value in zip(self._labelnames, values, strict=False)}
        for part in _kvtier_parts(transfer_stats_data):
            observe_into(self._metrics, part, base)


def _kvtier_parts(data: dict[str, Any]) -> list[dict[str, Any]]:
    """kvtier's flat stats, or a chained connector's children's (keyed by class name, stats objects or dicts)."""
    nested = [v for v in data.values() if isinstance(v, (dict, kvbase.KVConnectorStats, VllmStats))]
    if not nested:
        return [data]
    return [dict(v.data if not isinstance(v, dict) else v) for v in nested]


class KVTierMultiStats(MultiConnectorStats, VllmStats):  # type: ignore[misc, unused-ignore]
    """Stats of ``KVTierMultiConnector``'s children keyed by class name, as a vLLM ``KVConnectorStats``."""


KVTierMultiWorkerMetadata = ChildReports  # the children's worker metadata, one per child (kvtier.connector.report)
KVConnectorWorkerMetadata.register(ChildReports)
KVConnectorWorkerMetadata.register(WorkerReport)


def _child_transfer_configs(kv_transfer_config: Any) -> list[Any]:
    """The children's KVTransferConfigs, without building a VllmConfig (for classmethods)."""
    return [KVTransferConfig(**fields) for fields in settings.child_fields(kv_transfer_config)]


def _child_class(kv_transfer_config: Any) -> Any:
    return VLLM_FACTORY.resolve(kv_transfer_config).cls


def prefer_recompute(vllm_config: Any) -> None:
    """Make vLLM recompute blocks whose load failed instead of failing the request.

    kvtier is a cache: a dead tier or a corrupt record must cost a recompute, not an error returned to the
    user, but vLLM's default ``kv_load_failure_policy`` is ``"fail"``. vLLM 0.33's Scheduler reads the policy
    after building the connector, so the connector switches it to ``"recompute"`` unless the extra config says
    ``load_failure_policy: fail``.
    """
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None or getattr(ktc, "kv_load_failure_policy", "recompute") == "recompute":
        return
    if settings.extra_config(ktc).get("load_failure_policy", "recompute") != "recompute":
        return
    try:
        ktc.kv_load_failure_policy = "recompute"
        logger.info("kvtier: kv_load_failure_policy set to 'recompute' (a failed load recomputes, never fails)")
    except Exception:  # a frozen config: tell the operator instead
        logger.warning("kvtier: set kv_load_failure_policy='recompute' in --kv-transfer-config, else a dead tier "
                       "fails requests instead of recomputing them")


class ToVllmLog(logging.Handler):
    """Hands each kvtier record to the handlers vLLM's logger has when the record is made (its format, its level):
    vLLM may configure its logging again after kvtier joined it."""

    def emit(self, record: logging.LogRecord) -> None:
        vllm_logger = logging.getLogger("vllm")
        if not vllm_logger.isEnabledFor(record.levelno):
            return
        for handler in vllm_logger.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def join_vllm_logging() -> None:
    """Send kvtier's log records to vLLM's log, once per process, where nothing else would show them: the
    ``kvtier`` logger has no handler of its own, so its INFO lines never reach ``vllm serve``'s output. Left alone:
    a ``kvtier`` logger the application gave handlers, and a process whose root logger has handlers (its records
    propagate there)."""
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    ours.addHandler(ToVllmLog())
    ours.setLevel(min(theirs.getEffectiveLevel(), logging.INFO))
    ours.propagate = False


def log_start(connector: TieredConnector, vllm_config: Any) -> None:
    """One INFO block, once per scheduler: kvtier's version, its tiers with their capacities, how it writes and
    persists, and vLLM's load-failure policy (the identity is logged by kvtier.connector.keying)."""
    cfg = connector.kvtier_config
    tiers = ", ".join(f"{t.name} ({t.kind.value}, {format_size(t.capacity)}"
                      f"{', ' + str(getattr(t, 'path', '')) if t.kind is TierKind.DISK else ''})" for t in cfg.tiers)
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    policy = cfg.policy
    persist = ", ".join(f"{what} {f'{seconds:g}s' if seconds else 'off'}" for what, seconds in (
        ("lag", policy.persist_max_lag), ("idle", policy.persist_after_idle), ("stop", policy.persist_at_close)))
    logger.info("kvtier %s: tiers %s; chunks of %d tokens, %s, copies to disk (%s); kv_load_failure_policy %s",
                __version__, tiers, cfg.chunk_size, policy.write.value, persist,
                getattr(ktc, "kv_load_failure_policy", "unknown"))


# kvtier's engine-neutral signatures name kvtier's types where vLLM's name vLLM's (same calls and values), hence
# the ignores on the two classes below
class KVTierConnector(TieredConnector, KVConnectorBase_V1, VllmSupportsHMA):  # type: ignore[misc, unused-ignore]
    """kvtier's tiered KV cache as a vLLM connector (scheduler half or worker half, by role): kvtier's
    engine-neutral connector with vLLM's base class and the hooks only vLLM has."""

    stats_type = KVTierStats

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        join_vllm_logging()
        KVConnectorBase_V1.__init__(self, vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        prefer_recompute(vllm_config)
        TieredConnector.__init__(self, vllm_config, role, kv_cache_config)
        if self._scheduler is not None:
            log_start(self, vllm_config)

    def _worker_tp_rank(self) -> int | None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

        return int(get_tensor_model_parallel_rank()) if model_parallel_is_initialized() else None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.34): kvtier keys its chunks from the prompt's tokens itself, never from vLLM's block
        hashes, so lookahead hashing would change nothing kvtier stores or finds; opting in would only change
        vLLM's own hashes for EAGLE/MTP."""
        return False

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """kvtier's results as vLLM's type; with several KV-cache groups a failed load is reported per request
        (``failed_recving``): vLLM refuses block-level errors for such models."""
        return _vllm_results(TieredConnector.get_transfer_results(self, finished_req_ids))

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> Any:
        """kvtier's hit split by where it comes from (``vllm:prompt_tokens_cached_by_source``): memory tiers are
        host, disk is disk, Redis is external."""
        if num_external_tokens == 0:
            return {}
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        names = {TierKind.GPU: CacheHitSource.HOST, TierKind.CPU: CacheHitSource.HOST,
                 TierKind.DISK: CacheHitSource.DISK}
        out: dict[Any, int] = {}
        for kind, tokens in self.hit_sources(request).items():
            source = names.get(kind, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + tokens
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return KVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        """kvtier's counters, levels and latency histograms in the server's ``/metrics``
        (kvtier.integrations.prometheus)."""
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> Any:
        """What entered and left each tier, as vLLM's ``BlockStored`` / ``BlockRemoved`` (medium CPU, GPU, STORAGE
        or REDIS; ``ownership`` names the kvtier tier)."""
        return _vllm_events(TieredConnector.take_events(self), self.kvtier_config)


class KVTierMultiConnector(MultiConnector, KVConnectorBase_V1, VllmSupportsHMA):  # type: ignore[misc, unused-ignore]
    """Child connectors chained as one (kvtier's MultiConnector rules, children built by kvtier's factory), with
    vLLM's base class and vLLM's own hooks forwarded to the children."""

    stats_type = KVTierMultiStats

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        join_vllm_logging()
        KVConnectorBase_V1.__init__(self, vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        prefer_recompute(vllm_config)
        MultiConnector.__init__(self, vllm_config, role, kv_cache_config, factory=VLLM_FACTORY,
                                hma_check=vllm_supports_hma)

    # ---- vLLM-only hooks, forwarded to the children -------------------------------------------------
    @property
    def requires_kv_delivery(self) -> bool:
        return any(c.requires_kv_delivery for c in self.sub_connectors)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        children = self.sub_connectors
        return bool(children) and all(c.supports_divergent_local_hybrid_hits for c in children)

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.34): lookahead hashing changes the block hashes every child would see; kvtier's children
        key chunks from tokens and need none."""
        return False

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        self.call_children("bind_kv_cache_manager", kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.call_children("bind_gpu_block_pool", gpu_block_pool)

    def on_new_request(self, request: Any) -> None:
        self.call_children("on_new_request", request)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        child = self.loading_connector(request.request_id)
        if child is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return child.get_loaded_kv_cache_group_ids(request)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> Any:
        child = self.loading_connector(request.request_id)
        if child is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return child.get_external_cache_hit_sources(request, num_external_tokens)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        return _vllm_results(MultiConnector.get_transfer_results(self, finished_req_ids))

    def has_pending_block_frees(self) -> bool:
        return any(self.call_children("has_pending_block_frees"))

    def has_pending_push_work(self) -> bool:
        return any(self.call_children("has_pending_push_work"))

    def register_finished_partial_tail(self, request: Any, block_ids: Any, partial_tail_offloads: Any) -> bool:
        return any(self.call_children("register_finished_partial_tail", request, block_ids,
                                            partial_tail_offloads))

    def unregister_kv_caches(self) -> None:
        self.call_children("unregister_kv_caches")

    def restore_kv_caches(self) -> None:
        self.call_children("restore_kv_caches")

    def finish_forward(self) -> None:
        self.call_children("finish_forward")

    def reset_capture_state(self) -> None:
        self.call_children("reset_capture_state")

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self.call_children("set_xfer_handshake_metadata_pp_aware", metadata)

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        pools = [p for p in self.call_children("get_mem_pool_context") if p is not None]
        if len(pools) > 1:
            raise ConnectorError("several child connectors provide a KV-cache memory pool; the KV cache is "
                                 "allocated once: configure a custom pool on one child at most")
        return pools[0] if pools else None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return required_layout(vllm_config, VLLM_FACTORY)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        children = [KVTransferConfig(**c) for c in extra_config.get("connectors") or []]
        return any(_child_class(c).requires_piecewise_for_cudagraph(settings.extra_config(c)) for c in children)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        children = _child_transfer_configs(kv_transfer_config)
        return bool(children) and all(_child_class(c).supports_sleep_mode(c) for c in children)

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34: how the children's workers reach the KV cache, every child's needs together (vLLM allocates
        it once for all of them); a child written before the hook reaches it in process."""
        from vllm.config.kv_transfer import KVCacheAccess  # type: ignore[attr-defined, unused-ignore]  # 0.34

        access = KVCacheAccess.IN_PROCESS
        for child in _child_transfer_configs(kv_transfer_config):
            hook = getattr(_child_class(child), "kv_cache_access", None)
            if hook is not None:
                access |= hook(child)
        return access

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return KVTierMultiStats(data={name: _rebuild_stats(name, value)
                                      for name, value in (data or {}).items() if value is not None})


_MEDIUM = {TierKind.GPU: "GPU", TierKind.CPU: "CPU", TierKind.DISK: "STORAGE", TierKind.REDIS: "REDIS"}


def _vllm_events(events: Any, cfg: Any) -> list[Any]:
    """kvtier's chunk events (kvtier.connector.scheduler.chunk_events) as vLLM's KV-cache events."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    kinds: dict[str, TierKind] = {t.name: t.kind for t in cfg.tiers}
    out: list[Any] = []
    for event in events:
        kind = kinds.get(event.tier)
        info, medium = event.info, _MEDIUM[kind] if kind is not None else "EXTERNAL"
        group = info.group if info.group >= 0 else None
        if event.kind is EventKind.STORED:
            out.append(BlockStored(block_hashes=list(info.block_hashes), parent_block_hash=info.parent_hash,
                                   token_ids=list(info.token_ids), block_size=info.block_size, lora_id=None,
                                   medium=medium, lora_name=None, group_idx=group, ownership=f"kvtier:{event.tier}"))
        else:
            out.append(BlockRemoved(block_hashes=list(info.block_hashes), medium=medium, group_idx=group,
                                    ownership=f"kvtier:{event.tier}"))
    return out


def _vllm_results(results: kvbase.KVConnectorTransferResults) -> Any:
    """kvtier's transfer results as vLLM's ``KVConnectorTransferResults``."""
    return KVConnectorTransferResults(finished_sending=results.finished_sending,
                                      finished_recving=results.finished_recving,
                                      failed_recving=results.failed_recving)


def _rebuild_stats(name: str, value: Any) -> Any:
    """A child's stats from its serialized ``data`` (after crossing processes), by child class name."""
    if isinstance(value, VllmStats):
        return value
    if name == KVTierConnector.__name__:
        return KVTierStats(data=dict(value))
    try:
        stats = KVConnectorFactory.get_connector_class_by_name(name).build_kv_connector_stats(data=value)
    except ValueError:  # a module-path child vLLM does not know: keep its numbers
        stats = None
    return stats if stats is not None else KVTierStats(data=dict(value))
