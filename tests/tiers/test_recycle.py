"""Recycled host buffers: memory returns to the free list only when every user of a buffer is gone."""

from __future__ import annotations

import threading

import torch

from kvtier.tiers.memory.recycle import ALIGN, GROUP_BYTES, GROUP_ITEM_MAX, LINE, PAGE_ALIGNED_FROM, Recycler, Slots


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


def test_take_many_groups_small_items_and_gives_large_ones_their_own_buffer() -> None:
    r = Recycler()
    sizes = [PAGE_ALIGNED_FROM + 100, 1000, GROUP_ITEM_MAX, 3 * PAGE_ALIGNED_FROM]
    places = r.take_many(sizes, lead=40)
    arrays = [a for a, _ in places]
    assert arrays[0] is arrays[1] and arrays[2] is not arrays[1] and arrays[3] is not arrays[2]
    assert [o for _, o in places] == [0, PAGE_ALIGNED_FROM + 100 + (-(PAGE_ALIGNED_FROM + 100) % LINE), 0, 0]
    for (array, offset), size in zip(places, sizes, strict=True):
        assert offset + size <= array.nbytes
        align = ALIGN if size >= PAGE_ALIGNED_FROM else LINE
        assert (array.ctypes.data + offset + 40) % align == 0
    assert r.allocated == 3  # one per group, one per large item
    assert arrays[0].nbytes == 1 << 17  # the group's 66664 bytes, rounded up to a power of two
    assert len(r.take_many([PAGE_ALIGNED_FROM + 100])) == 1 and r.allocated == 4
    del places, arrays
    r.take_many([40_000, 30_000])
    assert r.reused == 1  # a batch of another length reused the group of the same power of two

def test_take_many_starts_a_new_group_when_one_is_full() -> None:
    r = Recycler()
    item = GROUP_BYTES // 16
    places = r.take_many([item] * 33)
    groups = [a for a, _ in places]
    assert all(g is groups[0] for g in groups[:16]) and all(g is groups[16] for g in groups[16:32])
    assert groups[16] is not groups[0] and groups[32] is not groups[16] and groups[32].nbytes == item and groups[0].nbytes == GROUP_BYTES
    assert [o for _, o in places[14:18]] == [14 * item, 15 * item, 0, item]


def test_a_group_is_reused_only_when_every_item_of_it_is_dropped() -> None:
    r = Recycler()
    places = r.take_many([4096] * 4)
    group = places[0][0]
    ptr = group.ctypes.data
    tensors = [torch.from_numpy(a)[o:o + 4096] for a, o in places]
    del places, group
    for i, t in enumerate(tensors):
        t.fill_(i)
    assert [int(t[0]) for t in tensors] == [0, 1, 2, 3]  # the items do not overlap
    kept = tensors[2]
    del tensors, t
    assert r.idle_bytes == 0
    other = r.take_many([4096] * 4)
    assert other[0][0].ctypes.data != ptr
    del kept
    assert r.idle_bytes == 4 * 4096  # the whole group came back, once
    again = r.take_many([4096] * 4)
    assert again[0][0].ctypes.data == ptr and r.idle_bytes == 0


def test_groups_over_a_mebibyte_round_up_to_whole_mebibytes() -> None:
    r = Recycler()
    item = 600 << 10
    assert r.take_many([item] * 3)[0][0].nbytes == 2 << 20  # 1.76 MiB
    assert r.take_many([item] * 5)[0][0].nbytes == 3 << 20  # 2.93 MiB: not the 4 MiB of a power of two
    assert r.take_many([item])[0][0].nbytes == 1 << 20


def test_slots_hold_payloads_of_the_first_size_evenly_spaced_within_the_idle_cap() -> None:
    """``Slots`` (a Redis get): payloads of the first size seen go into evenly spaced slots of one buffer, by
    record index; another size, or slots that would take more than the recycler keeps idle (a header may claim any
    size before its payload is checked), get buffers of their own."""
    recycler = Recycler(1 << 20)
    slots = Slots(recycler, 4)
    first, third, odd = slots.take(0, 8192), slots.take(2, 8192), slots.take(1, 100)
    assert first.untyped_storage().data_ptr() == third.untyped_storage().data_ptr()
    assert third.data_ptr() - first.data_ptr() == 2 * 8192 and first.numel() == third.numel() == 8192
    assert odd.numel() == 100 and odd.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    big = Slots(recycler, 4).take(0, 1 << 20)  # 4 MiB of slots over the 1 MiB cap
    assert big.numel() == 1 << 20 and big.untyped_storage().nbytes() < 2 << 20
