"""Run ``kvtier bench hit-rate`` from a checkout: ``python benchmarks/hit_rate.py [options]``.

With no options it replays the Mooncake conversation trace (``kvtier/bench/traces/``) at 5/10/20/40% of its
unique chunks plus a two-tier set-up, for every registered policy, and writes
benchmarks/results/hit_rate_mooncake.json and .png. See kvtier/bench/hitrate_cli.py for the semantics.

``python benchmarks/hit_rate.py --cost`` instead measures what each policy costs per call (CPU ns per insert,
touch or evict, as the directory makes them, interleaved rounds in one run) and its memory per held key, on
the first 3,000 requests of the trace (the agentic workload without it) at 10% of their unique chunks, and
writes benchmarks/results/hit_rate_policy_cost.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.bench import hitrate, hitrate_cli
from kvtier.bench.measure import machine_info, write_json
from kvtier.bench.workloads import GENERATORS, Workload, load_mooncake
from kvtier.control.policy import EvictionPolicy, make_policy

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULTS = ["--sweep", "5,10,20,40%", "--tiers", "5%,10%",
            "--json", str(RESULTS / "hit_rate_mooncake.json"), "--plot", str(RESULTS / "hit_rate_mooncake.png")]
COST_POLICIES = ("lru", "prefix_lru", "prefix_hd", "adaptive")
COST_REQUESTS, COST_ROUNDS = 3000, 5


def drive(policy: EvictionPolicy, workload: Workload, capacity: int) -> int:
    """The directory's calls for each request (touch held chunks, evict to make room, insert the others, in
    prefix order); returns how many insert/touch/evict calls it made."""
    calls = 0
    for req in workload.requests:
        parent = None
        for chunk in req.chunks:
            if chunk in policy:
                policy.touch(chunk)  # type: ignore[arg-type]
            else:
                while len(policy) >= capacity and policy.evict(1):
                    calls += 1
                policy.insert(chunk, parent)  # type: ignore[arg-type]
            calls += 1
            parent = chunk
    return calls


def cost() -> int:
    trace = hitrate.DEFAULT_TRACE
    workload = load_mooncake(trace, COST_REQUESTS) if trace.is_file() else GENERATORS["agentic"]()
    capacity = max(1, round(0.10 * workload.unique_chunks()))
    ns: dict[str, list[float]] = {name: [] for name in COST_POLICIES}
    for _ in range(COST_ROUNDS):  # interleaved, so that a noisy neighbour slows every policy alike
        for name in COST_POLICIES:
            policy = make_policy(name, capacity)
            started = time.process_time_ns()
            calls = drive(policy, workload, capacity)
            ns[name].append((time.process_time_ns() - started) / calls)
    rows: list[dict[str, Any]] = []
    base = statistics.median(ns["prefix_lru"])
    for name in COST_POLICIES:
        tracemalloc.start()
        policy = make_policy(name, capacity)
        drive(policy, workload, capacity)
        held_bytes = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        median = statistics.median(ns[name])
        rows.append({"policy": name, "ns_per_call_median": round(median), "ns_per_call_min": round(min(ns[name])),
                     "vs_prefix_lru": round(median / base, 2), "bytes_per_key": round(held_bytes / len(policy))})
        print(f"{name:<11} {median:8.0f} ns/call (min {min(ns[name]):.0f}, x{median / base:.2f} prefix_lru), "
              f"{held_bytes / len(policy):6.0f} B per held key")
    doc = {"benchmark": "hit_rate_policy_cost", "machine": machine_info(), "workload": workload.name,
           "requests": len(workload.requests), "capacity_chunks": capacity, "calls_per_round": calls,
           "rounds": COST_ROUNDS, "clock": "process CPU time", "results": rows}
    print(f"wrote {write_json(RESULTS / 'hit_rate_policy_cost.json', doc)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--cost"]:
        return cost()
    parser = argparse.ArgumentParser(prog="benchmarks/hit_rate.py", description=hitrate_cli.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    hitrate_cli.add_arguments(parser)
    return hitrate_cli.run(parser.parse_args(argv or DEFAULTS))


if __name__ == "__main__":
    sys.exit(main())
