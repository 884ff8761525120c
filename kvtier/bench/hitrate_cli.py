"""Hit-rate replay, ``kvtier bench hit-rate``: a workload through kvtier's own directory and policies.

Chunk by chunk, without moving bytes: an hour-long trace replays in seconds. Results: ``hit_rate.json`` (always)
and its chart in ``--out DIR`` (default ``./benchmarks/results``; ``./kvtier-results`` with ``--quick``), or at
``--json FILE`` / ``--plot FILE``.

Semantics: a request hits the longest prefix of its chunks held by any tier (each hit chunk is attributed to
the tier holding it); then all its chunks are inserted (misses) or touched (hits) in prefix order. New and
promoted chunks go to tier 0; a tier that is full asks its policy for a victim, which is demoted to the next
tier (exclusive tiers) or dropped from the last one. Token hit rate = sum of min(hit chunks x chunk tokens,
input length) over the sum of input lengths.

``--engine 10,25,40%``: vLLM's prefix cache in front instead (an LRU of that share of the unique chunks, one block a
chunk), one kvtier tier behind it (``--tier-factor`` times the engine's memory, the default policy), and kvtier
serving past the engine's hit, as its scheduler half plans: every chunk saved (``policy.admission: all``) against
the learned save admission (the default), against an oracle that saves only the chunks the first replay
loaded (the bound of any admission), and against saving each chunk when the engine evicts it instead of when it is
computed (``evict``: offload on evict, the peers' lazy offload; the tier is then looked up past the engine's
hit). Per share: the hit rates, the chunks kvtier saved (written where the tier did not hold them) and loaded,
their ratio, and the share of offered chunks the admission declined (``hit_rate_admission.json``, no chart).

This module is the command line (its options, the workload and sweep they name, the chart, where the results
go); the replay itself is :mod:`kvtier.bench.hitrate`.
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path
from typing import Any

from kvtier.bench import hitrate
from kvtier.bench.hitrate import (
    DEFAULT_POLICY,
    TRACE_SOURCE,
    SweepSpec,
    admission_sweep,
    admission_table,
    bars,
    sweep,
    table,
)
from kvtier.bench.output import add_output_arguments, figure, save_results
from kvtier.bench.workloads import GENERATORS, SUITES, Workload, load_mooncake, parse_capacities, suite_workloads
from kvtier.config.parse import parse_size, refuse_bare_size
from kvtier.control.policy import POLICIES
from kvtier.errors import ConfigError
from kvtier.ops.check import parse_model_shape

NAME = "hit_rate"  # the result files: hit_rate.json and hit_rate.png
QUICK_REQUESTS = 400  # --quick: the first requests of the trace, at 10% only (a few seconds)
QUICK_WORKLOAD = "agentic"  # --quick without a trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier bench hit-rate``."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path,
                     help=f"Mooncake-format JSONL trace (default {hitrate.DEFAULT_TRACE} if present)")
    src.add_argument("--workload", choices=sorted(GENERATORS), help="a seeded synthetic workload instead")
    src.add_argument("--suite", choices=SUITES, help="a set of workloads: the benchmark's synthetic ones, or those "
                     "held back from tuning the default policy (with the trace's second half when present)")
    parser.add_argument("--workload-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="generator parameter, repeatable (e.g. users=100, repeat_mode=tile)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    cap = parser.add_mutually_exclusive_group()
    cap.add_argument("--capacity", help="one capacity: chunks (1000) or a share of the unique chunks (10%%)")
    cap.add_argument("--capacity-bytes", help="one capacity in bytes (8GiB); needs the model shape")
    cap.add_argument("--sweep", help="comma list of capacities (default 5,10,20,40%%)")
    parser.add_argument("--model-shape", default="llama-3.1-8b",
                        help="layers=N,kv_heads=N,head_size=N,dtype=D or a preset (for byte capacities)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma list (default: all registered)")
    parser.add_argument("--tiers", action="append", default=[], metavar="CAPS",
                        help="a multi-tier set-up, fastest first, e.g. 5%%,10%% (repeatable)")
    parser.add_argument("--no-belady", action="store_true", help="skip Belady's offline optimum")
    parser.add_argument("--engine", metavar="SHARES",
                        help="instead of the policy sweep: vLLM's prefix cache (an LRU of SHARES of the unique "
                             "chunks, e.g. 10,25,40%%) in front of one kvtier tier, every chunk saved against the "
                             "learned save admission, an oracle and saving on evict: hits, chunks saved and loaded "
                             "(results hit_rate_admission)")
    parser.add_argument("--tier-factor", type=float, default=4.0,
                        help="with --engine: kvtier's tier, in multiples of the engine's memory (default 4)")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--quick", action="store_true",
                        help=f"a few seconds: the first {QUICK_REQUESTS} requests at 10%% (the synthetic "
                             f"{QUICK_WORKLOAD} workload when no trace is found)")
    add_output_arguments(parser, NAME, chart=False)
    parser.add_argument("--plot", "--png", dest="png", type=Path, metavar="FILE",
                        help="hit-rate-vs-capacity chart file (default beside the JSON)")
    parser.add_argument("--no-plot", action="store_true", help="write no chart")


def load_workload(args: argparse.Namespace) -> Workload:
    """The trace or generated workload the options name, cut to ``--limit`` requests."""
    if args.workload:
        factory = GENERATORS[args.workload]
        params: dict[str, Any] = {"seed": args.seed}
        for item in args.workload_arg:
            key, sep, value = item.partition("=")
            if not sep or key not in inspect.signature(factory).parameters:
                raise ConfigError("--workload-arg", f"bad item {item!r}",
                                  f"keys of {args.workload}: {', '.join(inspect.signature(factory).parameters)}")
            params[key] = value if key == "repeat_mode" else int(value)
        return factory(**params).head(_limit(args))
    trace = args.trace or hitrate.DEFAULT_TRACE
    if not trace.is_file():
        if args.quick and args.trace is None:
            print(f"no trace at {trace} (get it from {TRACE_SOURCE}): --quick replays the synthetic "
                  f"{QUICK_WORKLOAD} workload instead")
            return GENERATORS[QUICK_WORKLOAD](seed=args.seed).head(_limit(args))
        raise ConfigError("--trace", f"no trace file at {trace}",
                          f"get it from {TRACE_SOURCE} and give --trace PATH, or use --workload NAME")
    try:
        workload = load_mooncake(trace, _limit(args))
    except ValueError as exc:  # a line that is not a Mooncake trace's (or not text)
        raise ConfigError("--trace", str(exc).splitlines()[0],
                          "give a Mooncake trace: JSON lines with timestamp, input_length, hash_ids") from None
    if not workload.requests:
        raise ConfigError("--trace", f"{trace} holds no requests", "give a Mooncake trace with at least one line")
    return workload


def _limit(args: argparse.Namespace) -> int | None:
    """--limit, else the --quick bound, else all requests."""
    if args.limit is not None:
        return int(args.limit)
    return QUICK_REQUESTS if getattr(args, "quick", False) else None


def spec_from(args: argparse.Namespace, workload: Workload) -> SweepSpec:
    """The sweep the options ask for."""
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ConfigError("--policies", f"unknown policies {unknown}", f"use some of {', '.join(POLICIES)}")
    unique = workload.unique_chunks()
    chunk_bytes = parse_model_shape(args.model_shape).bytes_per_token * workload.chunk_tokens
    try:
        if args.capacity_bytes:
            refuse_bare_size(args.capacity_bytes, "--capacity-bytes")
            caps = [parse_size(args.capacity_bytes, "--capacity-bytes") // chunk_bytes]
        else:
            default = "10%" if getattr(args, "quick", False) else "5,10,20,40%"
            caps = parse_capacities(args.capacity or args.sweep or default, unique, chunk_bytes)
        tiers = tuple(tuple(parse_capacities(t, unique, chunk_bytes)) for t in args.tiers)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError("--capacity", str(exc)) from None
    return SweepSpec(policies, tuple(caps), tiers, belady=not args.no_belady)


def _shares(spec: str) -> list[float]:
    """--engine's shares of the unique chunks, as fractions: '10,25,40%'."""
    try:
        shares = [float(x.strip().rstrip("%")) / 100 for x in spec.split(",") if x.strip()]
    except ValueError:
        shares = []
    if not shares or not all(0 < x <= 1 for x in shares):
        raise ConfigError("--engine", f"bad shares {spec!r}", "give percentages over 0 and at most 100: 10,25,40%")
    return shares


def suite_document(args: argparse.Namespace) -> dict[str, Any]:
    """Sweep every workload of ``--suite``; print their tables and how often the default policy meets its bar."""
    workloads = [w.head(_limit(args)) for w in suite_workloads(args.suite, hitrate.DEFAULT_TRACE)]
    docs = [sweep(w, spec_from(args, w), progress=not args.no_progress) for w in workloads]
    checks = bars(docs, DEFAULT_POLICY)
    print("\n\n".join(table(d) for d in docs))
    missed = [f"{c['workload']} at {c['capacity_fraction']:.0%}" for c in checks if not c["met"]]
    print(f"{DEFAULT_POLICY} >= LRU and >= ARC: {len(checks) - len(missed)} of {len(checks)} cases"
          + (f"; missed: {', '.join(missed)}" if missed else ""))
    return {"suite": args.suite, "default_policy": DEFAULT_POLICY, "workloads": docs, "bars": checks}


def run(args: argparse.Namespace) -> int:
    """Replay, print the table, write the JSON (always) and the chart (unless --no-plot), print their paths."""
    if getattr(args, "engine", None):
        if getattr(args, "suite", None):
            raise ConfigError("--engine", "replays one workload, not a suite", "give --trace or --workload instead")
        shares = _shares(args.engine)
        if not 0 < args.tier_factor < float("inf"):
            raise ConfigError("--tier-factor", f"{args.tier_factor} is not a positive number",
                              "give kvtier's tier in multiples of the engine's memory, e.g. 4")
        workload = load_workload(args)
        doc = admission_sweep(workload, shares, args.tier_factor)
        print(admission_table(doc))
        save_results(args, "hit_rate_admission", doc)
        return 0
    if getattr(args, "suite", None):
        doc = suite_document(args)
    else:
        workload = load_workload(args)
        doc = sweep(workload, spec_from(args, workload), progress=not args.no_progress)
        print(table(doc))
    save_results(args, NAME, doc, plot=lambda path: plot(doc, path))
    return 0


def plot(doc: dict[str, Any], path: Path) -> Path | None:
    """Token hit rate vs capacity per policy (single-tier runs), with Belady's and the infinite cache's; one
    panel per workload for a suite."""
    docs = doc.get("workloads", [doc])
    cols = min(len(docs), 3)
    rows = -(-len(docs) // cols)
    with figure(path, rows, cols, dpi=120 if len(docs) == 1 else 80, figsize=(8 * cols, 5 * rows),
                squeeze=False) as (_, axes):
        for ax in axes.flat[len(docs):]:
            ax.set_visible(False)
        for one, ax in zip(docs, axes.flat, strict=False):
            _draw(one, ax)
    return path


def _draw(doc: dict[str, Any], ax: Any) -> None:
    single = [r for r in doc["results"] if len(r["tier_capacities"]) == 1]
    for policy in dict.fromkeys(r["policy"] for r in single):
        rows = sorted((r for r in single if r["policy"] == policy), key=lambda r: r["capacity_chunks"])
        ax.plot([100 * r["capacity_fraction"] for r in rows], [100 * r["hit_rate"] for r in rows], "o-", label=policy)
    bel = sorted({(r["capacity_fraction"], r["belady_hit_rate"]) for r in single if r["belady_hit_rate"] is not None})
    if bel:
        ax.plot([100 * x for x, _ in bel], [100 * y for _, y in bel], "k--", label="Belady (offline)")
    ax.axhline(100 * doc["ideal_hit_rate"], color="grey", linestyle=":", label="infinite cache")
    ax.set_xscale("log")
    ticks = sorted({100 * r["capacity_fraction"] for r in single})
    ax.set_xticks(ticks, [f"{t:.3g}%" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(f"capacity, % of {doc['unique_chunks']:,} unique chunks (log scale)")
    ax.set_ylabel("token hit rate, %")
    ax.set_title(f"{doc['workload']} ({doc['requests']:,} requests, {doc['chunk_tokens']}-token chunks)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
