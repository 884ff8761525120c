"""Redis tiers that a test starts on a real server and that are closed when it ends (the catalog's and the
Redis tier's tests share this): ``async with started_tiers(url, prefix) as make: tier = await make(ttl=30.0)``."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from kvtier.config import RedisTierConfig
from kvtier.tiers.redis.tier import RedisTier

Make = Callable[..., Awaitable[RedisTier]]


def fresh_prefix(letter: str = "t") -> str:
    """A key prefix no other test uses (tests share one server)."""
    return f"{letter}{uuid.uuid4().hex[:8]}"


@contextlib.asynccontextmanager
async def started_tiers(default_url: str, prefix: str | None = None) -> AsyncIterator[Make]:
    """``make(url=None, hmac_key=None, **section)`` builds and starts a RedisTier (name ``redis``, 1 GiB, a 5 s
    timeout, ``default_url`` and a fresh ``prefix`` unless given); every tier it made is closed at exit."""
    default_prefix = prefix or fresh_prefix()
    tiers: list[RedisTier] = []

    async def make(url: str | None = None, hmac_key: bytes | None = None, **kw: Any) -> RedisTier:
        kw.setdefault("key_prefix", default_prefix)
        kw.setdefault("timeout", 5.0)
        section = RedisTierConfig(name="redis", capacity=kw.pop("capacity", 1 << 30), url=url or default_url, **kw)
        tier = RedisTier(section, hmac_key=hmac_key)
        await tier.start()
        tiers.append(tier)
        return tier

    try:
        yield make
    finally:
        for tier in tiers:
            await tier.close()
