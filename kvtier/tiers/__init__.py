"""Storage tiers and their lazy registry: importing this package imports no tier module.

``make_tier(section)`` builds the tier a config section names; ``await tier.start()`` opens it (see
``kvtier.tiers.base`` for the lifecycle and the contract every tier follows). A tier kind whose client library
is an optional extra (Redis: ``pip install 'kvtier[redis]'``) fails with a :class:`ConfigError` naming the
tier and the fix when that library is missing (:func:`require_extra`), never with an ``ImportError``.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from kvtier.config import KvtierConfig, TierConfig
from kvtier.errors import ConfigError
from kvtier.tiers.base import Tier, TierEntry

TIERS: dict[str, str] = {
    "gpu": "kvtier.tiers.memory.gpu:GpuTier",
    "cpu": "kvtier.tiers.memory.cpu:CpuTier",
    "disk": "kvtier.tiers.disk.tier:DiskTier",
    "redis": "kvtier.tiers.redis.tier:RedisTier",
}
EXTRAS: dict[str, tuple[str, str]] = {"redis": ("redis", "redis")}  # kind -> (module it needs, extra with it)

__all__ = ["EXTRAS", "TIERS", "Tier", "TierEntry", "check_extras", "make_tier", "require_extra", "tier_class"]


def require_extra(kind: str, path: str) -> None:
    """Raise ``ConfigError`` at ``path`` (e.g. ``tiers[1]``) when the library tier ``kind`` needs is missing."""
    if str(kind) not in EXTRAS:
        return
    module, extra = EXTRAS[str(kind)]
    try:
        importlib.import_module(module)
    except ImportError:
        raise ConfigError(path, f"kind {kind} needs the {extra} extra: pip install 'kvtier[{extra}]'") from None


def check_extras(cfg: KvtierConfig) -> None:
    """:func:`require_extra` for every tier of ``cfg``, named by its key path ``tiers[i]``."""
    for i, section in enumerate(cfg.tiers):
        require_extra(section.kind, f"tiers[{i}]")


def tier_class(kind: str, path: str | None = None) -> type[Tier]:
    """The tier class registered under ``kind`` (imported on first use); ``path`` names the config section in
    the error when the kind's extra is not installed."""
    try:
        module, _, name = TIERS[str(kind)].partition(":")
    except KeyError:
        raise ValueError(f"unknown tier kind {kind!r}; known: {', '.join(sorted(TIERS))}") from None
    require_extra(kind, path or f"tier kind {kind}")
    cls: type[Tier] = getattr(importlib.import_module(module), name)
    return cls


def make_tier(section: TierConfig, *, hmac_key: bytes | None = None, path: str | None = None) -> Tier:
    """Construct (not start) the tier for a config section: ``Cls(section, hmac_key=hmac_key)``. ``path`` is the
    section's key path (``tiers[1]``) for errors; without it they name the tier. A tier whose constructor takes
    ``key_path`` (disk: its errors name ``tiers[1].path``) gets ``path`` as it."""
    # tier constructors take (section, *, hmac_key[, key_path]), not Tier's own
    cls: Any = tier_class(section.kind, path or f"tier {section.name!r}")
    if path is not None and "key_path" in inspect.signature(cls).parameters:
        tier: Tier = cls(section, hmac_key=hmac_key, key_path=path)
    else:
        tier = cls(section, hmac_key=hmac_key)
    return tier
