"""How far can an online eviction policy get on the Mooncake trace? ``python benchmarks/hit_rate_ceiling.py``

An analysis, not a policy benchmark (that is ``benchmarks/hit_rate.py``, which replays through kvtier's own
directory and policies). It uses a small priority-cache simulator with the same semantics (a request hits the
longest held prefix of its 512-token blocks; then every block is inserted or touched in prefix order; the
block with the lowest priority is evicted; token hit rate = sum of min(hit blocks x 512, input length) over
the sum of input lengths) and asks what each kind of knowledge is worth at 10% of the unique blocks:

* ``lru``: priority = time of last use. Matches the replay's LRU (28.4%), which validates the simulator.
* ``lru_tail_first``: LRU, but a request's last block (partial: a later turn never reuses it) goes first.
* ``hindsight <features>``: priority = last use + scale x (P(the request gets a follow-up turn | features) -
  0.4), with P measured on the whole trace afterwards, the best of several scales: an upper bound for any
  online policy that predicts continuation from those features. Features, all known when the request's
  blocks are stored or at the latest when it ends: ``k`` turn number of the conversation, ``n`` blocks in the
  request, ``g`` seconds since the previous turn, ``o`` output tokens.
* ``oracle_continues``: the same with P = 1 for requests that really get a follow-up turn, 0 otherwise.
* ``prefix_hd ...``: kvtier's learned policy through kvtier's own replay, online and with its per-class reuse
  curves learned over the whole trace (frozen from the start, or as a prior that online learning updates).

The conversation structure: request B continues request A when B's held prefix (with an infinite cache) is
at least two blocks long and ends in a block last stored by A. The gap between the best online bound and the
oracle is what no policy built on these signals can close. Writes benchmarks/results/hit_rate_ceiling.json.
"""

from __future__ import annotations

import argparse
import copy
import heapq
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtier.bench.hitrate import DEFAULT_TRACE  # noqa: E402
from kvtier.bench.measure import machine_info, write_json  # noqa: E402

TRACE = DEFAULT_TRACE
RESULTS = ROOT / "benchmarks" / "results" / "hit_rate_ceiling.json"
BLOCK = 512
SCALES = (20_000, 40_000, 80_000, 160_000)
FEATURE_SETS = ("k", "kn", "kng", "kngo")

Request = dict[str, Any]
Priority = Callable[[int], float]  # request index -> bonus added to the time of last use


def simulate(reqs: Sequence[Request], capacity: int, bonus: Priority, tail_first: bool = True) -> float:
    """Token hit rate of a priority cache of ``capacity`` blocks (clock: one tick per block access)."""
    prio: dict[int, float] = {}
    heap: list[tuple[float, int, int]] = []
    clock = hit = total = 0
    for i, r in enumerate(reqs):
        ids: list[int] = r["hash_ids"]
        depth = 0
        for b in ids:
            if b not in prio:
                break
            depth += 1
        hit += min(depth * BLOCK, r["input_length"])
        total += r["input_length"]
        extra = bonus(i)
        last = len(ids) - 1
        for pos, b in enumerate(ids):
            clock += 1
            p = clock + extra if not (tail_first and pos == last and last > 0) else clock - 10**9
            old = prio.get(b)
            if old is not None and old > p:
                p = old
            prio[b] = p
            heapq.heappush(heap, (p, -pos, b))
            while len(prio) > capacity:
                q, _, victim = heapq.heappop(heap)
                if prio.get(victim) == q:
                    del prio[victim]
    return hit / total


def structure(reqs: Sequence[Request]) -> tuple[list[int | None], list[int]]:
    """Each request's parent (the request it continues, or None) and its turn number."""
    seen: set[int] = set()
    owner: dict[int, int] = {}
    parent: list[int | None] = [None] * len(reqs)
    for i, r in enumerate(reqs):
        depth = 0
        for b in r["hash_ids"]:
            if b not in seen:
                break
            depth += 1
        if depth >= 2:
            parent[i] = owner[r["hash_ids"][depth - 1]]
        for b in r["hash_ids"]:
            seen.add(b)
            owner[b] = i
    turn = [0] * len(reqs)
    for i, p in enumerate(parent):
        turn[i] = 0 if p is None else turn[p] + 1
    return parent, turn


def features(reqs: Sequence[Request], parent: Sequence[int | None], turn: Sequence[int],
             which: str) -> list[tuple[int, ...]]:
    def log2(x: float) -> int:
        return int(math.log2(max(x, 0) + 1))

    out = []
    for i, r in enumerate(reqs):
        f: list[int] = []
        p = parent[i]
        if "k" in which:
            f.append(min(turn[i], 6))
        if "n" in which:
            f.append(min(log2(len(r["hash_ids"])), 6))
        if "g" in which:
            f.append(-1 if p is None else min(log2((r["timestamp"] - reqs[p]["timestamp"]) // 10_000), 6))
        if "o" in which:
            f.append(min(log2(r["output_length"]), 10))
        out.append(tuple(f))
    return out


def prefix_hd_learning(trace: Path, capacity: int) -> dict[str, float]:
    """What ``prefix_hd``'s learning costs, through kvtier's own replay: online (as shipped, and keeping every
    observation), with the curves learned over the whole trace frozen from the start (hindsight), and with those
    curves as a prior worth one refresh period that online learning then updates (a perfect warm start)."""
    from kvtier.bench.hitrate import DirectoryStack, replay
    from kvtier.bench.workloads import load_mooncake
    from kvtier.control.policies.hitdensity import PrefixHitDensityPolicy

    workload = load_mooncake(trace)

    def rate(policy: PrefixHitDensityPolicy) -> float:
        return replay(workload, DirectoryStack([policy], [capacity])).hit_rate

    whole = PrefixHitDensityPolicy(capacity, decay=1.0)
    out = {"prefix_hd online": rate(PrefixHitDensityPolicy(capacity)), "prefix_hd online, no decay": rate(whole)}
    whole._refresh()
    learned = copy.deepcopy(whole.stats)

    class Frozen(PrefixHitDensityPolicy):
        def _refresh(self) -> None:
            super()._refresh()
            self.stats = copy.deepcopy(learned)

    out["prefix_hd, whole-trace curves frozen (hindsight)"] = rate(Frozen(capacity, decay=1.0))
    warm = PrefixHitDensityPolicy(capacity)
    warm.stats = copy.deepcopy(learned)
    for stats in warm.stats:
        stats.hits = [h * 0.05 for h in stats.hits]
        stats.exposure = [e * 0.05 for e in stats.exposure]
    out["prefix_hd, whole-trace curves as prior, then online"] = rate(warm)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--capacity", type=float, default=0.10, help="fraction of the unique blocks (default 0.10)")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not args.trace.exists():
        print(f"trace not found: {args.trace}; nothing to do")
        return 0
    started = time.monotonic()
    reqs = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    unique = len({b for r in reqs for b in r["hash_ids"]})
    capacity = int(unique * args.capacity)
    parent, turn = structure(reqs)
    continues = [0] * len(reqs)
    for p in parent:
        if p is not None:
            continues[p] = 1
    rows: list[dict[str, Any]] = []

    def add(name: str, rate: float, **extra: Any) -> None:
        rows.append({"policy": name, "hit_rate": round(rate, 4), **extra})
        print(f"{name:<28} {100 * rate:6.2f}%  {extra if extra else ''}")

    add("lru", simulate(reqs, capacity, lambda i: 0.0, tail_first=False))
    add("lru_tail_first", simulate(reqs, capacity, lambda i: 0.0))
    for which in FEATURE_SETS:
        keys = features(reqs, parent, turn, which)
        counts: Counter[tuple[int, ...]] = Counter(keys)
        hits: Counter[tuple[int, ...]] = Counter(k for k, c in zip(keys, continues, strict=True) if c)
        prob = [hits[k] / counts[k] for k in keys]
        best = max((simulate(reqs, capacity, lambda i, s=s, p=prob: s * (p[i] - 0.4)), s) for s in SCALES)
        add(f"hindsight {which}", best[0], classes=len(counts), scale=best[1])
    add("oracle_continues", max(simulate(reqs, capacity, lambda i, s=s: s * (continues[i] - 0.4))
                                for s in SCALES))
    for name, rate in prefix_hd_learning(args.trace, capacity).items():
        add(name, rate)
    body = {"benchmark": "hit_rate_ceiling", "machine": machine_info(), "trace": args.trace.name,
            "requests": len(reqs), "unique_blocks": unique, "capacity_blocks": capacity,
            "capacity_fraction": args.capacity, "continuing_requests": sum(continues),
            "seconds": round(time.monotonic() - started, 1), "results": rows}
    print(f"wrote {write_json(args.json, body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
