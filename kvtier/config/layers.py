"""The layers of a config and their merge (helpers of :mod:`kvtier.config`): the YAML file, the ``KVTIER_*``
environment layer (tiers addressed by name), the deep merge of layers (tiers merged by name), and plain copies of
mappings and section dataclasses.

Every helper that reads a value takes its key path and raises :class:`ConfigError` naming that path.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from kvtier.config.parse import EnvScalar, as_list, as_mapping, join, suggest, type_name, unwrap
from kvtier.errors import ConfigError

ENV_PREFIX = "KVTIER_"
NON_CONFIG_VARS = frozenset({
    "KVTIER_CONFIG", "KVTIER_CACHE_DIR", "KVTIER_REDIS_PASSWORD",  # read by the config loader and the tiers
    "KVTIER_BENCH_DIR",  # kvtier bench fingerprint: where its temporary files go
    "KVTIER_VLLM_LOCK", "KVTIER_TORCH", "KVTIER_TORCH_INDEX",  # scripts/bootstrap.sh
    "KVTIER_FULL", "KVTIER_SKIP_E2E", "KVTIER_REQUIRE_ALL",  # scripts/test.sh
    "KVTIER_E2E", "KVTIER_E2E_COUNTS", "KVTIER_E2E_DISK_DELAY_S",  # the end-to-end tests
})
"""The project's own ``KVTIER_*`` variables that are not config paths (the one list of them): the loader neither
reads them as config nor warns about them. The variable a config names in ``security.hmac_key_env`` is exempt too."""


def plain(value: Any) -> Any:
    """Deep copy of mappings and lists into dicts and lists (leaves scalars)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def plain_fields(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, leaving out None values and turning enums into their values."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if value is not None:
            out[f.name] = value.value if isinstance(value, Enum) else value
    return out


def read_yaml(file: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML config file into a dict; every failure is a ConfigError naming the file."""
    name = os.fspath(file)
    try:
        text = Path(name).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"config file {name!r} not found") from None
    except (OSError, ValueError) as exc:  # ValueError: undecodable text, or a NUL byte in the path
        raise ConfigError("", f"cannot read config file {name!r}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{name}: invalid YAML: {yaml_problem(exc)}") from None
    except RecursionError:
        raise ConfigError("", f"{name}: YAML nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"{name}: the top level must be a mapping, got {type_name(data)}")
    return data


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong, at which line and column (PyYAML's own text spans several lines
    and names the stream, not the file)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}" + (f" ({context})" if context else "")


def merge(base: dict[str, Any], over: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """Deep-merge ``over`` into a copy of ``base``; the ``tiers`` lists merge by tier name."""
    out = dict(base)
    for key, value in over.items():
        sub = join(path, str(key))
        if key == "tiers" and not path and key in out and isinstance(unwrap(value), list | tuple):
            out[key] = merge_tiers(out[key], unwrap(value))
        elif isinstance(out.get(key), Mapping) and isinstance(value, Mapping):
            out[key] = merge(dict(out[key]), value, sub)
        else:
            out[key] = plain(value)
    return out


def merge_tiers(base: Any, over: list[Any] | tuple[Any, ...]) -> list[Any]:
    """Tiers of ``over`` update the tier of ``base`` with the same name, or are appended."""
    tiers = as_list(base, "tiers")
    for i, tier in enumerate(over):
        entry = as_mapping(tier, f"tiers[{i}]")
        name = entry.get("name")
        if not isinstance(name, str):
            raise ConfigError(f"tiers[{i}].name", "every tier given as an override needs a name",
                              "tiers are merged by name")
        for j, old in enumerate(tiers):
            if isinstance(old, Mapping) and old.get("name") == name:
                tiers[j] = merge(dict(old), entry, f"tiers[{j}]")
                break
        else:
            tiers.append(plain(entry))
    return tiers


def env_layer(env: Mapping[str, str], sections: Iterable[str],
              skip: Iterable[str] = ()) -> list[tuple[str, list[str], EnvScalar]]:
    """``KVTIER_A__B=v`` variables whose first part is a config section: (var, [a, b], value), sorted."""
    sections, skip = set(sections), set(skip)
    out = []
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in skip:
            continue
        parts = [p.lower() for p in var[len(ENV_PREFIX):].split("__")]
        if parts[0] in sections:
            out.append((var, parts, EnvScalar(var, env[var])))
    return out


def unknown_env(env: Mapping[str, str], sections: Iterable[str], exempt: Iterable[str] = ()) -> list[str]:
    """One line per ``KVTIER_*`` variable that is neither a config path nor in :data:`NON_CONFIG_VARS` (nor
    ``exempt``): it is ignored, so say so, with a did-you-mean when a section or a known variable is close."""
    sections, known = sorted(sections), NON_CONFIG_VARS | set(exempt)
    lines = []
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in known:
            continue
        first, sep, rest = var[len(ENV_PREFIX):].partition("__")
        if first.lower() in sections:
            continue
        close = difflib.get_close_matches(first.lower(), sections, n=1, cutoff=0.6)
        names = [f"{ENV_PREFIX}{close[0].upper()}{sep}{rest}"] if close else []
        names += difflib.get_close_matches(var, sorted(known), n=1, cutoff=0.8)
        hint = f"did you mean {names[0]}?" if names else \
            "config variables are KVTIER_<SECTION>[__<KEY>...], e.g. KVTIER_POLICY__EVICTION"
        lines.append(f"{var} is not a kvtier setting and is ignored ({hint})")
    return lines


def apply_env(data: dict[str, Any], var: str, parts: list[str], value: EnvScalar,
              written: Callable[[list[str], Any], Any] = lambda _parts, tree: tree) -> dict[str, Any]:
    """Set one env variable's value into ``data``; ``tiers`` are addressed by (case-insensitive) name. A value that
    is a YAML mapping or list goes in as ``written(parts, tree)`` returns it."""
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = _tier_by_name(node, part, var)
        else:
            if part not in node or node[part] is None:
                node[part] = [] if (depth, part) == (0, "tiers") else {}
            node = node[part]
            if not isinstance(node, dict | list):
                raise ConfigError(".".join(parts[: depth + 1]), f"{var} sets a key inside a {type_name(node)}")
    if isinstance(node, list):
        raise ConfigError(".".join(parts), f"{var} must name a key inside a tier",
                          "e.g. KVTIER_TIERS__CPU__CAPACITY=4GiB")
    parsed = value.parsed
    node[parts[-1]] = written(parts, plain(parsed)) if isinstance(parsed, Mapping | list) else value
    return data


def _tier_by_name(tiers: list[Any], name: str, var: str) -> dict[str, Any]:
    names = []
    for tier in tiers:
        if isinstance(tier, dict) and isinstance(tier.get("name"), str):
            names.append(tier["name"])
            if tier["name"].lower().replace("-", "_") == name:
                return tier
    raise ConfigError("tiers", f"{var}: no tier named {name!r}", suggest(name, [n.lower() for n in names]))
