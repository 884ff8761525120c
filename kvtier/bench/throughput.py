"""Store and load GB/s of each tier beside the raw limit of its medium, measured in the same run.

For every tier and chunk size one batch of chunks is stored and loaded, interleaved round by round with the
medium's raw limit on the same bytes:

* ``cpu`` / ``gpu`` (the gpu tier on whatever device is available): ``put`` / ``get`` / ``get_into`` against
  ``dst.copy_(src)`` per chunk into pre-touched buffers;
* ``disk``: ``put`` / ``get`` against plain ``os.write`` / ``readinto`` of files of the same sizes, with the
  same fsync mode and the same thread fan-out; reads warm (page cache) and cold (the files' pages dropped with
  ``POSIX_FADV_DONTNEED`` before each read);
* ``redis`` (a private ``redis-server`` on a free loopback port): ``put`` / ``get`` against redis-py pipelined
  SET / GET (hiredis parser);
* ``transfer``: ``kvtier.kvcopy.transfer.gather`` / ``scatter`` between a paged layout (Llama-3.1-8B shaped layers,
  blocks in random order) and chunk payloads, against one contiguous copy of the same bytes.

Goals: memory tiers and transfer >= 80% of the raw copy, disk and Redis >= 70% of raw. A row below its goal
says why where it can (``quick``: a ``--quick`` run is too short to judge; ``known``: a cost README explains;
``noise``: its best round reached the goal). Results: a table on stdout, JSON and a bar chart in ``--out DIR``
(default ./benchmarks/results; ./kvtier-results with --quick). See :mod:`kvtier.bench.measure` for the method.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier.bench.args import existing_dir, names_from, positive_int, positive_size, positive_sizes
from kvtier.bench.measure import (
    Spread,
    chunk_views,
    copy_all,
    default_device,
    format_size,
    gbps,
    interleave,
    make_keys,
    paired_ratio,
    pretouch,
    same_bytes,
    save_results,
    timed,
    touched,
)
from kvtier.bench.output import add_output_arguments

if TYPE_CHECKING:  # imported where it is used: --help loads no torch
    import torch

HELP = "store/load GB/s of each tier beside the raw limit of its medium (same run)"
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
KNOWN_MISSES = {  # (tier, op, cache) -> the cost README's "Misses, honestly" explains
    ("disk", "load", "warm"): "known: every read checks the record's xxh3 hash",
    ("disk", "store", ""): "known: every write hashes the record (xxh3)",
    ("transfer", "gather", ""): "known: one index kernel per chunk and layer",
    ("transfer", "scatter", ""): "known: one index kernel per chunk and layer",
}
MISS_LEGEND = ("MISS: below its goal in this run. quick: a --quick run moves too few bytes over too few rounds to "
               "judge a tier against its medium's limit (README's figures are full runs); known: a cost README "
               "explains under 'Misses, honestly'; noise: the tier's best round reached the goal.")


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


# ---- memory tiers ------------------------------------------------------------------------------------------

def bench_memory(run: Runner, kind: str, chunk_bytes: int) -> None:
    """``put`` / ``get`` / ``get_into`` of a pool tier against per-chunk tensor copies."""
    import torch

    from kvtier.config import CpuTierConfig, GpuTierConfig
    from kvtier.tiers import make_tier
    from kvtier.tiers.memory.pool import PoolTier

    s = run.settings
    n = s.chunks(chunk_bytes)
    device = (s.device or default_device()) if kind == "gpu" else "cpu"
    src = chunk_views(touched(n * chunk_bytes, device), chunk_bytes)  # the gpu tier stores device tensors
    dst = chunk_views(pretouch(torch.empty(n * chunk_bytes, dtype=torch.uint8, device=device)), chunk_bytes)
    section = (GpuTierConfig(name=kind, capacity=n * chunk_bytes, device=device) if kind == "gpu"
               else CpuTierConfig(name=kind, capacity=n * chunk_bytes))
    tier = make_tier(section)
    assert isinstance(tier, PoolTier)
    run.call(tier.start())
    keys = make_keys(f"{kind}:{chunk_bytes}", n)
    items = list(zip(keys, src, strict=True))
    try:
        def store() -> float:
            run.call(tier.delete(keys))
            return run.clocked(lambda: tier.put(items))[0]

        def raw() -> float:
            return timed(lambda: copy_all(dst, src), device)

        samples = interleave({"kvtier": store, "raw": raw}, s.repeats, s.warmup)
        run.record(kind, "store", chunk_bytes, n, samples, "tensor copy_ per chunk", device=device)
        if not all(run.call(tier.put(items))):
            raise RuntimeError(f"{kind} tier refused the batch")
        held: list[Any] = []

        def load() -> float:
            held.clear()  # free the previous round's tensors outside the timed region
            seconds, out = run.clocked(lambda: tier.get(keys))
            held.append(out)
            return seconds

        def load_into() -> float:
            return run.clocked(lambda: tier.get_into(list(zip(keys, dst, strict=True))))[0]

        fresh: list[torch.Tensor] = []

        def alloc_copy() -> float:
            fresh.clear()  # free the previous round's tensors, as the tier's caller would
            return timed(lambda: fresh.extend(torch.empty_like(c, device=device).copy_(c) for c in src), device)

        samples = interleave({"kvtier": load, "into": load_into, "raw": raw, "alloc": alloc_copy},
                             s.repeats, s.warmup)
        ok = bool(held) and same_bytes(held[0][-1], src[-1])
        run.record(kind, "load", chunk_bytes, n, samples, "tensor copy_ per chunk", device=device, verified=ok,
                   alt=("alloc", "torch.empty + copy_ per chunk (new memory each round, as get returns)"))
        run.record(kind, "load_into", chunk_bytes, n, samples, "tensor copy_ per chunk", ours="into",
                   device=device, verified=same_bytes(dst[0], src[0]))
    finally:
        run.call(tier.close())


# ---- running, printing, plotting ----------------------------------------------------------------------------

def run_all(settings: Settings, progress: bool = True) -> list[dict[str, Any]]:
    """Measure every selected tier at every size; return the result records."""
    from kvtier.bench.throughput_media import bench_disk, bench_redis, bench_transfer, redis_context

    run = Runner(settings)
    cases: list[tuple[str, Callable[[], None]]] = []
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=settings.disk_path)
    redis_cm = redis_context(settings) if "redis" in settings.tiers else None
    url = redis_cm.__enter__() if redis_cm is not None else ""
    for size in settings.sizes:
        for kind in settings.tiers:
            label = f"{kind} {format_size(size)}"
            if kind in ("cpu", "gpu"):
                cases.append((label, partial(bench_memory, run, kind, size)))
            elif kind == "transfer":
                cases.append((label, partial(bench_transfer, run, size)))
            elif kind == "redis":
                cases.append((label, partial(bench_redis, run, url, size)))
            elif kind == "disk":
                cases += [(f"{label} fsync={fs}", partial(bench_disk, run, Path(tmp.name), size, fs))
                          for fs in settings.fsync]
    try:
        for i, (label, case) in enumerate(cases, 1):
            if progress:
                print(f"[{i}/{len(cases)}] {label}", file=sys.stderr, flush=True)
            case()
            run.fresh_loop()
    finally:
        if redis_cm is not None:
            redis_cm.__exit__(None, None, None)
        tmp.cleanup()
        run.close()
    return run.results


def table(results: Sequence[dict[str, Any]]) -> str:
    """A fixed-width text table of the results."""
    head = f"{'tier':<9}{'op':<11}{'mode':<11}{'chunk':>8}  {'kvtier GB/s':>20}  {'raw GB/s':>20}  {'% raw':>6} goal"
    lines = [head, "-" * len(head)]
    for r in results:
        mode = r.get("cache", "") + ("+fsync" if r.get("fsync") else "")
        k, w = r["gbps"], r["raw"]["gbps"]
        lines.append(f"{r['tier']:<9}{r['op']:<11}{mode:<11}{format_size(r['chunk_bytes']):>8}  "
                     f"{k['median']:>7.2f} [{k['min']:>5.2f}-{k['max']:>5.2f}]  "
                     f"{w['median']:>7.2f} [{w['min']:>5.2f}-{w['max']:>5.2f}]  "
                     f"{percent(r['ratio']):>5d}% {'ok' if r['meets_goal'] else 'MISS'} "
                     f"({100 * r['goal']:.0f}%)"
                     + (f"  alt raw {r['raw_alt']['gbps']['median']:.2f} GB/s: {100 * r['raw_alt']['ratio']:.0f}%"
                        if "raw_alt" in r else "")
                     + (f"  [{r['miss_reason']}]" if "miss_reason" in r else ""))
    if any(not r["meets_goal"] for r in results):
        lines.append(MISS_LEGEND)
    return "\n".join(lines)


def plot(results: Sequence[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Bar chart: kvtier vs raw GB/s per tier, op and size (one panel per tier and mode). None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        fsync = {True: "fsync", False: "no fsync"}.get(r["fsync"]) if "fsync" in r else None
        mode = " ".join(filter(None, [r.get("cache"), fsync]))
        panels.setdefault(f"{r['tier']} {mode}".strip(), []).append(r)
    cols = 2
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14, 3.4 * rows), squeeze=False)
    for ax, (name, rs) in zip(axes.flat, panels.items(), strict=False):
        _panel(ax, name, rs)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


ALT_LABELS = {"cpu": "new memory + copy", "gpu": "new memory + copy", "disk": "plain reads + xxh3",
              "redis": "plain-socket client"}


def _panel(ax: Any, name: str, rs: Sequence[dict[str, Any]]) -> None:
    """One tier's bars: kvtier, raw and (where measured) the alternative raw baseline, with min-max whiskers."""
    x = range(len(rs))
    with_alt = any("raw_alt" in r for r in rs)
    w = 0.27 if with_alt else 0.4
    left = -w if with_alt else -w / 2
    ax.bar([i + left for i in x], [r["gbps"]["median"] for r in rs], w, label="kvtier",
           yerr=_err(rs, lambda r: r["gbps"]), capsize=2)
    ax.bar([i + left + w for i in x], [r["raw"]["gbps"]["median"] for r in rs], w, label="raw", alpha=0.6,
           yerr=_err(rs, lambda r: r["raw"]["gbps"]), capsize=2)
    if with_alt:
        zero = {"median": 0.0, "min": 0.0, "max": 0.0}
        ax.bar([i + left + 2 * w for i in x], [r.get("raw_alt", {}).get("gbps", zero)["median"] for r in rs], w,
               label=f"alt raw ({ALT_LABELS.get(rs[0]['tier'], 'see raw_alt')})", alpha=0.6, hatch="//",
               yerr=_err(rs, lambda r: r.get("raw_alt", {}).get("gbps", zero)), capsize=2)
    for i, r in zip(x, rs, strict=True):
        ax.annotate(f"{100 * r['ratio']:.0f}%", (i, max(r["gbps"]["max"], r["raw"]["gbps"]["max"])),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x), [f"{r['op']}\n{format_size(r['chunk_bytes'])}" for r in rs], fontsize=7)
    ax.set_title(f"{name} (goal {100 * rs[0]['goal']:.0f}% of raw)", fontsize=9)
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=7)


def _err(rs: Sequence[dict[str, Any]], get: Callable[[dict[str, Any]], dict[str, float]]) -> list[list[float]]:
    return [[get(r)["median"] - get(r)["min"] for r in rs], [get(r)["max"] - get(r)["median"] for r in rs]]


# ---- command line --------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of kvtier bench throughput."""
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 repeats (CI smoke run, < 60 s)")
    parser.add_argument("--tiers", type=names_from(ALL_TIERS), default=ALL_TIERS,
                        help=f"comma list of {', '.join(ALL_TIERS)}")
    parser.add_argument("--sizes", type=positive_sizes, help="comma list of chunk sizes (default 32MiB,2MiB,256KiB)")
    parser.add_argument("--batch", type=positive_size, help="bytes moved per measured call (default 256MiB)")
    parser.add_argument("--repeats", type=positive_int, help="measured rounds for memory, redis, transfer (default 7)")
    parser.add_argument("--disk-repeats", type=positive_int, help="measured rounds for disk (default 5)")
    parser.add_argument("--fsync", choices=["off", "on", "both"], help="disk fsync mode (default both)")
    parser.add_argument("--disk-path", type=existing_dir,
                        help="directory for the disk files (default: the system temp dir)")
    parser.add_argument("--device", help="device of the gpu tier (default cuda when available, else cpu)")
    parser.add_argument("--redis-url", help="use this Redis instead of starting a private redis-server")
    add_output_arguments(parser, "throughput")


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from parsed options (--quick picks the smoke defaults)."""
    s = QUICK if args.quick else Settings()
    changes: dict[str, Any] = {"tiers": tuple(args.tiers)}
    if args.sizes:
        changes["sizes"] = args.sizes
    if args.batch:
        changes["batch_bytes"] = args.batch
    for name in ("repeats", "disk_repeats", "disk_path", "device", "redis_url"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.fsync:
        changes["fsync"] = {"off": (False,), "on": (True,), "both": (False, True)}[args.fsync]
    return replace(s, **changes)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write JSON (and PNG)."""
    settings = settings_from(args)
    results = run_all(settings)
    name = "throughput-quick" if args.quick else "throughput"
    print(table(results))
    save_results(args, "throughput", {"settings": dict(vars(settings)), "goals": GOALS, "results": results},
                 lambda png: plot(results, png, f"kvtier tier bandwidth vs raw ({name})"))
    return 0
