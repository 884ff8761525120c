"""The usage ledger of a disk directory that several processes share (blocking: run it in worker threads).

Its files, under ``<root>``, are read and written only while holding ``fcntl.flock`` on ``.kvtier-lock``, a file
of its own (a new descriptor per transaction, so threads of one process exclude each other too):

* ``.kvtier-ledger``, the counts::

    {"bytes": {"<namespace hex>": <bytes of its record files>, ...}, "kvtier_ledger": 4,
     "members": {"<member id>": {...}, ...}, "quota": <bytes for the whole directory>, "check": "<hash>"}

  ``members`` is a copy of the member files as of the last transaction, for reading: membership is read from
  ``.kvtier-members/``, one file per open disk tier (kvtier.tiers.disk.members), never from the ledger.
  ``check`` is a hash of the rest (as ``json.dumps`` with sorted keys writes it): a torn ledger fails it.

The rules:

* Every change is written in place, whole (every write checked), then the file is cut to its length (and
  fsynced when the tier's ``fsync`` says so). A process killed in between, or a crash before the page cache reached
  the disk, may leave a mix of the new ledger and the old one: its ``check`` fails, and the next transaction
  rebuilds it (below). A crash without ``fsync`` may also leave a whole older ledger, which passes its check:
  every process counts the directory's files again when its tier starts (``SharedDirectory.join``).
  Not a temp file renamed over the ledger: on ext4 a rename over a file starts the new file's writeback at once
  (``auto_da_alloc``) and waits on the journal. A transaction (lock, read, count, write) took
  0.44-0.54 ms that way and 0.57-0.89 ms beside a process writing records; in place it takes 0.033-0.048 ms.
* ``bytes`` are the record files' sizes: files change only under the lock, in the transaction that counts the
  change (kvtier.tiers.disk.shared): a record is counted, the ledger written, then the record renamed into
  place; a record is unlinked, then uncounted. A process killed in between leaves bytes no file holds (an
  overcount: the quota still holds), which the next transaction recounts (below).
* A ledger that is absent, unreadable or invalid (not JSON, wrong schema, its check wrong) is rebuilt under the
  lock before the transaction goes on (``fresh``): bytes from the record files' sizes, the quota from the live
  members' files (else the caller's). A member of this host found dead without having left (killed, perhaps inside
  a transaction) also makes the transaction recount the bytes from the files (``recounted``). Membership lives in
  the member files, so a rebuild never takes a running process's namespaces for orphans.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvtier.tiers.disk.files import TEMP_MODE, discard, fsync_dir, write_all
from kvtier.tiers.disk.index import count_records
from kvtier.tiers.disk.members import HOST, MemberFiles, Roster

__all__ = ["HOST", "LEDGER_NAME", "LOCK_NAME", "Ledger", "LedgerState", "seal", "step"]

log = logging.getLogger(__name__)

LEDGER_NAME = ".kvtier-ledger"
LOCK_NAME = ".kvtier-lock"
LEDGER_VERSION = 4  # 3 had no check (it was renamed into place); 2 had reservations
STEP_HOOK: Callable[[str], None] | None = None  # tests only: called with each step of a transaction's writes


def step(name: str) -> None:
    """Mark a step of a transaction's file changes (``STEP_HOOK``: a test stops the process there)."""
    if STEP_HOOK is not None:
        STEP_HOOK(name)


@dataclass
class LedgerState:
    """The ledger as read under the lock; changes are written back when the transaction ends."""

    quota: int
    bytes: dict[str, int] = field(default_factory=dict)
    members: dict[str, dict[str, Any]] = field(default_factory=dict)
    fresh: bool = False  # the file was absent or invalid: rebuilt from the files
    recounted: bool = False  # bytes were counted from the files in this transaction
    written: builtins.bytes = field(default=b"", repr=False)  # the ledger file as it is on disk
    roster: Roster = field(default_factory=Roster, repr=False)  # the member files as they are on disk

    def total(self) -> int:
        """The directory's bytes: its record files'."""
        return sum(self.bytes.values())

    def add(self, namespace: str, n: int) -> None:
        """Count ``n`` more bytes of files (negative: fewer) for ``namespace``; never below zero."""
        left = self.bytes.get(namespace, 0) + n
        if left > 0:
            self.bytes[namespace] = left
        else:
            self.bytes.pop(namespace, None)

    def claimed_by_others(self, me: str) -> set[str]:
        """Namespaces that live members other than ``me`` serve (members of ``me``'s own process included:
        one process's tiers on one directory act as one)."""
        out: set[str] = set()
        for member in self.others(me):
            out.update(member.get("namespaces", ()))
        return out

    def others(self, me: str) -> list[dict[str, Any]]:
        """The live members of other processes."""
        pid = self.members.get(me, {}).get("pid", os.getpid())
        return [m for n, m in self.members.items() if n != me and not (m.get("host") == HOST and m.get("pid") == pid)]


def _counts(raw: object) -> dict[str, int]:
    if not isinstance(raw, dict):
        raise TypeError("not a mapping")
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in raw.values()):
        raise ValueError("not a byte count")
    return {str(k): v for k, v in raw.items() if v > 0}


def _parse(raw: bytes) -> LedgerState | None:
    """The ledger ``raw`` holds; None when it is not a valid one (torn, or not this version)."""
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("kvtier_ledger") != LEDGER_VERSION:
            return None
        check = data.pop("check", None)
        if check != _check(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()):
            return None
        quota = data["quota"]
        if not isinstance(quota, int) or isinstance(quota, bool) or quota <= 0:
            return None
        return LedgerState(quota, _counts(data["bytes"]))
    except (ValueError, KeyError, TypeError):
        return None


def _check(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=8).hexdigest()


def seal(body: bytes) -> bytes:
    """A ledger file's bytes: ``body`` (a JSON object as ``json.dumps`` with sorted keys and no spaces writes it)
    with its ``check``."""
    return body[:-1] + b',"check":"' + _check(body).encode() + b'"}'


def _dump(state: LedgerState) -> bytes:
    body = {"kvtier_ledger": LEDGER_VERSION, "quota": state.quota, "bytes": state.bytes, "members": state.members}
    return seal(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


class Ledger:
    """The ledger, lock and member files of one directory."""

    def __init__(self, root: str, fsync: bool = False) -> None:
        self.root = root
        self.path = os.path.join(root, LEDGER_NAME)
        self.lock_path = os.path.join(root, LOCK_NAME)
        self.fsync = fsync
        self.member_files = MemberFiles(root, fsync)
        self._warned = False  # of a ledger of another version

    @contextlib.contextmanager
    def locked(self, default_quota: int, write: bool = True) -> Iterator[LedgerState]:
        """Hold the lock, read the ledger (rebuilt when it must be: the module docstring; ``default_quota`` for a
        new one), yield it, write back what changed (if ``write``). Raises OSError when the files cannot be
        created, locked or written."""
        lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            state = self._load(default_quota)
            yield state
            if write:
                self.save(state)
        finally:
            os.close(lock_fd)  # closing the descriptor releases the lock

    def save(self, state: LedgerState) -> None:
        """Write what changed now: the member files, then the ledger. Only inside ``locked``."""
        self.member_files.save(state.members, state.roster)
        out = _dump(state)
        if out != state.written:
            self._replace(out, created=not state.written)
            state.written = out

    def read(self, default_quota: int) -> LedgerState:
        """A snapshot of the ledger (taken under the lock, changes discarded)."""
        with self.locked(default_quota, write=False) as state:
            return LedgerState(state.quota, dict(state.bytes), {k: dict(m) for k, m in state.members.items()},
                               state.fresh, state.recounted)

    def _load(self, default_quota: int) -> LedgerState:
        roster = self.member_files.load(time.time())
        raw = self._read()
        state = _parse(raw)
        if state is None:
            self._invalid(raw)
            quotas = [m["quota"] for m in roster.live.values() if isinstance(m.get("quota"), int) and m["quota"] > 0]
            state = LedgerState(min(quotas, default=default_quota), fresh=True)
        state.members, state.roster, state.written = roster.live, roster, raw
        if state.fresh or roster.died:
            state.bytes = count_records(self.root)
            state.recounted = True
        return state

    def _invalid(self, raw: bytes) -> None:
        """The ledger is about to be rebuilt: remove the temp file a killed writer of version 3 may have left, and
        warn once when a process of another kvtier version writes it (each version then rebuilds the other's
        ledger in every transaction: correct, but a walk of the whole directory each time)."""
        discard(self.path + ".tmp")
        try:
            version = json.loads(raw).get("kvtier_ledger")
        except (ValueError, AttributeError):
            return
        if isinstance(version, int) and version != LEDGER_VERSION and not self._warned:
            self._warned = True
            log.warning("the disk tier ledger %s is version %d, written by another kvtier version (this one writes "
                        "%d): each transaction counts the directory's files again; run one kvtier version per "
                        "shared directory", self.path, version, LEDGER_VERSION)

    def _read(self) -> bytes:
        """The ledger file's bytes; none when it is absent or unreadable (then it is rebuilt)."""
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return b""
        except OSError as exc:
            log.warning("cannot read the disk tier ledger %s (rebuilding it from the files): %s", self.path, exc)
            return b""

    def _replace(self, data: bytes, created: bool) -> None:
        """Write the ledger file in place: ``data`` from its start, then cut to its length (the module docstring);
        with ``fsync``, the directory too where the file is (perhaps) new."""
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, TEMP_MODE)
        try:
            write_all(fd, [data], at=0)  # every byte, or an OSError
            step("ledger:written")
            os.ftruncate(fd, len(data))
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if self.fsync and created:
            fsync_dir(self.root)
        step("ledger:whole")
