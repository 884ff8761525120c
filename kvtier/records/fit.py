"""Whether a config fits an engine's KV-cache layout: the one chunk-alignment and capacity rule.

Used by the scheduler half at start (kvtier disables itself, or raises in strict mode) and by ``kvtier check``.
Torch-free: it reads block sizes and bytes per chunk from the engine-neutral :class:`KVCacheConfig`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvtier.config import MEMORY_KINDS
from kvtier.config.parse import format_size
from kvtier.errors import ConfigError
from kvtier.layout import UNSERVED
from kvtier.records.codec import stored_size

if TYPE_CHECKING:
    from kvtier.config import KvtierConfig
    from kvtier.layout import KVCacheConfig


def check_fit(cfg: KvtierConfig, kv_cache_config: KVCacheConfig) -> None:
    """Check a config against an engine's KV-cache layout: chunk_size is a multiple of every group's block size
    (a recurrent group's states lie every block_size tokens), and each tier holds at least one chunk record of
    every group placed on it. Raises :class:`ConfigError` naming the key path and the fix."""
    groups = kv_cache_config.kv_cache_groups
    served = [max(1, g.kv_cache_spec.block_size) for g in groups if g.kind not in UNSERVED]
    for gid, group in enumerate(groups):
        block = group.kv_cache_spec.block_size
        if group.kind not in UNSERVED and (block <= 0 or cfg.chunk_size % block):
            lcm = math.lcm(*served)
            raise ConfigError("chunk_size", f"{cfg.chunk_size} is not a multiple of the block size {block} of "
                              f"KV-cache group {gid} ({group.kind.value})",
                              f"use a multiple of {lcm}, e.g. {lcm * max(1, round(cfg.chunk_size / lcm))}")
    for i, tier in enumerate(cfg.tiers):
        for gid, group in enumerate(groups):
            record = stored_size(group.bytes_per_chunk(cfg.chunk_size), signed=bool(cfg.security.hmac_key_env),
                                 memory=tier.kind in MEMORY_KINDS, slot_bytes=getattr(tier, "slot_bytes", None))
            if tier.name in cfg.tiers_for(group.kind) and record > tier.capacity:
                raise ConfigError(f"tiers[{i}].capacity", f"{format_size(tier.capacity)} cannot hold one chunk "
                                  f"of group {gid} ({format_size(record)})", "raise capacity or lower chunk_size")
