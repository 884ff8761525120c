"""Engine-neutral stand-ins for the engine objects a connector sees (field names as in vLLM 0.33).

The reference engine and unit tests build these; inside vLLM the real objects (same attribute names) are
passed instead, so connector code reads only the attributes listed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_request: Any = None
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class KVCacheBlocks:
    """Allocated blocks of one request: one list of block ids per KV-cache group."""

    block_ids: tuple[list[int], ...]

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...]:
        return self.block_ids

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.block_ids))


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class KVConnectorBlockState:
    """vLLM >= 0.32's scheduler-local block state offered to a connector (never shipped to workers): the exact
    blocks holding the recurrent states (Mamba "align" mode) this step's forward writes, per request, as
    ``(group id, block id, boundary tokens)``. The blocks stay valid until the step's ``wait_for_save``."""

    boundary_state_offloads: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] | None = None
    kv_connector_metadata: Any = None
    kv_connector_block_state: KVConnectorBlockState | None = None
    new_block_ids_to_zero: list[int] | None = None  # blocks the model runner zeroes before the step (vLLM >= 0.33)


@dataclass
class KVConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_stats: Any = None
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_worker_meta: Any = None
    failed_recving: set[str] = field(default_factory=set)  # async loads that failed: recompute the request

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.kv_connector_stats
                    or self.invalid_block_ids or self.kv_connector_worker_meta or self.failed_recving)


def _new_engine_id() -> str:
    import uuid

    return str(uuid.uuid4())


@dataclass
class KVTransferConfig:
    """Stand-in for vLLM's ``KVTransferConfig`` (the fields a connector and kvtier's factory read)."""

    kv_connector: str | None = None
    kv_connector_module_path: str | None = None
    kv_role: str | None = None
    engine_id: str = field(default_factory=_new_engine_id)
    kv_buffer_device: str = "cpu"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "fail"

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)


@dataclass
class CacheConfig:
    block_size: int = 16


@dataclass
class EngineConfig:
    """Stand-in for vLLM's ``VllmConfig``: what a connector reads from it (attribute names as in vLLM)."""

    kv_transfer_config: KVTransferConfig | None = None
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    model_config: Any = None
