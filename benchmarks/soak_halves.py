"""How the soak (benchmarks/soak.py) builds its engine and what it inspects at the end.

* one store: both connector halves over one TieredStore (``KVTierPair``): the directory is the store's own;
* split halves, as vLLM builds them: each role opens its own tiers from ``kv_connector_extra_config`` (the
  scheduler a directory of the local tiers, the worker a store), and the directory learns of writes only through
  the WorkerReports.

``StepProbe`` is the engine's step hook during the run (timing, synchronous load failures, faults within waves).
At the end, on the idle engine (before it is closed): pins and pending chunks left in the directory, pins left in
the worker's cpu pool, every tier (and the directory's count of it) within capacity.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.soak_faults import FaultInjector
from kvtier.config import KvtierConfig
from kvtier.connector.tiered import TieredConnector
from kvtier.connector.worker.half import WorkerHalf
from kvtier.control.directory import ChunkState, Directory
from kvtier.engine import Engine, EngineArgs, KVTierPair
from kvtier.engine.types import KVTransferConfig
from kvtier.store.tiered import TieredStore
from kvtier.tiers.memory.pool import PoolTier
from kvtier.tiers.runtime import LoopThread

SETTLE_S = 5.0  # longest wait, past persist_after_idle, for the directory's pending chunks to settle


@dataclass(frozen=True)
class Target:
    """What a soak run drives and inspects: the engine, the directory its scheduler plans with, the worker's store,
    I/O loop and half, and kvtier's config."""

    engine: Engine
    directory: Directory
    store: TieredStore
    loop: LoopThread
    cfg: KvtierConfig
    worker: WorkerHalf
    split: bool = False


def _halves(engine: Engine) -> tuple[TieredConnector, TieredConnector]:
    sched, work = engine.scheduler_connector, engine.worker_connector
    if not isinstance(sched, TieredConnector) or not isinstance(work, TieredConnector):
        raise RuntimeError("the engine's connector is not kvtier's")
    return sched, work


def one_store(args: EngineArgs, cfg: KvtierConfig) -> Target:
    pair = KVTierPair(cfg)
    engine = Engine(args, pair)
    return Target(engine, pair.store.directory, pair.store, pair.loop, cfg, _halves(engine)[1]._work())


def split_halves(args: EngineArgs, raw: dict[str, Any]) -> Target:
    """The engine with each half built by kvtier's factory from ``raw`` (its ``kv_connector_extra_config``)."""
    ktc = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config=raw)
    engine = Engine(args, connector=None, kv_transfer_config=ktc)
    sched, work = _halves(engine)
    worker = work._work()
    return Target(engine, sched._sched().directory, worker.store, work._loop, work.kvtier_config, worker, True)


def sync_load_failures(target: Target) -> int:
    """Requests whose synchronous load failed in the step just run (the worker's own record, reset per step)."""
    return len(target.worker._loads.failed_now)


class StepProbe:
    """The engine's step hook: times each step (hooks excluded), counts the requests whose synchronous load failed,
    and injects a fault within the wave every ``every`` steps (0: none)."""

    def __init__(self, target: Target, faults: FaultInjector, every: int) -> None:
        self.target = target
        self.faults = faults
        self.every = every
        self.steps: list[float] = []
        self.sync_failures = 0
        self._mark = time.perf_counter()

    def __call__(self, _engine: Engine) -> None:
        self.steps.append(time.perf_counter() - self._mark)
        self.sync_failures += sync_load_failures(self.target)
        if self.every and len(self.steps) % self.every == 0:
            self.faults.within()
        self.mark()

    def mark(self) -> None:
        self._mark = time.perf_counter()


@contextmanager
def worker_bounds(target: Target, wait_s: float, grace_s: float) -> Iterator[None]:
    """The worker waits ``wait_s`` for a synchronous load, and a timed-out one ``grace_s`` more to unwind
    (``kvtier.connector.worker.loads.CANCEL_GRACE_S``); both restored after."""
    from kvtier.connector.worker import loads

    worker, wait, grace = target.worker, target.worker.wait_timeout_s, loads.CANCEL_GRACE_S
    worker.wait_timeout_s, loads.CANCEL_GRACE_S = wait_s, grace_s
    try:
        yield
    finally:
        worker.wait_timeout_s, loads.CANCEL_GRACE_S = wait, grace


def residue(target: Target) -> tuple[int, int]:
    """(pinned, pending) chunks left in the directory once the idle engine has persisted its cpu chunks: a copy to
    disk waits, PENDING there, until the engine has computed nothing for ``policy.persist_after_idle``
    (kvtier.control.persist), so the count is taken when none is left or that time and ``SETTLE_S`` have passed. With
    split halves the directory learns that a copy landed from a worker report, which comes with an engine step, and an
    idle engine runs none: empty steps stand for the next request's."""
    deadline = time.monotonic() + float(getattr(target.cfg.policy, "persist_after_idle", 0.0)) + SETTLE_S
    while True:
        pins = pending = 0
        for index in target.directory._tiers.values():  # read-only inspection
            for entry in index.entries.values():
                pins += entry.pins > 0
                pending += entry.state is ChunkState.PENDING
        if not pending or time.monotonic() > deadline:
            return pins, pending
        time.sleep(0.05)
        if target.split:
            target.engine.step()  # schedules nothing: carries the worker's report


def pool_pins(target: Target) -> int:
    """Keys pinned in the worker's cpu pool (a borrow never released holds its slots for ever)."""
    pool = target.store.tier("cpu")
    if not isinstance(pool, PoolTier):
        raise TypeError(f"the cpu tier is a {type(pool).__name__}, not a memory pool")
    return pool.pool.pinned()


def capacity_report(target: Target, disk_root: Path) -> dict[str, dict[str, int]]:
    """Bytes used and capacity of each tier: the worker's count, or the directory's where larger (a local tier), and
    the record files on disk."""
    out = {}
    for name in target.store.tier_names:
        tier = target.store.tier(name)
        used = tier.used_bytes() if tier.is_shared else max(tier.used_bytes(), target.directory.used_bytes(name))
        out[name] = {"used": used, "capacity": tier.capacity_bytes}
    out["disk_files"] = {"used": sum(p.stat().st_size for p in disk_root.rglob("*.kvt")),
                         "capacity": target.store.tier("disk").capacity_bytes}
    return out


def inspect(target: Target, disk_root: Path) -> dict[str, Any]:
    """The end-of-run figures of the idle engine's kvtier: residue, capacity, tier counters, evictions."""
    caps = capacity_report(target, disk_root)
    pins, pending = residue(target)
    stats = {name: target.store.tier(name).stats().as_dict() for name in target.store.tier_names}
    return {
        "directory_pins": pins, "directory_pending": pending, "pool_pins": pool_pins(target),
        "temp_files": len(list(disk_root.rglob("*.tmp"))), "capacity": caps,
        "within_capacity": all(c["used"] <= c["capacity"] for c in caps.values()),
        "corrupt_detected": {n: int(s["corrupt"]) for n, s in stats.items()},
        "redis_errors_and_timeouts": int(stats["redis"]["errors"] + stats["redis"]["timeouts"]),
        "evictions": {n: target.directory.stats.evictions_by_tier.get(n, 0) for n in stats},
        "sync_load_steps": int(target.worker.totals().get("load_calls", 0)),
    }
