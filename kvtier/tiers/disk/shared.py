"""One disk directory, several processes: whose namespaces are whose, the shared quota, and the manifests.

The rule (the disk tier's docstring says why):

* The directory has one quota, kept in its ledger (kvtier.tiers.disk.ledger): the capacity of the process that
  created the ledger. A process configured with another capacity logs a warning; it keeps the directory's
  quota for the whole directory and its own capacity for its own namespaces.
* Every put counts its bytes in the ledger under the lock. When the directory would go over its quota, a
  process whose namespaces (with the new bytes) stay within a fair share (the quota split evenly between the
  namespaces running processes serve) makes room from the oldest records of namespaces no running process
  serves (orphans), then from the oldest of the other running process's namespace furthest over its share,
  never below that share, then from its own oldest. A process at or over its share deletes its own namespaces'
  oldest records, then orphans'. Nothing else deletes another running process's records; what still does not
  fit is refused. A namespace is an orphan once no live ledger member names it (a member leaves when its tier
  closes; one on this host whose pid is gone is dropped: kvtier.tiers.disk.members).
* A process's namespaces: those it was told of (``DiskTier.describe``) and those it writes; without a
  description, at start also those whose directory has no manifest and that no other running process serves
  (a ``TieredStore`` of raw keys adopts what its earlier run wrote).
* The ledger counts the record files exactly, in one transaction per put: the put writes its records into temp
  files (lock not held), then, under the lock, counts each record by what its file adds (its size less the file
  it replaces, as found then), making room by the rule above, writes the ledger, and renames the counted records
  into place; one that would still take the directory over its quota is dropped. Deletions unlink and uncount
  under the lock. Two processes writing one key thus count it once. The temp files of the puts in flight are
  not counted: the directory may hold one batch of them per writing process beyond its quota.

The blocking methods run in worker threads; the tier calls them with what it read on the event loop thread.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtier.records.keys import DIGEST_BYTES, Key
from kvtier.tiers.disk.files import Staged, discard, fsync_dir, write_manifest
from kvtier.tiers.disk.index import SUFFIX, Layout, ScanResult, count_records
from kvtier.tiers.disk.ledger import HOST, Ledger, LedgerState, step
from kvtier.tiers.disk.members import SEEN_EVERY
from kvtier.tiers.manifest import read_manifest, same_namespace

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Victim:
    """A record the writer may delete to make room: its key, and whether it is ours (else an orphan's)."""

    key: Key
    own: bool


class TierClosed(Exception):
    """The tier closed while a batch was being staged: the batch is dropped."""


class SharedDirectory:
    """This tier's membership of its directory's ledger."""

    def __init__(self, name: str, layout: Layout, capacity: int, fsync: bool = False) -> None:
        self.name = name
        self.layout = layout
        self.capacity = capacity
        self.fsync = fsync
        self.ledger = Ledger(layout.root, fsync)
        self.me = f"{HOST}:{os.getpid()}:{secrets.token_hex(4)}"
        self.quota = capacity  # the directory's, as last read
        self.total = 0  # the directory's bytes, as last read
        self.foreign: set[bytes] = set()  # namespaces other running processes serve, as last read
        self.described: dict[bytes, dict[str, Any]] = {}
        self.manifested: set[bytes] = set()
        self.closed = False  # the tier closed: a batch staged before is dropped, never counted or placed

    # ---- transactions (blocking) ----------------------------------------------------------------------
    def _note(self, state: LedgerState, own: Sequence[bytes]) -> None:
        """Register this member (its capacity, namespaces, the quota, last seen) and remember what the ledger says."""
        member = state.members.setdefault(self.me, {"host": HOST, "pid": os.getpid(), "capacity": self.capacity,
                                                    "namespaces": []})
        known = set(member["namespaces"])
        member["namespaces"] = member["namespaces"] + sorted(ns.hex() for ns in own if ns.hex() not in known)
        member["quota"] = state.quota
        now = time.time()
        if now - member.get("seen", 0.0) >= SEEN_EVERY:  # not every transaction: each change rewrites its file
            member["seen"] = round(now, 1)
        self.quota = state.quota
        self.total = state.total()
        self.foreign = {bytes.fromhex(h) for h in state.claimed_by_others(self.me)}

    def join(self, scan: Callable[[], ScanResult], own: Sequence[bytes]) -> ScanResult:
        """Enter the ledger, scan the directory (the lock not held: others write meanwhile), then recount every
        namespace's bytes from the record files under the lock (the scan removed invalid ones; a purge, or a
        process of another host killed mid-transaction, may have left counts no file holds)."""
        with self.ledger.locked(self.capacity) as state:
            self._note(state, own)
            self._warn_quota(state)
        result = scan()
        with self.ledger.locked(self.capacity) as state:
            if not state.recounted:
                state.bytes = count_records(self.layout.root)
            self._note(state, ())
        return result

    def _warn_quota(self, state: LedgerState) -> None:
        if state.quota != self.capacity:
            log.warning("disk tier %s: %s is shared with a quota of %d bytes (the capacity of the process that "
                        "created %s); this tier's capacity of %d bytes limits its own namespaces only; give every "
                        "process the same capacity, or remove that file while no process uses the directory",
                        self.name, self.layout.root, state.quota, self.ledger.path, self.capacity)
        for other in state.others(self.me):
            if other.get("capacity") != self.capacity:
                log.warning("disk tier %s: process %s shares %s with a capacity of %s bytes, this one %d",
                            self.name, other.get("pid"), self.layout.root, other.get("capacity"), self.capacity)

    def leave(self) -> None:
        """Leave the ledger (the others' fair share stops counting this process); a failure is logged."""
        try:
            with self.ledger.locked(self.capacity) as state:
                state.members.pop(self.me, None)
        except OSError as exc:
            log.warning("disk tier %s: cannot leave the ledger of %s: %s", self.name, self.layout.root, exc)

    def claim(self, own: Sequence[bytes]) -> None:
        """Name more namespaces as this member's; write the manifests of those with a directory."""
        with self.ledger.locked(self.capacity) as state:
            self._note(state, own)
        self.write_manifests(own)

    def store(self, items: Sequence[tuple[Key, T]], victims: Sequence[Victim], own: Sequence[bytes],
              stage: Callable[[Sequence[tuple[Key, T]]], list[Staged | Exception]],
              ) -> tuple[list[int | Exception | None], dict[Key, int]]:
        """Write the manifests of the items' namespaces, ``stage`` every item into its temp file (the lock not
        held), then in one transaction under the lock: make room for each staged record that adds bytes,
        deleting ``victims`` as the rule allows, count it (one that still does not fit is dropped), write the
        ledger, and rename the counted records into place (a process killed in between leaves an overcount,
        never an undercount). Per item: its file size, the error that dropped it, or None where the directory
        is full; and the records deleted for room with their sizes."""
        self.write_manifests(sorted({k[:DIGEST_BYTES] for k, _ in items}))
        staged = stage(items)
        out: list[int | Exception | None] = [s if isinstance(s, Exception) else None for s in staged]
        evicted: dict[Key, int] = {}
        if not any(isinstance(s, Staged) for s in staged):
            return out, evicted
        try:
            with self.ledger.locked(self.capacity) as state:
                if self.closed:
                    raise TierClosed(f"disk tier {self.name} closed while the batch was written")
                self._note(state, own)
                placing = self._admit(state, [k for k, _ in items], staged, victims, evicted)
                if evicted:
                    step("evicted")
                self.ledger.save(state)
                step("counted")
                for i, done, delta in placing:
                    out[i] = rename(state, items[i][0], done, delta)
                step("placed")
                self.total = state.total()
        except BaseException as exc:  # no staged file outlives a failed transaction; only OSErrors are a miss
            for i, left in enumerate(staged):
                if isinstance(left, Staged) and not isinstance(out[i], int):
                    discard(left.tmp)
                    out[i] = exc if isinstance(exc, OSError) else None
            if isinstance(exc, TierClosed):
                return out, evicted
            if not isinstance(exc, OSError):
                raise
            log.warning("disk tier %s: cannot count writes in the ledger of %s: %s", self.name, self.layout.root, exc)
        if self.fsync:
            sync_dirs(self.name, [s.final for s, got in zip(staged, out, strict=True)
                                  if isinstance(s, Staged) and isinstance(got, int)])
        return out, evicted

    def _admit(self, state: LedgerState, keys: Sequence[Key], staged: Sequence[Staged | Exception],
               victims: Sequence[Victim], evicted: dict[Key, int]) -> list[tuple[int, Staged, int]]:
        """Count each staged record by what its file adds (its size less the file it replaces, as found now),
        making room while the directory would go over its quota: below our fair share from orphans, then from
        the namespace furthest over its share, then from our own; else from our own, then orphans. One that
        still does not fit is dropped (its temp file removed). The counted ones: ``(position, staged, bytes)``."""
        foreign = state.claimed_by_others(self.me)
        mine = [v for v in victims if v.own]
        orphans = [v for v in victims if not v.own and v.key[:DIGEST_BYTES].hex() not in foreign]
        placing: list[tuple[int, Staged, int]] = []
        for i, (key, record) in enumerate(zip(keys, staged, strict=True)):
            if not isinstance(record, Staged):
                continue
            need = record.size - size_of(record.final)
            if need > 0 and state.total() + need > state.quota:
                if self._below_share(state, need):
                    self._take(state, orphans, need, evicted)
                    if state.total() + need > state.quota:
                        self._fair_share(state, state.total() + need - state.quota, evicted)
                for pending in (mine, orphans):
                    self._take(state, pending, need, evicted)
                if state.total() + need > state.quota:
                    discard(record.tmp)
                    continue
            state.add(key[:DIGEST_BYTES].hex(), need)
            placing.append((i, record, need))
        return placing

    def _take(self, state: LedgerState, pending: list[Victim], need: int, evicted: dict[Key, int]) -> None:
        """Delete records from the front of ``pending`` (removing them from it) until ``need`` more bytes fit."""
        while state.total() + need > state.quota and pending:
            self._unlink(state, pending.pop(0).key, evicted)

    def _below_share(self, state: LedgerState, need: int) -> bool:
        """Whether our namespaces, with ``need`` more bytes, stay within a fair share of the quota."""
        mine = set(state.members.get(self.me, {}).get("namespaces", ()))
        live = mine | state.claimed_by_others(self.me)
        return sum(state.bytes.get(h, 0) for h in mine) + need <= state.quota // max(1, len(live))

    def _fair_share(self, state: LedgerState, wanted: int, evicted: dict[Key, int]) -> int:
        """Free up to ``wanted`` bytes from the namespace furthest over its fair share (the quota split evenly
        between the namespaces running processes serve), oldest files first, never taking it below its share;
        the bytes freed. The caller checks that ours are below our share."""
        mine = set(state.members.get(self.me, {}).get("namespaces", ()))
        share = state.quota // max(1, len(mine | state.claimed_by_others(self.me)))
        richest = max((h for h in state.bytes if h not in mine), key=lambda h: state.bytes.get(h, 0), default=None)
        if richest is None or state.bytes.get(richest, 0) <= share:
            return 0
        freed = 0
        for key in _oldest(os.path.join(self.layout.root, richest)):
            if freed >= wanted:
                break
            if state.bytes.get(richest, 0) - size_of(self.layout.path(key)) < share:
                break  # this record would take the namespace below its share
            freed += self._unlink(state, key, evicted)
        return freed

    def _unlink(self, state: LedgerState, key: Key, evicted: dict[Key, int]) -> int:
        path = self.layout.path(key)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            log.warning("disk tier %s: cannot remove %s: %s", self.name, path, exc)
            return 0
        state.add(key[:DIGEST_BYTES].hex(), -size)
        evicted[key] = size
        return size

    def remove(self, keys: Sequence[Key]) -> dict[Key, int]:
        """Delete record files and uncount them; return the size of each one that existed."""
        removed: dict[Key, int] = {}
        with self.ledger.locked(self.capacity) as state:
            for key in keys:
                self._unlink(state, key, removed)
            self.total = state.total()
        return removed

    # ---- manifests (blocking) -------------------------------------------------------------------------
    def write_manifests(self, spaces: Sequence[bytes]) -> None:
        """Write the manifest of each described namespace (its directory made when absent) that lacks an equal
        one. A failure is logged: records do not depend on manifests."""
        for space in spaces:
            manifest = self.described.get(space)
            if manifest is None or space in self.manifested:
                continue
            directory = os.path.join(self.layout.root, space.hex())
            try:
                if not os.path.isdir(directory):
                    self.layout.make_dirs(directory)
                found = read_manifest(directory)
                if found is None or not same_namespace(found, manifest):
                    write_manifest(directory, manifest)
                self.manifested.add(space)
            except OSError as exc:
                log.warning("disk tier %s: cannot write the manifest of %s: %s", self.name, directory, exc)


def _oldest(directory: str) -> list[Key]:
    """Keys of the record files under a namespace directory, oldest first."""
    found: list[tuple[float, Key]] = []
    for dirpath, _, files in os.walk(directory):
        for name in files:
            if name.endswith(SUFFIX):
                try:
                    found.append((os.stat(os.path.join(dirpath, name)).st_mtime, bytes.fromhex(name[:-len(SUFFIX)])))
                except (OSError, ValueError):
                    continue
    return [key for _, key in sorted(found)]


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
