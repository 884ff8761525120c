"""The cpu tier: a slot pool in host memory, pinned (page-locked) when CUDA is present so that copies to and
from the GPU run at full PCIe speed. See ``kvtier.tiers.memory.pool`` for the lifecycle and the slot rules.
"""

from __future__ import annotations

import logging

import torch

from kvtier.config import CpuTierConfig, TierConfig
from kvtier.tiers.memory.pool import PoolTier

log = logging.getLogger(__name__)


def want_pinned(setting: bool | None) -> bool:
    """Pin when asked (None: when CUDA is available); never without CUDA, where pinning is impossible."""
    available = torch.cuda.is_available()
    if setting and not available:
        log.warning("pin_memory requested but CUDA is not available: using pageable host memory")
    return available if setting is None else bool(setting and available)


class CpuTier(PoolTier):
    """Host-memory pool of ``section.capacity`` bytes."""

    def __init__(self, section: TierConfig, *, hmac_key: bytes | None = None) -> None:
        slot = section.slot_bytes if isinstance(section, CpuTierConfig) else None
        pin = section.pin_memory if isinstance(section, CpuTierConfig) else None
        super().__init__(section.name, section.capacity, "cpu", slot, want_pinned(pin))
        self.section = section
