"""File layout of the disk tier and the start-up scan that rebuilds its index from record headers.

Layout: ``<root>/<namespace hex>/<aa>/<bb>/<key hex>.kvt`` (``shard_depth`` levels of two hex digits taken
from the chunk hash), every directory mode 0700. Writers create ``<key hex>.kvt.<pid>.<random>.tmp`` in the
target directory and ``os.replace`` it, so a record file is either absent or complete. The scan (blocking:
run it in a worker thread) walks the namespace directories only (the root may hold other tiers' directories,
e.g. tensor-parallel ranks' ``tp<rank>-of-<size>``), removes stale temp files, deletes files whose header is
invalid or whose size disagrees with the header, moves records found at another shard depth, and returns the
valid ones oldest first. It skips what is not a record: each namespace directory's ``manifest.json``
(kvtier.tiers.manifest) and, at the root, the shared-directory ledger and lock files (kvtier.tiers.disk.ledger).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import time
from dataclasses import dataclass, field

from kvtier.errors import CorruptRecord
from kvtier.records.codec import HEADER_SIZE, decode_header
from kvtier.records.keys import DIGEST_BYTES, KEY_BYTES, Key
from kvtier.tiers.disk.files import remove
from kvtier.tiers.manifest import MANIFEST_NAME

log = logging.getLogger(__name__)

SUFFIX = ".kvt"
TMP_SUFFIX = ".tmp"
STALE_TMP_SECONDS = 600.0  # a temp file this old is stale even if its writer's pid is alive (pid reuse)
DIR_MODE = 0o700
# errors that mean the configured path cannot be this tier's directory (the user's to fix), not a failing disk
PATH_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EROFS, errno.EEXIST, errno.ENOENT,
                         errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP})


class Layout:
    """Where each key's file lives under ``root``."""

    def __init__(self, root: str, shard_depth: int) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.depth = shard_depth
        self._made: set[str] = set()

    def directory(self, key: Key) -> str:
        digest = key[DIGEST_BYTES:].hex()
        shards = [digest[2 * i:2 * i + 2] for i in range(self.depth)]
        return os.path.join(self.root, key[:DIGEST_BYTES].hex(), *shards)

    def path(self, key: Key) -> str:
        return os.path.join(self.directory(key), key.hex() + SUFFIX)

    @staticmethod
    def temp_path(final: str) -> str:
        return f"{final}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"

    def make_dirs(self, path: str) -> None:
        """Create ``path`` and its missing parents, each with mode 0700 (cached after the first call)."""
        if path in self._made:
            return
        missing = []
        head = path
        while head and not os.path.isdir(head):
            missing.append(head)
            head = os.path.dirname(head)
        for d in reversed(missing):
            try:
                os.mkdir(d, DIR_MODE)
            except FileExistsError:  # another writer made it first
                pass
        self._made.add(path)

    def forget_dirs(self) -> None:
        self._made.clear()


@dataclass
class ScanResult:
    entries: list[tuple[Key, int]] = field(default_factory=list)  # oldest first
    corrupt: int = 0
    temp_removed: int = 0
    manifested: set[bytes] = field(default_factory=set)  # namespaces whose directory has a manifest


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers: this process has no write in flight during a scan
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def is_stale_temp(path: str, name: str, now: float) -> bool:
    """A temp file whose writer is gone (dead pid) or which is too old to be in flight."""
    try:
        pid = int(name.split(".")[-3])
        age = now - os.stat(path).st_mtime
    except (ValueError, IndexError, OSError):
        return True
    return age > STALE_TMP_SECONDS or not _pid_alive(pid)


def _check_record(path: str, key: Key, size: int, max_raw: int) -> None:
    with open(path, "rb") as f:
        head = f.read(HEADER_SIZE)
    header = decode_header(head, expected_key=key, max_raw=max_raw)
    if header.total_len != size:
        raise CorruptRecord(f"file is {size} bytes, header says {header.total_len}")


def _is_namespace(name: str) -> bool:
    """A directory name that is a namespace digest in hex."""
    if len(name) != 2 * DIGEST_BYTES:
        return False
    try:
        bytes.fromhex(name)
    except ValueError:
        return False
    return True


def _key_of(name: str) -> Key | None:
    stem = name[:-len(SUFFIX)]
    try:
        key = bytes.fromhex(stem)
    except ValueError:
        return None
    return key if len(key) == KEY_BYTES else None


def scan(layout: Layout, max_raw: int) -> ScanResult:
    """Walk the tree, clean it and list valid records (see the module docstring)."""
    result = ScanResult()
    found: list[tuple[float, Key, int]] = []
    now = time.time()
    if not os.path.isdir(layout.root):
        return result
    for dirpath, dirs, files in os.walk(layout.root):
        if dirpath == layout.root:
            # only namespace directories: other entries (e.g. the tp<rank>-of-<size> directories of tensor-
            # parallel ranks sharing the configured path) belong to other tiers
            dirs[:] = [d for d in dirs if _is_namespace(d)]
            continue
        if os.path.dirname(dirpath) == layout.root and MANIFEST_NAME in files:
            result.manifested.add(bytes.fromhex(os.path.basename(dirpath)))
        for name in files:
            path = os.path.join(dirpath, name)
            if name.endswith(TMP_SUFFIX):
                if is_stale_temp(path, name, now):
                    remove(path)
                    result.temp_removed += 1
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                entry = _scan_one(layout, path, name, max_raw)
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            if isinstance(entry, int):
                result.corrupt += 1
            else:
                found.append(entry)
    found.sort(key=lambda e: e[0])
    result.entries = [(key, size) for _, key, size in found]
    return result


def count_records(root: str) -> dict[str, int]:
    """Bytes of the record files (``*.kvt``, temp files not) per namespace hex, from their sizes alone (no header
    is read): how the shared-directory ledger recounts under its lock (kvtier.tiers.disk.ledger)."""
    out: dict[str, int] = {}
    try:
        spaces = [e.name for e in os.scandir(root) if _is_namespace(e.name) and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return out
    for space in spaces:
        total = 0
        for dirpath, _, files in os.walk(os.path.join(root, space)):
            for name in files:
                if name.endswith(SUFFIX):
                    try:
                        total += os.stat(os.path.join(dirpath, name)).st_size
                    except FileNotFoundError:
                        continue
        if total > 0:
            out[space] = total
    return out


def _scan_one(layout: Layout, path: str, name: str, max_raw: int) -> tuple[float, Key, int] | int:
    """(mtime, key, size) of a valid record, after moving it to its place; the size of an invalid one (deleted).
    ``FileNotFoundError`` when the file vanished meanwhile."""
    key = _key_of(name)
    size = 0
    try:
        st = os.stat(path)
        size = st.st_size
        if key is None:
            raise CorruptRecord(f"file name {name!r} is not a key")
        _check_record(path, key, st.st_size, max_raw)
        final = layout.path(key)
        if path != final:  # written with another shard depth
            layout.make_dirs(os.path.dirname(final))
            os.replace(path, final)
    except FileNotFoundError:
        raise
    except (CorruptRecord, OSError) as exc:
        log.warning("disk tier: removing invalid record %s: %s", path, exc)
        remove(path)
        return size
    return (st.st_mtime, key, st.st_size)
