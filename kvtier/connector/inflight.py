"""Saves in flight, on the scheduler side: which chunks each request's workers are writing, what the workers
reported not stored, and the directory's verdict once a request's saves are done (``finished_sending``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvtier.connector.report import WorkerReport
from kvtier.directory import Directory
from kvtier.keys import Key

logger = logging.getLogger(__name__)


class InflightSaves:
    """Per request: the (tier, key) pairs planned for writing, and the ranks that reported each not stored."""

    def __init__(self, directory: Directory, tp_size: int = 1, reports: bool = True) -> None:
        """``tp_size``: how many worker ranks save each chunk (a chunk is forgotten when all of them report it
        not stored). ``reports=False`` when the directory is the workers' own store's (one process): the store
        has already completed every write there, failed ones included."""
        self._directory = directory
        self._tp_size = max(1, tp_size)
        self._reports = reports
        self._saving: dict[str, list[tuple[str, Key]]] = {}
        self._failures: dict[str, dict[tuple[str, Key], set[str]]] = {}

    def add(self, req_id: str, stored: Iterable[tuple[str, Key]]) -> None:
        """The workers are told to write ``stored`` for ``req_id``."""
        self._saving.setdefault(req_id, []).extend(stored)

    def pending(self, req_id: str) -> bool:
        """Whether saves of ``req_id`` may still be running on the workers."""
        return req_id in self._saving

    def planned(self, req_id: str) -> list[tuple[str, Key]]:
        return list(self._saving.get(req_id, ()))

    def failures(self, req_id: str) -> dict[tuple[str, Key], set[str]]:
        return dict(self._failures.get(req_id, {}))

    def note(self, report: WorkerReport) -> None:
        """Remember the rows a worker reported not stored (late rows, of requests already done, are ignored)."""
        if not self._reports:
            return
        for req_id, tier, key, rank in report.failed_saves:
            if req_id in self._saving:
                self._failures.setdefault(req_id, {}).setdefault((tier, key), set()).add(rank)

    def finish(self, req_id: str) -> None:
        """The workers are done with ``req_id``'s saves: its chunks become READY, or are forgotten where no rank
        stored them (a chunk some ranks stored stays tracked; the failed rank's load of it is recomputed)."""
        failures = self._failures.pop(req_id, {})
        done: dict[tuple[str, bool], list[Key]] = {}
        for tier, key in self._saving.pop(req_id, []):
            ok = len(failures.get((tier, key), ())) < self._tp_size
            done.setdefault((tier, ok), []).append(key)
        for (tier, ok), keys in done.items():
            self._directory.complete_store(tier, keys, ok)
            if not ok:
                logger.warning("%d chunk(s) of %s were not stored in tier %s; forgotten", len(keys), req_id, tier)
