"""Recycled receive buffers for the Redis tier's reads.

Touching freshly mapped memory costs a page fault per 4 KiB page (on some VMs as slow as 0.5 GB/s), which is
slower than the network path itself. ``BufferPool.take(n)`` hands out a tensor over a buffer the pool keeps; when
the last tensor, view or storage using it is freed (in whatever thread), the buffer goes back to the pool rather
than to the allocator, so the next read lands in memory that is already mapped. At most ``max_idle_bytes`` wait
in the pool; beyond that, returned buffers are freed normally.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch


class BufferPool:
    """Free lists of byte buffers by exact size; thread-safe (buffers come back from any thread)."""

    def __init__(self, max_idle_bytes: int = 512 << 20) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._idle = 0
        self._lock = threading.RLock()  # re-entrant: a buffer can come back during take() in the same thread
        self._lent: dict[int, tuple[weakref.ref[np.ndarray], np.ndarray]] = {}
        self.reused = 0
        self.allocated = 0

    @property
    def idle_bytes(self) -> int:
        return self._idle

    def take(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 tensor of ``nbytes`` whose memory returns here once it is no longer used."""
        base = None
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                base = free.pop()
                self._idle -= nbytes
                self.reused += 1
        if base is None:
            base = np.empty(nbytes, dtype=np.uint8)
            self.allocated += 1
        view = base[:]  # torch keeps ``view`` alive exactly as long as any storage over it lives
        ref = weakref.ref(view, self._give_back)  # lighter than weakref.finalize (a dict entry, no registry)
        self._lent[id(ref)] = (ref, base)
        return torch.from_numpy(view)

    def _give_back(self, ref: weakref.ref[np.ndarray]) -> None:
        _, base = self._lent.pop(id(ref))
        n = base.nbytes
        with self._lock:
            if self._idle + n <= self.max_idle_bytes:
                self._free.setdefault(n, []).append(base)
                self._idle += n

    def clear(self) -> None:
        """Drop every idle buffer."""
        with self._lock:
            self._free.clear()
            self._idle = 0
