"""One assembly of a config's tiers, for a role and a rank. ``TieredStore``, the connector's scheduler half and its
worker half (and through them the reference engine and the benchmarks) all open their tiers here.

    cfg = applied(cfg, kcc, rank, tp_size)         # fixed pool slots, rank-local disk paths
    tiers = build_tiers(cfg, hmac_key)              # constructed, not started
    directory = directory_for(cfg, tiers)           # control plane only
    started = await start_tiers(tiers, role, directory)

Roles:

* ``STORE``: one process holds both planes (``TieredStore`` used directly, the reference engine): every tier
  starts (a failure is raised), persistent local tiers are adopted into the directory.
* ``SCHEDULER``: the control plane of a multi-process engine: memory tiers are never started (only their sizes
  count, no pool is allocated), an unreachable tier is a miss source (logged, not started), persistent local
  tiers are adopted into its directory.
* ``WORKER``: the data plane of a multi-process engine: every tier starts; there is no directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import os
from collections.abc import Sequence

from kvtier.config import CpuTierConfig, DiskTierConfig, GpuTierConfig, KvtierConfig
from kvtier.control.directory import Directory, TierSlot
from kvtier.control.policy import make_policy
from kvtier.errors import ConfigError
from kvtier.layout import UNSERVED, KVCacheConfig
from kvtier.tiers import Tier, make_tier
from kvtier.tiers.runtime import TIER_CLOSE_S

logger = logging.getLogger(__name__)


class Role(enum.Enum):
    STORE = "store"
    SCHEDULER = "scheduler"
    WORKER = "worker"


def applied(cfg: KvtierConfig, kcc: KVCacheConfig | None = None, rank: int = 0, tp_size: int = 1) -> KvtierConfig:
    """``cfg`` as one process of one rank opens it: ``with_pool_slots`` then ``rank_local``."""
    return rank_local(with_pool_slots(cfg, kcc), rank, tp_size)


def rank_local(cfg: KvtierConfig, tp_rank: int, tp_size: int) -> KvtierConfig:
    """``cfg`` for one tensor-parallel rank: with more than one rank, each disk tier gets its own subdirectory
    ``tp<rank>-of-<size>`` of the configured path. Every rank stores its own shard of each chunk under its own
    keys; in one directory, each rank's tier would adopt the others' files at start (its quota counting them,
    its evictions deleting them). The capacity stays per rank, as for the memory tiers."""
    if tp_size <= 1:
        return cfg
    tiers = tuple(dataclasses.replace(t, path=os.path.join(t.path, f"tp{tp_rank}-of-{tp_size}"))
                  if isinstance(t, DiskTierConfig) else t for t in cfg.tiers)
    return dataclasses.replace(cfg, tiers=tiers)


def with_pool_slots(cfg: KvtierConfig, kcc: KVCacheConfig | None) -> KvtierConfig:
    """Fix the slot size of memory pools that leave it open when groups store records of different sizes.

    A pool otherwise sizes its slots by the first record it receives, which only the worker sees; with a fixed
    slot the scheduler's directory counts exactly the bytes the worker's pool will use.
    """
    if kcc is None:
        return cfg
    sizes = {g.bytes_per_chunk(cfg.chunk_size) for g in kcc.kv_cache_groups if g.kind not in UNSERVED}
    if len(sizes) <= 1:
        return cfg
    slot = min(sizes)
    tiers = tuple(dataclasses.replace(t, slot_bytes=slot)
                  if isinstance(t, (CpuTierConfig, GpuTierConfig)) and t.slot_bytes is None else t
                  for t in cfg.tiers)
    return dataclasses.replace(cfg, tiers=tiers)


def build_tiers(cfg: KvtierConfig, hmac_key: bytes | None = None) -> list[Tier]:
    """The config's tiers, in order, constructed (not started)."""
    return [make_tier(section, hmac_key=hmac_key, path=f"tiers[{i}]") for i, section in enumerate(cfg.tiers)]


def directory_for(cfg: KvtierConfig, tiers: Sequence[Tier]) -> Directory:
    """A directory with one policy per tier (the tier's own eviction setting, else the global one)."""
    slots = []
    for section, tier in zip(cfg.tiers, tiers, strict=True):
        policy = make_policy(section.eviction or cfg.policy.eviction)
        slots.append(TierSlot(tier.name, tier.capacity_bytes, policy, tier.is_shared))
    return Directory(slots)


async def start_tiers(tiers: Sequence[Tier], role: Role, directory: Directory | None = None) -> list[Tier]:
    """Start ``tiers`` as ``role`` does (see the module doc); return the ones started (the caller closes them).
    On a failure that is raised, the tiers already started are closed first."""
    started: list[Tier] = []
    try:
        for tier in tiers:
            if role is Role.SCHEDULER and tier.is_memory:
                continue
            if not await _start(tier, tolerate=role is Role.SCHEDULER):
                continue
            started.append(tier)
            if directory is not None and not tier.is_shared:
                await tier.list_entries()
                adopted = directory.adopt(tier.name, ((e.key, e.size) for e in tier.entries()))
                if adopted:
                    logger.info("tier %s: adopted %d existing records", tier.name, adopted)
    except BaseException:
        await close_tiers(started)
        raise
    return started


async def _start(tier: Tier, tolerate: bool) -> bool:
    """Start ``tier``; with ``tolerate`` (the scheduler) a tier that fails to start is logged and skipped, but a
    ``ConfigError`` is raised in every role: a bad config is the user's to fix, in one line naming the key."""
    try:
        await tier.start()
    except ConfigError:
        raise
    except Exception as exc:
        if not tolerate:
            raise
        logger.warning("tier %s unavailable to the scheduler: %r", tier.name, exc)  # a miss source
        return False
    return True


async def close_tiers(tiers: Sequence[Tier], timeout_s: float = TIER_CLOSE_S) -> None:
    """Close every tier, all at once, for at most ``timeout_s`` in all (a close still running then is given up and
    logged: a stop is bounded whatever a medium does); log each failure and re-raise the last one once all ended."""
    tiers = list(tiers)
    if not tiers:
        return
    closes = [asyncio.ensure_future(tier.close()) for tier in tiers]
    _, late = await asyncio.wait(closes, timeout=timeout_s)
    errors: list[BaseException] = []
    for tier, close in zip(tiers, closes, strict=True):
        if close in late:
            close.cancel()
            logger.warning("closing tier %s took over %.1fs: given up", tier.name, timeout_s)
        elif not close.cancelled() and (exc := close.exception()) is not None:
            logger.error("closing tier %s failed", tier.name, exc_info=exc)
            errors.append(exc)
    if errors:
        raise errors[-1]
