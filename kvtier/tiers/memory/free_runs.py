"""Free slot runs of a slot pool: first fit for one run, largest runs first when fragmented, coalescing on return.

Slots below the high-water mark (``high``: the end of the highest run ever taken) are preferred: a pool's memory
is backed only where it was written (:mod:`kvtier.tiers.memory.arena`), so reusing those slots first keeps the
mark, and the memory, at the peak of what was stored when records have one size.
"""

from __future__ import annotations

Run = tuple[int, int]  # (first slot, number of slots)


class FreeRuns:
    """Free slot runs with coalescing: first fit for one run, largest runs first when fragmented; runs below
    ``high`` first (module docstring)."""

    def __init__(self, n_slots: int) -> None:
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self.free = 0
        self.high = 0
        if n_slots:
            self.give(0, n_slots)

    def _remove(self, start: int) -> int:
        count = self._by_start.pop(start)
        del self._by_end[start + count]
        self.free -= count
        return count

    def _add(self, start: int, count: int) -> None:
        self._by_start[start] = count
        self._by_end[start + count] = start
        self.free += count

    def take(self, need: int) -> list[Run] | None:
        """Reserve ``need`` slots; None when fewer are free."""
        if need > self.free:
            return None
        chosen: list[Run] = []
        # newest free run first: the slots freed last are the likeliest to still be in the CPU cache; one that
        # would raise the high-water mark only when no run below it fits
        above: Run | None = None
        for start, count in reversed(self._by_start.items()):
            if count >= need:
                if start + need <= self.high:
                    chosen = [(start, need)]
                    break
                if above is None:
                    above = (start, need)
        if above is not None and not chosen:
            chosen = [above]
        if not chosen:
            left = need
            for start, count in sorted(self._by_start.items(), key=lambda r: -r[1]):
                chosen.append((start, min(count, left)))
                left -= chosen[-1][1]
                if not left:
                    break
        for start, used in chosen:
            count = self._remove(start)
            if count > used:
                self._add(start + used, count - used)
            self.high = max(self.high, start + used)
        return chosen

    def give(self, start: int, count: int) -> None:
        """Return a run, merging it with free neighbours."""
        end = start + count
        if start in self._by_end:  # a free run ends where this one starts
            prev = self._by_end[start]
            count += self._remove(prev)
            start = prev
        if end in self._by_start:
            count += self._remove(end)
        self._add(start, count)
