"""``kvtier bench vllm-overhead``'s kvtier configs: each mode's file is a valid config with the tiers it names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.vllm_overhead import MODES, _less, kvtier_yaml, prime
from kvtier.config import RedisTierConfig, WritePolicy, load_config
from kvtier.control.persist import enabled


@pytest.mark.parametrize("mode", [m for m in MODES if m != "none"])
def test_each_modes_config_loads_with_its_tiers(mode: str, tmp_path: Path) -> None:
    path = kvtier_yaml(tmp_path / "kvtier.yaml", mode, 32, tmp_path, "redis://127.0.0.1:1/0", ["store_threshold=2"])
    cfg = load_config(path, env={})
    assert [t.name for t in cfg.tiers] == mode.removeprefix("kvtier_").split("_")
    assert cfg.policy.write is WritePolicy.WRITE_BACK and cfg.policy.store_threshold == 2
    assert enabled(cfg.policy)  # with cpu above disk, what cpu holds is copied to disk as the engine runs


def test_the_redis_tier_is_private_when_asked(tmp_path: Path) -> None:
    for private in (False, True):
        path = kvtier_yaml(tmp_path / "kvtier.yaml", "kvtier_redis", 32, tmp_path, "redis://127.0.0.1:1/0",
                           private_redis=private)
        tier = load_config(path, env={}).tier("redis")
        assert isinstance(tier, RedisTierConfig) and tier.private is private


class Handle:
    """Stands in for an engine process's handle (kvtier.bench.vllm_driver.Engine): what ``prime`` sends it."""

    def __init__(self, mode: str) -> None:
        self.mode, self.on, self.saved = mode, False, 0
        self.asked: list[tuple[int, int, bool]] = []

    def switch(self, on: bool) -> None:
        self.on = on

    def ask(self, prompt: list[int], max_tokens: int) -> dict[str, object]:
        self.asked.append((len(prompt), max_tokens, self.on))
        self.saved += len(prompt) // 32
        return {}

    def flush(self) -> dict[str, object]:
        return {"save_chunks": self.saved, "save_seconds": 0.5, "kvtier_disabled": 1}


def test_priming_sends_new_prompts_to_kvtier_engines_working_and_the_rounds_count_only_their_own_saves() -> None:
    none, cpu = Handle("none"), Handle("kvtier_cpu")
    engines: list[Any] = [none, cpu]
    synced: list[int] = []
    primed = prime(engines, 4, 64, sync=lambda: synced.append(len(cpu.asked)))
    assert none.asked == [] and cpu.asked == [(64, 1, True)] * 4 and synced == [4]  # synced once, after priming
    assert primed == {"kvtier_cpu": {"save_chunks": 8, "save_seconds": 0.5, "kvtier_disabled": 1}}
    cpu.ask([0] * 96, 8)
    # kvtier disabled while priming stays disabled: that count is kept whole, not zeroed
    assert _less(cpu.flush(), primed["kvtier_cpu"]) == {"save_chunks": 3, "save_seconds": 0.0, "kvtier_disabled": 1}
