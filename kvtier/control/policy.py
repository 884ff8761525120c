"""Eviction policies: pure Python bookkeeping of which key of one tier to evict next.

Lifecycle per tier: ``policy = make_policy(name, capacity)``; then, as the directory sees them, ``insert(key,
parent)`` for a newly stored key (``parent`` = the previous chunk of the same prefix, or None), ``touch(key)``
on a hit, ``remove(key)`` when a key leaves for another reason, and ``evict(n, protected)`` to pick and
forget up to ``n`` victims, never one in ``protected`` (pinned or in flight). Policies know nothing of bytes:
the directory evicts until enough bytes are free. ``capacity`` is in entries and is a hint (ARC sizes its
ghost lists with it, ``adaptive`` its shadow caches); ``set_capacity`` updates it. The default is ``adaptive``.

The implementations live in ``kvtier.control.policies``; this module is the registry everything else imports.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.control.policies.adaptive import AdaptivePolicy
from kvtier.control.policies.arc import ARCPolicy
from kvtier.control.policies.base import EvictionPolicy
from kvtier.control.policies.hitdensity import PrefixHitDensityPolicy
from kvtier.control.policies.lru import LRUPolicy
from kvtier.control.policies.prefix_lru import PrefixLRUPolicy
from kvtier.control.policies.s3fifo import S3FIFOPolicy

__all__ = [
    "POLICIES",
    "ARCPolicy",
    "AdaptivePolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "PrefixHitDensityPolicy",
    "PrefixLRUPolicy",
    "S3FIFOPolicy",
    "make_policy",
]

# the names are the config's (kvtier.config.tree.EVICTION_POLICIES), which validates them without importing this
POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "prefix_lru": PrefixLRUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "prefix_hd": PrefixHitDensityPolicy,
    "adaptive": AdaptivePolicy,
}


def make_policy(name: str, capacity: int = 0) -> EvictionPolicy:
    """Build a policy by name; ``ValueError`` naming the valid ones otherwise."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; use one of {sorted(POLICIES)}") from None
    return factory(capacity)
