"""Loading the typed configuration tree (:mod:`kvtier.config.tree`, whose names are importable from here too).
The only entry that reads YAML, ``KVTIER_*`` environment variables or an engine's extra-config dict; everything
else receives the frozen section objects.

``load_config`` merges three layers, later ones winning, then validates the result once:

1. the file (``source``; when ``source`` is None: ``overrides["config_file"]``, else ``$KVTIER_CONFIG``, else
   the embedded :data:`DEFAULT_CONFIG`: a 2 GiB cpu tier and an 8 GiB disk tier in the user cache dir),
   or a mapping given as ``source``;
2. ``KVTIER_<PATH>`` environment variables, ``__`` between nested keys, tiers addressed by name, values parsed
   as YAML scalars: ``KVTIER_CHUNK_SIZE=128``, ``KVTIER_POLICY__EVICTION=lru``,
   ``KVTIER_TIERS__CPU__CAPACITY=4GiB``. The project's own other variables (``KVTIER_CONFIG``,
   ``KVTIER_CACHE_DIR``, ``KVTIER_REDIS_PASSWORD``, ...: ``config_layers.NON_CONFIG_VARS``) and the HMAC key
   variable are left alone; any other ``KVTIER_*`` variable is ignored with a warning (and a did-you-mean);
3. ``overrides``: an engine's extra-config dict shaped like the YAML, deep-merged, tiers merged by name. The
   engine-only keys in :data:`ENGINE_ONLY_KEYS` are ignored here.

Every invalid value raises :class:`ConfigError` naming its key path (``tiers[1].capacity``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvtier.config.layers import NON_CONFIG_VARS, apply_env, env_layer, merge, plain, read_yaml, unknown_env
from kvtier.config.parse import (
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
    expand_path,
    has_password,
    join,
    parse_duration,
    parse_size,
    refuse_bare_duration,
    refuse_bare_size,
    suggest,
    unwrap,
)
from kvtier.config.tree import (
    ADMISSIONS,
    DURATION_FIELDS,
    EVICTION_POLICIES,
    MEMORY_KINDS,
    SAVE_TIMES,
    SIZE_FIELDS,
    WEIGHT_MODES,
    CpuTierConfig,
    DiskTierConfig,
    GpuTierConfig,
    KvtierConfig,
    NamespaceConfig,
    PolicyConfig,
    RedisTierConfig,
    SecurityConfig,
    TierConfig,
    TierKind,
    WritePolicy,
    config_to_dict,
)
from kvtier.errors import ConfigError
from kvtier.layout import GroupKind

__all__ = [  # the loader, and the tree's names (importable from here as before the tree had a module of its own)
    "DEFAULT_CONFIG",
    "ENGINE_ONLY_KEYS",
    "EVICTION_POLICIES",
    "MEMORY_KINDS",
    "WEIGHT_MODES",
    "CpuTierConfig",
    "DiskTierConfig",
    "GpuTierConfig",
    "KvtierConfig",
    "NamespaceConfig",
    "PolicyConfig",
    "RedisTierConfig",
    "SecurityConfig",
    "TierConfig",
    "TierKind",
    "WritePolicy",
    "bare_numbers",
    "build_config",
    "config_to_dict",
    "load_config",
]

logger = logging.getLogger(__name__)

SECTIONS = ("chunk_size", "namespace", "tiers", "policy", "placement", "save_partial_chunks", "security", "strict",
            "serve_without_prefix_caching")
ENGINE_ONLY_KEYS = frozenset({"config_file", "connectors", "load_failure_policy"})
"""Keys of an engine's extra-config dict that are not kvtier config: ``config_file`` (the file to load when no
source is given) and ``connectors`` (a MultiConnector's children)."""
ENV_RESERVED = NON_CONFIG_VARS  # KVTIER_* variables that are not config paths

DEFAULT_CONFIG: dict[str, Any] = {
    "tiers": [{"name": "cpu", "kind": "cpu", "capacity": "2GiB"},
              {"name": "disk", "kind": "disk", "capacity": "8GiB"}],
}
"""The embedded default (same as configs/default.yaml): used when no file is named anywhere."""

TIER_CLASSES: dict[TierKind, type[TierConfig]] = {
    TierKind.GPU: GpuTierConfig, TierKind.CPU: CpuTierConfig,
    TierKind.DISK: DiskTierConfig, TierKind.REDIS: RedisTierConfig,
}
COMPRESSIONS = ("none", "lz4", "zstd")
ZERO_OK = frozenset({"breaker_backoff", "shard_depth", "persist_after_idle", "persist_max_lag",
                     "persist_at_close"})
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
            data = apply_env(data, var, parts, value, written=_env_written)
        data = merge(data, {k: v for k, v in over.items() if k not in ENGINE_ONLY_KEYS})
        cfg = build_config(data, env)
        for line in unknown_env(env, SECTIONS, filter(None, [cfg.security.hmac_key_env])):
            logger.warning("%s", line)
        return cfg
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
        return written_numbers(read_yaml(source))
    raise ConfigError("", f"config source must be a file path or a mapping, got {type(source).__name__}")


def _unit_numbers(data: Mapping[str, Any]) -> list[tuple[dict[str, Any], str, str]]:
    """(section, key, key path) of each size or duration in ``policy`` and the tiers written as a number (0 aside,
    a duration's off). Anything of another shape is left to the validation that names it."""
    sections = [("policy", data.get("policy"))]
    if isinstance(data.get("tiers"), list):
        sections += [(f"tiers[{i}]", t) for i, t in enumerate(data["tiers"])]
    return [(section, k, f"{path}.{k}") for path, section in sections if isinstance(section, dict)
            for k, v in section.items() if k in SIZE_FIELDS | DURATION_FIELDS
            and isinstance(v, int | float) and not isinstance(v, bool) and v != 0]


def written_numbers(data: dict[str, Any]) -> dict[str, Any]:
    """A YAML file's data with the numbers of its sizes and durations as the text they were written as, so that a
    bare one is refused like a ``KVTIER_*`` variable's (``refuse_bare_size``, ``refuse_bare_duration``)."""
    data = dict(data)  # copies of the sections it may change (a deep copy would follow YAML's recursive aliases)
    if isinstance(data.get("policy"), dict):
        data["policy"] = dict(data["policy"])
    if isinstance(data.get("tiers"), list):
        data["tiers"] = [dict(t) if isinstance(t, dict) else t for t in data["tiers"]]
    for section, key, _ in _unit_numbers(data):
        section[key] = str(section[key])
    return data


def _env_written(parts: list[str], tree: Any) -> Any:
    """A ``KVTIER_*`` variable's YAML mapping or list (``KVTIER_POLICY='{...}'``, ``KVTIER_TIERS='[...]'``) with
    its sizes and durations as text, so that a bare number is refused as in a YAML file."""
    if parts in (["policy"], ["tiers"]):
        return written_numbers({parts[0]: tree})[parts[0]]
    return tree


def bare_numbers(data: Mapping[str, Any]) -> list[str]:
    """One line per size or duration of a mapping written as a number: read as bytes or seconds (an engine's
    ``kv_connector_extra_config`` warns of them, where a YAML file refuses them)."""
    return [f"{path}: {section[key]} has no unit: read as {'bytes' if key in SIZE_FIELDS else 'seconds'} (write "
            f"{section[key]}{'B' if key in SIZE_FIELDS else 's'}, or another unit)"
            for section, key, path in _unit_numbers(data)]


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
        refuse_bare_size(value, path)
        size = parse_size(value, path)
        if size <= 0:
            raise ConfigError(path, f"must be positive, got {size}", "e.g. 2GiB")
        return size
    if name in DURATION_FIELDS:
        refuse_bare_duration(value, path)
        seconds = parse_duration(value, path)
        if seconds <= 0 and name not in ZERO_OK:
            raise ConfigError(path, "must be positive", "use null for none" if "None" in annotation else None)
        return seconds
    if name in PATH_FIELDS:
        return expand_path(value, path, env)
    if name == "eviction":
        return choice(value, path, EVICTION_POLICIES, "eviction policy")
    if name == "weights":
        return choice(value, path, WEIGHT_MODES, "weights fingerprint mode")
    if name == "admission":
        return choice(value, path, ADMISSIONS, "save admission")
    if name == "save_at":
        return choice(value, path, SAVE_TIMES, "time to save")
    if name == "admission_min_reuse":
        share = as_float(value, path)
        if not 0 <= share <= 1:
            raise ConfigError(path, f"must be between 0 and 1, got {share}", "e.g. 0.1: one reuse per ten chunks")
        return share
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
        if isinstance(raw.get("url"), str) and has_password(raw["url"]):  # from a file or overrides, not the env
            logger.warning("%s: the URL holds a password, kept in the config for anyone who can read it: drop it "
                           "from the URL and set $%s", join(path, "url"), kwargs.get("password_env",
                                                                                  RedisTierConfig.password_env))
        is_cluster = check_redis_url(kwargs.get("url", RedisTierConfig.url), join(path, "url"))
        if is_cluster and kwargs.get("cluster") is False:
            raise ConfigError(join(path, "cluster"), "false, but the URL is redis+cluster://", "remove 'cluster'")
        kwargs["cluster"] = kwargs.get("cluster", False) or is_cluster
    return cls(**kwargs)


def _redis_aliases(raw: dict[str, Any], path: str) -> dict[str, Any]:
    """``password`` is refused (secrets stay out of files); ``timeout_ms: 50`` means ``timeout: 50ms``."""
    if "password" in raw:
        raise ConfigError(join(path, "password"), "passwords do not belong in the config file",
                          "set $KVTIER_REDIS_PASSWORD (or the variable named by password_env)")
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
