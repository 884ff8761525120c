"""Worker side of the reference engine: builds the batch, runs the model, drives the worker connector hooks.

Per step (vLLM's ``KVConnectorModelRunnerMixin`` order):
    handle_preemptions(metadata)            when requests were preempted
    recurrent layers: each request whose running state moves to a new slot gets the previous slot's state
                      copied there (vLLM's ``preprocess_mamba``: before the loads, so a state must be loaded
                      by an earlier step, i.e. asynchronously, to be carried)
    bind_connector_metadata(metadata) -> start_load_kv(forward_context)
    per attention layer: wait_for_layer_load(name) -> write K/V + attention -> save_kv_layer(name, kv, metadata)
    wait_for_save()                         only when there was a forward pass
    get_transfer_results(finished_req_ids) -> get_block_ids_with_load_errors() -> get_kv_connector_stats()
    -> build_connector_worker_meta()
    clear_connector_metadata()
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.connector.base import KVConnectorBase
from kvtier.engine.kv_cache import KVCacheManager
from kvtier.engine.model import KEY_BLOCK, TILE, BatchMeta, GroupAttention, TinyTransformer
from kvtier.engine.recurrent import StateBatch
from kvtier.engine.scheduler import RunnerOutput
from kvtier.engine.types import KVConnectorOutput, Request, SchedulerOutput
from kvtier.layout.geometry import NULL_BLOCK


@dataclass
class AttentionMetadata:
    """What ``save_kv_layer`` receives for a layer's group (vLLM's backends carry the same ideas)."""

    group: int
    slot_mapping: torch.Tensor  # slot of each token written this step
    block_table: torch.Tensor  # [N, L] slot of every key position
    seq_lens: torch.Tensor  # [N] tokens in context after this step
    req_ids: list[str] = field(default_factory=list)


@dataclass
class StateMetadata:
    """A recurrent layer's entry in the forward context (vLLM's Mamba metadata carries the same ideas)."""

    group: int
    state_indices: torch.Tensor  # [N] block of each request's running state
    seq_lens: torch.Tensor  # [N] tokens in context after this step
    req_ids: list[str] = field(default_factory=list)


@dataclass
class ForwardContext:
    """Stand-in for vLLM's forward context: attention metadata per layer and the paged tensors."""

    attn_metadata: dict[str, AttentionMetadata | StateMetadata]
    kv_caches: dict[str, torch.Tensor]
    virtual_engine: int = 0


class _ConnectorHooks:
    """Per-layer ``wait_for_layer_load`` / ``save_kv_layer`` calls."""

    def __init__(self, connector: KVConnectorBase, names: list[str], ctx: ForwardContext) -> None:
        self.connector, self.names, self.ctx = connector, names, ctx

    def before_attention(self, layer: int) -> None:
        self.connector.wait_for_layer_load(self.names[layer])

    def after_attention(self, layer: int) -> None:
        name = self.names[layer]
        self.connector.save_kv_layer(name, self.ctx.kv_caches[name], self.ctx.attn_metadata[name])


class ModelRunner:
    """Runs scheduled tokens through the model over the paged KV tensors."""

    def __init__(self, model: TinyTransformer, kv: KVCacheManager, kv_caches: dict[str, torch.Tensor],
                 connector: KVConnectorBase | None = None) -> None:
        self.model, self.kv, self.kv_caches, self.connector = model, kv, kv_caches, connector
        config = kv.config
        self.names = [model.config.layer_name(i) for i in range(model.config.num_layers)]
        group_of = config.group_of_layer()
        self.group_of_layer = [group_of[name] for name in self.names]
        self.cache_list = [kv_caches[name] for name in self.names]
        self.state_caches = [kv_caches[name] for i, name in enumerate(self.names) if model.config.is_recurrent(i)]
        self._state_slots: dict[str, int] = {}  # per request: the slot its state ran in last step
        if connector is not None:
            connector.register_kv_caches(dict(kv_caches))

    def execute(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> RunnerOutput:
        """Run one step; the connector hooks wrap the forward pass."""
        conn = self.connector
        meta, tokens, sampling = self._prepare(out, requests)
        ctx = self._forward_context(meta, list(out.num_scheduled_tokens))
        if conn is not None and out.preempted_req_ids:
            conn.handle_preemptions(out.kv_connector_metadata)
        self._carry_states(out)
        if conn is not None:
            conn.bind_connector_metadata(out.kv_connector_metadata)
            conn.start_load_kv(ctx)
        result = RunnerOutput()
        if out.num_scheduled_tokens:
            hooks = _ConnectorHooks(conn, self.names, ctx) if conn is not None else None
            logits = self.model.forward(tokens, meta, self.cache_list, self.group_of_layer, hooks)
            for row, req_id in enumerate(sampling):
                result.logits[req_id] = logits[row]
                result.sampled[req_id] = int(torch.argmax(logits[row]).item())
            if conn is not None:
                conn.wait_for_save()
        if conn is not None:
            result.kv_connector_output = self._connector_output(conn, out.finished_req_ids)
        return result

    @staticmethod
    def _connector_output(conn: KVConnectorBase, finished_req_ids: set[str]) -> KVConnectorOutput:
        results = conn.get_transfer_results(finished_req_ids)
        invalid = conn.get_block_ids_with_load_errors()
        stats = conn.get_kv_connector_stats()
        meta = conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        return KVConnectorOutput(finished_sending=results.finished_sending or None,
                                 finished_recving=results.finished_recving or None, kv_connector_stats=stats,
                                 invalid_block_ids=set(invalid), kv_connector_worker_meta=meta,
                                 failed_recving=set(results.failed_recving))

    def _carry_states(self, out: SchedulerOutput) -> None:
        """Copy each request's state from the slot it ran in last step into this step's running slot, when they
        differ (vLLM's ``preprocess_mamba``). A new or resumed request starts from the slot of the state after its
        computed tokens (a loaded one), or from the zero state when it starts at 0."""
        group = self.kv.state_group
        if group is None:
            return
        for req_id in out.finished_req_ids | (out.preempted_req_ids or set()):
            self._state_slots.pop(req_id, None)
        restarted = {r.req_id for r in out.scheduled_new_reqs} | out.scheduled_cached_reqs.resumed_req_ids
        for req_id, start in _step_starts(out).items():
            slot = self.kv.state_slot(start + out.num_scheduled_tokens[req_id])
            prev = self._state_slots.get(req_id) if req_id not in restarted else None
            prev = self.kv.state_slot(start) if prev is None else prev
            self._state_slots[req_id] = slot
            if start == 0 or prev == slot:
                continue
            table = self.kv.tables[req_id][group]
            src, dst = table[prev], table[slot]
            if src == NULL_BLOCK:
                raise RuntimeError(f"request {req_id}: no state to continue from in slot {prev}")
            for cache in self.state_caches:
                cache[dst].copy_(cache[src])

    def _prepare(self, out: SchedulerOutput, requests: Mapping[str, Request]
                 ) -> tuple[BatchMeta, torch.Tensor, list[str]]:
        """Lay the scheduled tokens out in per-request tiles."""
        req_ids = list(out.num_scheduled_tokens)
        tokens: list[int] = []
        positions: list[int] = []
        valid: list[int] = []
        tile_req: list[int] = []
        ctx_lens: list[int] = []
        sample_rows: list[int] = []
        sampling: list[str] = []
        first_rows: list[int] = []
        starts = _step_starts(out)
        for r, req_id in enumerate(req_ids):
            req, n, start = requests[req_id], out.num_scheduled_tokens[req_id], starts[req_id]
            ids = req.all_token_ids[start:start + n]
            padded = -(-n // TILE) * TILE
            first_rows.append(len(tokens))
            valid.extend(range(len(tokens), len(tokens) + n))
            if start + n == req.num_tokens:
                sample_rows.append(len(tokens) + n - 1)
                sampling.append(req_id)
            tokens.extend(ids + [0] * (padded - n))
            positions.extend(list(range(start, start + n)) + [0] * (padded - n))
            tile_req.extend([r] * (padded // TILE))
            ctx_lens.append(start + n)
        pos = torch.tensor(positions, dtype=torch.long)
        valid_rows = torch.tensor(valid, dtype=torch.long)
        span = -(-max(ctx_lens, default=0) // KEY_BLOCK) * KEY_BLOCK
        slots = self.kv.slot_table(req_ids, span) if req_ids else []
        row_req = torch.tensor(tile_req, dtype=torch.long).repeat_interleave(TILE)[valid_rows]
        groups = [GroupAttention(write_slots=s[row_req, pos[valid_rows]], req_slots=s) for s in slots]
        meta = BatchMeta(positions=pos, valid_rows=valid_rows, tile_req=torch.tensor(tile_req, dtype=torch.long),
                         ctx_lens=torch.tensor(ctx_lens, dtype=torch.long),
                         sample_rows=torch.tensor(sample_rows, dtype=torch.long), groups=groups,
                         states=self._state_batch(req_ids, first_rows, ctx_lens, starts))
        return meta, torch.tensor(tokens, dtype=torch.long), sampling

    def _state_batch(self, req_ids: list[str], first_rows: list[int], ctx_lens: list[int],
                     starts: Mapping[str, int]) -> StateBatch | None:
        """Where each request's recurrent state runs this step (None for a model without recurrent layers)."""
        if self.kv.state_group is None:
            return None
        return StateBatch(first_rows=tuple(first_rows),
                          lengths=tuple(end - starts[r] for r, end in zip(req_ids, ctx_lens, strict=True)),
                          blocks=tuple(self.kv.state_block(r, end) for r, end in zip(req_ids, ctx_lens, strict=True)),
                          fresh=tuple(starts[r] == 0 for r in req_ids))

    def _forward_context(self, meta: BatchMeta, req_ids: list[str]) -> ForwardContext:
        per_group: list[Any] = [AttentionMetadata(g, grp.write_slots, grp.req_slots, meta.ctx_lens, req_ids)
                                for g, grp in enumerate(meta.groups)]
        if meta.states is not None and self.kv.state_group is not None and per_group:
            per_group[self.kv.state_group] = StateMetadata(self.kv.state_group, torch.tensor(meta.states.blocks),
                                                           meta.ctx_lens, req_ids)
        attn: dict[str, Any] = {}
        if per_group:
            attn = {name: per_group[self.group_of_layer[i]] for i, name in enumerate(self.names)}
        return ForwardContext(attn_metadata=attn, kv_caches=self.kv_caches)


def _step_starts(out: SchedulerOutput) -> dict[str, int]:
    """Tokens computed before this step, per scheduled request (as the scheduler output says)."""
    starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    return starts
