"""A connector written for vLLM <= 0.11 (two-argument constructor, not SupportsHMA), loaded by module path as a
child of KVTierMultiConnector in the end-to-end tests. It never hits and records which hooks the engine calls."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class LegacyMetadata(KVConnectorMetadata):
    def __init__(self, req_ids: list[str]) -> None:
        self.req_ids = req_ids


class LegacyCountingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        self.calls: list[tuple[Any, ...]] = []

    # ---- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.calls.append(("get_num_new_matched_tokens",))
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.calls.append(("update_state_after_alloc",))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self.calls.append(("build_connector_meta",))
        return LegacyMetadata([r.req_id for r in scheduler_output.scheduled_new_reqs])

    # ---- worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert isinstance(self._get_connector_metadata(), LegacyMetadata)
        self.calls.append(("start_load_kv",))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait_for_layer_load",))

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.calls.append(("save_kv_layer",))

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save",))
