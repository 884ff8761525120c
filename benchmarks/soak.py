"""Soak: many requests through the reference engine with cpu + disk + redis tiers while seeded random faults hit
the tiers, then every answer compared with a run without kvtier.

Two ways to build the engine's kvtier (benchmarks/soak_halves.py):

* one store (default): both connector halves over one TieredStore (``KVTierPair``);
* ``--split``: the halves as vLLM builds them, each role with its own tiers from ``kv_connector_extra_config``,
  the scheduler's directory fed by the WorkerReports; the default policy (write_back, promote on hit). Besides
  the faults below, the worker's own (records lost from its cpu pool, its I/O loop stalled past its wait bound, Redis
  flushed) and faults within waves, every ``--fault-every`` engine steps. ``--model full`` (one full-attention
  KV-cache group) makes loads from the cpu tier synchronous; ``hybrid`` (sliding window, two groups) asynchronous.

Faults, one after each wave (every kind occurs within the first waves; benchmarks/soak_faults.py): Redis killed
(restarted empty at the next wave boundary), disk records corrupted or removed, Redis values corrupted; quota
pressure throughout: the cpu and disk tiers are far smaller than the working set, so every wave evicts and demotes.

At the end: no leaked engine blocks, no pins or pending chunks in the directory, no pins in the worker's cpu pool,
no temp files in the disk directory, every tier within its capacity, and the number of wrong answers (tokens or
logits differing from the no-connector run, float32; must be 0). Prints the figures and writes them as JSON.

    .venv/bin/python benchmarks/soak.py [--waves 200] [--requests 6] [--seed 0] [--split] [--model full]
                                        [--out benchmarks/results/soak.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvtier from this checkout

import torch  # noqa: E402

from benchmarks.script_run import missing, run_checked  # noqa: E402
from benchmarks.soak_faults import KINDS, WORKER_KINDS, FaultInjector, WorkerFaults  # noqa: E402
from benchmarks.soak_halves import StepProbe, Target, inspect, one_store, split_halves, worker_bounds  # noqa: E402
from kvtier.config import KvtierConfig, load_config  # noqa: E402
from kvtier.engine import Engine, EngineArgs, ModelConfig, RequestSpec  # noqa: E402
from kvtier.engine.harness import RunRecord, run_waves  # noqa: E402
from kvtier.engine.workload import random_tokens  # noqa: E402
from kvtier.ops.argtypes import non_negative_int, positive_int  # noqa: E402
from kvtier.ops.cli import KvtierParser  # noqa: E402

__all__ = ["ARGS", "KINDS", "SPLIT_SIZES", "WORKER_KINDS", "FaultInjector", "SoakSpec", "make_waves", "run_soak",
           "summary", "verdict"]
ARGS = EngineArgs(model=ModelConfig(sliding_window=48))


@dataclass(frozen=True)
class SoakSpec:
    waves: int = 12
    requests: int = 5  # per wave
    seed: int = 0
    systems: int = 4  # shared system prompts
    recent: int = 0  # repeats and extensions draw from the last this many prompts (0: from every earlier one)
    cpu_capacity: str = "160KiB"
    disk_capacity: str = "384KiB"
    redis_capacity: str = "64MiB"
    redis_timeout: str = "200ms"
    split: bool = False  # each half with its own tiers, as vLLM builds them (the default policy), worker faults
    sliding_window: int | None = 48  # None: one full-attention KV-cache group (loads from cpu are synchronous)
    fault_every: int = 0  # split: a fault within a wave every this many engine steps (0: between waves only)
    stall_seconds: float = 0.25  # split, one group: a loop stall holds the worker's I/O loop this long
    wait_timeout_s: float = 0.05  # split: the worker's wait bound (a synchronous load gives up past it)
    cancel_grace_s: float = 0.05  # split: kvtier.connector.worker.loads.CANCEL_GRACE_S for the run


# the split soak: recent prompts come back (a chunk computed on top of a failed load is hit while still cached), and
# a cpu tier large enough for whole prefixes (synchronous loads)
SPLIT_SIZES: dict[str, Any] = {"recent": 12, "cpu_capacity": "640KiB", "disk_capacity": "1MiB"}


def engine_args(spec: SoakSpec) -> EngineArgs:
    return EngineArgs(model=ModelConfig(sliding_window=spec.sliding_window))


def make_waves(spec: SoakSpec) -> list[list[RequestSpec]]:
    """Requests built from a few shared system prompts, new or earlier user turns, and exact repeats."""
    rng = random.Random(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    vocab = ARGS.model.vocab_size
    systems = [random_tokens(gen, rng.randint(96, 224), vocab) for _ in range(spec.systems)]
    earlier: list[tuple[int, ...]] = []
    waves = []
    for w in range(spec.waves):
        wave = []
        for r in range(spec.requests):
            pool = earlier[-spec.recent:] if spec.recent else earlier
            if earlier and rng.random() < 0.25:
                prompt = rng.choice(pool)
            else:
                base = list(rng.choice(pool)) if earlier and rng.random() < 0.3 else rng.choice(systems)
                prompt = tuple(base[:400] + random_tokens(gen, rng.randint(8, 64), vocab))
                earlier.append(prompt)
            wave.append(RequestSpec(f"w{w}-r{r}", prompt, 3))
        waves.append(wave)
    return waves


def soak_raw(spec: SoakSpec, disk_root: Path, redis_url: str) -> dict[str, Any]:
    """kvtier's config as an engine's ``kv_connector_extra_config``; the split soak keeps the default policy."""
    tiers = [{"name": "cpu", "kind": "cpu", "capacity": spec.cpu_capacity},
             {"name": "disk", "kind": "disk", "capacity": spec.disk_capacity, "path": str(disk_root)},
             {"name": "redis", "kind": "redis", "capacity": spec.redis_capacity, "url": redis_url,
              "key_prefix": f"kvtier-soak-{spec.seed}", "timeout": spec.redis_timeout,
              "connect_timeout": spec.redis_timeout, "breaker_failures": 3, "breaker_backoff": "200ms"}]
    raw: dict[str, Any] = {"chunk_size": 32, "tiers": tiers}
    if not spec.split:
        raw["policy"] = {"write": "write_back", "eviction": "prefix_lru", "promote_on_hit": True}
    return raw


def soak_config(spec: SoakSpec, disk_root: Path, redis_url: str) -> KvtierConfig:
    return load_config(soak_raw(spec, disk_root, redis_url), env={})


def wrong_answers(base: RunRecord, other: RunRecord) -> int:
    """Requests whose tokens or logits differ (exactly, float32) from the no-connector run."""
    wrong = 0
    for req_id, ref in base.requests.items():
        got = other.requests.get(req_id)
        if got is None or got.output_token_ids != ref.output_token_ids or len(got.logits) != len(ref.logits) or \
                not all(torch.equal(a, b) for a, b in zip(ref.logits, got.logits, strict=True)):
            wrong += 1
    return wrong


def _injector(spec: SoakSpec, target: Target, server: Any, disk_root: Path) -> FaultInjector:
    worker = None
    if spec.split:  # loop stalls with one KV-cache group, whose cpu loads are synchronous
        stall = spec.stall_seconds if spec.sliding_window is None else 0.0
        worker = WorkerFaults(target.store, target.loop, stall)
    return FaultInjector(spec.seed, disk_root, server, worker)


def _drive(spec: SoakSpec, waves: list[list[RequestSpec]], target: Target, server: Any,
           disk_root: Path) -> tuple[RunRecord, dict[str, Any]]:
    """Run the waves on the target's engine under faults; the run and its figures (its end inspected while the
    engine is idle, before it is closed)."""
    faults = _injector(spec, target, server, disk_root)
    probe = StepProbe(target, faults, spec.fault_every if spec.split else 0)
    end: dict[str, Any] = {}

    def between(i: int) -> None:
        if i < len(waves) - 1:
            faults(i)
        else:
            faults.finish()
            if faults.worker is not None:
                faults.worker.settle()
            end.update(inspect(target, disk_root))
        probe.mark()

    t0 = time.perf_counter()
    try:
        with worker_bounds(target, spec.wait_timeout_s, spec.cancel_grace_s) if spec.split else nullcontext():
            other = run_waves(target.engine, waves, between, probe)
    finally:
        faults.finish()
    stall = faults.worker.stall if faults.worker is not None else None
    return other, {
        "faults_injected": dict(faults.counts), "faults_within_waves": dict(faults.within_counts),
        "records_damaged": dict(faults.damaged), "sync_load_failures": probe.sync_failures,
        "loop_stalls": stall.stalled if stall is not None else 0, **end,
        "max_step_seconds": round(max(probe.steps, default=0.0), 4), "soak_seconds": round(time.perf_counter() - t0, 2),
    }


def run_soak(spec: SoakSpec, server: Any, workdir: Path) -> dict[str, Any]:
    """Run the soak against a started Redis ``server`` (kill / start / port / url); return the figures."""
    waves = make_waves(spec)
    args = engine_args(spec)
    t0 = time.perf_counter()
    base = run_waves(Engine(args), waves)
    baseline_s = time.perf_counter() - t0
    disk_root = workdir / "disk"
    raw = soak_raw(spec, disk_root, server.url)
    target = split_halves(args, raw) if spec.split else one_store(args, load_config(raw, env={}))
    other, fig = _drive(spec, waves, target, server, disk_root)
    reqs = list(other.requests.values())
    return {
        "spec": asdict(spec), "mode": "split halves" if spec.split else "one store",
        "groups": len(target.engine.kv_cache_config.kv_cache_groups), "policy": asdict(target.cfg.policy),
        "requests": len(reqs), "waves": len(waves), "steps": other.steps, **fig,
        "load_errors_recovered": sum(r.num_load_failures for r in reqs),
        "requests_with_hits": sum(r.external_tokens > 0 for r in reqs),
        "external_hit_tokens": sum(r.external_tokens for r in reqs),
        "hits_by_tier": {k.removeprefix("hits_"): int(v) for k, v in other.stats.items() if k.startswith("hits_")},
        "wrong_answers": wrong_answers(base, other), "leaked_blocks": other.leaked_blocks,
        "baseline_seconds": round(baseline_s, 2),
    }


def summary(fig: dict[str, Any]) -> str:
    faults = ", ".join(f"{k} {v}" for k, v in sorted(fig["faults_injected"].items()))
    within = ", ".join(f"{k} {v}" for k, v in sorted(fig["faults_within_waves"].items())) or "none"
    return (f"{fig['mode']}, {fig['groups']} KV-cache group(s): {fig['requests']} requests in {fig['waves']} waves "
            f"({fig['steps']} steps, {fig['soak_seconds']} s)\n"
            f"faults injected: {faults} (within waves: {within}); records damaged: {fig['records_damaged']}\n"
            f"load errors recovered: {fig['load_errors_recovered']} (synchronous: {fig['sync_load_failures']}); "
            f"loop stalls: {fig['loop_stalls']}; corrupt detected: {fig['corrupt_detected']}; "
            f"redis errors+timeouts: {fig['redis_errors_and_timeouts']}\n"
            f"hits: {fig['requests_with_hits']} requests, {fig['external_hit_tokens']} tokens, by tier "
            f"{fig['hits_by_tier']}; evictions {fig['evictions']}\n"
            f"wrong answers: {fig['wrong_answers']}; leaked blocks: {fig['leaked_blocks']}; pins/pending: "
            f"{fig['directory_pins']}/{fig['directory_pending']}; pool pins: {fig['pool_pins']}; temp files: "
            f"{fig['temp_files']}; within capacity: {fig['within_capacity']}; slowest step {fig['max_step_seconds']} s")


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0; 1 when a check failed (wrong answers, leaks, over capacity) or the run did; 2 for a bad
    option or a missing dependency; 130 on Ctrl-C. Every error is one line."""
    parser = KvtierParser(prog="benchmarks/soak.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waves", type=positive_int, default=200)
    parser.add_argument("--requests", type=positive_int, default=6, help="requests per wave")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--split", action="store_true", help="the halves as vLLM builds them, with worker faults")
    parser.add_argument("--model", choices=("hybrid", "full"), default="hybrid",
                        help="hybrid: sliding window (two KV-cache groups); full: one full-attention group")
    parser.add_argument("--fault-every", type=non_negative_int, default=7,
                        help="--split: a fault within a wave every this many engine steps (0: none)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak.json")
    args = parser.parse_args(argv)
    return run_checked("soak", missing(("redis-server", "redis-cli"), "the soak starts, kills and restarts its own "
                                       "server", args.out), lambda: _verdict(_soak(args)))


def verdict(fig: dict[str, Any]) -> bool:
    """Whether the run passed: no wrong answer, nothing leaked, every tier within capacity."""
    return fig["wrong_answers"] == 0 and fig["leaked_blocks"] == 0 and fig["within_capacity"] and \
        fig["directory_pins"] == fig["directory_pending"] == fig["pool_pins"] == fig["temp_files"] == 0


def _verdict(fig: dict[str, Any]) -> int:
    return 0 if verdict(fig) else 1


def _soak(args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.bench.redis_servers import RedisServer

    spec = SoakSpec(waves=args.waves, requests=args.requests, seed=args.seed, split=args.split,
                    sliding_window=None if args.model == "full" else 48, fault_every=args.fault_every,
                    **(SPLIT_SIZES if args.split else {}))
    with RedisServer(maxmemory="256mb") as server, tempfile.TemporaryDirectory(prefix="kvtier-soak-") as tmp:
        fig = run_soak(spec, server, Path(tmp))
    fig["machine"] = {"python": platform.python_version(), "torch": torch.__version__, "cpus": _cpus()}
    print(summary(fig))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fig, indent=2, default=str) + "\n")
    print(f"results: {args.out}")
    return fig


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    raise SystemExit(main())
