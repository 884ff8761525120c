"""Typed configuration tree. The only module that reads YAML, ``KVTIER_*`` environment variables or an
engine's extra-config dict; everything else receives the frozen section objects below.

``load_config`` merges three layers, later ones winning, then validates the result once:

1. the file (``source``; when ``source`` is None: ``overrides["config_file"]``, else ``$KVTIER_CONFIG``, else
   the embedded :data:`DEFAULT_CONFIG`: a 2 GiB cpu tier and an 8 GiB disk tier in the user cache dir),
   or a mapping given as ``source``;
2. ``KVTIER_<PATH>`` environment variables, ``__`` between nested keys, tiers addressed by name, values parsed
   as YAML scalars: ``KVTIER_CHUNK_SIZE=128``, ``KVTIER_POLICY__EVICTION=lru``,
   ``KVTIER_TIERS__CPU__CAPACITY=4GiB``. Variables whose first part is not a section (``KVTIER_CONFIG``,
   ``KVTIER_CACHE_DIR``, ``KVTIER_REDIS_PASSWORD``, HMAC keys, ...) are not config paths and are left alone;
3. ``overrides``: an engine's extra-config dict shaped like the YAML, deep-merged, tiers merged by name. The
   engine-only keys in :data:`ENGINE_ONLY_KEYS` are ignored here.

Every invalid value raises :class:`ConfigError` naming its key path (``tiers[1].capacity``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.config_parse import (
    apply_env,
    as_bool,
    as_float,
    as_int,
    as_list,
    as_mapping,
    as_str,
    check_keys,
    check_redis_url,
    choice,
    default_cache_dir,
    env_layer,
    expand_path,
    format_size,
    join,
    merge,
    parse_duration,
    parse_size,
    plain,
    plain_fields,
    read_yaml,
    suggest,
    unwrap,
)
from kvtier.errors import ConfigError
from kvtier.layout import UNSERVED, GroupKind

if TYPE_CHECKING:
    from kvtier.layout import KVCacheConfig


class TierKind(StrEnum):
    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"
    REDIS = "redis"


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

    @property
    def kind(self) -> TierKind:
        return TierKind.REDIS


@dataclass(frozen=True)
class NamespaceConfig:
    model: str = "default"
    revision: str = "main"
    tenant: str = ""  # salt that isolates tenants sharing tiers
    weights: str = "auto"  # how the weights join the namespace (kvtier.fingerprint.WEIGHT_MODES)


@dataclass(frozen=True)
class PolicyConfig:
    eviction: str = "prefix_lru"
    write: WritePolicy = WritePolicy.WRITE_BACK
    promote_on_hit: bool = True
    # a chunk is saved once this many requests have asked for it (1: every computed chunk; 2: only prefixes seen
    # before, so one-off prompts cost no save)
    store_threshold: int = 1
    # saves queued on a worker and not yet written (bytes): a step's saves past it are skipped (counted), so a
    # medium slower than the engine never builds an unbounded queue of held blocks and copies
    save_backlog: int = 256 << 20


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



# ---- loading ----------------------------------------------------------------------------------------------

SECTIONS = ("chunk_size", "namespace", "tiers", "policy", "placement", "save_partial_chunks", "security", "strict",
            "serve_without_prefix_caching")
ENGINE_ONLY_KEYS = frozenset({"config_file", "connectors", "load_failure_policy"})
"""Keys of an engine's extra-config dict that are not kvtier config: ``config_file`` (the file to load when no
source is given) and ``connectors`` (a MultiConnector's children)."""
ENV_RESERVED = ("KVTIER_CONFIG", "KVTIER_CACHE_DIR", "KVTIER_REDIS_PASSWORD")

DEFAULT_CONFIG: dict[str, Any] = {
    "tiers": [{"name": "cpu", "kind": "cpu", "capacity": "2GiB"},
              {"name": "disk", "kind": "disk", "capacity": "8GiB"}],
}
"""The embedded default (same as configs/default.yaml): used when no file is named anywhere."""

TIER_CLASSES: dict[TierKind, type[TierConfig]] = {
    TierKind.GPU: GpuTierConfig, TierKind.CPU: CpuTierConfig,
    TierKind.DISK: DiskTierConfig, TierKind.REDIS: RedisTierConfig,
}
MEMORY_KINDS = frozenset({TierKind.GPU, TierKind.CPU})
COMPRESSIONS = ("none", "lz4", "zstd")
SIZE_FIELDS = frozenset({"capacity", "slot_bytes", "save_backlog"})
DURATION_FIELDS = frozenset({"ttl", "timeout", "connect_timeout", "breaker_backoff"})
ZERO_OK = frozenset({"breaker_backoff", "shard_depth"})
PATH_FIELDS = frozenset({"path", "tls_ca", "tls_cert", "tls_key"})
REDIS_MS_ALIASES = {"timeout_ms": "timeout", "connect_timeout_ms": "connect_timeout"}


def load_config(source: str | Path | Mapping[str, Any] | None = None, *,
                env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> KvtierConfig:
    """Load, merge and validate a config: file (or dict), then ``KVTIER_*`` env, then engine overrides.

    ``env=None`` reads ``os.environ``. Raises ``ConfigError`` naming the offending key path.
    """
    env = os.environ if env is None else env
    try:
        over = as_mapping(plain(overrides), "overrides") if overrides is not None else {}
        data = _base_layer(source, env, over)
        for var, parts, value in env_layer(env, SECTIONS, ENV_RESERVED):
            data = apply_env(data, var, parts, value)
        data = merge(data, {k: v for k, v in over.items() if k not in ENGINE_ONLY_KEYS})
        return build_config(data, env)
    except RecursionError:
        raise ConfigError("", "config nested too deeply") from None


def _base_layer(source: Any, env: Mapping[str, str], over: Mapping[str, Any]) -> dict[str, Any]:
    if source is None:
        if over.get("config_file"):
            source = expand_path(over["config_file"], "config_file", env)
        elif env.get("KVTIER_CONFIG"):
            source = expand_path(env["KVTIER_CONFIG"], "KVTIER_CONFIG", env)
        else:
            base = plain(DEFAULT_CONFIG)
            if "tiers" in over:  # the engine brings its own tiers: do not add the default ones
                del base["tiers"]
            return base
    if isinstance(source, Mapping):
        return as_mapping(plain(source), "")
    if isinstance(source, str | os.PathLike):
        return read_yaml(source)
    raise ConfigError("", f"config source must be a file path or a mapping, got {type(source).__name__}")


def build_config(data: Mapping[str, Any], env: Mapping[str, str]) -> KvtierConfig:
    """Validate a merged config dict into the typed tree."""
    data = as_mapping(data, "")
    check_keys(data, SECTIONS, "")
    tiers = _build_tiers(data.get("tiers"), env)
    chunk_size = as_int(data.get("chunk_size", 256), "chunk_size", minimum=1)
    return KvtierConfig(
        chunk_size=chunk_size,
        namespace=_section(NamespaceConfig, data.get("namespace"), "namespace", env),
        tiers=tiers,
        policy=_section(PolicyConfig, data.get("policy"), "policy", env),
        placement=_build_placement(data.get("placement"), tiers),
        save_partial_chunks=as_bool(data.get("save_partial_chunks", False), "save_partial_chunks"),
        strict=as_bool(data.get("strict", False), "strict"),
        serve_without_prefix_caching=as_bool(data.get("serve_without_prefix_caching", False),
                                             "serve_without_prefix_caching"),
        security=_section(SecurityConfig, data.get("security"), "security", env),
    )


def _section(cls: type[Any], value: Any, path: str, env: Mapping[str, str]) -> Any:
    """A flat section dataclass from a mapping (null or missing: all defaults)."""
    raw = {} if unwrap(value) is None else as_mapping(value, path)
    annotations = {f.name: str(f.type) for f in fields(cls)}
    check_keys(raw, annotations, path)
    return cls(**{k: _field_value(k, annotations[k], v, join(path, k), env) for k, v in raw.items()})


def _field_value(name: str, annotation: str, value: Any, path: str, env: Mapping[str, str]) -> Any:
    """Parse one field by its name (sizes, durations, paths, policies) or else by its annotation."""
    if "None" in annotation and unwrap(value) is None:
        return None
    if name in SIZE_FIELDS:
        size = parse_size(value, path)
        if size <= 0:
            raise ConfigError(path, f"must be positive, got {size}", "e.g. 2GiB")
        return size
    if name in DURATION_FIELDS:
        seconds = parse_duration(value, path)
        if seconds <= 0 and name not in ZERO_OK:
            raise ConfigError(path, "must be positive", "use null for none" if "None" in annotation else None)
        return seconds
    if name in PATH_FIELDS:
        return expand_path(value, path, env)
    if name == "eviction":
        from kvtier.policy import POLICIES  # at validation time: policies register themselves there

        return choice(value, path, POLICIES, "eviction policy")
    if name == "weights":
        from kvtier.fingerprint import WEIGHT_MODES

        return choice(value, path, WEIGHT_MODES, "weights fingerprint mode")
    if name == "compression":
        text = choice(value, path, COMPRESSIONS, "compression")
        return None if text == "none" else text
    base = annotation.split("|")[0].strip()
    if base == "bool":
        return as_bool(value, path)
    if base == "int":
        return as_int(value, path, minimum=0 if name in ZERO_OK else 1)
    if base == "float":
        return as_float(value, path)
    if base == "WritePolicy":
        return WritePolicy(choice(value, path, [w.value for w in WritePolicy], "write policy"))
    text = as_str(value, path)
    if name in ("name", "device", "model", "key_prefix") and not text:
        raise ConfigError(path, "must not be empty")
    if name == "name" and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", text):
        raise ConfigError(path, f"bad tier name {text!r}", "use letters, digits, '_', '-' and '.'")
    return text


def _build_tiers(value: Any, env: Mapping[str, str]) -> tuple[TierConfig, ...]:
    hint = "add e.g. 'tiers: [{name: cpu, kind: cpu, capacity: 4GiB}]'"
    if unwrap(value) is None:
        raise ConfigError("tiers", "no tiers configured", hint)
    items = as_list(value, "tiers")
    if not items:
        raise ConfigError("tiers", "no tiers configured", hint)
    tiers: list[TierConfig] = []
    for i, item in enumerate(items):
        tier = _build_tier(item, f"tiers[{i}]", env)
        if any(t.name == tier.name for t in tiers):
            raise ConfigError(f"tiers[{i}].name", f"duplicate tier name {tier.name!r}", "give each tier its own name")
        if isinstance(tier, DiskTierConfig):
            for t in tiers:
                if isinstance(t, DiskTierConfig) and os.path.abspath(t.path) == os.path.abspath(tier.path):
                    raise ConfigError(f"tiers[{i}].path", f"disk tiers {t.name!r} and {tier.name!r} share "
                                      f"the directory {tier.path!r}", "give each disk tier its own path")
        tiers.append(tier)
    return tuple(tiers)


def _build_tier(value: Any, path: str, env: Mapping[str, str]) -> TierConfig:
    raw = as_mapping(value, path)
    if "kind" not in raw:
        raise ConfigError(join(path, "kind"), "missing", f"one of {', '.join(k.value for k in TierKind)}")
    kind = TierKind(choice(raw.pop("kind"), join(path, "kind"), [k.value for k in TierKind], "tier kind"))
    cls = TIER_CLASSES[kind]
    if kind is TierKind.REDIS:
        raw = _redis_aliases(raw, path)
    annotations = {f.name: str(f.type) for f in fields(cls)}
    check_keys(raw, [*annotations, "kind"], path)
    for required in ("name", "capacity"):
        if required not in raw:
            raise ConfigError(join(path, required), "missing", "every tier needs a name and a capacity")
    kwargs = {k: _field_value(k, annotations[k], v, join(path, k), env) for k, v in raw.items()}
    if kwargs.get("compression") and kind in MEMORY_KINDS:
        raise ConfigError(join(path, "compression"), f"a {kind.value} tier stores records uncompressed",
                          "compression applies to disk and redis tiers; remove it")
    if kind is TierKind.DISK and "path" not in kwargs:
        kwargs["path"] = str(Path(default_cache_dir(env)) / kwargs["name"])
    if kind is TierKind.REDIS:
        is_cluster = check_redis_url(kwargs.get("url", RedisTierConfig.url), join(path, "url"))
        if is_cluster and kwargs.get("cluster") is False:
            raise ConfigError(join(path, "cluster"), "false, but the URL is redis+cluster://", "remove 'cluster'")
        kwargs["cluster"] = kwargs.get("cluster", False) or is_cluster
    return cls(**kwargs)


def _redis_aliases(raw: dict[str, Any], path: str) -> dict[str, Any]:
    """``password`` is refused (secrets stay out of files); ``timeout_ms: 50`` means ``timeout: 50ms``."""
    if "password" in raw:
        raise ConfigError(join(path, "password"), "passwords do not belong in the config file",
                          "put it in the URL (redis://:PASSWORD@host:6379/0) or in $KVTIER_REDIS_PASSWORD")
    for alias, target in REDIS_MS_ALIASES.items():
        if alias in raw:
            if target in raw:
                raise ConfigError(join(path, alias), f"conflicts with {target!r}", "give only one of them")
            millis = as_float(raw.pop(alias), join(path, alias))
            if millis <= 0:
                raise ConfigError(join(path, alias), "must be a positive number of milliseconds")
            raw[target] = millis / 1000
    return raw


def _build_placement(value: Any, tiers: tuple[TierConfig, ...]) -> dict[GroupKind, tuple[str, ...]]:
    if unwrap(value) is None:
        return {}
    raw = as_mapping(value, "placement")
    names = [t.name for t in tiers]
    kinds = [k.value for k in GroupKind]
    out: dict[GroupKind, tuple[str, ...]] = {}
    for key, item in raw.items():
        path = join("placement", key)
        if key not in kinds:
            raise ConfigError(path, f"unknown KV-cache group kind {key!r}", suggest(key, kinds))
        listed = [item] if isinstance(unwrap(item, want_text=True), str) else as_list(item, path)
        chosen: list[str] = []
        for j, entry in enumerate(listed):
            name = as_str(entry, f"{path}[{j}]")
            if name not in names:
                raise ConfigError(f"{path}[{j}]", f"no tier named {name!r}", suggest(str(name), names))
            if name in chosen:
                raise ConfigError(f"{path}[{j}]", f"tier {name!r} listed twice")
            chosen.append(name)
        if chosen != sorted(chosen, key=names.index):
            raise ConfigError(path, f"tiers listed as {chosen}, not in the order of 'tiers'",
                              f"list them fastest first, as in tiers: {sorted(chosen, key=names.index)}")
        out[GroupKind(key)] = tuple(chosen)
    return out


# ---- checks against an engine's layout, export ------------------------------------------------------------

def validate_for_layout(cfg: KvtierConfig, kv_cache_config: KVCacheConfig) -> None:
    """Check a config against an engine's KV-cache layout: chunk_size is a multiple of every attention group's
    block size (Mamba groups store one state per chunk and are exempt), and each tier holds at least one chunk
    record of every group placed on it."""
    from kvtier.codec import HEADER_SIZE

    groups = kv_cache_config.kv_cache_groups
    attention = [g.kv_cache_spec.block_size for g in groups if g.kind not in UNSERVED]
    for gid, group in enumerate(groups):
        block = group.kv_cache_spec.block_size
        if group.kind not in UNSERVED and cfg.chunk_size % block:
            lcm = math.lcm(*attention)
            raise ConfigError("chunk_size", f"{cfg.chunk_size} is not a multiple of the block size {block} of "
                              f"KV-cache group {gid} ({group.kind.value})",
                              f"use a multiple of {lcm}, e.g. {lcm * max(1, round(cfg.chunk_size / lcm))}")
    for i, tier in enumerate(cfg.tiers):
        for gid, group in enumerate(groups):
            record = group.bytes_per_chunk(cfg.chunk_size) + HEADER_SIZE
            if tier.name in cfg.tiers_for(group.kind) and record > tier.capacity:
                raise ConfigError(f"tiers[{i}].capacity", f"{format_size(tier.capacity)} cannot hold one chunk "
                                  f"of group {gid} ({format_size(record)})", "raise capacity or lower chunk_size")


def config_to_dict(cfg: KvtierConfig) -> dict[str, Any]:
    """Plain dict of a config (sizes in bytes, durations in seconds) that ``load_config`` reads back."""
    tiers = []
    for tier in cfg.tiers:
        body = plain_fields(tier)
        tiers.append({"name": body.pop("name"), "kind": tier.kind.value, **body})
    return {
        "chunk_size": cfg.chunk_size,
        "namespace": plain_fields(cfg.namespace),
        "tiers": tiers,
        "policy": plain_fields(cfg.policy),
        "placement": {kind.value: list(names) for kind, names in cfg.placement.items()},
        "save_partial_chunks": cfg.save_partial_chunks,
        "strict": cfg.strict,
        "security": plain_fields(cfg.security),
    }
