"""A small dict-backed connector for models with recurrent layers (engine tests; not part of kvtier).

It follows the engine's side of vLLM's Mamba "align" contract the way a real connector would: attention blocks of
the prompt are stored per full block (chained keys, as ``dict_connector``); recurrent states are stored only where
the scheduler offers them (``scheduler_output.kv_connector_block_state``: group, block, boundary tokens), keyed by
the tokens up to the boundary. A hit is the longest block prefix ``H`` with every attention block and the state at
``H``; it is loaded asynchronously (as kvtier does for such models), attention into the blocks of ``[0, H)`` and the state into the recurrent
group's block at slot ``(H - 1) // block_size``.

Both role instances share one store by name (``kv_connector_extra_config["store"]``). Options there:
``fail_state_loads``: the first N state loads fill their block with noise and report it failed; ``async_steps``:
``get_finished`` calls until a load is reported done; ``async_load: false``: loads run in ``start_load_kv`` of the
step that computes after them (wrong for recurrent state, see test_recurrent). Test probes: ``offers`` (every step's offers, scheduler) and
``allocations`` (the block ids of each ``update_state_after_alloc`` with external tokens, scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from dict_connector import block_keys

from kvtier.connector.base import KVConnectorBase, KVConnectorMetadata, SupportsHMA
from kvtier.layout import GroupKind, MambaSpec

STORES: dict[str, dict[bytes, list[torch.Tensor]]] = {}


@dataclass
class _Load:
    req_id: str
    keys: list[bytes]  # attention block keys of [0, H); the state's key is the last one
    blocks: list[list[int]]  # per group: attention block ids, or the one state block
    is_async: bool = True


@dataclass
class StateMeta(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    saves: list[tuple[bytes, list[int]]] = field(default_factory=list)  # attention key, block per attention group
    state_saves: list[tuple[bytes, int]] = field(default_factory=list)  # state key, block


@dataclass
class _Req:
    request: Any
    saved: int = 0  # prompt blocks stored or loaded


class StateDictConnector(KVConnectorBase, SupportsHMA):
    """Attention blocks and offered recurrent states in a dict; async loads of the longest restorable prefix."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.store = STORES.setdefault(extra.get("store", "default"), {})
        self.fail_state_loads = int(extra.get("fail_state_loads", 0))
        self.async_steps = int(extra.get("async_steps", 2))
        self.async_load = bool(extra.get("async_load", True))
        self.block_size = int(vllm_config.cache_config.block_size)
        groups = kv_cache_config.kv_cache_groups
        self.groups = [list(g.layer_names) for g in groups]
        self.state_group = next(g for g, group in enumerate(groups) if group.kind is GroupKind.MAMBA)
        spec = groups[self.state_group].kv_cache_spec
        assert isinstance(spec, MambaSpec)
        self.state_bytes = spec.state_bytes_per_layer()
        self.reqs: dict[str, _Req] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.pending: list[_Load] = []
        self.offers: list[dict[str, list[tuple[int, int, int]]]] = []
        self.allocations: list[tuple[str, int, tuple[list[int], ...]]] = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.in_flight: dict[str, int] = {}
        self.invalid: set[int] = set()
        self.num_state_loads = 0

    def _attention_groups(self) -> list[int]:
        return [g for g in range(len(self.groups)) if g != self.state_group]

    # ---- scheduler -----------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = request.all_token_ids
        keys = block_keys(tokens, self.block_size, (len(tokens) - 1) // self.block_size)
        present = 0
        while present < len(keys) and b"a" + keys[present] in self.store:
            present += 1
        hit = next((h for h in range(present, 0, -1) if b"s" + keys[h - 1] in self.store), 0)
        extra = max(0, hit * self.block_size - num_computed_tokens)
        return extra, self.async_load and extra > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        ids = tuple(list(g) for g in blocks.get_block_ids())
        self.tables[request.request_id] = [list(g) for g in ids]
        state = self.reqs.setdefault(request.request_id, _Req(request))
        if num_external_tokens == 0:
            return
        self.allocations.append((request.request_id, num_external_tokens, ids))
        hit = (request.num_computed_tokens + num_external_tokens) // self.block_size
        keys = block_keys(request.all_token_ids, self.block_size, hit)
        per_group = [[ids[g][hit - 1]] if g == self.state_group else ids[g][:hit] for g in range(len(ids))]
        self.pending.append(_Load(request.request_id, keys, per_group, self.async_load))
        state.saved = hit

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = StateMeta(loads=self.pending)
        self.pending = []
        self._track_blocks(scheduler_output)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            state, table = self.reqs[req_id], self.tables[req_id]
            prompt = state.request.prompt_token_ids
            done = min(state.request.num_computed_tokens + n, len(prompt)) // self.block_size
            keys = block_keys(prompt, self.block_size, done)
            for b in range(state.saved, done):
                meta.saves.append((keys[b], [table[g][b] for g in self._attention_groups()]))
            state.saved = max(state.saved, done)
        block_state = scheduler_output.kv_connector_block_state
        offers = dict(block_state.boundary_state_offloads) if block_state is not None else {}
        self.offers.append(offers)
        for req_id, entries in offers.items():
            tokens = self.reqs[req_id].request.all_token_ids
            for _group, block, boundary in entries:
                key = block_keys(tokens, self.block_size, boundary // self.block_size)[-1]
                meta.state_saves.append((key, block))
        for req_id in scheduler_output.preempted_req_ids or ():
            if req_id in self.reqs:
                self.reqs[req_id].saved = 0
        return meta

    def _track_blocks(self, out: Any) -> None:
        """Attention block ids from the scheduler output (new blocks are appended to a running request's table)."""
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(g) for g in new.block_ids]
            self.reqs.setdefault(new.req_id, _Req(new))
        cached = out.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = [list(g) for g in new_ids]
            elif new_ids is not None:
                for table, extra in zip(self.tables[req_id], new_ids, strict=True):
                    table.extend(extra)

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self.reqs.pop(request.request_id, None)
        self.tables.pop(request.request_id, None)
        return False, None

    # ---- worker --------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = kv_caches

    def _state_rows(self, name: str) -> torch.Tensor:
        tensor = self.kv_caches[name]
        return tensor.reshape(tensor.shape[0], -1)[:, :self.state_bytes]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StateMeta)
        for load in meta.loads:
            for g in self._attention_groups():
                for key, block in zip(load.keys, load.blocks[g], strict=True):
                    for name, data in zip(self.groups[g], self.store[b"a" + key][g], strict=True):
                        self.kv_caches[name][:, block] = data
            self._load_state(load.keys[-1], load.blocks[self.state_group][0])
            if load.is_async:
                self.in_flight[load.req_id] = self.async_steps

    def _load_state(self, key: bytes, block: int) -> None:
        names = self.groups[self.state_group]
        if self.fail_state_loads > 0:
            self.fail_state_loads -= 1
            for name in names:
                self._state_rows(name)[block] = torch.randint(0, 256, (self.state_bytes,), dtype=torch.uint8)
            self.invalid.add(block)
            return
        for name, data in zip(names, self.store[b"s" + key], strict=True):
            self._state_rows(name)[block] = data
        self.num_state_loads += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StateMeta)
        for key, blocks in meta.saves:
            self.store[b"a" + key] = self._attention_record(blocks)
        for key, block in meta.state_saves:
            self.store[b"s" + key] = [self._state_rows(n)[block].clone() for n in self.groups[self.state_group]]

    def _attention_record(self, blocks: list[int]) -> list[torch.Tensor]:
        """Per group (the state group's entry empty): the layers' K/V of the block."""
        record: list[torch.Tensor] = [torch.empty(0)] * len(self.groups)
        for g, block in zip(self._attention_groups(), blocks, strict=True):
            record[g] = torch.stack([self.kv_caches[name][:, block].clone() for name in self.groups[g]])
        return record

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving = set()
        for req_id in list(self.in_flight):
            self.in_flight[req_id] -= 1
            if self.in_flight[req_id] <= 0:
                del self.in_flight[req_id]
                recving.add(req_id)
        return None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self.invalid = self.invalid, set()
        return out
