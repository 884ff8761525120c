"""vLLM-like scheduler of the reference engine, calling the connector's scheduler hooks in vLLM's order.

Per ``schedule()`` step:
    RUNNING requests first (chunked prefill or one decode token each, within the token budget); when blocks
    run out the last running request is preempted (recompute style: blocks freed, back to WAITING); when
    nothing runs, waiting requests holding loaded blocks are, so that the first waiting one can start.
    WAITING requests, unless something was preempted this step:
        WAITING_FOR_REMOTE_KVS: skipped until the id came back in ``finished_recving``; then scheduled with
        its loaded tokens counted as computed (``update_state_after_alloc`` is called again with 0).
        fresh / preempted: ``get_num_new_matched_tokens(request, 0)`` (None: retry next step), allocate,
        ``update_state_after_alloc(request, all blocks, num_external)``; an async load parks the request.
    Models with recurrent layers: prefill steps end at multiples of the block size (vLLM's
    ``_mamba_block_aligned_split``), and ``scheduler_output.kv_connector_block_state`` offers the connector the
    block of every state this step writes at a block boundary, for ``build_connector_meta`` only.
    ``build_connector_meta(scheduler_output)`` every step, before ``num_computed_tokens`` advances.
``update_from_output``: ``update_connector_output`` first, then invalid blocks (truncate at the first failed
block, or to 0 for hybrid models whose sliding window before that point was never loaded; "recompute"
policy), sampled tokens, finished loads and saves; finished requests go through ``request_finished`` (or
``request_finished_all_groups`` for ``SupportsHMA`` connectors) and keep their blocks while ``delay_free``.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.connector.base import KVConnectorBase, supports_hma
from kvtier.engine.kv_cache import KVCacheManager
from kvtier.engine.types import (
    KVCacheBlocks,
    KVConnectorBlockState,
    KVConnectorOutput,
    NewRequestData,
    Request,
    SchedulerOutput,
)
from kvtier.errors import ConnectorError


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class EngineRequest(Request):
    """A request with the engine's bookkeeping (the connector sees the ``Request`` fields)."""

    max_tokens: int = 16
    status: RequestStatus = RequestStatus.WAITING
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    logits: list[torch.Tensor] = field(default_factory=list)
    external_tokens: int = 0  # tokens loaded by the connector and kept (failed loads subtracted)
    prefill_computed: int = 0  # prompt tokens the engine computed itself (recomputation included)
    num_preemptions: int = 0
    num_load_failures: int = 0
    resumed: bool = False  # preempted earlier: the next schedule is a resume
    pending_external: int = 0  # tokens of an async load in flight

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 32
    kv_load_failure_policy: str = "recompute"  # or "fail": the request finishes with reason "error"


@dataclass
class RunnerOutput:
    """What the worker returns for one step."""

    sampled: dict[str, int] = field(default_factory=dict)
    logits: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None


class Scheduler:
    """Admission, chunked prefill, preemption and the connector's scheduler-side hooks."""

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig, connector: KVConnectorBase | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if config.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_load_failure_policy must be 'recompute' or 'fail'")
        if connector is not None and kv.num_groups > 1 and not supports_hma(connector):
            raise ConnectorError(f"{type(connector).__name__} does not support several KV-cache groups "
                                 "(SupportsHMA); use a model without sliding-window or recurrent layers")
        self.kv, self.config, self.connector, self.clock = kv, config, connector, clock
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.delayed_free: set[str] = set()
        self._recved: set[str] = set()
        self._finished_ids: set[str] = set()
        # a failed block makes such a request recompute from 0: a window before it, or the recurrent state at the
        # point it would resume from, may never have been loaded
        self._hybrid = any(w is not None for w in kv.windows) or kv.state_group is not None

    def add_request(self, req: EngineRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.arrival_time = self.clock()
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._finished_ids)

    # ---- schedule ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens; every call builds connector metadata."""
        out = SchedulerOutput(finished_req_ids=self._finished_ids, preempted_req_ids=set())
        self._finished_ids = set()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        if self.connector is not None:
            out.kv_connector_block_state = self._block_state(out)
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
            out.kv_connector_block_state = None  # scheduler-local: never shipped to workers (as in vLLM)
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            req.prefill_computed += max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens)
                                        - req.num_computed_tokens)
            req.num_computed_tokens += n
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        assert out.preempted_req_ids is not None
        cached = out.scheduled_cached_reqs
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._aligned(req, req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget))
            if n == 0:  # its next block-aligned chunk does not fit this step's budget
                i += 1
                continue
            new = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, req.num_computed_tokens + n)
            if new is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.add(victim.request_id)
                continue
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append(new if any(new) else None)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            out.num_scheduled_tokens[req.request_id] = n
            budget -= n
            i += 1
        return budget

    def _preempt(self, req: EngineRequest) -> None:
        self.kv.free(req.request_id)
        req.status, req.num_computed_tokens, req.resumed = RequestStatus.WAITING, 0, True
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: deque[EngineRequest] = deque()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            scheduled = self._try_waiting(req, out, budget)
            if scheduled is None:
                self.waiting.appendleft(req)
                if not self.running and self._preempt_waiting(req, out):
                    continue  # the head tries again with the blocks the others held
                break
            if scheduled < 0:
                skipped.append(req)
                continue
            budget -= scheduled
        skipped.extend(self.waiting)
        self.waiting = skipped

    def _preempt_waiting(self, head: EngineRequest, out: SchedulerOutput) -> bool:
        """Nothing runs and ``head`` cannot get blocks: preempt the waiting requests behind it that hold blocks
        their finished loads filled (all hits of a model with recurrent layers load asynchronously), which could
        otherwise stall the engine; whether there were any."""
        assert out.preempted_req_ids is not None
        loaded = [r for r in self.waiting if r.status is RequestStatus.WAITING or r.request_id in self._recved]
        held = [r for r in loaded if r is not head and self.kv.holds_blocks(r.request_id)]
        for req in held:
            req.external_tokens = max(0, req.external_tokens - req.num_computed_tokens)
            self._recved.discard(req.request_id)
            self.kv.free(req.request_id)
            req.status, req.pending_external, req.num_computed_tokens, req.resumed = RequestStatus.WAITING, 0, 0, True
            req.num_preemptions += 1
            out.preempted_req_ids.add(req.request_id)
        return bool(held)

    def _try_waiting(self, req: EngineRequest, out: SchedulerOutput, budget: int) -> int | None:
        """Tokens scheduled; -1 when the request stays waiting; None when blocks ran out."""
        from_remote = req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        if from_remote:
            if req.request_id not in self._recved:
                return -1
            self._recved.discard(req.request_id)
            req.num_computed_tokens, req.pending_external = req.pending_external, 0
            req.external_tokens += req.num_computed_tokens
            req.status = RequestStatus.WAITING
        ext, is_async = 0, False
        if self.connector is not None and req.num_computed_tokens == 0 and not from_remote:
            matched, is_async = self.connector.get_num_new_matched_tokens(req, 0)
            if matched is None:
                return -1
            ext, is_async = matched, is_async and matched > 0
        nc = req.num_computed_tokens
        if not is_async and nc + ext >= req.num_tokens:
            raise ConnectorError(f"connector matched {ext} of {req.num_tokens} tokens; at least one token "
                                 "must be computed")
        n = 0 if is_async else self._aligned(req, nc + ext, min(req.num_tokens - nc - ext, budget))
        if not is_async and n == 0:
            return None  # its first block-aligned chunk does not fit this step's budget
        if self.kv.allocate_slots(req.request_id, nc, nc + ext + n, num_external=ext) is None:
            return None
        if self.connector is not None:
            blocks = KVCacheBlocks(self.kv.blocks_of(req.request_id))
            self.connector.update_state_after_alloc(req, blocks, ext)
        if is_async:
            req.status, req.pending_external = RequestStatus.WAITING_FOR_REMOTE_KVS, ext
            return -1
        req.num_computed_tokens = nc + ext
        req.external_tokens += ext
        self._start_running(req, out, n)
        return n

    def _aligned(self, req: EngineRequest, start: int, n: int) -> int:
        """Tokens of a step from ``start`` (at most ``n``) for a model with recurrent layers, as vLLM's
        ``_mamba_block_aligned_split`` clips them (no speculative decoding, no shared-prefix junctions): a prefill
        step ends at a multiple of the block size unless it ends the prefill, and stops at the last block
        boundary before the prompt's end (the longest prefix whose state a later request can resume from)."""
        if self.kv.state_group is None:
            return n
        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
        if start >= prefill_end:
            return n
        bs, end = self.kv.block_size, start + n
        aligned = end // bs * bs
        if end < prefill_end and (aligned > start or bs <= self.config.max_num_batched_tokens):
            end = aligned
        stops = ((start // bs + 1) * bs if start % bs else 0, (req.num_tokens - 1) // bs * bs)
        return min((s for s in stops if start < s < end), default=end) - start

    def _block_state(self, out: SchedulerOutput) -> KVConnectorBlockState:
        """The recurrent states this step writes at block boundaries: per request ``(group, block, tokens)``."""
        offers: dict[str, list[tuple[int, int, int]]] = {}
        group = self.kv.state_group
        for req_id, n in out.num_scheduled_tokens.items():
            seq_len = self.requests[req_id].num_computed_tokens + n
            if group is not None and seq_len % self.kv.block_size == 0:
                offers[req_id] = [(group, self.kv.state_block(req_id, seq_len), seq_len)]
        return KVConnectorBlockState(boundary_state_offloads=offers)

    def _start_running(self, req: EngineRequest, out: SchedulerOutput, n: int) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.num_scheduled_tokens[req.request_id] = n
        blocks = self.kv.blocks_of(req.request_id)
        if req.resumed:
            cached = out.scheduled_cached_reqs
            cached.req_ids.append(req.request_id)
            cached.resumed_req_ids.add(req.request_id)
            cached.new_block_ids.append(blocks)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            req.resumed = False
        else:
            out.scheduled_new_reqs.append(NewRequestData(req.request_id, list(req.prompt_token_ids), blocks,
                                                         req.num_computed_tokens))

    # ---- update from output -------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput) -> list[EngineRequest]:
        """Apply one step's results; the requests that finished in it."""
        kco = result.kv_connector_output
        if self.connector is not None and kco is not None:
            self.connector.update_connector_output(kco)
        failed = self._handle_invalid_blocks(kco.invalid_block_ids) if kco is not None else set()
        if kco is not None:
            self._handle_failed_recving(kco.failed_recving)
        finished: list[EngineRequest] = []
        for req_id in out.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            if req_id in failed:
                if self.config.kv_load_failure_policy == "fail":
                    finished.append(self._finish(req, "error"))
                continue
            if req.num_computed_tokens < req.num_tokens:
                continue
            req.output_token_ids.append(result.sampled[req_id])
            req.logits.append(result.logits[req_id])
            if req.first_token_time is None:
                req.first_token_time = self.clock()
            if len(req.output_token_ids) >= req.max_tokens:
                finished.append(self._finish(req, "length"))
        if kco is not None:
            self._recved.update(i for i in kco.finished_recving or () if i in self.requests)
            for req_id in kco.finished_sending or ():
                if req_id in self.delayed_free:
                    self.delayed_free.discard(req_id)
                    self.kv.free(req_id)
                    del self.requests[req_id]
        return finished

    def _handle_invalid_blocks(self, invalid: set[int]) -> set[str]:
        """Truncate requests whose loaded blocks failed; the ids of affected running requests."""
        if not invalid:
            return set()
        affected = set()
        for req in list(self.requests.values()):
            first = self._first_failed_token(req.request_id, invalid)
            if first is None:
                continue
            req.num_load_failures += 1
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                req.pending_external = min(req.pending_external, first)
            elif req.status is RequestStatus.RUNNING and first < req.num_computed_tokens:
                req.external_tokens -= max(0, min(req.external_tokens, req.num_computed_tokens) - first)
                req.external_tokens = max(0, req.external_tokens)
                req.num_computed_tokens = first
                affected.add(req.request_id)
        return affected

    def _handle_failed_recving(self, failed: set[str]) -> None:
        """Requests whose asynchronous load failed as a whole (vLLM's ``failed_recving``): recompute from 0."""
        for req_id in failed:
            req = self.requests.get(req_id)
            if req is not None and req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                req.num_load_failures += 1
                req.pending_external = 0

    def _first_failed_token(self, req_id: str, invalid: set[int]) -> int | None:
        first = None
        for table in self.kv.tables.get(req_id, []):
            for b, block in enumerate(table):
                if block in invalid:
                    first = b * self.kv.block_size if first is None else min(first, b * self.kv.block_size)
                    break
        if first is not None and self._hybrid:
            return 0  # the sliding window before `first` may never have been loaded: recompute everything
        return first

    def _finish(self, req: EngineRequest, reason: str) -> EngineRequest:
        req.status, req.finish_reason, req.finish_time = RequestStatus.FINISHED, reason, self.clock()
        self.running.remove(req)
        self._finished_ids.add(req.request_id)
        delay = False
        if self.connector is not None:
            delay, _params = self._connector_finished(req)
        if delay:
            self.delayed_free.add(req.request_id)
        else:
            self.kv.free(req.request_id)
            del self.requests[req.request_id]
        return req

    def _connector_finished(self, req: EngineRequest) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector is not None
        blocks = self.kv.blocks_of(req.request_id)
        if supports_hma(self.connector):
            return self.connector.request_finished_all_groups(req, blocks)  # type: ignore[attr-defined]
        return self.connector.request_finished(req, blocks[0])
