"""Soak: many requests through the reference engine with cpu + disk + redis tiers while seeded random faults hit
the tiers, then every answer compared with a run without kvtier.

Faults, one after each wave (every kind occurs within the first waves, then drawn at random):

* ``redis_kill``: SIGKILL the Redis server; it is restarted (empty) after the next wave (``redis_restart``);
* ``disk_corrupt``: flip a byte in, or truncate, some record files; ``disk_delete``: remove some record files
  behind the engine's back (another process or an operator cleaning up);
* ``redis_corrupt``: overwrite part of some Redis values, or truncate them;
* quota pressure throughout: the cpu and disk tiers are far smaller than the working set, so every wave evicts
  and demotes.

At the end: no leaked engine blocks, no pins or pending chunks in the directory, no temp files in the disk
directory, every tier within its capacity, and the number of wrong answers (tokens or logits differing from
the no-connector run; must be 0). Prints the figures and writes them as JSON.

    .venv/bin/python benchmarks/soak.py [--waves 200] [--requests 6] [--seed 0] [--out benchmarks/results/soak.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvtier from this checkout

import torch  # noqa: E402

from benchmarks.script_run import missing, run_checked  # noqa: E402
from kvtier.cli import KvtierParser, non_negative_int, positive_int  # noqa: E402
from kvtier.config import KvtierConfig, load_config  # noqa: E402
from kvtier.engine import Engine, EngineArgs, KVTierPair, ModelConfig, RequestSpec  # noqa: E402
from kvtier.engine.harness import RunRecord, run_waves  # noqa: E402
from kvtier.engine.workload import random_tokens  # noqa: E402

KINDS = ("redis_kill", "disk_corrupt", "disk_delete", "redis_corrupt")
ARGS = EngineArgs(model=ModelConfig(sliding_window=48))


@dataclass(frozen=True)
class SoakSpec:
    waves: int = 12
    requests: int = 5  # per wave
    seed: int = 0
    systems: int = 4  # shared system prompts
    cpu_capacity: str = "160KiB"
    disk_capacity: str = "384KiB"
    redis_capacity: str = "64MiB"
    redis_timeout: str = "200ms"


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
            if earlier and rng.random() < 0.25:
                prompt = rng.choice(earlier)
            else:
                base = list(rng.choice(earlier)) if earlier and rng.random() < 0.3 else rng.choice(systems)
                prompt = tuple(base[:400] + random_tokens(gen, rng.randint(8, 64), vocab))
                earlier.append(prompt)
            wave.append(RequestSpec(f"w{w}-r{r}", prompt, 3))
        waves.append(wave)
    return waves


def soak_config(spec: SoakSpec, disk_root: Path, redis_url: str) -> KvtierConfig:
    tiers = [{"name": "cpu", "kind": "cpu", "capacity": spec.cpu_capacity},
             {"name": "disk", "kind": "disk", "capacity": spec.disk_capacity, "path": str(disk_root)},
             {"name": "redis", "kind": "redis", "capacity": spec.redis_capacity, "url": redis_url,
              "key_prefix": f"kvtier-soak-{spec.seed}", "timeout": spec.redis_timeout,
              "connect_timeout": spec.redis_timeout, "breaker_failures": 3, "breaker_backoff": "200ms"}]
    return load_config({"chunk_size": 32, "tiers": tiers,
                        "policy": {"write": "write_back", "eviction": "prefix_lru", "promote_on_hit": True}}, env={})


class FaultInjector:
    """Draws and applies one fault per wave boundary; counts what it did."""

    def __init__(self, seed: int, disk_root: Path, server: Any) -> None:
        self.rng = random.Random(seed * 7919 + 1)
        self.disk_root = disk_root
        self.server = server
        self.counts: Counter[str] = Counter()
        self.damaged: Counter[str] = Counter()
        self._order = list(KINDS)
        self.rng.shuffle(self._order)
        self._down = False

    def __call__(self, wave: int, _pair: object = None) -> None:
        if self._down:  # a killed server comes back after one wave
            self.server.start()
            self._down = False
            self.counts["redis_restart"] += 1
        kind = self._order[wave] if wave < len(self._order) else self.rng.choice(KINDS)
        getattr(self, kind)()
        self.counts[kind] += 1

    def redis_kill(self) -> None:
        self.server.kill()
        self._down = True

    def _files(self) -> list[Path]:
        files = sorted(self.disk_root.rglob("*.kvt"))
        return self.rng.sample(files, min(len(files), self.rng.randint(1, 6)))

    def disk_corrupt(self) -> None:
        for path in self._files():
            data = bytearray(path.read_bytes())
            if self.rng.random() < 0.5:
                data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
            else:
                del data[self.rng.randrange(1, len(data)):]
            path.write_bytes(bytes(data))
            self.damaged["disk_records"] += 1

    def disk_delete(self) -> None:
        for path in self._files():
            path.unlink(missing_ok=True)
            self.damaged["disk_deleted"] += 1

    def redis_corrupt(self) -> None:
        if self._down:
            return
        import redis  # the redis extra: main() checks for it

        client = redis.Redis(host="127.0.0.1", port=self.server.port, socket_timeout=5)
        try:
            names = sorted(client.scan_iter(count=1000))
            for name in self.rng.sample(names, min(len(names), self.rng.randint(1, 6))):
                size = int(client.strlen(name))
                if self.rng.random() < 0.5 and size > 1:
                    client.setrange(name, self.rng.randrange(size), bytes([self.rng.randrange(256)]) * 3)
                else:
                    client.set(name, client.getrange(name, 0, max(0, size // 2)))
                self.damaged["redis_records"] += 1
        finally:
            client.close()

    def finish(self) -> None:
        if self._down:
            self.server.start()
            self._down = False
            self.counts["redis_restart"] += 1


def wrong_answers(base: RunRecord, other: RunRecord) -> int:
    """Requests whose tokens or logits differ (exactly, float32) from the no-connector run."""
    wrong = 0
    for req_id, ref in base.requests.items():
        got = other.requests.get(req_id)
        if got is None or got.output_token_ids != ref.output_token_ids or len(got.logits) != len(ref.logits) or \
                not all(torch.equal(a, b) for a, b in zip(ref.logits, got.logits, strict=True)):
            wrong += 1
    return wrong


def residue(pair: KVTierPair) -> tuple[int, int]:
    """(pinned, pending) chunks left in the directory."""
    from kvtier.directory import ChunkState

    pins = pending = 0
    for index in pair.store.directory._tiers.values():  # read-only inspection
        for entry in index.entries.values():
            pins += entry.pins > 0
            pending += entry.state is ChunkState.PENDING
    return pins, pending


def capacity_report(pair: KVTierPair, disk_root: Path) -> dict[str, dict[str, int]]:
    out = {}
    for name in pair.store.tier_names:
        tier = pair.store.tier(name)
        used = tier.used_bytes() if tier.is_shared else max(tier.used_bytes(), pair.store.directory.used_bytes(name))
        out[name] = {"used": used, "capacity": tier.capacity_bytes}
    out["disk_files"] = {"used": sum(p.stat().st_size for p in disk_root.rglob("*.kvt")),
                         "capacity": pair.store.tier("disk").capacity_bytes}
    return out


def run_soak(spec: SoakSpec, server: Any, workdir: Path) -> dict[str, Any]:
    """Run the soak against a started Redis ``server`` (kill / start / port / url); return the figures."""
    waves = make_waves(spec)
    t0 = time.perf_counter()
    base = run_waves(Engine(ARGS), waves)
    disk_root = workdir / "disk"
    pair = KVTierPair(soak_config(spec, disk_root, server.url))
    faults = FaultInjector(spec.seed, disk_root, server)
    steps: list[float] = []
    mark = [time.perf_counter()]

    def on_step(_engine: Engine) -> None:
        steps.append(time.perf_counter() - mark[0])
        mark[0] = time.perf_counter()

    def between(i: int) -> None:
        if i < len(waves) - 1:
            faults(i)
        mark[0] = time.perf_counter()

    t1 = time.perf_counter()
    try:
        other = run_waves(Engine(ARGS, pair), waves, between, on_step)
    finally:
        faults.finish()
    wall = time.perf_counter() - t1
    stats = {name: pair.store.tier(name).stats().as_dict() for name in pair.store.tier_names}
    reqs = list(other.requests.values())
    caps = capacity_report(pair, disk_root)
    pins, pending = residue(pair)
    return {
        "spec": asdict(spec), "requests": len(reqs), "waves": len(waves), "steps": other.steps,
        "faults_injected": dict(faults.counts), "records_damaged": dict(faults.damaged),
        "load_errors_recovered": sum(r.num_load_failures for r in reqs),
        "requests_with_hits": sum(r.external_tokens > 0 for r in reqs),
        "external_hit_tokens": sum(r.external_tokens for r in reqs),
        "hits_by_tier": {k.removeprefix("hits_"): int(v) for k, v in other.stats.items() if k.startswith("hits_")},
        "corrupt_detected": {n: int(s["corrupt"]) for n, s in stats.items()},
        "redis_errors_and_timeouts": int(stats["redis"]["errors"] + stats["redis"]["timeouts"]),
        "evictions": {n: pair.store.directory.stats.evictions_by_tier.get(n, 0) for n in stats},
        "wrong_answers": wrong_answers(base, other), "leaked_blocks": other.leaked_blocks,
        "directory_pins": pins, "directory_pending": pending,
        "temp_files": len(list(disk_root.rglob("*.tmp"))), "capacity": caps,
        "within_capacity": all(c["used"] <= c["capacity"] for c in caps.values()),
        "max_step_seconds": round(max(steps, default=0.0), 4), "soak_seconds": round(wall, 2),
        "baseline_seconds": round(t1 - t0, 2),
    }


def summary(fig: dict[str, Any]) -> str:
    faults = ", ".join(f"{k} {v}" for k, v in sorted(fig["faults_injected"].items()))
    return (f"{fig['requests']} requests in {fig['waves']} waves ({fig['steps']} steps, {fig['soak_seconds']} s)\n"
            f"faults injected: {faults}; records damaged: {fig['records_damaged']}\n"
            f"load errors recovered: {fig['load_errors_recovered']}; corrupt detected: {fig['corrupt_detected']}; "
            f"redis errors+timeouts: {fig['redis_errors_and_timeouts']}\n"
            f"hits: {fig['requests_with_hits']} requests, {fig['external_hit_tokens']} tokens, by tier "
            f"{fig['hits_by_tier']}; evictions {fig['evictions']}\n"
            f"wrong answers: {fig['wrong_answers']}; leaked blocks: {fig['leaked_blocks']}; pins/pending: "
            f"{fig['directory_pins']}/{fig['directory_pending']}; temp files: {fig['temp_files']}; within capacity: "
            f"{fig['within_capacity']}; slowest step {fig['max_step_seconds']} s")


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0; 1 when a check failed (wrong answers, leaks, over capacity) or the run did; 2 for a bad
    option or a missing dependency; 130 on Ctrl-C. Every error is one line."""
    parser = KvtierParser(prog="benchmarks/soak.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waves", type=positive_int, default=200)
    parser.add_argument("--requests", type=positive_int, default=6, help="requests per wave")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak.json")
    args = parser.parse_args(argv)
    return run_checked("soak", missing(("redis-server", "redis-cli"), "the soak starts, kills and restarts its own "
                                       "server", args.out), lambda: _verdict(_soak(args)))


def _verdict(fig: dict[str, Any]) -> int:
    ok = fig["wrong_answers"] == 0 and fig["leaked_blocks"] == 0 and fig["within_capacity"] and \
        fig["directory_pins"] == fig["directory_pending"] == fig["temp_files"] == 0
    return 0 if ok else 1


def _soak(args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.bench.redis_servers import RedisServer

    spec = SoakSpec(waves=args.waves, requests=args.requests, seed=args.seed)
    with RedisServer(maxmemory="256mb") as server, tempfile.TemporaryDirectory(prefix="kvtier-soak-") as tmp:
        fig = run_soak(spec, server, Path(tmp))
    fig["machine"] = {"python": platform.python_version(), "torch": torch.__version__, "cpus": _cpus()}
    print(summary(fig))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fig, indent=2) + "\n")
    print(f"results: {args.out}")
    return fig


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    raise SystemExit(main())
