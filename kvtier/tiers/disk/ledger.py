"""The usage ledger of a disk directory that several processes share (blocking: run it in worker threads).

``<root>/.kvtier-ledger`` is a small JSON file, read and rewritten only while holding ``fcntl.flock`` on
``<root>/.kvtier-lock`` (a new descriptor per transaction, so threads of one process exclude each other too)::

    {"kvtier_ledger": 1, "quota": <bytes for the whole directory>,
     "bytes": {"<namespace hex>": <bytes of its record files>, ...},
     "members": {"<host>:<pid>:<token>": {"host": str, "pid": int, "capacity": int,
                                           "namespaces": ["<namespace hex>", ...], "seen": float}, ...}}

A member is one open disk tier. It is gone when its process is (same host: the pid no longer exists; another
host: not seen for ``GONE_AFTER`` seconds); gone members are dropped on every transaction. A file that is
absent or invalid reads as a fresh ledger (``fresh``): the caller rebuilds its counts from a scan.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

LEDGER_NAME = ".kvtier-ledger"
LOCK_NAME = ".kvtier-lock"
LEDGER_VERSION = 1
GONE_AFTER = 3600.0  # seconds: a member on another host not seen for this long is gone
HOST = socket.gethostname()


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def is_alive(member: dict[str, Any], now: float) -> bool:
    """Whether a member's process still runs (see the module docstring)."""
    if member.get("host") == HOST:
        return isinstance(member.get("pid"), int) and pid_exists(member["pid"])
    seen = member.get("seen")
    return isinstance(seen, (int, float)) and now - seen < GONE_AFTER


@dataclass
class LedgerState:
    """The ledger as read under the lock; changes are written back when the transaction ends."""

    quota: int
    bytes: dict[str, int] = field(default_factory=dict)
    members: dict[str, dict[str, Any]] = field(default_factory=dict)
    fresh: bool = False  # the file was absent or invalid

    def total(self) -> int:
        return sum(self.bytes.values())

    def add(self, namespace: str, n: int) -> None:
        """Count ``n`` more bytes (negative: fewer) for ``namespace``; never below zero."""
        left = self.bytes.get(namespace, 0) + n
        if left > 0:
            self.bytes[namespace] = left
        else:
            self.bytes.pop(namespace, None)

    def claimed_by_others(self, me: str) -> set[str]:
        """Namespaces that live members other than ``me`` serve (members of ``me``'s own process included:
        one process's tiers on one directory act as one)."""
        pid = self.members.get(me, {}).get("pid", os.getpid())
        out: set[str] = set()
        for name, member in self.members.items():
            if name != me and not (member.get("host") == HOST and member.get("pid") == pid):
                out.update(member.get("namespaces", ()))
        return out

    def others(self, me: str) -> list[dict[str, Any]]:
        """The live members of other processes."""
        pid = self.members.get(me, {}).get("pid", os.getpid())
        return [m for n, m in self.members.items() if n != me and not (m.get("host") == HOST and m.get("pid") == pid)]


def _parse(raw: bytes, default_quota: int) -> LedgerState:
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("kvtier_ledger") != LEDGER_VERSION:
            raise ValueError("not a kvtier ledger")
        quota, counts, members = data["quota"], data["bytes"], data["members"]
        if not isinstance(quota, int) or quota <= 0 or not isinstance(counts, dict) or not isinstance(members, dict):
            raise ValueError("bad fields")
        state = LedgerState(quota, {str(k): int(v) for k, v in counts.items() if int(v) > 0},
                            {str(k): dict(v) for k, v in members.items() if isinstance(v, dict)})
    except (ValueError, KeyError, TypeError):
        return LedgerState(default_quota, fresh=True)
    now = time.time()
    state.members = {k: m for k, m in state.members.items() if is_alive(m, now)}
    return state


def _dump(state: LedgerState) -> bytes:
    body = {"kvtier_ledger": LEDGER_VERSION, "quota": state.quota, "bytes": state.bytes, "members": state.members}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


class Ledger:
    """The ledger and lock files of one directory."""

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, LEDGER_NAME)
        self.lock_path = os.path.join(root, LOCK_NAME)

    @contextlib.contextmanager
    def locked(self, default_quota: int, write: bool = True) -> Iterator[LedgerState]:
        """Hold the lock, read the ledger (``default_quota`` for a fresh one), yield it, write it back if it
        changed (and ``write``). Raises OSError when the files cannot be created or locked."""
        lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                raw = _read_all(fd)
                state = _parse(raw, default_quota)
                yield state
                out = _dump(state)
                if write and out != raw:
                    os.pwrite(fd, out, 0)
                    os.ftruncate(fd, len(out))
            finally:
                os.close(fd)
        finally:
            os.close(lock_fd)  # closing the descriptor releases the lock

    def read(self, default_quota: int) -> LedgerState:
        """A snapshot of the ledger (taken under the lock, changes discarded)."""
        with self.locked(default_quota, write=False) as state:
            return LedgerState(state.quota, dict(state.bytes), {k: dict(m) for k, m in state.members.items()},
                               state.fresh)


def _read_all(fd: int) -> bytes:
    parts = []
    offset = 0
    while chunk := os.pread(fd, 1 << 16, offset):
        parts.append(chunk)
        offset += len(chunk)
    return b"".join(parts)
