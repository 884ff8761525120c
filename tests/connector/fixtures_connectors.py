"""Connector classes the factory and MultiConnector tests load by module path (``tests.connector.fixtures_connectors``).

- ``LegacyConnector``: the two-argument constructor of vLLM <= 0.11, ``super().__init__(vllm_config=, role=)``.
- ``NewConnector``: ``(vllm_config, role, kv_cache_config)``.  ``KwargsConnector``: ``(vllm_config, role, **kwargs)``.
- ``StrictBase`` / ``StrictLegacyConnector``: a base whose ``__init__`` REQUIRES ``kv_cache_config`` (as vLLM 0.33's)
  and a legacy class on it.
- ``StorageConnector``: a small real storage connector (one file per full block under
  ``kv_connector_extra_config["path"]``), SupportsHMA, optional async saves, corrupt files reported as load errors.
- ``NonHMAStorageConnector``: the same without SupportsHMA.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.connector.base import KVConnectorBase, KVConnectorMetadata, KVConnectorStats, SupportsHMA


class _Minimal(KVConnectorBase):
    """No-op implementations of the abstract methods; records calls."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.calls: list[tuple[Any, ...]] = []

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.calls.append(("start_load_kv",))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.calls.append(("save_kv_layer", layer_name))

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save",))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.calls.append(("get_num_new_matched_tokens", request.request_id, num_computed_tokens))
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.calls.append(("update_state_after_alloc", request.request_id, blocks.get_block_ids(),
                           num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self.calls.append(("build_connector_meta",))
        return KVConnectorMetadata()


class LegacyConnector(_Minimal):
    def __init__(self, vllm_config: Any, role: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role)


class NewConnector(_Minimal):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)


class KwargsConnector(_Minimal):
    def __init__(self, vllm_config: Any, role: Any, **kwargs: Any) -> None:
        self.received_kwargs = dict(kwargs)
        super().__init__(vllm_config, role, **kwargs)


class BuiltinLikeConnector(_Minimal):
    """Third parameter not named kv_cache_config: probing would call it legacy-style and fail."""

    def __init__(self, vllm_config: Any, role: Any, cache_cfg: Any) -> None:
        super().__init__(vllm_config, role, cache_cfg)


class StrictBase(_Minimal):
    """A base whose constructor requires kv_cache_config, like vLLM 0.33's KVConnectorBase_V1."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)


class StrictLegacyConnector(StrictBase):
    def __init__(self, vllm_config: Any, role: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role)  # type: ignore[call-arg]
        self.legacy_init_ran = True


class NotAConnector:
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        pass


NOT_A_CLASS = 42


def _block_digest(token_ids: list[int], upto_block: int, block_size: int) -> str:
    data = ",".join(map(str, token_ids[: (upto_block + 1) * block_size])).encode()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass
class StorageMetadata(KVConnectorMetadata):
    # req_id -> list of (file name, block id, expected block token ids)
    loads: dict[str, list[tuple[str, int, list[int]]]] = field(default_factory=dict)
    saves: dict[str, list[tuple[str, list[int]]]] = field(default_factory=dict)


class StorageConnector(_Minimal, SupportsHMA):
    """One file per full block (group 0 block ids); the file holds the block's token ids."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.path = Path(extra["path"])
        self.path.mkdir(parents=True, exist_ok=True)
        self.block_size = int(extra.get("block_size", 4))
        self.async_save = bool(extra.get("async_save", False))
        self.fail_shutdown = bool(extra.get("fail_shutdown", False))
        self.lookup_pending = bool(extra.get("lookup_pending", False))
        self.hold_saves = bool(extra.get("hold_saves", False))
        self._held: list[tuple[str, list[tuple[str, list[int]]]]] = []
        self.shut_down = False
        self._pending_loads: dict[str, list[tuple[str, int, list[int]]]] = {}
        self._saved: set[str] = set()
        self._load_errors: set[int] = set()
        self._finished: set[str] = set()
        self.loaded_blocks: list[int] = []
        self.stats = KVConnectorStats()

    def _hits(self, token_ids: list[int]) -> int:
        blocks = 0
        while (blocks + 1) * self.block_size < len(token_ids) and \
                (self.path / _block_digest(token_ids, blocks, self.block_size)).exists():
            blocks += 1
        return blocks

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        super().get_num_new_matched_tokens(request, num_computed_tokens)
        if self.lookup_pending:
            return None, False
        return max(self._hits(request.prompt_token_ids) * self.block_size - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens == 0:
            return
        ids, tokens, bs = blocks.get_block_ids()[0], request.prompt_token_ids, self.block_size
        self._pending_loads[request.request_id] = [
            (_block_digest(tokens, i, bs), ids[i], tokens[i * bs:(i + 1) * bs])
            for i in range(num_external_tokens // bs)]

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        super().build_connector_meta(scheduler_output)
        meta = StorageMetadata(loads=self._pending_loads)
        self._pending_loads = {}
        for new in scheduler_output.scheduled_new_reqs:
            tokens = new.prompt_token_ids
            meta.saves[new.req_id] = [(_block_digest(tokens, i, self.block_size),
                                       tokens[i * self.block_size:(i + 1) * self.block_size])
                                      for i in range(len(tokens) // self.block_size)]
        return meta

    # ---- worker ------------------------------------------------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context)
        meta = self._get_connector_metadata()
        assert isinstance(meta, StorageMetadata)
        loaded = 0
        for entries in meta.loads.values():
            for name, block_id, expected in entries:
                stored = (self.path / name).read_text().split(",")
                if [int(t) for t in stored if t] != expected:
                    self._load_errors.add(block_id)
                else:
                    self.loaded_blocks.append(block_id)
                    loaded += 1
        self.stats.aggregate(KVConnectorStats(data={"loads": loaded}))

    def wait_for_save(self) -> None:
        super().wait_for_save()
        meta = self._get_connector_metadata()
        assert isinstance(meta, StorageMetadata)
        self._held.extend(meta.saves.items())
        if not self.hold_saves:
            self.flush()

    def flush(self) -> None:
        """Write the queued saves (immediately unless ``hold_saves``)."""
        for req_id, entries in self._held:
            for name, tokens in entries:
                (self.path / name).write_text(",".join(map(str, tokens)))
            self._saved.add(req_id)
        self._held = []

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self.async_save:
            return None, None
        self._finished |= finished_req_ids
        done = self._finished & self._saved
        self._finished -= done
        self._saved -= done
        return done or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.stats if self.stats.data else None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("request_finished", request.request_id, block_ids))
        return self.async_save, None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("request_finished_all_groups", request.request_id, block_ids))
        return self.async_save, None

    def shutdown(self) -> None:
        self.shut_down = True
        if self.fail_shutdown:
            raise RuntimeError(f"shutdown failed for {self.path.name}")


class NonHMAStorageConnector(_Minimal):
    """Not SupportsHMA (a connector written before hybrid models)."""
