"""``kvtier bench vllm-overhead``'s kvtier configs: each mode's file is a valid config with the tiers it names."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.vllm_overhead import MODES, kvtier_yaml
from kvtier.config import WritePolicy, load_config
from kvtier.control.persist import enabled


@pytest.mark.parametrize("mode", [m for m in MODES if m != "none"])
def test_each_modes_config_loads_with_its_tiers(mode: str, tmp_path: Path) -> None:
    path = kvtier_yaml(tmp_path / "kvtier.yaml", mode, 32, tmp_path, "redis://127.0.0.1:1/0", ["store_threshold=2"])
    cfg = load_config(path, env={})
    assert [t.name for t in cfg.tiers] == mode.removeprefix("kvtier_").split("_")
    assert cfg.policy.write is WritePolicy.WRITE_BACK and cfg.policy.store_threshold == 2
    assert enabled(cfg.policy)  # with cpu above disk, what cpu holds is copied to disk as the engine runs
