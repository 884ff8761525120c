"""The memory tier (cpu and gpu tiers) over a fixed-size slot pool in one buffer (``SlotPool``, in
:mod:`kvtier.tiers.memory.slots`).

Lifecycle: ``PoolTier(...)`` -> ``await start()`` -> ``put`` / ``get`` / ``get_into`` / ``view`` / ``delete`` /
``pin`` / ``unpin`` -> ``await close()`` (drops the buffer). ``start`` reserves ``capacity`` bytes of address
space; pageable host memory is backed only as records are written into slots (:mod:`kvtier.tiers.memory.arena`:
resident memory is at most the high-water mark of the used slots rounded up to 2 MiB), while pinned host memory
and device memory are allocated whole and zeroed at ``start``.

The pool is split into slots of ``slot_bytes`` (from the config, or the first record stored, rounded up to
4 KiB). A record of n bytes takes ceil(n / slot) slots, contiguous when a run that long is free, several runs
otherwise; one ``copy_`` per run, no per-element work. Used bytes are whole slots, so capacity is never
exceeded. Deleting (or overwriting) a pinned record hides it at once but frees its slots only at the last
``unpin``: a reader holding a ``view`` of it keeps valid bytes. A ``SlotPool`` is not thread-safe; its
``PoolTier`` is: one lock around every call, so the engine's thread borrows and releases records while the I/O
loop writes, reads and deletes others. A borrow waits for the call in progress (a batch's copies: memory speed,
no I/O), at most its caller's bound (the worker's wait bound; ``BORROW_WAIT_S`` when none is given).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Sequence

import torch

from kvtier.control.metrics import Timer
from kvtier.errors import TierUnavailable
from kvtier.records.keys import Key
from kvtier.tiers.base import Tier
from kvtier.tiers.memory.slots import SlotPool

log = logging.getLogger(__name__)

BORROW_WAIT_S = 5.0  # the longest a borrow waits for another thread's call on the pool (then it lends nothing)


def run_in_short_lived_thread(fn: Callable[[], None]) -> None:
    """Run ``fn`` in a thread that exits afterwards, re-raising its exception.

    A parallel torch op (the pool's ``zero_``) gives the thread running it an OpenMP team of its own; on a
    long-lived executor thread that team outlives the call, OpenMP then has more threads than cores and stops
    spin-waiting, and every later small parallel op in the process pays a thread wake-up (measured: paged
    gather/scatter at 32 MiB fell from ~75% to ~40% of a plain copy). A short-lived thread takes its team along.
    """
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=target, name="kvtier-pool-touch")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


class PoolTier(Tier):
    """A memory tier over one ``SlotPool``; the cpu and gpu tiers differ only in device and pinning."""

    is_memory = True

    def __init__(self, name: str, capacity: int, device: str | torch.device, slot_bytes: int | None = None,
                 pin_memory: bool = False) -> None:
        super().__init__(name, capacity)
        self.pool = SlotPool(capacity, device, slot_bytes, pin_memory)
        self._lock = threading.Lock()  # every use of the pool and of the stats (see the module docstring)

    async def start(self) -> None:
        """Reserve the pool (off the event loop: pinned and device pools are allocated whole and zeroed, which
        takes seconds for gigabytes). ``TierUnavailable`` when the host refuses even the address space (a
        capacity above its memory and swap)."""
        try:
            await asyncio.to_thread(run_in_short_lived_thread, self.pool.allocate)
        except OSError as exc:
            raise TierUnavailable(f"tier {self.name!r}: cannot reserve {self.capacity_bytes} bytes of host memory "
                                  f"({exc.strerror or exc}): lower its capacity") from exc
        log.debug("tier %s: %d bytes on %s, pinned=%s", self.name, self.capacity_bytes, self.pool.device,
                  self.pool.pin_memory)

    async def close(self) -> None:
        """Drop every record and the buffer. Idempotent."""
        with self._lock:
            self.pool.release()

    async def contains(self, keys: Sequence[Key]) -> list[bool]:
        with self._lock:
            found = [k in self.pool for k in keys]
            self._stats.lookups += len(found)
            self._stats.hits += sum(found)
        return found

    async def get(self, keys: Sequence[Key]) -> list[torch.Tensor | None]:
        with self._lock, Timer(self._stats, "get_seconds"):
            out = self.pool.get_many(keys)
            self._count_gets([t.numel() * t.element_size() if t is not None else None for t in out])
        return out

    async def get_into(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
        """Copy records into caller buffers (no allocation); False for a miss."""
        with self._lock, Timer(self._stats, "get_seconds"):
            found = self.pool.read_many(items)
            self._count_gets([self.pool.nbytes(k) if ok else None for (k, _), ok in zip(items, found, strict=True)])
        return found

    def _count_gets(self, sizes: Sequence[int | None]) -> None:
        hits = [n for n in sizes if n is not None]
        self._stats.gets += len(sizes)
        self._stats.get_hits += len(hits)
        self._stats.bytes_out += sum(hits)

    async def put(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
        """Store copies; ``puts`` counts stored records, ``puts_refused`` the ones that did not fit."""
        with self._lock:
            with Timer(self._stats, "put_seconds"):
                done = self.pool.put_many(items)
            for (_, t), ok in zip(items, done, strict=True):
                if ok:
                    self._stats.puts += 1
                    self._stats.bytes_in += t.numel() * t.element_size()
                else:
                    self._stats.puts_refused += 1
        return done

    async def delete(self, keys: Sequence[Key]) -> int:
        with self._lock:
            n = sum(self.pool.delete(k) for k in keys)
            self._stats.deletes += n
        return n

    def used_bytes(self) -> int:
        return self.pool.used_bytes()

    def committed_bytes(self) -> int:
        """High-water mark of the pool's memory (see the module docstring); at most ``capacity_bytes``."""
        return self.pool.committed_bytes()

    def stored_size(self, nbytes: int) -> int:
        return self.pool.cost(nbytes)

    def pin(self, keys: Iterable[Key]) -> None:
        """Keep the slots of these keys valid (for ``view`` readers) until ``unpin``."""
        with self._lock:
            self.pool.pin(keys)

    def unpin(self, keys: Iterable[Key]) -> None:
        with self._lock:
            self.pool.unpin(keys)

    def view(self, key: Key) -> torch.Tensor | None:
        """Zero-copy view of a record (see ``SlotPool.view``); pin the key while using it."""
        with self._lock:
            return self.pool.view(key)

    def borrow(self, keys: Sequence[Key], wait_s: float | None = None) -> list[torch.Tensor | None]:
        """Pin every key and return its record without a copy where the pool can lend one: a zero-copy view, a copy
        for a record split over several runs of slots, None for a miss. Counted as gets. Valid until
        ``release(keys)``. Any thread may call it; ``TimeoutError`` (nothing pinned) when another thread's call
        holds the pool past ``wait_s`` (default ``BORROW_WAIT_S``)."""
        wait_s = BORROW_WAIT_S if wait_s is None else wait_s
        if not self._lock.acquire(timeout=wait_s):
            raise TimeoutError(f"tier {self.name!r}: the pool stayed busy past {wait_s:.2f}s")
        try:
            self.pool.pin(keys)
            try:
                values = [self.pool.view(k) for k in keys]
                split = [i for i, v in enumerate(values) if v is None and keys[i] in self.pool]
                for i, value in zip(split, self.pool.get_many([keys[i] for i in split]), strict=True):
                    values[i] = value
                self._count_gets([v.numel() * v.element_size() if v is not None else None for v in values])
            except BaseException:
                self.pool.unpin(keys)
                raise
            return values
        finally:
            self._lock.release()

    def release(self, keys: Sequence[Key]) -> None:
        """End a ``borrow`` of these keys (unpins them). Any thread may call it; it waits for the call in progress
        on the pool, unbounded (a pin must end; a call holds the pool for a batch's copies, at memory speed)."""
        with self._lock:
            self.pool.unpin(keys)
