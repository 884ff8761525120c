"""kvtier's counters as Prometheus metrics: one table of names, read from kvtier.control.metrics snapshots.

Two exporters share the table:

* inside vLLM, ``KVTierConnector.build_prom_metrics`` (kvtier.integrations.vllm) registers them with vLLM's own
  registry, so they appear in the server's ``/metrics``; each step's connector stats (differences since the last
  step, levels when they changed, latency samples) are added to them by ``observe_into``;
* without vLLM, :func:`serve_store` serves a ``TieredStore``'s totals on a port (``prometheus-client``, the
  ``metrics`` extra), read at each scrape by :class:`StoreCollector`.

Names follow Prometheus conventions (``kvtier_`` prefix, ``_total`` counters, base units). Labels: ``tier``
(a tier's configured name; ``local`` for lookups the directory answers for every local tier at once),
``group`` (the KV-cache group), ``rank`` (a worker's tensor-parallel rank, for levels), ``kind`` (of error).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from kvtier.control.metrics import DiskStats, RedisStats

if TYPE_CHECKING:
    from kvtier.store.tiered import TieredStore

Kind = Literal["counter", "gauge", "histogram"]
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()


METRICS: tuple[Metric, ...] = (
    Metric("kvtier_lookup_chunks_total", "counter", "Chunks looked up", ("tier",)),
    Metric("kvtier_lookup_hit_chunks_total", "counter", "Chunks a lookup found", ("tier",)),
    Metric("kvtier_hit_chunks_total", "counter", "Chunks loaded into the engine", ("tier", "group")),
    Metric("kvtier_hit_tokens_total", "counter", "Tokens loaded into the engine (prefill skipped)",
           ("tier", "group")),
    Metric("kvtier_load_bytes_total", "counter", "Bytes loaded into the engine"),
    Metric("kvtier_load_failures_total", "counter", "Chunks planned for a load but not loaded (recomputed)"),
    Metric("kvtier_load_seconds", "histogram", "Time of one step's synchronous loads"),
    Metric("kvtier_store_seconds", "histogram", "Time of one save job"),
    Metric("kvtier_store_failures_total", "counter", "Chunks not stored, by cause", ("kind",)),
    Metric("kvtier_tier_reads_total", "counter", "Records asked of a tier", ("tier",)),
    Metric("kvtier_tier_read_hits_total", "counter", "Records a tier returned", ("tier",)),
    Metric("kvtier_tier_read_bytes_total", "counter", "Bytes read from a tier", ("tier",)),
    Metric("kvtier_tier_read_seconds_total", "counter", "Time spent in a tier's reads", ("tier",)),
    Metric("kvtier_stored_chunks_total", "counter", "Records written to a tier", ("tier",)),
    Metric("kvtier_stored_bytes_total", "counter", "Bytes written to a tier", ("tier",)),
    Metric("kvtier_tier_write_seconds_total", "counter", "Time spent in a tier's writes", ("tier",)),
    Metric("kvtier_refused_chunks_total", "counter", "Writes a tier refused (no room)", ("tier",)),
    Metric("kvtier_deleted_chunks_total", "counter", "Records deleted from a tier", ("tier",)),
    Metric("kvtier_evictions_total", "counter", "Chunks evicted from a tier", ("tier",)),
    Metric("kvtier_demotions_total", "counter", "Chunks moved to a slower tier on eviction"),
    Metric("kvtier_unplaced_chunks_total", "counter", "Chunks no tier of their chain took"),
    Metric("kvtier_save_admission_chunks_total", "counter", "Chunks offered for saving, by the admission's decision",
           ("decision",)),
    Metric("kvtier_corrupt_records_total", "counter", "Records that failed verification (a miss)", ("tier",)),
    Metric("kvtier_tier_errors_total", "counter", "Failed tier operations", ("tier", "kind")),
    Metric("kvtier_breaker_opens_total", "counter", "Times a Redis tier's circuit breaker opened", ("tier",)),
    Metric("kvtier_breaker_rejected_total", "counter", "Calls refused by an open breaker", ("tier",)),
    Metric("kvtier_breaker_state", "gauge", "Circuit breaker: 0 closed, 1 half open, 2 open", ("tier", "rank")),
    Metric("kvtier_used_bytes", "gauge", "Bytes a tier holds", ("tier", "rank")),
    Metric("kvtier_capacity_bytes", "gauge", "A tier's capacity in bytes", ("tier", "rank")),
)
BY_NAME = {m.name: m for m in METRICS}

# tier field -> (metric, extra labels)
_TIER_FIELDS: dict[str, tuple[str, dict[str, str]]] = {
    "lookups": ("kvtier_lookup_chunks_total", {}), "hits": ("kvtier_lookup_hit_chunks_total", {}),
    "gets": ("kvtier_tier_reads_total", {}), "get_hits": ("kvtier_tier_read_hits_total", {}),
    "bytes_out": ("kvtier_tier_read_bytes_total", {}), "get_seconds": ("kvtier_tier_read_seconds_total", {}),
    "puts": ("kvtier_stored_chunks_total", {}), "bytes_in": ("kvtier_stored_bytes_total", {}),
    "put_seconds": ("kvtier_tier_write_seconds_total", {}), "puts_refused": ("kvtier_refused_chunks_total", {}),
    "deletes": ("kvtier_deleted_chunks_total", {}), "evictions": ("kvtier_evictions_total", {}),
    "corrupt": ("kvtier_corrupt_records_total", {}), "errors": ("kvtier_tier_errors_total", {"kind": "error"}),
    "timeouts": ("kvtier_tier_errors_total", {"kind": "timeout"}),
    "server_errors": ("kvtier_tier_errors_total", {"kind": "server"}),
    "breaker_opens": ("kvtier_breaker_opens_total", {}), "breaker_rejected": ("kvtier_breaker_rejected_total", {}),
}
_TIER_FIELD_NAMES = sorted({f.name for cls in (DiskStats, RedisStats) for f in fields(cls)}, key=len, reverse=True)
_WORKER: dict[str, tuple[str, dict[str, str]]] = {
    "load_bytes": ("kvtier_load_bytes_total", {}), "load_failures": ("kvtier_load_failures_total", {}),
    "save_failures": ("kvtier_store_failures_total", {"kind": "error"}),
    "save_timeouts": ("kvtier_store_failures_total", {"kind": "timeout"}),
    "save_skipped_busy": ("kvtier_store_failures_total", {"kind": "backlog_full"}),
    "directory_lookups": ("kvtier_lookup_chunks_total", {"tier": "local"}),
    "directory_hits": ("kvtier_lookup_hit_chunks_total", {"tier": "local"}),
    "directory_demotions": ("kvtier_demotions_total", {}),
    "directory_unplaced": ("kvtier_unplaced_chunks_total", {}),
    "directory_admitted": ("kvtier_save_admission_chunks_total", {"decision": "admitted"}),
    "directory_declined": ("kvtier_save_admission_chunks_total", {"decision": "declined"}),
}
_LABELLED = {"loaded": ("kvtier_hit_chunks_total", ("tier", "group")),
             "loaded_tokens": ("kvtier_hit_tokens_total", ("tier", "group")),
             "gauge:used_bytes": ("kvtier_used_bytes", ("tier", "rank")),
             "gauge:capacity_bytes": ("kvtier_capacity_bytes", ("tier", "rank")),
             "gauge:breaker_state": ("kvtier_breaker_state", ("tier", "rank"))}
_SAMPLES = {"samples:load_seconds": "kvtier_load_seconds", "samples:save_seconds": "kvtier_store_seconds"}

Sample = tuple[str, dict[str, str], Any]  # metric name, labels, a number (or a list of samples: histograms)


def samples(data: Mapping[str, Any]) -> Iterator[Sample]:
    """The metric samples in a snapshot or a step's connector stats; keys the table does not name are left out."""
    for key, value in data.items():
        sample = _sample(key, value)
        if sample is not None:
            yield sample


def _sample(key: str, value: Any) -> Sample | None:
    if key in _SAMPLES:
        return _SAMPLES[key], {}, value
    if key in _WORKER:
        name, labels = _WORKER[key]
        return name, dict(labels), value
    for head, (name, labelnames) in _LABELLED.items():
        if key.startswith(head + ":"):
            parts = key[len(head) + 1:].split(":")  # tier names hold no ":"
            return (name, dict(zip(labelnames, parts, strict=True)), value) if len(parts) == len(labelnames) else None
    if key.startswith("directory_evictions_"):
        return "kvtier_evictions_total", {"tier": key.removeprefix("directory_evictions_")}, value
    if key.startswith("tier_"):
        return _tier_sample(key.removeprefix("tier_"), value)
    return None


def _tier_sample(rest: str, value: Any) -> Sample | None:
    for field_name in _TIER_FIELD_NAMES:  # longest first: "get_hits" before "hits"
        if rest.endswith("_" + field_name) and field_name in _TIER_FIELDS:
            name, labels = _TIER_FIELDS[field_name]
            return name, {"tier": rest[:-len(field_name) - 1], **labels}, value
        if rest.endswith("_" + field_name):
            return None
    return None


def observe_into(metrics: Mapping[str, Any], data: Mapping[str, Any], base: Mapping[str, str]) -> None:
    """Add one step's connector stats to registered metrics (prometheus-client objects by name, labelled
    ``base`` + the table's labels): counters by the difference, gauges to the level, histograms each sample."""
    for name, labels, value in samples(data):
        metric = metrics.get(name)
        if metric is None:
            continue
        child = metric.labels(**{**base, **labels}) if (base or labels) else metric
        kind = BY_NAME[name].kind
        if kind == "counter" and value > 0:
            child.inc(value)
        elif kind == "gauge":
            child.set(value)
        elif kind == "histogram":
            for seconds in value:
                child.observe(seconds)


def totals(data: Mapping[str, float]) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Samples of a snapshot summed per metric and label set (counters and gauges; no histograms)."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for name, labels, value in samples(data):
        if BY_NAME[name].kind == "histogram":
            continue
        series = out.setdefault(name, {})
        label_key = tuple(sorted(labels.items()))
        series[label_key] = series.get(label_key, 0.0) + float(value)
    return out


class StoreCollector:
    """A prometheus-client collector of a ``TieredStore``'s totals, read at each scrape."""

    def __init__(self, store: TieredStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from kvtier.control.metrics import tier_gauges

        store = self._store
        tiers = {name: store.tier(name) for name in store.tier_names}
        for name, series in totals({**store.stats(), **tier_gauges(tiers)}).items():
            metric = BY_NAME[name]
            labelnames = sorted({k for key in series for k, _ in key})
            family: Any = (CounterMetricFamily(name.removesuffix("_total"), metric.help, labels=labelnames)
                           if metric.kind == "counter" else GaugeMetricFamily(name, metric.help, labels=labelnames))
            for key, value in series.items():
                labels = dict(key)
                family.add_metric([labels.get(k, "") for k in labelnames], value)
            yield family


def serve_store(store: TieredStore, port: int, addr: str = "127.0.0.1") -> Any:
    """Serve ``store``'s metrics at ``http://addr:port/metrics`` from a daemon thread (port 0: any free one; the
    returned server's ``server_port`` says which). Needs the ``metrics`` extra (prometheus-client)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:
        from kvtier.errors import KvtierError

        raise KvtierError("serving metrics needs prometheus-client: pip install 'kvtier[metrics]'") from exc
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server
