"""What the scheduler half undoes when a load fails, so that no KV computed on top of it is ever served.

As in vLLM, the engine learns of a failed synchronous load only after the step's forward pass: that step computed
the request's next tokens over blocks that were never filled, and the same step's saves gathered that KV. Attention
is causal, so every chunk past the first failed one that the request computed since its load is suspect. When the
workers report the failure (``invalid_block_ids``; an asynchronous load of several groups fails as a whole request,
``failed_recving``), the scheduler:

- forgets the request's suspect saves: no longer in flight (a late "written" row cannot make them READY), out of
  the directory, and deleted from every tier on every rank (``take_drops``: eviction-only save specs shipped at the
  front of the next step's saves, so they run before the recompute writes the same keys again);
- forgets the chunk that failed to load, deleted from every rank too (a rank may still hold it: its bytes would be
  counted free by the directory while the pool keeps them);
- rolls the request's ``saved_chunks`` back to the first failed chunk, so the recompute stores the right KV.

The worker that saw its own load fail also writes nothing for that request in the same step
(``WorkerHalf.wait_for_save``): with one rank nothing suspect is ever written; with several, the other ranks' copies
are deleted here before any lookup can count on them (a chunk is served only once every rank wrote it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.connector.plans import LoadSpec, SaveSpec
from kvtier.connector.scheduler.inflight import Chunk, InflightSaves
from kvtier.connector.scheduler.request_state import ReqState
from kvtier.control.directory import Directory, StorePlan
from kvtier.layout.geometry import NULL_BLOCK
from kvtier.records.keys import Key


@dataclass(frozen=True)
class Loaded:
    """One chunk a request loads: its group, tier, key and index in the request."""

    req_id: str
    group: int
    tier: str
    key: Key
    index: int


class LoadRecovery:
    """The scheduler's record of planned loads and of the saves planned on top of them, and the undo of both."""

    def __init__(self, directory: Directory, inflight: InflightSaves, placement: Sequence[Sequence[str]]) -> None:
        self._directory = directory
        self._inflight = inflight
        self._placement = [tuple(p) for p in placement]
        self._blocks: dict[int, Loaded] = {}  # block id -> the chunk loaded into it (synchronous: one group)
        self._req_blocks: dict[str, list[int]] = {}
        self._since_load: dict[str, list[tuple[int, int, Chunk]]] = {}  # per request: (index, group, chunk) saved
        self._drops: dict[str, set[Key]] = {}  # tier -> keys every rank must delete

    def loading(self, req_id: str, specs: Sequence[LoadSpec], state: ReqState) -> None:
        """``req_id`` loads ``specs`` this step: remember the chunk in each block, and start collecting the saves
        planned on top of this load."""
        for spec in specs:
            index = {k: i for i, k in enumerate(state.keys[spec.group])}
            for key, ids in zip(spec.keys, spec.block_ids, strict=True):
                loaded = Loaded(req_id, spec.group, spec.tier, key, index[key])
                for b in ids:
                    if b != NULL_BLOCK:
                        self._blocks[b] = loaded
                        self._req_blocks.setdefault(req_id, []).append(b)
        self._since_load[req_id] = []

    def saving(self, req_id: str, group: int, chunks: Iterable[tuple[int, Chunk]]) -> None:
        """``req_id`` is told to write ``chunks`` (index, (tier, key)) of ``group`` after its latest load."""
        since = self._since_load.get(req_id)
        if since is not None:
            since.extend((i, group, chunk) for i, chunk in chunks)

    def failed(self, invalid_blocks: Iterable[int], failed_requests: Iterable[str],
               failed_loads: Iterable[tuple[str, Key]]) -> dict[str, int]:
        """The loads that failed: per request, the first chunk that must be recomputed (a request whose load failed as
        a whole recomputes from 0). The chunks that failed leave the directory and every rank's copy of their tier
        (a shared tier keeps them: a slow answer is no reason to delete what other engines read)."""
        first: dict[str, int] = {}
        chunks: dict[Chunk, None] = {}
        for block in invalid_blocks:
            loaded = self._blocks.get(block)
            if loaded is not None:
                chunks[(loaded.tier, loaded.key)] = None
                first[loaded.req_id] = min(first.get(loaded.req_id, loaded.index), loaded.index)
        chunks.update(dict.fromkeys(failed_loads))
        first.update(dict.fromkeys(failed_requests, 0))
        for tier, key in chunks:
            if not self._directory.is_shared(tier):
                self._forget(tier, key)
        return first

    def roll_back(self, req_id: str, state: ReqState | None, first: int) -> int:
        """Undo the saves ``req_id`` planned on top of its failed load from chunk ``first`` on, and let its recompute
        save again from there; how many chunks were undone."""
        since = self._since_load.get(req_id, [])
        suspect = [(g, chunk) for i, g, chunk in since if i >= first]
        self._since_load[req_id] = [row for row in since if row[0] < first]
        self._inflight.forget(req_id, [chunk for _, chunk in suspect])
        for g, (_, key) in suspect:  # it may have been demoted or written through since
            for tier in self._placement[g]:
                self._forget(tier, key)
        if state is not None:
            state.saved_chunks = min(state.saved_chunks, first)
            redo = {k for keys in state.keys for k in keys[first:]}  # their shared copies may be what failed
            state.in_shared = {(t, k) for t, k in state.in_shared if k not in redo}
            state.unfilled = [range(u.start, max(u.start, min(u.stop, first))) for u in state.unfilled]
        return len(suspect)

    def _forget(self, tier: str, key: Key) -> None:
        """``key`` leaves the directory's ``tier`` and, through the next step's drops, every rank's copy of it."""
        if self._directory.is_shared(tier):  # untracked: delete it wherever it may be
            self._drops.setdefault(tier, set()).add(key)
        elif self._directory.holds(tier, key):
            self._directory.remove(tier, [key])
            self._drops.setdefault(tier, set()).add(key)

    def forget(self, chunks: Iterable[Chunk]) -> None:
        """Chunks planned for saving that must not be served: they leave the directory and every rank."""
        for tier, key in chunks:
            self._forget(tier, key)

    def drop(self, chunks: Iterable[Chunk]) -> None:
        """Chunks some rank wrote that the scheduler forgets: delete them from every rank."""
        for tier, key in chunks:
            self._drops.setdefault(tier, set()).add(key)

    def take_drops(self, req_id: str) -> list[SaveSpec]:
        """The deletions to ship this step: one eviction-only save spec per tier (nothing gathered, nothing
        written), filed under ``req_id``."""
        drops, self._drops = self._drops, {}
        return [SaveSpec(req_id, 0, (), (), (StorePlan(tier, (), tuple(sorted(keys))),))
                for tier, keys in drops.items()]

    def finished(self, req_id: str) -> None:
        for block in self._req_blocks.pop(req_id, []):
            self._blocks.pop(block, None)
        self._since_load.pop(req_id, None)
