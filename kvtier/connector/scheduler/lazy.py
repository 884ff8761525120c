"""Saves on eviction (``policy.save_at: evict``): a computed chunk is saved when the engine is about to write over
one of its blocks, not when it is computed (the peers' offload-on-evict: SGLang HiCache's write-back, LMCache's
lazy offload). Most chunks leave vLLM's prefix cache unreused; while vLLM holds a chunk, kvtier's copy serves
nothing, so a save at compute time is pure cost until then.

vLLM's connector API has no eviction hook. What the scheduler half sees instead: every block a step writes into
belongs to an allocation of that step, and each is shown to the connector before the step runs:
``update_state_after_alloc`` (each request the step admits, with all its blocks, those whose load is
asynchronous included) and the step's scheduler output (the new blocks of running requests). A held chunk one of
whose blocks shows up there, reallocated or shared as a prefix-cache hit (whose bytes are the chunk's), is planned
for saving in that step; the worker copies it out when the step's metadata is bound
(``bind_connector_metadata``), before any connector's load and the forward pass write into the block.

A chunk whose bytes may not be its own is dropped, never saved (the scheduler half counts it declined):

* a block vLLM zeroes or copies into before the step runs (``new_block_ids_to_zero``, ``kv_cache_block_copies``);
* a block held again for another chunk: an allocation this half did not see came in between;
* every held chunk on a reset of the engine's KV memory (vLLM's sleep mode) and on any failed load (a held chunk
  may lie in, or be computed on, a block the load left unfilled); the saves planned on eviction since the
  workers' last output are then undone too (with asynchronous scheduling a step is planned before the last
  one's failures are known);
* every held chunk when an allocation comes without its blocks (a chain that hides them): the half then saves at
  compute time;
* the chunks a request took that finished before its step was planned.

Only requests that loaded nothing from kvtier hold their chunks; the others save at compute time, where a failed
load's recovery (kvtier.connector.scheduler.recovery) covers what they computed on top of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.records.keys import Key


@dataclass(frozen=True)
class Held:
    """A computed chunk of group 0 not saved yet: its key, its parent's key and the blocks that hold it."""

    key: Key
    parent: Key | None
    blocks: tuple[int, ...]
    info: Any = None  # its description for KV events (kvtier.connector.scheduler.chunk_events), when they are on


class LazySaves:
    """The held chunks by block id, and the allocations that take them."""

    def __init__(self) -> None:
        self._by_block: dict[int, Held] = {}
        self._shown: dict[str, bool] = {}  # requests allocated and not scheduled yet, shown with their blocks
        self.taken: list[tuple[str, Held]] = []  # (the request taking a block, the chunk): to plan in this step
        self.dropped = 0  # chunks dropped unsaved (their blocks could not be copied safely)

    def __len__(self) -> int:
        """Chunks held or taken."""
        return len({id(h) for h in self._by_block.values()}) + len(self.taken)

    def hold(self, chunk: Held) -> None:
        """Hold ``chunk`` until one of its blocks is taken; a block held for another chunk drops that chunk."""
        for block in chunk.blocks:
            old = self._by_block.get(block)
            if old is not None and old.key != chunk.key:
                self._remove(old)
                self.dropped += 1
        for block in chunk.blocks:
            self._by_block[block] = chunk

    def take(self, blocks: Iterable[int]) -> list[Held]:
        """The held chunks one of ``blocks`` belongs to, in order, no longer held."""
        out: list[Held] = []
        for block in blocks:
            held = self._by_block.get(block)
            if held is not None:
                self._remove(held)
                out.append(held)
        return out

    def drop(self, blocks: Iterable[int]) -> None:
        """Forget the held chunks one of ``blocks`` belongs to, unsaved."""
        self.dropped += len(self.take(blocks))

    def clear(self) -> None:
        """Drop every chunk held or taken, unsaved."""
        self.dropped += len(self)
        self._by_block.clear()
        self.taken = []

    def forget(self, req_id: str) -> None:
        """The request has finished (it may never have been scheduled): the chunks it took and whose saves are not
        planned yet are dropped (a save is filed under the request that takes the block)."""
        self._shown.pop(req_id, None)
        kept = [(r, h) for r, h in self.taken if r != req_id]
        self.dropped += len(self.taken) - len(kept)
        self.taken = kept

    def show(self, req_id: str, block_ids: Sequence[Sequence[int]]) -> bool:
        """A request's allocation as ``update_state_after_alloc`` shows it: the held chunks in its blocks are taken.
        False when it came without its blocks (a chain that hides them: no held chunk can be trusted)."""
        ids = [b for group in block_ids for b in group]
        if not ids:
            return False
        self._shown[req_id] = True
        self.taken.extend((req_id, held) for held in self.take(ids))
        return True

    def observe(self, scheduler_output: Any) -> None:
        """The step's other allocations: the new blocks of running requests are taken from; a new request not shown
        with its blocks, and a block vLLM zeroes or copies into before the step runs, drop theirs."""
        rewritten = set(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())
        for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():  # (never with one group)
            rewritten.update(_ints(copy))
        if rewritten:
            self.drop(rewritten)
            kept = [(r, h) for r, h in self.taken if rewritten.isdisjoint(h.blocks)]
            self.dropped += len(self.taken) - len(kept)
            self.taken = kept
        for new in scheduler_output.scheduled_new_reqs:
            ids = [b for group in new.block_ids for b in group]
            if self._shown.pop(new.req_id, False):
                self.taken.extend((new.req_id, held) for held in self.take(ids))
            else:
                self.drop(ids)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if new_ids is not None:
                self.taken.extend((req_id, held) for held in self.take(b for ids in new_ids for b in ids))

    def _remove(self, held: Held) -> None:
        for block in held.blocks:
            if self._by_block.get(block) is held:
                del self._by_block[block]


def _ints(value: Any) -> list[int]:
    """Every int in ``value`` (a block copy of vLLM's scheduler output: ids, pairs or a record of them)."""
    if isinstance(value, int):
        return [value]
    if isinstance(value, list | tuple | set | frozenset):
        return [i for v in value for i in _ints(v)]
    return [i for v in (getattr(value, "__dict__", None) or {}).values() for i in _ints(v)]
