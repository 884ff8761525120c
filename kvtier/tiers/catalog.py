"""What a config's tiers store, read without the engine running: per tier and namespace, and deleted on request.

Use: ``sources = open_sources(cfg)`` (kvtier.ops.catalog: one per tier; memory tiers are :class:`InProcess`
placeholders, since their records live only in a running process) -> ``summarize(source)`` (records, bytes, oldest /
newest and the namespace's manifest, per namespace) / ``source.records(namespace)`` / ``source.read(key)`` ->
``plan(source, Selection(...))`` then ``source.delete(records)`` -> ``source.close()``
(``offline_sources``: the readable ones, closed at the end of a ``with`` block).

Sources: :class:`kvtier.tiers.disk.catalog.DiskSource` (record files, the root and its ``tp<rank>-of-<size>``
rank directories) and :class:`kvtier.tiers.redis.catalog.RedisSource` (SCAN per server or cluster node). A tier that
cannot be read raises ``TierUnavailable``; :func:`summarize` turns that into a report with ``status``
``unreachable``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.errors import TierUnavailable
from kvtier.tiers.manifest import Manifest, describe

if TYPE_CHECKING:
    from kvtier.records.codec import RecordHeader

IN_PROCESS = "in-process only, not inspectable offline"


@dataclass(frozen=True)
class RecordInfo:
    """One stored record. ``mtime``: the file's on disk; in Redis estimated from the TTL left (None without a
    TTL). ``where``: the rank directory on disk (``tp0-of-2``), else empty. ``ref``: the file, or the node."""

    key: bytes
    size: int
    mtime: float | None
    where: str = ""
    ref: str = ""
    header: RecordHeader | None = None
    error: str | None = None

    @property
    def namespace(self) -> str:
        return self.key[:16].hex()


@dataclass(frozen=True)
class NamespaceSummary:
    namespace: str
    where: str
    records: int = 0
    bytes: int = 0
    oldest: float | None = None
    newest: float | None = None
    manifest: Manifest | None = None

    @property
    def description(self) -> str:
        return describe(self.manifest)

    def as_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "where": self.where, "records": self.records, "bytes": self.bytes,
                "oldest": self.oldest, "newest": self.newest, "manifest": self.manifest,
                "description": self.description}


@dataclass
class TierSummary:
    """``status``: ``ok``, ``unreachable`` (``error`` says why) or ``in-process``."""

    name: str
    kind: str
    location: str
    status: str = "ok"
    error: str | None = None
    namespaces: list[NamespaceSummary] = field(default_factory=list)

    @property
    def records(self) -> int:
        return sum(n.records for n in self.namespaces)

    @property
    def bytes(self) -> int:
        return sum(n.bytes for n in self.namespaces)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "location": self.location, "status": self.status,
                "error": self.error, "records": self.records, "bytes": self.bytes,
                "namespaces": [n.as_dict() for n in self.namespaces]}


class Source(Protocol):
    """A tier's stored records, read and deleted offline."""

    name: str
    kind: str
    location: str

    def manifests(self) -> dict[tuple[str, str], Manifest | None]:
        """(where, namespace hex) -> manifest (None when absent) of every namespace the tier knows."""
        ...

    def records(self, namespace: str | None = None, headers: bool = False) -> Iterator[RecordInfo]: ...

    def detail(self, record: RecordInfo) -> RecordInfo:
        """``record`` with its header parsed."""
        ...

    def read(self, key: bytes) -> list[tuple[RecordInfo, bytes]]:
        """Every copy of the record ``key`` (one per rank directory that holds it), whole."""
        ...

    def delete(self, records: Sequence[RecordInfo]) -> tuple[int, int]:
        """Delete the records; (how many existed, their bytes)."""
        ...

    def notes(self) -> list[str]: ...

    def close(self) -> None: ...


@dataclass
class InProcess:
    """A memory tier (cpu, gpu): its records exist only inside the process that holds it."""

    name: str
    kind: str
    location: str = ""

    def close(self) -> None:
        """Nothing to release."""


@dataclass(frozen=True)
class Selection:
    """What ``purge`` deletes: records matching every filter given (none given: everything)."""

    model: str | None = None
    namespace: str | None = None
    older_than: float | None = None  # seconds

    def wants_namespace(self, namespace: str, manifest: Manifest | None) -> bool:
        if self.namespace is not None and namespace != self.namespace:
            return False
        if self.model is None:
            return True
        return manifest is not None and manifest.get("model") == self.model

    def wants_record(self, record: RecordInfo, now: float) -> bool:
        if self.older_than is None:
            return True
        return record.mtime is not None and record.mtime < now - self.older_than


def summarize(source: Source | InProcess) -> TierSummary:
    """Records, bytes and age per namespace of one tier; an unreadable tier is reported, not raised."""
    if isinstance(source, InProcess):
        return TierSummary(source.name, source.kind, source.location, "in-process", IN_PROCESS)
    summary = TierSummary(source.name, source.kind, source.location)
    try:
        found: dict[tuple[str, str], NamespaceSummary] = {
            k: NamespaceSummary(k[1], k[0], manifest=m) for k, m in source.manifests().items()}
        for r in source.records():
            n = found.get((r.where, r.namespace)) or NamespaceSummary(r.namespace, r.where)
            oldest = n.oldest if r.mtime is None or (n.oldest is not None and n.oldest <= r.mtime) else r.mtime
            newest = n.newest if r.mtime is None or (n.newest is not None and n.newest >= r.mtime) else r.mtime
            found[(r.where, r.namespace)] = NamespaceSummary(n.namespace, n.where, n.records + 1, n.bytes + r.size,
                                                             oldest, newest, n.manifest)
    except TierUnavailable as exc:
        summary.status, summary.error = "unreachable", str(exc)
        return summary
    summary.namespaces = sorted(found.values(), key=lambda n: (n.where, n.namespace))
    return summary


def plan(source: Source, selection: Selection, now: float | None = None) -> list[RecordInfo]:
    """The records of ``source`` that ``selection`` picks (records of unknown age never match an age filter)."""
    now = time.time() if now is None else now
    manifests = source.manifests()
    return [r for r in source.records(selection.namespace)
            if selection.wants_namespace(r.namespace, manifests.get((r.where, r.namespace)))
            and selection.wants_record(r, now)]


__all__ = ["IN_PROCESS", "InProcess", "NamespaceSummary", "RecordInfo", "Selection", "Source", "TierSummary",
           "plan", "summarize"]
