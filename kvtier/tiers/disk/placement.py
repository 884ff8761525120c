"""Putting a put's staged records in place, under the shared directory's lock (blocking; the rule is in
kvtier.tiers.disk.shared): count each record by what its file adds as found now, drop one that would take the
directory over its quota, rename the others into place."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from kvtier.records.keys import DIGEST_BYTES, Key
from kvtier.tiers.disk.files import Staged, discard, fsync_dir
from kvtier.tiers.disk.ledger import LedgerState

log = logging.getLogger(__name__)

Batch = Sequence[tuple[Key, Staged | Exception | None, int | None]]  # (key, staged, bytes reserved) per item


def admit(state: LedgerState, batch: Batch) -> list[tuple[int, Staged, int]]:
    """Count the staged records that fit (``(position, staged, bytes counted)``), drop the others: a record that
    adds bytes while the directory has no room (the file it replaces vanished meanwhile, or a rebuilt ledger lost
    its reservation). The caller ended the batch's reservations first."""
    placing: list[tuple[int, Staged, int]] = []
    for i, (key, staged, _) in enumerate(batch):
        if not isinstance(staged, Staged):
            continue
        delta = staged.size - size_of(staged.final)
        if delta > 0 and state.total() + delta > state.quota:
            discard(staged.tmp)
            continue
        state.add(key[:DIGEST_BYTES].hex(), delta)
        placing.append((i, staged, delta))
    return placing


def rename(state: LedgerState, key: Key, staged: Staged, delta: int) -> int | Exception:
    """Rename a counted record into place; its size, or the error that dropped it (then uncounted)."""
    try:
        os.replace(staged.tmp, staged.final)
    except OSError as exc:
        discard(staged.tmp)
        state.add(key[:DIGEST_BYTES].hex(), -delta)
        return exc
    return staged.size


def sync_dirs(name: str, paths: Sequence[str]) -> None:
    """Make the renames of these records durable (the tier's ``fsync``); a failure is logged."""
    for directory in sorted({os.path.dirname(p) for p in paths}):
        try:
            fsync_dir(directory)
        except OSError as exc:
            log.warning("disk tier %s: cannot fsync %s: %s", name, directory, exc)


def size_of(path: str) -> int:
    """A file's size; 0 when there is none."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
