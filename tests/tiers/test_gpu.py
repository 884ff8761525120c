"""The gpu tier: the shared contract on the cpu device (the logic), and on CUDA where a GPU exists."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from contract import TierContract, assert_same, key, rand

from kvtier.config import GpuTierConfig
from kvtier.errors import TierUnavailable
from kvtier.tiers import make_tier
from kvtier.tiers.base import Tier
from kvtier.tiers.memory.gpu import GpuTier


class TestGpuTierOnCpuDevice(TierContract):
    async def build(self, env: Any, capacity: int, name: str) -> Tier:
        tier = make_tier(GpuTierConfig(name=name, capacity=capacity, device="cpu"))
        await tier.start()
        return tier


@pytest.mark.gpu
class TestGpuTierOnCuda(TierContract):
    async def build(self, env: Any, capacity: int, name: str) -> Tier:
        tier = make_tier(GpuTierConfig(name=name, capacity=capacity, device="cuda:0"))
        await tier.start()
        return tier


@pytest.mark.gpu
async def test_cuda_pool_lives_on_the_device_and_takes_host_tensors() -> None:
    tier = GpuTier(GpuTierConfig(name="g", capacity=8 << 20, device="cuda:0"))
    await tier.start()
    host = rand((1 << 20,), torch.bfloat16, seed=3)
    assert await tier.put([(key(0), host)]) == [True]
    [back] = await tier.get([key(0)])
    assert back is not None and back.device.type == "cuda"
    assert_same(back, host)
    out = torch.empty_like(host).pin_memory()
    assert await tier.get_into([(key(0), out)]) == [True]
    torch.cuda.synchronize()
    assert_same(out, host)
    await tier.close()


async def test_missing_cuda_device_is_unavailable() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tier = GpuTier(GpuTierConfig(name="g", capacity=1 << 20, device=f"cuda:{count}"))
    with pytest.raises(TierUnavailable, match=f"cuda:{count}"):
        await tier.start()


async def test_get_returns_tensors_on_the_pool_device() -> None:
    tier = GpuTier(GpuTierConfig(name="g", capacity=1 << 20, device="cpu"))
    await tier.start()
    await tier.put([(key(0), rand((64,)))])
    [got] = await tier.get([key(0)])
    assert got is not None and got.device == torch.device("cpu")
    assert tier.is_memory and not tier.is_shared
