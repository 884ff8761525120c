"""What every case of ``kvtier bench throughput`` runs on: its settings, and the runner that times a case's rounds
and turns them into a result (GB/s beside the medium's raw limit, and the goal). The memory cases and the command are
in :mod:`kvtier.bench.throughput`, the disk, Redis and transfer cases in :mod:`kvtier.bench.throughput_media`."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtier.bench.measure import Spread, format_size, gbps, paired_ratio

T = TypeVar("T")

TOKEN_BYTES = 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B: K+V x 32 layers x 8 KV heads x head 128 x bf16 = 128 KiB
GOALS = {"cpu": 0.8, "gpu": 0.8, "transfer": 0.8, "disk": 0.7, "redis": 0.7}
ALL_TIERS = ("cpu", "gpu", "disk", "redis", "transfer")


@dataclass(frozen=True)
class Settings:
    """What to measure and how often."""

    sizes: tuple[int, ...] = (32 << 20, 2 << 20, 256 << 10)
    batch_bytes: int = 256 << 20
    repeats: int = 7
    disk_repeats: int = 5
    warmup: int = 1
    tiers: tuple[str, ...] = ALL_TIERS
    fsync: tuple[bool, ...] = (False, True)
    disk_path: str | None = None
    device: str | None = None  # of the gpu tier; None: cuda when available, else cpu
    transfer_layers: int = 32
    redis_url: str | None = None
    quick: bool = False  # a smoke run: rows below their goal say so

    def chunks(self, chunk_bytes: int) -> int:
        return max(1, self.batch_bytes // chunk_bytes)


QUICK = Settings(sizes=(2 << 20, 256 << 10), batch_bytes=8 << 20, repeats=2, disk_repeats=2, fsync=(False,),
                 transfer_layers=4, quick=True)
KNOWN_MISSES = {  # (tier, op, cache) -> the cost docs/benchmarks/throughput.md's "Misses, honestly" explains
    ("disk", "load", "warm"): "known: every read checks the record's xxh3 hash",
    ("disk", "store", ""): "known: every write hashes the record (xxh3)",
    ("transfer", "gather", ""): "known: one index kernel per chunk and layer",
    ("transfer", "scatter", ""): "known: one index kernel per chunk and layer",
}
MISS_LEGEND = ("MISS: below its goal in this run. quick: a --quick run moves too few bytes over too few rounds to "
               "judge a tier against its medium's limit (README's figures are full runs); known: a cost "
               "docs/benchmarks/throughput.md explains under 'Misses, honestly'; noise: the tier's best round "
               "reached the goal.")


def percent(ratio: float) -> int:
    """A ratio in whole percent, rounded down (a row just below its goal must not print as the goal)."""
    return math.floor(100 * ratio + 1e-9)


def miss_reason(settings: Settings, key: tuple[str, str, str], best_ratio: float, goal: float) -> str:
    """Why a row fell below its goal, in a few words (what is known of it)."""
    reasons = []
    if settings.quick:
        reasons.append(f"quick: {format_size(settings.batch_bytes)} per call, {settings.repeats} rounds, too short")
    if key in KNOWN_MISSES:
        reasons.append(KNOWN_MISSES[key])
    if best_ratio >= goal:
        reasons.append(f"noise: best round {percent(best_ratio)}%")
    return "; ".join(reasons) or "below goal (a real miss: rerun on a quiet machine to confirm)"


class Runner:
    """One event loop for the tiers' async calls, plus the results collected so far."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.results: list[dict[str, Any]] = []

    def call(self, coro: Awaitable[T]) -> T:
        return self.loop.run_until_complete(coro)

    def clocked(self, make: Callable[[], Awaitable[T]]) -> tuple[float, T]:
        """Seconds one awaited call takes, and its result."""
        t0 = time.perf_counter()
        value = self.loop.run_until_complete(make())
        return time.perf_counter() - t0, value

    def record(self, tier: str, op: str, chunk_bytes: int, chunks: int, samples: dict[str, list[float]],
               raw_method: str, ours: str = "kvtier", raw: str = "raw", alt: tuple[str, str] | None = None,
               **extra: Any) -> None:
        """Turn timed rounds (seconds) into one result: GB/s spreads, ratio to raw, goal; ``alt`` (samples
        name, method) adds a second baseline as ``raw_alt``."""
        nbytes = chunk_bytes * chunks
        mine = [gbps(nbytes, s) for s in samples[ours]]
        limit = [gbps(nbytes, s) for s in samples[raw]]
        ratio = Spread.of(mine).median / Spread.of(limit).median
        goal = GOALS[tier]
        reason = None if ratio >= goal else miss_reason(
            self.settings, (tier, op, str(extra.get("cache", ""))), max(mine) / Spread.of(limit).median, goal)
        self.results.append({
            "tier": tier, "op": op, "chunk_bytes": chunk_bytes, "chunk_tokens": chunk_bytes / TOKEN_BYTES,
            "chunks": chunks, "batch_bytes": nbytes, **extra,
            "gbps": Spread.of(mine).as_dict(),
            "raw": {"method": raw_method, "gbps": Spread.of(limit).as_dict()},
            "ratio": round(ratio, 6), "paired_ratio": paired_ratio(mine, limit).as_dict(),
            "goal": goal, "meets_goal": ratio >= goal, **({"miss_reason": reason} if reason else {}),
        })
        if alt is not None:
            other = [gbps(nbytes, x) for x in samples[alt[0]]]
            self.results[-1]["raw_alt"] = {"method": alt[1], "gbps": Spread.of(other).as_dict(),
                                           "ratio": round(Spread.of(mine).median / Spread.of(other).median, 6)}

    def fresh_loop(self) -> None:
        """End the current event loop and start a new one, so that no case inherits another's threads.

        Why: an executor thread that ran torch ops keeps an OpenMP team, and with more OpenMP threads than
        cores libgomp stops spin-waiting: later small parallel ops (transfer's index_select) then pay a futex
        wake-up each (32 MiB gathers measured at ~40% instead of ~80% of a copy). See kvtier.bench.measure.
        """
        self.close()
        self.loop = asyncio.new_event_loop()

    def close(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()
