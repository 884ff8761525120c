"""The tier contract: one storage medium, async and batched.

Lifecycle: ``tier = make_tier(section)`` -> ``await tier.start()`` (opens files or connections, rebuilds
indexes) -> any number of ``contains`` / ``get`` / ``put`` / ``delete`` -> ``await tier.close()``.

Payloads are contiguous torch tensors (any dtype; a tier may store them as raw bytes and must give back a
tensor of the same dtype, shape and contents). Rules every tier follows:

* Batched calls return one result per key, in order.
* A miss, an unreachable medium, a timeout or a corrupt record is ``None`` from ``get`` / ``False`` from
  ``contains``, never an exception; a corrupt record is also deleted and counted in ``stats().corrupt``.
* ``put`` never exceeds ``capacity_bytes``: an item that does not fit is refused (``False``), not stored.
  Choosing victims is the control plane's job (``kvtier.directory``); the tier only stores and deletes.
* ``entries()`` lists what a local tier already holds at start (disk: rebuilt from headers) so the
  directory can adopt it; shared tiers (Redis) are not enumerated and are asked with ``contains``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.keys import Key

if TYPE_CHECKING:
    import torch


@dataclass
class TierStats:
    """Counters of one tier. Plain ints and floats so they pickle and aggregate."""

    lookups: int = 0
    hits: int = 0
    gets: int = 0
    get_hits: int = 0
    puts: int = 0
    puts_refused: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    deletes: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0
    timeouts: int = 0
    get_seconds: float = 0.0
    put_seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {k: v for k, v in vars(self).items() if k != "extra"}
        out.update(self.extra)
        return out


@dataclass(frozen=True, slots=True)
class TierEntry:
    """A record a local tier already holds at start."""

    key: Key
    size: int


class Tier(ABC):
    """One medium. Subclasses implement the abstract methods; see the module docstring for the rules."""

    #: Memory tiers (gpu, cpu) are fast enough to read synchronously inside a scheduler step.
    is_memory: bool = False
    #: Local tiers are fully known to the directory; shared ones (redis) can change behind our back.
    is_shared: bool = False

    def __init__(self, name: str, capacity_bytes: int) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._stats = TierStats()

    async def start(self) -> None:
        """Open the medium. Default: nothing to do."""

    def entries(self) -> Iterable[TierEntry]:
        """Records already present at start (local persistent tiers). Default: none."""
        return ()

    @abstractmethod
    async def contains(self, keys: Sequence[Key]) -> list[bool]: ...

    @abstractmethod
    async def get(self, keys: Sequence[Key]) -> list[torch.Tensor | None]: ...

    @abstractmethod
    async def put(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]: ...

    @abstractmethod
    async def delete(self, keys: Sequence[Key]) -> int:
        """Delete the records; return how many existed."""

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes this tier holds now (for shared tiers: what this process wrote and did not delete)."""

    def stored_size(self, nbytes: int) -> int:
        """Bytes a payload of ``nbytes`` costs in this tier (slot rounding, record header)."""
        return nbytes

    def stats(self) -> TierStats:
        return self._stats

    async def close(self) -> None:
        """Release the medium. Default: nothing to do."""


class Timer:
    """Adds elapsed wall time to a stats field: ``with Timer(stats, "get_seconds"): ...``."""

    def __init__(self, stats: TierStats, attr: str) -> None:
        self._stats, self._attr = stats, attr
        self._t0 = 0.0

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self._stats, self._attr, getattr(self._stats, self._attr) + time.perf_counter() - self._t0)
