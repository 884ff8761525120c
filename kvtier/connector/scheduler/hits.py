"""Where a request's chunks are, and how many of them every KV-cache group can restore: the request's hit.

Where (``Locator``, the scheduler half's lookups): the fastest local tier holding a chunk READY, else a local tier
this scheduler's saves are writing it to, else a shared tier that has it (or that these saves are writing it to).
A chunk still being written counts: an idle engine runs no step, so the worker report that a write landed
(``InflightSaves.note``) may arrive only with the request that wants the chunk, the first reuse after a pause. Such
a chunk is loaded asynchronously, and the worker's read waits for its own write of it (``SaveQueue.landed``); a
write that fails makes that read a miss, recomputed as any failed load.

How many (the hit rule, pure logic). A hit of ``n`` chunks means the engine skips the first ``n * chunk_size``
tokens. What each group must find in the tiers for that:

* full attention, MLA: every chunk ``0 .. n-1``;
* sliding window (``w`` tokens): only the chunks covering the ``w - 1`` tokens before the hit point, since the
  first computed token attends to nothing older; earlier chunks may be missing;
* Mamba / linear attention: its recurrent state at the hit point, stored with chunk ``n - 1`` (a state is valid
  only at its exact boundary: a shorter hit cannot be cut out of a longer one). A state without its attention
  prefix is useless, and the reverse: the hit is the longest boundary where every group has what it needs.

The request's hit is the largest ``n`` every group accepts, at most ``limit`` (which keeps at least one token
to compute).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.connector.scheduler.inflight import InflightSaves
from kvtier.control.directory import Directory, Located
from kvtier.layout import UNSERVED, GroupKind
from kvtier.records.keys import Key
from kvtier.tiers.base import Tier
from kvtier.tiers.runtime import LoopThread

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 0.25


@dataclass(frozen=True)
class GroupNeed:
    """What one group needs restored: its kind and, for sliding window, the window in tokens."""

    kind: GroupKind
    sliding_window: int = 0

    def needed(self, n: int, chunk_size: int) -> range:
        """Chunk indices that must be loaded for a hit of ``n`` chunks."""
        if n <= 0 or self.kind in UNSERVED:
            return range(0)
        if self.kind is GroupKind.SLIDING_WINDOW:
            first_token = max(0, n * chunk_size - (self.sliding_window - 1))
            return range(first_token // chunk_size, n)
        if self.kind is GroupKind.MAMBA:
            return range(n - 1, n)
        return range(n)

    def accepts(self, n: int, present: Sequence[bool], chunk_size: int) -> bool:
        """True when a hit of ``n`` chunks is restorable given which chunks are ``present``."""
        if n == 0:
            return True
        if self.kind in UNSERVED:
            return False
        return all(i < len(present) and present[i] for i in self.needed(n, chunk_size))


def hit_limit(num_tokens: int, chunk_size: int) -> int:
    """Most chunks a request may hit: never the whole prompt, at least one token is computed."""
    if num_tokens <= 1:
        return 0
    return (num_tokens - 1) // chunk_size


def best_hit(needs: Sequence[GroupNeed], present: Sequence[Sequence[bool]], chunk_size: int,
             limit: int) -> int:
    """Largest ``n <= limit`` chunks every group can restore (``present[g][i]``: chunk ``i`` of group ``g``)."""
    upper = limit
    windowed: list[tuple[GroupNeed, Sequence[bool]]] = []
    for need, pres in zip(needs, present, strict=True):
        if need.kind in UNSERVED:
            return 0
        if need.kind in (GroupKind.SLIDING_WINDOW, GroupKind.MAMBA):
            windowed.append((need, pres))
        else:
            upper = min(upper, _prefix(pres))
    for n in range(upper, 0, -1):
        if all(need.accepts(n, pres, chunk_size) for need, pres in windowed):
            return n
    return 0


def _prefix(present: Sequence[bool]) -> int:
    n = 0
    while n < len(present) and present[n]:
        n += 1
    return n


class Locator:
    """Answers where chunks are, over the directory of the local tiers, the in-flight saves and the shared tiers."""

    def __init__(self, directory: Directory, inflight: InflightSaves, placement: Sequence[Sequence[str]],
                 needs: Sequence[GroupNeed], tiers: Mapping[str, Tier], loop: LoopThread | None) -> None:
        self._directory = directory
        self._inflight = inflight
        self._placement = [tuple(p) for p in placement]
        self._needs = list(needs)
        self._tiers = tiers
        self._loop = loop

    def locate(self, group: int, keys: Sequence[Key], count: bool = False) -> Located:
        """Where each key of ``group`` is (kvtier.control.directory.Directory.locate over the local tiers, then the
        shared ones). Without shared tiers, a group that needs a whole prefix (not sliding window, not recurrent
        state) stops at the first chunk no tier holds: the chunks past it cannot be part of a hit (they stay
        None). ``count``: count the lookup in the directory's stats."""
        directory, inflight = self._directory, self._inflight
        local = [n for n in self._placement[group] if not directory.is_shared(n)]
        shared = [n for n in self._placement[group] if directory.is_shared(n)]
        whole = bool(shared) or self._needs[group].kind not in (GroupKind.FULL_ATTENTION, GroupKind.MLA)
        found = directory.locate(keys, local, whole=whole, writing=inflight.writing, count=count)
        out, writing = found.tiers, set(found.writing)
        for name in shared:
            missing = [i for i, loc in enumerate(out) if loc is None]
            if not missing:
                break
            for i, ok in zip(missing, self._shared_contains(name, [keys[i] for i in missing]), strict=True):
                if ok or inflight.writing(name, keys[i]):
                    out[i] = name
                    if not ok:
                        writing.add(i)
        return Located(out, frozenset(writing))

    def _shared_contains(self, tier: str, keys: list[Key]) -> list[bool]:
        if self._loop is None:
            return [False] * len(keys)

        async def ask() -> list[bool]:
            return await asyncio.wait_for(self._tiers[tier].contains(keys), LOOKUP_TIMEOUT_S)

        try:
            return self._loop.run(ask(), timeout=LOOKUP_TIMEOUT_S * 2)
        except Exception as exc:  # a slow or dead shared tier is a miss, never an engine failure
            logger.debug("lookup in shared tier %s failed: %r", tier, exc)
            return [False] * len(keys)
