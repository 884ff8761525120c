"""The write/placement policy (kvtier.control.planner): where chunks go, what is refused, what is never written twice."""

from __future__ import annotations

from kvtier.config import WritePolicy
from kvtier.control.directory import Directory, StorePlan, TierSlot
from kvtier.control.planner import place
from kvtier.control.policy import make_policy

CHAIN = ("cpu", "disk")


def key(i: int) -> bytes:
    return bytes([i]) * 32


def directory(cpu_chunks: int = 4, disk_chunks: int = 16) -> Directory:
    return Directory([TierSlot("cpu", cpu_chunks * 100, make_policy("lru")),
                      TierSlot("disk", disk_chunks * 100, make_policy("lru"))])


def size(_tier: str, nbytes: int) -> int:
    return nbytes


def stored(plans: list[StorePlan], tier: str) -> list[bytes]:
    return [k for p in plans if p.tier == tier and p.source is None for k in p.store]


def test_write_back_fills_the_first_tier_and_passes_the_rest_down() -> None:
    d = directory(cpu_chunks=2)
    placement = place(d, CHAIN, [(key(i), 100, None) for i in range(5)], WritePolicy.WRITE_BACK, size)
    assert stored(placement.plans, "cpu") == [key(0), key(1)]
    assert stored(placement.plans, "disk") == [key(2), key(3), key(4)]
    assert placement.unplaced == [] and d.stats.unplaced == 0


def test_a_chunk_with_a_write_in_flight_is_not_written_again_further_down() -> None:
    """Two requests sharing a prefix are saved in consecutive steps: the second finds the chunk reserved in cpu
    (its write not done yet) and must not plan it for disk as well (the old planner did: a double write)."""
    d = directory()
    first = place(d, CHAIN, [(key(1), 100, None)], WritePolicy.WRITE_BACK, size)
    assert stored(first.plans, "cpu") == [key(1)] and not d.contains("cpu", key(1)) and d.holds("cpu", key(1))
    second = place(d, CHAIN, [(key(1), 100, None), (key(2), 100, key(1))], WritePolicy.WRITE_BACK, size)
    assert stored(second.plans, "cpu") == [key(2)] and stored(second.plans, "disk") == []
    assert second.unplaced == []


def test_write_through_counts_a_chunk_in_flight_as_placed_not_unplaced() -> None:
    d = directory()
    place(d, CHAIN, [(key(1), 100, None)], WritePolicy.WRITE_THROUGH, size)
    again = place(d, CHAIN, [(key(1), 100, None)], WritePolicy.WRITE_THROUGH, size)
    assert again.plans == [] and again.unplaced == [] and d.stats.unplaced == 0


def test_chunks_no_tier_takes_are_returned_and_counted() -> None:
    d = directory(cpu_chunks=1, disk_chunks=1)
    placement = place(d, CHAIN, [(key(i), 100, None) for i in range(3)], WritePolicy.WRITE_BACK, size)
    assert placement.unplaced == [key(2)] and d.stats.unplaced == 1
