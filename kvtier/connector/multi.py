"""MultiConnector: several connectors chained as one (engine-neutral; vLLM 0.33's routing rules).

Configuration: ``kv_connector_extra_config["connectors"]`` is a list of dicts of ``KVTransferConfig`` fields.
Each child gets a shallow copy of the engine config whose ``kv_transfer_config`` is built from its dict (same
config type as the parent's; ``engine_id`` inherited unless given) and is built THROUGH THE FACTORY, so legacy
two-argument children work; every child receives the same ``kv_cache_config``.

Routing:
    get_num_new_matched_tokens   children in order; a ``None`` answer returns ``(None, False)`` at once; the first
                                 child with a non-zero count loads the request; no summing
    update_state_after_alloc     the loading child gets the blocks and count, the others the blocks and 0 (a child
                                 that saves on eviction sees every allocation)
    build_connector_meta         :class:`MultiConnectorMetadata` of the children's metadata, in order
    saves                        every child saves; a request is reported in ``finished_sending`` once every child
                                 that returned True from ``request_finished`` reported it
    load errors                  union;  shutdown: every child, each failure logged, the first one re-raised
    stats                        :class:`MultiConnectorStats` keyed by child class name
With several KV-cache groups (hybrid model, HMA on) every child must be ``SupportsHMA``: checked at construction.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvtier.connector.base import (
    KVConnectorBase,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorStats,
    KVConnectorTransferResults,
    SupportsHMA,
    supports_hma,
)
from kvtier.connector.factory import DEFAULT_FACTORY, ConnectorFactory
from kvtier.connector.report import ChildReports
from kvtier.connector.settings import child_configs
from kvtier.errors import ConnectorError

logger = logging.getLogger(__name__)


@dataclass
class MultiConnectorMetadata(KVConnectorMetadata):
    """The children's metadata in config order, plus the extra async saves the workers must count."""

    metadata: tuple[Any, ...]
    extra_async_saves: dict[str, int] = field(default_factory=dict)


@dataclass
class MultiConnectorStats(KVConnectorStats):
    """``data`` maps a child connector's class name to its stats object."""

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, stats in other.data.items():
            mine = self.data.get(name)
            self.data[name] = stats if mine is None else mine.aggregate(stats)
        return self

    def reset(self) -> None:
        for stats in self.data.values():
            stats.reset()

    def reduce(self) -> dict[str, int | float]:
        return {f"{name}.{key}": value for name, stats in self.data.items()
                for key, value in stats.reduce().items()}

    def is_empty(self) -> bool:
        return all(stats.is_empty() for stats in self.data.values())

    def to_dict(self) -> dict[str, Any]:
        """Serializable payload: each child's ``to_dict()`` (or ``data``)."""
        return {name: (s.to_dict() if hasattr(s, "to_dict") else s.data) for name, s in self.data.items()}


class MultiConnector(KVConnectorBase, SupportsHMA):
    """Chains child connectors: loads from the first that hits, saves to all (see the module docstring)."""

    stats_type: ClassVar[type[MultiConnectorStats]] = MultiConnectorStats  # what get_kv_connector_stats returns

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *,
                 factory: ConnectorFactory | None = None,
                 hma_check: Callable[[Any], bool] = supports_hma) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._factory = factory or DEFAULT_FACTORY
        self._supports_hma = hma_check
        self._connectors: list[Any] = []
        try:
            for sub in child_configs(vllm_config):
                self._connectors.append(self._factory.create(sub, role, kv_cache_config))
        except BaseException:
            self._shutdown_quietly()  # the children built so far hold threads, files, connections
            raise
        self._check_hma(kv_cache_config)
        self._requests_to_connector: dict[str, int] = {}
        self._extra_async_saves: dict[str, int] = {}
        self._warned_events = False

    def _check_hma(self, kv_cache_config: Any) -> None:
        groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or ())
        if groups <= 1:
            return
        missing = [type(c).__name__ for c in self._connectors if not self._supports_hma(c)]
        if not missing:
            return
        self._shutdown_quietly()
        raise ConnectorError(
            f"the KV-cache config has {groups} groups (a hybrid model with the hybrid KV-cache manager on) but "
            f"child connector(s) {', '.join(missing)} do not implement SupportsHMA (request_finished_all_groups). "
            "Make them SupportsHMA, or run vLLM with --disable-hybrid-kv-cache-manager so that all layers share "
            "one group.")

    def _shutdown_quietly(self) -> None:
        try:
            self.shutdown()
        except Exception:  # already logged per child
            pass

    # ---- composition helpers -----------------------------------------------------------------------
    @property
    def sub_connectors(self) -> list[Any]:
        """The children, in config order."""
        return list(self._connectors)

    def call_children(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every child that has it (engine-specific hooks); results in order."""
        return [getattr(c, method)(*args, **kwargs) for c in self._connectors if hasattr(c, method)]

    def loading_connector(self, request_id: str) -> Any | None:
        """The child chosen to load ``request_id``, if any."""
        index = self._requests_to_connector.get(request_id)
        return None if index is None else self._connectors[index]

    def count_finished_sending(self, req_ids: Iterable[str]) -> set[str]:
        """Ids from ONE child's ``finished_sending`` that are now saved by every child that was saving them."""
        done: set[str] = set()
        for req_id in req_ids:
            pending = self._extra_async_saves.get(req_id)
            if pending is None:
                done.add(req_id)
            elif pending <= 1:
                del self._extra_async_saves[req_id]
            else:
                self._extra_async_saves[req_id] = pending - 1
        return done

    # ---- worker side -------------------------------------------------------------------------------
    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return bool(self._connectors) and all(c.prefer_cross_layer_blocks for c in self._connectors)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, MultiConnectorMetadata):
            raise ConnectorError(f"MultiConnector expects MultiConnectorMetadata, got {type(connector_metadata)}")
        self._extra_async_saves.update(connector_metadata.extra_async_saves)
        for child, meta in zip(self._connectors, connector_metadata.metadata, strict=True):
            child.bind_connector_metadata(meta)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        for child in self._connectors:
            child.clear_connector_metadata()
        super().clear_connector_metadata()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        for child in self._connectors:
            child.register_kv_caches(kv_caches)

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        for child in self._connectors:
            child.register_cross_layers_kv_cache(kv_cache, attn_backend)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        for child in self._connectors:
            child.set_host_xfer_buffer_ops(copy_operation)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, MultiConnectorMetadata):
            for child, meta in zip(self._connectors, kv_connector_metadata.metadata, strict=True):
                child.handle_preemptions(meta)
        else:  # older engines pass the preempted request ids
            for child in self._connectors:
                child.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        for child in self._connectors:
            child.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for child in self._connectors:
            child.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        for child in self._connectors:
            child.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        for child in self._connectors:
            child.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        for child in self._connectors:
            child_sending, child_recving = child.get_finished(finished_req_ids)
            recving |= child_recving or set()
            sending |= self.count_finished_sending(child_sending or ())
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        for child in self._connectors:
            child_results = child.get_transfer_results(finished_req_ids)
            results.finished_recving |= child_results.finished_recving
            results.failed_recving |= child_results.failed_recving
            results.finished_sending |= self.count_finished_sending(child_results.finished_sending)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors: set[int] = set()
        for child in self._connectors:
            errors |= child.get_block_ids_with_load_errors()
        return errors

    def shutdown(self) -> None:
        first: Exception | None = None
        for child in self._connectors:
            try:
                child.shutdown()
            except Exception as exc:
                logger.exception("shutdown of connector %s failed", type(child).__name__)
                first = first or exc
        if first is not None:
            raise first

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        merged: MultiConnectorStats | None = None
        for child in self._connectors:
            stats = child.get_kv_connector_stats()
            if stats is None:
                continue
            merged = merged or self.stats_type()
            name = type(child).__name__
            if name in merged.data:  # two children of one class: sum, without touching either child's object
                merged.data[name] = copy.deepcopy(merged.data[name]).aggregate(stats)
            else:
                merged.data[name] = stats
        return merged

    def get_kv_connector_kv_cache_events(self) -> Any:
        events = [e for e in (c.get_kv_connector_kv_cache_events() for c in self._connectors) if e is not None]
        if len(events) > 1 and not self._warned_events:
            self._warned_events = True
            logger.warning("%d child connectors report KV-cache events; only the first child's are kept",
                           len(events))
        return events[0] if events else None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        for child in self._connectors:
            metadata = child.get_handshake_metadata()
            if metadata is not None:
                return metadata
        return None

    def get_finished_count(self) -> int | None:
        counts = [c.get_finished_count() for c in self._connectors]
        if any(count is None for count in counts):
            return None
        distinct = set(counts)
        if len(distinct) > 1:
            raise ConnectorError(f"child connectors expect different finished counts: {sorted(distinct)}")
        return next(iter(distinct), None)

    # ---- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests_to_connector.pop(request.request_id, None)  # a previous lookup's choice is stale
        result: tuple[int | None, bool] = (0, False)
        for i, child in enumerate(self._connectors):
            tokens, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if tokens is None:
                return None, False
            if result[0] == 0 and tokens > 0:
                self._requests_to_connector[request.request_id] = i
                result = (tokens, load_async)
        return result

    def may_load_async(self, request: Any) -> bool:
        """Whether a child's hit of ``request`` may load asynchronously (a child without the hook: no)."""
        return any(bool(getattr(child, "may_load_async", lambda _request: False)(request))
                   for child in self._connectors)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        chosen = self._requests_to_connector.get(request.request_id, -1)
        for i, child in enumerate(self._connectors):
            if i == chosen:
                child.update_state_after_alloc(request, blocks, num_external_tokens)
            else:
                child.update_state_after_alloc(request, blocks, 0)  # the real blocks (vLLM 0.33): no load into them

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        metadata = MultiConnectorMetadata(tuple(c.build_connector_meta(scheduler_output) for c in self._connectors),
                                          self._extra_async_saves)
        self._extra_async_saves = {}
        return metadata

    def build_connector_worker_meta(self) -> ChildReports | None:
        metas = tuple(c.build_connector_worker_meta() for c in self._connectors)
        return None if all(m is None for m in metas) else ChildReports(metas)

    def update_connector_output(self, connector_output: Any) -> None:
        """Every child learns what the workers finished; each sees its own worker metadata."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, ChildReports):
            for child in self._connectors:
                child.update_connector_output(connector_output)
            return
        try:
            for child, child_meta in zip(self._connectors, meta.metadata, strict=True):
                connector_output.kv_connector_worker_meta = child_meta
                child.update_connector_output(connector_output)
        finally:
            connector_output.kv_connector_worker_meta = meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._aggregate_finished(request, lambda c: c.request_finished(request, block_ids))

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        def finish(child: Any) -> tuple[bool, dict[str, Any] | None]:
            if self._supports_hma(child):
                return child.request_finished_all_groups(request, block_ids)
            if len(block_ids) != 1:
                raise ConnectorError(f"{type(child).__name__} is not SupportsHMA but got {len(block_ids)} groups")
            return child.request_finished(request, block_ids[0])

        return self._aggregate_finished(request, finish)

    def _aggregate_finished(self, request: Any, finish: Callable[[Any], tuple[bool, dict[str, Any] | None]]
                            ) -> tuple[bool, dict[str, Any] | None]:
        saving = 0
        params: dict[str, Any] | None = None
        for child in self._connectors:
            delay, child_params = finish(child)
            saving += bool(delay)
            if child_params:
                clash = set(params or ()) & set(child_params)
                if clash:
                    raise ConnectorError(f"child connectors both set kv_transfer_params {sorted(clash)}")
                params = {**(params or {}), **child_params}
        if saving > 1:
            self._extra_async_saves[request.request_id] = saving - 1
        self._requests_to_connector.pop(request.request_id, None)
        return saving > 0, params

    def take_events(self) -> Iterable[Any]:
        return [event for child in self._connectors for event in child.take_events()]

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        for child in self._connectors:
            child.set_xfer_handshake_metadata(metadata)

    def reset_cache(self) -> bool | None:
        return all([c.reset_cache() is not False for c in self._connectors])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return required_layout(vllm_config, DEFAULT_FACTORY)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        rebuilt: dict[str, Any] = {}
        for name, value in (data or {}).items():
            if isinstance(value, KVConnectorStats):
                rebuilt[name] = value
            elif value is not None:
                rebuilt[name] = KVConnectorStats(data=dict(value))
        return MultiConnectorStats(data=rebuilt)


def required_layout(config: Any, factory: ConnectorFactory) -> str | None:
    """The one KV-cache layout the children require (None if none does); differing layouts are an error."""
    layouts = set()
    for sub in child_configs(config):
        child_cls: Any = factory.resolve(sub.kv_transfer_config).cls
        layout = child_cls.get_required_kvcache_layout(sub)
        if layout is not None:
            layouts.add(layout)
    if len(layouts) > 1:
        raise ConnectorError(f"child connectors require different KV-cache layouts: {sorted(layouts)}")
    return next(iter(layouts), None)
