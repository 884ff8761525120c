"""The first reuse after a pause hits (issue 32), in the reference engine with split halves as vLLM builds them.

The scheduler learns that a write landed from the next step's worker report, and an idle engine runs no step: B,
sharing A's prefix and submitted right after A finished, was looked up before any step told the scheduler of A's
writes, and computed everything. A chunk whose write is in flight, or landed unreported, is now served: B loads
it asynchronously, the worker's read waiting for its own write. Each tier's writes are held until B's lookup, so
that no step can deliver them first (the landed cases then let them land before B arrives).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import TierKind
from kvtier.engine import EngineArgs, ModelConfig
from kvtier.engine.core import Engine, RequestSpec
from kvtier.engine.types import KVTransferConfig
from kvtier.records.keys import Key, chunk_keys

C = 32
FULL, HYBRID = ModelConfig(), ModelConfig(sliding_window=48)
PREFIX = tuple(range(1, 4 * C + 1))  # 4 chunks
B_TOKENS = PREFIX + tuple(range(300, 316))  # the prefix + 16 tokens: its 4 whole chunks can come from a cache
# the tier each hit comes from, and the tier whose writes the test holds: a cpu save with nothing queued is written
# within its step and reported in that step's output, so the cpu case writes through to disk as well (its cpu
# record is reported with the disk write, as any cpu save queued behind another)
CASES = {"cpu": ("cpu", "disk"), "disk": ("disk", "disk"), "redis": ("redis", "redis")}
_uncached: dict[tuple[ModelConfig, tuple[int, ...]], list[torch.Tensor]] = {}


def tiers(kind: str, tmp_path: Path, redis_url: str | None) -> list[dict[str, Any]]:
    disk = {"name": "disk", "kind": "disk", "capacity": "32MiB", "path": str(tmp_path / "disk")}
    if kind == "cpu":
        return [{"name": "cpu", "kind": "cpu", "capacity": "32MiB"}, disk]
    if kind == "redis":
        return [{"name": "redis", "kind": "redis", "capacity": "32MiB", "url": redis_url, "timeout": "2s",
                 "key_prefix": f"kvtier-pause-{tmp_path.name}"}]
    return [disk]


def split_engine(kind: str, tmp_path: Path, redis_url: str | None, model: ModelConfig) -> Engine:
    extra = {"chunk_size": C, "tiers": tiers(kind, tmp_path, redis_url),
             "policy": {"write": "write_through" if kind == "cpu" else "write_back", "eviction": "prefix_lru"}}
    ktc = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config=extra)
    return Engine(EngineArgs(model=model), kv_transfer_config=ktc)


class HeldWrites:
    """The worker's writes to one tier wait until ``release`` (then each succeeds, or fails when ``fail``)."""

    def __init__(self, engine: Engine, tier: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self._loop = engine.worker_connector._loop  # type: ignore[union-attr]
        self._gate = asyncio.Event()
        self.fail = False
        target = engine.worker_connector._work().store.tier(tier)  # type: ignore[union-attr]
        put = target.put

        async def held(items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
            await self._gate.wait()
            return [False] * len(items) if self.fail else await put(items)

        monkeypatch.setattr(target, "put", held)

    def release(self) -> None:
        self._loop.loop.call_soon_threadsafe(self._gate.set)


def uncached_logits(model: ModelConfig, tokens: tuple[int, ...]) -> list[torch.Tensor]:
    if (model, tokens) not in _uncached:
        engine = Engine(EngineArgs(model=model))
        try:
            _uncached[model, tokens] = engine.run([RequestSpec("ref", tokens, max_tokens=2)])["ref"].logits
        finally:
            engine.close()
    return _uncached[model, tokens]


def run_a_then_b(engine: Engine, held: HeldWrites, *, landed: bool) -> tuple[Any, dict[TierKind, int], bool]:
    """A, then B in the step right after A finished (its writes held till then); B, its hit sources, and whether
    the scheduler had been told of any of A's writes when it looked B up."""
    sched = engine.scheduler_connector._sched()  # type: ignore[union-attr]
    engine.add_request(RequestSpec("A", (*PREFIX, 7, 7), max_tokens=2))
    while not any(r.request_id == "A" for r in engine.step()):
        pass
    if landed:  # the pause: A's writes land, and no step reports them
        held.release()
        engine.worker_connector._work().flush()  # type: ignore[union-attr]
    keys = chunk_keys(sched._spaces[0], PREFIX, C)
    told = any(sched.directory.contains(t, k) for t in sched.directory.tier_names for k in keys
               if not sched.directory.is_shared(t))
    sources: dict[TierKind, int] = {}

    def after_step(_: Engine) -> None:
        held.release()  # B was looked up in the step just run
        sources.update(sched.hit_sources("B"))

    b = engine.run([RequestSpec("B", B_TOKENS, max_tokens=2)], on_step=after_step)["B"]
    return b, sources, told


@pytest.mark.parametrize(("kind", "landed"), [("cpu", True), ("disk", True), ("cpu", False), ("disk", False),
                                              ("redis", False)],
                         ids=["cpu-landed", "disk-landed", "cpu-in-flight", "disk-in-flight", "redis-in-flight"])
def test_the_first_reuse_after_a_pause_hits(kind: str, landed: bool, tmp_path: Path, request: pytest.FixtureRequest,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """B hits A's 4 whole chunks (it hit 0 before) with the uncached logits bit for bit, reported as hits of the
    tier they came from (vLLM's cached tokens by source)."""
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    source, gated = CASES[kind]
    engine = split_engine(kind, tmp_path, url, FULL)
    held = HeldWrites(engine, gated, monkeypatch)
    try:
        b, sources, told = run_a_then_b(engine, held, landed=landed)
        assert not told  # the case of the issue: no step delivered A's write reports before B's lookup
        assert (b.external_tokens, b.num_load_failures) == (4 * C, 0)
        assert sources == {TierKind(source): 4 * C}
        assert torch.equal(torch.stack(b.logits), torch.stack(uncached_logits(FULL, B_TOKENS)))
    finally:
        held.release()  # a failed assertion must not leave the write for shutdown to wait out
        engine.close()


@pytest.mark.parametrize("model", [FULL, HYBRID], ids=["one-group", "two-groups"])
def test_a_write_that_fails_after_the_lookup_is_recomputed(model: ModelConfig, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A's disk write fails after B counted on it: B's load fails (one group: its blocks; two groups: the whole
    request), B is recomputed with the uncached logits; once writes succeed again the prefix is stored (C) and hit
    (D)."""
    engine = split_engine("disk", tmp_path, None, model)
    held = HeldWrites(engine, "disk", monkeypatch)
    held.fail = True
    try:
        b, _, _ = run_a_then_b(engine, held, landed=False)
        assert b.num_load_failures >= 1 and b.external_tokens == 0
        assert torch.equal(torch.stack(b.logits), torch.stack(uncached_logits(model, B_TOKENS)))
        held.fail = False
        assert engine.run([RequestSpec("C", B_TOKENS, max_tokens=2)])["C"].external_tokens == 0  # nothing kept
        d = engine.run([RequestSpec("D", B_TOKENS, max_tokens=2)])["D"]
        assert (d.external_tokens, d.num_load_failures) == (4 * C, 0)
        assert torch.equal(torch.stack(d.logits), torch.stack(uncached_logits(model, B_TOKENS)))
    finally:
        held.release()
        engine.close()
