"""A disk tier's records, read from its directory without the tier running (layout: ``kvtier.tiers.disk.index``).

The root holds ``<namespace hex>/`` directories, and tensor-parallel ranks' ``tp<rank>-of-<size>/`` directories
holding their own. Other entries (``.kvtier-ledger``, ``.kvtier-lock``, temp files, ``manifest.json``) are not
records and are skipped. Deleting unlinks record files only, so it is safe beside a running writer: a reader
treats a vanished file as a miss; directories and manifests stay.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence

from kvtier.config import DiskTierConfig
from kvtier.errors import CorruptRecord, TierUnavailable
from kvtier.records.codec import HEADER_SIZE, decode_header
from kvtier.tiers.catalog import RecordInfo
from kvtier.tiers.disk.index import SUFFIX, Layout, _is_namespace, _key_of
from kvtier.tiers.manifest import Manifest, read_disk

RANK_DIR = re.compile(r"tp\d+-of-\d+")
LEDGER_FILES = (".kvtier-ledger", ".kvtier-lock")


class DiskSource:
    """Records under ``section.path``."""

    kind = "disk"

    def __init__(self, section: DiskTierConfig) -> None:
        self.name = section.name
        self.root = os.path.abspath(os.path.expanduser(section.path))
        self.location = self.root
        self.depth = section.shard_depth

    def roots(self) -> list[tuple[str, str]]:
        """(where, directory): the root, then each rank directory in it."""
        try:
            entries = sorted(os.scandir(self.root), key=lambda e: e.name)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise TierUnavailable(f"{self.root}: {exc.strerror or exc}") from None
        ranks = [(e.name, e.path) for e in entries if RANK_DIR.fullmatch(e.name) and e.is_dir()]
        return [("", self.root), *ranks]

    def _namespaces(self) -> Iterator[tuple[str, str, str]]:
        for where, base in self.roots():
            try:
                entries = sorted(os.scandir(base), key=lambda e: e.name)
            except OSError as exc:
                raise TierUnavailable(f"{base}: {exc.strerror or exc}") from None
            for entry in entries:
                if _is_namespace(entry.name) and entry.is_dir():
                    yield where, entry.name, entry.path

    def manifests(self) -> dict[tuple[str, str], Manifest | None]:
        return {(where, ns): read_disk(path) for where, ns, path in self._namespaces()}

    def records(self, namespace: str | None = None, headers: bool = False) -> Iterator[RecordInfo]:
        for where, ns, path in self._namespaces():
            if namespace is not None and ns != namespace:
                continue
            for dirpath, _, files in os.walk(path):
                for name in sorted(files):
                    key = _key_of(name) if name.endswith(SUFFIX) else None
                    if key is None:
                        continue
                    record = _record(os.path.join(dirpath, name), key, where, headers)
                    if record is not None:
                        yield record

    def detail(self, record: RecordInfo) -> RecordInfo:
        """``record`` with its header read (listing without headers only stats the files)."""
        if record.header is not None or record.error is not None:
            return record
        return _record(record.ref, record.key, record.where, True) or record

    def read(self, key: bytes) -> list[tuple[RecordInfo, bytes]]:
        out = []
        for where, base in self.roots():
            path = Layout(base, self.depth).path(key)
            try:
                with open(path, "rb") as f:
                    data = f.read()
                mtime = os.stat(path).st_mtime
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise TierUnavailable(f"{path}: {exc.strerror or exc}") from None
            out.append((RecordInfo(key, len(data), mtime, where, path), data))
        return out

    def delete(self, records: Sequence[RecordInfo]) -> tuple[int, int]:
        count = size = 0
        for r in records:
            try:
                os.unlink(r.ref)
            except FileNotFoundError:  # deleted meanwhile (evicted by a running tier)
                continue
            except OSError as exc:
                raise TierUnavailable(f"{r.ref}: {exc.strerror or exc}") from None
            count, size = count + 1, size + r.size
        return count, size

    def notes(self) -> list[str]:
        """What a purge leaves to the tier's owner: a shared usage ledger is not edited here."""
        ledgers = [os.path.join(base, LEDGER_FILES[0]) for _, base in self.roots()
                   if os.path.exists(os.path.join(base, LEDGER_FILES[0]))]
        return [f"the usage ledger {path} counts the deleted bytes until the disk tier's next start, which "
                "recounts it (nothing to do)" for path in ledgers]

    def close(self) -> None:
        """Nothing to release."""


def _record(path: str, key: bytes, where: str, headers: bool) -> RecordInfo | None:
    """The record file at ``path`` (None when it vanished meanwhile), its header parsed when ``headers``."""
    try:
        st = os.stat(path)
        if not headers:
            return RecordInfo(key, st.st_size, st.st_mtime, where, path)
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return RecordInfo(key, 0, None, where, path, error=exc.strerror or str(exc))
    try:
        header = decode_header(head, expected_key=key)
    except CorruptRecord as exc:
        return RecordInfo(key, st.st_size, st.st_mtime, where, path, error=str(exc))
    error = None if header.total_len == st.st_size else f"file is {st.st_size} bytes, header says {header.total_len}"
    return RecordInfo(key, st.st_size, st.st_mtime, where, path, header, error)
