"""Persisting write-back chunks: copies of what only a memory tier holds, into the persistent tier below it, so that
a restart finds them: the plans (control plane, no tensors) and the one-process routine ``persist_memory``.

Under ``write_back`` a chunk lives in the first tier of its placement until it is demoted, so the chunks worth
keeping, the hot ones, are only in memory when the engine stops. kvtier copies them, without taking them out of
memory, into the first local persistent tier after the memory tier in the chain (disk):

* the directory reserves the copy like any write (``prepare_store``: its bytes counted, victims chosen by the disk
  tier's policy and demoted down the chain), so every tier stays within its capacity and placement never plans
  the chunk again (``Directory.holds``). The chunk then lives in both tiers, as a promoted one does: lookups take
  the memory copy, and when memory evicts it the demotion finds it on disk and writes nothing;
* the copy is a store plan whose ``source`` is the memory tier, run by whoever holds the bytes:
  ``TieredStore.persist`` (one process: at close), or the connector's worker (kvtier.connector.worker.persisting: while
  the engine is idle, and at shutdown) as planned by its scheduler (kvtier.connector.scheduler.persist_plans).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvtier.config import PolicyConfig, WritePolicy
from kvtier.control.directory import Directory, StorePlan
from kvtier.records.keys import Key

if TYPE_CHECKING:
    from kvtier.store.tiered import TieredStore

logger = logging.getLogger(__name__)


def enabled(policy: PolicyConfig) -> bool:
    """Whether a connector persists memory chunks (write-back, and while idle or at close)."""
    return policy.write is WritePolicy.WRITE_BACK and (policy.persist_after_idle > 0 or policy.persist_at_close > 0)


def copy_target(chain: Sequence[str], tier: str, persistent: Callable[[str], bool]) -> tuple[str, list[str]] | None:
    """Where chunks ``tier`` holds are persisted: the first tier after it in ``chain`` that ``persistent`` accepts
    (a local tier that survives the process), with the chain below that one; None when there is none."""
    if tier not in chain:
        return None
    below = list(chain[list(chain).index(tier) + 1:])
    for i, name in enumerate(below):
        if persistent(name):
            return name, below[i + 1:]
    return None


def plan_copies(directory: Directory, source: str, target: str, below: Sequence[str],
                entries: Sequence[tuple[Key, int, Key | None]]) -> list[StorePlan]:
    """Reserve copies of ``entries`` (key, size in ``target``, parent) of ``source`` in ``target`` (victims demoted
    into ``below``); the plans in execution order, the copy itself as a move from ``source``. Keys ``target``
    already holds are skipped; keys that do not fit are left out."""
    plans = directory.prepare_store(target, list(entries), list(below))
    return [StorePlan(p.tier, p.store, p.evicted, source) if p.tier == target and p.source is None else p
            for p in plans]



PERSIST_BATCH = 64  # chunks read and written per round of ``persist_memory`` (the budget is checked between rounds)


async def persist_memory(store: TieredStore, budget_s: float, clock: Callable[[], float] = time.monotonic) -> int:
    """Copy the READY chunks each memory tier of ``store`` (one holding its directory) alone holds into the first
    persistent local tier after it, in the order they were stored, until all are copied or ``budget_s`` has passed
    (a round already started finishes: at most ``PERSIST_BATCH`` chunks past it); return how many were copied."""
    deadline, copied = clock() + budget_s, 0
    directory, order = store.directory, store.tier_names
    for name in order:
        target = copy_target(order, name, lambda n: _persistent(store, n)) if store.tier(name).is_memory else None
        if target is None:
            continue
        keys = [k for k in directory.ready_keys(name) if not directory.holds(target[0], k)]
        for i in range(0, len(keys), PERSIST_BATCH):
            if clock() >= deadline:
                left = len(keys) - i
                logger.warning("tier %s: %d chunk(s) not persisted to %s: the %.1fs budget ran out (%d copied)",
                               name, left, target[0], budget_s, copied)
                return copied
            copied += await _copy_round(store, name, target, keys[i:i + PERSIST_BATCH])
    return copied


def _persistent(store: TieredStore, name: str) -> bool:
    tier = store.tier(name)
    return not tier.is_memory and not tier.is_shared


async def _copy_round(store: TieredStore, source: str, target: tuple[str, list[str]], keys: list[Key]) -> int:
    """Read ``keys`` from ``source`` (pinned meanwhile) and store them in the target through the directory."""
    directory = store.directory
    directory.pin(source, keys)
    try:
        values = await store.read(source, keys)
    finally:
        directory.unpin(source, keys)
    items = {k: v for k, v in zip(keys, values, strict=True) if v is not None}
    name, below = target
    size = store.tier(name).stored_size
    entries = [(k, size(v.numel() * v.element_size()), directory.parent(source, k)) for k, v in items.items()]
    plans = directory.prepare_store(name, entries, below)
    return (await store.execute(plans, items)).get(name, 0)
