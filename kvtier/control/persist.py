"""Persisting write-back chunks: copies of what only a memory tier holds, into the persistent tier below it, so that
a restart finds them: the plans (control plane, no tensors). The copies run where the bytes are:
``TieredStore.persist`` (one process, kvtier.store.tiered) or the connector's worker.

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

from collections.abc import Callable, Sequence

from kvtier.config import PolicyConfig, WritePolicy
from kvtier.control.directory import Directory, StorePlan
from kvtier.records.keys import Key


def enabled(policy: PolicyConfig) -> bool:
    """Whether a connector persists memory chunks (write-back, and while idle, within a lag, or at close)."""
    return policy.write is WritePolicy.WRITE_BACK and (
        policy.persist_after_idle > 0 or policy.persist_max_lag > 0 or policy.persist_at_close > 0)


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
