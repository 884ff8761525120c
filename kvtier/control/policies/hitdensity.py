"""Prefix-aware hit density (``prefix_hd``): per-class LRU queues; evict the class tail least likely reused soon.

Designed for prefix-structured KV reuse, where a chunk is first reused minutes after it is stored (a
conversation's next turn, another question on the same document), most chunks are never reused, and no
reuse at all happens at short range, so the recency/frequency signals of ARC and S3-FIFO say little. The
policy sees requests as runs of calls in prefix order that start at a root (a key inserted with ``parent``
None) and puts each key in a class:

- ``tail``: the last chunk a request stored (usually a partial block that the next turn supersedes);
- ``reused``: accessed again once, twice, or three times or more;
- ``fresh``: never reused yet; split by whether its request continued a deep hit (a later turn) and, once
  the request ends, by how many chunks the request stored (log2 buckets).

For each class it learns how likely a key is to be accessed again at each age: reuses per age bin over
key-time spent in that bin (exposure), counting reuses of evicted keys seen through a ghost list, so that
it learns what keeping a class longer would give. The value of a key of class c and age a is the chance of
a reuse within the next ``horizon`` x capacity calls. Within a class the oldest key has the lowest value
once past the reuse peak, so eviction compares only the class tails. When a request ends its chunks are
queued again tail first, so within a class a request's head outlives its tail (as in ``prefix_lru``: a
chunk is of use only while its whole prefix is held). Ages count calls (insert and touch):
the policy needs no wall clock and no random source.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass

from kvtier.control.policies.base import EvictionPolicy, pick_unprotected
from kvtier.records.keys import Key

TAIL = 0
REUSED = (1, 2, 3)  # accessed again once, twice, three times or more
FRESH = 4  # + FRESH_SPAN * continuation + (0 while its request runs | 1 + log2 bucket of its stored count)
FRESH_SPAN = 9
NUM_CLASSES = FRESH + 2 * FRESH_SPAN
NUM_BINS = 128
BINS_PER_CAPACITY = 8
MAX_RUN = 4096  # calls without a root before the policy treats the run as ended
GROWTH = 1.25  # bin-width growth after which the occupancy is counted again


def _log2_bucket(n: int, top: int) -> int:
    """floor(log2(n + 1)), capped at ``top``."""
    return min((n + 1).bit_length() - 1, top)


@dataclass(slots=True)
class _Entry:
    cls: int
    stamp: int  # clock at last access
    uses: int
    root: bool  # inserted with parent None: starts a request


class _ClassStats:
    """Reuses and exposure (keys x bins spent) per age bin of one class, and the resulting values."""

    def __init__(self) -> None:
        self.hits = [0.0] * NUM_BINS
        self.exposure = [0.0] * NUM_BINS
        self.values = [1.0 - b / NUM_BINS for b in range(NUM_BINS)]  # LRU-like until data arrives



def _refreshed(stats: list[_ClassStats], horizon_bins: int, decay: float) -> None:
    """Every class's values from its reuses and exposure, then both decayed. values[b] = 1 - P(no reuse in bins
    b .. b + horizon - 1), where a bin's chance of a reuse is reuses over exposure, capped at 1, and a bin the
    class never saw takes the pooled chance of all classes (0 where none saw it).

    All classes at once, as arrays: a refresh runs on the engine's thread (inside a hit's plan), and the per-bin
    Python loops took 3.7-4.9 ms of a 2048-token hit in vLLM's CPU engine. Same operations in the same order as
    those loops, so the values are the same floats."""
    import numpy as np

    hits = np.array([s.hits for s in stats])
    exposure = np.array([s.exposure for s in stats])
    pooled_hits, pooled_exposure = np.zeros(NUM_BINS), np.zeros(NUM_BINS)
    for h, e in zip(hits, exposure, strict=True):  # row by row, as a running sum over the classes
        pooled_hits += h
        pooled_exposure += e
    with np.errstate(divide="ignore", invalid="ignore"):
        prior = np.where(pooled_exposure > 0, np.minimum(pooled_hits / pooled_exposure, 1.0), 0.0)
        hazard = np.where(exposure > 0, np.minimum(hits / exposure, 1.0), prior)
    keep = np.ones((len(stats), NUM_BINS + horizon_bins))
    keep[:, :NUM_BINS] = 1.0 - hazard
    stay = np.ones((len(stats), NUM_BINS))
    for j in range(horizon_bins):  # the window's product, left to right; past the last bin a factor of 1
        stay *= keep[:, j:j + NUM_BINS]
    for s, values, h, e in zip(stats, (1.0 - stay).tolist(), (hits * decay).tolist(), (exposure * decay).tolist(),
                               strict=True):
        s.values, s.hits, s.exposure = values, h, e


class _Occupancy:
    """Live keys (entries and ghosts) of one class counted by stamp bucket (``1 << shift`` calls wide), and
    in one count those old enough to sit in the last age bin for good: exposure comes from these counts,
    so a refresh costs O(buckets), not O(keys)."""

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}
        self.old = 0

    def add(self, stamp: int, shift: int, old_below: int, n: int) -> None:
        if stamp < old_below:
            self.old += n
            return
        bucket = stamp >> shift
        count = self.buckets.get(bucket, 0) + n
        if count:
            self.buckets[bucket] = count
        else:
            del self.buckets[bucket]

    def expose(self, exposure: list[float], clock: int, width: int, shift: int, elapsed: float) -> None:
        """Add ``elapsed`` bins of exposure per key, spreading a bucket's keys evenly over its stamps."""
        top = NUM_BINS - 1
        exposure[top] += elapsed * self.old
        for bucket, count in self.buckets.items():
            first = bucket << shift
            last = min(first + (1 << shift) - 1, clock)
            age, oldest = clock - last, clock - first
            share = elapsed * count / (oldest - age + 1)
            while age <= oldest:
                b = age // width
                if b >= top:
                    exposure[top] += share * (oldest - age + 1)
                    break
                end = min(oldest, (b + 1) * width - 1)
                exposure[b] += share * (end - age + 1)
                age = end + 1

    def retire(self, below_bucket: int) -> None:
        """Move the buckets under ``below_bucket`` into the old count."""
        for bucket in [b for b in self.buckets if b < below_bucket]:
            self.old += self.buckets.pop(bucket)


class PrefixHitDensityPolicy(EvictionPolicy):
    """Learned, class-based eviction for prefix-structured reuse (see the module docstring)."""

    name = "prefix_hd"

    def __init__(self, capacity: int = 0, horizon: float = 2.0, ghost_factor: float = 4.0,
                 refresh: float = 0.25, decay: float = 0.9) -> None:
        self.horizon, self.ghost_factor, self.refresh, self.decay = horizon, ghost_factor, refresh, decay
        self.occupancy = [_Occupancy() for _ in range(NUM_CLASSES)]
        self._shift = 0  # stamp buckets are 1 << _shift calls wide, about a quarter of an age bin
        self._old_below = 0  # keys stamped before this are counted as old (last age bin)
        self._counted_width = 1  # the bin width the occupancy was counted for
        self.entries: dict[Key, _Entry] = {}
        self.ghosts: OrderedDict[Key, _Entry] = OrderedDict()
        super().__init__(capacity)
        self.queues: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(NUM_CLASSES)]
        self.stats = [_ClassStats() for _ in range(NUM_CLASSES)]
        self.clock = 0
        self._refreshed_at = 0
        self._pos = 0  # position of the current call in its request
        self._hit_end = -1  # position of the request's first insert, -1 before it
        self._stored: list[Key] = []  # fresh keys stored by the current request
        self._called: list[Key] = []  # keys the current request inserted or touched, in prefix order
        self._last_insert: Key | None = None
        self.set_capacity(capacity)

    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        self.bin_width = max(1, capacity // BINS_PER_CAPACITY)
        self.refresh_period = max(64, int(capacity * self.refresh))
        self.horizon_bins = max(1, round(self.horizon * BINS_PER_CAPACITY))
        if self.bin_width > GROWTH * self._counted_width:
            self._recount()

    def _recount(self) -> None:
        """Count the keys again for the current bin width: the old count assumed a narrower one. Runs only
        when the width has grown by ``GROWTH`` since the last count (a tier filling up with no capacity hint),
        so it costs O(1) amortised per key."""
        self._counted_width = self.bin_width
        self._shift = max(self.bin_width // 4, 1).bit_length() - 1
        self._old_below = 0
        self.occupancy = [_Occupancy() for _ in range(NUM_CLASSES)]
        for entries in (self.entries, self.ghosts):
            for entry in entries.values():
                self._count(entry, 1)

    def _count(self, entry: _Entry, n: int) -> None:
        self.occupancy[entry.cls].add(entry.stamp, self._shift, self._old_below, n)

    def _age_bin(self, entry: _Entry) -> int:
        return min((self.clock - entry.stamp) // self.bin_width, NUM_BINS - 1)

    # -- request tracking and classes ------------------------------------------------------------------

    def _advance(self, root: bool) -> None:
        self.clock += 1
        if self.clock - self._refreshed_at >= self.refresh_period:
            self._refresh()
        if root:
            self._end_request()
            self._requeue_heads_last()
            self._pos, self._hit_end = 0, -1
        else:
            self._pos += 1
        self._last_insert = None

    def _end_request(self) -> None:
        """Classify the fresh keys of the request that just ended by its stored count; its last is a tail."""
        stored, self._stored = self._stored, []
        if not stored:
            return
        base = FRESH + FRESH_SPAN * (self._hit_end >= 2) + 1 + _log2_bucket(len(stored) - 1, 7)
        for key in stored:
            self._reclassify(key, base)
        if self._last_insert is not None:
            self._reclassify(self._last_insert, TAIL)

    def _note_call(self, key: Key) -> None:
        """Remember a call of the current request; a run of calls with no root (a lower tier fed by
        demotions) is cut into requests of ``MAX_RUN`` calls, so memory stays bounded."""
        self._called.append(key)
        if len(self._called) >= MAX_RUN:
            self._end_request()
            self._requeue_heads_last()

    def _requeue_heads_last(self) -> None:
        """Queue the ended request's keys again, tail first: in each class its head is now the youngest."""
        called, self._called = self._called, []
        for key in reversed(called):
            entry = self.entries.get(key)
            if entry is not None:
                self.queues[entry.cls].move_to_end(key)

    def _reclassify(self, key: Key, cls: int) -> None:
        entry = self.entries.get(key)
        if entry is not None and entry.uses == 1:
            del self.queues[entry.cls][key]
            self._count(entry, -1)
            entry.cls = cls
            self._count(entry, 1)
            self.queues[cls][key] = None

    def _fresh_class(self) -> int:
        if self._hit_end < 0:
            self._hit_end = self._pos
        return FRESH + FRESH_SPAN * (self._hit_end >= 2)

    # -- learning ----------------------------------------------------------------------------------------

    def _record_reuse(self, entry: _Entry) -> None:
        self.stats[entry.cls].hits[self._age_bin(entry)] += 1

    def _refresh(self) -> None:
        """Add the exposure since the last refresh (occupancy snapshot x bins elapsed); recompute values."""
        clock, width, shift = self.clock, self.bin_width, self._shift
        elapsed = (clock - self._refreshed_at) / width
        self._refreshed_at = clock
        for stats, occupancy in zip(self.stats, self.occupancy, strict=True):
            occupancy.expose(stats.exposure, clock, width, shift, elapsed)
        old_bucket = (clock - (NUM_BINS - 1) * width + 1) >> shift  # stamps under it stay in the last bin
        if old_bucket << shift > self._old_below:
            self._old_below = old_bucket << shift
            for occupancy in self.occupancy:
                occupancy.retire(old_bucket)
        _refreshed(self.stats, self.horizon_bins, self.decay)

    # -- the policy interface ------------------------------------------------------------------------------

    def insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self.entries:
            self.touch(key)
            return
        self._advance(parent is None)
        ghost = self.ghosts.pop(key, None)
        if ghost is not None:
            self._count(ghost, -1)
            self._record_reuse(ghost)
            entry = _Entry(REUSED[min(ghost.uses, 3) - 1], self.clock, ghost.uses + 1, parent is None)
        else:
            entry = _Entry(self._fresh_class(), self.clock, 1, parent is None)
            self._stored.append(key)
        self.entries[key] = entry
        self._count(entry, 1)
        self.queues[entry.cls][key] = None
        self._last_insert = key
        self._note_call(key)

    def touch(self, key: Key) -> None:
        entry = self.entries.get(key)
        if entry is None:
            return
        self._advance(entry.root)
        self._record_reuse(entry)
        del self.queues[entry.cls][key]
        self._count(entry, -1)
        entry.cls = REUSED[min(entry.uses, 3) - 1]
        entry.uses += 1
        entry.stamp = self.clock
        self._count(entry, 1)
        self.queues[entry.cls][key] = None
        self._note_call(key)

    def remove(self, key: Key) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            del self.queues[entry.cls][key]
            self._count(entry, -1)

    def evict(self, n: int, protected: Container[Key] = ()) -> list[Key]:
        victims: list[Key] = []
        while len(victims) < n:
            best = self._lowest_head(protected)
            if best is None:
                break
            victims.append(best)
            self._to_ghost(best)
        return victims

    def _lowest_head(self, protected: Container[Key]) -> Key | None:
        """The unprotected class head of the lowest value (equal values: the older goes)."""
        best: Key | None = None
        best_rank: tuple[float, int] = (2.0, 0)
        clock, width, top, entries = self.clock, self.bin_width, NUM_BINS - 1, self.entries
        for stats, queue in zip(self.stats, self.queues, strict=True):
            if not queue:
                continue
            if protected:
                head = pick_unprotected(queue, 1, protected)
                if not head:
                    continue
                key = head[0]
            else:
                key = next(iter(queue))
            stamp = entries[key].stamp
            rank = (stats.values[min((clock - stamp) // width, top)], stamp)
            if rank < best_rank:
                best, best_rank = key, rank
        return best

    def _to_ghost(self, key: Key) -> None:
        entry = self.entries.pop(key)
        del self.queues[entry.cls][key]
        self.ghosts[key] = entry
        while len(self.ghosts) > self.ghost_factor * max(self.capacity, 1):
            self._count(self.ghosts.popitem(last=False)[1], -1)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)
