"""Worker side of the reference engine: builds the batch, runs the model, drives the worker connector hooks.

Per step (vLLM's ``KVConnectorModelRunnerMixin`` order):
    handle_preemptions(metadata)            when requests were preempted
    bind_connector_metadata(metadata) -> start_load_kv(forward_context)
    per layer: wait_for_layer_load(name) -> write K/V + attention -> save_kv_layer(name, kv, attn_metadata)
    wait_for_save()                         only when there was a forward pass
    get_finished(finished_req_ids) -> get_block_ids_with_load_errors() -> get_kv_connector_stats()
    -> build_connector_worker_meta()
    clear_connector_metadata()
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.connector.base import KVConnectorBase
from kvtier.connector.types import KVConnectorOutput, Request, SchedulerOutput
from kvtier.engine.kv_cache import KVCacheManager
from kvtier.engine.model import KEY_BLOCK, TILE, BatchMeta, GroupAttention, TinyTransformer
from kvtier.engine.scheduler import RunnerOutput


@dataclass
class AttentionMetadata:
    """What ``save_kv_layer`` receives for a layer's group (vLLM's backends carry the same ideas)."""

    group: int
    slot_mapping: torch.Tensor  # slot of each token written this step
    block_table: torch.Tensor  # [N, L] slot of every key position
    seq_lens: torch.Tensor  # [N] tokens in context after this step
    req_ids: list[str] = field(default_factory=list)


@dataclass
class ForwardContext:
    """Stand-in for vLLM's forward context: attention metadata per layer and the paged tensors."""

    attn_metadata: dict[str, AttentionMetadata]
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
        if connector is not None:
            connector.register_kv_caches(dict(kv_caches))

    def execute(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> RunnerOutput:
        """Run one step; the connector hooks wrap the forward pass."""
        conn = self.connector
        meta, tokens, sampling = self._prepare(out, requests)
        ctx = self._forward_context(meta, list(out.num_scheduled_tokens))
        if conn is not None:
            if out.preempted_req_ids:
                conn.handle_preemptions(out.kv_connector_metadata)
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
        sending, recving = conn.get_finished(finished_req_ids)
        invalid = conn.get_block_ids_with_load_errors()
        stats = conn.get_kv_connector_stats()
        meta = conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        return KVConnectorOutput(finished_sending=sending, finished_recving=recving, kv_connector_stats=stats,
                                 invalid_block_ids=set(invalid), kv_connector_worker_meta=meta)

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
        starts = _step_starts(out)
        for r, req_id in enumerate(req_ids):
            req, n, start = requests[req_id], out.num_scheduled_tokens[req_id], starts[req_id]
            ids = req.all_token_ids[start:start + n]
            padded = -(-n // TILE) * TILE
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
                         sample_rows=torch.tensor(sample_rows, dtype=torch.long), groups=groups)
        return meta, torch.tensor(tokens, dtype=torch.long), sampling

    def _forward_context(self, meta: BatchMeta, req_ids: list[str]) -> ForwardContext:
        per_group = [AttentionMetadata(g, grp.write_slots, grp.req_slots, meta.ctx_lens, req_ids)
                     for g, grp in enumerate(meta.groups)]
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
