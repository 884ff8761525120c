"""What workers tell the scheduler each step, apart from counters: ``WorkerReport``.

It travels through the engine's worker-metadata hook: ``build_connector_worker_meta()`` on each worker, the
engine's ``aggregate`` over workers (tensor-parallel ranks), ``KVConnectorOutput.kv_connector_worker_meta`` into
the scheduler's ``update_connector_output``. vLLM (0.32 and 0.33) and the reference engine (kvtier.engine) both
carry it; stats only count. ``ChildReports`` carries a multi-connector's children's metadata, one per child.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvtier.records.keys import Key

# (request id, tier, key, tensor-parallel rank) of one chunk a worker did not store
FailedSave = tuple[str, str, Key, str]
# (request id, tier, key, tensor-parallel rank) of one chunk a worker has written: readable from now on
StoredSave = tuple[str, str, Key, str]
# (tier, key, tensor-parallel rank, written) of one record a persisting plan created
# (kvtier.connector.worker.persisting)
PersistedCopy = tuple[str, Key, str, bool]
# (tier, key) of one chunk a worker could not load (a request's asynchronous load reported failed as a whole)
FailedLoad = tuple[str, Key]


@dataclass
class WorkerReport:
    """Chunks not stored (the scheduler forgets a chunk no rank stored), whether a worker disabled kvtier (it
    cannot read the engine's KV tensors: the scheduler stops planning), chunks that could not be loaded for a
    request whose load failed as a whole (the scheduler forgets them), chunks written (the scheduler makes a
    chunk every rank wrote visible to lookups at once, not when its request ends), and the records of persisting
    copies, written or not (kvtier.connector.scheduler.persist_plans)."""

    failed_saves: list[FailedSave] = field(default_factory=list)
    disabled: bool = False
    failed_loads: list[FailedLoad] = field(default_factory=list)
    stored_saves: list[StoredSave] = field(default_factory=list)
    persisted: list[PersistedCopy] = field(default_factory=list)

    def aggregate(self, other: WorkerReport) -> WorkerReport:
        return WorkerReport([*self.failed_saves, *other.failed_saves], self.disabled or other.disabled,
                            [*self.failed_loads, *other.failed_loads], [*self.stored_saves, *other.stored_saves],
                            [*self.persisted, *other.persisted])

    def __bool__(self) -> bool:
        return (bool(self.failed_saves) or self.disabled or bool(self.failed_loads) or bool(self.stored_saves)
                or bool(self.persisted))


class ReportBox:
    """A worker's report for the next step, filled from the engine's thread and the I/O loop (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._report = WorkerReport()

    def fail(self, rows: Iterable[FailedSave]) -> None:
        with self._lock:
            self._report.failed_saves.extend(rows)

    def stored(self, rows: Iterable[StoredSave]) -> None:
        with self._lock:
            self._report.stored_saves.extend(rows)

    def fail_loads(self, rows: Iterable[FailedLoad]) -> None:
        with self._lock:
            self._report.failed_loads.extend(rows)

    def disable(self) -> None:
        with self._lock:
            self._report.disabled = True

    def take(self) -> WorkerReport | None:
        """This step's report (None when there is nothing to say), emptying the box."""
        with self._lock:
            report, self._report = self._report, WorkerReport()
        return report or None


@dataclass
class ChildReports:
    """The worker metadata of a multi-connector's children (worker -> scheduler), in config order."""

    metadata: tuple[Any, ...]

    def aggregate(self, other: ChildReports) -> ChildReports:
        pairs = zip(self.metadata, other.metadata, strict=True)
        return ChildReports(tuple(b if a is None else a if b is None else a.aggregate(b) for a, b in pairs))


def report_of(connector_output: Any) -> WorkerReport | None:
    """The kvtier worker report in an engine's connector output, if any."""
    meta = getattr(connector_output, "kv_connector_worker_meta", None)
    return meta if isinstance(meta, WorkerReport) else None
