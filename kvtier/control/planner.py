"""The write/placement policy: which tiers a batch of chunks goes to. ``place``, used by the single-process store
(``TieredStore.put``) and by the connector's scheduler half; ``promote`` for chunks read from slower tiers.

* write-back: the first tier of the chain, its victims demoted down the chain; chunks it cannot take (too large,
  or its room is pending writes) go to the next tier instead, and so on down the chain.
* write-through: every tier of the chain.

A chunk no tier of the chain takes is returned in ``Placement.unplaced`` (and counted by the directory as
``unplaced``), never dropped silently. Chunks a tier already holds, ready or with a write in flight, are not
planned again, for it or (write-back) for any tier after it. The directory does not track shared tiers (other
processes write and evict there): ``without_known`` takes out of the plans the chunks a lookup just found in one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from kvtier.config import WritePolicy
from kvtier.control.directory import Directory, StorePlan
from kvtier.records.keys import Key

# (key, payload bytes, parent key) of one chunk to place
Entry = tuple[Key, int, Key | None]


@dataclass(frozen=True)
class Placement:
    """Store plans in execution order, and the chunks no tier of the chain took."""

    plans: list[StorePlan]
    unplaced: list[Key]


def place(directory: Directory, chain: Sequence[str], entries: Sequence[Entry], write: WritePolicy,
          stored_size: Callable[[str, int], int]) -> Placement:
    """Plan ``entries`` into ``chain`` following ``write``; ``stored_size(tier, nbytes)`` is a record's cost there."""
    if write is WritePolicy.WRITE_BACK:
        plans, left = _write_back(directory, list(chain), list(entries), stored_size)
    else:
        plans, left = _write_through(directory, list(chain), list(entries), stored_size)
    directory.count_unplaced(len(left))
    return Placement(plans, left)


def promote(directory: Directory, chain: Sequence[str], entries: Sequence[Entry],
            stored_size: Callable[[str, int], int]) -> list[StorePlan]:
    """Plans copying chunks read from slower tiers into the first tier of ``chain``, its victims demoted down the
    chain; a chunk the first tier refuses is not planned anywhere (it stays where it was read from)."""
    if not chain:
        return []
    return directory.prepare_store(chain[0], _sized(chain[0], entries, stored_size), list(chain[1:]))


def _sized(tier: str, entries: Sequence[Entry], stored_size: Callable[[str, int], int]) -> list[Entry]:
    return [(k, stored_size(tier, n), p) for k, n, p in entries]


def _write_back(directory: Directory, chain: list[str], entries: list[Entry],
                stored_size: Callable[[str, int], int]) -> tuple[list[StorePlan], list[Key]]:
    plans: list[StorePlan] = []
    for i, tier in enumerate(chain):
        if not entries:
            break
        made = directory.prepare_store(tier, _sized(tier, entries, stored_size), chain[i + 1:])
        plans.extend(made)
        taken = {k for p in made if p.tier == tier and p.source is None for k in p.store}
        entries = [e for e in entries if e[0] not in taken and not directory.holds(tier, e[0])]
    return plans, [k for k, _, _ in entries]


def _write_through(directory: Directory, chain: list[str], entries: list[Entry],
                   stored_size: Callable[[str, int], int]) -> tuple[list[StorePlan], list[Key]]:
    plans: list[StorePlan] = []
    placed: set[Key] = set()
    for tier in chain:
        made = directory.prepare_store(tier, _sized(tier, entries, stored_size))
        plans.extend(made)
        placed.update(k for p in made if p.tier == tier for k in p.store)
        placed.update(k for k, _, _ in entries if directory.holds(tier, k))
    return plans, [k for k, _, _ in entries if k not in placed]


def without_known(plans: Sequence[StorePlan], known: Collection[tuple[str, Key]]) -> list[StorePlan]:
    """``plans`` without storing the keys a shared tier is known to hold (``(tier, key)`` pairs: a lookup just
    found them there); writing them again would cost the engine a copy and the medium a write for nothing. Only
    pairs of shared tiers belong in ``known``: their plans reserve nothing in the directory, so a key taken out
    leaves nothing pending."""
    if not known:
        return list(plans)
    out: list[StorePlan] = []
    for plan in plans:
        store = tuple(k for k in plan.store if (plan.tier, k) not in known)
        if store or plan.evicted:
            out.append(plan if len(store) == len(plan.store) else replace(plan, store=store))
    return out
