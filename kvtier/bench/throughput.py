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
says why where it can (``quick``: a ``--quick`` run is too short to judge; ``known``: a cost
docs/benchmarks/throughput.md explains; ``noise``: its best round reached the goal). Results: a table on stdout,
JSON and a bar chart in ``--out DIR`` (default ./benchmarks/results; ./kvtier-results with --quick). See
:mod:`kvtier.bench.measure` for the method.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.bench.measure import (
    chunk_views,
    copy_all,
    default_device,
    format_size,
    interleave,
    make_keys,
    pretouch,
    same_bytes,
    save_results,
    timed,
    touched,
)
from kvtier.bench.output import add_output_arguments, figure
from kvtier.bench.throughput_run import (
    ALL_TIERS,
    GOALS,
    MISS_LEGEND,
    QUICK,
    Runner,
    Settings,
    percent,
)
from kvtier.ops.argtypes import existing_dir, names_from, positive_int, positive_size, positive_sizes

if TYPE_CHECKING:  # imported where it is used: --help loads no torch
    import torch

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
    """Bar chart: kvtier vs raw GB/s per tier, op and size (one panel per tier and mode)."""
    panels: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        fsync = {True: "fsync", False: "no fsync"}.get(r["fsync"]) if "fsync" in r else None
        mode = " ".join(filter(None, [r.get("cache"), fsync]))
        panels.setdefault(f"{r['tier']} {mode}".strip(), []).append(r)
    cols = 2
    rows = -(-len(panels) // cols)
    with figure(path, rows, cols, dpi=90, figsize=(14, 3.4 * rows), squeeze=False) as (fig, axes):
        for ax, (name, rs) in zip(axes.flat, panels.items(), strict=False):
            _panel(ax, name, rs)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.suptitle(title)
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
