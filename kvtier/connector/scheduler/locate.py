"""Where each chunk of a request is, for the scheduler half's lookups: the fastest local tier holding it READY, else
a local tier this scheduler's saves are writing it to, else a shared tier that has it (or that these saves are
writing it to).

A chunk still being written counts: an idle engine runs no step, so the worker report that a write landed
(``InflightSaves.note``) may arrive only with the request that wants the chunk, the first reuse after a pause. Such
a chunk is loaded asynchronously, and the worker's read waits for its own write of it (``SaveQueue.landed``); a
write that fails makes that read a miss, recomputed as any failed load.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from kvtier.connector.scheduler.hits import GroupNeed
from kvtier.connector.scheduler.inflight import InflightSaves
from kvtier.control.directory import Directory, Located
from kvtier.layout import GroupKind
from kvtier.records.keys import Key
from kvtier.tiers.base import Tier
from kvtier.tiers.runtime import LoopThread

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 0.25


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
