"""Backing an on-demand pool's pages just past its written mark, in the background, before a put writes them.

Why: the first write into a page of fresh anonymous memory pays its page fault, and on a VM that fault is slow:
on the 2-core CI VM (Firecracker, no transparent huge pages) a 16 MiB put into pool memory never written before
took 55 ms, the same put into backed memory 1.5 ms. A cpu tier that keeps filling (a trace with little reuse)
paid that on every save, in the I/O loop while the engine's step waited for the save. A ``Prefaulter`` backs the
next bytes past the mark (at most as many as the mark itself, and at most ``PREFAULT_AHEAD``) in one thread at
the lowest CPU priority (``kvtier.tiers.runtime.background_thread``), so the faults fall into the engine's idle time.

``MADV_POPULATE_WRITE`` (Linux 5.14+) faults pages in writable without writing them: contents never change, so a
put writing the same pages at the same time is safe. Where the call is missing or refused, nothing is backed
ahead (puts fault as before). Resident memory is then at most the written mark plus ``min(mark, 64 MiB)``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import sys
import threading
import weakref
from collections.abc import Callable

import torch

from kvtier.tiers.runtime import background_thread

log = logging.getLogger(__name__)

PREFAULT_AHEAD = 64 << 20  # bytes backed ahead of the written mark, at most
PREFAULT_STEP = 4 << 20  # bytes per call: a close or a new mark is seen between calls
MADV_POPULATE_WRITE = 23
IDLE_CHECK_S = 1.0  # an idle thread checks this often whether its pool is gone
CLOSE_JOIN_S = 2.0  # close() waits this long, at most, for a call in progress to finish

Madvise = Callable[[int, int, int], int]


def populate_call() -> Madvise | None:
    """libc's ``madvise`` (it releases the GIL while the kernel backs pages), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _populate(madvise: Madvise, address: int, length: int) -> bool:
    """Back ``length`` bytes at ``address``; a call interrupted (EINTR, EAGAIN) is tried again, up to 3 times.
    False when the kernel refuses it (then nothing more is backed ahead)."""
    for _ in range(3):
        if madvise(address, length, MADV_POPULATE_WRITE) == 0:
            return True
        code = ctypes.get_errno()
        if code not in (errno.EINTR, errno.EAGAIN):
            break
    log.debug("pool pages are not backed ahead of puts (errno %d)", ctypes.get_errno())
    return False


class Prefaulter:
    """Backs pages of ``buf`` (an on-demand mapping) ahead of the mark ``want`` is told, in a daemon thread
    started on the first ``want``. Thread-safe; ``close`` stops it."""

    def __init__(self, buf: torch.Tensor, ahead: int = PREFAULT_AHEAD) -> None:
        # weak: a pool dropped without close() frees its memory, and the thread then ends; held strongly only
        # during a call, so the mapping stays valid while the kernel backs it
        self._buf: weakref.ReferenceType[torch.Tensor] | None = weakref.ref(buf)
        self._size = buf.numel()
        self.ahead = ahead
        self._cond = threading.Condition()
        self._target = 0  # back bytes up to here
        self.backed = 0  # bytes up to here are backed (or were written by puts)
        self._closed = False
        self._busy = False  # a call is backing pages now
        self._thread: threading.Thread | None = None

    def want(self, mark: int) -> None:
        """Bytes up to ``mark`` are (being) written: back the next ``min(mark, ahead)`` bytes past it."""
        target = min(self._size, mark + min(mark, self.ahead))
        with self._cond:
            if self._closed or target <= self._target:
                return
            self._target = target
            self.backed = max(self.backed, mark)  # below the mark, puts write (and fault) the pages themselves
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvtier-pool-prefault", daemon=True)
                self._thread.start()
            self._cond.notify()

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every page asked for is backed (or backing stopped); True then."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or (not self._busy and self.backed >= self._target),
                                       timeout)

    def _next(self) -> tuple[torch.Tensor, int, int] | None:
        """The next range to back (buffer, start, end), waiting for one; None once closed."""
        with self._cond:
            self._busy = False
            self._cond.notify_all()
            while not self._closed and self.backed >= self._target and self._alive():
                self._cond.wait(IDLE_CHECK_S)
            buf = self._buf() if self._buf is not None else None
            if self._closed or buf is None:
                return None
            start = self.backed
            end = min(self._target, start + PREFAULT_STEP)
            self.backed = end
            self._busy = True
            return buf, start, end

    def _alive(self) -> bool:
        return self._buf is not None and self._buf() is not None

    def _run(self) -> None:
        background_thread()
        madvise = populate_call()
        while madvise is not None:
            step = self._next()
            if step is None:
                break
            buf, start, end = step
            if not _populate(madvise, buf.data_ptr() + start, end - start):
                break
            del buf, step  # hold the pool only during the call
        self.close()

    def close(self) -> None:
        """Stop backing pages and let go of the buffer. Waits up to ``CLOSE_JOIN_S`` for a call in progress, so
        that no thread is inside ``madvise`` when the interpreter exits: a daemon thread that comes back from C
        then is ended by ``pthread_exit``, which can abort the process ("terminate called without an active
        exception")."""
        with self._cond:
            self._closed = True
            self._buf = None
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_JOIN_S)
