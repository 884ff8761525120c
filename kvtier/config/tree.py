"""The typed config tree: frozen section dataclasses (the tiers, one class per kind; namespace, policy,
security) under :class:`KvtierConfig`, and its export to a plain dict. Built and validated by
:func:`kvtier.config.load_config`; every other module receives these section objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from enum import StrEnum
from typing import Any

from kvtier.config.layers import plain_fields
from kvtier.layout import GroupKind

# The names the config accepts where code of a higher layer implements them (kvtier.control.policy.POLICIES,
# kvtier.records.fingerprint); tests/control/test_policy.py checks that they serve exactly these.
EVICTION_POLICIES = ("lru", "prefix_lru", "arc", "s3fifo", "prefix_hd", "adaptive")
WEIGHT_MODES = ("auto", "stat", "content", "off")
ADMISSIONS = ("all", "learned")
SAVE_TIMES = ("compute", "evict")


class TierKind(StrEnum):
    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"
    REDIS = "redis"


MEMORY_KINDS = frozenset({TierKind.CPU, TierKind.GPU})  # tiers that hold raw payloads in slots, gone at exit


class WritePolicy(StrEnum):
    WRITE_THROUGH = "write_through"
    WRITE_BACK = "write_back"


@dataclass(frozen=True)
class TierConfig:
    """Fields every tier has. ``capacity`` is in bytes."""

    name: str
    capacity: int
    compression: str | None = None  # None, "lz4" or "zstd" (disk and redis only)
    eviction: str | None = None  # overrides policy.eviction for this tier

    @property
    def kind(self) -> TierKind:
        raise NotImplementedError


@dataclass(frozen=True)
class GpuTierConfig(TierConfig):
    device: str = "cuda:0"
    slot_bytes: int | None = None  # None: sized by the first record stored

    @property
    def kind(self) -> TierKind:
        return TierKind.GPU


@dataclass(frozen=True)
class CpuTierConfig(TierConfig):
    pin_memory: bool | None = None  # None: pinned when CUDA is available
    slot_bytes: int | None = None

    @property
    def kind(self) -> TierKind:
        return TierKind.CPU


@dataclass(frozen=True)
class DiskTierConfig(TierConfig):
    path: str = ""
    fsync: bool = False
    shard_depth: int = 2

    @property
    def kind(self) -> TierKind:
        return TierKind.DISK


@dataclass(frozen=True)
class RedisTierConfig(TierConfig):
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    ttl: float | None = None  # seconds
    timeout: float = 0.05  # seconds per operation
    connect_timeout: float = 1.0
    pool_size: int = 16
    connections: int = 4  # parallel connections for large-value transfers
    key_prefix: str = "kvtier"
    username: str | None = None
    password_env: str = "KVTIER_REDIS_PASSWORD"
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    breaker_failures: int = 3
    breaker_backoff: float = 1.0  # seconds
    # no other engine reads this Redis: the save admission (policy.admission) judges it like a local tier
    private: bool = False

    @property
    def kind(self) -> TierKind:
        return TierKind.REDIS


@dataclass(frozen=True)
class NamespaceConfig:
    model: str = "default"
    revision: str = "main"
    tenant: str = ""  # salt that isolates tenants sharing tiers
    weights: str = "auto"  # how the weights join the namespace: one of WEIGHT_MODES


@dataclass(frozen=True)
class PolicyConfig:
    eviction: str = "adaptive"
    write: WritePolicy = WritePolicy.WRITE_BACK
    promote_on_hit: bool = True
    # a chunk is saved once this many requests have asked for it (1: every computed chunk; 2: only prefixes seen
    # before, so one-off prompts cost no save)
    store_threshold: int = 1
    # which requests save their chunks: "learned": only classes of requests whose chunks are asked for again,
    # beyond the engine's own prefix cache, at least admission_min_reuse times per chunk offered
    # (kvtier.connector.scheduler.admission); "all": every computed chunk
    admission: str = "learned"
    # when the admitted chunks are saved: "compute": as the engine computes them; "evict": when the engine is about
    # to write over one of their blocks, or first shares one (kvtier.connector.scheduler.lazy)
    save_at: str = "compute"
    admission_min_reuse: float = 0.1
    # saves queued on a worker and not yet written (bytes): a step's saves past it are skipped (counted), so a
    # medium slower than the engine never builds an unbounded queue of held blocks and copies
    save_backlog: int = 256 << 20
    # write-back chunks only a memory tier holds are copied to the disk tier below it once the engine has computed
    # nothing for this long (seconds; 0: never while it runs), so that a crash loses only recent ones
    persist_after_idle: float = 1.0
    # while the engine is busy, such a chunk reaches disk within about this long of its save (seconds; 0: only
    # while idle and at close): the copies run paced, hot ones first, so a crash or kill loses only the last ones
    persist_max_lag: float = 2.0
    # at a graceful stop (connector shutdown, TieredStore.close), the most time spent copying what is still only
    # in memory to disk (seconds; 0: none)
    persist_at_close: float = 4.0


@dataclass(frozen=True)
class SecurityConfig:
    hmac_key_env: str | None = None  # env var holding the HMAC-SHA256 key; None: records are not signed


@dataclass(frozen=True)
class KvtierConfig:
    chunk_size: int = 256
    namespace: NamespaceConfig = field(default_factory=NamespaceConfig)
    tiers: tuple[TierConfig, ...] = ()
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    placement: Mapping[GroupKind, tuple[str, ...]] = field(default_factory=dict)
    save_partial_chunks: bool = False
    strict: bool = False  # KV tensors kvtier cannot read fail the engine's start (else kvtier disables itself)
    # the engine's prefix cache is off by the operator's choice, not the engine's: kvtier may serve it anyway
    serve_without_prefix_caching: bool = False
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def tier(self, name: str) -> TierConfig:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (YAML-ready) that ``load_config`` reads back to an equal config."""
        return config_to_dict(self)

    def tiers_for(self, kind: GroupKind) -> tuple[str, ...]:
        """Tier names holding a group kind, fastest first; every tier when placement does not name the kind."""
        if kind in self.placement:
            return self.placement[kind]
        if self.placement:
            return ()
        return tuple(t.name for t in self.tiers)


SIZE_FIELDS = frozenset({"capacity", "slot_bytes", "save_backlog"})
DURATION_FIELDS = frozenset({"ttl", "timeout", "connect_timeout", "breaker_backoff", "persist_after_idle",
                             "persist_max_lag", "persist_at_close"})


def _with_units(section: dict[str, Any]) -> dict[str, Any]:
    """``section`` with its sizes in bytes (``4096B``) and durations in seconds (``0.25s``), exact: a bare number
    is refused on reading."""
    def text(name: str, value: Any) -> Any:
        if name in SIZE_FIELDS:
            return f"{value}B"
        if name in DURATION_FIELDS:
            return f"{Decimal(repr(float(value))):f}s"
        return value

    return {k: text(k, v) for k, v in section.items()}


def config_to_dict(cfg: KvtierConfig) -> dict[str, Any]:
    """Plain dict of a config (sizes in bytes, durations in seconds, each with its unit) that ``load_config``
    reads back."""
    tiers = []
    for tier in cfg.tiers:
        body = _with_units(plain_fields(tier))
        tiers.append({"name": body.pop("name"), "kind": tier.kind.value, **body})
    return {
        "chunk_size": cfg.chunk_size,
        "namespace": plain_fields(cfg.namespace),
        "tiers": tiers,
        "policy": _with_units(plain_fields(cfg.policy)),
        "placement": {kind.value: list(names) for kind, names in cfg.placement.items()},
        "save_partial_chunks": cfg.save_partial_chunks,
        "strict": cfg.strict,
        "security": plain_fields(cfg.security),
    }
