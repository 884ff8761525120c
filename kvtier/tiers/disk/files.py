"""Atomic file writes (blocking): the bytes go into a temp file beside the target, which is then renamed over it,
so a reader finds the whole new file or the old one, never a part. Record files (``io.write_record``) and
namespace manifests (``kvtier.manifest``) are written this way. No torch here: the catalog imports it."""

from __future__ import annotations

import os
from collections.abc import Sequence

TEMP_MODE = 0o600


def open_temp(tmp: str) -> int:
    """Create ``tmp`` for writing (mode 0600; it must not exist). Raises OSError."""
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, TEMP_MODE)


def write_and_rename(fd: int, tmp: str, final: str, parts: Sequence[bytes | memoryview], fsync: bool = False) -> int:
    """Write ``parts`` into ``fd`` (open on ``tmp``), fsync it when asked, close it and rename ``tmp`` to
    ``final``; the bytes written. On any failure (BaseException: Ctrl-C too) the descriptor is closed and ``tmp``
    removed, then the error re-raised."""
    try:
        size = write_all(fd, parts)
        if fsync:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, final)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return size


def write_all(fd: int, parts: Sequence[bytes | memoryview]) -> int:
    """Write every byte of ``parts`` (short writes retried); the bytes written."""
    total = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            n = os.write(fd, view)
            total += n
            view = view[n:]
    return total


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
