"""The shared tier contract on a real standalone Redis and on a real 3-master Redis Cluster."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

import pytest
from contract import TierContract

from kvtier.bench.redis_servers import RedisClusterServers, RedisServer
from kvtier.config import RedisTierConfig
from kvtier.tiers import make_tier
from kvtier.tiers.base import Tier


class _RedisContract(TierContract):
    persistent: ClassVar[bool] = True
    enforces_capacity: ClassVar[bool] = False  # the server's maxmemory governs Redis memory

    async def build(self, env: Any, capacity: int, name: str) -> Tier:
        url, prefix = env
        # Generous timeout: CI machines are shared; the fault tests cover short timeouts.
        section = RedisTierConfig(name=name, capacity=capacity, url=url, key_prefix=f"{prefix}-{name}",
                                  timeout=5.0, connect_timeout=5.0)
        tier = make_tier(section)
        await tier.start()
        return tier


class TestRedisContract(_RedisContract):
    @pytest.fixture
    def env(self, redis_server: RedisServer) -> Any:
        return redis_server.url, f"c{uuid.uuid4().hex[:8]}"


class TestRedisClusterContract(_RedisContract):
    @pytest.fixture
    def env(self, redis_cluster: RedisClusterServers) -> Any:
        return redis_cluster.url, f"c{uuid.uuid4().hex[:8]}"
