"""Atomic file writes (blocking): the bytes go into a temp file beside the target, which is then renamed over it,
so a reader finds the whole new file or the old one, never a part. Namespace manifests (``kvtier.tiers.manifest``)
and the shared directory's member files (``kvtier.tiers.disk.members``) are written with ``write_and_rename``
(the ledger is written in place, with a check: ``kvtier.tiers.disk.ledger``); record files in two steps,
``finish_temp`` (``io.stage_record``) and a rename under the ledger's lock (``shared.SharedDirectory.store``), so
that the ledger counts each record as it lands. No torch here: the catalog imports it."""

from __future__ import annotations

import errno
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.tiers.manifest import MANIFEST_NAME

TEMP_MODE = 0o600


@dataclass(frozen=True)
class Staged:
    """A record written whole into its temp file ``tmp``, to be renamed to ``final``; ``size``: its bytes."""

    tmp: str
    final: str
    size: int


def open_temp(tmp: str) -> int:
    """Create ``tmp`` for writing (mode 0600; it must not exist). Raises OSError."""
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, TEMP_MODE)


def finish_temp(fd: int, tmp: str, parts: Sequence[bytes | memoryview], fsync: bool = False) -> int:
    """Write ``parts`` into ``fd`` (open on ``tmp``), fsync it when asked and close it; the bytes written. On any
    failure (BaseException: Ctrl-C too) the descriptor is closed and ``tmp`` removed, then the error re-raised."""
    try:
        size = write_all(fd, parts)
        if fsync:
            os.fsync(fd)
        os.close(fd)
        fd = -1
    except BaseException:
        if fd >= 0:
            os.close(fd)
        discard(tmp)
        raise
    return size


def write_and_rename(fd: int, tmp: str, final: str, parts: Sequence[bytes | memoryview], fsync: bool = False) -> int:
    """``finish_temp``, then rename ``tmp`` to ``final``; the bytes written. On any failure ``tmp`` is removed
    and the error re-raised."""
    size = finish_temp(fd, tmp, parts, fsync)
    try:
        os.replace(tmp, final)
    except BaseException:
        discard(tmp)
        raise
    return size


def write_all(fd: int, parts: Sequence[bytes | memoryview], at: int | None = None) -> int:
    """Write every byte of ``parts`` (short writes retried; a write that makes no progress is an OSError), at the
    file's offset or, given ``at``, from that offset on; the bytes written."""
    total = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            n = os.write(fd, view) if at is None else os.pwrite(fd, view, at + total)
            if n <= 0:
                raise OSError(errno.EIO, f"write stopped with {view.nbytes} bytes left")
            total += n
            view = view[n:]
    return total


def remove(path: str) -> None:
    """Remove a file; one already gone is no error (any other failure is)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def discard(path: str) -> None:
    """Remove a temp file if it is there."""
    try:
        os.unlink(path)
    except OSError:
        pass


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: str, manifest: Mapping[str, Any]) -> None:
    """Write ``<directory>/manifest.json`` atomically (temp file + ``os.replace``; mode 0600). Raises OSError."""
    final = os.path.join(directory, MANIFEST_NAME)
    tmp = f"{final}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    data = json.dumps(dict(manifest), indent=1, sort_keys=True).encode() + b"\n"
    write_and_rename(open_temp(tmp), tmp, final, [data])
