"""Member files of a shared disk directory (blocking; read and written only under the ledger's lock).

``<root>/.kvtier-members/<member id, %-quoted>.json`` holds one open disk tier's entry::

    {"host": str, "pid": int, "capacity": int, "quota": int, "namespaces": ["<namespace hex>", ...],
     "seen": float}

Each file is written whole (temp file and rename, ``kvtier.tiers.disk.files``), so membership survives whatever
happens to the ledger file: a ledger rebuilt from the files still knows which running processes serve which
namespaces. A member is gone when its process is (same host: the pid no longer exists; another host: not seen
for ``GONE_AFTER`` seconds); a gone member's file is removed by the next transaction that writes.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from kvtier.tiers.disk.files import discard, fsync_dir, open_temp, remove, write_and_rename

MEMBERS_NAME = ".kvtier-members"
SUFFIX = ".json"
GONE_AFTER = 3600.0  # seconds: a member on another host not seen for this long is gone
SEEN_EVERY = 60.0  # seconds: a member refreshes its "seen" (rewriting its file) at most this often
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


def died_here(member: dict[str, Any]) -> bool:
    """A member of this host whose process is gone without leaving (killed, crashed)."""
    return member.get("host") == HOST and not is_alive(member, 0.0)


@dataclass
class Roster:
    """The member files as read: the live members, and what each file held (to write back only changes)."""

    live: dict[str, dict[str, Any]] = field(default_factory=dict)
    on_disk: dict[str, str] = field(default_factory=dict)  # member id -> the JSON its file holds ("" unreadable)
    died: bool = False  # a member of this host died without leaving (it may have died inside a transaction)


class MemberFiles:
    """The member directory of one shared disk directory."""

    def __init__(self, root: str, fsync: bool) -> None:
        self.path = os.path.join(root, MEMBERS_NAME)
        self.fsync = fsync

    def load(self, now: float) -> Roster:
        """Read every member file; gone members are left out of ``live`` (their files go at the next save)."""
        roster = Roster()
        try:
            names = [n for n in os.listdir(self.path) if n.endswith(SUFFIX)]
        except FileNotFoundError:
            return roster
        for name in names:
            member_id = urllib.parse.unquote(name[:-len(SUFFIX)])
            try:
                with open(os.path.join(self.path, name), "rb") as f:
                    text = f.read().decode()
                member = json.loads(text)
            except (OSError, ValueError):
                roster.on_disk[member_id] = ""
                continue
            roster.on_disk[member_id] = text
            if not isinstance(member, dict):
                continue
            if is_alive(member, now):
                roster.live[member_id] = member
            else:
                roster.died |= died_here(member)
        return roster

    def save(self, members: dict[str, dict[str, Any]], roster: Roster) -> None:
        """Write the file of each member whose entry changed, remove those of members no longer listed."""
        changed = False
        for member_id, member in members.items():
            text = _dump(member)
            if roster.on_disk.get(member_id) != text:
                os.makedirs(self.path, 0o700, exist_ok=True)
                path = self._file(member_id)
                tmp = path + ".tmp"  # one writer at a time (the lock): a fixed name, any leftover is stale
                discard(tmp)
                write_and_rename(open_temp(tmp), tmp, path, [text.encode()], self.fsync)
                roster.on_disk[member_id] = text
                changed = True
        for member_id in [m for m in roster.on_disk if m not in members]:
            remove(self._file(member_id))
            del roster.on_disk[member_id]
            changed = True
        if changed and self.fsync and os.path.isdir(self.path):
            fsync_dir(self.path)

    def _file(self, member_id: str) -> str:
        return os.path.join(self.path, urllib.parse.quote(member_id, safe="") + SUFFIX)


def _dump(member: dict[str, Any]) -> str:
    return json.dumps(member, sort_keys=True, separators=(",", ":"))
