"""Shared pieces of the fault suite: configs, workloads, a cached no-connector baseline, step timing and the
end-of-run checks (identical outputs, no leaked blocks, no pins, no temp files, capacity held).

Everything runs the REAL reference engine with KVTierConnector halves over one TieredStore (``KVTierPair``);
faults are injected from the harness hooks (``between_waves`` after a wave, ``on_step`` after each step).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier.config import KvtierConfig, load_config
from kvtier.control.directory import ChunkState, Directory
from kvtier.engine import Engine, EngineArgs, KVTierPair, ModelConfig, RequestSpec
from kvtier.engine.harness import RunRecord, compare, run_waves
from kvtier.engine.workload import random_tokens

HYBRID = ModelConfig(sliding_window=48)  # full-attention and sliding-window groups: both load paths
ARGS = EngineArgs(model=HYBRID)
CHUNK = 32
_prefix = itertools.count()


def tier_section(kind: str, root: Path | None = None, url: str | None = None, capacity: str = "32MiB",
                 **kw: Any) -> dict[str, Any]:
    """One tier section; redis gets a fresh key prefix (tests share servers)."""
    section: dict[str, Any] = {"name": kind, "kind": kind, "capacity": capacity, **kw}
    if kind == "disk":
        section.setdefault("path", str(root))
    elif kind == "redis":
        section.setdefault("key_prefix", f"kvtier-faults-{next(_prefix)}")
        section["url"] = url
    return section


def make_config(tiers: list[dict[str, Any]], *, write: str = "write_back", tenant: str = "",
                hmac_env: str | None = None) -> KvtierConfig:
    raw: dict[str, Any] = {"chunk_size": CHUNK, "tiers": tiers, "namespace": {"tenant": tenant},
                           "policy": {"write": write, "eviction": "prefix_lru", "promote_on_hit": True}}
    if hmac_env:
        raw["security"] = {"hmac_key_env": hmac_env}
    return load_config(raw, env={})


def prompts(seed: int, *lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [random_tokens(gen, n, HYBRID.vocab_size) for n in lengths]


def fault_waves(seed: int = 7, max_tokens: int = 4) -> list[list[RequestSpec]]:
    """Four waves: 0 stores; 1 runs while a fault is on (shares wave 0's prefixes); 2 stores new prefixes after
    recovery; 3 repeats prefixes of waves 0 and 2 (hits must be back)."""
    sa, sb, sc, *q = prompts(seed, 200, 170, 190, 20, 25, 30, 35, 22, 27)

    def spec(name: str, tokens: list[int]) -> RequestSpec:
        return RequestSpec(name, tuple(tokens), max_tokens)

    return [[spec("w0-a", sa + q[0]), spec("w0-b", sb + q[1])],
            [spec("w1-a", sa + q[2]), spec("w1-b", sb + q[3])],
            [spec("w2-c", sc + q[4])],
            [spec("w3-c", sc + q[5]), spec("w3-a", sa + q[0])]]


_BASELINES: dict[tuple[Any, ...], RunRecord] = {}


def baseline(waves: Sequence[Sequence[RequestSpec]], args: EngineArgs = ARGS) -> RunRecord:
    """The workload's no-connector run (cached: the same waves always give the same outputs)."""
    ident = (args, tuple(tuple(w) for w in waves))
    if ident not in _BASELINES:
        _BASELINES[ident] = run_waves(Engine(args), waves)
    return _BASELINES[ident]


@dataclass
class FaultRun:
    """A connector run of a workload and what was measured during it."""

    record: RunRecord
    pair: KVTierPair
    step_seconds: list[float] = field(default_factory=list)
    wave_step_max: list[float] = field(default_factory=list)

    @property
    def max_step(self) -> float:
        return max(self.step_seconds, default=0.0)

    def wave_hits(self, prefix: str) -> int:
        """External (loaded) tokens of the requests whose id starts with ``prefix``."""
        return sum(r.external_tokens for i, r in self.record.requests.items() if i.startswith(prefix))

    def tier_stats(self, name: str) -> Any:
        return self.pair.store.tier(name).stats()

    def load_failures(self) -> int:
        return sum(r.num_load_failures for r in self.record.requests.values())


WaveHook = Callable[[int, KVTierPair], None]


def run_faulted(cfg: KvtierConfig, waves: Sequence[Sequence[RequestSpec]], *,
                between_waves: WaveHook | None = None,
                on_step: Callable[[Engine], None] | None = None, args: EngineArgs = ARGS) -> FaultRun:
    """Run ``waves`` through the engine with kvtier, timing every step (hooks excluded from the timing).
    ``between_waves(i, pair)`` runs after wave ``i`` with the store's pair (its tiers and I/O loop)."""
    pair = KVTierPair(cfg)
    run = FaultRun(record=None, pair=pair)  # type: ignore[arg-type]
    mark = [time.perf_counter()]
    wave_start = [0]

    def step_hook(engine: Engine) -> None:
        run.step_seconds.append(time.perf_counter() - mark[0])
        if on_step is not None:
            on_step(engine)
        mark[0] = time.perf_counter()

    def wave_hook(i: int) -> None:
        run.wave_step_max.append(max(run.step_seconds[wave_start[0]:], default=0.0))
        wave_start[0] = len(run.step_seconds)
        if between_waves is not None:
            between_waves(i, pair)
        mark[0] = time.perf_counter()

    run.record = run_waves(Engine(args, pair), waves, wave_hook, step_hook)
    return run


def wait_breaker_closed(pair: KVTierPair, tier: str = "redis", limit: float = 40.0) -> float:
    """Probe a shared tier until its circuit breaker is closed again (after a server came back); the seconds
    it took. The breaker lets one probe through per back-off, so this is bounded by its max back-off."""
    t0 = time.monotonic()
    probe = bytes(32)
    target: Any = pair.store.tier(tier)
    while target.breaker.state != 0:
        assert time.monotonic() - t0 < limit, f"tier {tier} did not recover within {limit}s"
        pair.loop.run(target.contains([probe]))
        time.sleep(0.05)
    return time.monotonic() - t0


def assert_identical(run: FaultRun, waves: Sequence[Sequence[RequestSpec]], args: EngineArgs = ARGS) -> None:
    """Every request finished with the tokens and logits (exactly) of the no-connector run; no block leaked."""
    base = baseline(waves, args)
    tokens_same, logits_same, worst, failures = compare(base, run.record, 0.0)
    assert tokens_same and logits_same and not failures, (worst, failures)
    assert all(r.finish_reason == "length" for r in run.record.requests.values())
    assert run.record.leaked_blocks == 0


def directory_residue(directory: Directory) -> tuple[int, int]:
    """(pinned chunks, pending chunks) left in a directory; both must be 0 once the engine is idle."""
    pins = pending = 0
    for index in directory._tiers.values():  # read-only inspection of the bookkeeping
        for entry in index.entries.values():
            pins += entry.pins > 0
            pending += entry.state is ChunkState.PENDING
    return pins, pending


def temp_files(root: Path) -> list[Path]:
    return list(root.rglob("*.tmp"))


def record_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvt"))


def assert_clean(run: FaultRun, disk_root: Path | None = None) -> None:
    """No pins or pending chunks, no temp files, every tier (and the directory) within its capacity."""
    assert directory_residue(run.pair.store.directory) == (0, 0)
    for name in run.pair.store.tier_names:
        tier = run.pair.store.tier(name)
        assert tier.used_bytes() <= tier.capacity_bytes, name
        if not tier.is_shared:
            assert run.pair.store.directory.used_bytes(name) <= tier.capacity_bytes, name
    if disk_root is not None:
        assert temp_files(disk_root) == []
        files = sum(p.stat().st_size for p in record_files(disk_root))
        assert files <= run.pair.store.tier("disk").capacity_bytes
