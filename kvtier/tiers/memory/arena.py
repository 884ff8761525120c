"""A slot pool's byte buffer: address space for the whole capacity at once, memory only as slots are used.

Pageable host memory (the cpu tier without CUDA; the gpu tier on the ``cpu`` device in tests) is a private
anonymous mapping of ``capacity`` bytes, advised to use 2 MiB huge pages and placed on a 2 MiB boundary. The
kernel backs a page only when it is first written, and nothing writes a slot before a record is copied into it:
resident memory is at most the high-water mark of the used slots rounded up to 2 MiB (one huge page of slack),
and never more than the capacity rounded up to 2 MiB. Memory of freed slots stays resident for the next record.
``commit(end)`` records that mark (``committed``, for stats). Each page's first write pays its fault inside a
put instead of at start, where touching a whole 16 GiB pool took half a minute; later puts and gets run at the
same speed as into a buffer touched up front (measured on the 2-core CI VM). A first write on a VM is slow
(3-4 ms per MiB there), so the pages just past the mark are backed ahead in the background
(:mod:`kvtier.tiers.memory.prefault`): resident memory may exceed the mark by ``min(mark, 64 MiB)``.

Pinned host memory (page-locked, hence resident by definition) and device memory are allocated whole and
zeroed by ``zero``: there ``committed`` is the capacity from the start.
"""

from __future__ import annotations

import mmap

import torch

from kvtier.tiers.memory.prefault import Prefaulter

HUGE_PAGE = 2 << 20  # the buffer's start and the committed mark are aligned to this


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


class Arena:
    """``nbytes`` of ``uint8`` in ``buf``: reserved and backed on first write (pageable host memory), or allocated
    whole (pinned host memory, device memory). Not thread-safe, like the pool that owns it."""

    def __init__(self, nbytes: int, device: torch.device, pin_memory: bool) -> None:
        self.nbytes = nbytes
        self._mm: mmap.mmap | None = None
        self.prefault: Prefaulter | None = None  # backs pages past the mark ahead of puts (pageable memory)
        if device.type != "cpu" or pin_memory:
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)
            self.committed = nbytes
            return
        # private: anonymous shared memory would be shmem, whose huge pages are usually off
        self._mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # kernels without transparent huge pages
                pass
        whole = torch.frombuffer(self._mm, dtype=torch.uint8)
        lead = -whole.data_ptr() % HUGE_PAGE
        self.buf = whole[lead:lead + nbytes]
        self.committed = 0
        self.prefault = Prefaulter(self.buf)

    @property
    def on_demand(self) -> bool:
        """True when memory is backed as it is written (pageable host memory)."""
        return self._mm is not None

    def zero(self) -> None:
        """Zero a buffer allocated whole (a fresh mapping reads as zeros already and is not touched)."""
        if not self.on_demand:
            self.buf.zero_()

    def commit(self, end: int) -> None:
        """Note that bytes up to ``end`` are about to be written."""
        if end > self.committed:
            self.committed = min(self.nbytes, round_up(end, HUGE_PAGE))
            if self.prefault is not None:
                self.prefault.want(self.committed)

    def close(self) -> None:
        """Drop the buffer; a mapping is unmapped when the last tensor view of it is gone."""
        self._mm = None
        self.committed = 0
        if self.prefault is not None:
            self.prefault.close()
            self.prefault = None
