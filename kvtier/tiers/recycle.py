"""Recycled host buffers for tensors that tiers hand out (``get`` results, disk read buffers).

Why: on VMs that hand freed memory back to their host, a fresh allocation of megabytes is first touched at a
fraction of memory speed, so a ``get`` that returns new memory runs far below a copy into warm buffers. A
``Recycler`` keeps the memory of results the caller has dropped and gives it to the next ``take`` of the same
size, already touched.

Lifetime: ``take(n)`` returns a ``uint8`` CPU tensor backed by a numpy array made for that call; the tensor
(and every view of it, ``.numpy()`` included) holds that array. Only when the last of them is gone does a
``weakref.finalize`` on the array put the memory back on the free list, so a buffer is never reused while
anything can still read it. Idle memory is capped (``max_idle_bytes``): beyond it, dropped buffers are freed.
Thread-safe (disk reads take buffers in worker threads; a tensor may die on any thread).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque

import numpy as np
import torch

DEFAULT_MAX_IDLE = 512 << 20


class Recycler:
    """A free list of host buffers by exact size, refilled when the tensors handed out are garbage."""

    def __init__(self, max_idle_bytes: int = DEFAULT_MAX_IDLE) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._free: dict[int, deque[np.ndarray]] = {}
        self._idle = 0
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    @property
    def idle_bytes(self) -> int:
        """Bytes kept for reuse now (not held by any caller)."""
        return self._idle

    def take(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` tensor of ``nbytes`` (contents undefined), reusing dropped memory when possible."""
        if nbytes <= 0:
            return torch.empty(0, dtype=torch.uint8)
        backing: np.ndarray | None = None
        with self._lock:
            stack = self._free.get(nbytes)
            if stack:
                backing = stack.pop()
                self._idle -= nbytes
                self.reused += 1
        if backing is None:
            backing = np.empty(nbytes, dtype=np.uint8)
            self.allocated += 1
        handle = backing[:]  # a new array object per call: its death means every user of this take is gone
        weakref.finalize(handle, self._give, backing).atexit = False
        return torch.from_numpy(handle)

    def _give(self, backing: np.ndarray) -> None:
        nbytes = backing.nbytes
        with self._lock:
            if self._idle + nbytes > self.max_idle_bytes:
                return  # over the cap: let this one be freed
            self._free.setdefault(nbytes, deque()).append(backing)
            self._idle += nbytes

    def clear(self) -> None:
        """Free every idle buffer (buffers still held return to the list later, as usual)."""
        with self._lock:
            self._free.clear()
            self._idle = 0
