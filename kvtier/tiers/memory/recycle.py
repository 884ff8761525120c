"""Recycled host buffers for tensors that tiers hand out (``get`` results, disk read buffers).

Why: on VMs that hand freed memory back to their host, a fresh allocation of megabytes is first touched at a
fraction of memory speed, so a ``get`` that returns new memory runs far below a copy into warm buffers. A
``Recycler`` keeps the memory of results the caller has dropped and gives it to the next ``take`` of the same
size, already touched.

Lifetime: ``take(n)`` returns a ``uint8`` CPU tensor backed by a numpy array made for that call; the tensor
(and every view of it, ``.numpy()`` included) holds that array. Only when the last of them is gone does a
weak reference to the array put the memory back on the free list, so a buffer is never reused while
anything can still read it. Idle memory is capped (``max_idle_bytes``): beyond it, dropped buffers are freed.
Thread-safe (disk reads take buffers in worker threads; a tensor may die on any thread).

Alignment: a buffer's byte ``lead`` (0 unless asked) sits on a page boundary (on a 64-byte line for buffers under
64 KiB, so that the slack stays under 1/16 of a buffer). The kernel copies file and socket data into a
destination at 16 bytes past a page (numpy's own alignment) at under half the speed it reaches for an aligned one
(measured: 32 MiB page-cache reads 2.5x slower), and the tensor built on the payload starts aligned. The idle cap
counts the bytes asked for, not that slack.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.records.codec import slot_aligned

DEFAULT_MAX_IDLE = 512 << 20
ALIGN = 4096  # buffers of PAGE_ALIGNED_FROM bytes and more; smaller ones: LINE
LINE = 64
PAGE_ALIGNED_FROM = 64 << 10
GROUP_BYTES = 8 << 20  # ``take_many``: small items of one call share buffers of up to this size
GROUP_ITEM_MAX = 1 << 20  # ``take_many``: items of this size and more get a buffer each


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to its buffer size class: a power of two up to 1 MiB, whole MiB above. Buffers of
    varying sizes taken by class reuse each other's memory (the free lists hold exact sizes)."""
    mib = GROUP_ITEM_MAX
    return 1 << (nbytes - 1).bit_length() if nbytes <= mib else -(-nbytes // mib) * mib


def _align_of(nbytes: int) -> int:
    return ALIGN if nbytes >= PAGE_ALIGNED_FROM else LINE


class Recycler:
    """A free list of host buffers by exact size, refilled when the tensors handed out are garbage."""

    def __init__(self, max_idle_bytes: int = DEFAULT_MAX_IDLE) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._free: dict[int, deque[tuple[np.ndarray, int]]] = {}  # size -> (backing, its address)
        # handed out, not yet dead: id(weak reference to the handle) -> (that reference, backing, address, size)
        self._out: dict[int, tuple[weakref.ref[np.ndarray], np.ndarray, int, int]] = {}
        self._idle = 0
        # re-entrant: a buffer's last user may die (and ``_returned`` run) inside a garbage collection that an
        # allocation made while this thread already holds the lock
        self._lock = threading.RLock()
        self.reused = 0
        self.allocated = 0

    @property
    def idle_bytes(self) -> int:
        """Bytes kept for reuse now (not held by any caller), counted as asked for (alignment slack aside)."""
        return self._idle

    def take(self, nbytes: int, lead: int = 0) -> torch.Tensor:
        """A ``uint8`` tensor of ``nbytes`` (contents undefined) whose byte ``lead`` is aligned (module
        docstring), reusing dropped memory when possible."""
        if nbytes <= 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_numpy(self.take_array(nbytes, lead))

    def take_array(self, nbytes: int, lead: int = 0) -> np.ndarray:
        """``take`` as a numpy ``uint8`` array (the same lifetime rule: reused once it and its views are gone)."""
        if nbytes <= 0:
            return np.empty(0, dtype=np.uint8)
        found: tuple[np.ndarray, int] | None = None
        with self._lock:
            stack = self._free.get(nbytes)
            if stack:
                found = stack.pop()
                self._idle -= nbytes
                self.reused += 1
        align = _align_of(nbytes)
        if found is None:
            backing = np.empty(nbytes + align, dtype=np.uint8)  # room to place ``lead`` on a boundary
            found = (backing, backing.ctypes.data)
            self.allocated += 1
        backing, address = found
        start = -(address + lead) % align
        # a new array object per call: its death means every user of this take is gone
        handle = backing[start:start + nbytes]
        ref = weakref.ref(handle, self._returned)
        self._out[id(ref)] = (ref, backing, address, nbytes)
        return handle

    def take_many(self, sizes: Sequence[int], lead: int = 0) -> list[tuple[np.ndarray, int]]:
        """Buffers for a batch: for each size, ``(array, offset)`` where bytes ``offset .. offset + size`` of the
        ``uint8`` array are that item's, byte ``offset + lead`` aligned as ``take`` aligns a buffer of that size.

        Consecutive items under ``GROUP_ITEM_MAX`` share one array of up to ``GROUP_BYTES`` (each at a multiple of
        its alignment), so a batch of small results costs one take per group instead of one per item (at 256 KiB
        records, per-item takes and views were a third of a memory tier's ``get``). A group's array has a size
        class (a power of two up to 1 MiB, whole MiB above), so that batches of different lengths reuse each
        other's memory. The lifetime rule is the array's: a group's memory is reused once every item of it (and
        every view) is gone, so a caller that keeps one small result keeps its group's memory (at most
        ``GROUP_BYTES``).
        """
        out: list[tuple[np.ndarray, int]] = []
        group: list[int] = []  # offsets of the open group's items
        end = 0

        def close_group() -> None:
            if group:
                # a size class (a power of two up to 1 MiB, whole MiB above): batches of different lengths then
                # reuse each other's memory, and a group wastes at most half of itself, or 1 MiB
                array = self.take_array(size_class(end), lead)
                out.extend((array, offset) for offset in group)
                group.clear()

        for nbytes in sizes:
            if nbytes >= GROUP_ITEM_MAX or nbytes <= 0:
                close_group()
                end = 0
                out.append((self.take_array(nbytes, lead), 0))
                continue
            align = _align_of(nbytes)
            offset = -(-end // align) * align
            if group and offset + nbytes > GROUP_BYTES:
                close_group()
                offset = 0
            group.append(offset)
            end = offset + nbytes
        close_group()
        return out

    def take_slots(self, count: int, nbytes: int) -> list[tuple[torch.Tensor, int, int]]:
        """Room for ``count`` payloads of ``nbytes`` each, evenly spaced in one page-aligned ``uint8`` tensor (one
        storage), as records lie in consecutive memory slots: ``(tensor, offset, nbytes)`` each,
        ``slot_aligned(nbytes)`` bytes apart. A reader writes at most ``nbytes`` into a slot: more would overwrite
        the next payload. The memory has a size class (``size_class``) and is reused once every view of it is
        gone."""
        stride = slot_aligned(nbytes)
        memory = torch.from_numpy(self.take_array(size_class(count * stride)))
        return [(memory, i * stride, nbytes) for i in range(count)]

    def _returned(self, ref: weakref.ref[np.ndarray]) -> None:
        _, backing, address, nbytes = self._out.pop(id(ref))
        entry, fresh = (backing, address), deque[tuple[np.ndarray, int]]()  # allocated before taking the lock
        with self._lock:
            if self._idle + nbytes > self.max_idle_bytes:
                return  # over the cap: let this one be freed
            self._free.setdefault(nbytes, fresh).append(entry)
            self._idle += nbytes

    def clear(self) -> None:
        """Free every idle buffer (buffers still held return to the list later, as usual)."""
        with self._lock:
            self._free.clear()
            self._idle = 0


class Slots:
    """Rooms for the payloads of one batch read whose sizes show only as each record arrives (a Redis get): the
    first payload's size takes ``count`` evenly spaced slots of one buffer (``Recycler.take_slots``), and the
    payload of record ``i`` of exactly that size goes into slot ``i``; a payload of another size gets a buffer of
    its own, and so does every payload where the slots would take more than the recycler keeps idle (a record's
    header, unchecked until its payload is, could claim any size). For one event loop's coroutines (no lock)."""

    def __init__(self, recycler: Recycler, count: int) -> None:
        self._recycler, self._count = recycler, count
        self._size = -1
        self._slots: list[tuple[torch.Tensor, int, int]] = []

    def take(self, i: int, nbytes: int) -> torch.Tensor:
        """A ``uint8`` tensor of ``nbytes`` for record ``i``'s payload."""
        if self._size < 0 and self._count > 1 and nbytes > 0:
            self._size = nbytes
            if self._count * slot_aligned(nbytes) <= self._recycler.max_idle_bytes:
                self._slots = self._recycler.take_slots(self._count, nbytes)
        if nbytes != self._size or not 0 <= i < len(self._slots):
            return self._recycler.take(nbytes)
        memory, offset, _ = self._slots[i]
        return memory[offset:offset + nbytes]
