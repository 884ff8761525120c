"""Saves on eviction (``policy.admission: evict``): a computed chunk is saved when the engine is about to write over
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

A chunk that cannot be copied safely is dropped, never saved:

* a block vLLM zeroes before the step runs (``new_block_ids_to_zero``);
* a block of a request whose allocation was not shown with its blocks (a chain that hides them): its bytes may
  already be another connector's load;
* a block held again for another chunk: an allocation this half did not see came in between.

Only requests that loaded nothing from kvtier hold their chunks; the others save at compute time, where a failed
load's recovery (kvtier.connector.scheduler.recovery) covers what they computed on top of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.records.keys import Key


@dataclass(frozen=True)
class Held:
    """A computed chunk of group 0 not saved yet: its key, its parent's key and the blocks that hold it."""

    key: Key
    parent: Key | None
    blocks: tuple[int, ...]


class LazySaves:
    """The held chunks by block id."""

    def __init__(self) -> None:
        self._by_block: dict[int, Held] = {}
        self.dropped = 0  # chunks dropped unsaved (their blocks could not be copied safely)

    def __len__(self) -> int:
        return len({id(h) for h in self._by_block.values()})

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
        """The held chunks one of ``blocks`` belongs to, in order, no longer held: to be saved now."""
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
        self._by_block.clear()

    def _remove(self, held: Held) -> None:
        for block in held.blocks:
            if self._by_block.get(block) is held:
                del self._by_block[block]
