"""Engine-neutral connector API mirroring vLLM's ``KVConnectorBase_V1`` (names, signatures, call order).

Two roles, two unrelated instances that share nothing but the config:

Scheduler role, per ``schedule()`` step:
    get_num_new_matched_tokens(request, num_computed_tokens)   WAITING requests, may repeat, side-effect free
    update_state_after_alloc(request, blocks, num_external)     after every allocation (twice for async loads)
    build_connector_meta(scheduler_output)                      every step, packs this step's load/save plan
  then, from the workers' output:
    update_connector_output(connector_output)                   before finished sets are acted on
    request_finished(request, block_ids) /                      once per finished request; True keeps the
    request_finished_all_groups(request, block_ids)             blocks until the id is in finished_sending
  and take_events(), shutdown().

Worker role:
    register_kv_caches(kv_caches)                               once, before the first step
  per step:
    handle_preemptions(metadata)                                when requests were preempted
    bind_connector_metadata(metadata) -> start_load_kv(forward_context)
    per attention layer: wait_for_layer_load(name) ... save_kv_layer(name, kv_layer, attn_metadata)
    wait_for_save()                                             (not on steps without a forward pass)
    get_transfer_results(finished_req_ids) (get_finished + failed async loads) -> get_block_ids_with_load_errors()
    -> get_kv_connector_stats()
    clear_connector_metadata()

Everything crossing the scheduler/worker boundary (metadata, outputs, stats) must pickle.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvtier.control.metrics import is_gauge

logger = logging.getLogger(__name__)


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """Per-step plan built by the scheduler half and shipped to the workers. Must pickle."""


class KVConnectorHandshakeMetadata:
    """Out-of-band handshake data. Must pickle."""


@dataclass
class KVConnectorStats:
    """Serializable stats: ``data`` is plain numbers keyed by name (and, for other connectors, lists of plain rows);
    aggregating sums the numbers and joins the lists. Stats only count: what a scheduler must act on travels in
    the worker metadata (kvtier's ``WorkerReport``, kvtier.connector.report)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            mine = self.data.get(key)
            if isinstance(value, (int, float)):
                self.data[key] = (mine or 0) + value
            elif isinstance(value, list) and isinstance(mine, list):
                self.data[key] = mine + value
            else:
                self.data[key] = value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counts (levels and samples are for Prometheus only: kvtier.integrations.prometheus)."""
        return {k: v for k, v in self.data.items() if isinstance(v, (int, float)) and not is_gauge(k)}

    def is_empty(self) -> bool:
        return not self.data


@dataclass
class KVConnectorTransferResults:
    """What ``get_transfer_results`` returns (vLLM's names)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class SupportsHMA(ABC):
    """A connector that handles several KV-cache groups (hybrid models)."""

    @abstractmethod
    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Like ``request_finished`` with the block ids of every group."""


def supports_hma(obj: Any) -> bool:
    if isinstance(obj, type):
        return issubclass(obj, SupportsHMA)
    return isinstance(obj, SupportsHMA)


class KVConnectorBase(ABC):
    """Base of every kvtier connector. ``kv_cache_config`` is explicit; ``None`` is legacy/unknown."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        self._connector_metadata: KVConnectorMetadata | None = None
        self._vllm_config = vllm_config
        self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return False

    # ---- worker side -------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None, "no connector metadata bound"
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Receive the paged KV tensors, one per layer name."""

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        """Receive one tensor holding every layer (only when ``prefer_cross_layer_blocks``)."""

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        """Receive the engine's block copy function."""

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Called before preempted requests' blocks are overwritten; flush pending saves."""

    @abstractmethod
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving) request ids."""
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished sends and receives, and the requests whose asynchronous loads failed (vLLM >= 0.32: with several
        KV-cache groups a failed load must be reported per request, block ids are not unique across groups)."""
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        """Release resources."""

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None

    def get_kv_connector_kv_cache_events(self) -> Any:
        return None

    def build_connector_worker_meta(self) -> Any:
        """What this worker tells the scheduler this step (anything with ``aggregate(other)``), or None; the
        engine aggregates it over workers into ``KVConnectorOutput.kv_connector_worker_meta``."""
        return None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None

    def get_finished_count(self) -> int | None:
        return None

    # ---- scheduler side ----------------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]: ...

    @abstractmethod
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None: ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata: ...

    def update_connector_output(self, connector_output: Any) -> None:
        """Learn what the workers finished."""

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def take_events(self) -> Iterable[Any]:
        return ()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Receive the workers' handshake metadata."""

    def reset_cache(self) -> bool | None:
        return None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVConnectorStats(data=dict(data)) if data is not None else None
