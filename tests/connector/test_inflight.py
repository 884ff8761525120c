"""InflightSaves (the scheduler's saves in flight): a chunk is served once every rank reports it written, not when
its request ends; what no rank reported is settled when the request's saves finish."""

from __future__ import annotations

from kvtier.connector.report import WorkerReport
from kvtier.connector.scheduler.inflight import InflightSaves
from kvtier.control.directory import Directory, TierSlot
from kvtier.control.policy import make_policy


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def planned(n: int, tp_size: int = 1) -> tuple[Directory, InflightSaves]:
    """A directory with chunks 0..n-1 of request A PENDING in tier t0, tracked as A's saves."""
    directory = Directory([TierSlot("t0", 1000, make_policy("lru"))])
    directory.prepare_store("t0", [(k(i), 10, k(i - 1) if i else None) for i in range(n)])
    inflight = InflightSaves(directory, tp_size)
    inflight.add("A", [("t0", k(i)) for i in range(n)])
    return directory, inflight


def stored(req_id: str, rank: str, *chunks: int) -> WorkerReport:
    return WorkerReport(stored_saves=[(req_id, "t0", k(i), rank) for i in chunks])


def test_written_chunks_are_served_before_their_request_ends() -> None:
    directory, inflight = planned(3)
    assert directory.lookup([k(0), k(1), k(2)]) == []  # PENDING: invisible
    inflight.note(stored("A", "0", 0, 1))
    assert directory.lookup([k(0), k(1), k(2)]) == ["t0", "t0"]
    assert inflight.planned("A") == [("t0", k(2))] and inflight.pending("A")
    inflight.finish("A")  # the rest is settled at the end: READY (no rank reported it not stored)
    assert directory.lookup([k(0), k(1), k(2)]) == ["t0"] * 3 and not inflight.pending("A")


def test_a_chunk_is_served_only_once_every_tensor_parallel_rank_wrote_it() -> None:
    directory, inflight = planned(2, tp_size=2)
    inflight.note(stored("A", "0", 0, 1))
    inflight.note(stored("A", "0", 0))  # the same rank again counts once
    assert directory.lookup([k(0)]) == []
    inflight.note(stored("A", "1", 0))
    assert directory.lookup([k(0), k(1)]) == ["t0"]
    inflight.note(WorkerReport([("A", "t0", k(1), "1")]))  # rank 1 failed chunk 1; rank 0 holds it
    assert inflight.finish("A") == [("t0", k(1))]  # to drop from rank 0: a load of it would fail on rank 1
    assert directory.lookup([k(0), k(1)]) == ["t0"] and not directory.holds("t0", k(1))


def test_rows_of_other_requests_and_late_rows_change_nothing() -> None:
    directory, inflight = planned(2)
    inflight.note(stored("B", "0", 0))  # not B's save
    assert directory.lookup([k(0)]) == []
    inflight.note(WorkerReport([("A", "t0", k(0), "0"), ("A", "t0", k(1), "0")]))
    inflight.finish("A")  # every rank failed both: forgotten, their room freed
    assert directory.lookup([k(0)]) == [] and not directory.contains("t0", k(0)) and directory.used_bytes("t0") == 0
    inflight.note(stored("A", "0", 0, 1))  # late rows of a request already settled
    assert not directory.contains("t0", k(0)) and not inflight.pending("A")


def test_a_single_process_store_completes_its_own_writes() -> None:
    directory, _ = planned(1)
    inflight = InflightSaves(directory, reports=False)
    inflight.add("A", [("t0", k(0))])
    inflight.note(stored("A", "0", 0))  # the store marks its writes itself; reports are not read
    assert directory.lookup([k(0)]) == []
