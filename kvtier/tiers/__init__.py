"""Storage tiers and their lazy registry: importing this package imports no tier module.

``make_tier(section)`` builds the tier a config section names; ``await tier.start()`` opens it (see
``kvtier.tiers.base`` for the lifecycle and the contract every tier follows).
"""

from __future__ import annotations

import importlib
from typing import Any

from kvtier.config import TierConfig
from kvtier.tiers.base import Tier, TierEntry, TierStats

TIERS: dict[str, str] = {
    "gpu": "kvtier.tiers.gpu:GpuTier",
    "cpu": "kvtier.tiers.cpu:CpuTier",
    "disk": "kvtier.tiers.disk:DiskTier",
    "redis": "kvtier.tiers.redis:RedisTier",
}

__all__ = ["TIERS", "Tier", "TierEntry", "TierStats", "make_tier", "tier_class"]


def tier_class(kind: str) -> type[Tier]:
    """The tier class registered under ``kind`` (imported on first use)."""
    try:
        module, _, name = TIERS[str(kind)].partition(":")
    except KeyError:
        raise ValueError(f"unknown tier kind {kind!r}; known: {', '.join(sorted(TIERS))}") from None
    cls: type[Tier] = getattr(importlib.import_module(module), name)
    return cls


def make_tier(section: TierConfig, *, hmac_key: bytes | None = None) -> Tier:
    """Construct (not start) the tier for a config section: ``Cls(section, hmac_key=hmac_key)``."""
    cls: Any = tier_class(section.kind)  # tier constructors take (section, *, hmac_key), not Tier's own
    tier: Tier = cls(section, hmac_key=hmac_key)
    return tier
