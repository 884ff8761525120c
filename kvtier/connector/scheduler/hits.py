"""How many chunks of a prompt each KV-cache group can restore, and the request's hit (pure logic, no I/O).

A hit of ``n`` chunks means the engine skips the first ``n * chunk_size`` tokens. What each group must find in
the tiers for that:

* full attention, MLA: every chunk ``0 .. n-1``;
* sliding window (``w`` tokens): only the chunks covering the ``w - 1`` tokens before the hit point, since the
  first computed token attends to nothing older; earlier chunks may be missing;
* Mamba / linear attention: its recurrent state at the hit point, stored with chunk ``n - 1`` (a state is valid
  only at its exact boundary: a shorter hit cannot be cut out of a longer one). A state without its attention
  prefix is useless, and the reverse: the hit is the longest boundary where every group has what it needs.

The request's hit is the largest ``n`` every group accepts, at most ``limit`` (which keeps at least one token
to compute).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.layout import UNSERVED, GroupKind


@dataclass(frozen=True)
class GroupNeed:
    """What one group needs restored: its kind and, for sliding window, the window in tokens."""

    kind: GroupKind
    sliding_window: int = 0

    def needed(self, n: int, chunk_size: int) -> range:
        """Chunk indices that must be loaded for a hit of ``n`` chunks."""
        if n <= 0 or self.kind in UNSERVED:
            return range(0)
        if self.kind is GroupKind.SLIDING_WINDOW:
            first_token = max(0, n * chunk_size - (self.sliding_window - 1))
            return range(first_token // chunk_size, n)
        if self.kind is GroupKind.MAMBA:
            return range(n - 1, n)
        return range(n)

    def accepts(self, n: int, present: Sequence[bool], chunk_size: int) -> bool:
        """True when a hit of ``n`` chunks is restorable given which chunks are ``present``."""
        if n == 0:
            return True
        if self.kind in UNSERVED:
            return False
        return all(i < len(present) and present[i] for i in self.needed(n, chunk_size))


def hit_limit(num_tokens: int, chunk_size: int) -> int:
    """Most chunks a request may hit: never the whole prompt, at least one token is computed."""
    if num_tokens <= 1:
        return 0
    return (num_tokens - 1) // chunk_size


def best_hit(needs: Sequence[GroupNeed], present: Sequence[Sequence[bool]], chunk_size: int,
             limit: int) -> int:
    """Largest ``n <= limit`` chunks every group can restore (``present[g][i]``: chunk ``i`` of group ``g``)."""
    upper = limit
    windowed: list[tuple[GroupNeed, Sequence[bool]]] = []
    for need, pres in zip(needs, present, strict=True):
        if need.kind in UNSERVED:
            return 0
        if need.kind in (GroupKind.SLIDING_WINDOW, GroupKind.MAMBA):
            windowed.append((need, pres))
        else:
            upper = min(upper, _prefix(pres))
    for n in range(upper, 0, -1):
        if all(need.accepts(n, pres, chunk_size) for need, pres in windowed):
            return n
    return 0


def _prefix(present: Sequence[bool]) -> int:
    n = 0
    while n < len(present) and present[n]:
        n += 1
    return n
