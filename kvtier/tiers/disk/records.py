"""The disk tier's index: key -> file size, per namespace in write order, and which namespaces are this
process's own (kvtier.tiers.disk.shared has the rule). Touched on the event loop thread only."""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator

from kvtier.records.keys import DIGEST_BYTES, Key
from kvtier.tiers.disk.shared import Victim


class Records:
    """Every record this tier knows of, and the bytes of those in its own namespaces (``used``)."""

    def __init__(self) -> None:
        self.index: dict[Key, int] = {}
        self.spaces: dict[bytes, dict[Key, int]] = {}  # the index per namespace, oldest first
        self.own: set[bytes] = set()
        self.used = 0

    def clear(self) -> None:
        self.index.clear()
        self.spaces.clear()
        self.used = 0

    def is_own(self, key: Key) -> bool:
        return key[:DIGEST_BYTES] in self.own

    def take(self, spaces: Iterable[bytes]) -> None:
        """Count these namespaces as our own from now on."""
        for space in spaces:
            if space not in self.own:
                self.own.add(space)
                self.used += sum(self.spaces.get(space, {}).values())

    def add(self, key: Key, size: int) -> None:
        """Index a record (again: it moves to the newest end)."""
        self.forget(key)
        self.index[key] = size
        space = key[:DIGEST_BYTES]
        self.spaces.setdefault(space, {})[key] = size
        if space in self.own:
            self.used += size

    def forget(self, key: Key) -> None:
        size = self.index.pop(key, None)
        if size is None:
            return
        space = key[:DIGEST_BYTES]
        records = self.spaces.get(space)
        if records is not None:
            records.pop(key, None)
            if not records:
                del self.spaces[space]
        if space in self.own:
            self.used -= size

    def victims(self, nbytes: int, keep: Container[Key], foreign: Container[bytes],
                orphans: bool = True) -> Iterator[Victim]:
        """Records that may go to free ``nbytes``, in the order to try them: our namespaces' oldest (taken in
        turn from each); then, with ``orphans``, the oldest of other namespaces, first those not in ``foreign``
        (served by another running process, as last seen: the writer checks again under the lock). Up to
        ``nbytes`` from each of these three groups; never a key of ``keep``."""
        others = [s for s in self.spaces if s not in self.own]
        groups = [([s for s in self.own if s in self.spaces], True)]
        if orphans:
            groups += [([s for s in others if s not in foreign], False), ([s for s in others if s in foreign], False)]
        for spaces, mine in groups:
            iterators = [iter(self.spaces[s].items()) for s in spaces]
            left = nbytes
            while iterators and left > 0:
                for it in list(iterators):
                    item = next(it, None)
                    if item is None:
                        iterators.remove(it)
                    elif item[0] not in keep and left > 0:
                        left -= item[1]
                        yield Victim(item[0], mine)
