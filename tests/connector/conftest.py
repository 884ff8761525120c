"""Shared fixtures of the connector tests: ``harness`` builds scheduler-half harnesses (scheduler_harness.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from scheduler_harness import Build, Harness, make_cfg

from kvtier.config import KvtierConfig, WritePolicy
from kvtier.layout import KVCacheConfig


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Build]:
    made: list[Harness] = []

    def build(kcc: KVCacheConfig, write: WritePolicy = WritePolicy.WRITE_THROUGH,
              cfg: KvtierConfig | None = None) -> Harness:
        made.append(Harness(cfg or make_cfg(tmp_path / f"disk{len(made)}", write), kcc))
        return made[-1]

    yield build
    for h in made:
        h.close()
