"""A small dict-backed storage connector for the engine tests (not part of kvtier).

Both role instances find one shared store by name (``kv_connector_extra_config["store"]``). One record per
full block of the prompt and KV-cache group, keyed by a chained hash of the tokens up to that block.
Options in the extra config:

- ``async_load``: loads finish ``async_steps`` calls of ``get_finished`` later (``WAITING_FOR_REMOTE_KVS``);
- ``fail_loads``: the first block of each of the first N loads is filled with noise and reported as failed;
- ``delay_free``: ``request_finished*`` returns True; the id comes back in ``finished_sending`` once finished.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.connector.base import KVConnectorBase, KVConnectorMetadata, SupportsHMA

STORES: dict[str, dict[bytes, list[torch.Tensor]]] = {}


@dataclass
class _Load:
    req_id: str
    keys: list[bytes]
    blocks: list[list[int]]  # per group, one block id per key
    is_async: bool


@dataclass
class DictMeta(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    saves: list[tuple[str, bytes, list[int]]] = field(default_factory=list)  # request, key, block per group


@dataclass
class _ReqState:
    request: Any
    blocks: list[list[int]]
    saved: int = 0  # full blocks already stored or loaded


def block_keys(tokens: list[int], block_size: int, n: int) -> list[bytes]:
    """Chained keys of the first ``n`` full blocks."""
    keys, parent = [], b""
    for b in range(n):
        chunk = tokens[b * block_size:(b + 1) * block_size]
        parent = hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in chunk), digest_size=16).digest()
        keys.append(parent)
    return keys


class DictConnectorBase(KVConnectorBase):
    """Saves every full prompt block of every group; loads the longest stored prefix."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.store = STORES.setdefault(extra.get("store", "default"), {})
        self.async_load = bool(extra.get("async_load", False))
        self.async_steps = int(extra.get("async_steps", 2))
        self.fail_loads = int(extra.get("fail_loads", 0))
        self.delay_free = bool(extra.get("delay_free", False))
        self.corrupt_silently = bool(extra.get("corrupt_silently", False))
        self.calls: list[str] | None = extra.get("call_log")
        self.groups: list[list[str]] = []
        if kv_cache_config is not None:
            self.groups = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
        self.block_size = int(vllm_config.cache_config.block_size)
        self.states: dict[str, _ReqState] = {}
        self.pending_loads: list[_Load] = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.in_flight: dict[str, int] = {}
        self.invalid: set[int] = set()
        self.failed_reqs: set[str] = set()
        self.finished_unreported: set[str] = set()
        self.num_loaded_blocks = 0

    # ---- scheduler -----------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = request.all_token_ids
        usable = (len(tokens) - 1) // self.block_size
        hits = 0
        for key in block_keys(tokens, self.block_size, usable):
            if key not in self.store:
                break
            hits += 1
        extra = max(0, hits * self.block_size - num_computed_tokens)
        return extra, self.async_load and extra > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        ids = [list(g) for g in blocks.get_block_ids()]
        state = self.states.setdefault(request.request_id, _ReqState(request, ids))
        state.blocks = ids
        if num_external_tokens == 0:
            return
        first = request.num_computed_tokens // self.block_size
        n = num_external_tokens // self.block_size
        keys = block_keys(request.all_token_ids, self.block_size, first + n)[first:]
        self.pending_loads.append(_Load(request.request_id, keys, [g[first:first + n] for g in ids],
                                        self.async_load))
        state.saved = first + n

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = DictMeta(loads=self.pending_loads)
        self.pending_loads = []
        starts = self._track_blocks(scheduler_output)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            state = self.states[req_id]
            prompt = state.request.prompt_token_ids
            done = min(starts[req_id] + n, len(prompt)) // self.block_size
            if done > state.saved:
                keys = block_keys(prompt, self.block_size, done)
                for b in range(state.saved, done):
                    if keys[b] not in self.store:
                        meta.saves.append((req_id, keys[b], [g[b] for g in state.blocks]))
                state.saved = done
        for req_id in scheduler_output.preempted_req_ids or ():
            if req_id in self.states:
                self.states[req_id].saved = 0
        return meta

    def _track_blocks(self, out: Any) -> dict[str, int]:
        """Block ids from the scheduler output (authoritative even for a child that loaded nothing)."""
        starts = {}
        for new in out.scheduled_new_reqs:
            state = self.states.get(new.req_id)
            if state is None:
                state = self.states[new.req_id] = _ReqState(new, [], new.num_computed_tokens // self.block_size)
            state.blocks = [list(g) for g in new.block_ids]
            starts[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state, new_ids = self.states[req_id], cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.blocks = [list(g) for g in new_ids]
            elif new_ids is not None:
                for table, extra in zip(state.blocks, new_ids, strict=True):
                    table.extend(extra)
            starts[req_id] = cached.num_computed_tokens[i]
        return starts

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self.states.pop(request.request_id, None)
        return self.delay_free, None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    # ---- worker --------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = kv_caches
        if not self.groups:  # legacy: no kv_cache_config, one group of every layer
            self.groups = [list(kv_caches)]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DictMeta)
        for load in meta.loads:
            for j, key in enumerate(load.keys):
                blocks = [g[j] for g in load.blocks]
                if j == 0 and self.fail_loads > 0:
                    self._fill_noise(blocks)
                    continue
                for g, (group, block) in enumerate(zip(self.groups, blocks, strict=True)):
                    self._scatter(group, block, self.store[key][g])
                    if self.corrupt_silently:
                        self.kv_caches[group[0]][:, block] += 0.5
                self.num_loaded_blocks += 1
            if self.fail_loads > 0:
                self.fail_loads -= 1
                self.failed_reqs.add(load.req_id)
            if load.is_async:
                self.in_flight[load.req_id] = self.async_steps

    def _fill_noise(self, blocks: list[int]) -> None:
        for group, block in zip(self.groups, blocks, strict=True):
            for name in group:
                self.kv_caches[name][:, block] = torch.randn_like(self.kv_caches[name][:, block]) * 100
            self.invalid.add(block)

    def _scatter(self, layers: list[str], block: int, data: torch.Tensor) -> None:
        for i, name in enumerate(layers):
            self.kv_caches[name][:, block] = data[i]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DictMeta)
        for req_id, key, blocks in meta.saves:
            if req_id in self.failed_reqs:
                continue  # computed over a failed load this step: never store it
            self.store[key] = [torch.stack([self.kv_caches[name][:, block].clone() for name in group])
                               for group, block in zip(self.groups, blocks, strict=True)]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving = set()
        for req_id in list(self.in_flight):
            self.in_flight[req_id] -= 1
            if self.in_flight[req_id] <= 0:
                del self.in_flight[req_id]
                recving.add(req_id)
        sending = set(finished_req_ids) if self.delay_free else set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self.invalid = self.invalid, set()
        self.failed_reqs = set()
        return out


class DictConnector(DictConnectorBase, SupportsHMA):
    """The HMA-aware connector (several KV-cache groups)."""


class NonHMADictConnector(DictConnectorBase):
    """Not SupportsHMA: gets ``request_finished`` with group 0 only."""


class LegacyDictConnector(DictConnectorBase):
    """Written for vLLM <= 0.11: two-argument constructor, no kv_cache_config, not SupportsHMA."""

    def __init__(self, vllm_config: Any, role: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role)


class RecordingDictConnector(DictConnector):
    """Logs every hook call (with its role) into ``kv_connector_extra_config["call_log"]``."""

    def __getattribute__(self, name: str) -> Any:
        attr = object.__getattribute__(self, name)
        log = object.__getattribute__(self, "__dict__").get("calls")
        if log is not None and callable(attr) and not name.startswith("_") and name in _HOOKS:
            role = object.__getattribute__(self, "_role").name.lower()

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                log.append(f"{role}.{name}")
                return attr(*args, **kwargs)

            return wrapper
        return attr


_HOOKS = frozenset({
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
    "request_finished", "request_finished_all_groups", "register_kv_caches", "handle_preemptions",
    "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
    "get_finished", "get_block_ids_with_load_errors", "get_kv_connector_stats", "clear_connector_metadata",
})
