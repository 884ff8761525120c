"""The tier contract: one storage medium, async and batched.

Lifecycle: ``tier = make_tier(section)`` -> ``await tier.start()`` (opens files or connections, rebuilds
indexes) -> any number of ``contains`` / ``get`` / ``put`` / ``delete`` -> ``await tier.close()``.

Payloads are contiguous torch tensors (any dtype; a tier may store them as raw bytes and must give back a
tensor of the same dtype, shape and contents). Rules every tier follows:

* Batched calls return one result per key, in order.
* A miss, an unreachable medium, a timeout or a corrupt record is ``None`` from ``get`` / ``False`` from
  ``contains``, never an exception; a corrupt record is also deleted and counted in ``stats().corrupt``.
* A tier counts its own operations in its ``stats()`` (``kvtier.control.metrics.TierStats``, or the subclass of its
  kind); evictions the directory chose are deletes there, never tier evictions.
* ``put`` never exceeds ``capacity_bytes``: an item that does not fit is refused (``False``), not stored.
  Shared tiers are the exception: Redis memory belongs to the server (``maxmemory`` + ``allkeys-lru``), so
  the Redis tier only reports the bytes it wrote and refuses just a record larger than its whole capacity.
  Choosing victims is the control plane's job (``kvtier.control.directory``); the tier only stores and deletes.
* ``get_into`` copies records into caller buffers instead of returning new tensors (default: ``get`` + copy;
  memory tiers copy straight from their pool). Memory tiers also lend pinned zero-copy views (``Borrowing``).
* ``entries()`` lists what a local tier already holds at start (disk: rebuilt from headers) so the
  directory can adopt it; shared tiers (Redis) are not enumerated and are asked with ``contains``.
* ``describe(manifests)``: the connector names, once, the namespaces (digest -> kvtier.tiers.manifest dict) this
  process serves. A tier several processes share (disk) takes them as its own: ``entries()`` lists only
  those, it evicts only those, and writes their manifests. Default: nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvtier.control.metrics import TierStats
from kvtier.records.keys import Key

if TYPE_CHECKING:
    import torch


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
    #: Records expire unless written again (a Redis tier with a ``ttl``): a hit does not spare their rewrite.
    expiring: bool = False

    def __init__(self, name: str, capacity_bytes: int) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._stats = TierStats()

    async def start(self) -> None:
        """Open the medium. Default: nothing to do."""

    async def list_entries(self) -> None:
        """Read what the medium already holds, for ``entries()``: called after ``start`` only where a directory
        adopts it (the scheduler, a one-process store), never on a worker. Default: nothing to do (the disk tier
        reads its records in ``start``, which its quota needs anyway)."""

    def entries(self) -> Iterable[TierEntry]:
        """Records already present at start (local persistent tiers). Default: none."""
        return ()

    def describe(self, manifests: Mapping[bytes, Mapping[str, Any]]) -> Awaitable[None] | None:
        """The namespaces this process serves: 16-byte digest -> manifest (kvtier.tiers.manifest), once, before or
        after ``start``, on the tier's event loop. A tier may do it synchronously or as a coroutine (callers
        await what it returns, if anything). Default: nothing to do."""
        return None

    @abstractmethod
    async def contains(self, keys: Sequence[Key]) -> list[bool]: ...

    @abstractmethod
    async def get(self, keys: Sequence[Key]) -> list[torch.Tensor | None]: ...

    async def get_into(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
        """Copy each record's bytes into its buffer (contiguous, the record's byte size); False for a miss.
        A buffer of another byte size raises ``ValueError``. Default: ``get``, then one copy per record."""
        values = await self.get([k for k, _ in items])
        return [copy_bytes(value, out) for (_, out), value in zip(items, values, strict=True)]

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


@runtime_checkable
class Borrowing(Protocol):
    """A tier that lends its records without a copy (memory tiers), to any thread: ``borrow`` pins the keys and
    returns zero-copy views (a copy where a record cannot be viewed whole, None for a miss); they stay valid until
    ``release``."""

    def borrow(self, keys: Sequence[Key], wait_s: float | None = None) -> list[torch.Tensor | None]: ...

    def release(self, keys: Sequence[Key]) -> None: ...


def copy_bytes(value: torch.Tensor | None, out: torch.Tensor) -> bool:
    """Copy ``value``'s bytes into ``out`` (same byte size, else ``ValueError``); False when ``value`` is None."""
    if value is None:
        return False
    import torch

    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    src = value.contiguous().reshape(-1).view(torch.uint8)
    dst = out.reshape(-1).view(torch.uint8)
    if dst.numel() != src.numel():
        raise ValueError(f"out has {dst.numel()} bytes, the record {src.numel()}")
    dst.copy_(src)
    return True
