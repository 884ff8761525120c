"""What the scheduler half ships to the workers each step: plain, picklable plans (no tensors, no handles).

Block ids are per KV-cache group, one tuple per chunk in token order; ``NULL_BLOCK`` (0) marks a block the
worker must leave alone (an out-of-window sliding-window block, or one the engine already holds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from kvtier.connector.base import KVConnectorMetadata
from kvtier.control.directory import StorePlan
from kvtier.layout.geometry import NULL_BLOCK
from kvtier.records.keys import Key


@dataclass(frozen=True)
class LoadSpec:
    """Read ``keys`` of ``group`` from ``tier`` and scatter chunk ``i`` into ``block_ids[i]``."""

    req_id: str
    group: int
    tier: str
    keys: tuple[Key, ...]
    block_ids: tuple[tuple[int, ...], ...]
    is_async: bool = False


@dataclass(frozen=True)
class SaveSpec:
    """Gather chunk ``i`` of ``group`` from ``block_ids[i]`` and run ``plans`` (evict / demote, then write)."""

    req_id: str
    group: int
    keys: tuple[Key, ...]
    block_ids: tuple[tuple[int, ...], ...]
    plans: tuple[StorePlan, ...]
    evicted: bool = False  # chunks the step's allocations take (kvtier.connector.scheduler.lazy): copied when bound

    def stored_keys(self) -> list[tuple[str, Key]]:
        """(tier, key) of every record the plans create, demotions included."""
        return [(p.tier, k) for p in self.plans for k in p.store]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """One step's plan: loads (sync ones before the forward pass, async ones in the background) and saves."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    idle: bool = False  # the step computes no token: workers may block on pending async loads (see WorkerHalf)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves)


def block_at(ids: Sequence[int], j: int) -> int:
    """The ``j``-th block id of a group's list, or the null block past its end."""
    return ids[j] if j < len(ids) else NULL_BLOCK


def chunk_blocks(block_ids: Sequence[Sequence[int]], group: int, chunk: int, per_chunk: int) -> tuple[int, ...] | None:
    """Block ids of one chunk of a group, or None when any is missing or null (not savable)."""
    if group >= len(block_ids):
        return None
    ids = tuple(block_ids[group][chunk * per_chunk:(chunk + 1) * per_chunk])
    if len(ids) < per_chunk or NULL_BLOCK in ids:
        return None
    return ids


@dataclass
class PersistingMetadata(KVTierMetadata):
    """A step's plans (``KVTierMetadata``) and its persisting plans: copies of memory chunks (``source`` a memory
    tier) and the demotions of their victims, in execution order."""

    persists: list[StorePlan] = field(default_factory=list)

    @classmethod
    def of(cls, meta: KVTierMetadata, persists: list[StorePlan]) -> PersistingMetadata:
        return cls(**{f.name: getattr(meta, f.name) for f in fields(meta)}, persists=persists)

    def is_empty(self) -> bool:
        return super().is_empty() and not self.persists


def persists_of(meta: object) -> list[StorePlan]:
    """The persisting plans a step's metadata carries (none in plain ``KVTierMetadata``)."""
    return list(meta.persists) if isinstance(meta, PersistingMetadata) else []
