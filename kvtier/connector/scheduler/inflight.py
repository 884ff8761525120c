"""Saves in flight, on the scheduler side: which chunks each request's workers are writing, what the workers
reported not stored, and the directory's verdict once a request's saves are done (``finished_sending``).

A chunk still being written (``writing``) can be served already: the lookup counts it, and the workers' load waits
for their own write of it (kvtier.connector.scheduler.hits, kvtier.connector.worker.saves.SaveQueue.landed). An
idle engine runs no step, so the report that a write landed may come only with the request that wants it."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvtier.connector.report import WorkerReport
from kvtier.control.directory import Directory
from kvtier.records.keys import Key

logger = logging.getLogger(__name__)

Chunk = tuple[str, Key]  # (tier, key)


class InflightSaves:
    """Per request: the (tier, key) pairs planned for writing and not yet READY, and the ranks that reported each
    stored or not stored."""

    def __init__(self, directory: Directory, tp_size: int = 1, reports: bool = True) -> None:
        """``tp_size``: how many worker ranks save each chunk (a chunk is READY early when all of them report it
        stored, forgotten when all of them report it not stored). ``reports=False`` when the directory is the
        workers' own store's (one process): the store has already completed every write there, failed ones
        included."""
        self._directory = directory
        self._tp_size = max(1, tp_size)
        self._reports = reports
        self._saving: dict[str, dict[Chunk, None]] = {}
        self._failures: dict[str, dict[Chunk, set[str]]] = {}
        self._stored: dict[str, dict[Chunk, set[str]]] = {}
        self._writers: dict[Chunk, set[str]] = {}  # the requests writing each chunk, none of whose ranks failed it

    def add(self, req_id: str, chunks: Iterable[Chunk]) -> None:
        """The workers are told to write ``chunks`` for ``req_id``."""
        chunks = list(chunks)
        self._saving.setdefault(req_id, {}).update(dict.fromkeys(chunks))
        for chunk in chunks:
            self._writers.setdefault(chunk, set()).add(req_id)

    def writing(self, tier: str, key: Key) -> bool:
        """Whether the workers are writing ``key`` to ``tier`` for a request and no rank reported it failed (with
        reports: split halves; in one process the store marks its writes READY itself)."""
        return self._reports and bool(self._writers.get((tier, key)))

    def _unwrite(self, req_id: str, chunk: Chunk) -> None:
        writers = self._writers.get(chunk)
        if writers is not None:
            writers.discard(req_id)
            if not writers:
                del self._writers[chunk]

    def pending(self, req_id: str) -> bool:
        """Whether saves of ``req_id`` may still be running on the workers."""
        return req_id in self._saving

    def planned(self, req_id: str) -> list[Chunk]:
        """The chunks of ``req_id`` being written and not yet READY."""
        return list(self._saving.get(req_id, ()))

    def failures(self, req_id: str) -> dict[Chunk, set[str]]:
        return dict(self._failures.get(req_id, {}))

    def note(self, report: WorkerReport) -> None:
        """Remember the rows a worker reported not stored; make READY the chunks every rank reported stored (late
        rows, of requests already done, are ignored)."""
        if not self._reports:
            return
        for req_id, tier, key, rank in report.failed_saves:
            if req_id in self._saving:
                self._failures.setdefault(req_id, {}).setdefault((tier, key), set()).add(rank)
                self._unwrite(req_id, (tier, key))  # forgotten or dropped when the request ends: no more a hit
        ready: dict[str, list[Key]] = {}
        for req_id, tier, key, rank in report.stored_saves:
            saving = self._saving.get(req_id)
            if saving is None or (tier, key) not in saving:
                continue
            ranks = self._stored.setdefault(req_id, {}).setdefault((tier, key), set())
            ranks.add(rank)
            if len(ranks) >= self._tp_size:
                del saving[(tier, key)]
                del self._stored[req_id][(tier, key)]
                self._unwrite(req_id, (tier, key))
                ready.setdefault(tier, []).append(key)
        for tier, keys in ready.items():
            self._directory.complete_store(tier, keys, True)

    def forget(self, req_id: str, chunks: Iterable[Chunk]) -> None:
        """Stop tracking ``chunks`` of ``req_id`` (their KV is not to be served: kvtier.connector.scheduler.recovery);
        rows about them that arrive later change nothing."""
        saving = self._saving.get(req_id, {})
        for chunk in chunks:
            saving.pop(chunk, None)
            self._unwrite(req_id, chunk)
            self._stored.get(req_id, {}).pop(chunk, None)
            self._failures.get(req_id, {}).pop(chunk, None)

    def finish(self, req_id: str) -> list[Chunk]:
        """The workers are done with ``req_id``'s saves: its chunks not yet READY become so when no rank reported
        them not stored, and are forgotten otherwise; the chunks some ranks did store among those (returned) must
        leave those ranks too. A chunk one rank lacks is no hit: its load would fail on that rank."""
        failures = self._failures.pop(req_id, {})
        self._stored.pop(req_id, None)
        done: dict[tuple[str, bool], list[Key]] = {}
        partial: list[Chunk] = []
        for tier, key in self._saving.pop(req_id, {}):
            self._unwrite(req_id, (tier, key))
            ranks = len(failures.get((tier, key), ()))
            done.setdefault((tier, ranks == 0), []).append(key)
            if 0 < ranks < self._tp_size:
                partial.append((tier, key))
        for (tier, ok), keys in done.items():
            self._directory.complete_store(tier, keys, ok)
            if not ok:
                logger.warning("%d chunk(s) of %s were not stored in tier %s; forgotten", len(keys), req_id, tier)
        return partial
