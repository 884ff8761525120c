"""Scheduler half of KVTierConnector: the control plane. Decides; never touches tensors.

Per step (vLLM order):
    get_num_new_matched_tokens(request, n)  lookup: per-group restorable chunks -> hit; cached, no pins
    update_state_after_alloc(request, blocks, n_ext)  load plan into every group's block ids; pins the chunks
    build_connector_meta(scheduler_output)  ships this step's loads + save plans for newly full chunks
then from the workers' output:
    update_connector_output(output)         chunks written, or a request's saves finished -> complete_store;
                                            finished loads -> unpin; failed blocks -> chunks leave the directory
    request_finished_all_groups(request, ids)  True while the request has saves the workers have not confirmed

Loads from memory tiers are synchronous (done before the forward pass); a request that needs any chunk from
a slow tier (disk, redis), or one whose write has not been reported landed yet (kvtier.connector.scheduler.hits),
loads asynchronously and waits for ``finished_recving``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvtier.config import KvtierConfig, RedisTierConfig, TierConfig, TierKind
from kvtier.connector.keying import RequestKeying, has_prompt_embeds, request_keys
from kvtier.connector.plans import KVTierMetadata, LoadSpec, SaveSpec, block_at, chunk_blocks
from kvtier.connector.report import WorkerReport, report_of
from kvtier.connector.scheduler.admission import SaveAdmission, request_class
from kvtier.connector.scheduler.chunk_events import ChunkEvents
from kvtier.connector.scheduler.hits import LOOKUP_TIMEOUT_S as LOOKUP_TIMEOUT_S
from kvtier.connector.scheduler.hits import GroupNeed, Locator, best_hit, hit_limit
from kvtier.connector.scheduler.inflight import InflightSaves
from kvtier.connector.scheduler.lazy import Held, LazySaves
from kvtier.connector.scheduler.recovery import LoadRecovery
from kvtier.connector.scheduler.request_state import Hit, ReqState, tokens_of
from kvtier.connector.scheduler.reuse import SeenCounter
from kvtier.connector.scheduler.states import boundary_offers, state_chunks
from kvtier.control.directory import Directory, StorePlan
from kvtier.control.planner import place, without_known
from kvtier.errors import ConfigError
from kvtier.layout import UNSERVED, GroupKind, KVCacheConfig, SlidingWindowSpec
from kvtier.layout.geometry import NULL_BLOCK
from kvtier.records.fit import check_fit
from kvtier.records.keys import Key
from kvtier.tiers.base import Tier
from kvtier.tiers.runtime import LoopThread

logger = logging.getLogger(__name__)

SLOW_KINDS = frozenset({TierKind.DISK, TierKind.REDIS})


POLICY_DRAIN_DELAY_S = 0.002  # a drain of queued policy calls waits out the step's other scheduler hooks


def _later(loop: asyncio.AbstractEventLoop, job: Callable[[], None]) -> None:
    """Run ``job`` on ``loop``: ``POLICY_DRAIN_DELAY_S`` from now when asked from another thread (the engine's), so
    that it runs beside the engine's forward pass rather than its scheduler hooks, which would wait for the
    directory's lock and the GIL (measured in vLLM's engine, one process: a 2048-token cpu hit's
    ``build_connector_meta`` took 0.15 ms, 1.2-1.5 ms with the drain at once); at once when a drain on the loop
    leaves calls behind."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        loop.call_soon(job)
    else:
        loop.call_soon_threadsafe(loop.call_later, POLICY_DRAIN_DELAY_S, job)


class SchedulerHalf:
    """Lookups, load plans and save plans over a directory of the local tiers (+ shared tiers for lookups)."""

    def __init__(self, cfg: KvtierConfig, kcc: KVCacheConfig, spaces: Sequence[bytes], *, directory: Directory,
                 tiers: Mapping[str, Tier], loop: LoopThread | None = None, tp_size: int = 1,
                 save_reports: bool = True, blocker: str | None = None) -> None:
        """``tp_size``: how many worker ranks save each chunk (served once all report it written, forgotten when
        all report it not stored). ``save_reports=False`` when ``directory`` is the workers' own store's (one
        process): the store has already completed every write there, failed ones included. ``blocker``: why
        kvtier must not serve this engine (kvtier.connector.capability); it then plans no loads and no saves."""
        self.cfg, self.kcc, self.directory = cfg, kcc, directory
        self._spaces = list(spaces)
        self._keying = RequestKeying(cfg.namespace.weights)  # cache salt, LoRA adapter, multimodal inputs
        self._tiers = dict(tiers)
        self._kinds = {t.name: t.kind for t in cfg.tiers}
        self._placement = [tuple(n for n in cfg.tiers_for(g.kind) if n in self._tiers) for g in kcc.kv_cache_groups]
        self._needs = [GroupNeed(g.kind, g.kv_cache_spec.sliding_window
                                 if isinstance(g.kv_cache_spec, SlidingWindowSpec) else 0)
                       for g in kcc.kv_cache_groups]
        self._requests: dict[str, ReqState] = {}
        self._hits: dict[str, Hit] = {}
        self._sources: dict[str, dict[TierKind, int]] = {}  # per request: its planned load's tokens by tier kind
        self._step_loads: list[LoadSpec] = []
        self._sync_pins: list[tuple[str, list[Key]]] = []
        self._async_pins: dict[str, list[tuple[str, list[Key]]]] = {}
        self._inflight = InflightSaves(directory, tp_size, reports=save_reports)
        self._recovery = LoadRecovery(directory, self._inflight, self._placement)
        self._locator = Locator(directory, self._inflight, self._placement, self._needs, self._tiers, loop)
        if loop is not None:  # the policies' calls run on the I/O loop, off the engine's thread
            directory.defer_policy(functools.partial(_later, loop.loop))
        self.disabled = False  # a worker could not read the engine's KV tensors: no hits, no saves from now on
        self._seen = SeenCounter() if cfg.policy.store_threshold > 1 else None
        self._admission = self._make_admission()
        self._lazy = self._make_lazy()  # policy.save_at: evict (kvtier.connector.scheduler.lazy)
        self._recent: list[tuple[str, tuple[str, Key]]] = []  # saves on eviction planned since the last output
        # paused (benchmarks time one engine with and without kvtier's work): no lookups hit, no saves planned
        self.paused = False
        self.events: ChunkEvents | None = None  # set when the engine publishes KV events
        # a group kvtier does not serve (chunked-local, ...) makes every hit 0: saving the others is waste
        self._never_hits = any(g.kind in UNSERVED for g in kcc.kv_cache_groups) or blocker is not None
        self._several_groups = len(kcc.kv_cache_groups) > 1
        if blocker is not None:
            logger.warning("kvtier loads and saves nothing in this engine: %s", blocker)
        if not self._never_hits:  # else nothing is ever stored or hit: block sizes do not matter
            try:
                check_fit(cfg, kcc)
            except ConfigError as exc:  # the engine chose block sizes (or chunk bytes) the config does not fit
                if cfg.strict:
                    raise
                self.disabled = True
                logger.error("kvtier is disabled for this engine (it serves without the cache): %s. Set strict: "
                             "true in kvtier's config to fail at start instead", exc)

    def _make_admission(self) -> SaveAdmission | None:
        """The save admission of ``policy.admission: learned``, remembering as many chunks as the tiers of the first
        group's placement hold. None (every chunk saved) with a shared tier placed that is not ``private``: the
        reuse of what this engine saves there by other engines is invisible here, so it would decline what they
        reuse."""
        if self.cfg.policy.admission != "learned" or not self.kcc.kv_cache_groups or not self._placement[0]:
            return None
        if any(self.directory.is_shared(n) and not _private(self.cfg.tier(n))
               for names in self._placement for n in names):
            return None
        per_chunk = max(1, self.kcc.kv_cache_groups[0].bytes_per_chunk(self.cfg.chunk_size))
        held = sum(self.cfg.tier(n).capacity for n in self._placement[0]) // per_chunk
        return SaveAdmission(max(1, held), self.cfg.policy.admission_min_reuse)

    def _make_lazy(self) -> LazySaves | None:
        """The held chunks of ``policy.save_at: evict``, for an engine with one KV-cache group of full attention or
        MLA (a sliding window frees blocks while its request runs, and vLLM zeroes the new blocks of recurrent
        states before a step runs); None otherwise, and every chunk is saved when computed."""
        if self.cfg.policy.save_at != "evict":
            return None
        groups = self.kcc.kv_cache_groups
        if len(groups) == 1 and groups[0].kind in (GroupKind.FULL_ATTENTION, GroupKind.MLA) and self._placement[0]:
            return LazySaves()
        logger.warning("policy.save_at: evict needs one full-attention or MLA KV-cache group; this engine has %s: "
                       "its chunks are saved when computed", [g.kind.value for g in groups])
        return None

    # ---- lookups ---------------------------------------------------------------------------------------
    def _state(self, req_id: str, request: Any) -> ReqState:
        """Per-request state; chunk keys are computed lazily and kept (lookups repeat every step)."""
        state = self._requests.get(req_id)
        if state is None:
            state = ReqState(request, self._keying.extra(request), [[] for _ in self._spaces],
                              opaque=has_prompt_embeds(request))
            self._requests[req_id] = state
        return state

    def _keys(self, state: ReqState, chunks: int) -> list[list[Key]]:
        """Keys of at least the first ``chunks`` chunks of every group (fewer if the request is shorter)."""
        if self._spaces and len(state.keys[0]) < chunks:
            tokens = list(tokens_of(state.source))[:chunks * self.cfg.chunk_size]
            state.keys = request_keys(self._spaces, tokens, self.cfg.chunk_size, state.extra)
        return state.keys

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` restorable from the tiers, and whether the load is async."""
        self._hits.pop(request.request_id, None)
        if self.disabled or self._never_hits or self.paused:
            return 0, False  # e.g. a group kvtier does not serve: no hit rather than a wrong one
        state = self._state(request.request_id, request)
        if state.opaque:
            return 0, False
        size = self.cfg.chunk_size
        all_keys = self._keys(state, hit_limit(len(tokens_of(request)), size))
        if self._seen is not None and not state.counted and all_keys:
            state.counted = True
            self._seen.add(all_keys[0])  # group 0's key names the prefix for every group
        limit = min(len(k) for k in all_keys) if all_keys else 0
        if self._admission is not None and state.save_class is None and all_keys:
            self._classify(state, all_keys[0][:limit], num_computed_tokens)
        if not state.refreshed and num_computed_tokens >= size:
            state.refreshed = True
            self._refresh(all_keys, min(limit, num_computed_tokens // size))
        if limit * size <= num_computed_tokens:
            return 0, False
        # saved on eviction, the tiers lack what the engine holds: look them up from the engine's hit on
        engine = num_computed_tokens // size if self._lazy is not None else 0
        located = [self._locator.locate(g, keys[engine:limit], count=g == 0) for g, keys in enumerate(all_keys)]
        before: list[str | None] = [None] * engine
        locations = [before + list(loc.tiers) for loc in located]
        writing = [{engine + i for i in loc.writing} for loc in located]
        present = [[i < engine or loc is not None for i, loc in enumerate(locs)] for locs in locations]
        chunks = best_hit(self._needs, present, size, limit)
        if chunks * size <= num_computed_tokens:
            return 0, False
        used = [(g, i) for g, need in enumerate(self._needs) for i in need.needed(chunks, size)
                if (i + 1) * size > num_computed_tokens]
        # with several KV-cache groups a load is asynchronous: vLLM takes a failed load only per request then
        # (failed_recving), and copies a recurrent state's hit block into the running block before a synchronous
        # load could fill it (its preprocess_mamba runs before start_load_kv); a chunk still being written is
        # read once the worker's write of it landed
        is_async = self._several_groups or any(self._kinds.get(locations[g][i] or "") in SLOW_KINDS
                                               or i in writing[g] for g, i in used)
        self._hits[request.request_id] = Hit(chunks, num_computed_tokens, locations, is_async)
        return chunks * size - num_computed_tokens, is_async

    def _refresh(self, all_keys: Sequence[Sequence[Key]], chunks: int) -> None:
        """The engine's own hit covers a request's first ``chunks`` chunks: kvtier's copies of them are in use though
        no lookup of kvtier counts them (a lookup asks only past the engine's hit), so refresh them in the local tiers
        that hold them. Else a prefix the engine keeps serving ages in kvtier's tiers as if unused, and is gone, with
        the rest of its chain, by the time the engine drops it."""
        for g, keys in enumerate(all_keys):
            for tier in self._placement[g] if g < len(self._placement) else ():
                if not self.directory.is_shared(tier):
                    self.directory.touch(tier, keys[:chunks])

    def _classify(self, state: ReqState, keys: Sequence[Key], num_computed_tokens: int) -> None:
        """A request's first lookup: credit the save admission with the chunks it asks for past the engine's own
        hit, and give the request its class (kvtier.connector.scheduler.admission)."""
        assert self._admission is not None
        size = self.cfg.chunk_size
        engine = num_computed_tokens // size
        state.reach = engine + self._admission.asked(keys[engine:])
        state.save_class = request_class(state.reach, len(tokens_of(state.source)) // size)

    def may_load_async(self, request: Any) -> bool:
        """Whether a hit of ``request`` may load asynchronously, from what this process knows without asking a
        server (vLLM 0.34 asks whenever a request enters a waiting queue, and starts such loads while the running
        batch is full): a chunk of it in a slow local tier (disk) or being written, or, with several KV-cache
        groups (whose loads are all asynchronous), in any local tier. With a shared tier (Redis) placed, yes for
        every request a chunk long: asking the server is no cheap call, and a false yes only holds other
        asynchronous loads back until a slot frees."""
        if self.disabled or self._never_hits or self.paused:
            return False
        state = self._state(request.request_id, request)
        if state.opaque:
            return False
        all_keys = self._keys(state, hit_limit(len(tokens_of(request)), self.cfg.chunk_size))
        if not all_keys or not min(len(k) for k in all_keys):
            return False
        if any(self.directory.is_shared(n) for names in self._placement for n in names):
            return True  # so locate below asks no server
        located = [self._locator.locate(g, keys) for g, keys in enumerate(all_keys)]
        return any((self._several_groups and tier is not None) or self._kinds.get(tier or "") in SLOW_KINDS
                   or i in loc.writing for loc in located for i, tier in enumerate(loc.tiers))

    # ---- load plans ------------------------------------------------------------------------------------
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the hit found by the last lookup into the request's allocated blocks."""
        hit = self._hits.pop(request.request_id, None)
        block_ids = blocks.get_block_ids()
        if self._lazy is not None and not self._lazy.show(request.request_id, block_ids):
            logger.warning("policy.save_at: evict: an allocation came without its blocks (a chain of connectors "
                           "that hides them); kvtier saves chunks when they are computed from now on")
            self._drop_held(stop=True)
        if hit is None or num_external_tokens <= 0:
            return
        specs = self._load_specs(request.request_id, hit, block_ids)
        pins: list[tuple[str, list[Key]]] = []
        for spec in specs:
            if not self.directory.is_shared(spec.tier):
                self.directory.hold(spec.tier, spec.keys)
                pins.append((spec.tier, list(spec.keys)))
        if hit.is_async:
            self._async_pins.setdefault(request.request_id, []).extend(pins)
        else:
            self._sync_pins.extend(pins)
        self._step_loads.extend(specs)
        self._sources[request.request_id] = self._tokens_by_kind(hit)
        state = self._requests.get(request.request_id)
        if state is not None:
            state.loaded = max(state.loaded, hit.chunks)
            self._recovery.loading(request.request_id, specs, state)
            state.unfilled = [self._unfilled(g, hit) for g in range(len(self._needs))]
            state.in_shared = {(spec.tier, key) for spec in specs  # not written back (expiring ones are)
                               if self.directory.is_shared(spec.tier) and not self._tiers[spec.tier].expiring
                               for key in spec.keys}
            if not self.cfg.policy.promote_on_hit:
                state.saved_chunks = max(state.saved_chunks, hit.chunks)

    def _tokens_by_kind(self, hit: Hit) -> dict[TierKind, int]:
        """The hit's tokens by the kind of tier each comes from, read off the group that loads the most chunks
        (a full-attention group loads every chunk past the engine's own tokens)."""
        size = self.cfg.chunk_size
        group = max(range(len(self._needs)), key=lambda g: len(self._needs[g].needed(hit.chunks, size)))
        out: dict[TierKind, int] = {}
        for i in self._needs[group].needed(hit.chunks, size):
            kind = self._kinds.get(hit.locations[group][i] or "")
            tokens = (i + 1) * size - max(i * size, hit.local_tokens)
            if kind is not None and tokens > 0:
                out[kind] = out.get(kind, 0) + tokens
        return out

    def hit_sources(self, req_id: str) -> dict[TierKind, int]:
        """Tokens of the request's planned load by tier kind (vLLM's cache-hit sources); empty without a load."""
        return dict(self._sources.get(req_id, {}))

    def _unfilled(self, group: int, hit: Hit) -> range:
        """Chunks of ``group`` below the hit that neither the engine nor the load wrote: a sliding-window group
        loads only the chunks covering its window, so the blocks of earlier chunks hold stale bytes."""
        first_loaded = self._needs[group].needed(hit.chunks, self.cfg.chunk_size).start
        return range(min(hit.local_tokens // self.cfg.chunk_size, first_loaded), first_loaded)

    def _load_specs(self, req_id: str, hit: Hit, block_ids: Sequence[Sequence[int]]) -> list[LoadSpec]:
        size = self.cfg.chunk_size
        state = self._requests[req_id]
        specs: list[LoadSpec] = []
        for g, group in enumerate(self.kcc.kv_cache_groups):
            bs = group.kv_cache_spec.block_size
            per_chunk = size // bs
            local_blocks = hit.local_tokens // bs
            by_tier: dict[str, tuple[list[Key], list[tuple[int, ...]]]] = {}
            for i in self._needs[g].needed(hit.chunks, size):
                if (i + 1) * size <= hit.local_tokens:
                    continue
                tier = hit.locations[g][i]
                if tier is None:  # cannot happen for a hit; never plan a load from nowhere
                    continue
                first = (i + 1) * per_chunk - group.blocks_per_chunk(size)  # a state: the chunk's last block
                ids = tuple(block_at(block_ids[g], j) if j >= local_blocks else NULL_BLOCK
                            for j in range(first, (i + 1) * per_chunk))
                keys, blocks = by_tier.setdefault(tier, ([], []))
                keys.append(state.keys[g][i])
                blocks.append(ids)
            specs.extend(LoadSpec(req_id, g, tier, tuple(k), tuple(b), hit.is_async)
                         for tier, (k, b) in by_tier.items())
        return specs

    # ---- save plans ------------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        """This step's loads and the save plans of chunks that become full during it; resets step state."""
        scheduled = scheduler_output.num_scheduled_tokens
        meta = KVTierMetadata(loads=self._step_loads, idle=not any(scheduled.values()))
        drops = self._recovery.take_drops(next(iter(scheduled), ""))
        meta.saves.extend(drops)  # before any write of their keys (saves on eviction: those keys are left out)
        if self._lazy is not None:
            dropped = self._lazy.dropped
            self._lazy.observe(scheduler_output)
            self.directory.count_admission(False, self._lazy.dropped - dropped)
            self._plan_evicted(meta, {k for spec in drops for p in spec.plans for k in p.evicted})
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self._requests:
                # Never looked up: the engine's request (with its cache salt) was not seen, and vLLM's
                # NewRequestData carries no salt, so keys could miss the tenant: plan no saves for it.
                self._state(new.req_id, new).opaque = True
            state = self._state(new.req_id, new)
            state.opaque = state.opaque or has_prompt_embeds(new)
            state.block_ids = [list(ids) for ids in new.block_ids]
            self._plan_saves(new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())  # vLLM 0.34 re-sends a resumed request as a new one
        for i, req_id in enumerate(cached.req_ids):
            known = self._requests.get(req_id)
            if known is None:
                continue
            state = known
            new_ids = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if req_id in resumed and new_ids is not None:
                state.block_ids = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for g, ids in enumerate(new_ids):
                    state.block_ids[g].extend(ids)
            computed = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            self._plan_saves(req_id, state, computed, meta)
        self._plan_state_saves(scheduler_output, meta)
        for tier, keys in self._sync_pins:  # synchronous loads run before any later eviction executes
            self.directory.unpin(tier, keys)
        self._sync_pins = []
        self._step_loads = []
        return meta

    def _plan_saves(self, req_id: str, state: ReqState, computed: int, meta: KVTierMetadata) -> None:
        """Save plans of the chunks that became full, for groups whose chunks are their blocks (attention)."""
        if not self._may_save(state):
            return
        size = self.cfg.chunk_size
        full = min(computed, len(tokens_of(state.source))) // size
        if full <= state.saved_chunks:
            return
        all_keys = self._keys(state, full)
        first_new = max(state.saved_chunks, state.reach)  # loaded chunks count too: remembered, their reuse is seen
        offered = [all_keys[0][i] for i in range(first_new, full) if self._reused(all_keys, i)]
        # a declined request still plans the chunks its hit covered (a promotion into the first tier)
        end = full if self._admitted(state, offered) else min(full, state.loaded)
        for g, group in enumerate(self.kcc.kv_cache_groups):
            if not self._placement[g] or group.kind is GroupKind.MAMBA:  # states: _plan_state_saves
                continue
            per_chunk = size // group.kv_cache_spec.block_size
            unfilled = state.unfilled[g] if g < len(state.unfilled) else range(0)
            chunks = [(i, chunk_blocks(state.block_ids, g, i, per_chunk)) for i in range(state.saved_chunks, end)
                      if i not in unfilled and self._reused(all_keys, i)]
            taken = [(i, b) for i, b in chunks if b is not None]
            if self._lazy is not None and not state.loaded:  # saved when the engine takes a block of it
                for i, b in taken:
                    info = self.events.describe(state.source, g, i, all_keys[g][i]) if self.events else None
                    self._lazy.hold(Held(all_keys[g][i], all_keys[g][i - 1] if i else None, b, info))
            else:
                self._plan_group(req_id, g, all_keys[g], taken, meta)
        state.saved_chunks = full

    def reset_cache(self) -> None:
        """The engine's KV memory was reset (vLLM's sleep mode discards it): the held chunks' bytes are gone."""
        self._drop_held()

    def _drop_held(self, stop: bool = False) -> None:
        """Drop every chunk held or taken, unsaved (counted as declined); ``stop``: save at compute time from now on."""
        if self._lazy is not None:
            dropped = self._lazy.dropped
            self._lazy.clear()
            self.directory.count_admission(False, self._lazy.dropped - dropped)
            if stop:
                self._lazy = None

    def _undo_recent(self) -> None:
        """Forget the saves on eviction planned since the workers' last output, everywhere: with asynchronous
        scheduling they were planned before this output's failed loads were known."""
        by_request: dict[str, list[tuple[str, Key]]] = {}
        for req_id, chunk in self._recent:
            by_request.setdefault(req_id, []).append(chunk)
        for req_id, chunks in by_request.items():
            self._inflight.forget(req_id, chunks)
            self._recovery.forget(chunks)

    def _plan_evicted(self, meta: KVTierMetadata, dropping: set[Key]) -> None:
        """Save plans of the held chunks the step's allocations take, each under the request that takes its block
        (whose blocks vLLM keeps until the save is written); the worker copies them when the step is bound."""
        assert self._lazy is not None
        evicted, self._lazy.taken = self._lazy.taken, []
        if self.disabled or self.paused:
            self.directory.count_admission(False, len(evicted))
            return
        by_request: dict[str, dict[Key, Held]] = {}
        for req_id, held in evicted:  # a key recovery drops in this step is not written before the drop runs
            if held.key not in dropping:
                by_request.setdefault(req_id, {}).setdefault(held.key, held)
        self.directory.count_admission(False, sum(held.key in dropping for _, held in evicted))
        nbytes = self.kcc.kv_cache_groups[0].bytes_per_chunk(self.cfg.chunk_size)
        for req_id, chunks in by_request.items():
            plans = self._prepare(0, [(h.key, nbytes, h.parent) for h in chunks.values()])
            if not plans:
                continue
            stored = {k for p in plans if p.source is None for k in p.store}
            chosen = [h for h in chunks.values() if h.key in stored]
            spec = SaveSpec(req_id, 0, tuple(h.key for h in chosen), tuple(h.blocks for h in chosen), tuple(plans),
                            evicted=True)
            meta.saves.append(spec)
            self._inflight.add(req_id, spec.stored_keys())
            self._recent.extend((req_id, chunk) for chunk in spec.stored_keys())
            self.directory.count_admission(True, len(chosen))
            if self.events is not None:
                for held in chosen:
                    if held.info is not None:
                        self.events.remember(held.key, held.info)

    def _plan_state_saves(self, scheduler_output: Any, meta: KVTierMetadata) -> None:
        """Save plans of the recurrent states this step writes at chunk boundaries
        (kvtier.connector.scheduler.states)."""
        for req_id, offers in boundary_offers(scheduler_output).items():
            state = self._requests.get(req_id)
            if state is None or not self._may_save(state) or not self._admitted(state, ()):
                continue
            by_group = state_chunks(offers, self.kcc, self.cfg.chunk_size)
            if not by_group:
                continue
            all_keys = self._keys(state, 1 + max(i for chunks in by_group.values() for i, _ in chunks))
            for g, chunks in by_group.items():
                keys = all_keys[g]
                taken = [(i, b) for i, b in chunks if i < len(keys) and self._reused(all_keys, i)]
                if self._placement[g]:
                    self._plan_group(req_id, g, keys, taken, meta)

    def _may_save(self, state: ReqState) -> bool:
        return not (state.opaque or self.disabled or self._never_hits or self.paused)

    def _admitted(self, state: ReqState, offered: Sequence[Key]) -> bool:
        """Whether the save admission takes the request's chunks (decided once per request, at its first save, so
        that what it saves is a whole prefix); ``offered``: the first group's keys of the chunks it could save now, past
        what its lookup found in the engine's cache or the admission's ghosts."""
        if self._admission is None:
            return True
        cls = state.save_class
        if cls is None:  # never classified by a lookup: no hit, and the prompt's length
            cls = request_class(0, len(tokens_of(state.source)) // self.cfg.chunk_size)
        if state.admitted is None:
            state.admitted = self._admission.admits(cls)
        if offered:
            self._admission.offer(cls, offered)
            self.directory.count_admission(state.admitted, len(offered))
        return state.admitted

    def _plan_group(self, req_id: str, g: int, keys: Sequence[Key], chunks: Sequence[tuple[int, tuple[int, ...]]],
                    meta: KVTierMetadata) -> None:
        """Place ``chunks`` (index, block ids) of group ``g`` (kvtier.control.planner) and ship the ones the engine
        writes."""
        if not chunks:
            return
        nbytes = self.kcc.kv_cache_groups[g].bytes_per_chunk(self.cfg.chunk_size)
        plans = self._prepare(g, [(keys[i], nbytes, keys[i - 1] if i else None) for i, _ in chunks])
        plans = without_known(plans, self._requests[req_id].in_shared)
        if not plans:
            return
        engine_keys = {k for p in plans if p.source is None for k in p.store}
        chosen = [(i, b) for i, b in chunks if keys[i] in engine_keys]
        spec = SaveSpec(req_id, g, tuple(keys[i] for i, _ in chosen), tuple(b for _, b in chosen), tuple(plans))
        meta.saves.append(spec)
        self._inflight.add(req_id, spec.stored_keys())
        self._recovery.saving(req_id, g, [(i, (p.tier, keys[i])) for p in plans if p.source is None
                                          for i, _ in chosen if keys[i] in p.store])
        if self.events is not None:
            self.events.note(self._requests[req_id].source, g, keys, [i for i, _ in chosen])

    def _reused(self, all_keys: Sequence[Sequence[Key]], chunk: int) -> bool:
        """Whether enough requests have asked for the chunk to save it (``policy.store_threshold``)."""
        if self._seen is None:
            return True
        return self._seen.count(all_keys[0][chunk]) >= self.cfg.policy.store_threshold

    def _prepare(self, group: int, entries: list[tuple[Key, int, Key | None]]) -> list[StorePlan]:
        """Store plans of one group's chunks into its placement (kvtier.control.planner: the write policy)."""
        return place(self.directory, self._placement[group], entries, self.cfg.policy.write,
                     lambda tier, nbytes: self._tiers[tier].stored_size(nbytes)).plans

    # ---- worker feedback and request end ---------------------------------------------------------------
    def update_connector_output(self, output: Any) -> None:
        """Finished saves become READY (those a worker reported failed are forgotten), finished async loads
        release their pins, chunks that failed to load are dropped."""
        report = report_of(output) or WorkerReport()
        if not self.disabled and report.disabled:
            self.disabled = True
            logger.error("kvtier: a worker cannot read the engine's KV cache (see its log); no more hits or saves")
        self._recover(output, report)  # first: no row of this output may make a suspect chunk READY
        if output.invalid_block_ids or getattr(output, "failed_recving", None) or report.failed_loads:
            self._drop_held()  # a held chunk may lie in (or be computed on) blocks a failed load left unfilled
            self._undo_recent()
        self._recent = []
        self._inflight.note(report)
        for req_id in output.finished_sending or ():
            self._recovery.drop(self._inflight.finish(req_id))
        for req_id in output.finished_recving or ():
            for tier, keys in self._async_pins.pop(req_id, []):
                self.directory.unpin(tier, keys)

    def _recover(self, output: Any, report: WorkerReport) -> None:
        """Loads that failed (kvtier.connector.scheduler.recovery): their chunks, and every save planned on top of them,
        leave the directory and every rank; each request saves again from its first failed chunk."""
        failed = self._recovery.failed(output.invalid_block_ids or (), getattr(output, "failed_recving", None) or (),
                                       report.failed_loads)
        for req_id, first in failed.items():
            undone = self._recovery.roll_back(req_id, self._requests.get(req_id), first)
            logger.warning("a load of %s failed: recomputed from chunk %d, %d chunk(s) saved on top of it dropped",
                           req_id, first, undone)

    def request_finished_all_groups(self, request: Any,
                                    block_ids: Sequence[Sequence[int]]) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks (True) while saves of the request may still be running on the workers."""
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._hits.pop(req_id, None)
        self._sources.pop(req_id, None)
        if self._lazy is not None:
            dropped = self._lazy.dropped
            self._lazy.forget(req_id)
            self.directory.count_admission(False, self._lazy.dropped - dropped)
        self._recovery.finished(req_id)
        return self._inflight.pending(req_id), None

    def close(self) -> None:
        """Forget per-request state (the directory and tiers belong to the owner; its policies' calls are applied
        at once from now on)."""
        self.directory.defer_policy(None)
        self._requests.clear()
        self._hits.clear()
        if self._lazy is not None:
            self._lazy.clear()


def _private(tier: TierConfig) -> bool:
    """A Redis tier no other engine reads (``private: true``): the save admission may judge it."""
    return isinstance(tier, RedisTierConfig) and tier.private
