"""Recycled host buffers: memory returns to the free list only when every user of a buffer is gone."""

from __future__ import annotations

import threading

import torch

from kvtier.tiers.recycle import ALIGN, LINE, PAGE_ALIGNED_FROM, Recycler


def test_memory_is_reused_only_after_every_view_is_dropped() -> None:
    r = Recycler()
    t = r.take(1 << 16)
    ptr = t.data_ptr()
    view = t[100:].view(torch.int16)
    array = t[:10].numpy()
    del t
    assert r.idle_bytes == 0
    other = r.take(1 << 16)
    assert other.data_ptr() != ptr  # still held through the view and the numpy array
    del view
    assert r.idle_bytes == 0
    del array
    assert r.idle_bytes == 1 << 16
    again = r.take(1 << 16)
    assert again.data_ptr() == ptr and r.idle_bytes == 0
    assert (r.reused, r.allocated) == (1, 2)


def test_sizes_are_kept_apart_and_idle_memory_is_capped() -> None:
    r = Recycler(max_idle_bytes=3 << 12)
    bufs = [r.take(1 << 12) for _ in range(5)]
    small = r.take(100)
    del bufs
    assert r.idle_bytes == 3 << 12  # two of the five were freed, over the cap
    assert r.take(100).data_ptr() != small.data_ptr()
    assert r.take(1 << 12).numel() == 1 << 12 and r.reused == 1
    r.clear()
    assert r.idle_bytes == 0
    assert r.take(0).numel() == 0


def test_threads_never_share_a_buffer() -> None:
    r = Recycler()
    seen: list[int] = []
    errors: list[str] = []

    def work(tag: int) -> None:
        for _ in range(200):
            t = r.take(4096)
            t.fill_(tag)
            seen.append(t.data_ptr())
            if int(t.min()) != tag or int(t.max()) != tag:
                errors.append("buffer shared between threads")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and r.reused > 0


def test_byte_lead_is_aligned_also_when_reused() -> None:
    r = Recycler()
    for size, align in ((PAGE_ALIGNED_FROM, ALIGN), (10_000, LINE)):
        for lead in (0, 108, 140, 4095):
            t = r.take(size, lead=lead)
            assert (t.data_ptr() + lead) % align == 0
            assert t.numel() == size
            del t
    assert r.reused == 6 and r.allocated == 2  # one backing buffer per size served every lead


def test_an_exactly_full_cap_keeps_every_buffer() -> None:
    """The cap counts the bytes asked for: a pool's results adding up to its capacity all come back."""
    r = Recycler(max_idle_bytes=8 << 20)
    bufs = [r.take(1 << 20) for _ in range(8)]
    del bufs
    assert r.idle_bytes == 8 << 20
    again = [r.take(1 << 20) for _ in range(8)]
    assert r.allocated == 8 and r.reused == 8 and len(again) == 8
