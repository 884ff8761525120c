"""The gpu tier: a slot pool in one tensor on a torch device (``cuda:N`` in production, ``cpu`` in tests).
See ``kvtier.tiers.memory.pool`` for the lifecycle and the slot rules. ``get`` returns tensors on that device.
"""

from __future__ import annotations

import torch

from kvtier.config import GpuTierConfig, TierConfig
from kvtier.errors import TierUnavailable
from kvtier.tiers.memory.pool import PoolTier


class GpuTier(PoolTier):
    """Device-memory pool of ``section.capacity`` bytes."""

    def __init__(self, section: TierConfig, *, hmac_key: bytes | None = None) -> None:
        device = section.device if isinstance(section, GpuTierConfig) else "cuda:0"
        slot = section.slot_bytes if isinstance(section, GpuTierConfig) else None
        super().__init__(section.name, section.capacity, device, slot)
        self.section = section

    async def start(self) -> None:
        """Allocate the pool; ``TierUnavailable`` when the device does not exist here."""
        dev = self.pool.device
        if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
            raise TierUnavailable(f"tier {self.name!r}: device {dev} is not available on this host")
        try:
            await super().start()
        except torch.OutOfMemoryError as exc:
            raise TierUnavailable(f"tier {self.name!r}: cannot allocate {self.capacity_bytes} bytes on {dev}: "
                                  f"{exc}") from exc
