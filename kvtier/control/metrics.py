"""Every counter kvtier keeps, and the one snapshot that reports them. Pure Python (no torch): the control plane
imports it.

Owners: each counter is changed only by the object that owns it, so every event is counted once.

    TierStats (DiskStats, RedisStats)  a tier, for its own operations: lookups it answered (``contains``), gets,
                                       puts, deletes, bytes, corrupt records, errors, timeouts, evictions it chose
                                       itself (a disk quota lowered since the files were written) and the time its
                                       gets and puts took (``Timer``); a kind's own counters are declared fields of
                                       its subclass
    DirectoryStats                     the directory: lookups of local tiers and their hits, the evictions and
                                       demotions it chose, refusals, chunks no tier took (an eviction the directory
                                       chose is a delete for the tier, never a tier eviction too)
    WorkerCounters                     the worker half: loads (engine thread) and saves (I/O loop), thread-safe;
                                       ``take`` hands out the counts since its last call, ``totals`` those since start

One snapshot: :func:`snapshot` turns any of them into one flat dict of plain numbers under stable names; the worker
half's connector stats (``get_kv_connector_stats``), ``TieredStore.stats``, ``kvtier bench`` and ``kvtier demo``
read it, and a Prometheus exposition would too. Names:

    worker      load_chunks, load_bytes, load_failures, load_scatter_failures, load_seconds, load_calls,
                hits_<tier>, load_chunks_group<g>, save_chunks, save_bytes, save_seconds, save_calls,
                save_gather_seconds, save_gather_calls, save_failures, save_timeouts, save_skipped_busy,
                save_chunks_not_stored, kvtier_disabled
                loaded:<tier>:<group> (chunks by tier and group), loaded_tokens:<tier>:<group> (``hit_tokens``)
    tiers       tier_<name>_<field> for every field of the tier's stats (e.g. tier_disk_reads_cached);
                ``tier_gauges``: gauge:used_bytes|capacity_bytes|breaker_state:<tier>:<rank>
    directory   directory_<field> (lookups, hits, evictions, demotions, refused, unplaced, admitted, declined),
                directory_evictions_<tier>

Per-tier and per-group keys appear once something was counted under them; :func:`nonzero` drops zeros (a
per-step delta carries only what changed).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal, Protocol

from kvtier.layout.geometry import NULL_BLOCK

Numbers = dict[str, float]
TimedOp = Literal["get_seconds", "put_seconds"]


# ---- tiers ---------------------------------------------------------------------------------------------------
@dataclass
class TierStats:
    """Counters of one tier. Plain ints and floats so they pickle and aggregate."""

    lookups: int = 0
    hits: int = 0
    gets: int = 0
    get_hits: int = 0
    puts: int = 0
    puts_refused: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    deletes: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0
    timeouts: int = 0
    get_seconds: float = 0.0
    get_calls: int = 0
    put_seconds: float = 0.0
    put_calls: int = 0

    def as_dict(self) -> Numbers:
        """Every field by name, the kind's own ones included."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def extra(self) -> Numbers:
        """The counters a tier kind declares beyond the common ones, by name (a copy: read-only)."""
        common = {f.name for f in fields(TierStats)}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in common}


@dataclass
class DiskStats(TierStats):
    """A disk tier's counters: temp files of dead writers removed at start, reads served from the page cache in one
    pass (``reads_cached``) and reads that waited for the device (``reads_waited``)."""

    temp_removed: int = 0
    reads_cached: int = 0
    reads_waited: int = 0


@dataclass
class RedisStats(TierStats):
    """A Redis tier's counters: error replies, cluster slot-map reloads, and its circuit breaker's state (0 closed,
    1 half open, 2 open), openings and refused calls (read from the breaker, which counts them)."""

    server_errors: int = 0
    slot_refreshes: int = 0
    breaker_state: int = 0
    breaker_opens: int = 0
    breaker_rejected: int = 0


class Timer:
    """Adds the elapsed wall time, and one call, to a tier's get or put timing: ``with Timer(stats, "get_seconds")``."""

    def __init__(self, stats: TierStats, attr: TimedOp) -> None:
        self._stats, self._attr = stats, attr
        self._t0 = 0.0

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self._t0
        if self._attr == "get_seconds":
            self._stats.get_seconds += elapsed
            self._stats.get_calls += 1
        else:
            self._stats.put_seconds += elapsed
            self._stats.put_calls += 1


# ---- directory -------------------------------------------------------------------------------------------------
@dataclass
class DirectoryStats:
    """Counters of the control plane: lookups it answered (local tiers), its eviction decisions, and refusals: a
    tier that could not take a chunk (``refused``, once per tier), a chunk no tier of its chain took (``unplaced``)."""

    lookups: int = 0
    hits: int = 0
    evictions: int = 0
    demotions: int = 0
    refused: int = 0
    unplaced: int = 0
    admitted: int = 0  # chunks offered for saving that the save admission took (policy.admission)
    declined: int = 0  # and those it declined
    evictions_by_tier: dict[str, int] = field(default_factory=dict)


# ---- worker half ---------------------------------------------------------------------------------------------
@dataclass
class Latency:
    """Wall time spent in one timed operation, and how many times it ran (mean: ``seconds / calls``)."""

    seconds: float = 0.0
    calls: int = 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.calls += 1


@dataclass
class WorkerCounts:
    """The worker half's counts over some span (one step, or since start).

    A chunk counts as loaded (``load_chunks``, ``hits_by_tier``, ``load_chunks_by_group``, ``load_bytes``) only once
    its copy into the engine's blocks completed; one not read, or whose scatter failed, is a ``load_failures``."""

    load_chunks: int = 0
    load_bytes: int = 0
    load_failures: int = 0
    load_scatter_failures: int = 0
    load: Latency = field(default_factory=Latency)  # synchronous loads, per step
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    load_chunks_by_group: dict[int, int] = field(default_factory=dict)
    hits_by_tier_group: dict[tuple[str, int], int] = field(default_factory=dict)
    # tokens whose KV a load wrote into the engine's blocks, by tier and group: a chunk's tokens less those of its
    # blocks the engine already held (null in the load plan: its own prefix cache ended inside the chunk)
    tokens_by_tier_group: dict[tuple[str, int], int] = field(default_factory=dict)
    load_samples: list[float] = field(default_factory=list)  # seconds of each step's synchronous loads (bounded)
    save_chunks: int = 0
    save_bytes: int = 0
    save: Latency = field(default_factory=Latency)  # save jobs on the I/O loop
    save_gather: Latency = field(default_factory=Latency)  # gathers of a step's saves
    save_samples: list[float] = field(default_factory=list)  # seconds of each save job (bounded)
    save_failures: int = 0
    save_timeouts: int = 0
    save_skipped_busy: int = 0
    save_chunks_not_stored: int = 0
    kvtier_disabled: int = 0


class WorkerCounters:
    """The worker half's counters, one method per event (thread-safe: loads run on the engine's thread, saves on
    the I/O loop). Only count: what the scheduler must act on travels in the worker report."""

    def __init__(self, chunk_size: int = 0) -> None:
        """``chunk_size``: tokens per chunk (hit tokens are chunks times it)."""
        self._lock = threading.Lock()
        self.chunk_size = chunk_size
        self._step = WorkerCounts()  # since the last ``take``
        self._total = WorkerCounts()  # since start

    def loaded(self, group: int, per_tier: Mapping[str, int], nbytes: int,
               blocks: Sequence[tuple[str, Sequence[int]]] | None = None) -> None:
        """Chunks of ``group`` copied into the engine's blocks, by the tier they were read from; ``blocks``: each
        chunk's (tier, block ids), a null id for a block the engine already held (its tokens are not counted as
        loaded; without ``blocks`` every chunk counts ``chunk_size`` tokens)."""
        chunks = sum(per_tier.values())
        tokens = self._tokens(per_tier, blocks)
        with self._lock:
            for c in (self._step, self._total):
                c.load_chunks += chunks
                c.load_bytes += nbytes
                c.load_chunks_by_group[group] = c.load_chunks_by_group.get(group, 0) + chunks
                for tier, n in per_tier.items():
                    c.hits_by_tier[tier] = c.hits_by_tier.get(tier, 0) + n
                    c.hits_by_tier_group[tier, group] = c.hits_by_tier_group.get((tier, group), 0) + n
                for tier, n in tokens.items():
                    c.tokens_by_tier_group[tier, group] = c.tokens_by_tier_group.get((tier, group), 0) + n

    def _tokens(self, per_tier: Mapping[str, int], blocks: Sequence[tuple[str, Sequence[int]]] | None
                ) -> dict[str, int]:
        """Tokens loaded by tier: ``chunk_size`` per chunk, less the share of its blocks that are null."""
        if blocks is None:
            return {tier: n * self.chunk_size for tier, n in per_tier.items()}
        out: dict[str, int] = {}
        for tier, ids in blocks:
            written = sum(1 for b in ids if b != NULL_BLOCK)
            out[tier] = out.get(tier, 0) + (self.chunk_size * written // len(ids) if ids else 0)
        return out

    def load_failed(self, chunks: int, *, scatter: bool = False) -> None:
        """Chunks not loaded: not read (a miss, a corrupt record, a dead tier) or, ``scatter``, not copied."""
        with self._lock:
            for c in (self._step, self._total):
                c.load_failures += chunks
                c.load_scatter_failures += chunks if scatter else 0

    def load_timed(self, seconds: float) -> None:
        """One step's synchronous loads took ``seconds``."""
        with self._lock:
            for c in (self._step, self._total):
                c.load.add(seconds)
            _sample(self._step.load_samples, seconds)

    def saved(self, chunks: int, nbytes: int, seconds: float) -> None:
        """A save job stored ``chunks`` (of ``nbytes`` gathered) in ``seconds``."""
        with self._lock:
            for c in (self._step, self._total):
                c.save_chunks += chunks
                c.save_bytes += nbytes
                c.save.add(seconds)
            _sample(self._step.save_samples, seconds)

    def gathered(self, seconds: float) -> None:
        """One step's saves were gathered out of the engine's blocks in ``seconds``."""
        with self._lock:
            for c in (self._step, self._total):
                c.save_gather.add(seconds)

    def save_failed(self, chunks: int) -> None:
        """Chunks whose gather or whose save job raised."""
        with self._lock:
            for c in (self._step, self._total):
                c.save_failures += chunks

    def save_timed_out(self, saves: int = 1) -> None:
        """Saves abandoned after their bound (a job past its timeout, or a step's saves past the worker's wait)."""
        with self._lock:
            for c in (self._step, self._total):
                c.save_timeouts += saves

    def save_skipped(self, chunks: int) -> None:
        """Chunks not saved because the backlog of queued saves was full."""
        with self._lock:
            for c in (self._step, self._total):
                c.save_skipped_busy += chunks

    def not_stored(self, chunks: int) -> None:
        """Chunks reported to the scheduler as not stored (whatever the cause)."""
        with self._lock:
            for c in (self._step, self._total):
                c.save_chunks_not_stored += chunks

    def disabled(self) -> None:
        """kvtier was disabled for this engine."""
        with self._lock:
            for c in (self._step, self._total):
                c.kvtier_disabled += 1

    def take(self) -> WorkerCounts:
        """The counts since the last call (the counter starts them afresh)."""
        with self._lock:
            counts, self._step = self._step, WorkerCounts()
        return counts

    def totals(self) -> WorkerCounts:
        """The counts since start (a copy)."""
        with self._lock:
            return copy.deepcopy(self._total)


SAMPLES_PER_SPAN = 512  # latency samples kept per span (one step): a histogram needs no more


def _sample(samples: list[float], seconds: float) -> None:
    if len(samples) < SAMPLES_PER_SPAN:
        samples.append(seconds)


# ---- the snapshot ------------------------------------------------------------------------------------------------
def hits_key(tier: str) -> str:
    """The snapshot key of the chunks loaded from ``tier``."""
    return f"hits_{tier}"


def group_key(group: int) -> str:
    """The snapshot key of the chunks loaded into KV-cache group ``group``."""
    return f"load_chunks_group{group}"


def worker_numbers(c: WorkerCounts) -> Numbers:
    """The worker half's counts under their snapshot names."""
    out: Numbers = {
        "load_chunks": c.load_chunks, "load_bytes": c.load_bytes, "load_failures": c.load_failures,
        "load_scatter_failures": c.load_scatter_failures, "load_seconds": c.load.seconds, "load_calls": c.load.calls,
        "save_chunks": c.save_chunks, "save_bytes": c.save_bytes, "save_seconds": c.save.seconds,
        "save_calls": c.save.calls, "save_gather_seconds": c.save_gather.seconds,
        "save_gather_calls": c.save_gather.calls, "save_failures": c.save_failures,
        "save_timeouts": c.save_timeouts, "save_skipped_busy": c.save_skipped_busy,
        "save_chunks_not_stored": c.save_chunks_not_stored, "kvtier_disabled": c.kvtier_disabled,
    }
    out.update({hits_key(tier): n for tier, n in c.hits_by_tier.items()})
    out.update({group_key(group): n for group, n in c.load_chunks_by_group.items()})
    out.update({f"loaded:{tier}:{group}": n for (tier, group), n in c.hits_by_tier_group.items()})
    return out


def hit_tokens(c: WorkerCounts, chunk_size: int) -> Numbers:
    """Tokens loaded by tier and group, ``loaded_tokens:<tier>:<group>``: the tokens whose KV a load wrote into the
    engine's blocks (``WorkerCounters.loaded``: a chunk's ``chunk_size`` tokens less those of blocks the engine
    already held), what vLLM counts as ``external_kv_transfer`` for the request. (``chunk_size``: unused since
    the counters hold tokens; kept for callers.)"""
    return {f"loaded_tokens:{tier}:{group}": n for (tier, group), n in c.tokens_by_tier_group.items()}


class Gauged(Protocol):
    """What ``tier_gauges`` reads of a tier (kvtier.tiers.base.Tier has it): its level, its size and its stats."""

    @property
    def capacity_bytes(self) -> int: ...

    def used_bytes(self) -> int: ...

    def stats(self) -> object: ...


def tier_gauges(tiers: Mapping[str, Gauged], rank: int = 0) -> Numbers:
    """What each tier holds now, ``gauge:<what>:<tier>:<rank>``: used and capacity bytes, and a Redis tier's
    breaker state (per rank: ranks' gauges are never summed into one)."""
    out: Numbers = {}
    for name, tier in tiers.items():
        out[f"gauge:used_bytes:{name}:{rank}"] = tier.used_bytes()
        out[f"gauge:capacity_bytes:{name}:{rank}"] = tier.capacity_bytes
        stats = tier.stats()
        if isinstance(stats, RedisStats):
            out[f"gauge:breaker_state:{name}:{rank}"] = stats.breaker_state
    return out


def is_gauge(key: str) -> bool:
    """Whether a snapshot key is a level (reported as is) rather than a count (reported as a difference)."""
    return key.startswith("gauge:") or key.endswith("_breaker_state")


class Deltas:
    """Counts since the last call (counters as differences), levels whenever they changed (gauges as is)."""

    def __init__(self) -> None:
        self._last: Numbers = {}

    def take(self, numbers: Mapping[str, float]) -> Numbers:
        out: Numbers = {}
        for key, value in numbers.items():
            before = self._last.get(key)
            if is_gauge(key):
                if value != before:
                    out[key] = value
            elif value != (before or 0):
                out[key] = value - (before or 0)
        self._last = dict(numbers)
        return out


def tier_numbers(name: str, stats: TierStats) -> Numbers:
    """One tier's counters under their snapshot names, ``tier_<name>_<field>``."""
    return {f"tier_{name}_{key}": value for key, value in stats.as_dict().items()}


def directory_numbers(stats: DirectoryStats) -> Numbers:
    """The directory's counters under their snapshot names, ``directory_<field>``."""
    out: Numbers = {f"directory_{f.name}": getattr(stats, f.name) for f in fields(stats)
                    if f.name != "evictions_by_tier"}
    out.update({f"directory_evictions_{tier}": n for tier, n in stats.evictions_by_tier.items()})
    return out


def snapshot(worker: WorkerCounts | None = None, tiers: Mapping[str, TierStats] | None = None,
             directory: DirectoryStats | None = None) -> Numbers:
    """One flat dict of plain numbers under stable names (see the module docstring) from whichever counters are
    given: a worker half's, a store's tiers' (by tier name), a directory's."""
    out: Numbers = {}
    if worker is not None:
        out.update(worker_numbers(worker))
    for name, stats in (tiers or {}).items():
        out.update(tier_numbers(name, stats))
    if directory is not None:
        out.update(directory_numbers(directory))
    return out


def nonzero(numbers: Mapping[str, float]) -> Numbers:
    """``numbers`` without its zeros (a delta that carries only what changed; absent means 0)."""
    return {key: value for key, value in numbers.items() if value}
