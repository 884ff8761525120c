"""Shared helpers of the disk tier tests: a started tier over a directory, and its record files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.config import DiskTierConfig
from kvtier.tiers.disk.tier import DiskTier


async def disk(path: Path, capacity: int = 1 << 24, **kw: Any) -> DiskTier:
    hmac_key = kw.pop("hmac_key", None)
    tier = DiskTier(DiskTierConfig(name="disk", capacity=capacity, path=str(path), **kw), hmac_key=hmac_key)
    await tier.start()
    return tier


def record_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvt"))
