"""Which requests' chunks are saved (``policy.admission``): all of them, or only where saving pays.

``learned``: a request's chunks are saved only where chunks like them are asked for again, beyond what the
engine's own prefix cache still holds, often enough to pay for their saves. A cache that saves what nobody reads
again slows the requests it does not help (the copies out of the engine's blocks, the writes beside its compute).

* **Classes.** A request gets a class at its first lookup: how deep its hit reaches (the engine's own cache and
  the chunks the admission remembers) and how long its prompt is, each in powers of two of chunks.
* **Offers.** Every chunk a request could save is an offer of its class, admitted or not. Its key is remembered
  (a ghost: key -> class and when it was offered) for as many chunks as the tiers it would go to hold: a reuse
  later than that would find it evicted anyway.
* **Reuses.** A lookup asks for chunks past the engine's own computed tokens. Each of them a ghost holds, in a run
  from the engine's hit point, is a reuse of its class: a hit kvtier gives, or would have given had the chunk been
  saved. So a class that is not saved still learns what saving it would give.
* **The decision.** A class is saved while its reuses reach ``min_reuse`` per offer. A reuse comes long after its
  offer (a conversation's next turn), so the reuses of the last window (as many offers as the ghosts hold) are
  compared with the offers of one window that ended that long ago: most of their reuses have been seen (while
  fewer offers than a lag and a window have been made, both spans are the offers made before the lag). That lag
  is the age (in offers) within which four in five reuses came, counted with a half-life of one window so that it
  follows a workload whose reuses come sooner or later than before; before any reuse it is the whole window. A class
  with fewer than ``WARMUP`` offers in that matched window is saved, so a new workload starts saving and a reuse
  that takes long is never judged before it could come. A request decides once, at its first save, and keeps the
  decision, so what it saves is always a whole prefix.

Memory: one ghost per remembered chunk (a key and two ints), bounded by the tiers' capacity in chunks and by
``MAX_GHOSTS``, and per class a count of offers and reuses every 1/64 of a window.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Sequence

from kvtier.records.keys import Key

WARMUP = 256  # offers a class gets in its matched window before its reuse rate decides
DEPTH_BUCKETS = 6  # hit depth: 0, 1, 2-3, 4-7, 8-15, 16+ chunks
SIZE_BUCKETS = 8  # prompt length: 0, 1, 2-3, ..., 64+ chunks
CLASSES = DEPTH_BUCKETS * SIZE_BUCKETS
MAX_GHOSTS = 1 << 18  # chunks remembered at most (about 65 MB with their keys)
MARKS_PER_WINDOW = 64  # counts kept per window, to read them as they were some offers ago
LAG_SHARE = 0.8  # the lag: the age within which this share of the reuses came
AGE_BINS = 40  # reuse ages in powers of two


def request_class(hit_chunks: int, prompt_chunks: int) -> int:
    """The class of a request whose lookup reached ``hit_chunks`` deep, of a prompt of ``prompt_chunks``."""
    depth = min(hit_chunks.bit_length(), DEPTH_BUCKETS - 1)
    size = min(prompt_chunks.bit_length(), SIZE_BUCKETS - 1)
    return depth * SIZE_BUCKETS + size


class SaveAdmission:
    """Learns, per request class, whether chunks saved get asked for again beyond the engine's own cache."""

    def __init__(self, ghosts: int, min_reuse: float) -> None:
        if ghosts < 1:
            raise ValueError("ghosts must be at least 1")
        self.window = min(ghosts, MAX_GHOSTS)
        self.min_reuse = min_reuse
        self.offers = [0] * CLASSES  # since the start
        self.reuses = [0] * CLASSES
        self._ghosts: OrderedDict[Key, tuple[int, int]] = OrderedDict()  # key -> (class, offer number)
        self._offered = 0  # offers so far
        self._step = max(1, self.window // MARKS_PER_WINDOW)
        self._marks: deque[tuple[int, list[int], list[int]]] = deque()  # (offers so far, offers, reuses)
        self._ages = [0.0] * AGE_BINS  # reuses by the bit length of their age in offers, halved every window

    def admits(self, cls: int) -> bool:
        """Whether a request of class ``cls`` saves its chunks now."""
        offered, reused = self.matched(cls)
        return offered < WARMUP or reused >= self.min_reuse * offered

    def matched(self, cls: int) -> tuple[int, int]:
        """Offers of ``cls`` in the window that ended a lag ago, and its reuses in the last window. Until a lag and
        a window of offers have passed, both spans are as long as the offers made before the lag: a shorter span
        of offers against a whole window of reuses (those of later offers too) would overstate the reuse."""
        now, lag = self._offered, self.lag()
        span = max(0, min(self.window, now - lag))
        offered = self._at(now - lag)[0][cls] - self._at(now - lag - span)[0][cls]
        reused = self.reuses[cls] - self._at(now - span)[1][cls]
        return offered, reused

    def lag(self) -> int:
        """Offers within which ``LAG_SHARE`` of the reuses came after their offer, older ones counting half per window
        (the window before any reuse)."""
        total = sum(self._ages)
        if not total:
            return self.window
        seen = 0.0
        for bits, n in enumerate(self._ages):
            seen += n
            if seen >= LAG_SHARE * total:
                return min(1 << bits, self.window)
        return self.window

    def _at(self, offered: int) -> tuple[list[int], list[int]]:
        """The counts as they were after ``offered`` offers (the latest mark at or before it; zeros before any)."""
        i = bisect.bisect_right(self._marks, offered, key=lambda mark: mark[0]) - 1
        if offered <= 0 or i < 0:
            return [0] * CLASSES, [0] * CLASSES
        _, offers, reuses = self._marks[i]
        return offers, reuses

    def offer(self, cls: int, keys: Sequence[Key]) -> None:
        """Chunks a request of class ``cls`` could save (admitted or not): remembered as its ghosts."""
        ghosts = self._ghosts
        for key in keys:
            self._offered += 1
            self.offers[cls] += 1
            ghosts[key] = (cls, self._offered)
            ghosts.move_to_end(key)
            if self._offered % self._step == 0:
                self._marks.append((self._offered, list(self.offers), list(self.reuses)))
                while self._marks[0][0] < self._offered - 2 * self.window - self._step:
                    self._marks.popleft()
            if self._offered % self.window == 0:
                self._ages = [n / 2 for n in self._ages]
        while len(ghosts) > self.window:
            ghosts.popitem(last=False)

    def asked(self, keys: Sequence[Key]) -> int:
        """A lookup asked for ``keys``, the chunks past the engine's own hit in prompt order: credit each ghost of
        the run they start with to its class; how many were credited."""
        n = 0
        for key in keys:
            ghost = self._ghosts.get(key)
            if ghost is None:
                break
            self._ghosts.move_to_end(key)
            cls, when = ghost
            self.reuses[cls] += 1
            self._ages[min((self._offered - when).bit_length(), AGE_BINS - 1)] += 1
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._ghosts)
